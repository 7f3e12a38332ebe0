"""How well one token ranking agrees with another: rank correlations, top-k overlap, evidence recall.
(The scores the methods rank by come from the methods themselves: ``Method.layer_rankings``.)

Scores carry the tokens on the last axis; any leading axes (layers, heads) are kept, so a
whole ``[layers, kv_heads, T]`` array is scored against a ``[T]`` reference in one call and
each function returns one value per leading index. Which tokens are ranked is the caller's
choice: compare passes the span it ranks (see ``rankkit.eval.compare``).

Higher score = more important everywhere. Top-k sets break ties toward the earlier token, so
results are deterministic. A NaN score (a key a sliding-window layer could not see, or that no
layer of the oracle saw) ranks below every scored token, all NaN tied: a layer that cannot
see a token can never select it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def keep_count(keep: float | int, num_tokens: int) -> int:
    """How many of ``num_tokens`` a budget keeps: a keep rate (a float in (0, 1]) or a token count
    (an int), rounded as every method rounds its budget (``Budget.resolve``)."""
    from rankkit.methods.base import Budget

    return Budget.parse(keep).resolve(num_tokens)


def unscored_last(scores: np.ndarray) -> np.ndarray:
    """``scores`` with NaN (no score) replaced by -inf, so unscored tokens rank last."""
    values = np.asarray(scores)
    return np.where(np.isnan(values), -np.inf, values) if np.isnan(values).any() else values


class TieRuns:
    """One unstable (fast, SIMD) ascending sort of every row, and the run of equal scores each
    sorted position belongs to. Run ids are global and increase along the flattened rows; no
    run crosses a row, since every row starts a new one. Average and dense ranks and the tied
    pairs all come from it, so a score array is sorted once for them."""

    def __init__(self, scores: np.ndarray):
        values = unscored_last(scores)
        self.shape = values.shape
        self.order = np.argsort(values, axis=-1)
        ascending = np.take_along_axis(values, self.order, axis=-1)
        run_starts = np.ones(values.shape, dtype=bool)
        run_starts[..., 1:] = ascending[..., 1:] != ascending[..., :-1]
        self.run_ids = (np.cumsum(run_starts, axis=None) - 1).reshape(values.shape)

    def average_ranks(self) -> np.ndarray:
        # A run gets the mean of the 1-based positions it spans, whatever order the sort left it in.
        positions = np.broadcast_to(np.arange(1.0, self.shape[-1] + 1), self.shape).ravel()
        run_ids = self.run_ids.ravel()
        run_means = np.bincount(run_ids, weights=positions) / np.bincount(run_ids)
        ranks = np.empty(self.shape, dtype=np.float64)
        np.put_along_axis(ranks, self.order, run_means[self.run_ids], axis=-1)
        return ranks

    def dense_ranks(self) -> np.ndarray:
        """Ranks 0, 1, ... along the last axis with ties sharing one rank and no gaps."""
        row_first_run = self.run_ids[..., :1]
        ranks = np.empty(self.shape, dtype=np.int64)
        np.put_along_axis(ranks, self.order, self.run_ids - row_first_run, axis=-1)
        return ranks

    def tied_pairs(self) -> np.ndarray:
        """Pairs of tokens with equal scores, per row (Kendall's n_1 or n_2)."""
        return _tied_pairs(self.run_ids)


def _tied_pairs(run_ids: np.ndarray) -> np.ndarray:
    """Pairs sharing a run, per row, from global run ids numbered row after row (as ``TieRuns``)."""
    run_sizes = np.bincount(run_ids.ravel())
    row_first_runs = run_ids[..., 0].ravel()
    pairs_per_run = run_sizes * (run_sizes - 1) // 2
    # A row's runs are consecutive, so its pairs are a slice of the cumulative sum.
    cumulative = np.concatenate([[0], np.cumsum(pairs_per_run)])
    row_ends = np.append(row_first_runs[1:], len(run_sizes))
    return (cumulative[row_ends] - cumulative[row_first_runs]).reshape(run_ids.shape[:-1])


def average_ranks(scores: np.ndarray) -> np.ndarray:
    """Ranks 1..T along the last axis, tied scores sharing their average rank: scipy's
    ``rankdata(method="average")`` for NaN-free input, about twice as fast."""
    return TieRuns(scores).average_ranks()


def descending_ranks(scores: np.ndarray) -> np.ndarray:
    """Each token's place in the descending order along the last axis: 0 for the highest score.

    The methods' own rank rule (``rankkit.methods.selection.descending_ranks``): ties go to the
    earlier token, so every row is a permutation of 0..T-1 and the top-k set is
    ``descending_ranks(scores) < k``: exactly k tokens.
    """
    from rankkit.methods.selection import descending_ranks as method_ranks

    return method_ranks(torch.from_numpy(np.ascontiguousarray(unscored_last(scores)))).numpy()


def pearson(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson correlation along the last axis (broadcasting the leading axes); NaN where either side is constant."""
    x_centered = x - x.mean(axis=-1, keepdims=True)
    y_centered = y - y.mean(axis=-1, keepdims=True)
    covariance = (x_centered * y_centered).sum(axis=-1)
    scale = np.sqrt((x_centered**2).sum(axis=-1) * (y_centered**2).sum(axis=-1))
    with np.errstate(divide="ignore", invalid="ignore"):
        correlation = covariance / scale
    # Rounding can push |r| a hair past 1; scipy clips the same way.
    return np.clip(np.where(scale > 0, correlation, np.nan), -1.0, 1.0)


def spearman(scores: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Spearman's rho along the last axis, as ``scipy.stats.spearmanr``: Pearson on average ranks.

    The rank correlation CLAA (Sec. 3.1, Fig. 2) reports against the Answer-Informed Oracle.
    Callers comparing many rankings with one reference should rank the reference once with
    ``average_ranks`` and call ``pearson`` on the ranks.
    """
    return pearson(average_ranks(scores), average_ranks(reference))


def kendall(scores: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Kendall's tau-b along the last axis (ties corrected, as ``scipy.stats.kendalltau``); NaN for a constant side.

    Callers comparing many rankings with one reference should build the reference's
    ``TieRuns`` once and call ``kendall_from_runs``.
    """
    scores, reference = np.broadcast_arrays(np.asarray(scores), np.asarray(reference))
    return kendall_from_runs(TieRuns(scores), TieRuns(reference))


def kendall_from_runs(score_runs: TieRuns, reference_runs: TieRuns) -> np.ndarray:
    """Kendall's tau-b of every row of two sorted score arrays (the reference's rows broadcast).

    tau_b = (n_c - n_d) / sqrt((n_0 - n_1)(n_0 - n_2)) with n_0 = T(T-1)/2, n_1 and n_2 the
    pairs tied in either side and n_c - n_d = n_0 - n_1 - n_2 + n_3 - 2 n_d, n_3 the pairs tied
    in both; the discordant pairs n_d are inversions of the score ranks once the tokens are
    ordered by (reference, score), counted for all rows at once by ``_inversions``.
    """
    shape = np.broadcast_shapes(score_runs.shape, reference_runs.shape)
    num_tokens = shape[-1]
    score_dense = np.broadcast_to(score_runs.dense_ranks(), shape).reshape(-1, num_tokens)
    reference_dense = np.broadcast_to(reference_runs.dense_ranks(), shape).reshape(-1, num_tokens)
    joint = np.sort(reference_dense * num_tokens + score_dense, axis=-1)
    discordant = _inversions(joint % num_tokens)
    joint_starts = np.ones(joint.shape, dtype=bool)
    joint_starts[:, 1:] = joint[:, 1:] != joint[:, :-1]
    both_tied = _tied_pairs(np.cumsum(joint_starts, axis=None).reshape(joint.shape) - 1)

    total = num_tokens * (num_tokens - 1) // 2
    score_tied = np.broadcast_to(score_runs.tied_pairs(), shape[:-1]).reshape(-1)
    reference_tied = np.broadcast_to(reference_runs.tied_pairs(), shape[:-1]).reshape(-1)
    concordant_minus_discordant = total - score_tied - reference_tied + both_tied - 2 * discordant
    with np.errstate(divide="ignore", invalid="ignore"):
        tau = concordant_minus_discordant / np.sqrt(total - score_tied) / np.sqrt(total - reference_tied)
    undefined = (score_tied == total) | (reference_tied == total)
    return np.where(undefined, np.nan, np.clip(tau, -1.0, 1.0)).reshape(shape[:-1])


_BRUTE_FORCE_BLOCK = 8  # below this width comparing every pair costs less than a merge pass


def _inversions(values: np.ndarray) -> np.ndarray:
    """Pairs i < j with values[i] > values[j] in every row of a non-negative int array [R, T].

    A bottom-up merge sort over positions, all rows at once. Rows are padded to a power of two
    with a value above all others (padding only ever follows real values, so it adds no
    inversion). Within blocks of ``_BRUTE_FORCE_BLOCK`` every pair is compared; then at each
    level sibling sorted blocks of ``width`` are merged by one stable sort (two sorted runs:
    a linear merge), which puts a left element before an equal right one. A right element
    at merged position p with index r in its block has p - r left elements not above it,
    so it is inverted with width - (p - r) of them. O(T log T) per row in log2(T) passes.
    """
    num_rows, num_tokens = values.shape
    padded_tokens = 1 << max(0, (num_tokens - 1).bit_length())
    pad_value = int(values.max()) + 1 if values.size else 1
    blocks = np.full((num_rows, padded_tokens), pad_value, dtype=np.int64)
    blocks[:, :num_tokens] = values
    width = min(_BRUTE_FORCE_BLOCK, padded_tokens)
    small = blocks.reshape(-1, width)
    later = np.triu(np.ones((width, width), dtype=bool), 1)
    inversions = (
        ((small[:, :, np.newaxis] > small[:, np.newaxis, :]) & later).reshape(num_rows, -1).sum(axis=1)
    )
    blocks = np.sort(small, axis=-1).reshape(num_rows, padded_tokens)
    while width < padded_tokens:
        pairs = blocks.reshape(-1, 2 * width)
        order = np.argsort(pairs, axis=-1, kind="stable")
        right_positions = ((order >= width) * np.arange(2 * width)).sum(axis=-1)
        # sum over right elements of width - p + r = width^2 - sum(p) + width(width - 1)/2
        merged = width * width + width * (width - 1) // 2 - right_positions
        inversions += merged.reshape(num_rows, -1).sum(axis=1)
        blocks = np.take_along_axis(pairs, order, axis=-1).reshape(num_rows, padded_tokens)
        width *= 2
    return inversions


def top_k_mask(scores: np.ndarray, k: int) -> np.ndarray:
    """True for the k highest-scoring tokens along the last axis; ties go to the earlier token."""
    return descending_ranks(scores) < k


def overlap_share(kept: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Share of the target tokens that are kept, along the last axis (boolean masks); NaN without targets."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return (kept & targets).sum(axis=-1) / targets.sum(axis=-1)


def topk_recall(scores: np.ndarray, reference: np.ndarray, keep: float | int) -> np.ndarray:
    """Share of the reference's top-k tokens that the scores' top-k also keeps (k from ``keep_count``)."""
    k = keep_count(keep, np.shape(scores)[-1])
    return overlap_share(top_k_mask(scores, k), top_k_mask(reference, k))


def spans_mask(spans: Sequence[Sequence[int]], num_tokens: int) -> np.ndarray:
    """Boolean [T] mask of the tokens inside any [start, end) span; spans are clipped to [0, T)."""
    mask = np.zeros(num_tokens, dtype=bool)
    for start, end in spans:
        mask[max(0, start) : max(0, min(end, num_tokens))] = True
    return mask


def needle_recall(scores: np.ndarray, evidence: np.ndarray, keep: float | int) -> np.ndarray:
    """Share of the evidence tokens (a boolean [T] mask, see ``spans_mask``) inside the scores' top-k.

    NaN when there is no evidence token: the example has nothing to find.
    """
    kept = top_k_mask(scores, keep_count(keep, np.shape(scores)[-1]))
    return overlap_share(kept, np.asarray(evidence, dtype=bool))
