"""`rankkit diffusion`: SlimInfer's information-diffusion probe (Sec. 3.1, Fig. 2), layer by layer."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from rankkit.cli.app import app


@app.command("diffusion")
def diffusion(
    data: str = typer.Option(..., "--data", help="Data spec with evidence spans, e.g. niah:n=4,length=1024."),
    model: str = typer.Option("default", help="'default', an HF folder, or a hub id."),
    limit: int = typer.Option(None, min=1, help="Probe at most this many examples."),
    max_new_tokens: int = typer.Option(16, min=1, help="Greedy answer length limit."),
    out: Path | None = typer.Option(
        None, "--out", help="Write the per-example, per-layer frame to this parquet file."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the table's rows as a JSON list instead."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
) -> None:
    """Remove the evidence tokens from layer l on, for every l: is the answer still right, and where was it read?"""
    from rankkit.eval.diffusion import diffusion_probe, layer_summary
    from rankkit.report.tables import frame_table

    status = Console(stderr=True)
    frame = diffusion_probe(
        data,
        model=model,
        limit=limit,
        device=device,
        max_new_tokens=max_new_tokens,
        progress=lambda example: status.print(f"probed {example.id}"),
    )
    if out is not None:
        frame.write_parquet(out)
        typer.echo(f"wrote {out}", err=True)
    summary = layer_summary(frame)
    if as_json:
        typer.echo(json.dumps(summary.to_dicts(), indent=2))
        return
    Console().print(frame_table(summary, f"Evidence removed from layer l on, {data}"))
