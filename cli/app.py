"""The typer application every command module registers itself on, and the console results print on."""

import inspect
import sys
import typing
from pathlib import Path

import typer
from rich.console import Console

from rankkit import __version__
from rankkit.checks import first_repeated

# Where stdout is a log or a pipe, rich would fit tables to 80 columns (or to the terminal the
# command was started from) by cutting cells ("meth…"); there no width limits a line instead.
UNLIMITED_WIDTH = 100_000


def output() -> Console:
    """The console a command prints its results on: the terminal's width, or unlimited off a terminal,
    so no cell of a table is ever wrapped or cut in a log. The warnings held so far print first."""
    from rankkit.cli import release_warnings

    release_warnings()
    return Console() if sys.stdout.isatty() else Console(width=UNLIMITED_WIDTH)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"rankkit {__version__}")
        raise typer.Exit()


app = typer.Typer(
    name="rankkit",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_show_version, is_eager=True, help="Print rankkit's version and exit."
    ),
) -> None:
    """Rank tokens layer by layer, compare against the answer-informed oracle, and run the selection end to end."""


def command():
    """The click command ``rankkit`` runs: the app with no type tag ("<str>", "<bool>") in any option's
    help line (each option's help says what it takes), and each command listed by its summary as one
    paragraph (typer keeps a docstring's line breaks there)."""
    import typer.main

    root = typer.main.get_command(app)
    pending = [root]
    while pending:
        current = pending.pop()
        if current is not root and current.help and not current.short_help:
            current.short_help = " ".join(inspect.cleandoc(current.help).split("\n\n")[0].split())
        # click builds a command's help option once and keeps it, so its tag is blanked here too
        for param in [*current.params, current.get_help_option(current.context_class(current))]:
            if isinstance(param, typer.core.TyperOption):
                param.metavar = ""
            if isinstance(param, typer.core._TyperParameter) and _takes_paths(param.type_descriptor.annotation):
                _refuse_empty_path(param)
        if not hasattr(current, "commands"):
            _refuse_repeated_options(current)
        pending.extend(getattr(current, "commands", {}).values())
    return root


def click_errors():
    """The exceptions module of the click typer runs on (its own copy since typer 0.25)."""
    return sys.modules[typer.BadParameter.__module__]


def _takes_paths(annotation) -> bool:
    """Whether a parameter of type ``annotation`` (``Path``, ``list[Path]``) takes paths."""
    return Path in (annotation, *typing.get_args(annotation))


def _refuse_empty_path(param) -> None:
    """Make the path parameter ``param`` refuse an empty value: '' reads as '.', so `--out "$OUT"` with
    OUT unset wrote a demo's files into the current folder, or a refusal named '.', never typed."""
    process_value = param.process_value

    def refusing_empty(ctx, value):
        given = value if isinstance(value, tuple | list) else [value]
        empty = next((each for each in given if isinstance(each, str) and not each.strip()), None)
        if empty is not None:
            raise click_errors().BadParameter(f"{empty!r} names no path; give one", ctx=ctx, param=param)
        return process_value(ctx, value)

    param.process_value = refusing_empty


def _refuse_repeated_options(command) -> None:
    """Make ``command`` refuse a single-valued option given twice (``--keep 0.1 --keep 0.3``), whose last
    value click would take silently; an option that takes a list (``dashboard --bench``) may repeat. The
    parser lists an option once per time it is given."""
    make_parser = command.make_parser

    def refusing_parser(ctx):
        parser = make_parser(ctx)
        parse = parser.parse_args

        def parse_args(args):
            opts, rest, order = parse(args=args)
            given = [param for param in order if isinstance(param, typer.core.TyperOption) and not param.multiple]
            twice = first_repeated(given)
            if twice is not None:
                raise click_errors().UsageError(f"{twice.opts[0]} is given twice; give it once", ctx=ctx)
            return opts, rest, order

        parser.parse_args = parse_args
        return parser

    command.make_parser = refusing_parser


def say_if_timing_only(timing_only: bool) -> None:
    """The line under a table whose model had random weights."""
    from rankkit.checks import TIMING_ONLY

    if timing_only:
        output().print(f"[bold]{TIMING_ONLY}[/bold]")
