"""The rankings section of docs/findings.md, written by code: ``make findings`` runs this.

Runs docs/experiments/rankings.toml with ``rankkit sweep`` into ``--out`` (resuming what is
there: one store per task, niah and four RULER tasks, 50 prompts of 2,048 tokens each, every
probe, the Answer-Informed Oracle and SpecPrefill's draft scores; compare and variance per
task), then replaces the text between the ``<!-- rankings:begin -->`` and
``<!-- rankings:end -->`` markers of docs/findings.md with tables read from the sweep's
compare and variance parquets. Every mean is shown with its 95% interval over examples and
n (``rankkit.eval.stats``).

    python docs/experiments/rankings.py --out runs/findings/rankings

Stores the earlier version of this script captured (``runs/findings/<task>.zarr``) hold the
same specs, probes, oracle and draft: moved to ``<out>/stores/<task>-2048.zarr`` they resume
with nothing left to capture.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import polars as pl
from findings import FINDINGS, cell_frame, rewrite_section, run_experiment

from rankkit.eval.compare import pairs_at_layer, with_example_id
from rankkit.eval.stats import interval_columns, with_interval
from rankkit.experiment import DataCell

SHOWN_LAYERS = (0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 29)
SUMMARY_METRICS = ("spearman", "recall_at_10", "needle_recall")


def cell(row: dict, metric: str) -> str:
    return with_interval(row[metric], *(row[name] for name in interval_columns(metric)))


def task_section(out: Path, data: DataCell) -> str:
    """One task's tables from the sweep's compare and variance parquets."""
    per_layer = with_example_id(pl.read_parquet(out / "compare.parquet")).filter(pl.col("cell") == data.name)
    pruning_layer = per_layer["pruning_layer"][0]
    n = per_layer["example_id"].n_unique()
    lines = [f"### {data.dataset} (n = {n}, {data.length:,} tokens)", ""]
    lines += [
        f"At each method's own layer (probes and KV-only methods at l_p = {pruning_layer}); "
        "mean [95% interval] over examples:",
        "",
        "| method | layer | ρ | top-10% recall | needle recall | mean ρ over layers | min ρ (layer) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    stability = {row["method"]: row for row in cell_frame(out, "compare.stability", data).to_dicts()}
    for row in cell_frame(out, "compare.summary", data).to_dicts():
        steady = stability[row["method"]]
        trough = "–" if steady["min_spearman"] is None else f"{steady['min_spearman']:.2f}"
        trough += "" if steady["trough_layer"] is None else f" ({steady['trough_layer']})"
        layer = "–" if row["layer"] is None else row["layer"]
        mean = "–" if steady["mean_spearman"] is None else f"{steady['mean_spearman']:.2f}"
        metrics = " | ".join(cell(row, metric) for metric in SUMMARY_METRICS)
        lines.append(f"| {row['method']} | {layer} | {metrics} | {mean} | {trough} |")
    curve = cell_frame(out, "compare.curve", data).filter(pl.col("layer").is_in(SHOWN_LAYERS))
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
    paired = pairs_at_layer(cell_frame(out, "compare.pairs", data), pruning_layer)
    if paired.height:
        lines += ["", f"Paired differences in ρ at l_p = {pruning_layer} (Wilcoxon signed-rank):", ""]
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
    chosen = (
        cell_frame(out, "variance.selections", data)
        .group_by("tau", maintain_order=True)
        .agg(pl.col("selection_layer").is_not_null().sum().alias("selected"), pl.len().alias("examples"))
    )
    means = cell_frame(out, "variance.means", data).sort("layer").filter(pl.col("layer") % 3 == 0)
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
    parser.add_argument("--out", type=Path, default=Path("runs/findings/rankings"))
    args = parser.parse_args()
    experiment = run_experiment("rankings", args.out)
    sections = [task_section(args.out, data) for data in experiment.data]
    rewrite_section("rankings", "\n\n".join(sections))
    print(f"wrote {len(sections)} task tables into {FINDINGS}")


if __name__ == "__main__":
    main()
