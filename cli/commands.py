"""Imports every command module so each registers on the app."""

from rankkit.cli import run_cmd  # noqa: F401
from rankkit.cli import store_cmd  # noqa: F401
from rankkit.cli import overhead_cmd  # noqa: F401
from rankkit.cli import data_cmd  # noqa: F401
from rankkit.cli import compare_cmd  # noqa: F401
from rankkit.cli import capture_cmd  # noqa: F401
from rankkit.cli import prefill_cmd  # noqa: F401
from rankkit.cli import dashboard_cmd  # noqa: F401
from rankkit.cli import diffusion_cmd  # noqa: F401
