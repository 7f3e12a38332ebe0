"""Confidence intervals and paired tests (rankkit.eval.stats), each against scipy or the formula
written out by hand, and their place in compare, bench, variance and the tables."""

from __future__ import annotations

import io
import math
import re
import warnings

import numpy as np
import polars as pl
import pytest
from scipy import stats as scipy_stats

from rankkit.errors import RankkitError
from rankkit.eval.stats import (
    bootstrap_means,
    cluster_column,
    cluster_numbers,
    mean_intervals,
    median_interval,
    paired_difference,
    paired_differences,
    relation,
    row_with_interval,
    wilcoxon_p_value,
    wilson_interval,
    with_interval,
)


def scipy_percentile_interval(values: np.ndarray) -> tuple[float, float]:
    result = scipy_stats.bootstrap(
        (values,), np.mean, method="percentile", n_resamples=9999, rng=np.random.default_rng(1)
    )
    return result.confidence_interval.low, result.confidence_interval.high


def percentile_bootstrap_by_hand(values: np.ndarray) -> tuple[float, float]:
    """The percentile bootstrap of a mean written out: 9,999 resamples, each n draws with replacement
    among the n values from rankkit's seeded generator, and the 2.5th and 97.5th percentiles of
    their means."""
    draws = np.random.default_rng(0).integers(0, values.size, size=(9999, values.size))
    return tuple(np.percentile(values[draws].mean(axis=1), [2.5, 97.5]))


@pytest.mark.parametrize("size", [8, 40])
def test_bootstrap_interval_agrees_with_scipys_percentile_bootstrap(size):
    rng = np.random.default_rng(size)
    values = rng.normal(0.5, 0.2, size=(size, 3))
    means, low, high, counts = bootstrap_means(values)
    np.testing.assert_allclose(means, values.mean(axis=0))
    assert counts.tolist() == [size] * 3
    for column in range(3):
        expected_low, expected_high = scipy_percentile_interval(values[:, column])
        width = expected_high - expected_low
        # two Monte Carlo estimates of the same percentiles: equal to a few percent of the width
        assert low[column] == pytest.approx(expected_low, abs=0.05 * width)
        assert high[column] == pytest.approx(expected_high, abs=0.05 * width)


def test_bootstrap_is_deterministic_and_leaves_out_missing_values():
    rng = np.random.default_rng(0)
    values = rng.random((30, 2))
    values[::3, 1] = np.nan
    first, second = bootstrap_means(values), bootstrap_means(values)
    for got, again in zip(first, second, strict=True):
        np.testing.assert_array_equal(got, again)
    means, low, high, counts = first
    assert counts.tolist() == [30, 20]
    assert means[1] == pytest.approx(np.nanmean(values[:, 1]))
    assert low[1] < means[1] < high[1]


def test_fewer_than_two_values_have_no_interval():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a column no example has is no error to warn of
        means, low, high, counts = bootstrap_means(np.array([[0.7, np.nan], [np.nan, np.nan]]))
    assert means[0] == 0.7 and math.isnan(means[1])
    assert np.isnan(low).all() and np.isnan(high).all() and counts.tolist() == [1, 0]
    # two: a resample draws both, or one of them twice (each a quarter of the time), so [min, max]
    assert bootstrap_means(np.array([[0.6], [0.2]]))[1:3] == ([0.2], [0.6])
    # a pair of methods no example has both of: nothing to compare, no error
    none_shared = paired_difference(np.array([0.5, np.nan]), np.array([np.nan, 0.4]))
    assert none_shared == {
        "difference": None, "difference_ci_low": None, "difference_ci_high": None, "p_value": None,
        "n_examples": 0, "n_clusters": 0,
    }  # fmt: skip


def test_identical_values_have_a_zero_width_interval():
    _, low, high, _ = bootstrap_means(np.full((5, 1), 0.25))
    assert low[0] == high[0] == 0.25


def test_each_column_is_bootstrapped_over_its_own_values_in_their_order():
    """Columns of 20, 13, 2, 1 and no values among 20 examples, worked out by hand: each interval is
    the percentile bootstrap of the column's own values, drawn in the examples' order, over all
    9,999 resamples. Twenty examples, because numpy's default sort keeps equal keys in order over
    up to 16 of them and reorders them over more: the gapped column then drew other values."""
    rng = np.random.default_rng(7)
    values = rng.random((20, 5))
    values[[1, 4, 5, 9, 12, 17, 18], 1] = np.nan
    values[np.arange(20) % 10 != 4, 2] = np.nan  # values at examples 4 and 14 only
    values[1:, 3] = np.nan
    values[:, 4] = np.nan
    means, low, high, counts = bootstrap_means(values)
    assert counts.tolist() == [20, 13, 2, 1, 0]
    for column in range(3):
        own = values[~np.isnan(values[:, column]), column]
        assert means[column] == pytest.approx(own.mean(), rel=1e-12)
        # resampled in float32: a bound moves by a millionth of the interval's width
        assert (low[column], high[column]) == pytest.approx(percentile_bootstrap_by_hand(own), abs=1e-6)
    assert means[3] == values[0, 3] and math.isnan(means[4])
    assert np.isnan(low[3:]).all() and np.isnan(high[3:]).all()


def test_the_cluster_bootstrap_of_a_column_with_gaps_draws_the_clusters_it_has_with_their_values():
    """Five clusters of eight examples; the second column lacks cluster 2 wholly and one of cluster
    3's two examples, so it resamples four clusters, cluster 3 with its one value."""
    values = np.array(
        [[0.1, 0.3], [0.3, 0.5], [0.9, 0.7], [0.5, 0.1], [0.6, np.nan], [0.2, np.nan], [0.8, 0.6], [0.4, 0.9]]
    )
    clusters = np.array([0, 0, 1, 1, 2, 3, 3, 4])
    means, low, high, counts = bootstrap_means(values, clusters)
    assert counts.tolist() == [8, 6]
    assert means == pytest.approx([0.475, 3.1 / 6], rel=1e-12)
    assert (low[0], high[0]) == pytest.approx(slow_cluster_interval(values[:, 0], clusters), abs=1e-6)
    kept = ~np.isnan(values[:, 1])
    expected = slow_cluster_interval(values[kept, 1], np.array([0, 0, 1, 1, 2, 3]))
    assert (low[1], high[1]) == pytest.approx(expected, abs=1e-6)


def test_scores_of_a_narrow_dtype_are_averaged_in_double_precision():
    """A store written with --score-dtype float16: the mean of its values is not rounded to float16's
    three digits."""
    values = np.array([[0.1], [0.2], [0.4]], dtype=np.float16)
    means, _, _, _ = bootstrap_means(values)
    assert means[0] == pytest.approx(values.astype(np.float64).mean(), rel=1e-12)


def test_values_must_be_examples_by_quantities():
    with pytest.raises(ValueError, match=r"^values must be \[examples, quantities\], got shape \(3,\)$"):
        bootstrap_means(np.zeros(3))


@pytest.mark.parametrize("clustered", [False, True])
def test_an_interval_never_leaves_the_range_of_its_values(clustered):
    """No resample's mean lies outside the values it averages, so neither does the interval: a share
    of evidence kept is never below 0 (the float32 resampling once gave -1.5e-9 and 0.33333334 over a
    maximum of 1/3)."""
    rng = np.random.default_rng(0)
    clusters = np.array([0, 0, 1, 2, 3]) if clustered else None
    escaped = 0
    for _ in range(100):
        values = rng.choice([0.0, 0.0, 0.1, 1 / 3, 5 / 23, np.nan], size=(5, 3))
        _, low, high, _ = bootstrap_means(values, clusters)
        has = ~np.isnan(low)
        with np.errstate(invalid="ignore"):
            escaped += (low[has] < np.nanmin(values, axis=0)[has]).sum()
            escaped += (high[has] > np.nanmax(values, axis=0)[has]).sum()
    assert escaped == 0


@pytest.mark.parametrize(
    ("successes", "trials"), [(0, 4), (3, 4), (4, 4), (17, 50), (1.5, 4)]
)  # 1.5: partial credit
def test_wilson_interval_is_the_formula(successes, trials):
    z = scipy_stats.norm.ppf(0.975)
    share = successes / trials
    centre = (share + z**2 / (2 * trials)) / (1 + z**2 / trials)
    half = z / (1 + z**2 / trials) * math.sqrt(share * (1 - share) / trials + z**2 / (4 * trials**2))
    low, high = wilson_interval(successes, trials)
    assert low == pytest.approx(max(0.0, centre - half), abs=1e-12)
    assert high == pytest.approx(min(1.0, centre + half), abs=1e-12)


def test_mean_intervals_per_group_wilson_for_right_or_wrong_scores():
    frame = pl.DataFrame(
        {
            "example_id": ["a", "b", "c", "d"] * 2,
            "method": ["x"] * 4 + ["y"] * 4,
            "score": [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, None],
            "ratio": [0.5, 0.6, 0.55, 0.7, 0.2, 0.25, 0.3, 0.35],
            "constant": [1.0] * 8,  # 0/1 values, but not a right/wrong score: no Wilson
        }
    )
    found = mean_intervals(frame, ["method"], ["score", "ratio", "constant"], scores=["score"])
    rows = {row["method"]: row for row in found.to_dicts()}
    assert (rows["x"]["constant_ci_low"], rows["x"]["constant_ci_high"]) == (1.0, 1.0)
    assert rows["x"]["score"] == 0.75
    assert (rows["x"]["score_ci_low"], rows["x"]["score_ci_high"]) == pytest.approx(wilson_interval(3, 4))
    assert (rows["y"]["score_ci_low"], rows["y"]["score_ci_high"]) == pytest.approx(wilson_interval(0, 3))
    assert rows["x"]["ratio"] == pytest.approx(0.5875)
    assert rows["x"]["ratio_ci_low"] < 0.5875 < rows["x"]["ratio_ci_high"]
    assert rows["x"]["n_examples"] == 4 and rows["y"]["n_examples"] == 4  # y has a ratio for d


def test_a_group_named_by_a_missing_value_is_a_group():
    """A store whose examples record no task: variance's means are per task, the task null."""
    frame = pl.DataFrame({"example_id": ["a", "b", "c"], "task": [None, None, "qa"], "rho": [0.2, 0.4, 0.9]})
    found = mean_intervals(frame, ["task"], ["rho"])
    assert found.select("task", "rho", "n_examples").rows() == [(None, pytest.approx(0.3), 2), ("qa", 0.9, 1)]


def test_an_example_whose_id_is_missing_is_one_example_not_a_row_left_out():
    frame = pl.DataFrame({"example_id": ["a", None, "c"], "task": ["qa"] * 3, "rho": [0.2, 0.4, 0.9]})
    found = mean_intervals(frame, ["task"], ["rho"])
    assert found.select("rho", "rho_n", "n_examples").rows() == [(pytest.approx(0.5), 3, 3)]


def test_mean_intervals_bootstraps_each_groups_own_values_worked_out_by_hand():
    """Two methods over twelve examples, rows in no order, one method lacking some examples and
    some values: each group's mean, interval and counts are those of its own values, bootstrapped
    by hand in the order in which the frame first names their examples (the order the resamples
    draw them in)."""
    rng = np.random.default_rng(11)
    names = [f"e{index}" for index in rng.permutation(12)]
    shuffled = [names[index] for index in (8, 3, 11, 0, 6, 1, 9, 4, 7)]  # y has 9 of the 12
    rho = {"x": rng.random(12), "y": rng.random(9)}
    ratio = {"x": rng.random(12), "y": rng.random(9)}
    ratio["x"][[2, 5, 7]] = np.nan
    rho["y"][4] = ratio["y"][4] = np.nan  # an example with a row but no metric
    ratio["y"][6] = np.nan
    frame = pl.DataFrame(
        {
            "example_id": names + shuffled,
            "method": ["x"] * 12 + ["y"] * 9,
            "rho": np.concatenate([rho["x"], rho["y"]]),
            "ratio": np.concatenate([ratio["x"], ratio["y"]]),
        }
    ).with_columns(pl.col("rho", "ratio").fill_nan(None))
    found = mean_intervals(frame, ["method"], ["rho", "ratio"])
    assert found["method"].to_list() == ["x", "y"]
    first_seen = {name: index for index, name in enumerate(names)}
    for row, ids in zip(found.to_dicts(), (names, shuffled), strict=True):
        for metric, values in (("rho", rho), ("ratio", ratio)):
            by_example = dict(zip(ids, values[row["method"]], strict=True))
            own = np.array([by_example[name] for name in sorted(ids, key=first_seen.get)])
            own = own[~np.isnan(own)]
            assert (row[metric], row[f"{metric}_n"]) == (pytest.approx(own.mean(), rel=1e-12), own.size)
            expected = percentile_bootstrap_by_hand(own)
            assert (row[f"{metric}_ci_low"], row[f"{metric}_ci_high"]) == pytest.approx(expected, abs=1e-6)
    assert found["n_examples"].to_list() == [12, 8]


def test_groups_come_in_the_order_the_frame_first_names_them():
    """Twelve methods named out of order: a hash-ordered set of groups would shuffle the rows."""
    methods = [f"m{(index * 5) % 12}" for index in range(12)]
    frame = pl.DataFrame({"example_id": ["e0"] * 12, "method": methods, "rho": np.arange(12) / 10})
    found = mean_intervals(frame, ["method"], ["rho"])
    assert found.select("method", "rho").rows() == [
        (method, pytest.approx(index / 10)) for index, method in enumerate(methods)
    ]


def test_an_example_with_two_rows_in_a_group_is_refused_naming_the_first_and_its_group():
    frame = pl.DataFrame(
        {"example_id": ["a", "b", "a", "b"], "method": ["m"] * 4, "layer": [3] * 4, "rho": [0.1, 0.2, 0.3, 0.4]}
    )
    with pytest.raises(RankkitError, match="^example_id a has more than one row in the group of method m, layer 3: "):
        mean_intervals(frame, ["method", "layer"], ["rho"])


def test_counts_are_int32_columns_as_in_every_frame_of_counts():
    """compare's pairs frame declares its counts Int32: frames concatenated across runs (a sweep's)
    must agree on the type."""
    frame = pl.DataFrame(
        {"example_id": ["a", "b", "c"], "cluster": ["c0", "c0", "c1"], "method": ["m"] * 3, "rho": [0.1, 0.2, 0.3]}
    )
    found = mean_intervals(frame, ["method"], ["rho"], cluster="cluster")
    assert found.select("rho_n", "n_examples", "n_clusters").rows() == [(3, 3, 2)]
    assert {name: found.schema[name] for name in ("rho_n", "n_examples", "n_clusters")} == dict.fromkeys(
        ("rho_n", "n_examples", "n_clusters"), pl.Int32
    )


def test_a_frame_names_clusters_when_any_of_its_examples_has_one():
    assert cluster_column(pl.DataFrame({"cluster": ["c0", None]})) == "cluster"
    assert cluster_column(pl.DataFrame({"cluster": [None, None]}, schema={"cluster": pl.String})) is None
    assert cluster_column(pl.DataFrame({"example_id": ["a"]})) is None


def test_paired_difference_is_the_mean_difference_with_wilcoxons_p():
    rng = np.random.default_rng(3)
    first = rng.normal(0.6, 0.1, 12)
    second = first - rng.normal(0.05, 0.03, 12)
    second[4] = np.nan  # an example only one side has is left out
    found = paired_difference(first, second)
    kept = ~np.isnan(second)
    differences = first[kept] - second[kept]
    assert found["n_examples"] == 11
    assert found["difference"] == pytest.approx(differences.mean())
    assert found["p_value"] == pytest.approx(scipy_stats.wilcoxon(differences).pvalue)
    assert found["difference_ci_low"] < found["difference"] < found["difference_ci_high"]
    assert paired_difference(np.ones(3), np.ones(3))["p_value"] is None  # no difference to test
    assert paired_difference(np.ones(1), np.zeros(1))["p_value"] is None  # one difference: no test either
    assert paired_difference(np.ones(2), np.zeros(2))["p_value"] == scipy_stats.wilcoxon([1.0, 1.0]).pvalue == 0.5
    # right/wrong columns as booleans: a share's difference
    correct = paired_difference(np.array([True, True, False, True]), np.array([False, True, False, False]))
    assert (correct["difference"], correct["n_examples"]) == (0.5, 4)


@pytest.mark.parametrize(
    "shape", ["continuous", "ties", "zeros", "one_sided", "lower", "small", "at_the_limit", "past_the_limit"]
)
def test_wilcoxon_p_value_equals_scipys(shape):
    """Past 50 differences the normal approximation with the tie correction is rankkit's own; it
    must give scipy's p-value wherever scipy's "auto" picks that test, ties and zeros included,
    and scipy's exact test at 50 (a second below's lower side is as far from chance as above's)."""
    rng = np.random.default_rng(len(shape))
    size = {"small": 40, "at_the_limit": 50, "past_the_limit": 51}.get(shape, 700)
    differences = rng.normal(0.02, 0.3, size)
    if shape in ("ties", "zeros"):
        differences = np.round(differences, 1)  # a few dozen distinct values
    if shape == "zeros":
        differences[:200] = 0.0
    if shape in ("one_sided", "lower"):
        differences = (np.abs(differences) + 0.01) * (1 if shape == "one_sided" else -1)
    expected = scipy_stats.wilcoxon(differences).pvalue
    assert wilcoxon_p_value(differences) == pytest.approx(expected, rel=1e-12, abs=1e-300)


def test_many_paired_differences_equal_one_call_each():
    """Pairs with as many shared examples share one bootstrap; each still gets its own interval."""
    rng = np.random.default_rng(5)
    pairs = []
    for missing in (0, 0, 1, 3, 0, 12):
        first, second = rng.normal(0.5, 0.2, 12), rng.normal(0.4, 0.2, 12)
        second[rng.choice(12, missing, replace=False)] = np.nan
        pairs.append((first, second))
    pairs.append((np.ones(4), np.ones(4)))
    for found, pair in zip(paired_differences(pairs), pairs, strict=True):
        alone = paired_difference(*pair)
        assert found.keys() == alone.keys()
        for name, value in alone.items():
            # resamples are summed in float32: a bound moves by a millionth of the interval's width
            low, high = alone["difference_ci_low"], alone["difference_ci_high"]
            width = 1.0 if low is None or high is None else high - low
            tolerance = 1e-12 if name in ("difference", "p_value") else 1e-6 * width
            assert found[name] == (value if value is None else pytest.approx(value, abs=tolerance)), name


def test_with_interval_formats_what_tables_show():
    assert with_interval(0.6213, 0.551, 0.6949) == "0.62 [0.55, 0.69]"
    assert with_interval(0.5, None, None) == "0.50 [–]" and with_interval(None, None, None) == "–"
    assert with_interval(0.5, 0.4, None) == "0.50 [–]"  # half an interval is none


def test_a_mean_without_an_interval_shows_that_it_has_none():
    """One example, or examples of one cluster, give a mean and no interval: printed "0.56" it looked
    as precise as any other figure."""
    one = pl.DataFrame({"example_id": ["e0"], "method": ["claa"], "ttft_ratio": [0.5561234]})
    assert row_with_interval(mean_intervals(one, ["method"], ["ttft_ratio"]).row(0, named=True), "ttft_ratio") == (
        "0.56 [–]"
    )
    clustered = pl.DataFrame(
        {"example_id": ["e0", "e1", "e2"], "cluster": ["c"] * 3, "method": ["claa"] * 3, "rho": [0.41, 0.45, 0.52]}
    )
    row = mean_intervals(clustered, ["method"], ["rho"], cluster="cluster").row(0, named=True)
    assert row_with_interval(row, "rho") == f"{np.mean([0.41, 0.45, 0.52]):.2f} [–]"


# -- where the intervals appear ------------------------------------------------------------------


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    from test_eval import write_store

    from rankkit.eval.compare import compare_store

    return compare_store(write_store(tmp_path_factory.mktemp("stats") / "run.zarr", examples=6))


def test_compare_curve_is_the_mean_over_examples_per_method_and_layer(comparison):
    slow = (
        comparison.per_layer.filter(pl.col("method") == "lava")
        .group_by("layer")
        .agg(pl.col("spearman").mean())
        .sort("layer")
    )
    curve = comparison.curve.filter(pl.col("method") == "lava").sort("layer")
    np.testing.assert_allclose(curve["spearman"], slow["spearman"])
    assert (curve["spearman_ci_low"] <= curve["spearman"]).all()
    assert (curve["spearman"] <= curve["spearman_ci_high"]).all()
    assert set(curve["n_examples"]) == {6}


def test_compare_pairs_claa_with_each_single_layer_heuristic_by_wilcoxon(comparison):
    pairs = comparison.pairs
    assert sorted(set(pairs.select("method", "baseline").rows())) == [
        ("claa", "fastkv"),
        ("claa", "gemfilter"),
    ]
    row = pairs.filter((pl.col("baseline") == "gemfilter") & (pl.col("layer") == 3)).row(0, named=True)
    per_layer = comparison.per_layer.filter(pl.col("layer") == 3)
    claa, gemfilter = (
        per_layer.filter(pl.col("method") == name).sort("example_id")["spearman"]
        for name in ("claa", "gemfilter")
    )
    differences = (claa - gemfilter).to_numpy()
    assert row["difference"] == pytest.approx(differences.mean()) and row["n_examples"] == 6
    assert row["p_value"] == pytest.approx(scipy_stats.wilcoxon(differences).pvalue)


def test_compare_pairs_option_names_methods_and_refuses_others(tmp_path):
    from test_eval import write_store

    from rankkit.eval.compare import compare_store

    store = write_store(tmp_path / "run.zarr")
    chosen = compare_store(store, methods="window,lava,claa", pairs="lava:window")
    assert set(chosen.pairs["method"]) == {"lava"} and set(chosen.pairs["baseline"]) == {"window"}
    with pytest.raises(
        RankkitError, match="--pairs 'claa:nope' is not METHOD:BASELINE of two compared methods"
    ):
        compare_store(store, methods="window,claa", pairs="claa:nope")
    # as (method, baseline) tuples from Python: an unknown one tested nothing, a repeated one twice
    assert compare_store(store, methods="window,lava,claa", pairs=[("lava", "window")]).pairs.equals(chosen.pairs)
    with pytest.raises(RankkitError, match=re.escape("--pairs ('claa', 'nope') is not (method, baseline) of two compared methods")):
        compare_store(store, methods="window,claa", pairs=[("claa", "nope")])
    with pytest.raises(RankkitError, match="--pairs names claa:window twice; name each pair once"):
        compare_store(store, methods="window,claa", pairs=[("claa", "window")] * 2)
    # a method with itself: a zero difference on every example, printed as a finding
    for pairs in ("claa:claa", [("claa", "claa")]):
        with pytest.raises(RankkitError, match="^--pairs claa:claa pairs claa with itself; pair two different"):
            compare_store(store, methods="window,claa", pairs=pairs)
    assert compare_store(store, methods="window,claa", pairs=[]).pairs.height == 0


def test_compare_table_shows_means_with_intervals(tmp_path):
    from test_eval import write_store
    from typer.testing import CliRunner

    from rankkit.cli import commands  # noqa: F401  (registers every command)
    from rankkit.cli.app import app

    store = write_store(tmp_path / "run.zarr", examples=4)
    result = CliRunner().invoke(
        app, ["compare", str(store), "--methods", "lava,claa,fastkv"], env={"COLUMNS": "80"}
    )
    assert result.exit_code == 0, result.output
    assert "means [95% interval] over n examples" in result.stdout
    lava = next(line for line in result.stdout.splitlines() if line.startswith("lava"))
    assert " [" in lava and "]" in lava  # "0.03 [-0.05, 0.10]"
    assert "Paired Spearman differences" in result.stdout and "claa" in result.stdout
    assert max(map(len, result.stdout.splitlines())) <= 80


def test_variance_means_carry_intervals(tmp_path):
    from test_eval import write_store

    from rankkit.eval.variance import variance_store

    store = write_store(tmp_path / "run.zarr", examples=4)
    result = variance_store(store, method="asl:window_size=8", budget=13, min_layer=1, observed_layers=2)
    means = result.means
    assert means.columns == [
        "task", "probe", "layer", "relative_variance", "relative_variance_ci_low", "relative_variance_ci_high",
        "relative_variance_n", "n_examples",
    ]  # fmt: skip
    slow = (
        result.curves.drop_nulls("relative_variance")
        .group_by("layer")
        .agg(pl.col("relative_variance").mean())
    )
    joined = means.join(slow, on="layer", suffix="_slow")
    np.testing.assert_allclose(joined["relative_variance"], joined["relative_variance_slow"])


def test_wilson_interval_is_scipys_for_whole_counts():
    for successes, trials in [(0, 4), (3, 4), (10, 10), (17, 50)]:
        expected = scipy_stats.binomtest(successes, trials).proportion_ci(0.95, method="wilson")
        assert wilson_interval(successes, trials) == pytest.approx((expected.low, expected.high), abs=1e-12)


def test_the_cluster_bootstrap_draws_whole_clusters_and_needs_two_of_them():
    """Examples of one cluster enter a resample together, as often as their cluster is drawn."""
    from rankkit.eval.stats import _resample_counts

    values = np.array([[0.1], [0.3], [0.9], [0.5], [0.6]])
    clusters = np.array([0, 0, 1, 2, 2])
    means, low, high, counts = bootstrap_means(values, clusters)
    weights = _resample_counts(3)[:, clusters].astype(np.float64)
    resampled = (weights @ values[:, 0]) / weights.sum(axis=1)
    assert (means[0], counts[0]) == (pytest.approx(0.48), 5)
    assert (low[0], high[0]) == pytest.approx(tuple(np.percentile(resampled, [2.5, 97.5])), abs=1e-6)
    assert high[0] - low[0] > bootstrap_means(values)[2][0] - bootstrap_means(values)[1][0]  # wider
    _, low, high, _ = bootstrap_means(values, np.zeros(5, dtype=int))  # one cluster: one sample
    assert np.isnan(low[0]) and np.isnan(high[0])


def test_a_wilson_interval_stays_inside_zero_and_one():
    """Its bounds at 0 and at n of n are 0 and 1 in exact arithmetic; in floats, unclamped, 0 of 27
    gives a low below 0 and 16 of 16 a high above 1."""
    assert wilson_interval(0, 27)[0] == 0.0 and wilson_interval(16, 16)[1] == 1.0
    assert all(math.isnan(bound) for bound in wilson_interval(0, 0))  # no trials


def test_a_right_or_wrong_score_over_examples_each_its_own_cluster_is_wilsons():
    """RULER's tasks name a cluster per example: none shares one, so a 0/1 score counts independent
    trials and gets the Wilson interval, as it does without the column."""
    assert cluster_numbers(["c0", "c1", None]) is None
    frame = pl.DataFrame(
        {"example_id": ["a", "b", "c", "d"], "cluster": ["c0", "c1", "c2", "c3"], "method": ["m"] * 4,
         "accuracy": [1.0, 0.0, 1.0, 1.0]}
    )  # fmt: skip
    (row,) = mean_intervals(frame, ["method"], ["accuracy"], cluster="cluster", scores=["accuracy"]).to_dicts()
    assert (row["accuracy_ci_low"], row["accuracy_ci_high"]) == pytest.approx(wilson_interval(3, 4))
    assert row["n_clusters"] == 4


def test_mean_intervals_count_clusters_and_a_partial_credit_of_zero_does_not_collapse():
    frame = pl.DataFrame(
        {
            "example_id": ["a", "b", "c", "d"],
            "cluster": ["sweep", "sweep", "sweep", "other"],
            "score": [0.0, 0.0, 0.0, 0.0],  # partial credit (0, 0.5, 1) that came out 0 everywhere
            "credit": [0.5, 0.0, 0.5, 1.0],
        }
    ).with_columns(method=pl.lit("claa"))
    (row,) = mean_intervals(
        frame, ["method"], ["score", "credit"], cluster="cluster", scores=["score", "credit"]
    ).to_dicts()
    assert (row["n_examples"], row["n_clusters"]) == (4, 2)
    assert (row["score_ci_low"], row["score_ci_high"]) == pytest.approx(wilson_interval(0, 2))  # not [0, 0]
    assert row["score_ci_high"] > 0.6
    assert row["credit"] == 0.5 and row["credit_ci_low"] < row["credit_ci_high"]
    # a 0/1 score of clustered examples is no count of independent trials: the cluster bootstrap
    right = frame.with_columns(score=pl.Series([1.0, 0.0, 1.0, 1.0]))
    (row,) = mean_intervals(right, ["method"], ["score"], cluster="cluster", scores=["score"]).to_dicts()
    assert (row["score_ci_low"], row["score_ci_high"]) == pytest.approx(
        slow_cluster_interval(right["score"].to_numpy(), np.array([0, 0, 0, 1])), abs=1e-6
    )
    (alone,) = mean_intervals(frame.drop("cluster"), ["method"], ["score"], scores=["score"]).to_dicts()
    assert "n_clusters" not in alone and (alone["score_ci_low"], alone["score_ci_high"]) == pytest.approx(
        wilson_interval(0, 4)
    )


def test_a_score_over_one_independent_sample_has_no_interval():
    """Five examples of one cluster (a niah depth sweep over one haystack and needle) are one
    sample, as is one example alone: the Wilson interval over one trial ([0.08, 0.96] for 0.6)
    would look precise where nothing is known of the spread."""
    frame = pl.DataFrame(
        {"example_id": [f"e{index}" for index in range(5)], "cluster": ["niah-s0-needle0"] * 5,
         "accuracy": [1.0, 0.0, 1.0, 1.0, 0.0], "method": ["oracle"] * 5}
    )
    (row,) = mean_intervals(frame, ["method"], ["accuracy"], cluster="cluster", scores=["accuracy"]).to_dicts()
    assert (row["accuracy"], row["n_examples"], row["n_clusters"]) == (pytest.approx(0.6), 5, 1)
    assert (row["accuracy_ci_low"], row["accuracy_ci_high"]) == (None, None)
    (alone,) = mean_intervals(frame.head(1), ["method"], ["accuracy"], scores=["accuracy"]).to_dicts()
    assert (alone["accuracy"], alone["accuracy_ci_low"], alone["accuracy_ci_high"]) == (1.0, None, None)


@pytest.mark.parametrize(
    ("values", "units"),
    [([0.1, 0.4, 0.6, 0.9], None), ([0.1, 0.4, 0.6, 0.9, 0.2, 0.3, 0.8, 0.7], [0, 0, 1, 2, 3, 4, 5, 6])],
)
def test_a_groups_interval_resamples_its_own_examples_whatever_else_the_frame_holds(values, units):
    """A method on a few of the frame's examples: its interval is the bootstrap of its own values (or
    clusters), worked out the slow way, not of a random number of them drawn among all the frame's
    (4 values of 44 gave [0.10, 0.90] for [0.225, 0.775])."""
    values = np.array(values)
    size = values.size
    names = [f"e{index}" for index in range(size)] if units is None else [f"c{unit}" for unit in units]
    frame = pl.DataFrame(
        {
            "example_id": [f"e{index}" for index in range(40)] + [f"e{index}" for index in range(size)],
            "cluster": names + [f"other{index}" for index in range(size, 40)] + names,
            "method": ["window"] * 40 + ["asl"] * size,
            "spearman": [0.5] * 40 + values.tolist(),
        }
    )
    found = mean_intervals(frame, ["method"], ["spearman"], cluster=None if units is None else "cluster")
    (row,) = found.filter(pl.col("method") == "asl").to_dicts()
    units = np.arange(size) if units is None else np.array(units)
    expected = slow_cluster_interval(values, units)
    assert (row["spearman_ci_low"], row["spearman_ci_high"]) == pytest.approx(expected, abs=1e-6)
    if "n_clusters" in row:  # resampled by cluster: its own clusters, not the frame's
        assert row["n_clusters"] == len(set(units))


def slow_cluster_interval(values: np.ndarray, units: np.ndarray) -> tuple[float, float]:
    """The cluster bootstrap's percentile interval drawn the slow way: each resample draws C of the C
    clusters (``units``: each value's, 0..C-1) from rankkit's seeded generator and averages every
    value of each cluster drawn, as often as it is drawn."""
    count = units.max() + 1
    draws = np.random.default_rng(0).integers(0, count, size=(9999, count))
    resampled = [np.concatenate([values[units == unit] for unit in drawn]).mean() for drawn in draws]
    return tuple(np.percentile(resampled, [2.5, 97.5]))


def test_each_metric_counts_the_examples_its_mean_is_over():
    """Spearman is NaN on 4 of 6 examples (constant scores): its mean and count are over the other 2,
    where n_examples counts the 6 rows with any metric; a table shows its own n beside it."""
    from rich.console import Console

    from rankkit.tables import frame_table

    spearman = [None, None, None, None, 0.9, 1.0]
    frame = pl.DataFrame(
        {"example_id": [f"e{index}" for index in range(6)], "method": ["m"] * 6,
         "spearman": spearman, "recall_at_10": [0.1 * index for index in range(6)]},
        schema_overrides={"spearman": pl.Float64},
    )  # fmt: skip
    (row,) = mean_intervals(frame, ["method"], ["spearman", "recall_at_10"]).to_dicts()
    had = [value for value in spearman if value is not None]
    assert (row["spearman"], row["spearman_n"]) == (pytest.approx(np.mean(had)), len(had))
    assert (row["recall_at_10_n"], row["n_examples"]) == (6, 6)
    assert row_with_interval(row, "spearman").endswith(" n=2")
    assert row_with_interval(row, "recall_at_10").endswith("]")  # its n is the row's
    assert row_with_interval(row, "spearman", unit=0.5, digits=1) == "1.9 [1.8, 2.0] n=2"
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(frame_table(pl.DataFrame([row]), "t"))
    shown = console.export_text()
    assert re.search(r"0\.95 \[0\.90, 1\.00\] n=2", shown) and "spearman_n" not in shown


def test_paired_differences_over_clusters_test_each_clusters_mean():
    first = np.array([0.5, 0.6, 0.7, 0.2, 0.9, 0.4, 0.8])
    second = np.array([0.4, 0.4, 0.6, 0.3, 0.5, 0.3, 0.5])
    clusters = ["a", "a", "b", "c", "d", "e", "e"]
    found = paired_difference(first, second, clusters)
    means = np.array([0.15, 0.1, -0.1, 0.4, 0.2])  # each cluster's mean difference
    assert (found["n_examples"], found["n_clusters"]) == (7, 5)
    assert found["p_value"] == pytest.approx(scipy_stats.wilcoxon(means).pvalue)
    # a cluster of three whose mean ranks lowest but whose sum would rank highest
    first, second = np.array([0.5, 0.5, 0.5, 0.1, 0.9, 0.6, 0.2]), np.array([0.4, 0.4, 0.4, 0.3, 0.6, 0.2, 0.7])
    clusters = ["a", "a", "a", "b", "c", "d", "e"]
    found = paired_difference(first, second, clusters)
    means = np.array([0.1, -0.2, 0.3, 0.4, -0.5])
    assert (found["n_examples"], found["n_clusters"]) == (7, 5)
    assert found["p_value"] == pytest.approx(scipy_stats.wilcoxon(means).pvalue)
    interval = slow_cluster_interval(first - second, np.array([0, 0, 0, 1, 2, 3, 4]))
    assert (found["difference_ci_low"], found["difference_ci_high"]) == pytest.approx(interval, abs=1e-6)
    assert found["difference"] == pytest.approx((first - second).mean())
    assert paired_difference(first, second)["n_clusters"] == 7


def test_an_example_without_a_cluster_is_its_own():
    """Stores of which only some record clusters (niah beside RULER in one sweep's frame): the
    examples without one are single samples, not one cluster named None."""
    first = np.array([0.5, 0.6, 0.7, 0.2, 0.9])
    second = np.array([0.4, 0.4, 0.6, 0.3, 0.5])
    alone = paired_difference(first, second, [None] * 5)
    assert alone == paired_difference(first, second)
    mixed = paired_difference(first, second, ["a", "a", None, None, None])
    assert (mixed["n_examples"], mixed["n_clusters"]) == (5, 4)
    assert cluster_numbers(["a", None, "a", None]).tolist() == [0, 1, 0, 2]


@pytest.mark.parametrize("count", [5, 6, 9, 10, 20, 100])
def test_median_interval_is_the_widest_order_statistic_pair_short_of_five_percent(count):
    """Coverage worked out the slow way: the interval [x_(k), x_(n+1-k)] misses the median when k or
    more values lie above it or below it, each with probability P(Binomial(n, ½) < k)."""
    values = np.random.default_rng(count).normal(size=count)
    low, high = median_interval(values)
    ordered = np.sort(values)

    def coverage(k):
        return 1 - 2 * scipy_stats.binom.cdf(k - 1, count, 0.5)

    covering = [k for k in range(1, count // 2 + 1) if coverage(k) >= 0.95]
    if not covering:
        assert (low, high) == (None, None)
        return
    k = max(covering)
    assert (low, high) == (ordered[k - 1], ordered[count - k])
    assert low <= np.median(values) <= high


@pytest.mark.parametrize(
    ("low", "high", "p_value", "expected"),
    [
        (0.01, 0.2, 0.01, "higher"), (-0.3, -0.02, 0.01, "lower"), (-0.01, 0.4, 0.01, None),
        (0.0, 0.2, 0.01, None), (-0.2, 0.0, 0.01, None), (None, None, None, None),
        (0.01, 0.2, 0.05, None), (0.01, 0.2, None, None),  # the interval alone claims nothing
        (0.01, 0.2, math.nan, None), (math.nan, -0.02, 0.01, None),  # nor does a NaN p-value or bound
    ],
)  # fmt: skip
def test_higher_or_lower_only_where_the_interval_excludes_zero_and_p_is_below_five_percent(
    low, high, p_value, expected
):
    assert relation(low, high, p_value) == expected
