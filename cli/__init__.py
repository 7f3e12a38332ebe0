"""Command line: thin wrappers that parse, call one library function and print.

Each command module registers on ``app`` when imported. Usage errors are typer's own
(exit 2); a RankkitError from the library becomes one line on stderr and exit 2.
"""

import sys

from rankkit.errors import RankkitError


def main() -> None:
    from rankkit.cli import commands  # noqa: F401  (registers every command)
    from rankkit.cli.app import app

    try:
        app()
    except RankkitError as error:
        print(f"rankkit: error: {error}", file=sys.stderr)
        sys.exit(2)
