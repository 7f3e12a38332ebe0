"""The one exception type users see: a clear, one-line message that names the fix."""


class RankkitError(Exception):
    """Bad input or an unmet precondition. The CLI prints it on one line and exits with status 2."""
