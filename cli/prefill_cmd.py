"""`rankkit prefill` (one method on one prompt, optionally beside another) and `rankkit bench` (the grid)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rankkit.cli.app import THREADS_HELP, app, use_threads
from rankkit.errors import RankkitError

console = Console()
status = Console(stderr=True)

JSON_KEYS = (
    "method",
    "keep",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "kv_bytes",
    "peak_mem_bytes",
    "ideal_ratio",
    "answer",
    "score",
)
LAYER_HELP = (
    "Selection layer: CLAA l_p, FastKV TSP, GemFilter r, the oracle's l_p (default: 15 of 32 scaled)."
)


def _budgets(keep: str | None, budget: str | None):
    from rankkit.methods import Budget

    if (keep is None) == (budget is None):
        raise RankkitError("give exactly one of --keep (e.g. 0.1) or --budget (e.g. 2048)")
    try:
        if keep is not None:
            return [Budget.from_keep(float(value)) for value in keep.split(",")]
        return [Budget.from_tokens(int(value)) for value in budget.split(",")]
    except ValueError as error:
        raise RankkitError(f"cannot read the budget list: {error}") from None


def _method(name: str, layer: int | None, draft_model: str, mirror: str, *, strict: bool = True):
    """The method ``name`` with the CLI's options; ``--layer`` goes to methods that have a selection layer.

    ``strict`` refuses ``--layer`` for a method without one (prefill); the bench grid skips those.
    """
    from rankkit.methods import Method, make

    params = {"specprefill": {"draft_model": draft_model}, "oracle": {"mirror": mirror}}.get(name, {})
    method = make(name, **params)
    has_layer = type(method).with_layer is not Method.with_layer
    if layer is None or name == "full" or not (has_layer or strict):
        return method
    return method.with_layer(layer)


def _load(model: str, device: str, threads: int | None):
    from rankkit import models
    from rankkit.runner import Runner

    use_threads(threads)
    loaded = models.load(model, device=device)
    return loaded, Runner(loaded.model)


def _megabytes(value) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f}"


def _number(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


@app.command()
def prefill(
    method: str = typer.Option(
        ..., help="A method name: full, gemfilter, fastkv, claa, asl, ... (see docs/methods.md)."
    ),
    keep: str = typer.Option(None, help="Keep rate in (0, 1], e.g. 0.1."),
    budget: str = typer.Option(None, help="Tokens to keep, e.g. 2048 (instead of --keep)."),
    layer: int = typer.Option(None, help=LAYER_HELP),
    model: str = typer.Option("default", help="'default', an HF folder, or a hub id."),
    data: str = typer.Option(
        None, help="A data spec (niah:length=4096, ruler:..., FILE.jsonl); uses --example."
    ),
    example_index: int = typer.Option(0, "--example", min=0, help="Which example of --data to run."),
    context_file: Path = typer.Option(
        None, exists=True, dir_okay=False, help="Context text (with --question)."
    ),
    question: str = typer.Option(None, help="The question after the context (with --context-file)."),
    max_new_tokens: int = typer.Option(32, min=1),
    compare: str = typer.Option(None, help="Run this method too (e.g. full) and print both and the ratios."),
    draft_model: str = typer.Option("default", help="SpecPrefill's draft model."),
    mirror: str = typer.Option(
        "fastkv", help="The architecture the oracle mirrors: gemfilter, fastkv or claa."
    ),
    warmup: int = typer.Option(
        1, min=0, help="Untimed runs before the timed one (on CPU the first measures memory)."
    ),
    repeats: int = typer.Option(
        1, min=1, help="Timed rounds, interleaved with --compare; times are medians."
    ),
    threads: int = typer.Option(None, min=1, help=THREADS_HELP),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    kept_layers: str = typer.Option(
        None, help="With --json: comma-separated layers (e.g. 0,15,29) whose kept positions per KV head it lists."
    ),
) -> None:
    """Run one method's selection end to end on one prompt and print the answer and its measurements."""
    import torch

    from rankkit.bench import BenchSettings, compare_on_prompt, kept_positions_by_layer
    from rankkit.methods import Budget
    from rankkit.methods.measure import cached_calibration

    if method == "full" and keep is None and budget is None:  # full keeps everything: no budget to ask for
        keep = "1.0"
    (chosen_budget,) = _budgets(keep, budget)
    layers_to_list = _layer_list(kept_layers, as_json)
    loaded, runner = _load(model, device, threads)
    example, prompt = _prompt(loaded.tokenizer, data, example_index, context_file, question)
    entries = [(_method(method, layer, draft_model, mirror), chosen_budget)]
    if compare:  # the reference goes first; full keeps everything whatever the budget
        reference_budget = Budget.from_keep(1.0) if compare == "full" else chosen_budget
        entries.insert(0, (_method(compare, layer, draft_model, mirror), reference_budget))
    with torch.inference_mode():
        cost_model = cached_calibration(runner, prompt.input_ids, loaded.weights_hash)
    settings = BenchSettings(max_new_tokens, warmup, repeats)
    rows = compare_on_prompt(runner, loaded.tokenizer, prompt, example, entries, cost_model, settings)
    if not compare:
        rows[0] |= {"ttft_ratio": None, "tpot_ratio": None, "kv_ratio": None}
    else:
        rows.reverse()  # the method first, then what it is compared with
    if as_json:
        result = {key: rows[0][key] for key in JSON_KEYS} | {
            "budget": rows[0]["budget"],
            "length": rows[0]["length"],
        }
        if compare:
            result |= {"ttft_ratio": rows[0]["ttft_ratio"], "kv_ratio": rows[0]["kv_ratio"]}
            result["tpot_ratio"] = rows[0]["tpot_ratio"]
            result["compare"] = {key: rows[1][key] for key in JSON_KEYS}
        if layers_to_list:
            chosen_method, _ = entries[-1]
            kept = kept_positions_by_layer(runner, chosen_method, prompt.input_ids, chosen_budget, layers_to_list)
            result["kept_positions_by_layer"] = {str(layer): heads for layer, heads in kept.items()}
        console.print_json(json.dumps(result))
        return
    _print_runs(rows, compare is not None)


def _layer_list(text: str | None, as_json: bool) -> list[int]:
    if text is None:
        return []
    if not as_json:
        raise RankkitError("--kept-layers lists positions in the JSON output: add --json")
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise RankkitError(f"--kept-layers takes comma-separated layer numbers, e.g. 0,15,29, not {text!r}") from None


def _prompt(tokenizer, data, example_index, context_file, question):
    from rankkit.capture import example_prompt
    from rankkit.data import load_examples
    from rankkit.prompting import build_prompt

    if (data is None) == (context_file is None):
        raise RankkitError("give either --data SPEC or --context-file FILE with --question")
    if data is not None:
        examples = load_examples(data, tokenizer)
        if example_index >= len(examples):
            raise RankkitError(f"--example {example_index} is past the {len(examples)} examples of {data}")
        example = examples[example_index]
        return example, example_prompt(tokenizer, example)
    if not question:
        raise RankkitError("--context-file needs --question")
    return None, build_prompt(tokenizer, context_file.read_text(encoding="utf-8"), question)


def _print_runs(rows: list[dict], compared: bool) -> None:
    table = Table(title=f"{rows[0]['length']} prompt tokens, {rows[0]['budget']}")
    table.add_column("")
    for row in rows:
        table.add_column(row["method"], justify="right")
    lines = [
        ("TTFT (s)", lambda r: _number(r["ttft_s"])),
        ("TPOT (s)", lambda r: _number(r["tpot_s"], 4)),
        ("end to end (s)", lambda r: _number(r["e2e_s"])),
        ("KV cache (MiB)", lambda r: _megabytes(r["kv_bytes"])),
        ("peak memory (MiB)", lambda r: _megabytes(r["peak_mem_bytes"])),
        ("ideal TTFT ratio", lambda r: _number(r["ideal_ratio"])),
        ("score", lambda r: _number(r["score"], 2)),
    ]
    if compared:
        lines += [
            ("TTFT ratio", lambda r: _number(r["ttft_ratio"])),
            ("TPOT ratio", lambda r: _number(r["tpot_ratio"])),
            ("KV ratio", lambda r: _number(r["kv_ratio"])),
        ]
    for label, cell in lines:
        table.add_row(label, *(cell(row) for row in rows))
    console.print(table)
    for row in rows:
        console.print(f"[bold]{row['method']}[/bold]: {row['answer']!r}")


@app.command()
def bench(
    methods: str = typer.Option(..., help="Comma-separated methods, e.g. full,gemfilter,fastkv,claa,oracle."),
    keep: str = typer.Option(None, help="Comma-separated keep rates, e.g. 0.1,0.2,0.4."),
    budget: str = typer.Option(None, help="Comma-separated token budgets (instead of --keep)."),
    data: str = typer.Option(..., help="A data spec, e.g. niah:n=4,length=4096."),
    limit: int = typer.Option(None, min=1, help="Only the first N examples."),
    out: Path = typer.Option(None, help="Write one row per (example, method, budget) to this parquet file."),
    layer: int = typer.Option(None, help=LAYER_HELP),
    model: str = typer.Option("default", help="'default', an HF folder, or a hub id."),
    max_new_tokens: int = typer.Option(32, min=1),
    draft_model: str = typer.Option("default", help="SpecPrefill's draft model."),
    mirror: str = typer.Option(
        "fastkv", help="The architecture the oracle mirrors: gemfilter, fastkv or claa."
    ),
    warmup: int = typer.Option(
        1, min=0, help="Untimed runs before each timed one (on CPU the first measures memory)."
    ),
    repeats: int = typer.Option(
        1,
        min=1,
        help="Timed rounds over all methods of an example; times are medians, ratios paired per round.",
    ),
    threads: int = typer.Option(None, min=1, help=THREADS_HELP),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
    as_json: bool = typer.Option(False, "--json", help="Print the per-method summary as JSON."),
) -> None:
    """Run the methods x budgets grid over a dataset; print accuracy and TTFT ratio per method and budget."""
    from rankkit.bench import BenchSettings, run_bench, summary
    from rankkit.capture import example_prompt
    from rankkit.data import load_examples

    names = [name.strip() for name in methods.split(",") if name.strip()]
    budgets = _budgets(keep, budget)
    chosen = [_method(name, layer, draft_model, mirror, strict=False) for name in names]
    loaded, runner = _load(model, device, threads)
    examples = load_examples(data, loaded.tokenizer)[:limit]
    if not examples:
        raise RankkitError(f"{data} has no examples")
    runs_per_example = 1 + sum(1 for name in names if name != "full") * len(budgets)
    progress = Progress(
        TextColumn("[bold]bench"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=status,
    )
    with progress:
        task = progress.add_task("", total=len(examples) * runs_per_example)
        started = {"runs": 0}

        def on_run(description: str) -> None:
            progress.update(task, description=description, completed=started["runs"])
            if not description.startswith("calibrating"):
                started["runs"] += 1

        frame = run_bench(
            runner,
            loaded.tokenizer,
            examples,
            chosen,
            budgets,
            BenchSettings(max_new_tokens, warmup, repeats),
            prompt_for=lambda example: example_prompt(loaded.tokenizer, example),
            on_run=on_run,
        )
        progress.update(task, completed=len(examples) * runs_per_example, description="done")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        frame.write_parquet(out)
    table = summary(frame)
    if as_json:
        console.print_json(json.dumps({"out": str(out) if out else None, "summary": table.to_dicts()}))
        return
    _print_summary(table, out)


def _print_summary(table, out: Path | None) -> None:
    view = Table(title="methods vs full (means over examples)")
    columns = [
        ("method", "method", str),
        ("budget", "budget", str),
        ("n", "examples", str),
        ("accuracy", "accuracy", lambda v: _number(v, 2)),
        ("TTFT ratio", "ttft_ratio", _number),
        ("ideal", "ideal_ratio", _number),
        ("measured/ideal", "measured_over_ideal", _number),
        ("TPOT ratio", "tpot_ratio", _number),
        ("KV ratio", "kv_ratio", _number),
        ("KV MiB", "kv_bytes", _megabytes),
        ("peak MiB", "peak_mem_bytes", _megabytes),
    ]
    for label, _, _ in columns:
        view.add_column(label, justify="left" if label in ("method", "budget") else "right")
    for row in table.to_dicts():
        view.add_row(*(render(row[key]) for _, key, render in columns))
    console.print(view)
    if out is not None:
        console.print(f"rows: {out}")
