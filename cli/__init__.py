"""Command line: thin wrappers that parse, call one library function and print.

Each command module registers on ``app`` when imported. Usage errors are typer's own
(exit 2); a RankkitError from the library becomes one line on stderr and exit 2; an
interrupt (SIGINT, SIGTERM) one line saying what finished work was kept, and exit 130.
"""

import sys
import warnings

from rankkit.errors import Interrupted, RankkitError


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"rankkit: warning: {message}", file=sys.stderr)


def route_warnings() -> None:
    """Warnings as one ``rankkit: warning:`` line each, only those that concern the user."""
    warnings.showwarning = _one_line_warning
    # An interrupt during a store write abandons zarr's pending writes; the example stays
    # unflagged (and is redone on resume), so Python's note about them says nothing useful.
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
    # rankkit warns with UserWarning only; deprecation notices come from the libraries under it
    # (transformers' about its own keyword arguments) and tell a user of rankkit nothing to do.
    for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category)


def main() -> None:
    try:
        from rankkit.cli import commands  # noqa: F401  (registers every command)
        from rankkit.cli.app import command

        route_warnings()
        command()(prog_name="rankkit")
    except RankkitError as error:
        print(f"rankkit: error: {error}", file=sys.stderr)
        sys.exit(2)
    except Interrupted as interrupted:
        print(f"rankkit: {interrupted}", file=sys.stderr)
        sys.exit(130)
    except KeyboardInterrupt:  # while the command line itself loads: no command has started
        print("rankkit: interrupted before the command started; nothing written", file=sys.stderr)
        sys.exit(130)
