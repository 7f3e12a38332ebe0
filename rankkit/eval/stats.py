"""How sure a mean over examples is: confidence intervals and paired tests.

Every mean rankkit reports over examples comes with a 95% interval and its n:

- ``bootstrap_means``: the percentile bootstrap, resampling examples (the unit that varies),
  or whole clusters of examples where examples share a haystack or a needle (the cluster
  bootstrap: a cluster is one sample however many examples it holds), for many quantities
  at once. A quantity an example lacks (NaN) leaves that example out of its mean and its
  resamples; n counts the examples it has. Quantities on the same examples share their
  resamples, so intervals of rankings measured on the same examples move together.
- ``wilson_interval``: the Wilson score interval for a 0/1 score (accuracy), which stays
  inside [0, 1] and is not degenerate at 0 or 1 as a bootstrap of n identical scores is; a
  score in [0, 1] whose bootstrap interval collapses (every value the same, e.g. a partial
  credit of 0 everywhere) gets it too, over its independent samples.
- ``paired_difference``: the mean difference of two rankings over the same examples, its
  bootstrap interval and the Wilcoxon signed-rank p-value; ``relation`` calls one higher or
  lower only where both agree (the interval excludes zero and p < 0.05).

Fewer than two values give no interval (NaN): one example says nothing about spread. With
fewer than about ten examples the percentile bootstrap is too narrow (it cannot see spread
the sample does not show) and the Wilcoxon test cannot reach p < 0.05 below six pairs:
read such intervals as a lower bound on the uncertainty.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

import numpy as np
import polars as pl

from rankkit.errors import RankkitError

CONFIDENCE = 0.95
RESAMPLES = 9999  # scipy.stats.bootstrap's default
SEED = 0  # fixed: the same data give the same interval


_RESAMPLES_PER_BATCH = 1000  # bounds the float copy a product works on


@lru_cache(maxsize=4)
def _resample_counts(num_examples: int) -> np.ndarray:
    """uint16 [RESAMPLES, n]: how often each example is drawn in each resample (n draws with
    replacement), from one seeded generator; cached, as compare asks for the same n many times."""
    rng = np.random.default_rng(SEED)
    draws = rng.integers(0, num_examples, size=(RESAMPLES, num_examples))
    rows = np.arange(RESAMPLES)[:, np.newaxis] * num_examples
    counts = np.bincount((rows + draws).ravel(), minlength=RESAMPLES * num_examples)
    return counts.reshape(RESAMPLES, num_examples).astype(np.uint16 if num_examples < 2**16 else np.uint32)


def _resample_batches(num_examples: int):
    """``_resample_counts`` as float32 batches of ``_RESAMPLES_PER_BATCH`` rows (counts are exact)."""
    counts = _resample_counts(num_examples)
    for start in range(0, RESAMPLES, _RESAMPLES_PER_BATCH):
        yield counts[start : start + _RESAMPLES_PER_BATCH].astype(np.float32)


def bootstrap_means(
    values: np.ndarray, clusters: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Mean, interval low, interval high and n of every column of ``values`` [examples, quantities].

    NaN marks a value an example lacks. Each column is resampled over the examples that have it
    alone: n draws with replacement from its n examples, as if the others were not in the frame
    (drawing from every example would give a column on 4 of 44 a random number of its own
    values, and an interval that depends on unrelated rows). Columns present on the same
    examples share their resamples, so rankings measured on the same examples move together.
    The interval is the 2.5th and 97.5th percentile of the resampled means over ``RESAMPLES``
    resamples. ``clusters`` [examples] numbers each example's cluster: a resample then draws
    the column's C clusters with replacement and takes every example of a drawn cluster as
    often as it is drawn. Columns with values in fewer than two examples (clusters) get a NaN
    interval.
    """
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2:
        raise ValueError(f"values must be [examples, quantities], got shape {values.shape}")
    present = ~np.isnan(values)
    counts = present.sum(axis=0)
    filled = np.where(present, values, 0.0)
    with np.errstate(invalid="ignore"):  # 0 / 0: a column no example has
        means = filled.sum(axis=0) / counts
    low = np.full(values.shape[1], np.nan)
    high = np.full(values.shape[1], np.nan)
    # Resample the deviations from each mean in float32, at twice float64's speed: their
    # rounding is a millionth of the interval's width, and a constant stays exact.
    deviations = np.where(present, filled - means, 0.0).astype(np.float32)
    has, sizes = present, None  # sizes: how many of a column's examples each unit holds (None: one)
    if clusters is not None:  # a cluster's examples always enter together: resample their sums
        deviations = _cluster_sums(deviations, clusters)
        sizes = _cluster_sums(present, clusters).astype(np.float32)
        has = sizes > 0
    units = has.sum(axis=0)
    spread = np.flatnonzero(units >= 2)
    # Each column's own units first, in order (a stable sort of the missing ones to the end): a
    # resample of C units then draws positions 0..C-1, the same positions for every column of C
    # units, so columns on the same examples share their resamples and one product serves all.
    order = np.argsort(~has[:, spread], axis=0, kind="stable")
    tail = (1 - CONFIDENCE) / 2 * 100
    for size in np.unique(units[spread]):
        chosen = units[spread] == size
        columns, rows = spread[chosen], order[:size, chosen]
        own = np.take_along_axis(deviations[:, columns], rows, axis=0)
        own_sizes = None if sizes is None else np.take_along_axis(sizes[:, columns], rows, axis=0)
        batches = []
        for weights in _resample_batches(int(size)):
            drawn = weights.sum(axis=1, keepdims=True) if own_sizes is None else weights @ own_sizes
            batches.append((weights @ own) / drawn)
        low[columns], high[columns] = np.percentile(np.concatenate(batches), [tail, 100 - tail], axis=0)
    # Every resample's mean lies within the column's values; the float32 rounding above can step
    # a hair outside (a share's interval from -1e-9), so the bounds are held inside them.
    low = np.maximum(low + means, np.where(present, values, np.inf).min(axis=0, initial=np.inf))
    high = np.minimum(high + means, np.where(present, values, -np.inf).max(axis=0, initial=-np.inf))
    return means, low, high, counts


def cluster_numbers(names: Sequence[Any]) -> np.ndarray | None:
    """Each example's cluster as a number 0..C-1 (in first-seen order), from its cluster's name;
    None when every example is its own cluster (nothing to resample together). An example without a
    cluster (None: a frame joining stores of which only some record clusters) is its own."""
    names = [(index,) if name is None else str(name) for index, name in enumerate(names)]
    numbers = {name: number for number, name in enumerate(dict.fromkeys(names))}
    return np.array([numbers[name] for name in names]) if len(numbers) < len(names) else None


def _cluster_sums(values: np.ndarray, clusters: np.ndarray) -> np.ndarray:
    """Per cluster 0..C-1 (``clusters`` numbers each example's), the sum of its examples' rows of
    ``values`` [examples, quantities] (of a bool, how many are true)."""
    grouped = np.argsort(clusters)
    _, starts = np.unique(clusters[grouped], return_index=True)
    return np.add.reduceat(values[grouped], starts)  # along the examples, numpy's default axis


def cluster_counts(present: np.ndarray, clusters: np.ndarray) -> np.ndarray:
    """Per column of ``present`` [examples, quantities], how many clusters have a value."""
    return (_cluster_sums(present, clusters) > 0).sum(axis=0)


@contextmanager
def made_ahead(num_examples: int) -> Iterator[None]:
    """Inside, a thread makes the resample counts intervals over ``num_examples`` examples will
    need (half a second at a thousand) while the caller waits on other processes; leaving waits
    for it. The thread imports nothing: an import in a thread can deadlock with one in the
    caller (numba imports scipy.linalg when it loads a kernel)."""
    import numpy.random  # noqa: F401  (numpy loads it on first use: here, not in the thread)

    thread = threading.Thread(
        target=_resample_counts, args=(num_examples,), name="rankkit-intervals", daemon=True
    )
    thread.start()
    try:
        yield
    finally:
        thread.join()


_Z = 1.959963984540054  # the standard normal's 97.5th percentile: a 95% interval


def wilson_interval(successes: float, trials: float) -> tuple[float, float]:
    """The Wilson score interval of a proportion, as ``scipy.stats.binomtest(...).proportion_ci(method="wilson")``
    gives it for whole counts; ``successes`` may be a sum of partial credits. NaN without trials."""
    if trials == 0:
        return np.nan, np.nan
    share = successes / trials
    center = (share + _Z**2 / (2 * trials)) / (1 + _Z**2 / trials)
    half = _Z / (1 + _Z**2 / trials) * math.sqrt(share * (1 - share) / trials + _Z**2 / (4 * trials**2))
    return max(0.0, center - half), min(1.0, center + half)


def is_binary(values: np.ndarray) -> bool:
    """True when every present value is 0 or 1 (a right/wrong score)."""
    present = values[~np.isnan(values)]
    return bool(np.isin(present, (0.0, 1.0)).all())


def interval_columns(metric: str) -> tuple[str, str]:
    """The names of a metric's interval columns: ``<metric>_ci_low``, ``<metric>_ci_high``."""
    return f"{metric}_ci_low", f"{metric}_ci_high"


def count_column(metric: str) -> str:
    """The name of a metric's own count column, ``<metric>_n``: the examples its mean is over, which
    ``n_examples`` (rows with any metric) overstates for a metric some examples lack."""
    return f"{metric}_n"


EXAMPLE_ID = "example_id"  # the column naming each example in every per-example frame a user joins
CLUSTER = "cluster"  # the column naming each example's cluster: the examples sharing a haystack or a needle
# Each example's share of its evidence kept (offline, by a ranking; online, by a run) or found: a score, so
# none kept anywhere is not "0.00 [0.00, 0.00]"; with an answer's accuracy, what means treat as scores.
SHARES = ("needle_recall", "evidence_kept", "evidence_kept_offline")
# compare's recall_at_X, each example's share of the oracle's top X% in the ranking's top X%: a share too
TOP_K_RECALL = "recall_at_"
ACCURACY = "accuracy"


def scores_among(metrics: Sequence[str]) -> list[str]:
    """The ``metrics`` that ``mean_intervals`` takes as scores (``scores``): accuracy and the shares.
    The one rule of compare's, bench's and report's means."""
    return [name for name in metrics if name == ACCURACY or name in SHARES or name.startswith(TOP_K_RECALL)]


def cluster_column(frame: pl.DataFrame) -> str | None:
    """``CLUSTER`` when ``frame`` names a cluster for any of its examples: intervals then resample
    clusters (an example without one is its own sample, ``cluster_numbers``); None when it names none."""
    return CLUSTER if CLUSTER in frame.columns and frame[CLUSTER].null_count() < frame.height else None


def mean_intervals(
    frame: pl.DataFrame,
    by: Sequence[str],
    metrics: Sequence[str],
    *,
    example: str = EXAMPLE_ID,
    cluster: str | None = None,
    scores: Sequence[str] = (),
) -> pl.DataFrame:
    """Per group of ``by`` (in first-seen order): each metric's mean over the group's rows, its
    interval (``interval_columns``), its own count (``count_column``) and ``n_examples`` (rows
    with any metric). Rows are
    examples; a group with two rows of one ``example`` is refused (``RankkitError``).
    ``cluster`` names the column holding each example's cluster (examples sharing a haystack or
    a needle): the bootstrap then resamples clusters, and ``n_clusters`` counts the independent
    samples beside ``n_examples``.

    A score (one of ``scores``) gets the Wilson interval over its independent samples when its
    values are all 0 or 1 and no two examples share a cluster (a right/wrong count), or when
    its bootstrap interval collapses (a constant, e.g. a partial credit of 0 everywhere), and
    only over two or more samples (one cluster, or one example, gets no interval); every other
    metric the bootstrap (``bootstrap_means``, resampling the group's examples that have the
    metric), even when its values happen to be 0 or 1
    (full prefill's TTFT ratio is 1 on every example: a constant, not a proportion).
    """
    if not frame.height:
        return pl.DataFrame()
    groups = frame.select(by).unique(maintain_order=True).with_row_index("_group")
    examples = frame.select(example).unique(maintain_order=True).with_row_index("_example")
    indexed = frame.join(groups, on=list(by), how="left", nulls_equal=True).join(
        examples, on=example, how="left", nulls_equal=True
    )
    repeated = indexed.filter(pl.struct("_group", "_example").is_duplicated())
    if repeated.height:  # the grid below would keep one of them, unseen
        row = repeated.row(0, named=True)
        group = ", ".join(f"{key} {row[key]}" for key in by)
        raise RankkitError(
            f"{example} {row[example]} has more than one row in the group of {group}: a mean counts each "
            "example once; keep one row per example (one layer setting of a sweep, say)"
        )
    rows, columns = indexed["_example"].to_numpy(), indexed["_group"].to_numpy()
    clusters = None
    if cluster is not None:
        clusters = cluster_numbers(indexed.unique("_example", keep="first").sort("_example")[cluster])
    result = groups.drop("_group")
    grids = np.full((examples.height, len(metrics), groups.height), np.nan)
    for index, metric in enumerate(metrics):
        grids[rows, index, columns] = indexed[metric].cast(pl.Float64).fill_null(np.nan).to_numpy()
    present = ~np.isnan(grids)
    # every metric in one bootstrap: one pass over the shared resamples
    found = bootstrap_means(grids.reshape(examples.height, -1), clusters)
    means, low, high, counts = (values.reshape(len(metrics), groups.height) for values in found)
    units = counts if clusters is None else cluster_counts(present.reshape(examples.height, -1), clusters)
    units = units.reshape(len(metrics), groups.height)
    for index, metric in enumerate(metrics):
        counted = clusters is None and is_binary(grids[:, index])
        for group in range(groups.height) if metric in scores else ():
            collapsed = not low[index, group] < high[index, group]  # equal, or NaN: one sample
            # one independent sample has no interval, whatever its examples' scores: n is 1
            if units[index, group] >= 2 and (counted or collapsed):
                samples = units[index, group]
                low[index, group], high[index, group] = wilson_interval(
                    means[index, group] * samples, samples
                )
        low_name, high_name = interval_columns(metric)
        result = result.with_columns(
            pl.Series(metric, means[index]).fill_nan(None),
            pl.Series(low_name, low[index]).fill_nan(None),
            pl.Series(high_name, high[index]).fill_nan(None),
            pl.Series(count_column(metric), counts[index], dtype=pl.Int32),
        )
    has_any = present.any(axis=1)
    result = result.with_columns(pl.Series("n_examples", has_any.sum(axis=0), dtype=pl.Int32))
    if cluster is None:
        return result
    samples = has_any.sum(axis=0) if clusters is None else cluster_counts(has_any, clusters)
    return result.with_columns(pl.Series("n_clusters", samples, dtype=pl.Int32))


def paired_difference(
    first: np.ndarray, second: np.ndarray, clusters: Sequence[Any] | None = None
) -> dict[str, Any]:
    """``first - second`` over the examples that have both (NaN elsewhere): the mean difference, its
    bootstrap interval, the Wilcoxon signed-rank p-value (two-sided; None below two
    differences or when every difference is zero) and n. With ``clusters`` (each example's
    cluster name) the bootstrap resamples clusters and the test ranks each cluster's mean
    difference: examples of one cluster are one sample (``n_clusters``; ``n_examples`` without)."""
    return paired_differences([(first, second)], [clusters])[0]


def paired_differences(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]], clusters: Sequence[Sequence[Any] | None] | None = None
) -> list[dict[str, Any]]:
    """``paired_difference`` of every (first, second) pair, ``clusters[i]`` naming the clusters of
    pair i's examples. Unclustered pairs with as many shared examples share one bootstrap call
    (the resamples depend only on that number), which costs as much as one."""
    differences, numbers = [], []
    for index, (first, second) in enumerate(pairs):
        difference = np.subtract(first, second, dtype=np.float64)  # bools too (a correct column)
        shared = ~np.isnan(difference)
        differences.append(difference[shared])
        names = None if clusters is None or clusters[index] is None else np.asarray(clusters[index])[shared]
        numbers.append(None if names is None or not names.size else cluster_numbers(names))
    by_count: dict[int, list[int]] = {}
    for index, difference in enumerate(differences):
        if numbers[index] is None:
            by_count.setdefault(difference.size, []).append(index)
    batches = [(indices, None) for indices in by_count.values()]
    batches += [([index], numbers[index]) for index in range(len(differences)) if numbers[index] is not None]
    rows: list[dict[str, Any]] = [{} for _ in differences]
    for indices, grouped in batches:
        count = differences[indices[0]].size
        stacked = np.stack([differences[index] for index in indices], axis=1).reshape(count, len(indices))
        for column, (mean, low, high) in enumerate(zip(*bootstrap_means(stacked, grouped)[:3], strict=True)):
            rows[indices[column]] = _paired_row(differences[indices[column]], mean, low, high, grouped)
    return rows


def _paired_row(difference: np.ndarray, mean, low, high, clusters: np.ndarray | None) -> dict[str, Any]:
    finite = lambda value: None if np.isnan(value) else float(value)  # noqa: E731
    samples = difference
    if clusters is not None:  # one difference per cluster: its mean
        samples = np.bincount(clusters, weights=difference) / np.bincount(clusters)
    p_value = wilcoxon_p_value(samples) if samples.size >= 2 and np.any(samples != 0) else None
    return {
        "difference": finite(mean),
        "difference_ci_low": finite(low),
        "difference_ci_high": finite(high),
        "p_value": p_value,
        "n_examples": difference.size,
        "n_clusters": samples.size,
    }


EXACT_WILCOXON_LIMIT = 50  # scipy.stats.wilcoxon's "auto": its exact or permutation test up to here


def wilcoxon_p_value(differences: np.ndarray) -> float:
    """The two-sided Wilcoxon signed-rank p-value of paired ``differences``, as
    ``scipy.stats.wilcoxon(differences).pvalue`` gives it (zeros dropped, no continuity correction).

    Past ``EXACT_WILCOXON_LIMIT`` differences scipy's test is the normal approximation with the
    tie correction, worked out here: importing scipy.stats takes longer than the whole tail of
    a thousand-example comparison. Smaller samples get scipy's exact or permutation test.
    """
    differences = np.asarray(differences)
    if differences.size <= EXACT_WILCOXON_LIMIT:
        from scipy import stats  # imported when used, as in ``wilson_interval``

        return float(stats.wilcoxon(differences).pvalue)
    from rankkit.eval.ranking import average_ranks

    nonzero = differences[differences != 0]
    count = nonzero.size
    magnitudes = np.abs(nonzero)
    positive_rank_sum = average_ranks(magnitudes)[nonzero > 0].sum()
    ties = np.unique(magnitudes, return_counts=True)[1].astype(np.float64)
    mean = count * (count + 1) / 4
    variance = (count * (count + 1) * (2 * count + 1) - (ties**3 - ties).sum() / 2) / 24
    z = (positive_rank_sum - mean) / np.sqrt(variance)
    return float(math.erfc(abs(z) / math.sqrt(2)))


def median_interval(values: Sequence[float]) -> tuple[float | None, float | None]:
    """A distribution-free interval of at least 95% for the median of ``values``: the order statistics
    x_(k) and x_(n+1-k) for the largest k with 2·P(Binomial(n, ½) < k) ≤ 5%, since each value lies
    below the median with probability ½. It needs six values (with five, [min, max] covers the median
    only 94% of the time): fewer give (None, None)."""
    ordered = sorted(values)
    count = len(ordered)
    below = 0  # P(Binomial(count, ½) < k) for the k tried, times 2**count
    widest = None
    for k in itertools.count(1):  # ends by k = count // 2 + 1, where below reaches half of 2**count
        below += math.comb(count, k - 1)
        if 2 * below / 2**count > 1 - CONFIDENCE:
            break
        widest = k
    if widest is None:
        return None, None
    return ordered[widest - 1], ordered[count - widest]


SIGNIFICANCE = 0.05  # the p-value below which a paired difference counts as significant


def relation(low: float | None, high: float | None, p_value: float | None) -> str | None:
    """"higher" or "lower" when a paired difference's 95% interval [low, high] lies wholly above or
    below zero and its Wilcoxon p-value is below ``SIGNIFICANCE``, else None: the one rule by which
    rankkit's written findings call one method higher or lower than another. The interval alone
    is not enough: a difference equal on every example has a zero-width bootstrap interval (two
    examples of +1 give [1, 1]) though the test cannot tell it from chance (p = 0.5)."""
    if any(value is None or math.isnan(value) for value in (low, high, p_value)):
        return None
    if p_value >= SIGNIFICANCE:
        return None
    if low > 0:
        return "higher"
    if high < 0:
        return "lower"
    return None


NO_INTERVAL = "[–]"  # beside a mean without an interval: a bare figure would look precise


def with_interval(value: float | None, low: float | None, high: float | None, digits: int = 2) -> str:
    """ "0.62 [0.55, 0.69]": a mean and its interval as tables show them; "0.62 [–]" when the mean
    has no interval (``NO_INTERVAL``); "–" when there is no mean."""
    if value is None:
        return "–"
    if low is None or high is None:
        return f"{value:.{digits}f} {NO_INTERVAL}"
    return f"{value:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def row_with_interval(row: Mapping[str, Any], metric: str, *, unit: float = 1.0, digits: int = 2) -> str:
    """``with_interval`` of ``metric`` in ``row`` (a summary's row: the mean and its interval columns),
    each value divided by ``unit`` (2**20 shows bytes in MiB), and "n=2" after it where the metric's
    own count (``count_column``) is not the row's ``n_examples``."""
    values = (row[column] for column in (metric, *interval_columns(metric)))
    shown = with_interval(*(None if value is None else value / unit for value in values), digits=digits)
    count = row.get(count_column(metric))
    return shown if count is None or count == row.get("n_examples") else f"{shown} n={count}"
