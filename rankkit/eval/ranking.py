"""How well one token ranking agrees with another: rank correlations, top-k overlap, evidence recall.
(The scores the methods rank by come from the methods themselves: ``Method.layer_rankings``.)

Scores carry the tokens on the last axis; any leading axes (layers, heads) are kept, so a
whole ``[layers, kv_heads, T]`` array is scored against a ``[T]`` reference in one call and
each function returns one value per leading index. Which tokens are ranked is the caller's
choice: compare passes the span it ranks (see ``rankkit.eval.compare``).

Higher score = more important everywhere. Top-k sets break ties toward the earlier token, so
results are deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from scipy import stats


def keep_count(keep: float | int, num_tokens: int) -> int:
    """How many of ``num_tokens`` a budget keeps: a keep rate (a float in (0, 1]) or a token count
    (an int), rounded as every method rounds its budget (``Budget.resolve``)."""
    from rankkit.methods.base import Budget

    return Budget.parse(keep).resolve(num_tokens)


class _TieRuns:
    """One unstable (fast, SIMD) ascending sort of every row, and the run of equal scores each
    sorted position belongs to. Run ids are global and increase along the flattened rows; no
    run crosses a row, since every row starts a new one. Average ranks come from it."""

    def __init__(self, scores: np.ndarray):
        values = np.asarray(scores)
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


def average_ranks(scores: np.ndarray) -> np.ndarray:
    """Ranks 1..T along the last axis, tied scores sharing their average rank: scipy's
    ``rankdata(method="average")`` for NaN-free input, about twice as fast."""
    return _TieRuns(scores).average_ranks()


def descending_ranks(scores: np.ndarray) -> np.ndarray:
    """Each token's place in the descending order along the last axis: 0 for the highest score.

    The methods' own rank rule (``rankkit.methods.selection.descending_ranks``): ties go to the
    earlier token, so every row is a permutation of 0..T-1 and the top-k set is
    ``descending_ranks(scores) < k``: exactly k tokens.
    """
    from rankkit.methods.selection import descending_ranks as method_ranks

    return method_ranks(torch.from_numpy(np.ascontiguousarray(scores))).numpy()


def ranks_and_places(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``average_ranks`` and ``descending_ranks`` of the same scores."""
    return average_ranks(scores), descending_ranks(scores)


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

    tau-b counts discordant pairs by a merge sort that numpy cannot batch, so this loops over
    the leading indices (about 1-2 ms per 4,000-token ranking).
    """
    scores, reference = np.broadcast_arrays(np.asarray(scores), np.asarray(reference))
    rows = zip(scores.reshape(-1, scores.shape[-1]), reference.reshape(-1, reference.shape[-1]), strict=True)
    taus = [stats.kendalltau(row, reference_row).statistic for row, reference_row in rows]
    return np.asarray(taus, dtype=np.float64).reshape(scores.shape[:-1])


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
