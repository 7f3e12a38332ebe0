"""`rankkit demo` and `rankkit generate`: the quickest way to see the runner answer."""

from __future__ import annotations

from pathlib import Path

import typer

from rankkit import defaults
from rankkit.cli.app import app, output
from rankkit.cli.options import AsJson, Device, Format, MaxNewTokens, Model, Threads, output_format


@app.command()
def demo(
    out: Path = typer.Option(Path("runs/demo"), help="Folder for everything the demo writes."),
    device: Device = defaults.DEVICE,
) -> None:
    """Run the main job on the embedded default model and print where its output is."""
    from rankkit.demo import run_demo

    console = output()
    written = run_demo(out, device=device, console=console)
    console.print(f"\n[bold]demo output:[/bold] {out}")
    for name, path in written.items():
        console.print(f"  {name:10} {path}")


@app.command()
def generate(
    question: str = typer.Option("", "--question", help="The question after the context."),
    context_file: Path = typer.Option(
        None, "--context-file", exists=True, dir_okay=False, help="Context text file."
    ),
    data: str = typer.Option(
        None, "--data", help="Answer the first example of a data spec instead, e.g. niah:length=1024."
    ),
    model: Model = defaults.MODEL,
    max_new_tokens: MaxNewTokens = defaults.MAX_NEW_TOKENS,
    device: Device = defaults.DEVICE,
    threads: Threads = None,
    as_json: AsJson = False,
    table_format: Format = "table",
) -> None:
    """Greedy answer through the layer-by-layer runner (full prefill); --format csv or json adds what it ran on."""
    from rankkit.demo import answer
    from rankkit.tables import rows_text

    shown_as = output_format(table_format, as_json)

    result = answer(
        model,
        "",
        question,
        data=data,
        context_file=context_file,
        max_new_tokens=max_new_tokens,
        device=device,
        threads=threads,
    )
    if shown_as == "table":
        output().print(result["answer"])
    else:
        typer.echo(rows_text([result], shown_as, whole=result))
