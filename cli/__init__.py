"""Command line: thin wrappers that parse, call one library function and print.

Each command module registers on ``app`` when imported; ``main`` turns a
RankkitError into a one-line message and exit status 2.
"""

import sys

from rankkit.errors import RankkitError


def main() -> None:
    from rankkit.cli import commands  # noqa: F401  (registers every command)
    from rankkit.cli.app import app

    try:
        app(standalone_mode=False)
    except RankkitError as error:
        print(f"rankkit: error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("rankkit: interrupted", file=sys.stderr)
        sys.exit(130)
    except SystemExit:
        raise
    except Exception as error:  # click's usage errors arrive here with standalone_mode=False
        import click

        if isinstance(error, click.exceptions.ClickException):
            error.show()
            sys.exit(2)
        if isinstance(error, click.exceptions.Abort):
            sys.exit(130)
        raise
