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

import numba
import numpy as np

from rankkit.sorting import descending_places, run_end, sort_buffers, sort_row


def keep_count(keep: float | int, num_tokens: int) -> int:
    """How many of ``num_tokens`` a budget keeps: a keep rate (a float in (0, 1]) or a token count
    (an int), rounded as every method rounds its budget (``Budget.resolve``)."""
    from rankkit.methods.base import Budget

    return Budget.parse(keep).resolve(num_tokens)


class Ranked:
    """Every row of a score array (tokens on the last axis, any leading axes) sorted once, in
    descending order with ties to the earlier token, and what the metrics read off that sort:

    - ``places``: each token's place in that order (0 for the highest score), int32; the
      top-k set is ``places < k``, exactly k tokens (the methods' own rule,
      ``rankkit.methods.selection.descending_ranks``);
    - ``average_ranks``: ranks 1..T ascending, tied scores sharing their average rank
      (scipy's ``rankdata(method="average")``), float64;
    - ``dense_ranks``: ranks 0, 1, ... ascending with ties sharing one rank and no gaps, int32;
    - ``tied_pairs``: pairs of tokens with equal scores, per row (Kendall's n_1 or n_2);
    - ``spread``: the sum of squared deviations of ``average_ranks`` from their mean, per row
      (what Spearman's rho divides by).

    Indexing a ``Ranked`` picks rows along the leading axes (``ranked[1:]``).

    NaN (no score) ranks below every score, all NaN tied, as -inf would. One compiled pass per
    row (``_rank_rows``). Compare ranks its reference (the oracle) this way, once per example;
    the hundreds of rankings it scores against it go through ``row_metrics``, which builds no
    per-token array.
    """

    def __init__(self, scores: np.ndarray):
        values = np.asarray(scores, dtype=np.float64)
        self.shape = values.shape
        rows = np.ascontiguousarray(values.reshape(-1, self.shape[-1]))
        places, ranks, dense, tied, spread = _rank_rows(rows)
        self.places = places.reshape(self.shape)
        self.average_ranks = ranks.reshape(self.shape)
        self.dense_ranks = dense.reshape(self.shape)
        self.tied_pairs = tied.reshape(self.shape[:-1])
        self.spread = spread.reshape(self.shape[:-1])

    def __getitem__(self, rows) -> Ranked:
        picked = object.__new__(Ranked)
        for name in ("places", "average_ranks", "dense_ranks"):
            setattr(picked, name, getattr(self, name)[rows])
        picked.tied_pairs, picked.spread = self.tied_pairs[rows], self.spread[rows]
        picked.shape = picked.places.shape
        return picked


@numba.njit(cache=True, nogil=True)
def _rank_rows(values):  # pragma: no cover - compiled; tested through Ranked
    """``Ranked``'s arrays for every row of a C-contiguous array [R, T]: each row sorted once
    (``rankkit.sorting.sort_row``, NaN last), then one walk along its runs of equal scores."""
    num_rows, num_tokens = values.shape
    places = np.empty((num_rows, num_tokens), np.int32)
    ranks = np.empty((num_rows, num_tokens), np.float64)
    dense = np.empty((num_rows, num_tokens), np.int32)
    tied = np.zeros(num_rows, np.int64)
    spread = np.zeros(num_rows, np.float64)
    center = (num_tokens + 1) / 2.0
    buffers = sort_buffers(num_tokens)
    for row in range(num_rows):
        buffers = sort_row(values[row], False, buffers)
        keys, order = buffers[1], buffers[3]
        start, runs, row_tied, row_spread = 0, 0, 0, 0.0
        while start < num_tokens:
            end = run_end(keys, start)
            average = num_tokens - (start + end - 1) * 0.5  # ascending ranks count from the lowest
            if end - start > 1:  # integer division is slow enough to matter here
                row_tied += (end - start) * (end - start - 1) // 2
            row_spread += (end - start) * (average - center) * (average - center)  # half-integers: exact
            for place in range(start, end):
                token = order[place]
                places[row, token], ranks[row, token], dense[row, token] = place, average, runs
            runs += 1
            start = end
        tied[row], spread[row] = row_tied, row_spread
        for token in range(num_tokens):
            dense[row, token] = runs - 1 - dense[row, token]
    return places, ranks, dense, tied, spread


def average_ranks(scores: np.ndarray) -> np.ndarray:
    """Ranks 1..T along the last axis, tied scores sharing their average rank (``Ranked``)."""
    return Ranked(scores).average_ranks


def descending_ranks(scores: np.ndarray) -> np.ndarray:
    """Each token's place in the descending order along the last axis: 0 for the highest score,
    ties to the earlier token, NaN last (``Ranked.places``, without the rest of ``Ranked``)."""
    return descending_places(np.asarray(scores), nan_first=False)


def spearman(scores: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Spearman's rho along the last axis, as ``scipy.stats.spearmanr``; NaN where either side is constant.

    The rank correlation CLAA (Sec. 3.1, Fig. 2) reports against the Answer-Informed Oracle.
    Callers scoring many rankings against one reference should rank the reference once and
    call ``row_metrics``, as compare does; this path, through every row's ``Ranked``, stays as
    the tests' second way to the same number.
    """
    return spearman_rho(Ranked(scores), Ranked(reference))


def spearman_rho(scores: Ranked, reference: Ranked) -> np.ndarray:
    """Spearman's rho of every row of ``scores`` with ``reference`` (rows broadcast): the Pearson
    correlation of their average ranks, whose mean is (T + 1) / 2 on every row."""
    center = (scores.shape[-1] + 1) / 2
    covariance = ((scores.average_ranks - center) * (reference.average_ranks - center)).sum(axis=-1)
    return _correlation(covariance, scores.spread, reference.spread)


def _correlation(covariance: np.ndarray, spread: np.ndarray, reference_spread: np.ndarray) -> np.ndarray:
    """Pearson's r from a covariance and both sides' sums of squared deviations; NaN for a constant side."""
    # A constant side's ranks all sit at their mean, so its covariance is exactly 0 too: 0 / 0 is
    # NaN, and no other division by 0 can arise.
    with np.errstate(invalid="ignore"):
        correlation = covariance / np.sqrt(spread * reference_spread)
    # Rounding can push |r| a hair past 1; scipy clips the same way.
    return np.clip(correlation, -1.0, 1.0)


def kendall(scores: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Kendall's tau-b along the last axis (ties corrected, as ``scipy.stats.kendalltau``); NaN for a
    constant side. ``row_metrics`` with ``with_kendall`` scores many rows against one ``Ranked``."""
    found = row_metrics(scores, Ranked(reference), with_kendall=True)["kendall"]
    return found.reshape(np.shape(scores)[:-1])


def _tau_b(
    discordant: np.ndarray,
    both_tied: np.ndarray,
    tied: np.ndarray,
    reference_tied: np.ndarray,
    num_tokens: int,
) -> np.ndarray:
    """Kendall's tau-b = (n_c - n_d) / sqrt((n_0 - n_1)(n_0 - n_2)) from n_d (discordant pairs),
    n_3 (pairs tied in both), n_1 and n_2 (pairs tied in either side), n_0 = T(T-1)/2 and
    n_c - n_d = n_0 - n_1 - n_2 + n_3 - 2 n_d; NaN for a constant side."""
    total = num_tokens * (num_tokens - 1) // 2
    concordant_minus_discordant = total - tied - reference_tied + both_tied - 2 * discordant
    # A constant side ties all n_0 pairs, which makes n_c - n_d exactly 0 as well: 0 / 0 is NaN,
    # and no other division by 0 can arise.
    with np.errstate(invalid="ignore"):
        tau = concordant_minus_discordant / np.sqrt(total - tied) / np.sqrt(total - reference_tied)
    return np.clip(tau, -1.0, 1.0)


def row_metrics(
    scores: np.ndarray,
    reference: Ranked | None,
    *,
    top_sets: np.ndarray | None = None,
    top_ks: Sequence[int] = (),
    evidence: np.ndarray | None = None,
    needle_k: int = 0,
    with_kendall: bool = False,
    chained: bool = False,
) -> dict[str, np.ndarray]:
    """Every metric of every row of ``scores`` [R, T] in one compiled pass per row, with no
    per-token array built (what compare asks of hundreds of rankings per example):

    - ``spearman``, and with ``with_kendall`` ``kendall`` (tau-b), against ``reference`` (a
      ``Ranked`` [T]; None: NaN), as ``scipy.stats.spearmanr`` and ``kendalltau`` give them;
    - ``overlap`` [R, K]: the share of each ``top_sets[j]`` (bool [K, T]) inside the row's top
      ``top_ks[j]`` (``top_k_mask``);
    - ``evidence``: the share of ``evidence`` (bool [T]) inside the row's top ``needle_k``
      (NaN without evidence);
    - ``chained``, with ``chained``: Spearman with the row before (NaN for the first row).
    """
    values = np.ascontiguousarray(scores.reshape(-1, scores.shape[-1]))
    num_rows, num_tokens = values.shape
    no_tokens = np.zeros(0, np.float64)
    top_sets = np.asarray(np.zeros((0, num_tokens)) if top_sets is None else top_sets, bool)
    evidence = np.asarray(np.zeros(num_tokens) if evidence is None else evidence, bool)
    # the compiled pass reads every input at each row's token indices: a shorter one is read past its end
    lengths = {"evidence": evidence.shape[0], "top_sets": top_sets.shape[1]}
    if reference is not None:
        lengths["reference"] = reference.average_ranks.shape[0]
    for name, length in lengths.items():
        if length != num_tokens:
            raise ValueError(f"row_metrics: {name} covers {length} tokens, the rankings {num_tokens}")
    found = _score_rows(
        values,
        no_tokens if reference is None else reference.average_ranks - (num_tokens + 1) / 2,
        np.zeros(num_tokens, np.int32) if reference is None else reference.dense_ranks,
        top_sets,
        np.asarray(top_ks, np.int64),
        evidence,
        needle_k,
        with_kendall and reference is not None,
        chained,
    )
    covariance, chained_covariance, tied, spread, top_hits, evidence_hits, discordant, both_tied = found
    nothing = np.full(num_rows, np.nan)
    # hits never outnumber their targets: no targets is 0 / 0
    with np.errstate(invalid="ignore"):
        columns = {
            "spearman": nothing if reference is None else _correlation(covariance, spread, reference.spread),
            "kendall": _tau_b(discordant, both_tied, tied, reference.tied_pairs, num_tokens)
            if with_kendall and reference is not None
            else nothing,
            "overlap": top_hits / top_sets.sum(axis=-1),
            "evidence": evidence_hits / evidence.sum(),
            "chained": _correlation(chained_covariance, spread, np.concatenate([[np.nan], spread[:-1]]))
            if chained
            else nothing,
        }
    return columns


@numba.njit(cache=True, nogil=True)
def _score_rows(
    values, reference_deviations, reference_dense, tops, top_ks, evidence, needle_k, with_kendall, chained
):  # pragma: no cover - compiled; tested through row_metrics against Ranked and scipy
    """``row_metrics``'s raw counts for every row of ``values`` [R, T] against one reference,
    without building any per-token array: each row sorted once (``rankkit.sorting.sort_row``,
    NaN last), then

    - one walk along the sorted tokens, as if no two scores were tied, accumulates the
      covariance of its ranks with the reference's, given as their deviations from their mean
      [T] (empty: no reference), and, with ``chained``, with the previous row's (rows are
      consecutive layers);
    - one scan for runs of tied scores corrects that to their average rank, and takes the
      run's tied pairs and its share of the rank spread (Spearman's denominator) off the
      untied T(T^2 - 1) / 12; rankings rarely tie, so this costs a comparison per token;
    - how many of each ``tops[j]`` [T] (bool) its top ``top_ks[j]`` keep, and of ``evidence``
      its top ``needle_k``;
    - with ``with_kendall``, Kendall's n_d and n_3 (``_discordant_pairs``).
    """
    num_rows, num_tokens = values.shape
    highest = (num_tokens - 1) / 2.0  # the top place's deviation from the mean rank, untied
    untied_spread = num_tokens * (num_tokens * num_tokens - 1) / 12.0
    covariance = np.zeros(num_rows, np.float64)
    chained_covariance = np.full(num_rows, np.nan)
    tied = np.zeros(num_rows, np.int64)
    spread = np.zeros(num_rows, np.float64)
    top_hits = np.zeros((num_rows, top_ks.shape[0]), np.int64)
    evidence_hits = np.zeros(num_rows, np.int64)
    discordant = np.zeros(num_rows, np.int64)
    both_tied = np.zeros(num_rows, np.int64)
    buffers = sort_buffers(num_tokens)
    deviations, previous = np.empty(num_tokens, np.float64), np.empty(num_tokens, np.float64)
    counted, tally = _counted_ranks(num_tokens), np.zeros(num_tokens, np.int32)
    has_reference = reference_deviations.shape[0] == num_tokens
    for row in range(num_rows):
        buffers = sort_row(values[row], False, buffers)
        keys, order = buffers[1], buffers[3]
        follows = chained and row > 0
        row_covariance, row_chained = 0.0, 0.0
        for place in range(num_tokens):
            token, deviation = order[place], highest - place
            if has_reference:
                row_covariance += deviation * reference_deviations[token]
            if follows:
                row_chained += deviation * previous[token]
            if chained:  # only what the next row reads: the write costs a third of the walk
                deviations[token] = deviation
        row_tied, row_spread, start = 0, untied_spread, 0
        while start < num_tokens - 1:
            if keys[start + 1] != keys[start]:
                start += 1
                continue
            end = run_end(keys, start)
            size = end - start
            row_tied += size * (size - 1) // 2
            row_spread -= (size * size * size - size) / 12.0
            average = highest - (start + end - 1) * 0.5
            for place in range(start, end):
                token, correction = order[place], average - (highest - place)
                if has_reference:
                    row_covariance += correction * reference_deviations[token]
                if follows:
                    row_chained += correction * previous[token]
                if chained:
                    deviations[token] = average
            start = end
        if with_kendall:
            discordant[row], both_tied[row] = _discordant_pairs(keys, order, reference_dense, counted, tally)
        # the top k are the first k places (ties already broken toward the earlier token)
        for j in range(top_ks.shape[0]):
            top_hits[row, j] = _hits(tops[j], order, top_ks[j])
        evidence_hits[row] = _hits(evidence, order, needle_k)
        covariance[row], tied[row], spread[row] = row_covariance, row_tied, row_spread
        if follows:
            chained_covariance[row] = row_chained
        previous, deviations = deviations, previous
    return covariance, chained_covariance, tied, spread, top_hits, evidence_hits, discordant, both_tied


@numba.njit(cache=True, nogil=True)
def _hits(targets, order, k):  # pragma: no cover - compiled
    """How many of ``targets`` (bool [T]) the first ``k`` places of ``order`` hold."""
    hits = 0
    for place in range(min(k, order.shape[0])):
        hits += targets[order[place]]
    return hits


# Up to this many tokens the ranks seen so far are counted in blocks of 64, beyond it in a
# Fenwick tree: on 2k-token rows the blocks count discordant pairs in 44 us to the tree's 54
# (45 to 70 with ties), at 4k they tie, at 8k the tree is faster.
_BLOCKED_COUNT_LIMIT = 4096
_BLOCK = 64


@numba.njit(cache=True, nogil=True)
def _count_blocks(num_tokens):  # pragma: no cover - compiled
    """How many blocks of ``_BLOCK`` ranks rows of ``num_tokens`` are counted in; 0: a Fenwick tree."""
    return 0 if num_tokens > _BLOCKED_COUNT_LIMIT else -(-num_tokens // _BLOCK)


@numba.njit(cache=True, nogil=True)
def _counted_ranks(num_tokens):  # pragma: no cover - compiled
    """``_discordant_pairs``'s count of the ranks seen so far, for rows of ``num_tokens``: the
    per-block and within-block counts of ``_blocked_below``, or a Fenwick tree [T + 1]."""
    blocks = _count_blocks(num_tokens)
    return np.zeros(blocks + blocks * _BLOCK if blocks else num_tokens + 1, np.int32)


@numba.njit(cache=True, nogil=True)
def _discordant_pairs(keys, order, reference_dense, counted, tally):  # pragma: no cover - compiled
    """Kendall's n_d and n_3 of one sorted row (``keys`` and ``order`` from ``sort_row``) against
    ``reference_dense`` (the reference's ascending dense ranks [T]). Walking the tokens from
    the highest score down, a count of the reference ranks seen so far (``_counted_ranks``)
    gives, for each token, the higher-scoring tokens ranked lower by the reference (discordant
    pairs). A run of tied scores enters the count only once all of it is counted, so
    score-tied pairs are never discordant, and the strict comparison leaves reference-tied
    ones out; a per-rank tally within each run counts the pairs tied in both. ``counted`` and
    ``tally`` [T] are scratch, ``tally`` left all zero.
    """
    num_tokens = keys.shape[0]
    blocks = _count_blocks(num_tokens)
    counted[:] = 0
    discordant, both_tied, start = 0, 0, 0
    while start < num_tokens:
        end = run_end(keys, start)
        for place in range(start, end):
            rank = reference_dense[order[place]]
            discordant += _blocked_below(counted, blocks, rank) if blocks else _fenwick_below(counted, rank)
            if end - start > 1:
                both_tied += tally[rank]
                tally[rank] += 1
        for place in range(start, end):
            rank = reference_dense[order[place]]
            tally[rank] = 0
            if blocks:
                _blocked_add(counted, blocks, rank)
            else:
                _fenwick_add(counted, rank)
        start = end
    return discordant, both_tied


@numba.njit(cache=True, nogil=True, inline="always")
def _blocked_below(counted, blocks, rank):  # pragma: no cover - compiled
    """Ranks seen below ``rank``: those in the blocks before its block, then those below it in
    its block. ``counted`` holds both per rank, so a count is two reads."""
    return counted[rank // _BLOCK] + counted[blocks + rank]


@numba.njit(cache=True, nogil=True, inline="always")
def _blocked_add(counted, blocks, rank):  # pragma: no cover - compiled
    """Count ``rank`` as seen: every later rank of its block and every later block gain one. The
    loops run their full length with a 0-or-1 step, so the compiler makes them vector adds."""
    block, offset = rank // _BLOCK, rank % _BLOCK
    within = counted[blocks + block * _BLOCK : blocks + (block + 1) * _BLOCK]
    for later in range(_BLOCK):
        within[later] += np.int32(later > offset)
    before = counted[:blocks]
    for later in range(blocks):
        before[later] += np.int32(later > block)


@numba.njit(cache=True, nogil=True, inline="always")
def _fenwick_below(tree, rank):  # pragma: no cover - compiled
    """Ranks seen below ``rank``: tree slots 1..rank hold them. O(log T)."""
    lower, node = 0, rank
    while node > 0:
        lower += tree[node]
        node -= node & -node
    return lower


@numba.njit(cache=True, nogil=True, inline="always")
def _fenwick_add(tree, rank):  # pragma: no cover - compiled
    node = rank + 1
    while node < tree.shape[0]:
        tree[node] += 1
        node += node & -node


def top_k_mask(scores: np.ndarray, k: int) -> np.ndarray:
    """True for the k highest-scoring tokens along the last axis; ties go to the earlier token."""
    return descending_ranks(scores) < k


def overlap_share(kept: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Share of the target tokens that are kept, along the last axis (boolean masks); NaN without targets."""
    with np.errstate(invalid="ignore"):  # no targets: 0 / 0
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
