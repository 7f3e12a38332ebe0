"""`rankkit data export SPEC --out FILE`: write any data spec as JSONL, to rerun or share it."""

from pathlib import Path

import typer

from rankkit.cli.app import app
from rankkit.cli.options import AllowOverlength, Overwrite

data_app = typer.Typer(
    name="data", help="Datasets: needle in a haystack, RULER, JSONL.", no_args_is_help=True
)
app.add_typer(data_app, name="data")


@data_app.command("export")
def export(
    spec: str = typer.Argument(
        ...,
        help="niah:length=N,n=K[,depths=10;50;90][,seed=S] | ruler:task=NAME,length=N[,n=K] | PATH.jsonl[:n=K]",
    ),
    out: Path = typer.Option(..., "--out", help="JSONL file to write (refused if it exists)."),
    overwrite: Overwrite = False,
    model: str = typer.Option(
        "default",
        help="Whose tokenizer measures lengths, and whose positions the prompts must fit: 'default', an HF "
        "folder, or a hub id.",
    ),
    allow_overlength: AllowOverlength = False,
) -> None:
    """Write the examples of SPEC to a JSONL file; loading that file gives the same examples."""
    from rankkit.data import export_spec
    from rankkit.models import load_config, load_tokenizer

    count = export_spec(
        spec,
        load_tokenizer(model),
        out,
        overwrite=overwrite,
        config=load_config(model),
        allow_overlength=allow_overlength,
    )
    typer.echo(f"wrote {count} example{'' if count == 1 else 's'} to {out}")
