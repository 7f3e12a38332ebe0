"""How sure a mean over examples is: confidence intervals and paired tests.

Every mean rankkit reports over examples comes with a 95% interval and its n:

- ``bootstrap_means``: the percentile bootstrap, resampling examples (the unit that varies),
  for many quantities at once. All quantities share the same resamples, so intervals of
  rankings measured on the same examples move together, as they should. A quantity an
  example lacks (NaN) leaves that example out of its mean; n counts the examples it has.
- ``wilson_interval``: the Wilson score interval for a 0/1 score (accuracy), which stays
  inside [0, 1] and is not degenerate at 0 or 1 as a bootstrap of n identical scores is.
- ``paired_difference``: the mean difference of two rankings over the same examples, its
  bootstrap interval and the Wilcoxon signed-rank p-value.

Fewer than two values give no interval (NaN): one example says nothing about spread. With
fewer than about ten examples the percentile bootstrap is too narrow (it cannot see spread
the sample does not show) and the Wilcoxon test cannot reach p < 0.05 below six pairs:
read such intervals as a lower bound on the uncertainty.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

import numpy as np
import polars as pl

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


def bootstrap_means(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Mean, interval low, interval high and n of every column of ``values`` [examples, quantities].

    NaN marks a value an example lacks. A resample's mean of a column is the weighted mean of
    the examples it drew that have the value; the interval is the 2.5th and 97.5th percentile
    of those means over ``RESAMPLES`` resamples (resamples without any such example are
    skipped). Columns with fewer than two values get a NaN interval.
    """
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2:
        raise ValueError(f"values must be [examples, quantities], got shape {values.shape}")
    present = ~np.isnan(values)
    counts = present.sum(axis=0)
    filled = np.where(present, values, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = filled.sum(axis=0) / counts
    low = np.full(values.shape[1], np.nan)
    high = np.full(values.shape[1], np.nan)
    spread = counts >= 2
    if spread.any():
        has = present[:, spread]
        # Resample the deviations from each mean in float32, at twice float64's speed: their
        # rounding is a millionth of the interval's width, and a constant stays exact.
        deviations = np.where(has, filled[:, spread] - means[spread], 0.0).astype(np.float32)
        gaps = ~has.all(axis=0)  # only columns with a missing value need their own denominators
        batches = []
        for weights in _resample_batches(values.shape[0]):
            denominators = np.broadcast_to(
                weights.sum(axis=1, keepdims=True), (weights.shape[0], deviations.shape[1])
            ).copy()
            denominators[:, gaps] = weights @ has[:, gaps].astype(np.float32)
            with np.errstate(invalid="ignore", divide="ignore"):
                batches.append((weights @ deviations) / denominators)
        resampled = np.concatenate(batches)
        tail = (1 - CONFIDENCE) / 2 * 100
        # A resample lacks a column's mean only where that column lacks values; numpy's
        # percentile is vectorized, its NaN-skipping one goes column by column.
        skipped = np.isnan(resampled).any(axis=0)
        if skipped.any():
            bounds = np.empty((2, resampled.shape[1]))
            bounds[:, ~skipped] = np.percentile(resampled[:, ~skipped], [tail, 100 - tail], axis=0)
            bounds[:, skipped] = np.nanpercentile(resampled[:, skipped], [tail, 100 - tail], axis=0)
        else:  # no copy of the resamples
            bounds = np.percentile(resampled, [tail, 100 - tail], axis=0)
        low[spread], high[spread] = bounds + means[spread]
    return means, low, high, counts


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


def wilson_interval(successes: int, trials: int) -> tuple[float, float]:
    """The Wilson score interval of a proportion (``scipy.stats.binomtest``); NaN without trials."""
    from scipy import stats  # imported when used: it takes a second, longer than most analyses

    if trials == 0:
        return np.nan, np.nan
    interval = stats.binomtest(int(successes), int(trials)).proportion_ci(CONFIDENCE, method="wilson")
    return float(interval.low), float(interval.high)


def is_binary(values: np.ndarray) -> bool:
    """True when every present value is 0 or 1 (a right/wrong score)."""
    present = values[~np.isnan(values)]
    return bool(np.isin(present, (0.0, 1.0)).all())


def interval_columns(metric: str) -> tuple[str, str]:
    """The names of a metric's interval columns: ``<metric>_ci_low``, ``<metric>_ci_high``."""
    return f"{metric}_ci_low", f"{metric}_ci_high"


def mean_intervals(
    frame: pl.DataFrame,
    by: Sequence[str],
    metrics: Sequence[str],
    *,
    example: str = "example",
    scores: Sequence[str] = (),
) -> pl.DataFrame:
    """Per group of ``by`` (in first-seen order): each metric's mean over the group's rows, its
    interval (``interval_columns``) and ``n_examples`` (rows with any metric). Rows are
    examples; a group has at most one row per ``example``.

    A right/wrong score (one of ``scores``) whose values are all 0 or 1 gets the Wilson
    interval; every other metric the bootstrap (``bootstrap_means``, resampling the frame's
    examples, the same resamples for every group), even when its values happen to be 0 or 1
    (full prefill's TTFT ratio is 1 on every example: a constant, not a proportion).
    """
    if not frame.height:
        return pl.DataFrame()
    groups = frame.select(by).unique(maintain_order=True).with_row_index("_group")
    examples = frame.select(example).unique(maintain_order=True).with_row_index("_example")
    indexed = frame.join(groups, on=list(by), how="left", nulls_equal=True).join(
        examples, on=example, how="left", nulls_equal=True
    )
    rows, columns = indexed["_example"].to_numpy(), indexed["_group"].to_numpy()
    result = groups.drop("_group")
    grids = np.full((examples.height, len(metrics), groups.height), np.nan)
    for index, metric in enumerate(metrics):
        grids[rows, index, columns] = indexed[metric].cast(pl.Float64).fill_null(np.nan).to_numpy()
    # every metric in one bootstrap: one pass over the shared resamples
    found = bootstrap_means(grids.reshape(examples.height, -1))
    means, low, high, counts = (values.reshape(len(metrics), groups.height) for values in found)
    for index, metric in enumerate(metrics):
        grid = grids[:, index]
        for group in range(groups.height) if metric in scores and is_binary(grid) else ():
            low[index, group], high[index, group] = wilson_interval(
                np.nansum(grid[:, group]), counts[index, group]
            )
        low_name, high_name = interval_columns(metric)
        result = result.with_columns(
            pl.Series(metric, means[index]).fill_nan(None),
            pl.Series(low_name, low[index]).fill_nan(None),
            pl.Series(high_name, high[index]).fill_nan(None),
        )
    has_any = (~np.isnan(grids)).any(axis=1)
    return result.with_columns(pl.Series("n_examples", has_any.sum(axis=0), dtype=pl.Int32))


def paired_difference(first: np.ndarray, second: np.ndarray) -> dict[str, Any]:
    """``first - second`` over the examples that have both (NaN elsewhere): the mean difference, its
    bootstrap interval, the Wilcoxon signed-rank p-value (two-sided; None below two
    differences or when every difference is zero) and n."""
    return paired_differences([(first, second)])[0]


def paired_differences(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[dict[str, Any]]:
    """``paired_difference`` of every (first, second) pair. Pairs with as many shared examples share
    one bootstrap call (the resamples depend only on that number), which costs as much as one."""
    differences = []
    for first, second in pairs:
        difference = np.asarray(first, dtype=np.float64) - np.asarray(second, dtype=np.float64)
        differences.append(difference[~np.isnan(difference)])
    by_count: dict[int, list[int]] = {}
    for index, difference in enumerate(differences):
        by_count.setdefault(difference.size, []).append(index)
    rows: list[dict[str, Any]] = [{} for _ in differences]
    finite = lambda value: None if np.isnan(value) else float(value)  # noqa: E731
    for count, indices in by_count.items():
        stacked = np.stack([differences[index] for index in indices], axis=1).reshape(count, len(indices))
        for column, (mean, low, high) in enumerate(zip(*bootstrap_means(stacked)[:3], strict=True)):
            difference = differences[indices[column]]
            p_value = None
            if difference.size >= 2 and np.any(difference != 0):
                p_value = wilcoxon_p_value(difference)
            rows[indices[column]] = {
                "difference": finite(mean),
                "difference_ci_low": finite(low),
                "difference_ci_high": finite(high),
                "p_value": p_value,
                "n_examples": count,
            }
    return rows


EXACT_WILCOXON_LIMIT = 50  # scipy.stats.wilcoxon's "auto": its exact or permutation test up to here


def wilcoxon_p_value(differences: np.ndarray) -> float:
    """The two-sided Wilcoxon signed-rank p-value of paired ``differences``, as
    ``scipy.stats.wilcoxon(differences).pvalue`` gives it (zeros dropped, no continuity correction).

    Past ``EXACT_WILCOXON_LIMIT`` differences scipy's test is the normal approximation with the
    tie correction, worked out here: importing scipy.stats takes longer than the whole tail of
    a thousand-example comparison. Smaller samples get scipy's exact or permutation test.
    """
    differences = np.asarray(differences, dtype=np.float64)
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


def with_interval(value: float | None, low: float | None, high: float | None, digits: int = 2) -> str:
    """ "0.62 [0.55, 0.69]": a mean and its interval as tables show them; "–" when undefined."""
    if value is None:
        return "–"
    if low is None or high is None:
        return f"{value:.{digits}f}"
    return f"{value:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"
