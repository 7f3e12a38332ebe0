"""The one exception type users see: a clear, one-line message that names the fix; and the one
way to say that a run went on without something."""

import sys


class RankkitError(Exception):
    """Bad input or an unmet precondition. The CLI prints it on one line and exits with status 2."""


def warn(message: str) -> None:
    """One line on stderr for what a command leaves out and carries on without, never a silent drop."""
    print(f"warning: {message}", file=sys.stderr)
