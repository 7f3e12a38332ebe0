"""docs/findings.md is written by code (docs/experiments/findings.py): the committed page is what
the committed result tables render to, every "higher"/"lower" follows a paired interval and test, and the
tables are collected from a sweep's outputs as the slow, obvious computation gives them."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from scipy import stats as scipy_stats

from rankkit.eval.compare import with_example_id
from rankkit.eval.stats import paired_difference
from rankkit.sweep import sweep

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "experiments"))
import findings  # noqa: E402

TINY = """
name = "tiny-findings"
stages = ["capture", "oracle", "compare", "variance", "bench"]
keep = [0.2]

[model]
name = "{model}"
device = "cpu"

[[data]]
spec = "niah:n=4,length=256"

[oracle]
max_new_tokens = 4

[bench]
methods = ["full", "claa", "fastkv", "gemfilter"]
max_new_tokens = 4
warmup = 0
"""


def test_the_page_is_what_the_committed_tables_render_to():
    page = findings.FINDINGS.read_text(encoding="utf-8")
    assert findings.render(findings.read_results()) == page, (
        "run: python docs/experiments/findings.py --render-only"
    )


def test_the_readme_and_the_page_name_the_default_models_quantization():
    readme = (findings.EXPERIMENTS.parents[1] / "README.md").read_text(encoding="utf-8")
    page = findings.FINDINGS.read_text(encoding="utf-8")
    assert "Q4_1" in readme and "Q4_1 for" in page


def _pair(low: float, high: float, difference: float = 0.1, task: str = "t", p_value: float = 0.01) -> dict:
    return {
        "task": task, "difference": difference, "difference_ci_low": low, "difference_ci_high": high,
        "p_value": p_value,
    }


def test_a_difference_equal_on_every_example_is_no_claim_without_the_test():
    """Two examples of +1 give the bootstrap interval [1, 1], which excludes zero; scipy's Wilcoxon
    test of the same two differences gives p = 0.5, so nothing is claimed. Eight clusters of +1
    (p = 2 / 2**8) are a claim."""
    row = paired_difference(np.array([1.0, 1.0]), np.array([0.0, 0.0]))
    assert (row["difference_ci_low"], row["difference_ci_high"]) == (1.0, 1.0)
    assert row["p_value"] == pytest.approx(scipy_stats.wilcoxon([1.0, 1.0]).pvalue) == 0.5
    assert findings.supported(row) is None
    clustered = paired_difference(np.ones(16), np.zeros(16), [f"c{index // 2}" for index in range(16)])
    assert clustered["p_value"] == pytest.approx(scipy_stats.wilcoxon(np.ones(8)).pvalue)
    assert findings.supported(clustered) == "higher"


def test_a_claim_sorts_tasks_by_what_their_intervals_support_with_their_numbers():
    rows = [_pair(0.05, 0.2, 0.12, "a"), _pair(-0.2, -0.01, -0.1, "b"), _pair(-0.05, 0.3, 0.2, "c")]
    sentence = findings.claim("CLAA", "fastkv", rows, lambda row: row["task"])
    assert sentence == (
        "CLAA − fastkv in ρ: higher on a (0.12 [0.05, 0.20]); lower on b (-0.10 [-0.20, -0.01]); "
        "not distinguishable on c (0.20 [-0.05, 0.30])."
    )


@pytest.fixture(scope="module")
def tiny_sweep(tiny_folder, tmp_path_factory) -> tuple[Path, dict[str, pl.DataFrame]]:
    """A tiny sweep's outputs, and the tables ``findings`` collects from them."""
    folder = tmp_path_factory.mktemp("findings")
    path = folder / "tiny.toml"
    path.write_text(TINY.format(model=tiny_folder), encoding="utf-8")
    out = folder / "out"
    sweep(path, out, workers=1)
    experiment = findings.read_experiment(path)[0]
    return out, {**findings.collect_rankings(out, experiment), **findings.collect_end_to_end(out, experiment)}


def test_collected_tables_are_the_slow_computation_on_the_sweeps_outputs(tiny_sweep):
    out, tables = tiny_sweep
    per_layer = with_example_id(pl.read_parquet(out / "compare.parquet"))
    task = tables["tasks"].row(0, named=True)
    assert task["n_examples"] == 4 and task["needle_keep"] == 0.2

    def at_pruning_layer(method: str, metric: str) -> np.ndarray:
        rows = per_layer.filter((pl.col("method") == method) & (pl.col("layer") == task["pruning_layer"]))
        return rows.sort("example_id")[metric].to_numpy()

    for baseline in findings.BASELINES:
        needle = tables["needle_pairs"].filter(pl.col("baseline") == baseline).row(0, named=True)
        expected = (
            at_pruning_layer("claa", "needle_recall") - at_pruning_layer(baseline, "needle_recall")
        ).mean()
        assert needle["difference"] == pytest.approx(expected)
        rho = tables["pairs"].filter(
            (pl.col("baseline") == baseline) & (pl.col("layer") == task["pruning_layer"])
        )
        expected = (at_pruning_layer("claa", "spearman") - at_pruning_layer(baseline, "spearman")).mean()
        assert rho["difference"][0] == pytest.approx(expected)

    bench = pl.read_parquet(out / "bench.parquet")
    full = bench.filter(pl.col("method") == "full").sort("example_id")["score"].to_numpy()
    for method in ("claa", "fastkv", "gemfilter"):
        scores = bench.filter(pl.col("method") == method).sort("example_id")["score"].to_numpy()
        pair = tables["end_to_end_pairs"].filter(
            (pl.col("method") == method) & (pl.col("baseline") == "full")
        )
        assert pair["difference"][0] == pytest.approx((scores - full).mean())
        accuracy = tables["end_to_end"].filter(pl.col("method") == method)["accuracy"][0]
        assert accuracy == pytest.approx(scores.mean())

    page = findings.render(tables)
    assert f"n = 4, {task['n_clusters']} clusters" in page
    for row in tables["end_to_end"].to_dicts():
        assert findings.row_with_interval(row, "accuracy") in page


def test_a_flipped_difference_flips_the_sentence(tiny_sweep):
    tables = dict(tiny_sweep[1])
    forced = {"difference": 0.3, "difference_ci_low": 0.1, "difference_ci_high": 0.5, "p_value": 0.01}
    tables["needle_pairs"] = tables["needle_pairs"].with_columns(**{k: pl.lit(v) for k, v in forced.items()})
    assert "needle recall at keep 0.2: higher on niah (0.30 [0.10, 0.50])." in findings.render(tables)
    flipped = {"difference": -0.3, "difference_ci_low": -0.5, "difference_ci_high": -0.1, "p_value": 0.01}
    tables["needle_pairs"] = tables["needle_pairs"].with_columns(**{k: pl.lit(v) for k, v in flipped.items()})
    assert "needle recall at keep 0.2: lower on niah (-0.30 [-0.50, -0.10])." in findings.render(tables)
