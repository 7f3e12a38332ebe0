"""The end-to-end table of docs/findings.md, written by code: ``make findings`` runs this.

Runs docs/experiments/end_to_end.toml with ``rankkit sweep`` into ``--out`` (resuming what
is there: 13 methods at keep 0.1, 0.2 and 0.4 on one example per task, one torch thread),
then replaces the text between the ``<!-- end_to_end:begin -->`` and
``<!-- end_to_end:end -->`` markers of docs/findings.md with the table read from the sweep's
bench.parquet: per method the score at each task and keep rate (``rankkit.bench.summary``'s
accuracy; full runs once and stands for every keep rate), then the mean measured and ideal
TTFT ratios to full over the tasks at the first keep rate.

    python docs/experiments/end_to_end.py --out runs/findings/end_to_end
"""

from __future__ import annotations

import argparse
from pathlib import Path

import polars as pl
import torch
from findings import FINDINGS, cell_frame, rewrite_section, run_experiment

from rankkit.bench import FULL, summary
from rankkit.experiment import Experiment

EXPERIMENT = "end_to_end"


def table(out: Path, experiment: Experiment) -> str:
    budgets = [budget.label for budget in experiment.budgets]
    first = budgets[0]
    per_task = {data.dataset: summary(cell_frame(out, "bench", data)) for data in experiment.data}

    def at(frame: pl.DataFrame, method: str, budget: str) -> dict:
        rows = frame.filter((pl.col("method") == method) & ((pl.col("budget") == budget) | (method == FULL)))
        return rows.row(0, named=True)

    header = [f"{task} @ {budget}" for task in per_task for budget in budgets]
    lines = [
        "| method | " + " | ".join(header) + f" | mean TTFT ratio @ {first.removeprefix('keep=')} "
        f"| ideal @ {first.removeprefix('keep=')} |",
        "|---|" + "---:|" * (len(header) + 2),
    ]
    for method in experiment.bench.methods:
        scores = [
            f"{at(frame, method, budget)['accuracy']:.2f}"
            for frame in per_task.values()
            for budget in budgets
        ]
        ratios = [
            sum(at(frame, method, first)[column] for frame in per_task.values()) / len(per_task)
            for column in ("ttft_ratio", "ideal_ratio")
        ]
        lines.append(
            f"| {method} | " + " | ".join(scores) + "".join(f" | {ratio:.2f}" for ratio in ratios) + " |"
        )
    lines += [
        "",
        f"Written by `make findings` from `docs/experiments/{EXPERIMENT}.toml`: every row from the same run.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/findings") / EXPERIMENT)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the table's runs were made (--threads 1): steadier on a busy machine
    experiment = run_experiment(EXPERIMENT, args.out)
    rewrite_section(EXPERIMENT, table(args.out, experiment))
    print(f"wrote the end-to-end table into {FINDINGS}")


if __name__ == "__main__":
    main()
