"""Imports every command module so each registers on the app."""

from rankkit.cli import run_cmd  # noqa: F401
