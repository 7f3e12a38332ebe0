"""`rankkit diffusion`: SlimInfer's information-diffusion probe (Sec. 3.1, Fig. 2), layer by layer."""

from __future__ import annotations

from pathlib import Path

import typer

from rankkit import defaults
from rankkit.cli.app import app, output
from rankkit.cli.options import AllowOverlength, Device, Format, Model, Overwrite, Threads, output_format
from rankkit.cli.progress import progress_bar


@app.command("diffusion")
def diffusion(
    data: str = typer.Option(..., "--data", help="Data spec with evidence spans, e.g. niah:n=4,length=1024."),
    model: Model = defaults.MODEL,
    limit: int = typer.Option(None, min=1, help="Probe at most this many examples."),
    max_new_tokens: int | None = typer.Option(
        None,
        "--max-new-tokens",
        min=1,
        help="Greedy answer length limit; an unpruned answer it cuts short of full marks is warned of, and "
        "every layer scores it wrong (its log-probabilities and attention stand). (default: each example's "
        f"reference answer in tokens plus {defaults.MAX_NEW_TOKENS}, and such a cut is refused)",
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Write the per-example, per-layer frame to this parquet file (refused if it exists). Finished "
        "examples are kept beside it as they finish: after Ctrl-C (or SIGTERM) the same command resumes.",
    ),
    overwrite: Overwrite = False,
    allow_overlength: AllowOverlength = False,
    as_json: bool = typer.Option(
        False, "--json", help="Print the table's rows as a JSON list instead (--format json)."
    ),
    table_format: Format = "table",
    device: Device = defaults.DEVICE,
    threads: Threads = None,
) -> None:
    """Remove the evidence tokens from layer l on, for every l: is the answer still right, and where was it read?

    Ctrl-C or SIGTERM keeps every finished example (with --out) and exits 130.
    """
    from rankkit.eval.diffusion import diffusion_probe, layer_summary
    from rankkit.tables import frame_table, rows_text

    shown_as = output_format(table_format, as_json)
    with progress_bar("diffusion") as show:
        frame = diffusion_probe(
            data,
            model=model,
            limit=limit,
            device=device,
            max_new_tokens=max_new_tokens,
            out=out,
            overwrite=overwrite,
            allow_overlength=allow_overlength,
            progress=show,
            threads=threads,
        )
    if out is not None:
        typer.echo(f"wrote {out}", err=True)
    summary = layer_summary(frame)
    if shown_as != "table":
        typer.echo(rows_text(summary.to_dicts(), shown_as))
        return
    output().print(frame_table(summary, f"Evidence removed from layer l on, {data}"))
