"""`rankkit models`: the converted models in the cache, and where the default model lives."""

from dataclasses import asdict

import typer
from rich.table import Table
from rich.text import Text

from rankkit.cli.app import app, output
from rankkit.cli.options import Format, output_format


@app.command("models")
def models_list(
    as_json: bool = typer.Option(False, "--json", help="Print the folders as JSON (--format json)."),
    table_format: Format = "table",
) -> None:
    """List the converted model folders in $RANKKIT_CACHE with their weights hash and size."""
    from rankkit import model_cache
    from rankkit.tables import rows_text

    shown_as = output_format(table_format, as_json)
    default = model_cache.default_model_target()
    found = model_cache.cached_models()
    if shown_as != "table":
        rows = [
            asdict(entry) | {"folder": str(entry.folder), "default": entry.folder == default}
            for entry in found
        ]
        typer.echo(rows_text(rows, shown_as, whole={"default_model": str(default), "models": rows}))
        return
    table = Table(title=Text(f"Converted models in {model_cache.cache_root() / 'models'}"))
    for header in ("folder", "weights sha256", "MiB", "source"):
        table.add_column(header, justify="right" if header == "MiB" else "left", overflow="fold")
    for entry in found:
        table.add_row(
            Text(entry.folder.name),
            entry.weights_hash[:12],
            f"{entry.size_bytes / 2**20:,.1f}",
            Text(entry.source or "-"),
        )
    console = output()
    console.print(table)
    state = "converted" if default in [entry.folder for entry in found] else "converted on its first use"
    console.print(Text(f"default model: {default} ({state})"))
