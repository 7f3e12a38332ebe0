"""How well one token ranking agrees with another: rank correlations, top-k overlap, evidence recall,
and the score aggregations the methods rank by.

Scores carry the tokens on the last axis; any leading axes (layers, heads) are kept, so a
whole ``[layers, kv_heads, T]`` array is scored against a ``[T]`` reference in one call and
each function returns one value per leading index. Which tokens are ranked is the caller's
choice: the evaluators pass the context span only (see ``rankkit.eval.compare``).

Higher score = more important everywhere. Top-k sets break ties toward the earlier token, so
results are deterministic. A NaN score (a key a sliding-window layer could not see, or that no
layer of the oracle saw) ranks below every scored token, all NaN tied: a layer that cannot
see a token can never select it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats


def keep_count(keep: float | int, num_tokens: int) -> int:
    """How many of ``num_tokens`` a budget keeps.

    A float in (0, 1] is a keep rate: floor(keep * T), at least one token. An int >= 1 is an
    absolute count, capped at T.
    """
    if isinstance(keep, bool) or not isinstance(keep, int | float):
        raise ValueError(f"keep must be a rate in (0, 1] or a token count >= 1, got {keep!r}")
    if isinstance(keep, float):
        if not 0.0 < keep <= 1.0:
            raise ValueError(f"a keep rate must be in (0, 1], got {keep}")
        return max(1, math.floor(keep * num_tokens))
    if keep < 1:
        raise ValueError(f"a token count must be >= 1, got {keep}")
    return min(keep, num_tokens)


def unscored_last(scores: np.ndarray) -> np.ndarray:
    """``scores`` with NaN (no score) replaced by -inf, so unscored tokens rank last."""
    values = np.asarray(scores)
    return np.where(np.isnan(values), -np.inf, values) if np.isnan(values).any() else values


class _TieRuns:
    """One unstable (fast, SIMD) ascending sort of every row, and the run of equal scores each
    sorted position belongs to. Run ids are global and increase along the flattened rows; no
    run crosses a row, since every row starts a new one. Both rank kinds below come from it."""

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

    def descending_places(self) -> np.ndarray:
        # Sorting (run descending, token ascending) as one int64 key puts tied tokens in token
        # order; that integer sort is far cheaper than a stable sort of the float scores.
        num_tokens = self.shape[-1]
        keys = np.sort((self.run_ids.max() - self.run_ids) * num_tokens + self.order, axis=-1)
        places = np.empty(self.shape, dtype=np.int64)
        np.put_along_axis(places, keys % num_tokens, np.arange(num_tokens), axis=-1)
        return places


def average_ranks(scores: np.ndarray) -> np.ndarray:
    """Ranks 1..T along the last axis, tied scores sharing their average rank: scipy's
    ``rankdata(method="average")`` for NaN-free input, about twice as fast."""
    return _TieRuns(scores).average_ranks()


def descending_ranks(scores: np.ndarray) -> np.ndarray:
    """Each token's place in the descending order along the last axis: 0 for the highest score.

    Ties go to the earlier token, so every row is a permutation of 0..T-1 and the top-k set
    is ``descending_ranks(scores) < k``: exactly k tokens.
    """
    return _TieRuns(scores).descending_places()


def ranks_and_places(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``average_ranks`` and ``descending_ranks`` of the same scores from one sort."""
    runs = _TieRuns(scores)
    return runs.average_ranks(), runs.descending_places()


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
    scores, reference = np.broadcast_arrays(unscored_last(scores), unscored_last(reference))
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


def aggregate_claa(layer_scores: np.ndarray, pruning_layer: int, num_layers: int) -> np.ndarray:
    """CLAA's ranking at pruning layer l_p: S_i = max over l' in {l_p - n + 1, ..., l_p} of S_i^(l') (CLAA Sec. 4.2).

    ``layer_scores`` [L, T] are the per-layer FastKV window scores of CLAA Eq. 5, already summed
    over heads and pooled: Listing 5 buffers the output of ``aggregate_attention`` per layer and
    takes the max over that buffer, so the max comes after pooling and the head sum. The window
    is clipped at layer 0. (Listing 5 also scores nothing in its first m deferred layers; with
    the paper's m = 4, l_p = 15, n = 4 the window never reaches them.)
    """
    if not 0 <= pruning_layer < layer_scores.shape[0]:
        raise ValueError(f"pruning layer {pruning_layer} is outside 0..{layer_scores.shape[0] - 1}")
    if num_layers < 1:
        raise ValueError(f"CLAA aggregates n >= 1 layers, got {num_layers}")
    return layer_scores[max(0, pruning_layer - num_layers + 1) : pruning_layer + 1].max(axis=0)


def aggregate_claa_every_layer(layer_scores: np.ndarray, num_layers: int) -> np.ndarray:
    """``aggregate_claa`` for every pruning layer at once: [L, T], row l_p = max of rows l_p - n + 1..l_p."""
    if num_layers < 1:
        raise ValueError(f"CLAA aggregates n >= 1 layers, got {num_layers}")
    aggregated = layer_scores.copy()
    for lag in range(1, min(num_layers, layer_scores.shape[0])):
        np.maximum(aggregated[lag:], layer_scores[:-lag], out=aggregated[lag:])
    return aggregated


def specprefill_scores(lookahead: np.ndarray) -> np.ndarray:
    """Speculative Prefill's ranking (CLAA Eq. 3): mean over the k lookahead queries of the max over layers and heads.

    ``lookahead`` is [k, ..., T]: the draft model's raw (pre-softmax) scores per lookahead
    query, with any layer and head axes in between. A [T] array is taken as already aggregated.
    """
    lookahead = np.asarray(lookahead, dtype=np.float64)
    if lookahead.ndim == 1:
        return lookahead
    per_query_peak = lookahead.reshape(lookahead.shape[0], -1, lookahead.shape[-1]).max(axis=1)
    return per_query_peak.mean(axis=0)
