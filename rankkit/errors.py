"""The one exception type users see: a clear, one-line message that names the fix."""


class RankkitError(Exception):
    """Bad input or an unmet precondition. The CLI prints it on one line and exits with status 2."""


class Interrupted(Exception):
    """SIGINT or SIGTERM stopped a command; the message says what finished work was kept.

    The CLI prints it on one line and exits with status 130, as a shell does for Ctrl-C.
    """
