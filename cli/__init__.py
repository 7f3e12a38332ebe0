"""Command line: thin wrappers that parse, call one library function and print.

Each command module registers on ``app`` when imported. A usage error (an unknown option, a
value out of an option's range) and a RankkitError from the library each become one line on
stderr and exit 2; an interrupt (SIGINT, SIGTERM) one line saying what finished work was kept,
and exit 130. Warnings wait until the command starts its work or prints (``release_warnings``),
so that a refusal is one line: a warning before it concerned a run that did not happen.
"""

import sys
import warnings

from rankkit.errors import Interrupted, RankkitError
from rankkit.interrupts import ignore_interrupts, interrupt_on_sigterm

# the status of an interrupted command, as a shell reports Ctrl-C; typer returns it too, silently, for a
# KeyboardInterrupt that reaches it
INTERRUPTED_STATUS = 130
# every file rankkit writes is written whole or not at all, so an interrupt between writes loses none
INTERRUPTED_OUTSIDE_WORK = "interrupted; every file written so far is whole"

# the warnings of a command that has neither started its work nor printed; None once either happened
_held_warnings: list[str] | None = None
# every warning the command has given: one that comes again (a keep rate's pass over the same
# examples) says nothing new, and Python's own once-per-place rule is reset whenever any
# library changes the warning filters
_given_warnings: set[str] = set()


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    text = f"rankkit: warning: {message}"
    if text in _given_warnings:
        return
    _given_warnings.add(text)
    if _held_warnings is None:
        print(text, file=sys.stderr)
    else:
        _held_warnings.append(text)


def release_warnings() -> None:
    """Print the warnings held so far, and every later one as it comes: the command has started its
    work (a progress event) or prints its results, so they concern what it does."""
    global _held_warnings
    held, _held_warnings = _held_warnings or [], None
    for text in held:
        print(text, file=sys.stderr)


def route_warnings() -> None:
    """Warnings as one ``rankkit: warning:`` line each, only those that concern the user, held until
    ``release_warnings``."""
    global _held_warnings
    _held_warnings = []
    _given_warnings.clear()
    warnings.showwarning = _one_line_warning
    # An interrupt during a store write abandons zarr's pending writes; the example stays
    # unflagged (and is redone on resume), so Python's note about them says nothing useful.
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
    # rankkit warns with UserWarning only; deprecation notices come from the libraries under it
    # (transformers' about its own keyword arguments) and tell a user of rankkit nothing to do.
    for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category)


def _usage_error(error) -> str:
    """A click usage error as one line naming where the fix is (typer draws it as a boxed panel)."""
    message = " ".join(error.format_message().split()).rstrip(".")
    where = f"; see '{error.ctx.command_path} --help'" if error.ctx is not None else ""
    return f"rankkit: error: {message[:1].lower()}{message[1:]}{where}"


def _invoke(root) -> int:
    """Run the click command ``root`` on the command line; its exit status. Not standalone, so click's
    usage errors come here instead of typer's panels."""
    import typer

    from rankkit.cli.app import click_errors

    usage = click_errors()
    try:
        status = root.main(prog_name="rankkit", standalone_mode=False)
    except usage.NoArgsIsHelpError as error:  # `rankkit`, `rankkit data`: their help
        from typer import rich_utils

        rich_utils.rich_format_error(error)
        return error.exit_code
    except usage.UsageError as error:
        print(_usage_error(error), file=sys.stderr)
        return 2
    except typer.Abort:  # end of input where a command read it
        print("rankkit: aborted", file=sys.stderr)
        return 1
    if status == INTERRUPTED_STATUS:  # a Ctrl-C outside the library's interruptible work (while results print)
        raise Interrupted(INTERRUPTED_OUTSIDE_WORK)
    return status if isinstance(status, int) else 0


def main() -> None:
    interrupt_on_sigterm()  # every command, not only the library's interruptible work
    try:
        from rankkit.cli import commands  # noqa: F401  (registers every command)
        from rankkit.cli.app import command

        route_warnings()
        status = _invoke(command())
        if status == 0:  # else a usage error or an abort: its line is what to fix first
            release_warnings()
    except RankkitError as error:
        print(f"rankkit: error: {error}", file=sys.stderr)
        status = 2
    except Interrupted as interrupted:
        release_warnings()
        print(f"rankkit: {interrupted}", file=sys.stderr)
        status = INTERRUPTED_STATUS
    except KeyboardInterrupt:  # while the command line itself loads: no command has started
        print("rankkit: interrupted before the command started; nothing written", file=sys.stderr)
        status = INTERRUPTED_STATUS
    # The command's last line is out and its status is set. Ctrl-C while the interpreter ends (the pool's
    # finalizers, torch's teardown: a second or more) printed a traceback or, once Python had restored
    # the default handler, killed a finished run silently with status 130.
    ignore_interrupts()
    sys.exit(status)
