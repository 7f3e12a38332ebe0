"""The typer application every command module registers itself on."""

import typer

app = typer.Typer(
    name="rankkit",
    help="Rank tokens layer by layer, compare against the answer-informed oracle, and run the selection end to end.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def use_threads(threads: int | None) -> None:
    """torch's CPU thread count for this process, when the user gave one (``--threads``)."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
