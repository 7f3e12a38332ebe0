"""The rankings section of docs/findings.md, written by code: ``make findings`` runs this.

One store per task (niah and four RULER tasks, ``--examples`` prompts of 2,048 tokens each,
every probe, the Answer-Informed Oracle and SpecPrefill's draft scores) under ``--runs``,
captured unless already complete (a rerun resumes); then ``compare`` and ``variance`` per
task through the library, and the text between the ``<!-- rankings:begin -->`` and
``<!-- rankings:end -->`` markers of docs/findings.md is replaced with the tables. Every
mean is shown with its 95% interval over examples and n (``rankkit.eval.stats``).

    python docs/experiments/rankings.py --examples 50 --runs runs/findings
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import polars as pl

from rankkit import models, outputs
from rankkit.capture import OracleOptions, capture
from rankkit.cli.progress import progress_bar
from rankkit.eval.compare import compare_store, pairs_at_layer
from rankkit.eval.stats import interval_columns, with_interval
from rankkit.eval.variance import variance_store
from rankkit.methods.specprefill import self_draft_spec

TASKS = {
    "niah": "niah:n={n},length=2048",
    "niah_single_2": "ruler:task=niah_single_2,n={n},length=2048",
    "niah_multikey_1": "ruler:task=niah_multikey_1,n={n},length=2048",
    "vt": "ruler:task=vt,n={n},length=2048",
    "qa_1": "ruler:task=qa_1,n={n},length=2048",
}
SHOWN_LAYERS = (0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 29)
SUMMARY_METRICS = ("spearman", "recall_at_10", "needle_recall")
FINDINGS = Path(__file__).resolve().parents[1] / "findings.md"
BEGIN, END = "<!-- rankings:begin -->", "<!-- rankings:end -->"


def capture_task(task: str, spec: str, store: Path) -> None:
    draft = self_draft_spec(models.load_config("default").num_hidden_layers)
    with progress_bar(f"capture {task}") as show:
        capture(data=spec, out=store, probes="all", oracle=OracleOptions(), draft=draft, progress=show)


def cell(row: dict, metric: str) -> str:
    return with_interval(row[metric], *(row[name] for name in interval_columns(metric)))


def task_section(task: str, store: Path) -> str:
    result = compare_store(store)
    n = result.per_layer["example"].n_unique()
    lines = [f"### {task} (n = {n}, 2,048 tokens)", ""]
    lines += [
        f"At each method's own layer (probes and KV-only methods at l_p = {result.pruning_layer}); "
        "mean [95% interval] over examples:",
        "",
        "| method | layer | ρ | top-10% recall | needle recall | mean ρ over layers | min ρ (layer) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    stability = {row["method"]: row for row in result.stability.to_dicts()}
    for row in result.summary.to_dicts():
        steady = stability[row["method"]]
        trough = "–" if steady["min_spearman"] is None else f"{steady['min_spearman']:.2f}"
        trough += "" if steady["trough_layer"] is None else f" ({steady['trough_layer']})"
        layer = "–" if row["layer"] is None else row["layer"]
        mean = "–" if steady["mean_spearman"] is None else f"{steady['mean_spearman']:.2f}"
        metrics = " | ".join(cell(row, metric) for metric in SUMMARY_METRICS)
        lines.append(f"| {row['method']} | {layer} | {metrics} | {mean} | {trough} |")
    curve = result.curve.filter(pl.col("layer").is_in(SHOWN_LAYERS))
    lines += [
        "",
        "Mean ρ per layer:",
        "",
        "| method | " + " | ".join(f"l{layer}" for layer in SHOWN_LAYERS) + " |",
    ]
    lines.append("|---|" + "---:|" * len(SHOWN_LAYERS))
    for (method,), rows in curve.group_by("method", maintain_order=True):
        by_layer = dict(zip(rows["layer"].to_list(), rows["spearman"].to_list(), strict=True))
        if len(by_layer) > 1:  # adaptive and layer-less methods have no curve
            cells = [
                "" if by_layer.get(layer) is None else f"{by_layer[layer]:.2f}" for layer in SHOWN_LAYERS
            ]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    paired = pairs_at_layer(result.pairs, result.pruning_layer)
    if paired.height:
        lines += ["", f"Paired differences in ρ at l_p = {result.pruning_layer} (Wilcoxon signed-rank):", ""]
        lines += [
            "| pair | Δρ [95% interval] | p | layers higher, p < 0.05 | layers lower, p < 0.05 |",
            "|---|---:|---:|---:|---:|",
        ]
        for row in paired.to_dicts():
            p_value = "–" if row["p_value"] is None else f"{row['p_value']:.2g}"
            lines.append(
                f"| {row['method']} − {row['baseline']} | {cell(row, 'difference')} | {p_value} | "
                f"{row['higher_layers']} | {row['lower_layers']} |"
            )
    variance = variance_store(store)
    chosen = variance.selections.group_by("tau", maintain_order=True).agg(
        pl.col("selection_layer").is_not_null().sum().alias("selected"), pl.len().alias("examples")
    )
    means = variance.means.sort("layer").filter(pl.col("layer") % 3 == 0)
    curve_text = ", ".join(f"l{row['layer']} {cell(row, 'relative_variance')}" for row in means.to_dicts())
    lines += ["", f"ASL relative rank variance (mean [95% interval]): {curve_text}.", ""]
    lines.append(
        "Examples whose curve drops below τ (the rest fall back to the last layer): "
        + "; ".join(f"τ = {row['tau']:g}: {row['selected']}/{row['examples']}" for row in chosen.to_dicts())
        + "."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=50)
    parser.add_argument("--runs", type=Path, default=Path("runs/findings"))
    args = parser.parse_args()
    sections = []
    for task, spec in TASKS.items():
        store = args.runs / f"{task}.zarr"
        capture_task(task, spec.format(n=args.examples), store)
        sections.append(task_section(task, store))
    text = FINDINGS.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(f"{FINDINGS} has no {BEGIN} ... {END} section to fill")
    body = "\n\n".join(sections)
    outputs.write_text(pattern.sub(lambda _: f"{BEGIN}\n{body}\n{END}", text), FINDINGS)
    print(f"wrote {len(sections)} task tables into {FINDINGS}")


if __name__ == "__main__":
    main()
