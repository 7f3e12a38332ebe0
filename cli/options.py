"""Option types several commands share, declared once (typer ``Annotated`` aliases), and the
one list convention: every multi-value option is a comma-separated string (``--methods claa,fastkv``).

Commands take their defaults from ``rankkit.defaults``, where the library reads them too.
"""

from __future__ import annotations

from typing import Annotated

import typer

from rankkit.errors import RankkitError
from rankkit.shapes import PUBLISHED_SHAPES
from rankkit.values import int_or_float, read_number

OVERWRITE_HELP = (
    "Replace an existing --out (written atomically: a reader sees the old file or the new one, never half)."
)
LAYER_HELP = (
    "Selection layer: CLAA l_p, FastKV TSP, GemFilter r, the oracle's l_p (default: 15 of 32 scaled; "
    "on models with sliding-window layers, the nearest full-attention layer, ties to the earlier); "
    "checked against the model's depth. A layer given here is used as is, even a sliding-window one, "
    "which cannot see keys older than its window."
)
# The built-in methods that rank a store's scores (all but full), as compare and select list them:
# written out, as the help is printed without importing the methods (torch); a test holds it to
# the registry.
OFFLINE_METHODS = (
    "gemfilter, fastkv, claa, asl, asl-2pass, snapkv, pyramidkv, adakv, sage-kv, lava, tova, streamingllm, "
    "sliminfer, specprefill, oracle"
)
DRAFT_SPEC = (
    "layers:N (the target's first N layers, norm and LM head) or a model spec with the target's tokenizer"
)
DRAFT_HELP = f"SpecPrefill's draft: {DRAFT_SPEC}. Default: layers:⌈L/4⌉."

Overwrite = Annotated[bool, typer.Option("--overwrite", help=OVERWRITE_HELP)]
Model = Annotated[
    str,
    typer.Option(
        "--model",
        help="'default', an HF folder, a hub id, or random:<shape> (a published architecture with random "
        f"weights, timing only: {', '.join(PUBLISHED_SHAPES)}).",
    ),
]
Device = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")]
DeviceMap = Annotated[
    str | None,
    typer.Option(
        "--device-map",
        help="Spread a model too large for one GPU: auto (accelerate's placement), balanced, "
        'sequential, or a JSON file of module -> device, e.g. {"model.layers.0": 0, ...}.',
    ),
]
Threads = Annotated[
    int | None, typer.Option("--threads", min=1, help="torch CPU threads (1 is steadier on a busy machine).")
]
Layer = Annotated[int | None, typer.Option("--layer", help=LAYER_HELP)]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", min=1, help="Greedy answer length limit.")]
Draft = Annotated[str | None, typer.Option("--draft", help=DRAFT_HELP)]
NeedleKeep = Annotated[
    str | None,
    typer.Option(
        "--needle-keep",
        help="Keep rate (e.g. 0.1) or token count (a whole number, e.g. 2048) needle recall counts the "
        "evidence tokens in. (default: the keep rate or budget each comparison ranks under)",
    ),
]
Mirror = Annotated[
    str | None,
    typer.Option(
        "--mirror", help="The architecture the oracle mirrors: gemfilter, fastkv or claa. (default: fastkv)"
    ),
]
Warmup = Annotated[
    int,
    typer.Option(
        "--warmup",
        min=0,
        help="Untimed runs before the timed ones: give 1 or more when the times matter. On CPU the first "
        "measures peak memory; without one the peak memory column stays empty.",
    ),
]
Repeats = Annotated[
    int,
    typer.Option(
        "--repeats", min=1, help="Timed rounds over all methods; times are medians, ratios paired per round."
    ),
]
AllowOverlength = Annotated[
    bool,
    typer.Option(
        "--allow-overlength",
        help="Run prompts longer than the model's max_position_embeddings (with a warning).",
    ),
]
Workers = Annotated[
    int | None,
    typer.Option(
        "--workers", help="Processes sharing the examples; results do not depend on it. (default: CPU count)"
    ),
]
CudaGraphs = Annotated[
    bool,
    typer.Option(
        "--cuda-graphs",
        help="Decode over a static KV cache, replayed as CUDA graphs on CUDA (eagerly elsewhere): one per step, "
        "or one per stretch of layers where a method acts from the host between them (sliminfer's block swaps). "
        "The first run of each cache shape captures the graph: bench and prefill need --warmup 1 or more.",
    ),
]
CompileDecode = Annotated[
    bool,
    typer.Option(
        "--compile-decode",
        help="With --cuda-graphs: compile the static decode step with torch.compile before capturing it, "
        "fusing its small operators (the first step of each cache shape compiles, which takes minutes).",
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print the result as JSON (--format json).")]
Format = Annotated[
    str,
    typer.Option(
        "--format",
        help="table, csv or json. table (the default) is plain text that wraps no cell when stdout is "
        "not a terminal; csv is a header and one line per row with every value whole; json is what "
        "--json prints.",
    ),
]


def output_format(table_format: str, as_json: bool = False) -> str:
    """The format a command prints in: ``--format``, or json for ``--json`` (kept as its alias)."""
    from rankkit.tables import FORMATS

    if table_format not in FORMATS:
        raise RankkitError(f"--format {table_format!r}: give one of {', '.join(FORMATS)}")
    if as_json and table_format not in ("table", "json"):
        raise RankkitError(f"--json is --format json: give it or --format {table_format}, not both")
    return "json" if as_json else table_format


def keep_or_tokens(text: str | None, option: str) -> float | int | None:
    """A value that is a keep rate or a token count (``--needle-keep``), read as a sweep file's number
    and the Python API read it: a whole number (2048) is a token count, a decimal (0.1) a keep rate;
    the library checks its range (``Budget.parse``)."""
    if text is None:
        return None
    return read_number(text, int_or_float, option, "a keep rate or a token count; give e.g. 0.1 or 2048")
