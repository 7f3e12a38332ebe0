"""The typer application every command module registers itself on."""

import typer

app = typer.Typer(
    name="rankkit",
    help="Rank tokens layer by layer, compare against the answer-informed oracle, and run the selection end to end.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
