"""Option types several commands share, declared once (typer ``Annotated`` aliases)."""

from __future__ import annotations

from typing import Annotated

import typer

OVERWRITE_HELP = (
    "Replace an existing --out (written atomically: a reader sees the old file or the new one, never half)."
)

Overwrite = Annotated[bool, typer.Option("--overwrite", help=OVERWRITE_HELP)]
