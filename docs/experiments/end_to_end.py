"""The end-to-end tables of docs/findings.md, written by code: ``make findings`` runs this.

Runs ``docs/experiments/EXPERIMENT.toml`` (``--experiment``: ``end_to_end``, one example per
task, or ``end_to_end_20``, 20 per task) with ``rankkit sweep`` into ``--out`` (resuming what
is there; one torch thread), then replaces the text between the ``<!-- EXPERIMENT:begin -->``
and ``<!-- EXPERIMENT:end -->`` markers of docs/findings.md with the table read from the
sweep's bench.parquet: per method the score at each task and keep rate with its 95% interval
(``rankkit.bench.summary``: Wilson for right/wrong scores; full runs once and stands for
every keep rate), then the mean measured and ideal TTFT ratios to full over the tasks at the
first keep rate.

``--bench TASK=FILE`` (once per task) reads rows ``rankkit bench --out FILE`` made with the
experiment's settings instead of running the sweep: the finished parquet, or the journal of a
run still unfinished (``.FILE.unfinished.jsonl``: its finished examples).

    python docs/experiments/end_to_end.py --experiment end_to_end_20 --out runs/findings/end_to_end_20
"""

from __future__ import annotations

import argparse
from pathlib import Path

import polars as pl
import torch
from findings import EXPERIMENTS, FINDINGS, cell_frame, rewrite_section, run_experiment

from rankkit.bench import FULL, summary
from rankkit.eval.stats import interval_columns, with_interval
from rankkit.experiment import Experiment, read_experiment
from rankkit.outputs import Journal


def table(per_task: dict[str, pl.DataFrame], experiment: Experiment, source: str) -> str:
    """The markdown table of ``per_task`` bench summaries (``rankkit.bench.summary``)."""
    budgets = [budget.label for budget in experiment.budgets]
    first = budgets[0]

    def at(frame: pl.DataFrame, method: str, budget: str) -> dict:
        rows = frame.filter((pl.col("method") == method) & ((pl.col("budget") == budget) | (method == FULL)))
        return rows.row(0, named=True)

    def score(row: dict) -> str:
        return with_interval(row["accuracy"], *(row[name] for name in interval_columns("accuracy")))

    sizes = {task: at(frame, FULL, first)["n_examples"] for task, frame in per_task.items()}
    header = [f"{task} (n = {sizes[task]}) @ {budget}" for task in per_task for budget in budgets]
    lines = [
        "| method | " + " | ".join(header) + f" | mean TTFT ratio @ {first.removeprefix('keep=')} "
        f"| ideal @ {first.removeprefix('keep=')} |",
        "|---|" + "---:|" * (len(header) + 2),
    ]
    for method in experiment.bench.methods:
        scores = [score(at(frame, method, budget)) for frame in per_task.values() for budget in budgets]
        ratios = [
            sum(at(frame, method, first)[column] for frame in per_task.values()) / len(per_task)
            for column in ("ttft_ratio", "ideal_ratio")
        ]
        lines.append(
            f"| {method} | " + " | ".join(scores) + "".join(f" | {ratio:.2f}" for ratio in ratios) + " |"
        )
    lines += ["", f"Written by `make findings` from `docs/experiments/{experiment.name}.toml`: {source}."]
    return "\n".join(lines)


def bench_rows(path: Path) -> pl.DataFrame:
    """The rows of ``rankkit bench --out PATH``: the parquet, or the finished examples of its journal."""
    return pl.read_parquet(path) if path.is_file() else pl.DataFrame(Journal.finished_rows(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", default="end_to_end", help="end_to_end or end_to_end_20")
    parser.add_argument("--out", type=Path, help="the sweep's directory (default runs/findings/EXPERIMENT)")
    parser.add_argument("--bench", action="append", default=[], metavar="TASK=FILE")
    args = parser.parse_args()
    if args.bench:
        experiment = read_experiment(EXPERIMENTS / f"{args.experiment}.toml")[0]
        files = dict(entry.split("=", 1) for entry in args.bench)
        per_task = {task: summary(bench_rows(Path(file))) for task, file in files.items()}
        source = "rows of `rankkit bench` runs with its settings, one per task"
    else:
        torch.set_num_threads(1)  # as the table's runs were made (--threads 1): steadier on a busy machine
        out = args.out or Path("runs/findings") / args.experiment
        experiment = run_experiment(args.experiment, out)
        per_task = {data.dataset: summary(cell_frame(out, "bench", data)) for data in experiment.data}
        source = "every row from the same run"
    rewrite_section(experiment.name, table(per_task, experiment, source))
    print(f"wrote the {experiment.name} table into {FINDINGS}")


if __name__ == "__main__":
    main()
