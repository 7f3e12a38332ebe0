"""Ranking evaluators: rank statistics against scipy, top-k and needle recall by hand, CLAA and ASL
against slow loops of the papers' pseudo-code, and `rankkit compare` / `variance` on a small store."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from functools import partial

import numpy as np
import polars as pl
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from rankkit.errors import RankkitError
from rankkit.eval.compare import CLAA_SWEEP, Reference, compare_store
from rankkit.eval.ranking import (
    Ranked,
    average_ranks,
    descending_ranks,
    keep_count,
    kendall,
    needle_recall,
    row_metrics,
    spans_mask,
    spearman,
    top_k_mask,
    topk_recall,
)
from rankkit.eval.variance import VarianceResult, variance_store
from rankkit.methods import Budget, Captured, make
from rankkit.methods.asl import RankVariance, is_fallback, relative_variance_curve, selection_layer
from rankkit.methods.base import Selection
from rankkit.methods.selection import DRAFT_SCORES, head_sums, replay

# Few distinct values, so most draws have ties.
tied_rows = st.integers(2, 40).flatmap(
    lambda length: st.tuples(
        st.lists(st.integers(0, 5), min_size=length, max_size=length),
        st.lists(st.integers(0, 5), min_size=length, max_size=length),
    )
)


def same(got, expected) -> bool:
    return bool(np.allclose(got, expected, rtol=0, atol=1e-12, equal_nan=True))


# ---------------------------------------------------------------- rank statistics


@settings(max_examples=200, deadline=None)
@given(tied_rows)
def test_average_ranks_are_scipys_rankdata(rows):
    values = np.array(rows, dtype=np.float32)
    np.testing.assert_array_equal(average_ranks(values), stats.rankdata(values, axis=-1))


@settings(max_examples=200, deadline=None)
@given(tied_rows)
def test_descending_ranks_break_ties_toward_the_earlier_token(rows):
    values = np.array(rows, dtype=np.float64)
    expected = np.empty(values.shape, dtype=np.int64)
    np.put_along_axis(
        expected, np.argsort(-values, axis=-1, kind="stable"), np.arange(values.shape[1]), axis=-1
    )
    np.testing.assert_array_equal(descending_ranks(values), expected)


@settings(max_examples=200, deadline=None)
@given(tied_rows)
def test_ranked_places_are_the_methods_own_top_k_rule(rows):
    """compare's compiled sort and the torch sort a method selects by order every token alike,
    unscored (NaN) tokens and the two zeros included."""
    from rankkit.methods.selection import descending_ranks as method_ranks

    values = np.array(rows, dtype=np.float32) - 2.0
    values[values == 3.0] = np.nan
    values[values == -2.0] = -0.0
    expected = method_ranks(torch.from_numpy(np.where(np.isnan(values), -np.inf, values)))
    np.testing.assert_array_equal(Ranked(values).places, expected.numpy())


def test_ranked_rows_carry_ties_and_spread_and_slice_by_row():
    values = np.array([[3.0, 1.0, 3.0, 2.0, 3.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    ranked = Ranked(values)
    assert ranked.tied_pairs.tolist() == [3, 0]
    ranks = stats.rankdata(values, axis=-1)
    assert np.allclose(ranked.spread, ((ranks - 3.0) ** 2).sum(axis=-1), rtol=0, atol=1e-12)
    second = ranked[1:]
    assert second.shape == (1, 5) and second.places.tolist() == [[0, 1, 2, 3, 4]]
    assert second.dense_ranks.tolist() == [[4, 3, 2, 1, 0]] and second.tied_pairs.tolist() == [0]


@pytest.mark.filterwarnings("ignore::scipy.stats.ConstantInputWarning")
@settings(max_examples=200, deadline=None)
@given(tied_rows)
def test_spearman_is_scipys_including_ties_and_constant_inputs(rows):
    scores, reference = (np.array(row, dtype=np.float64) for row in rows)
    assert same(spearman(scores, reference), stats.spearmanr(scores, reference).statistic)


@settings(max_examples=200, deadline=None)
@given(tied_rows)
def test_kendall_is_scipys_tau_b(rows):
    scores, reference = (np.array(row, dtype=np.float64) for row in rows)
    assert same(kendall(scores, reference), stats.kendalltau(scores, reference).statistic)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 70).flatmap(
        lambda length: st.tuples(
            st.lists(st.lists(st.integers(0, 3), min_size=length, max_size=length), min_size=1, max_size=6),
            st.lists(st.integers(0, 3), min_size=length, max_size=length),
        )
    )
)
def test_batched_kendall_equals_one_scipy_call_per_row(rows):
    """Many tied rows against one tied reference, lengths on and off powers of two."""
    scores, reference = np.array(rows[0], dtype=np.float64), np.array(rows[1], dtype=np.float64)
    expected = [
        stats.kendalltau(row, reference).statistic if len(reference) > 1 else np.nan for row in scores
    ]
    assert same(kendall(scores, reference), expected)


@pytest.mark.parametrize("length", [3000, 4096, 4097, 6000])
@pytest.mark.parametrize("tied", [False, True])
def test_batched_kendall_on_long_rankings(length, tied):
    """Rows up to 4,096 tokens count their discordant pairs in blocks, longer ones in a tree."""
    rng = np.random.default_rng(length)
    if tied:
        scores, reference = rng.integers(0, 40, size=(3, length)), rng.integers(0, 25, size=length)
    else:
        scores, reference = rng.normal(size=(3, length)), rng.normal(size=length)
    expected = [stats.kendalltau(row, reference).statistic for row in scores]
    assert np.allclose(
        kendall(scores.astype(np.float64), reference.astype(np.float64)), expected, rtol=0, atol=1e-9
    )


def test_rank_statistics_score_every_layer_and_head_at_once():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 30, size=(4, 3, 200)).astype(np.float32)
    reference = rng.random(200)
    rho, tau = spearman(scores, reference), kendall(scores, reference)
    assert rho.shape == tau.shape == (4, 3)
    for layer, head in np.ndindex(4, 3):
        assert same(rho[layer, head], stats.spearmanr(scores[layer, head], reference).statistic)
        assert same(tau[layer, head], stats.kendalltau(scores[layer, head], reference).statistic)


@pytest.mark.filterwarnings("ignore::scipy.stats.ConstantInputWarning")
@settings(max_examples=150, deadline=None)
@given(
    st.integers(2, 60).flatmap(
        lambda length: st.tuples(
            st.lists(st.lists(st.integers(-1, 4), min_size=length, max_size=length), min_size=1, max_size=5),
            st.lists(st.integers(0, 3), min_size=length, max_size=length),
            st.lists(st.booleans(), min_size=length, max_size=length),
            st.lists(st.integers(1, length + 2), min_size=0, max_size=3),
            st.sampled_from([np.float32, np.float64]),
        )
    )
)
def test_row_metrics_equal_one_metric_at_a_time(drawn):
    """compare's fused pass equals scipy's Spearman and Kendall, the top-k rule and Spearman of
    consecutive rows, row by row; tied, unscored (NaN) and constant rows included."""
    rows, reference, evidence, top_ks, dtype = drawn
    scores = np.array(rows, dtype=dtype)
    scores[scores == -1] = np.nan
    reference = np.array(reference, dtype=np.float64)
    evidence = np.array(evidence)
    oracle = Ranked(reference)
    top_sets = np.stack([oracle.places < k for k in top_ks]) if top_ks else None
    found = row_metrics(
        scores,
        oracle,
        top_sets=top_sets,
        top_ks=top_ks,
        evidence=evidence,
        needle_k=top_ks[0] if top_ks else 1,
        with_kendall=True,
        chained=True,
    )
    unscored_low = np.where(np.isnan(scores), -np.inf, scores)  # how the rankings treat NaN
    for row, values in enumerate(unscored_low):
        assert same(found["spearman"][row], stats.spearmanr(values, reference).statistic)
        assert same(found["kendall"][row], stats.kendalltau(values, reference).statistic)
        for index, k in enumerate(top_ks):
            assert same(found["overlap"][row, index], topk_recall(values, reference, k))
        expected_needle = needle_recall(values, evidence, top_ks[0] if top_ks else 1)
        assert same(found["evidence"][row], expected_needle)
        previous = stats.spearmanr(values, unscored_low[row - 1]).statistic if row else np.nan
        assert same(found["chained"][row], previous)
    without = row_metrics(scores, None, evidence=evidence, needle_k=1)
    assert np.isnan(without["spearman"]).all() and np.isnan(without["kendall"]).all()
    assert np.isnan(without["chained"]).all() and without["overlap"].shape == (len(rows), 0)


# ---------------------------------------------------------------- top-k and needle recall


def test_row_metrics_refuse_inputs_over_other_tokens_than_the_rankings():
    """The compiled pass would read a shorter input past its end: a crash or a wrong number."""
    rng = np.random.default_rng(2)
    scores = rng.random((2, 30))
    for keywords, name, length in (
        ({"reference": Ranked(rng.random(29))}, "reference", 29),
        ({"reference": None, "evidence": np.ones(31, bool)}, "evidence", 31),
        ({"reference": None, "top_sets": np.ones((1, 20), bool), "top_ks": [3]}, "top_sets", 20),
    ):
        with pytest.raises(ValueError, match=f"^row_metrics: {name} covers {length} tokens, the rankings 30$"):
            row_metrics(scores, **keywords)
    assert row_metrics(scores, Ranked(rng.random(30)), evidence=np.ones(30, bool), top_sets=np.ones((1, 30), bool), top_ks=[3])


def test_a_ranking_scored_before_is_not_scored_again():
    """Methods that rank by a probe's own scores (fastkv by window's) reuse its metrics, in any
    dtype; a ranking scored without Kendall is scored again when Kendall is asked for."""
    rng = np.random.default_rng(4)
    reference = Reference(rng.random(300), np.zeros(300, bool), 0.1)
    scores = rng.random((4, 300)).astype(np.float32)
    quick = reference.metrics(scores, with_kendall=False)
    assert np.isnan(quick["kendall"]).all()
    full = reference.metrics(scores.astype(np.float64))
    assert full is not quick and same(full["kendall"], kendall(scores, reference.oracle))
    assert reference.metrics(scores.copy()) is full
    other = scores.copy()
    other[2, 7] += 1  # a value the fingerprint's sampled columns miss
    assert reference.metrics(other) is not full
    unseen = scores.copy()
    unseen[1, :50] = np.nan  # a local layer's keys it could not see (LAVa, SAGE-KV)
    assert reference.metrics(unseen.copy()) is reference.metrics(unseen)


def test_keep_count_takes_a_rate_or_a_count():
    assert keep_count(0.1, 100) == 10
    assert keep_count(0.25, 10) == 3  # rounded up, as every method rounds its budget
    assert keep_count(0.25, 10) == Budget.from_keep(0.25).resolve(10)
    assert keep_count(0.01, 10) == 1  # at least one token
    assert keep_count(1.0, 7) == 7
    assert keep_count(3, 10) == 3
    assert keep_count(50, 10) == 10
    for bad in (0.0, 1.5, 0, True):
        with pytest.raises(RankkitError):
            keep_count(bad, 10)


def test_top_k_mask_breaks_ties_toward_the_earlier_token():
    np.testing.assert_array_equal(top_k_mask(np.array([1.0, 3.0, 3.0, 3.0, 0.0]), 2), [0, 1, 1, 0, 0])


def test_topk_recall_by_hand():
    oracle = np.array([9, 8, 7, 6, 5, 4, 3, 2, 1, 0], dtype=float)  # top 20% = tokens 0, 1
    assert topk_recall(oracle, oracle, 0.2) == 1.0
    assert topk_recall(-oracle, oracle, 0.2) == 0.0
    assert topk_recall(np.array([9, 0, 8, 0, 0, 0, 0, 0, 0, 0.0]), oracle, 0.2) == 0.5  # keeps 0 and 2
    assert topk_recall(np.array([9, 0, 8, 0, 7, 0, 0, 0, 0, 0.0]), oracle, 3) == pytest.approx(2 / 3)
    layers = np.stack([oracle, -oracle])
    np.testing.assert_array_equal(topk_recall(layers, oracle, 0.2), [1.0, 0.0])


def test_needle_recall_by_hand():
    scores = np.array([0, 5, 4, 0, 3, 0, 0, 0, 0, 0], dtype=float)  # top 30% = tokens 1, 2, 4
    evidence = spans_mask([[2, 4], [9, 12]], 10)  # tokens 2, 3 and 9; the second span is clipped
    np.testing.assert_array_equal(evidence, [0, 0, 1, 1, 0, 0, 0, 0, 0, 1])
    assert needle_recall(scores, evidence, 0.3) == pytest.approx(1 / 3)
    assert needle_recall(scores, evidence, 1.0) == 1.0
    assert np.isnan(needle_recall(scores, spans_mask([], 10), 0.3))


# ---------------------------------------------------------------- method aggregations


def slow_claa(layer_scores: np.ndarray, pruning_layer: int, n: int, deferred: int) -> np.ndarray:
    """CLAA Eq. 5 / Listing 5 by hand: the max over the scored layers among l_p - n + 1..l_p (the
    first m are not scored; l_p itself always is), of the scores summed over heads."""
    summed = layer_scores.sum(axis=1)
    layers = [layer for layer in range(pruning_layer - n + 1, pruning_layer + 1) if layer >= deferred]
    return np.max(summed[layers or [pruning_layer]], axis=0)


@pytest.mark.parametrize("n, deferred", [(1, 0), (2, 0), (4, 1), (8, 3), (10, 0)])  # n up to the depth
def test_claa_ranks_by_the_max_over_the_n_layers_ending_at_the_pruning_layer(n, deferred):
    layer_scores = np.random.default_rng(1).random((10, 2, 50)).astype(np.float32)
    captured = Captured({"window": torch.from_numpy(layer_scores)}, 10, 50)
    claa = make("claa", aggregation_window=n, deferred_layers=deferred)
    rankings = claa.layer_rankings(captured, Budget.from_keep(0.2))
    assert list(rankings) == list(range(10))
    for pruning_layer, ranking in rankings.items():
        expected = slow_claa(layer_scores, pruning_layer, n, deferred)
        np.testing.assert_allclose(ranking[:-8].numpy(), expected[:-8], rtol=1e-6)
        assert torch.isinf(ranking[-8:]).all()  # the observation window ranks first
        kept = claa.with_layer(pruning_layer).select_offline(captured, Budget.from_tokens(20))
        top = sorted(np.argsort(-expected[:-8], kind="stable")[:12].tolist() + list(range(42, 50)))
        assert kept.layer == pruning_layer and kept.positions.tolist() == top


@pytest.mark.parametrize(
    "spec",
    [
        "claa",
        "claa:aggregation_window=1",
        "claa:aggregation_window=8,deferred_layers=3",
        "fastkv",
        "gemfilter",
    ],
)
def test_rankings_read_off_head_sums_equal_a_replay_of_each_candidate_to_the_bit(spec):
    """``layer_rankings`` asks each candidate layer's policy to decide at once from the head sums;
    a replay through the layers, as a prefill decides, gives the same scores."""
    from rankkit.eval.offline import method_from_spec
    from rankkit.methods.selection import forced_mask, replay, with_forced

    method = method_from_spec(spec)
    layer_scores = torch.from_numpy(np.random.default_rng(2).random((10, 3, 50)).astype(np.float32))
    captured = Captured({method.probe().key: layer_scores}, 10, 50)
    budget = Budget.from_keep(0.2)
    rankings = method.layer_rankings(captured, budget)
    bound, keep, window, sinks = method._plan(10, 50, budget)
    forced = forced_mask(50, window, sinks)
    assert list(rankings) == list(range(10))
    for layer, ranking in rankings.items():
        selected = replay(bound.with_layer(layer).policy(10, keep), layer_scores)
        assert selected[0] == layer and torch.equal(ranking, with_forced(selected[1], forced))


def test_specprefill_is_the_mean_over_lookahead_queries_of_the_max_over_layers_and_heads():
    # [k=2 queries, 2 layers, 2 heads, 3 tokens]
    lookahead = np.zeros((2, 2, 2, 3), dtype=np.float32)
    lookahead[0, 1, 0] = [1, 5, 2]
    lookahead[0, 0, 1] = [3, 0, 0]
    lookahead[1, 0, 0] = [0, 1, 7]
    captured = Captured({DRAFT_SCORES: torch.from_numpy(lookahead)}, 2, 3)
    (ranking,) = make("specprefill").layer_rankings(captured, Budget.from_keep(1.0)).values()
    np.testing.assert_allclose(ranking[:2].numpy(), [(3 + 0) / 2, (5 + 1) / 2])
    assert ranking[2] == float("inf")  # the last token is always kept
    kept = make("specprefill").select_offline(captured, Budget.from_tokens(2))
    assert kept.layer is None and kept.positions.tolist() == [1, 2]


# ---------------------------------------------------------------- ASL


def slow_algorithm_2(layer_scores: np.ndarray, k: int, min_layer: int, observed_layers: int) -> list[float]:
    """ASL Appendix A, Algorithm 2, one layer and one token at a time, with plain Python."""
    summed = layer_scores.sum(axis=1) if layer_scores.ndim == 3 else layer_scores
    num_layers, num_tokens = summed.shape
    rank_cache = []
    for layer in range(num_layers):  # Algorithm 1's RankDesc: 0 = highest, ties to the earlier token
        order = sorted(range(num_tokens), key=lambda token, layer=layer: (-summed[layer, token], token))
        ranks = [0] * num_tokens
        for place, token in enumerate(order):
            ranks[token] = place
        rank_cache.append(ranks)
    curve, init_var = [float("nan")] * num_layers, None
    for layer in range(min_layer, num_layers):
        window = rank_cache[max(0, layer - observed_layers + 1) : layer + 1]
        union = {token for ranks in window for token in range(num_tokens) if ranks[token] < k}
        var = statistics.fmean(statistics.pvariance([ranks[token] for ranks in window]) for token in union)
        init_var = var if init_var is None else init_var
        curve[layer] = var / init_var
    return curve


def test_asl_curve_by_hand():
    layer_scores = torch.tensor([[3.0, 2, 1], [1, 2, 3], [1, 2, 3]])[
        :, None
    ]  # ranks [0 1 2], [2 1 0], [2 1 0]
    # Layer 1: top-1 tokens {0, 2}, each ranked 0 and 2 -> variance 1. Layer 2: {2}, ranked 0 twice -> 0.
    curve = relative_variance_curve(layer_scores, top_k=1, window=0, min_layer=1, observed_layers=2)
    assert same(curve, [np.nan, 1.0, 0.0])
    assert selection_layer(curve, 0.5) == 2


@pytest.mark.parametrize("k, min_layer, observed_layers", [(3, 4, 3), (5, 2, 8), (1, 1, 2), (5, 5, 4)])
def test_asl_curve_matches_a_slow_loop_of_algorithm_2(k, min_layer, observed_layers):
    rng = np.random.default_rng(2)
    layer_scores = rng.integers(0, 6, size=(12, 2, 25)).astype(np.float32)  # heads to sum, ties to break
    expected = slow_algorithm_2(layer_scores, k, min_layer, observed_layers)
    curve = relative_variance_curve(torch.from_numpy(layer_scores), k, 0, min_layer, observed_layers)
    np.testing.assert_allclose(curve, expected, rtol=1e-6)
    # the window (the last W tokens) is kept out of the ranks, as Algorithm 1 line 4 keeps it
    windowed = relative_variance_curve(torch.from_numpy(layer_scores), k, 5, min_layer, observed_layers)
    np.testing.assert_allclose(
        windowed, slow_algorithm_2(layer_scores[..., :-5], k, min_layer, observed_layers), rtol=1e-6
    )


@pytest.mark.parametrize("tau", [0.3, 0.8, float("-inf")])
@pytest.mark.parametrize("min_layer, observed_layers", [(4, 3), (2, 8), (6, 2)])
def test_asl_decides_at_once_as_its_walk_through_the_layers(tau, min_layer, observed_layers):
    """The offline face ranks every layer in one sort; it must pick the layer and scores, and record
    the variances, of the layer-by-layer walk a prefill takes, to the last bit."""
    rng = np.random.default_rng(min_layer)
    layer_scores = torch.from_numpy(rng.integers(0, 9, size=(12, 3, 60)).astype(np.float32))  # ties
    walk = RankVariance(tau, min_layer, observed_layers, top_k=7, window=5, last_layer=11)
    at_once = RankVariance(tau, min_layer, observed_layers, top_k=7, window=5, last_layer=11)
    walked, decided = replay(walk, layer_scores), at_once.decide_at_once(head_sums(layer_scores))
    assert walked[0] == decided[0] and torch.equal(walked[1], decided[1])
    assert walk.relative_variance == at_once.relative_variance


def test_asl_min_layer_defaults_to_a_third_of_the_depth():
    scores = torch.from_numpy(np.random.default_rng(3).random((30, 1, 40)).astype(np.float32))
    curve = make("asl").variance_curve(Captured({"window:w=32": scores}, 30, 40), Budget.from_tokens(36))
    assert np.isnan(curve[:10]).all() and curve[10] == 1.0 and np.isfinite(curve[10:]).all()


def test_selection_layer_for_each_threshold():
    curve = np.array([np.nan, np.nan, 1.0, 0.7, 0.55, 0.45, 0.35, 0.25, 0.15, 0.5])
    chosen = {tau: selection_layer(curve, tau) for tau in (0.2, 0.3, 0.4, 0.5, 0.6)}
    assert chosen == {0.2: 8, 0.3: 7, 0.4: 6, 0.5: 5, 0.6: 4}
    assert not any(is_fallback(curve, tau) for tau in chosen)
    # nothing below 0.1: asl falls back to its last layer, and says so
    assert (selection_layer(curve, 0.1), is_fallback(curve, 0.1)) == (9, True)


# ---------------------------------------------------------------- compare on a store

LAYERS, HEADS, TOKENS = 6, 2, 60
CONTEXT = (5, 50)
EVIDENCE = [[20, 24]]


def write_store(path, *, oracle=True, draft=True, examples=3, clusters=None, oracle_attrs=None, run_meta=None):
    """Probes with known answers: ``window`` ranks exactly like the oracle, ``last_token_raw``
    exactly against it, ``lava`` at random; the oracle peaks on the evidence."""
    from rankkit import stores

    rng = np.random.default_rng(4)
    writer = stores.create(path, run_meta or {"model": {"id": "synthetic"}})
    for index in range(examples):
        example_id = f"ex{index}"
        truth = rng.random(TOKENS).astype(np.float32)
        truth[20:24] += 10
        per_head = np.broadcast_to(truth, (LAYERS, HEADS, TOKENS)) / HEADS
        scores = {
            "window": per_head,
            "last_token_raw": -per_head,
            "lava": rng.random((LAYERS, HEADS, TOKENS)).astype(np.float32),
        }
        spans = {"context_tokens": list(CONTEXT), "evidence_tokens": EVIDENCE}
        attrs = {"task": "niah", "spans": spans}
        if clusters is not None:
            attrs["meta"] = {"cluster": clusters[index]}
        writer.write_example(example_id, attrs=attrs, tokens=np.arange(TOKENS), scores=scores)
        if oracle:
            writer.add_oracle(
                example_id, oracle=truth, oracle_layers=np.tile(truth, (LAYERS, 1)), attrs=oracle_attrs or {}
            )
        if draft:
            writer.add_arrays(example_id, "draft_scores", {"lookahead": np.stack([truth, truth])}, {})
    return path


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return write_store(tmp_path_factory.mktemp("eval") / "run.zarr")


def test_a_missing_probe_names_the_capture_that_adds_it_and_whether_the_default_one_does(store_path):
    """gemfilter:kernel_size=7's probe was said to be recorded by the default capture, which records kernel 5."""
    from rankkit.eval.offline import select_store

    budget = Budget.from_keep(0.5)
    lacks = "which example 'ex0' lacks: capture it with `rankkit capture --probes"
    with pytest.raises(RankkitError, match=re.escape(f"{lacks} last_token_raw:kernel=7 ...`") + "$"):
        select_store(store_path, "gemfilter:kernel_size=7", **budget.keywords)
    with pytest.raises(RankkitError, match=re.escape(f"{lacks} window:w=32 ...` (the default capture records it)") + "$"):
        select_store(store_path, "snapkv", **budget.keywords)


@pytest.fixture(scope="module")
def result(store_path):
    return compare_store(store_path)


def test_compare_without_detail_is_the_same_per_layer_rows_without_kendall(store_path, result):
    """What the dashboard asks for: the per-layer rows, Kendall left null, no per-head or sweep rows."""
    light = compare_store(store_path, detailed=False)
    assert light.per_layer["kendall"].null_count() == light.per_layer.height
    assert light.per_head.is_empty() and light.sweep.is_empty()
    assert light.per_layer.drop("kendall").equals(result.per_layer.drop("kendall"))
    assert light.pairs.equals(result.pairs)


def test_compare_frames_have_the_documented_columns(result):
    metrics = [
        "spearman", "kendall", "recall_at_10", "recall_at_20", "recall_at_40", "needle_recall", "evidence_kept"
    ]  # fmt: skip
    keeps = ["keep", "needle_keep"]
    assert result.per_layer.columns == [
        "example_id",
        "task",
        "method",
        "layer",
        *metrics,
        "adjacent_spearman",
        *keeps,
    ]
    assert result.per_head.columns == ["example_id", "task", "method", "layer", "head", "spearman", *keeps]
    assert result.sweep.columns == [
        "example_id", "task", "method", "claa_layers", "layer",
        "spearman", "recall_at_10", "recall_at_20", "recall_at_40", "needle_recall", "adjacent_spearman", *keeps,
    ]  # fmt: skip
    stability = [
        "mean_spearman", "mean_spearman_ci_low", "mean_spearman_ci_high", "mean_spearman_n", "std_spearman",
        "min_spearman", "trough_layer", "layer_to_layer", "layer_to_layer_ci_low", "layer_to_layer_ci_high",
        "layer_to_layer_n",
    ]  # fmt: skip
    assert result.stability.columns == ["method", *stability, "n_examples", *keeps]
    with_intervals = [
        name for metric in metrics for name in (metric, f"{metric}_ci_low", f"{metric}_ci_high", f"{metric}_n")
    ]
    assert result.curve.columns == ["method", "layer", *with_intervals, "n_examples", *keeps]
    assert result.summary.columns == ["method", "layer", *with_intervals, "n_examples", *stability, *keeps]
    assert result.pairs.columns == [
        "method", "baseline", "layer", "difference", "difference_ci_low", "difference_ci_high", "p_value",
        "n_examples", "n_clusters", *keeps,
    ]  # fmt: skip
    assert result.per_layer["example_id"].dtype == pl.Categorical


def test_compare_known_answers(result):
    summary = {row["method"]: row for row in result.summary.to_dicts()}
    assert list(summary) == ["last_token_raw", "lava", "window", "claa", "fastkv", "gemfilter", "specprefill"]
    assert result.pruning_layer == 3 and result.span == "prompt"  # CLAA's l_p: round(15 * 6 / 32)
    assert {summary[name]["layer"] for name in ("window", "claa", "fastkv", "gemfilter")} == {3}
    for method in ("window", "fastkv", "claa", "specprefill"):
        row = summary[method]
        assert row["spearman"] == pytest.approx(1) and row["kendall"] == pytest.approx(1), method
        assert row["recall_at_10"] == row["recall_at_40"] == row["needle_recall"] == 1.0
        assert row["n_examples"] == 3
    assert summary["gemfilter"]["spearman"] == pytest.approx(-1)
    assert summary["specprefill"]["layer"] is None
    assert summary["window"]["std_spearman"] == pytest.approx(0)
    assert summary["window"]["layer_to_layer"] == pytest.approx(1)
    per_layer = result.per_layer
    # the prompt span leaves the window out, so GemFilter's forced last token does not show
    assert (
        per_layer.filter(pl.col("method") == "gemfilter")
        .drop("method", "evidence_kept")  # a probe keeps nothing; gemfilter's selection does
        .equals(per_layer.filter(pl.col("method") == "last_token_raw").drop("method", "evidence_kept"))
    )
    assert set(result.sweep["method"]) == {f"claa-n{n}" for n in CLAA_SWEEP if n <= LAYERS}


def test_compare_ranks_every_method_by_its_offline_face(store_path):
    """What compare ranks for a method is its layer_rankings; its summary sits at its own layer."""
    from rankkit import stores

    chosen = compare_store(
        store_path, methods="claa:aggregation_window=2,streamingllm", layer=4, span="context"
    )
    summary = {row["method"]: row for row in chosen.summary.to_dicts()}
    assert summary["claa:aggregation_window=2"]["layer"] == 4 and summary["streamingllm"]["layer"] == 4
    record = stores.open(store_path).example("ex1")
    context, oracle = slice(*CONTEXT), record.oracle[slice(*CONTEXT)]
    captured = Captured({"window": torch.from_numpy(record.scores("window"))}, LAYERS, TOKENS)
    rankings = make("claa", aggregation_window=2).layer_rankings(captured, Budget.from_keep(0.1))
    rows = chosen.per_layer.filter(
        (pl.col("example_id") == "ex1") & (pl.col("method") == "claa:aggregation_window=2")
    ).sort("layer")
    expected = [spearman(rankings[layer].numpy()[context], oracle) for layer in range(LAYERS)]
    assert same(rows["spearman"].to_numpy(), expected)
    recency = chosen.per_layer.filter((pl.col("example_id") == "ex1") & (pl.col("method") == "streamingllm"))
    assert recency.height == LAYERS  # KV-only: one ranking per layer


def test_compare_ranks_only_the_context(store_path):
    """The frame's numbers are the ranking functions' on the context span of the stored arrays."""
    from rankkit import stores

    result = compare_store(store_path, span="context")
    record = stores.open(store_path).example("ex1")
    context = slice(*CONTEXT)
    lava = record.scores("lava")[:, :, context]
    layer_scores, oracle = lava.sum(axis=1), record.oracle[context]
    evidence = spans_mask([[start - CONTEXT[0], end - CONTEXT[0]] for start, end in EVIDENCE], 45)
    rows = result.per_layer.filter((pl.col("example_id") == "ex1") & (pl.col("method") == "lava")).sort("layer")
    assert same(rows["spearman"].to_numpy(), spearman(layer_scores, oracle))
    assert same(rows["kendall"].to_numpy(), kendall(layer_scores, oracle))
    assert same(rows["recall_at_20"].to_numpy(), topk_recall(layer_scores, oracle, 0.2))
    assert same(rows["needle_recall"].to_numpy(), needle_recall(layer_scores, evidence, 0.1))
    adjacent = [spearman(layer_scores[layer], layer_scores[layer - 1]) for layer in range(1, LAYERS)]
    assert rows["adjacent_spearman"][0] is None and same(rows["adjacent_spearman"][1:].to_numpy(), adjacent)
    heads = result.per_head.filter((pl.col("example_id") == "ex1") & (pl.col("method") == "lava"))
    assert same(heads.sort("layer", "head")["spearman"].to_numpy(), spearman(lava, oracle).reshape(-1))
    claa = result.sweep.filter((pl.col("example_id") == "ex1") & (pl.col("method") == "claa-n2")).sort("layer")
    window = record.scores("window")
    deferred = make("claa").bind(LAYERS).deferred_layers
    expected = [spearman(slow_claa(window, layer, 2, deferred)[context], oracle) for layer in range(LAYERS)]
    assert same(claa["spearman"].to_numpy(), expected)


def test_compare_prompt_span_leaves_out_the_observation_window(store_path, result):
    from rankkit import stores

    record = stores.open(store_path).example("ex0")
    prompt = slice(0, TOKENS - 8)
    lava = record.scores("lava")[:, :, prompt].sum(axis=1)
    rows = result.per_layer.filter((pl.col("example_id") == "ex0") & (pl.col("method") == "lava")).sort("layer")
    assert same(rows["spearman"].to_numpy(), spearman(lava, record.oracle[prompt]))


def test_needle_recall_counts_the_evidence_in_the_keep_asked_and_says_which(store_path):
    """Needle recall at ``needle_keep``, by default the ``keep`` given (it was fixed at 0.1)."""
    from rankkit import stores

    record = stores.open(store_path).example("ex0")
    prompt = slice(0, TOKENS - 8)
    lava = record.scores("lava")[:, :, prompt].sum(axis=1)
    evidence = spans_mask(EVIDENCE, TOKENS - 8)
    assert not same(needle_recall(lava, evidence, 0.1), needle_recall(lava, evidence, 0.2))
    for keep, needle_keep, counted in [(0.2, None, 0.2), (0.1, None, 0.1), (0.1, 0.4, 0.4)]:
        result = compare_store(
            store_path, methods=["lava"], keep=keep, needle_keep=needle_keep, detailed=False
        )
        rows = result.per_layer.filter(pl.col("example_id") == "ex0").sort("layer")
        assert same(rows["needle_recall"].to_numpy(), needle_recall(lava, evidence, counted))
        for frame in (result.summary, result.curve):
            assert frame.select("keep", "needle_keep").unique().rows() == [(keep, counted)]


def test_cli_compare_names_its_keep_and_needle_keep(cli, store_path, tmp_path):
    result = cli("compare", store_path, "--methods", "lava", "--keep", "0.2", "--json")
    assert result.exit_code == 0, result.output
    assert {(row["keep"], row["needle_keep"]) for row in json.loads(result.stdout)} == {(0.2, 0.2)}
    out = tmp_path / "c.parquet"
    table = cli("compare", store_path, "--methods", "lava", "--needle-keep", "0.4", "--out", out)
    assert "ranked at keep=0.1, needle recall in the top keep=0.4" in " ".join(table.stdout.split())
    assert pl.read_parquet(out).select("keep", "needle_keep").unique().rows() == [(0.1, 0.4)]
    both = tmp_path / "both.parquet"
    two = cli("compare", store_path, "--methods", "lava", "--keep", "0.1,0.2", "--out", both, "--json")
    rows = json.loads(two.stdout)
    assert [(row["keep"], row["needle_keep"]) for row in rows] == [(0.1, 0.1), (0.2, 0.2)]
    alone = compare_store(store_path, methods=["lava"], keep=0.2)  # each keep's frames as compare_store's
    written = pl.read_parquet(both.with_name("both.summary.parquet"))
    assert written.filter(pl.col("keep") == 0.2).equals(alone.summary)
    assert pl.read_parquet(both).filter(pl.col("keep") == 0.2).equals(alone.per_layer)
    # a token count, as compare_store's needle_keep=16 and a sweep file's take it (16.0 was refused)
    tokens = json.loads(cli("compare", store_path, "--methods", "lava", "--needle-keep", "16", "--json").stdout)
    assert [(row["keep"], row["needle_keep"]) for row in tokens] == [(0.1, 16)]
    titled = cli("compare", store_path, "--methods", "lava", "--budget", "24", "--needle-keep", "16").stdout
    assert "ranked at budget=24, needle recall in the top budget=16" in " ".join(titled.split())  # not "keep 24"
    direct = compare_store(store_path, methods=["lava"], needle_keep=16).summary
    assert [row["needle_recall"] for row in tokens] == direct["needle_recall"].to_list()
    assert str(cli("compare", store_path, "--needle-keep", "all").exception) == (
        "--needle-keep 'all' is not a keep rate or a token count; give e.g. 0.1 or 2048"
    )
    refused = cli("compare", store_path, "--needle-keep", "1.5")
    assert str(refused.exception) == (
        "--needle-keep 1.5 is neither a keep rate in (0, 1] nor a positive token count; give e.g. 0.1 or 2048"
    )
    # token counts as variance and select take them: --budget, as compare_store's budget=16
    counted = cli("compare", store_path, "--methods", "lava", "--budget", "16,24", "--json")
    assert counted.exit_code == 0, counted.output
    rows = json.loads(counted.stdout)
    assert [row["keep"] for row in rows] == [16, 24]
    sixteen = compare_store(store_path, methods=["lava"], budget=16).summary
    assert [row["needle_recall"] for row in rows if row["keep"] == 16] == sixteen["needle_recall"].to_list()
    assert str(cli("compare", store_path, "--keep", "0.1", "--budget", "16").exception).startswith("give exactly one of --keep")


def test_the_python_writes_refuse_what_the_cli_refuses(tmp_path):
    """CompareResult.write and VarianceResult.write replaced any file, the store's own zarr.json
    included; they claim their paths as --out does, and so do compare_keeps' and variance_store's out."""
    from rankkit.eval.compare import compare_keeps

    store = write_store(tmp_path / "s.zarr", examples=1)
    metadata = (store / "zarr.json").read_bytes()
    own = tmp_path / "own.parquet"
    pl.DataFrame({"mine": [1]}).write_parquet(own)
    compared = compare_store(store, methods=["window"], workers=1)
    curves = variance_store(store, method="asl:window_size=8", budget=13, min_layer=1, workers=1)
    for write in (compared.write, curves.write):
        with pytest.raises(RankkitError, match="zarr.json is one of this command's inputs"):
            write(store / "zarr.json", overwrite=True)
        with pytest.raises(RankkitError, match=f"^{re.escape(str(own))} already exists; pass --overwrite"):
            write(own)
        with pytest.raises(RankkitError, match=f"^{re.escape(str(own))} was not written by rankkit"):
            write(own, overwrite=True)
    with pytest.raises(RankkitError, match=f"^{re.escape(str(own))} already exists"):
        compare_keeps(store, keep=0.1, out=own, methods=["window"], workers=1)
    with pytest.raises(RankkitError, match=f"^{re.escape(str(own))} already exists"):
        variance_store(store, method="asl:window_size=8", budget=13, min_layer=1, workers=1, out=own)
    assert (store / "zarr.json").read_bytes() == metadata
    assert pl.read_parquet(own).to_dict(as_series=False) == {"mine": [1]}
    written = compared.write(tmp_path / "c.parquet")
    assert [path.name for path in written] == ["c.parquet"] + [
        f"c.{name}.parquet" for name in ("per_head", "sweep", "curve", "stability", "summary", "pairs")
    ]
    with pytest.raises(RankkitError, match="c.parquet already exists"):
        compared.write(tmp_path / "c.parquet")
    assert compared.write(tmp_path / "c.parquet", overwrite=True) == written
    assert pl.read_parquet(written[0]).equals(compared.per_layer)
    kept = variance_store(store, method="asl:window_size=8", budget=13, min_layer=1, workers=1, out=tmp_path / "v.parquet")
    for name, frame in (("v", kept.curves), ("v.selections", kept.selections), ("v.means", kept.means)):
        assert pl.read_parquet(tmp_path / f"{name}.parquet").equals(frame), name
    with pytest.raises(RankkitError, match="zarr.json is one of this command's inputs"):
        variance_store(store, method="asl:window_size=8", budget=13, workers=1, out=store / "zarr.json", overwrite=True)
    replaced = variance_store(
        store, method="asl:window_size=8", budget=13, min_layer=1, thresholds=0.45, workers=1, out=tmp_path / "v.parquet",
        overwrite=True,
    )  # fmt: skip
    assert pl.read_parquet(tmp_path / "v.selections.parquet").equals(replaced.selections)
    assert not replaced.selections.equals(kept.selections)


def test_compare_resamples_the_clusters_its_examples_share(tmp_path):
    """Examples of one haystack or needle (meta["cluster"]) are one sample: intervals resample
    clusters, pairs test cluster means, and n_clusters says how many there are."""
    from rankkit.eval.stats import bootstrap_means, paired_difference

    path = write_store(tmp_path / "clustered.zarr", examples=4, clusters=["sweep", "sweep", "sweep", "other"])
    result = compare_store(path, methods=["lava", "last_token_raw"], pairs="lava:last_token_raw", layer=2)
    assert result.per_layer.filter(pl.col("method") == "lava")["cluster"].unique(
        maintain_order=True
    ).to_list() == [
        "sweep",
        "other",
    ]
    lava = result.summary.row(by_predicate=pl.col("method") == "lava", named=True)
    assert (lava["n_examples"], lava["n_clusters"]) == (4, 2)
    at_layer = result.per_layer.filter((pl.col("method") == "lava") & (pl.col("layer") == 2)).sort("example_id")
    _, low, high, _ = bootstrap_means(at_layer["spearman"].to_numpy()[:, None], np.array([0, 0, 0, 1]))
    assert (lava["spearman_ci_low"], lava["spearman_ci_high"]) == pytest.approx((low[0], high[0]))
    baseline = result.per_layer.filter((pl.col("method") == "last_token_raw") & (pl.col("layer") == 2)).sort(
        "example_id"
    )
    pair = result.pairs.row(by_predicate=pl.col("layer") == 2, named=True)
    expected = paired_difference(
        at_layer["spearman"].to_numpy(), baseline["spearman"].to_numpy(), ["s"] * 3 + ["o"]
    )
    assert (pair["n_examples"], pair["n_clusters"], pair["p_value"]) == (4, 2, expected["p_value"])
    variance = variance_store(path, method="asl:window_size=8", budget=13, min_layer=1, observed_layers=2)
    assert variance.curves["cluster"].to_list()[::LAYERS] == ["sweep", "sweep", "sweep", "other"]
    assert set(variance.means["n_examples"]) == {4} and set(variance.means["n_clusters"]) == {2}
    swept = compare_store(write_store(tmp_path / "sweep.zarr", clusters=["sweep"] * 3), methods=["lava"])
    one = swept.summary.row(0, named=True)  # one haystack and needle at three depths: one sample
    assert (one["n_examples"], one["n_clusters"], one["spearman_ci_low"]) == (3, 1, None)


def test_compare_layer_and_methods_choose_the_rows(store_path):
    chosen = compare_store(store_path, layer=1, methods=["lava", "claa"])
    assert chosen.summary["method"].to_list() == ["lava", "claa"]
    assert chosen.summary["layer"].to_list() == [1, 1]
    assert set(chosen.per_head["method"]) == {"lava"}
    with pytest.raises(RankkitError, match="rankkit capture --probes window:w=32"):
        compare_store(store_path, methods=["snapkv"])
    with pytest.raises(RankkitError, match="neither a probe"):
        compare_store(store_path, methods=["nothing"])
    with pytest.raises(RankkitError, match="outside"):
        compare_store(store_path, layer=LAYERS)


def test_compare_without_oracle(tmp_path):
    path = write_store(tmp_path / "no-oracle.zarr", oracle=False, draft=False, examples=1)
    with pytest.raises(RankkitError, match="run `rankkit oracle"):
        compare_store(path)
    free = compare_store(path, oracle=False)
    window = free.summary.filter(pl.col("method") == "window").row(0, named=True)
    assert window["spearman"] is None and window["needle_recall"] == 1.0 and window["layer_to_layer"] == 1.0
    assert "specprefill" not in free.summary["method"]
    assert free.pairs.height == 0  # the default pairs test Spearman: none without the oracle


def write_partly_oracled_store(path):
    """Three examples, the oracle of one (ex1)."""
    from rankkit import stores

    write_store(path, oracle=False, draft=False, examples=3)
    truth = np.linspace(0, 1, TOKENS, dtype=np.float32)
    stores.create(path, {"model": {"id": "synthetic"}}).add_oracle(
        "ex1", oracle=truth, oracle_layers=np.tile(truth, (LAYERS, 1)), attrs={}
    )
    return path


def write_timing_only_store(path):
    return write_store(path, draft=False, examples=1, run_meta={"model": {"id": "random:tiny"}, "timing_only": True})


def test_compare_leaves_out_the_examples_without_an_oracle_and_says_so(tmp_path):
    """Two of three examples without an oracle: compared with the oracle, the one that has it counts,
    and the warning names the two, the store and the fix."""
    path = write_partly_oracled_store(tmp_path / "partly.zarr")
    with pytest.warns(UserWarning) as warned:
        compared = compare_store(path, methods="window", workers=1)
    assert [str(warning.message) for warning in warned] == [
        f"left out 2 example(s) without an oracle; `rankkit oracle {path}` adds them"
    ]
    assert set(compared.per_layer["example_id"]) == {"ex1"} and compared.summary["n_examples"].to_list() == [1]


def test_compare_refuses_a_timing_only_store_with_the_oracle_and_warns_without_it(tmp_path):
    from rankkit.checks import TIMING_ONLY

    path = write_store(tmp_path / "real.zarr", draft=False, examples=1)
    timing_only = write_timing_only_store(tmp_path / "timing.zarr")
    with pytest.raises(RankkitError) as refused:
        compare_store(timing_only, workers=1)
    assert str(refused.value) == (
        f"store {timing_only} was captured with random:tiny, {TIMING_ONLY}: capture a real model to compare "
        "rankings with its oracle"
    )
    with pytest.warns(UserWarning) as warned:
        free = compare_store(timing_only, oracle=False, methods="window", workers=1)
    assert [str(warning.message) for warning in warned] == [f"store {timing_only} was captured with random:tiny: {TIMING_ONLY}"]
    assert free.per_layer.equals(compare_store(path, oracle=False, methods="window", workers=1).per_layer)


@pytest.mark.frames
def test_compares_warnings_point_at_its_caller(tmp_path):
    """Examples left out for want of an oracle, and a timing-only store compared without one."""
    for path, oracle in (
        (write_partly_oracled_store(tmp_path / "partly.zarr"), True),
        (write_timing_only_store(tmp_path / "timing.zarr"), False),
    ):
        with pytest.warns(UserWarning) as warned:
            compare_store(path, oracle=oracle, methods="window", workers=1)
        assert [warning.filename for warning in warned] == [__file__]


def test_an_unknown_method_is_refused_with_every_name_compare_takes(store_path):
    from rankkit.methods import REGISTRY

    with pytest.raises(RankkitError) as refused:
        compare_store(store_path, methods="nothing,window,none", workers=1)
    assert str(refused.value) == (
        f"nothing, none is neither a probe {store_path} holds nor a method; choose from "
        f"{', '.join(['last_token_raw', 'lava', 'window', *sorted(REGISTRY)])}"
    )


def test_pairs_without_an_oracle_are_refused(tmp_path, cli):
    """compare_store(oracle=False, pairs=...) and compare --no-oracle --pairs gave a pairs frame of
    nulls with n_examples 0, silently."""
    path = write_store(tmp_path / "no-oracle.zarr", oracle=False, draft=False, examples=1)
    message = (
        "--pairs tests differences of Spearman with the oracle, which --no-oracle leaves out; "
        "drop --pairs or compare with the oracle"
    )
    for pairs in ("window:lava", [("window", "lava")]):
        with pytest.raises(RankkitError) as refused:
            compare_store(path, methods="window,lava", oracle=False, pairs=pairs, workers=1)
        assert str(refused.value) == message
    shown = cli("compare", path, "--no-oracle", "--methods", "window,lava", "--pairs", "window:lava")
    assert str(shown.exception) == message


def test_compare_writes_every_frame(result, tmp_path):
    written = result.write(tmp_path / "out" / "results.parquet")
    assert [path.name for path in written] == [
        "results.parquet",
        "results.per_head.parquet",
        "results.sweep.parquet",
        "results.curve.parquet",
        "results.stability.parquet",
        "results.summary.parquet",
        "results.pairs.parquet",
    ]
    assert pl.read_parquet(written[0]).equals(result.per_layer)


def test_variance_store(store_path):
    variance = variance_store(
        store_path, method="asl:window_size=8", budget=13, min_layer=1, observed_layers=2
    )
    assert variance.curves.columns == ["example", "task", "probe", "layer", "relative_variance"]
    assert variance.selections.columns == ["example", "task", "probe", "tau", "selection_layer", "fallback"]
    assert variance.curves.height == 3 * LAYERS and variance.selections.height == 3 * 5
    named = [(f"ex{index}", "niah", "window") for index in range(3)]  # window_size=8's probe
    for frame in (variance.curves, variance.selections):
        assert frame.select("example", "task", "probe").unique(maintain_order=True).rows() == named
    # window ranks identically at every layer: the variance is 0 from L_min on, which ASL reads as
    # settled (relative variance 0), so every threshold selects L_min
    assert variance.curves["relative_variance"].null_count() == 3 * 1
    assert set(variance.selections["selection_layer"]) == {1}
    record_curve = variance.by_example()[0]
    assert record_curve["relative_variance"][0] is None and record_curve["relative_variance"][1] == 0.0
    assert list(record_curve["selection_layer"]) == ["0.2", "0.3", "0.4", "0.5", "0.6"]
    for row in variance.by_example():  # each example's own curve and selections, as the frames hold them
        own = variance.selections.filter(pl.col("example") == row["example"])
        curve = variance.curves.filter(pl.col("example") == row["example"])
        assert (row["task"], row["probe"], row["min_layer"]) == (own["task"][0], own["probe"][0], 1)
        assert row["relative_variance"] == curve["relative_variance"].to_list()
        assert row["selection_layer"] == {f"{tau:g}": layer for tau, layer in own.select("tau", "selection_layer").rows()}
        assert row["fallback"] == {f"{tau:g}": fallback for tau, fallback in own.select("tau", "fallback").rows()}
    with pytest.raises(RankkitError, match="window:w=32"):
        variance_store(store_path)
    with pytest.raises(RankkitError, match="asl"):
        variance_store(store_path, method="claa")
    # L_min and L_obs past the store's depth, refused with the layers it has
    with pytest.raises(RankkitError, match=rf"^method 'asl': min_layer={LAYERS} is outside \[0, {LAYERS - 1}\]$"):
        variance_store(store_path, method="asl:window_size=8", budget=13, min_layer=LAYERS)
    with pytest.raises(RankkitError, match=rf"^method 'asl': observed_layers={LAYERS + 1} is outside \[2, {LAYERS}\]$"):
        variance_store(store_path, method="asl:window_size=8", budget=13, observed_layers=LAYERS + 1)


def test_variance_reports_the_methods_own_tau_and_refuses_an_option_contradicting_its_spec(store_path):
    """asl:tau=0.8 was accepted and its tau left out of the thresholds; --min-layer 2 beside
    asl:min_layer=1 silently won."""
    variance = variance_store(store_path, method="asl:window_size=8,tau=0.8", budget=13, min_layer=1)
    assert sorted(set(variance.selections["tau"])) == [0.2, 0.3, 0.4, 0.5, 0.6, 0.8]
    assert list(variance.by_example()[0]["selection_layer"]) == ["0.2", "0.3", "0.4", "0.5", "0.6", "0.8"]
    with pytest.raises(RankkitError, match=r"^--min-layer 2 contradicts asl:min_layer=1; give one of them$"):
        variance_store(store_path, method="asl:window_size=8,min_layer=1", budget=13, min_layer=2)
    same = variance_store(store_path, method="asl:window_size=8,min_layer=1", budget=13, min_layer=1)
    assert same.min_layer == 1


@pytest.mark.parametrize(
    ("analysis", "arguments", "message"),
    [
        (variance_store, {"workers": 0}, "--workers must be a whole number >= 1, got 0"),
        (variance_store, {"thresholds": []}, "--thresholds names nothing; give e.g. --thresholds 0.2,0.3"),
        (variance_store, {"thresholds": ["0.3"]}, "--thresholds takes a number, not str '0.3'"),
        (variance_store, {"thresholds": "0.3,x"}, "--thresholds 'x' is not a number; give e.g. --thresholds 0.1,0.2"),
        (
            variance_store,
            {"method": "asl:window_size=8,observed_layers=2", "observed_layers": 3},
            "--observed-layers 3 contradicts asl:observed_layers=2; give one of them",
        ),
        (compare_store, {"workers": 0}, "--workers must be a whole number >= 1, got 0"),
        (compare_store, {"layer": 1.5}, "--layer takes a whole number, not float 1.5"),
        (compare_store, {"layer": True}, "--layer takes a whole number, not bool True"),
        (
            compare_store,
            {"needle_keep": 1.5},
            "--needle-keep 1.5 is neither a keep rate in (0, 1] nor a positive token count; give e.g. 0.1 or 2048",
        ),
        (compare_store, {"span": "nowhere"}, "span 'nowhere' is not one of prompt, context; use --span prompt or context"),
        (compare_store, {"keep": 0.1, "budget": 3}, "give exactly one of --keep (e.g. 0.1) or --budget (e.g. 2048)"),
        (compare_store, {"methods": []}, "--methods names nothing; give e.g. --methods window,claa,fastkv"),
    ],
)
def test_an_analysis_refuses_an_argument_in_its_options_words_before_reading_the_store(tmp_path, analysis, arguments, message):
    """Each refusal names the command-line option and comes before the store (here none) is read."""
    with pytest.raises(RankkitError) as refused:
        analysis(tmp_path / "missing.zarr", **arguments)
    assert str(refused.value) == message


def test_an_analysis_of_a_store_without_a_complete_example_is_refused(tmp_path):
    """variance, and compare with the oracle or without."""
    from rankkit import stores

    path = tmp_path / "empty.zarr"
    stores.create(path, {"model": {"id": "synthetic"}})
    for analysis in (variance_store, partial(compare_store, oracle=True), partial(compare_store, oracle=False)):
        with pytest.raises(RankkitError) as refused:
            analysis(path, workers=1)
        assert str(refused.value) == f"store {path} has no complete example; capture into it first"


@pytest.mark.parametrize(
    ("analysis", "examples_of"),
    [
        (partial(variance_store, method="asl:window_size=8", budget=13), lambda variance: variance.curves["example"]),
        (partial(compare_store, methods="window"), lambda compared: compared.per_layer["example_id"]),
    ],
    ids=["variance", "compare"],
)
def test_an_analysis_with_one_worker_starts_no_process(tmp_path, monkeypatch, analysis, examples_of):
    """workers=1 ranks in this process however many examples there are: each worker would load its own
    copy of the libraries."""
    import rankkit.eval.parallel as parallel

    def no_pool(*_):
        raise AssertionError("a worker pool was started")

    monkeypatch.setattr(parallel, "_worker_pool", no_pool)
    path = write_store(tmp_path / "run.zarr", examples=5)  # two workers' worth, where two CPUs are free
    result = analysis(path, workers=1)
    assert examples_of(result).unique(maintain_order=True).to_list() == [f"ex{index}" for index in range(5)]


def test_a_method_is_summarised_at_its_own_selection_layer_and_probes_at_claas(store_path):
    """Without --layer, a method named with its selection layer is summarised there, the probes and
    the other methods at CLAA's l_p (3 of 6)."""
    compared = compare_store(store_path, methods=["window", "fastkv:tsp_layer=4", "claa"], keep=0.5, workers=1)
    assert compared.summary.select("method", "layer").rows() == [("window", 3), ("fastkv:tsp_layer=4", 4), ("claa", 3)]


def hand_variance(curves: dict[str, tuple[str, list[float]]], taus: tuple[float, ...], store) -> VarianceResult:
    """variance_store's result for curves given by hand ({example: (task, curve)}, NaN before
    L_min = 1), each selection as asl makes it: frames no capture can bend to a test's needs."""
    curve_rows, selection_rows = [], []
    for example, (task, curve) in curves.items():
        named = {"example": example, "task": task, "probe": "window:w=8"}
        curve_rows += [
            {**named, "layer": layer, "relative_variance": None if np.isnan(value) else value}
            for layer, value in enumerate(curve)
        ]
        selection_rows += [
            {**named, "tau": tau, "selection_layer": selection_layer(curve, tau), "fallback": is_fallback(curve, tau)}
            for tau in taus
        ]
    named_schema = {"example": pl.Categorical, "task": pl.String, "probe": pl.String}
    return VarianceResult(
        1,
        pl.DataFrame(curve_rows, schema={**named_schema, "layer": pl.Int32, "relative_variance": pl.Float64}),
        pl.DataFrame(
            selection_rows,
            schema={**named_schema, "tau": pl.Float64, "selection_layer": pl.Int32, "fallback": pl.Boolean},
        ),
        store,
    )


def falling_curves(tasks: list[str]) -> dict[str, tuple[str, list[float]]]:
    """A curve for each of ``tasks``, each from 1 at L_min = 1 falling by its own factor a layer: the
    first six select layers (and fall back) each their own way."""
    return {
        f"ex{index}": (task, [np.nan, *((0.88 - 0.07 * index) ** step for step in range(6))])
        for index, task in enumerate(tasks)
    }


def test_variance_by_example_pairs_each_curve_with_its_own_selections(tmp_path):
    """by_example groups the curves and the selections apart and pairs them in order: grouped out of
    first-seen order (as polars' group_by is by default), a curve carried another example's
    layers, which no store where every example selects L_min can show."""
    curves = falling_curves(["niah"] * 6)
    taus = (0.2, 0.5)
    rows = hand_variance(curves, taus, tmp_path / "run.zarr").by_example()
    expected = []
    for example, (task, curve) in curves.items():
        chosen, fallback = {}, {}
        for tau in taus:
            below = [layer for layer in range(1, len(curve)) if curve[layer] < tau]
            chosen[f"{tau:g}"] = below[0] if below else len(curve) - 1
            fallback[f"{tau:g}"] = not below
        expected.append(
            {
                "example": example,
                "task": task,
                "probe": "window:w=8",
                "relative_variance": [None, *curve[1:]],
                "min_layer": 1,
                "selection_layer": chosen,
                "fallback": fallback,
            }
        )
    assert rows == expected
    assert len({tuple(row["selection_layer"].values()) for row in rows}) == 6  # no two alike
    assert [row["fallback"]["0.2"] for row in rows] == [True, True, True, False, False, False]
    assert [row["selection_layer"]["0.5"] for row in rows] == [6, 5, 4, 3, 3, 3]


def test_variance_means_keep_the_tasks_in_first_seen_order_each_resampled_alone(tmp_path):
    """A store of several tasks: means per task and layer, the tasks in the order the store first
    names them (the CLI prints them so), each interval drawn from its own task's examples."""
    from rankkit.eval.stats import bootstrap_means
    from rankkit.eval.variance import mean_curves

    tasks = ["qa", "niah", "code", "niah", "sum", "qa", "kv", "code", "sum", "kv"]
    curves = falling_curves(tasks)
    means = mean_curves(hand_variance(curves, (0.3,), tmp_path / "run.zarr").curves)
    order, layers = list(dict.fromkeys(tasks)), range(1, 7)  # from L_min on
    assert means["task"].to_list() == [task for task in order for _ in layers]
    assert means["layer"].to_list() == [*layers] * len(order)
    for row in means.iter_rows(named=True):
        values = [curve[row["layer"]] for task, curve in curves.values() if task == row["task"]]
        _, low, high, _ = bootstrap_means(np.array(values)[:, None])
        assert row["relative_variance"] == pytest.approx(sum(values) / len(values), abs=1e-15)
        assert (row["relative_variance_ci_low"], row["relative_variance_ci_high"]) == pytest.approx((low[0], high[0]))
        assert (row["relative_variance_n"], row["n_examples"]) == (2, 2)


def test_variance_write_replaces_a_file_only_with_overwrite_even_one_that_came_after_its_claim(tmp_path, monkeypatch):
    """write claims its paths, then writes each with the overwrite it was given: a second write with
    overwrite replaces the first, and a file another run wrote meanwhile is kept and refused without."""
    import rankkit.eval.variance as variance
    from rankkit.outputs import GENERATOR_TAG

    out = tmp_path / "v.parquet"
    first = hand_variance(falling_curves(["niah"] * 2), (0.3,), tmp_path / "run.zarr")
    paths = first.write(out)
    again = hand_variance(falling_curves(["qa"] * 2), (0.3,), tmp_path / "run.zarr")
    assert again.write(out, overwrite=True) == paths
    for path, frame in zip(paths, (again.curves, again.selections, again.means), strict=True):
        assert pl.read_parquet(path).equals(frame), path.name
    other = f"{GENERATOR_TAG} the other run's means"
    mean_curves = variance.mean_curves

    def the_other_run_finishes_first(curves):
        paths[2].write_text(other)
        return mean_curves(curves)

    for path in paths:
        path.unlink()
    monkeypatch.setattr(variance, "mean_curves", the_other_run_finishes_first)
    late = hand_variance(falling_curves(["code"] * 2), (0.3,), tmp_path / "run.zarr")
    with pytest.raises(RankkitError, match=f"^{re.escape(str(paths[2]))} was written by another run while this one worked"):
        late.write(out)
    assert paths[2].read_text() == other


def write_settling_store(path, run_meta=None):
    """Four examples of 12 layers and 200 tokens whose window rankings settle with depth: noise
    shrinking around a fixed order, so each curve falls from L_min on."""
    from rankkit import stores

    rng = np.random.default_rng(7)
    writer = stores.create(path, run_meta or {"model": {"id": "synthetic"}})
    for index in range(4):
        base = rng.random(200)
        scores = np.stack([base + rng.random(200) * 2.0 / (1 + layer) ** 2 for layer in range(12)])
        scores = np.broadcast_to(scores[:, None], (12, 2, 200)).astype(np.float32)
        writer.write_example(f"ex{index}", attrs={}, tokens=np.arange(200), scores={"window:w=32": scores})
    return path


def captured_window(record) -> Captured:
    """A settling store's example as the asl method reads it."""
    return Captured({"window:w=32": torch.from_numpy(record.scores("window:w=32"))}, 12, 200)


def test_variance_and_the_asl_method_pick_the_same_layer(tmp_path):
    from rankkit import stores

    path = write_settling_store(tmp_path / "asl.zarr")
    # 0.001: no curve drops that low, so asl falls back to its last layer, and variance reports that layer
    variance = variance_store(path, keep=0.3, thresholds=(0.001, 0.3))
    store = stores.open(path)
    for tau, expected_fallback in ((0.001, True), (0.3, False)):
        chosen = variance.selections.filter(pl.col("tau") == tau)
        assert chosen["fallback"].to_list() == [expected_fallback] * 4
        for record, layer in zip(store.examples(), chosen["selection_layer"], strict=True):
            selected = make("asl", tau=tau).select_offline(captured_window(record), Budget.from_keep(0.3)).layer
            assert layer == selected and (selected == 11) == expected_fallback


def test_variance_curves_hold_the_asl_methods_own_curve_under_the_given_l_min_and_l_obs(tmp_path):
    """curves holds, row by row, each example's id, its task (this store names none: nulls, still
    text, as where one is named), the probe asl ranks by, its layers and asl's own curve there, null
    before L_min: L_min and L_obs as given (neither the model's default here), the budget by default
    keep defaults.KEEP (here raised to what asl always keeps, and said so)."""
    from rankkit import defaults, stores

    path = write_settling_store(tmp_path / "asl.zarr")
    with pytest.warns(UserWarning, match=r"^keep=0\.1 asks for 20 token\(s\), fewer than asl always keeps; it keeps 33"):
        variance = variance_store(path, min_layer=2, observed_layers=5, workers=1)
    asl = make("asl", min_layer=2, observed_layers=5)
    expected = []
    for record in stores.open(path).examples():
        curve = asl.variance_curve(captured_window(record), Budget.from_keep(defaults.KEEP))
        expected += [
            (record.id, None, "window:w=32", layer, None if np.isnan(value) else value)
            for layer, value in enumerate(curve)
        ]
    assert variance.curves.rows() == expected
    assert list(variance.curves.schema.items()) == [
        ("example", pl.Categorical), ("task", pl.String), ("probe", pl.String), ("layer", pl.Int32),
        ("relative_variance", pl.Float64),
    ]  # fmt: skip
    assert variance.min_layer == 2 and variance.curves["relative_variance"].null_count() == 4 * 2
    assert list(variance.selections.schema.items()) == [
        ("example", pl.Categorical), ("task", pl.String), ("probe", pl.String), ("tau", pl.Float64),
        ("selection_layer", pl.Int32), ("fallback", pl.Boolean),
    ]  # fmt: skip


def test_variance_of_a_timing_only_store_says_what_its_curves_are_worth(tmp_path):
    from rankkit.checks import TIMING_ONLY

    path = write_settling_store(tmp_path / "random.zarr", {"model": {"id": "random:tiny"}, "timing_only": True})
    with pytest.warns(UserWarning) as warned:
        variance_store(path, keep=0.3, workers=1)
    assert [str(warning.message) for warning in warned] == [f"store {path} was captured with random:tiny: {TIMING_ONLY}"]


def test_compare_and_variance_read_keep_as_a_rate_and_budget_as_tokens(store_path):
    """compare_store(keep=1) ranked under 1 token where --keep 1 keeps everything, and variance_store's
    budget= stood for both; keep= and budget= now mean what --keep and --budget mean."""
    whole = compare_store(store_path, methods=["lava"], keep=1, workers=1)
    assert whole.keep == 1.0 and isinstance(whole.keep, float)
    assert set(whole.per_layer["needle_recall"]) == {1.0}  # the top 100% holds every evidence token
    assert whole.per_layer.equals(compare_store(store_path, methods=["lava"], keep=1.0, workers=1).per_layer)
    one = compare_store(store_path, methods=["lava"], budget=1, workers=1)
    assert one.keep == 1 and isinstance(one.keep, int) and max(one.per_layer["needle_recall"]) <= 0.25
    with pytest.raises(RankkitError, match=r"^keep rate 2048 is outside \(0, 1\]: use e.g. --keep 0.1, or --budget"):
        compare_store(store_path, keep=2048)
    with pytest.raises(RankkitError, match="^budget 0.5 is not a positive token count"):
        compare_store(store_path, budget=0.5)
    with pytest.raises(RankkitError, match="^give exactly one of --keep"):
        compare_store(store_path, keep=0.1, budget=16)
    asl = {"method": "asl:window_size=8", "min_layer": 1, "workers": 1}
    assert variance_store(store_path, keep=1, **asl).curves.equals(variance_store(store_path, budget=60, **asl).curves)
    with pytest.raises(RankkitError, match=r"^keep rate 13 is outside \(0, 1\]"):
        variance_store(store_path, keep=13, **asl)


def test_compare_and_variance_warn_of_a_budget_raised_or_clamped(store_path):
    """select warned of a budget below what a method always keeps and of one above the prompt;
    compare and variance ranked under both silently."""
    with pytest.warns(UserWarning) as warned:
        compare_store(store_path, methods=["claa"], budget=1, workers=1)
    assert [str(warning.message) for warning in warned] == [
        f"budget=1 asks for 1 token(s), fewer than claa always keeps; it keeps {make('claa').minimum_keep()} "
        "(in 3 of 3 prompts)"
    ]
    with pytest.warns(UserWarning) as warned:
        compare_store(store_path, methods=["window"], budget=TOKENS + 1, workers=1)
        variance_store(store_path, method="asl:window_size=8", budget=TOKENS + 1, min_layer=1, workers=1)
    # once for the store, as the raised budget is: a line per example buried the rest
    clamped = f"--budget {TOKENS + 1} is larger than the prompt ({TOKENS} tokens); it keeps all of it (in 3 of 3 prompts)"
    assert [str(warning.message) for warning in warned] == [clamped] * 2


def test_compare_warns_of_a_needle_keep_larger_than_the_ranked_span_as_of_such_a_budget(store_path):
    """--needle-keep 5000 on prompts of ~1000 tokens gave every method needle recall 1.00 silently,
    where --budget 5000 warned; so did one between the ranked span (the prompt less its observation
    window) and the prompt, where the warning compared with the prompt."""
    import warnings

    from rankkit.eval.compare import ranked_slice

    span = ranked_slice(None, "prompt", TOKENS).stop  # every example's ranked span, the prompt less W
    for needle_keep in (TOKENS + 1, span + 1):
        with pytest.warns(UserWarning) as warned:
            result = compare_store(store_path, methods=["window"], keep=0.5, needle_keep=needle_keep, workers=1)
        assert [str(warning.message) for warning in warned] == [
            f"--needle-keep {needle_keep} is larger than the ranked span ({span} tokens); it keeps all of it "
            "(in 3 of 3 ranked spans)"
        ]
        assert set(result.per_layer["needle_recall"].drop_nulls()) == {1.0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a needle keep within the spans says nothing, nor one as a keep rate
        compare_store(store_path, methods=["window"], keep=0.5, needle_keep=span, workers=1)
        compare_store(store_path, methods=["window"], keep=0.5, needle_keep=1.0, workers=1)


def test_a_budget_below_what_a_method_always_keeps_is_raised_with_a_warning(store_path):
    """select --budget 1 kept claa's window of 8 and variance --budget 5 ranked 33 tokens, each silently,
    under their budget's label."""
    import warnings

    from rankkit.eval.offline import select_store

    claa, asl = make("claa"), make("asl", window_size=8)
    with pytest.warns(UserWarning) as warned:
        rows = select_store(store_path, "claa", budget=1)
        variance_store(store_path, method="asl:window_size=8", budget=5, workers=1)
    kept = claa.minimum_keep()
    assert [str(warning.message) for warning in warned] == [
        f"budget=1 asks for 1 token(s), fewer than claa always keeps; it keeps {kept} (in 3 of 3 prompts)",
        f"budget=5 asks for 5 token(s), fewer than asl always keeps; it keeps {asl.minimum_keep()} (in 3 of 3 prompts)",
    ]
    assert {row["budget_tokens"] for row in rows} == {kept}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a budget the method can keep says nothing
        select_store(store_path, "claa", budget=kept)


def test_oracles_made_with_other_settings_in_one_store_are_refused(tmp_path):
    """An example copied in from a store whose oracles used kernel 5 and the reference answer was
    scored with the others (kernel 7, generated answer) as one ground truth."""
    from rankkit import stores
    from rankkit.oracle import oracle_params

    path = write_store(tmp_path / "run.zarr", oracle=False, examples=2)
    writer = stores.create(path, {"model": {"id": "synthetic"}})  # reopened: the same run
    truth = np.linspace(0, 1, TOKENS, dtype=np.float32)
    made = [oracle_params("generated", False, 7, 32), oracle_params("reference", True, 5, 32)]
    for example_id, params in zip(("ex0", "ex1"), made, strict=True):
        writer.add_oracle(example_id, oracle=truth, oracle_layers=np.tile(truth, (LAYERS, 1)), attrs={"oracle_params": params})
    with pytest.raises(RankkitError, match=rf"^store {re.escape(str(path))} holds oracles made with other settings: example 'ex0' .*'kernel': 7.*, example 'ex1' .*'kernel': 5.*; remake them alike with `rankkit oracle"):
        compare_store(path, workers=1)
    assert compare_store(path, oracle=False, workers=1).per_layer.height  # without the oracle, nothing to mix


@pytest.mark.processes
def test_two_workers_give_the_frames_of_one(tmp_path):
    path = write_store(tmp_path / "run.zarr", examples=9)
    one, two = compare_store(path, workers=1), compare_store(path, workers=2)
    for name in ("per_layer", "per_head", "sweep", "curve", "stability", "summary", "pairs"):
        assert getattr(one, name).equals(getattr(two, name)), name
    one, two = (
        variance_store(path, method="asl:window_size=8", budget=20, workers=workers) for workers in (1, 2)
    )
    assert one.curves.equals(two.curves) and one.selections.equals(two.selections)
    with pytest.raises(RankkitError, match="--workers must be"):
        compare_store(path, workers=0)


def test_more_workers_than_cpus_are_refused_before_any_starts(tmp_path):
    """--workers 1000 on a store of two examples started a thousand processes until the kernel killed them."""
    from rankkit.defaults import usable_cores

    path = write_store(tmp_path / "run.zarr", examples=2)
    cores = usable_cores()
    message = f"--workers {cores + 1} is more than the {cores} CPUs this process may use; give at most {cores}"
    for analysis in (compare_store, partial(variance_store, method="asl:window_size=8", budget=20)):
        with pytest.raises(RankkitError, match=re.escape(message)):
            analysis(path, workers=cores + 1)


# Set when a worker imports this module: its identity even once its pid is reused.
PROCESS_IDENTITY = f"{os.getpid()}:{time.time_ns()}"


def worker_pid(record) -> str:
    return PROCESS_IDENTITY


def first_layer_scores(record) -> np.ndarray:
    return record.scores("window")[0]


@pytest.mark.processes
def test_a_pool_ended_while_its_workers_hold_read_arrays_leaves_no_leaked_semaphore(tmp_path):
    """A pool ended early kills its workers with SIGTERM; each had made blosc's lock on its first
    read, a named semaphore that Python warned was leaked once the command ended."""
    path = write_store(tmp_path / "run.zarr", examples=12)
    script = f"""
import sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_eval import first_layer_scores
from rankkit.eval.parallel import map_examples
if __name__ == "__main__":
    results = map_examples({str(path)!r}, [f"ex{{index}}" for index in range(12)], first_layer_scores, workers=2)
    next(results)
    results.close()
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stderr == "", result.stderr


@pytest.mark.processes
def test_maps_inside_shared_workers_reuse_one_pool_and_give_the_same_frames(tmp_path):
    from rankkit.eval.parallel import _pool_key, _shared_pools, map_examples, shared_workers

    path = write_store(tmp_path / "run.zarr", examples=9)
    ids = [f"ex{index}" for index in range(9)]
    alone = compare_store(path, workers=2)
    with shared_workers(path, 2, now=True):  # as the commands start it: 9 examples are work for two
        assert _shared_pools[_pool_key(path)][0] == 2
        first = set(map_examples(path, ids, worker_pid, workers=2))
        shared = compare_store(path, workers=2)
        second = set(map_examples(path, ids, worker_pid, workers=2))
    assert len(first | second) <= 2  # one pool of two (a slow-starting worker may get no task)
    assert not set(map_examples(path, ids, worker_pid, workers=2)) & (
        first | second
    )  # a pool of its own again
    assert alone.per_layer.equals(shared.per_layer) and alone.pairs.equals(shared.pairs)


def test_a_command_on_a_store_of_a_few_examples_starts_no_workers(tmp_path):
    """`rankkit compare` started its two workers as it began, on any store: on one of a few examples,
    evaluated in the command's own process, they never got a task and it waited 2 s for their
    start-up to end. A store that cannot be read starts none either; the command's reading says why."""
    from rankkit.eval.parallel import _EXAMPLES_PER_TASK, _pool_key, _shared_pools, shared_workers

    few = write_store(tmp_path / "few.zarr", examples=_EXAMPLES_PER_TASK)
    alone = compare_store(few, workers=1)
    with shared_workers(few, 2, now=True):
        assert _shared_pools[_pool_key(few)] is None
        assert compare_store(few, workers=2).per_layer.equals(alone.per_layer)
    missing = tmp_path / "missing.zarr"
    with shared_workers(missing, 2, now=True):
        assert _shared_pools[_pool_key(missing)] is None
        with pytest.raises(RankkitError, match="missing.zarr"):
            compare_store(missing, workers=2)


class _InterruptedPool:
    """A pool whose every step of ending receives Ctrl-C, as a second one (or ``timeout``'s to the
    process group) arrives while the workers end."""

    def __init__(self):
        self.steps: list[str] = []

    def _step(self, name: str) -> None:
        signal.raise_signal(signal.SIGINT)
        self.steps.append(name)

    def close(self):
        self._step("close")

    def join(self):
        self._step("join")

    def terminate(self):
        self._step("terminate")


@pytest.mark.parametrize(("finished", "steps"), [(True, ["close", "join"]), (False, ["terminate"])])
def test_an_interrupt_while_the_workers_end_is_raised_once_they_have(finished, steps):
    """Raised inside the pool's join, it left the pool's finalizer printing a traceback below compare's
    one-line note."""
    from rankkit.eval.parallel import _end_pool

    pool = _InterruptedPool()
    with pytest.raises(KeyboardInterrupt):
        _end_pool(pool, finished=finished)
    assert pool.steps == steps


# ---------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def cli():
    from typer.testing import CliRunner

    from rankkit.cli import compare_cmd, select_cmd  # noqa: F401  (registers the commands)
    from rankkit.cli.app import app

    runner = CliRunner()
    return lambda *args: runner.invoke(app, [str(arg) for arg in args], env={"COLUMNS": "200"})


def test_evidence_kept_nowhere_is_a_wilson_interval_not_zero_to_zero():
    """needle_recall and evidence_kept are each example's share of its evidence, and recall_at_X its
    share of the oracle's top X%: scores, so an all-zero column (a method that never keeps the
    needle) gets Wilson's interval over n, as the README says, where the bootstrap read
    0.00 [0.00, 0.00]."""
    from rankkit.eval.compare import RECALL_COLUMNS, curve_frame, summary_frame
    from rankkit.eval.stats import wilson_interval

    shares = ("needle_recall", "evidence_kept", *RECALL_COLUMNS)
    per_layer = pl.DataFrame(
        {
            "example_id": ["a", "b", "c", "d"],
            "method": ["claa"] * 4,
            "layer": [3] * 4,
            **{metric: [0.5, 0.6, 0.7, 0.8] for metric in ("spearman", "kendall", "adjacent_spearman")},
            **{metric: [0.0] * 4 for metric in shares},
        }
    )
    for frame in (summary_frame(per_layer, {"claa": 3}), curve_frame(per_layer)):
        for metric in shares:
            low, high = wilson_interval(0, 4)
            assert frame.row(0, named=True)[f"{metric}_ci_high"] == pytest.approx(high) and high > 0.4
            assert frame.row(0, named=True)[f"{metric}_ci_low"] == low == 0
        assert frame.row(0, named=True)["spearman_ci_high"] < 0.8  # a bootstrap, as before


def test_an_interrupt_while_compare_summarises_or_writes_is_one_line_naming_what_was_written(
    cli, store_path, tmp_path, monkeypatch
):
    """The summaries and the writes came after the interrupt handling: SIGTERM there exited 143 silently."""
    from rankkit.errors import Interrupted
    from rankkit.eval import compare

    def interrupted_after_the_first(results, path, *, overwrite, written):
        written.append(compare.outputs.write_parquet(results[0].per_layer, path))
        raise KeyboardInterrupt

    monkeypatch.setattr(compare, "write_results", interrupted_after_the_first)
    out = tmp_path / "c.parquet"
    result = cli("compare", store_path, "--workers", "1", "--out", out)
    assert isinstance(result.exception, Interrupted)
    assert str(result.exception) == f"interrupted after writing {out}; {store_path} unchanged"
    monkeypatch.setattr(compare.CompareResult, "summary", property(lambda self: _raise(KeyboardInterrupt())))
    result = cli("compare", store_path, "--workers", "1", "--json")
    assert str(result.exception) == f"interrupted: nothing written, {store_path} unchanged"


def _raise(error):
    raise error


def test_cli_compare_without_an_oracle_says_so_and_has_no_paired_spearman_table(cli, store_path):
    """Its title read "Rankings vs oracle" over a table of empty paired rows."""
    shown = cli("compare", store_path, "--no-oracle", "--workers", "1")
    assert shown.exit_code == 0, shown.output
    assert "Rankings without an oracle" in shown.stdout and "vs oracle" not in shown.stdout
    assert "Paired" not in shown.stdout and "Paired" in cli("compare", store_path, "--workers", "1").stdout


def test_cli_compare_json_keys(cli, store_path):
    result = cli("compare", store_path, "--oracle", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    required = {"method", "layer", "spearman", "kendall", "recall_at_10", "recall_at_20", "recall_at_40"}
    required |= {"needle_recall", "n_examples", "spearman_ci_low", "spearman_ci_high", "needle_recall_ci_low"}
    assert all(required <= row.keys() for row in rows)
    assert [row["method"] for row in rows][-2:] == ["gemfilter", "specprefill"]
    assert {row["span"] for row in rows} == {"prompt"}


def test_cli_compare_table_methods_layer_and_out(cli, store_path, tmp_path):
    out = tmp_path / "results.parquet"
    result = cli("compare", store_path, "--layer", 2, "--methods", "window,claa,lava", "--out", out)
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())  # the title wraps where the store's path ends
    assert "l_p = 2" in text and "claa" in text and "gemfilter" not in text
    assert "span prompt" in text
    assert set(pl.read_parquet(out)["method"]) == {"window", "claa", "lava"}


def test_cli_variance(cli, store_path):
    result = cli(
        "variance", store_path, "--method", "asl:w=8", "--budget", "13", "--min-layer", 1, "--observed-layers", 2, "--json"
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [row["example"] for row in rows] == ["ex0", "ex1", "ex2"] and rows[0]["min_layer"] == 1
    assert list(rows[0]["selection_layer"]) == ["0.2", "0.3", "0.4", "0.5", "0.6"]  # ASL Sec. 5.5's taus
    # --thresholds, as variance_store's thresholds: the method's own tau always among them
    chosen = json.loads(
        cli("variance", store_path, "--method", "asl:w=8,tau=0.45", "--budget", "13", "--min-layer", 1,
            "--observed-layers", 2, "--thresholds", "0.25,0.5", "--json").stdout
    )  # fmt: skip
    assert list(chosen[0]["selection_layer"]) == ["0.25", "0.45", "0.5"]
    table = cli("variance", store_path, "--method", "asl:window_size=8", "--keep", "0.3")
    assert table.exit_code == 0, table.output
    assert "τ=0.3" in table.stdout
    # the mean curve per task and layer, each mean with its interval and n
    means = variance_store(store_path, method="asl:window_size=8", keep=0.3).means
    for row in means.iter_rows(named=True):
        shown = f"{row['relative_variance']:.2f} [{row['relative_variance_ci_low']:.2f}, {row['relative_variance_ci_high']:.2f}] {row['n_examples']}"
        assert re.search(rf"{row['task']}\s+{row['layer']}\s+{re.escape(shown)}", table.stdout), shown
    as_csv = cli(
        "variance", store_path, "--method", "asl:w=8", "--budget", "13", "--min-layer", 1, "--observed-layers", 2, "--format", "csv"
    )
    lines = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert [line["example"] for line in lines] == ["ex0", "ex1", "ex2"]
    for line, row in zip(lines, rows, strict=True):  # lists and mappings whole, as compact JSON
        assert json.loads(line["relative_variance"]) == row["relative_variance"]
        assert json.loads(line["selection_layer"]) == row["selection_layer"]
        assert line["min_layer"] == str(row["min_layer"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["compare", "--methods", "claa:aggregation_window=0"],
            "method 'claa': aggregation_window=0 is outside",
        ),
        (
            ["compare", "--methods", "claa:aggregation_window=abc"],
            "aggregation_window='abc' is not an integer",
        ),
        (
            ["select", "--method", "claa:deferred_layers=50", "--keep", "0.1"],
            "method 'claa': deferred_layers=50 is outside [0, 6]",
        ),
        # deduplicated silently, where bench refuses it
        (["compare", "--methods", "claa,fastkv,claa"],
         "claa is named twice (claa, claa): rows are labelled by method, so one setting's numbers would stand for both; name each once"),
        (["variance", "--method", "asl:tau=nan"], "method 'asl': tau=nan is not a number"),
        # thresholds are taus: a layer printed for tau NaN or -1 read as a result
        (["variance", "--thresholds", "0.3,nan"], "--thresholds nan is not a number; give taus asl takes"),
        (["variance", "--thresholds", "-1"], "--thresholds -1 is outside (0, inf) (τ, ASL Alg. 2); give taus"),
        (["variance", "--thresholds", "0"], "--thresholds 0 is outside (0, inf)"),
        (["variance", "--thresholds", "0.3,inf"], "--thresholds inf is outside (0, inf)"),
        (["variance", "--thresholds", "0.2,0.2"], "--thresholds names 0.2 twice; name each once"),
        # one name per option: --keep for a rate, --budget for tokens, as prefill, bench and sweep files
        (["variance", "--budget", "0.3"], "--budget '0.3' is not a token count; give e.g. --budget 2048, or --keep 0.1"),
        (["variance", "--keep", "0.1,0.2"], "variance draws one curve: give one keep rate (e.g. --keep 0.1)"),
        (["variance", "--keep", "0.1", "--budget", "13"], "give exactly one of --keep (e.g. 0.1) or --budget"),
    ],
)
def test_cli_refuses_a_method_parameter_out_of_range_in_one_line(cli, store_path, args, message):
    """The command's ``main`` prints a RankkitError as one line with exit status 2."""
    result = cli(args[0], store_path, *args[1:])
    assert isinstance(result.exception, RankkitError), result.output
    assert message in str(result.exception) and "\n" not in str(result.exception)


@pytest.mark.processes
def test_cli_compare_names_what_it_leaves_out_on_one_warning_line(tmp_path):
    path = write_store(tmp_path / "partial.zarr", draft=False)
    (path / "examples" / "ex9").mkdir()  # a capture killed before the example's metadata landed
    result = subprocess.run(
        # keep 0.2: 12 of the 60 tokens, more than any method always keeps (keep 0.1 warns of that)
        [sys.executable, "-m", "rankkit.cli", "compare", str(path), "--workers", "1", "--keep", "0.2", "--json"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert {row["n_examples"] for row in json.loads(result.stdout)} == {3}
    assert result.stderr == (
        f"rankkit: warning: left out 1 incomplete example(s) of {path}; `rankkit store verify {path}` lists them\n"
    )


@pytest.mark.processes
def test_cli_compare_stops_at_an_example_whose_metadata_was_cut_short(tmp_path):
    path = write_store(tmp_path / "damaged.zarr", draft=False)
    metadata = path / "examples" / "ex0" / "zarr.json"
    metadata.write_bytes(metadata.read_bytes()[:100])
    result = subprocess.run(
        [sys.executable, "-m", "rankkit.cli", "compare", str(path), "--workers", "1", "--json"],
        capture_output=True,
        text=True,
    )
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"rankkit: error: example 'ex0' in {path} is unreadable (its zarr.json does not parse); "
        f"rerun the capture into {path} to redo it\n"
    )


def test_variance_and_select_refuse_an_unreadable_example_as_compare_does(tmp_path):
    from rankkit.eval.offline import select_store

    path = write_store(tmp_path / "damaged.zarr", draft=False)
    (path / "examples" / "ex0" / "zarr.json").write_text("{ garbage")
    refused = "example 'ex0' in .* is unreadable \\(its zarr.json does not parse\\)"
    with pytest.raises(RankkitError, match=refused):
        variance_store(path, method="asl:window_size=8", budget=20, workers=1)
    with pytest.raises(RankkitError, match=refused):
        select_store(path, "claa:window_size=8", keep=0.2)


@pytest.mark.processes
def test_ctrl_c_stops_compare_with_workers_without_hanging_or_tracebacks(tmp_path):
    from rankkit.eval.cost import build_store

    path = tmp_path / "wide.zarr"
    build_store(path, examples=40, tokens=1024)
    # its own process group, as a terminal's: Ctrl-C reaches the command and its workers
    command = subprocess.Popen(
        [sys.executable, "-m", "rankkit.cli", "compare", str(path), "--workers", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    children = f"/proc/{command.pid}/task/{command.pid}/children"
    while command.poll() is None and len(open(children).read().split()) < 3:  # tracker + 2 workers
        time.sleep(0.1)
    time.sleep(0.5)
    os.killpg(command.pid, signal.SIGINT)
    _, stderr = command.communicate(timeout=60)
    assert command.returncode == 130, stderr
    assert f"rankkit: interrupted: nothing written, {path} unchanged\n" in stderr
    assert "Traceback" not in stderr and "leaked" not in stderr


@pytest.mark.processes
def test_a_damaged_example_met_by_a_worker_is_one_line_and_nothing_after_it(tmp_path):
    """The pool ends its workers early; Python's shutdown of them printed a leaked-semaphore warning."""
    path = write_store(tmp_path / "damaged.zarr", examples=12)
    damaged = path / "examples" / "ex9" / "capture.zip"
    damaged.write_bytes(damaged.read_bytes()[:1000])
    result = subprocess.run(
        [sys.executable, "-m", "rankkit.cli", "compare", str(path), "--workers", "2"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("rankkit: error: example 'ex9'") and result.stderr.count("\n") == 1, result.stderr


@pytest.mark.processes
def test_cli_compare_without_oracle_exits_2_with_the_fix(tmp_path):
    path = write_store(tmp_path / "no-oracle.zarr", oracle=False, draft=False, examples=1)
    result = subprocess.run(
        [sys.executable, "-m", "rankkit.cli", "compare", str(path), "--oracle"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr == (
        f"rankkit: error: store {path} has no oracle; run `rankkit oracle {path}` first (or pass --no-oracle)\n"
    )


def test_cli_compare_and_select_as_csv_are_the_json_rows_whole(cli, store_path):
    as_json = json.loads(cli("compare", store_path, "--methods", "window:w=8", "--format", "json").stdout)
    assert as_json == json.loads(cli("compare", store_path, "--methods", "window:w=8", "--json").stdout)
    table = cli("compare", store_path, "--methods", "window:w=8", "--format", "csv")
    assert table.exit_code == 0, table.output
    rows = list(csv.DictReader(io.StringIO(table.stdout)))
    assert list(rows[0]) == list(as_json[0])
    assert len(rows) == len(as_json)
    for line, row in zip(rows, as_json, strict=True):
        assert line == {key: "" if value is None else str(value) for key, value in row.items()}
    chosen = cli("select", store_path, "--method", "fastkv", "--keep", 0.2, "--layer", 2, "--format", "csv")
    lines = chosen.stdout.splitlines()
    assert lines[0] == "example_id,method,layer,budget_tokens,kept_tokens,selected_positions"
    selected = json.loads(cli("select", store_path, "--method", "fastkv", "--keep", 0.2, "--layer", 2, "--json").stdout)
    assert lines[1] == "ex0,fastkv,2,12,12,\"" + json.dumps(selected[0]["selected_positions"], separators=(",", ":")) + "\""
    both = cli("select", store_path, "--method", "fastkv", "--keep", 0.2, "--json", "--format", "csv")
    assert isinstance(both.exception, RankkitError) and "--json is --format json" in str(both.exception)


def test_cli_select_refuses_a_layer_contradicting_the_method_spec(cli, store_path):
    refused = cli("select", store_path, "--method", "fastkv:tsp_layer=1", "--keep", 0.2, "--layer", 2)
    assert isinstance(refused.exception, RankkitError)
    assert str(refused.exception) == "--layer 2 contradicts fastkv:tsp_layer=1; give one of them"
    agreeing = cli("select", store_path, "--method", "fastkv:tsp_layer=2", "--keep", 0.2, "--layer", 2, "--json")
    assert [row["layer"] for row in json.loads(agreeing.stdout)] == [2, 2, 2]


def test_cli_select_prints_each_examples_kept_positions(cli, store_path):
    result = cli("select", store_path, "--method", "fastkv", "--keep", 0.2, "--layer", 2, "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [row["example_id"] for row in rows] == ["ex0", "ex1", "ex2"]
    # window ranks like the oracle: the top 4 non-window tokens and the window of 8
    assert rows[0].keys() == {"example_id", "method", "layer", "budget_tokens", "kept_tokens", "selected_positions"}
    assert rows[0]["layer"] == 2 and rows[0]["budget_tokens"] == rows[0]["kept_tokens"] == 12
    from rankkit import stores

    truth = stores.open(store_path).example("ex0").oracle[:-8]
    top = sorted(np.argsort(-truth, kind="stable")[:4].tolist() + list(range(TOKENS - 8, TOKENS)))
    assert rows[0]["selected_positions"] == top
    per_head = json.loads(
        cli("select", store_path, "--method", "streamingllm", "--budget", 6, "--layer", 1, "--json").stdout
    )
    assert per_head[0]["selected_positions"] == [[0, 1, 2, 3, 58, 59]]
    missing = cli("select", store_path, "--method", "snapkv", "--keep", 0.1, "--layer", 1)
    assert isinstance(missing.exception, RankkitError)  # the CLI's entry point turns it into exit 2
    assert "rankkit capture --probes window:w=32" in str(missing.exception)


def test_a_probe_recorded_with_other_settings_is_refused(tmp_path):
    from rankkit import stores

    path = tmp_path / "old.zarr"
    recorded = {"window": {"probe": "window", "window_size": 8, "kernel_size": 5, "pooling": "avg"}}
    writer = stores.create(path, {"model": {"id": "synthetic"}, "probes": recorded})
    scores = np.random.default_rng(0).random((LAYERS, HEADS, TOKENS)).astype(np.float32)
    writer.write_example("ex0", attrs={}, tokens=np.arange(TOKENS), scores={"window": scores})
    with pytest.raises(RankkitError, match="kernel_size': 5.*rankkit capture --probes window"):
        compare_store(path, methods="claa", oracle=False)
    rows = compare_store(path, methods="window", oracle=False).summary  # the probe itself is fine
    assert rows["method"].to_list() == ["window"]


def test_unscored_tokens_rank_last_and_tied():
    """NaN (a key a local layer could not see) ranks below every score, as -inf would."""
    from rankkit.eval.ranking import average_ranks, descending_ranks, kendall

    scores = np.array([[0.3, np.nan, -2.0, np.nan, 5.0]])
    same = np.array([[0.3, -np.inf, -2.0, -np.inf, 5.0]])
    assert average_ranks(scores).tolist() == [[4.0, 1.5, 3.0, 1.5, 5.0]]
    assert descending_ranks(scores).tolist() == descending_ranks(same).tolist() == [[1, 3, 2, 4, 0]]
    reference = np.array([1.0, 0.0, 2.0, 3.0, 4.0])
    assert kendall(scores, reference)[0] == pytest.approx(stats.kendalltau(same[0], reference).statistic)


def test_evidence_kept_counts_the_selection_and_needle_recall_the_ranking(result):
    """At keep 0.1 of 60 tokens fastkv and claa keep only their 8-token window: the evidence (20-24),
    the ranking's top 6 tokens (needle_recall 1), is outside what they keep (evidence_kept 0);
    SpecPrefill keeps its draft's top 6, the evidence among them."""
    rows = result.per_layer.filter(pl.col("example_id") == "ex0")
    kept = {
        (row["method"], row["layer"]): row["evidence_kept"]
        for row in rows.to_dicts()
        if row["evidence_kept"] is not None
    }
    assert kept == {("claa", 3): 0.0, ("fastkv", 3): 0.0, ("gemfilter", 3): 0.0, ("specprefill", None): 1.0}
    fastkv = rows.filter((pl.col("method") == "fastkv") & (pl.col("layer") == 3)).row(0, named=True)
    assert fastkv["needle_recall"] == 1.0


def test_a_compare_frame_written_before_example_id_reads_with_it(result):
    from rankkit.eval.compare import with_example_id

    older = result.per_layer.rename({"example_id": "example"})
    assert with_example_id(older).equals(result.per_layer)
    assert with_example_id(result.per_layer).equals(result.per_layer)


@pytest.mark.parametrize("spec", ["oracle:mirror=gemfilter", "specprefill"])
def test_select_refuses_a_layer_for_a_method_that_keeps_one_set_it_selects_itself(tmp_path, spec):
    """--layer names the layer a per-head method reports; a shared selection made before any layer
    (or at one the method picks) would have ignored it."""
    from rankkit.eval.offline import select_store

    store_path = write_store(tmp_path / "run.zarr", oracle_attrs={"oracle_params": make("oracle").oracle_settings()})
    budget = Budget.from_keep(0.5)
    (row, *_) = select_store(store_path, spec, **budget.keywords)
    assert row["layer"] is None and len(row["selected_positions"]) == TOKENS // 2
    with pytest.raises(
        RankkitError,
        match=rf"^method '{spec}' keeps one set for every head, selected before any layer by its own rule: drop --layer$",
    ):
        select_store(store_path, spec, **budget.keywords, layer=1)
    (per_head, *_) = select_store(store_path, "lava", **budget.keywords, layer=1)
    assert per_head["layer"] == 1 and len(per_head["selected_positions"]) == HEADS


def test_stability_means_are_over_examples_with_their_intervals(result):
    """mean ρ and adjacent ρ were one number over the mean curve with no interval or n: each is now the
    mean over examples of the example's own mean over its layers, with the bootstrap interval of those."""
    from rankkit.eval.stats import bootstrap_means

    stability = {row["method"]: row for row in result.stability.to_dicts()}
    for method in ("lava", "window"):
        rows = result.per_layer.filter(pl.col("method") == method)
        per_example = []
        for example_id in rows["example_id"].unique(maintain_order=True):
            mine = rows.filter(pl.col("example_id") == example_id)
            per_example.append([mine["spearman"].mean(), mine["adjacent_spearman"].drop_nulls().mean()])
        means, low, high, counts = bootstrap_means(np.array(per_example, dtype=float))
        row = stability[method]
        assert row["n_examples"] == 3 == counts[0]
        assert row["mean_spearman"] == pytest.approx(means[0]) and row["layer_to_layer"] == pytest.approx(means[1])
        assert (row["mean_spearman_ci_low"], row["mean_spearman_ci_high"]) == pytest.approx((low[0], high[0]))
        assert (row["layer_to_layer_ci_low"], row["layer_to_layer_ci_high"]) == pytest.approx((low[1], high[1]))
    assert stability["lava"]["mean_spearman_ci_low"] < stability["lava"]["mean_spearman_ci_high"]


class GivenSelection:
    """A method whose offline selection is given, recording the ``Captured`` it was handed: what
    ``with_evidence_kept`` reads of a method (a registered one keeps one set [k] or refuses without
    a layer; one written elsewhere may keep a set per head, [kv_heads, k] or a list of them)."""

    def __init__(self, layer, positions):
        self.selection = None if positions is None else Selection(layer, positions)
        self.handed = []

    def captured_inputs(self):
        return ()

    def select_offline(self, captured, budget, *, layer=None):
        self.handed.append((captured, budget))
        if self.selection is None:
            raise RankkitError("keeps a set per layer and KV head: name the layer")
        return self.selection


class OneProbeRecord:
    probes = ("window",)
    num_tokens = 12

    def score_shape(self, probe):
        return (3, 1, self.num_tokens)


def test_evidence_kept_is_the_share_of_the_evidence_inside_the_ranked_tokens_the_selection_keeps():
    """Ranked tokens 2-9 of 12, evidence at 2-4 (ranked 0-2): a selection of positions 1, 2, 4 and 10
    keeps 2 and 4 of the ranked tokens (1 lies before them, 10 past them), 2 of the 3 evidence tokens,
    at its layer alone; a set per head, no set, no evidence or a layer not ranked leave every row NaN."""
    from rankkit.eval.compare import with_evidence_kept

    ranked, layers = slice(2, 10), [0, 1, 2]
    evidence = np.zeros(8, dtype=bool)
    evidence[:3] = True
    reference = Reference(None, evidence, 0.25)
    columns = {"spearman": np.arange(3.0), "evidence_kept": np.full(3, np.nan)}
    layout = {"layer_types": ["sliding_attention", "full_attention", "full_attention"], "sliding_window": 4}
    kept = with_evidence_kept(GivenSelection(1, torch.tensor([1, 2, 4, 10])), OneProbeRecord(), reference, ranked, layout, layers, columns)
    np.testing.assert_array_equal(kept["evidence_kept"], [np.nan, 2 / 3, np.nan])
    assert kept["spearman"] is columns["spearman"] and np.isnan(columns["evidence_kept"]).all()  # shared: not written into
    method = GivenSelection(0, torch.tensor([3]))
    assert with_evidence_kept(method, OneProbeRecord(), reference, ranked, layout, layers, columns)["evidence_kept"][0] == 1 / 3
    ((captured, budget),) = method.handed
    assert (captured.layer_types, captured.sliding_window, captured.num_tokens) == (layout["layer_types"], 4, 12)
    assert budget == Budget.parse(0.25)
    for unchanged in (
        GivenSelection(1, torch.tensor([[2, 3], [3, 4]])),  # a set per KV head
        GivenSelection(1, [torch.tensor([2, 3]), torch.tensor([4])]),  # heads keeping different counts
        GivenSelection(None, None),  # refuses without a layer
        GivenSelection(5, torch.tensor([2, 3])),  # at a layer the rows do not rank
    ):
        assert with_evidence_kept(unchanged, OneProbeRecord(), reference, ranked, layout, layers, columns) is columns
    none = Reference(None, np.zeros(8, dtype=bool), 0.25)
    assert with_evidence_kept(GivenSelection(1, torch.tensor([2])), OneProbeRecord(), none, ranked, layout, layers, columns) is columns


def test_a_methods_rankings_come_in_layer_order_cut_to_the_ranked_tokens_from_the_stores_layout():
    from rankkit.eval.compare import _rankings

    handed = []

    class GivenRankings(GivenSelection):
        def layer_rankings(self, captured, budget):
            handed.append((captured, budget))
            return {2: torch.arange(12.0) * 2, None: torch.arange(12.0), 0: -torch.arange(12.0)}

    layout = {"kv_heads": 1, "query_heads": 3}
    layers, rankings = _rankings(GivenRankings(None, None), OneProbeRecord(), Budget.from_keep(0.5), slice(2, 5), layout)
    assert layers == [None, 0, 2]  # before any layer first (a draft's), then the model's layers in order
    np.testing.assert_array_equal(rankings, [[2.0, 3.0, 4.0], [-2.0, -3.0, -4.0], [4.0, 6.0, 8.0]])
    ((captured, budget),) = handed
    assert (captured.kv_heads, captured.query_heads, budget) == (1, 3, Budget.from_keep(0.5))


def test_pairs_split_at_commas_and_at_the_one_colon_that_leaves_a_compared_label_on_each_side():
    from rankkit.eval.compare import parse_pairs

    labels = ["claa", "fastkv", "window:w=32", "a", "b:c", "a:b", "c"]
    assert parse_pairs(" claa:fastkv, ,window:w=32:claa,", labels) == [("claa", "fastkv"), ("window:w=32", "claa")]
    for spec, refusal in (
        ("a:b:c", "--pairs 'a:b:c' is not METHOD:BASELINE of two compared methods"),  # a | b:c, or a:b | c
        ("claa:h2o", "--pairs 'claa:h2o' is not METHOD:BASELINE of two compared methods"),
        (" , ", "--pairs names no pair"),
        ("claa:claa", "--pairs claa:claa pairs claa with itself"),
    ):
        with pytest.raises(RankkitError, match=f"^{re.escape(refusal)}"):
            parse_pairs(spec, labels)


def test_specprefill_is_offered_by_the_draft_the_store_holds_and_every_other_method_as_named():
    from rankkit.eval.compare import as_drafted

    methods = ["window", "specprefill", "claa"]
    drafted = {"draft": {"draft_model": "layers:3", "lookahead": 8}}
    assert as_drafted(methods, drafted, 6) == ["window", "specprefill:draft_model=layers:3,lookahead=8", "claa"]
    default = make("specprefill").draft_settings(6)
    for meta in ({}, {"draft": None}, {"draft": default}):  # no draft, or the one its defaults rank by
        assert as_drafted(methods, meta, 6) == methods


def test_results_at_two_keeps_are_written_as_one_frame_each_naming_its_paths_as_it_goes(result, tmp_path):
    """A keep where no method kept one set has evidence_kept all null (polars' Null type): its rows
    still join the other keep's. An existing file is refused unless overwritten."""
    import dataclasses

    from rankkit.eval.compare import output_paths, write_results

    per_layer = result.per_layer.with_columns(evidence_kept=None, keep=pl.lit(0.3))
    nowhere = dataclasses.replace(result, keep=0.3, per_layer=per_layer)
    out, written = tmp_path / "compare.parquet", []
    paths = write_results([result, nowhere], out, written=written)
    assert written == paths and [path.name for path in paths] == [path.name for path in output_paths(out)]
    both = pl.read_parquet(out)
    assert both.height == 2 * result.per_layer.height and sorted(set(both["keep"])) == [0.1, 0.3]
    assert both.filter(pl.col("keep") == 0.3)["evidence_kept"].null_count() == result.per_layer.height
    with pytest.raises(RankkitError, match="already exists"):
        write_results([result], out)
    assert write_results([result], out, overwrite=True) == paths


def test_the_ranked_tokens_are_the_prompt_but_its_window_or_the_context_span_inside_the_prompt():
    from rankkit.eval.compare import observation_window, ranked_slice

    window = observation_window()
    assert window == make("claa").window_size
    assert ranked_slice(None, "prompt", window + 12) == slice(0, 12)
    assert ranked_slice({"context_tokens": [2, 5]}, "prompt", window + 12) == slice(0, 12)  # the prompt's, whatever spans say
    assert ranked_slice(None, "prompt", window) == slice(0, 1)  # a prompt no longer than the window: its first token
    assert ranked_slice({"context_tokens": [2, 10]}, "context", 12) == slice(2, 10)
    assert ranked_slice({"context_tokens": [0, 12]}, "context", 12) == slice(0, 12)  # the whole prompt
    for spans in (None, {}, {"evidence_tokens": [[3, 4]]}):  # no context recorded: the prompt's tokens
        assert ranked_slice(spans, "context", window + 12) == slice(0, 12)
    for start, end in ((5, 5), (6, 4), (-1, 4), (3, 13)):
        with pytest.raises(RankkitError, match=rf"^span context_tokens = \[{start}, {end}\) is empty or outside the 12 tokens"):
            ranked_slice({"context_tokens": [start, end]}, "context", 12)
    with pytest.raises(RankkitError, match="^span 'needle' is not one of prompt, context; use --span prompt or context$"):
        ranked_slice(None, "needle", 12)


def test_examples_sharing_a_cluster_are_named_by_it_and_the_others_by_themselves():
    from rankkit.eval.compare import with_clusters

    class Record:
        def __init__(self, id, cluster=None, meta=True):
            self.id = id
            self.attrs = {"meta": {"cluster": cluster} if cluster else {}} if meta else {}

    rows = pl.DataFrame({"example_id": ["a", "b", "c", "a"], "spearman": [0.1, 0.2, 0.3, 0.4]})
    records = [Record("a", "haystack-1"), Record("b", "haystack-1"), Record("c", meta=False)]
    clustered = with_clusters(rows, records)
    assert clustered["cluster"].to_list() == ["haystack-1", "haystack-1", "c", "haystack-1"]
    assert clustered.drop("cluster").equals(rows)
    assert with_clusters(rows, [Record("a"), Record("b"), Record("c", meta=False)]) is rows  # none named: as is
    assert with_clusters(rows.clear(), records) is not None and "cluster" not in with_clusters(rows.clear(), records).columns
    renamed = rows.rename({"example_id": "example"})
    assert with_clusters(renamed, records, example="example")["cluster"].to_list() == clustered["cluster"].to_list()


def test_the_terminal_summary_is_method_layer_the_table_metrics_with_intervals_and_counts(result):
    from rankkit.eval.compare import summary_table

    shown = [
        *("method", "layer"),
        *(f"{metric}{suffix}" for metric in ("spearman", "recall_at_10", "needle_recall") for suffix in ("", "_ci_low", "_ci_high", "_n")),
    ]
    summary = result.summary
    assert summary_table(summary).columns == [*shown, "n_examples"]
    assert summary_table(summary).equals(summary.select(*shown, "n_examples"))
    clustered = summary.with_columns(n_clusters=pl.lit(2))
    assert summary_table(clustered).columns == [*shown, "n_examples", "n_clusters"]
    assert summary_table(summary.clear()).equals(summary.clear())  # nothing compared: every column, no rows


def test_outputs_are_claimed_outside_the_compared_store_open_or_named_and_never_over_a_file_by_default(result, tmp_path):
    from rankkit import stores
    from rankkit.eval.compare import claim_outputs, compared_labels

    inside = result.store / "compare.parquet"
    for store in (result.store, stores.open(result.store)):
        refusal = f"--out {inside} is one of this command's inputs ({result.store}); choose another path"
        with pytest.raises(RankkitError, match=f"^{re.escape(refusal)}$"):
            claim_outputs([inside], store)
    existing = tmp_path / "compare.parquet"
    existing.write_bytes(b"someone's")
    with pytest.raises(RankkitError, match="already exists"):
        claim_outputs([existing], result.store)
    with pytest.raises(RankkitError, match=r"^--methods names nothing; give e\.g\. --methods window,claa,fastkv$"):
        compared_labels([])
    assert compared_labels("window,claa") == compared_labels(["window", "claa"]) == ["window", "claa"]


def per_layer_rows(values: dict) -> pl.DataFrame:
    """A per-layer frame from {(method, example): [spearman per layer]}, layers from 0."""
    return pl.DataFrame([
        {"method": method, "example_id": example, "layer": layer, "spearman": float(value)}
        for (method, example), spearmans in values.items()
        for layer, value in enumerate(spearmans)
    ])


def test_stability_by_hand_the_mean_of_each_examples_layer_mean_and_the_curves_spread_and_first_trough():
    """CLAA Sec. 4.1's stability: per method (in first-seen order) the example means of each example's
    mean over layers, and of the example-mean curve its population deviation, least value and the
    first layer reaching it."""
    from rankkit.eval.compare import STABILITY_MEANS, stability_frame
    from rankkit.eval.stats import mean_intervals

    by_layer = {
        ("b", "e1"): [0.5, 0.1, 0.3, 0.6],  # curve 0.4, 0.2, 0.2, 0.5: the trough's first layer is 1
        ("b", "e2"): [0.3, 0.3, 0.1, 0.4],
        ("a", "e1"): [0.9, 0.8, 0.7, 0.6],  # curve 0.8, 0.7, 0.6, 0.7
        ("a", "e2"): [0.7, 0.6, 0.5, 0.8],
    }
    adjacent = {
        ("b", "e1"): [None, 0.2, 0.4, 0.9],  # mean 0.5 over the layers that have one
        ("b", "e2"): [None, 0.0, 0.6, 0.3],
        ("a", "e1"): [None, 1.0, 1.0, 1.0],
        ("a", "e2"): [None, 0.5, 0.5, 0.5],
    }
    per_layer = per_layer_rows(by_layer).with_columns(
        adjacent_spearman=pl.Series([value for values in adjacent.values() for value in values], dtype=pl.Float64)
    )
    # two more methods, so that an order not kept shows: b, a, d, c
    per_layer = pl.concat([
        per_layer,
        per_layer.filter(pl.col("method") == "b").with_columns(method=pl.lit("d")),
        per_layer.filter(pl.col("method") == "a").with_columns(method=pl.lit("c")),
    ])
    found = stability_frame(per_layer).filter(pl.col("method").is_in(["b", "a"]))
    assert stability_frame(per_layer)["method"].to_list() == ["b", "a", "d", "c"]
    assert stability_frame(per_layer).drop("method").equals(pl.concat([found, found]).drop("method"))
    assert found.columns == [
        "method", "mean_spearman", "mean_spearman_ci_low", "mean_spearman_ci_high", "mean_spearman_n",
        "std_spearman", "min_spearman", "trough_layer",
        "layer_to_layer", "layer_to_layer_ci_low", "layer_to_layer_ci_high", "layer_to_layer_n", "n_examples",
    ]
    assert found["method"].to_list() == ["b", "a"]
    assert np.allclose(found["mean_spearman"], [0.325, 0.7])
    assert np.allclose(found["layer_to_layer"], [0.4, 0.75])
    assert np.allclose(found["std_spearman"], [np.std([0.4, 0.2, 0.2, 0.5]), np.std([0.8, 0.7, 0.6, 0.7])])
    assert np.allclose(found["min_spearman"], [0.2, 0.6])
    assert found["trough_layer"].to_list() == [1, 2]
    assert found["n_examples"].to_list() == [2, 2]
    per_example = pl.DataFrame({
        "method": ["b", "b", "a", "a"],
        "example_id": ["e1", "e2", "e1", "e2"],
        "mean_spearman": [0.375, 0.275, 0.75, 0.65],
        "layer_to_layer": [0.5, 0.3, 1.0, 0.5],
    })
    intervals = [column for name in STABILITY_MEANS for column in (f"{name}_ci_low", f"{name}_ci_high", f"{name}_n")]
    expected = mean_intervals(per_example, ["method"], STABILITY_MEANS)
    assert np.allclose(found.select(intervals).to_numpy(), expected.select(intervals).to_numpy())

    one_haystack = per_layer.with_columns(cluster=pl.lit("haystack"))
    clustered = stability_frame(one_haystack).filter(pl.col("method").is_in(["b", "a"]))
    assert clustered.columns[-2:] == ["n_examples", "n_clusters"]
    assert clustered["n_clusters"].to_list() == [1, 1]
    assert clustered["mean_spearman_ci_low"].is_null().all()  # one independent sample has no interval
    assert np.allclose(clustered["mean_spearman"], [0.325, 0.7])


def test_pairs_by_hand_the_paired_difference_per_shared_layer_in_layer_order_with_layerless_rows_last():
    from rankkit.eval.compare import pairs_frame
    from rankkit.eval.stats import paired_difference

    first = {("m", "e1"): [0.9, 0.5, 0.1], ("m", "e2"): [0.8, 0.6, 0.2], ("m", "e3"): [0.7, 0.2, 0.3]}
    second = {("base", "e1"): [0.5, 0.5], ("base", "e2"): [0.6, 0.7], ("base", "e3"): [0.1, 0.4]}  # no layer 2
    per_layer = pl.concat([per_layer_rows(first), per_layer_rows(second)])
    layerless = pl.DataFrame({
        "method": ["x", "x", "y", "y"],
        "example_id": ["e1", "e2", "e1", "e2"],
        "layer": pl.Series([None] * 4, dtype=pl.Int64),
        "spearman": [0.4, 0.3, 0.1, 0.2],
    })
    per_layer = pl.concat([per_layer.reverse(), layerless])  # rows in no order
    found = pairs_frame(per_layer, [("m", "base"), ("x", "y")])
    assert found.columns == [
        "method", "baseline", "layer", "difference", "difference_ci_low", "difference_ci_high",
        "p_value", "n_examples", "n_clusters",
    ]
    assert found.select("method", "baseline", "layer").rows() == [("m", "base", 0), ("m", "base", 1), ("x", "y", None)]
    assert np.allclose(found["difference"], [(0.4 + 0.2 + 0.6) / 3, (0.0 - 0.1 - 0.2) / 3, (0.3 + 0.1) / 2])
    for row, (a, b) in zip(
        found.iter_rows(named=True),
        [([0.7, 0.8, 0.9], [0.1, 0.6, 0.5]), ([0.2, 0.6, 0.5], [0.4, 0.7, 0.5]), ([0.3, 0.4], [0.2, 0.1])],
        strict=True,
    ):
        expected = paired_difference(np.array(a), np.array(b))  # examples in the frame's order: e3, e2, e1
        assert {name: row[name] for name in expected} == pytest.approx(expected)

    needle = per_layer.with_columns(needle_recall=pl.col("spearman") * 2)
    assert np.allclose(pairs_frame(needle, [("m", "base")], "needle_recall")["difference"], found["difference"][:2] * 2)
    clustered = pairs_frame(per_layer.with_columns(cluster=pl.lit("one")), [("m", "base")])
    assert clustered["n_clusters"].to_list() == [1, 1]
    assert clustered["n_examples"].to_list() == [3, 3]
    assert pairs_frame(per_layer, []).columns == found.columns

    # many layers and a layer-less example in one pair: layers in order, the layer-less row last
    rng = np.random.default_rng(0)
    layered = {(method, f"e{index}"): rng.random(8) for method in ("m", "base") for index in range(3)}
    layerless = {"m": 0.9, "base": 0.4}
    rows = pl.concat([
        per_layer_rows(layered),
        pl.DataFrame({"method": list(layerless), "example_id": "e3", "layer": None, "spearman": list(layerless.values())}),
    ], how="vertical_relaxed")
    found = pairs_frame(rows.sample(fraction=1.0, shuffle=True, seed=3), [("m", "base")])
    assert found["layer"].to_list() == [*range(8), None]
    difference = np.mean([layered["m", example] - layered["base", example] for example in ("e0", "e1", "e2")], axis=0)
    assert np.allclose(found["difference"], [*difference, 0.9 - 0.4])
    assert found["n_examples"].to_list() == [3] * 8 + [1]


def test_pairs_at_a_layer_count_the_layers_significantly_higher_and_lower_below_the_level():
    from rankkit.eval.compare import pairs_at_layer

    pairs = pl.DataFrame({
        "method": ["m"] * 5 + ["k"] * 2,
        "baseline": ["b"] * 5 + ["b"] * 2,
        "layer": [0, 1, 2, 3, 4, 0, 1],
        "difference": [0.1, 0.5, -0.2, 0.3, 0.0, -0.4, 0.2],
        # 0.05 is not below the level; a significant difference of 0 is neither higher nor lower
        "p_value": [0.01, 0.2, 0.03, 0.05, 0.01, 0.001, None],
        "n_examples": [5] * 7,
    })
    found = pairs_at_layer(pairs, 1)
    assert found.columns == ["method", "baseline", "difference", "p_value", "n_examples", "higher_layers", "lower_layers"]
    assert found.rows() == [("m", "b", 0.5, 0.2, 5, "1/5", "1/5"), ("k", "b", 0.2, None, 5, "0/2", "1/2")]
    missing = pairs_at_layer(pairs, 3)  # a pair without the layer keeps its counts, its difference null
    assert missing.rows() == [("m", "b", 0.3, 0.05, 5, "1/5", "1/5"), ("k", "b", None, None, None, "0/2", "1/2")]
    assert pairs_at_layer(pairs.clear(), 1).equals(pairs.clear())


def test_rows_gather_each_examples_rows_under_its_id_and_task_typed_as_documented():
    from rankkit.eval.compare import _Rows

    first, second, empty, total = _Rows(), _Rows(), _Rows(), _Rows()
    first.add("a", layer=range(2), spearman=np.array([0.5, np.nan]))
    first.add("b", layer=[0], spearman=np.array([0.25]))
    second.add("a", layer=[1], spearman=np.array([1.0]))
    total.extend(first, "e1", "niah")
    total.extend(empty, "nothing", "niah")  # an example without rows adds none
    total.extend(second, "e2", None)
    found = total.frame()
    assert found.columns == ["example_id", "task", "method", "layer", "spearman"]
    assert found.dtypes == [pl.Categorical(), pl.String, pl.String, pl.Int32, pl.Float64]
    assert found.rows() == [
        ("e1", "niah", "a", 0, 0.5), ("e1", "niah", "a", 1, None), ("e1", "niah", "b", 0, 0.25), ("e2", None, "a", 1, 1.0),
    ]
    untasked = _Rows()
    untasked.extend(second, "e2", None)
    assert untasked.frame()["task"].dtype == pl.String  # a task column even where no example names one
    assert first.frame().columns == ["method", "layer", "spearman"]  # one example's rows: no example columns
    assert first.frame()["method"].to_list() == ["a", "a", "b"]
    assert empty.frame().equals(pl.DataFrame())


def test_claa_is_paired_by_default_with_each_single_layer_heuristic_compared_and_nothing_without_it():
    from rankkit.eval.compare import default_pairs

    assert default_pairs(["window", "fastkv", "claa", "snapkv", "gemfilter", "asl"]) == [("claa", "fastkv"), ("claa", "gemfilter")]
    assert default_pairs(["gemfilter", "claa"]) == [("claa", "gemfilter")]  # in the order compared
    assert default_pairs(["fastkv", "gemfilter"]) == []
    assert default_pairs(["claa"]) == []


def test_pairs_without_the_oracle_are_refused_and_no_pairs_need_none():
    from rankkit.eval.compare import refuse_pairs_without_oracle

    refusal = (
        "--pairs tests differences of Spearman with the oracle, which --no-oracle leaves out; "
        "drop --pairs or compare with the oracle"
    )
    for pairs in ("claa:fastkv", [("claa", "fastkv")]):
        with pytest.raises(RankkitError, match=f"^{re.escape(refusal)}$"):
            refuse_pairs_without_oracle(pairs, oracle=False)
        refuse_pairs_without_oracle(pairs, oracle=True)
    for nothing in (None, "", []):
        refuse_pairs_without_oracle(nothing, oracle=False)


class _Example:
    def __init__(self, id, oracle_params, layers=4, probes=("window", "last_token")):
        self.id, self.attrs, self.probes, self.layers = id, {"oracle_params": oracle_params}, list(probes), layers

    def score_shape(self, probe):
        return (self.layers, 3, 50) if probe == "window" else (0,)


def test_examples_whose_oracles_were_made_alike_pass_and_a_mix_is_refused_naming_both():
    from rankkit.eval.compare import refuse_mixed_oracles, scored_layers

    made = {"answer": "gold", "softmax": "full"}
    refuse_mixed_oracles([_Example("a", made), _Example("b", dict(made)), _Example("c", made)], "s.zarr")
    refuse_mixed_oracles([_Example("a", None), _Example("b", None)], "s.zarr")  # no oracles: nothing to mix
    other = {"answer": "gold", "softmax": "top"}
    refusal = (
        f"store s.zarr holds oracles made with other settings: example 'a' {made}, example 'c' {other}; "
        "remake them alike with `rankkit oracle s.zarr --redo`"
    )
    with pytest.raises(RankkitError, match=f"^{re.escape(refusal)}$"):
        refuse_mixed_oracles([_Example("a", made), _Example("b", made), _Example("c", other)], "s.zarr")
    with pytest.raises(RankkitError, match="example 'a' None, example 'b'"):
        refuse_mixed_oracles([_Example("a", None), _Example("b", made)], "s.zarr")
    second = _Example("b", made, layers=9, probes=("last_token", "window"))
    assert scored_layers([_Example("a", made, layers=7), second]) == 7  # the first's first probe
    assert scored_layers([_Example("a", made, layers=7)]) == 7


def test_a_frame_with_keeps_carries_the_keep_and_needle_keep_of_its_rows():
    from rankkit.eval.compare import with_keeps

    frame = pl.DataFrame({"method": ["a", "b"]})
    assert with_keeps(frame, 0.1, 16).rows() == [("a", 0.1, 16), ("b", 0.1, 16)]
    assert with_keeps(frame, 0.1, 16).columns == ["method", "keep", "needle_keep"]


def assert_rows_rank_as(rows: pl.DataFrame, rankings: dict, ranked: slice, oracle: np.ndarray, with_kendall: bool = False):
    """One method's rows hold, layer by layer in order, scipy's Spearman (and Kendall) of its
    ``rankings`` cut to the ``ranked`` tokens against ``oracle``."""
    layers = sorted(rankings)
    assert rows["layer"].to_list() == layers
    made = [rankings[layer].numpy()[ranked] for layer in layers]
    assert np.allclose(rows["spearman"], [stats.spearmanr(ranking, oracle).statistic for ranking in made])
    if with_kendall:
        assert np.allclose(rows["kendall"], [stats.kendalltau(ranking, oracle).statistic for ranking in made])


def test_one_examples_rows_by_hand_each_probe_per_layer_and_head_and_claa_with_its_sweep(store_path):
    """``evaluate_example`` against scipy on the ranked tokens: a probe's per-layer rows rank its head
    sum (CLAA Eq. 1, 2 and 5 sum over heads), its per-head rows each (layer, head) in that order, a
    method's rows its ``layer_rankings``, and CLAA's sweep each n of CLAA_SWEEP within the depth."""
    from rankkit import stores
    from rankkit.eval.compare import evaluate_example
    from rankkit.eval.offline import captured

    record = stores.open(store_path).example("ex2")
    ranked = slice(3, 45)
    oracle = record.oracle[ranked]
    evidence = spans_mask([(20 - 3, 24 - 3)], 42)
    budget = Budget.from_keep(0.1)
    methods = {"claa": make("claa"), "fastkv": make("fastkv")}

    def rho(ranking):
        return stats.spearmanr(ranking, oracle).statistic

    per_layer, per_head, sweep = (
        rows.frame() for rows in evaluate_example(record, Reference(oracle, evidence, 0.1), ["lava", "window"], methods, budget, ranked)
    )
    lava = record.scores("lava")[..., ranked]
    rows = per_layer.filter(pl.col("method") == "lava")
    assert rows["layer"].to_list() == list(range(LAYERS))
    assert np.allclose(rows["spearman"], [rho(lava[layer].sum(0)) for layer in range(LAYERS)])
    assert np.allclose(rows["kendall"], [stats.kendalltau(lava[layer].sum(0), oracle).statistic for layer in range(LAYERS)])
    heads = per_head.filter(pl.col("method") == "lava")
    assert heads.select("layer", "head").rows() == [(layer, head) for layer in range(LAYERS) for head in range(HEADS)]
    assert np.allclose(heads["spearman"], [rho(lava[layer, head]) for layer in range(LAYERS) for head in range(HEADS)])
    assert per_head["method"].to_list() == ["lava"] * (LAYERS * HEADS) + ["window"] * (LAYERS * HEADS)

    for label, method in methods.items():
        rankings = method.layer_rankings(captured(record, method), budget)
        assert_rows_rank_as(per_layer.filter(pl.col("method") == label), rankings, ranked, oracle)
    assert sweep["method"].unique(maintain_order=True).to_list() == [f"claa-n{n}" for n in CLAA_SWEEP if n <= LAYERS]
    for n in (n for n in CLAA_SWEEP if n <= LAYERS):
        claa = make("claa", aggregation_window=n)
        rankings = claa.layer_rankings(captured(record, claa), budget)
        rows = sweep.filter(pl.col("method") == f"claa-n{n}")
        assert rows["claa_layers"].to_list() == [n] * len(rankings)
        assert_rows_rank_as(rows, rankings, ranked, oracle)
    assert "kendall" not in sweep.columns and "evidence_kept" not in sweep.columns

    light = [rows.frame() for rows in evaluate_example(record, Reference(oracle, evidence, 0.1), ["lava"], methods, budget, ranked, detailed=False)]
    assert light[0]["kendall"].null_count() == light[0].height
    assert light[0].drop("kendall").equals(per_layer.filter(pl.col("method") != "window").drop("kendall"))
    assert light[1].is_empty() and light[2].is_empty()


def test_an_example_is_compared_on_its_span_with_its_evidence_moved_into_it_and_its_oracle_or_none(store_path):
    """``compare_example``, the unit a worker runs: the span's tokens ranked, the evidence spans
    counted from the span's start, the oracle over the span (or none: reference-free metrics only)."""
    from rankkit import stores
    from rankkit.eval.compare import compare_example, evaluate_example, observation_window

    record = stores.open(store_path).example("ex1")
    budget = Budget.from_keep(0.1)
    methods = {"claa": make("claa")}
    context = slice(*CONTEXT)
    example_id, task, found = compare_example(
        record, probes=("lava",), methods=methods, budget=budget, span="context", needle_keep=8
    )
    assert (example_id, task) == ("ex1", "niah")
    shifted = spans_mask([(EVIDENCE[0][0] - CONTEXT[0], EVIDENCE[0][1] - CONTEXT[0])], CONTEXT[1] - CONTEXT[0])
    reference = Reference(record.oracle[context], shifted, 8)
    expected = evaluate_example(record, reference, ("lava",), methods, budget, context)
    for got, made in zip(found, expected, strict=True):
        assert got.frame().equals(made.frame())

    _, _, free = compare_example(
        record, probes=("lava",), methods=methods, budget=budget, span="prompt", oracle=False, needle_keep=0.1
    )
    rows = free[0].frame()
    assert rows["spearman"].null_count() == rows.height  # no reference: the oracle's metrics are null
    prompt = slice(0, TOKENS - observation_window())
    assert rows.filter(pl.col("method") == "lava")["adjacent_spearman"].to_list()[1:] == pytest.approx(
        [stats.spearmanr(*record.scores("lava")[[layer - 1, layer]][..., prompt].sum(1)).statistic for layer in range(1, LAYERS)]
    )
    assert free[1].frame().is_empty()  # per head: Spearman with the oracle only


HYBRID_LAYERS = 8  # one of CLAA_SWEEP


def write_hybrid_store(path):
    """A store of a model with local layers (Gemma-like, 16-token window), scores random per layer and
    head: ex0 names its evidence, ex1 no spans. Returns the open store, its model entry and the scores."""
    from rankkit import stores

    local, full = "sliding_attention", "full_attention"
    model = {"id": "synthetic", "layer_types": [local, local, full, local, local, full, local, full], "sliding_window": 16}
    rng = np.random.default_rng(7)
    writer = stores.create(path, {"model": model, "kv_heads": HEADS, "num_attention_heads": HEADS})
    scores = {key: rng.random((HYBRID_LAYERS, HEADS, TOKENS)).astype(np.float32) for key in ("window", "last_token_heads", "lava")}
    truth = rng.random(TOKENS).astype(np.float32)
    for example, attrs in (("ex0", {"spans": {"evidence_tokens": [[30, 34]]}}), ("ex1", {})):
        writer.write_example(example, attrs={"task": "niah", **attrs}, tokens=np.arange(TOKENS), scores=scores)
        writer.add_oracle(example, oracle=truth, oracle_layers=np.tile(truth, (HYBRID_LAYERS, 1)), attrs={})
    return stores.open(path), model, scores


def test_compare_summarises_a_model_with_local_layers_at_claas_global_layer(tmp_path):
    """CLAA's l_p (round(15 L / 32) = 4 of 8) is a local layer here: the default summary layer is the
    global one CLAA prunes at on this layout (5), for probes and methods alike."""
    from rankkit.eval.compare import compare_example
    from rankkit.eval.offline import recorded_model

    store, _, _ = write_hybrid_store(tmp_path / "hybrid.zarr")
    lava = "lava:kernel_size=7"  # the method, not the store's probe of that name
    with pytest.warns(UserWarning, match="fewer than lava always keeps; it keeps 32"):
        compared = compare_store(store.path, methods=["window", "claa", lava], keep=0.2, workers=1)
    assert compared.pruning_layer == 5
    assert compared.summary.select("method", "layer").rows() == [("window", 5), ("claa", 5), (lava, 5)]
    # each example ranked on the store's layout: LAVa leaves out the keys a local layer cannot see
    layout = recorded_model(store.meta)
    for example in ("ex0", "ex1"):
        _, _, (rows, _, _) = compare_example(
            store.example(example), probes=(), methods={lava: make("lava")}, budget=Budget.from_keep(0.2), needle_keep=0.2, layout=layout
        )
        got = compared.per_layer.filter((pl.col("example_id") == example) & (pl.col("method") == lava))
        assert got["spearman"].to_list() == rows.frame()["spearman"].to_list()


def test_one_examples_rows_follow_the_models_local_layers_and_the_sweep_reaches_the_models_depth(tmp_path):
    """On scores that differ by layer, of a model with local layers whose depth is one of CLAA_SWEEP:
    each method ranks as its offline face does given the store's layout (``recorded_model``: the local
    layers, the KV heads), with Kendall; CLAA's evidence kept is counted at its selection layer on that
    layout, and its sweep runs every n up to the depth, each n its own ranking."""
    from rankkit.eval.compare import compare_example, evaluate_example
    from rankkit.eval.offline import recorded_model

    layers, local = HYBRID_LAYERS, "sliding_attention"
    store, model, scores = write_hybrid_store(tmp_path / "hybrid.zarr")
    record, layout = store.example("ex0"), recorded_model(store.meta)
    assert layout == {"layer_types": model["layer_types"], "sliding_window": 16, "kv_heads": HEADS, "query_heads": HEADS}
    ranked = slice(0, TOKENS - 8)
    oracle, budget = record.oracle[ranked], Budget.from_keep(0.2)
    methods = {"claa": make("claa"), "fastkv": make("fastkv"), "tova": make("tova"), "lava": make("lava")}
    evidence = spans_mask([(30, 34)], TOKENS - 8)
    reference = Reference(oracle, evidence, 0.2)
    per_layer, _, sweep = (rows.frame() for rows in evaluate_example(record, reference, [], methods, budget, ranked, layout))

    arrays = {key: torch.from_numpy(values) for key, values in scores.items()}
    captured, unaware = Captured(arrays, layers, TOKENS, **layout), Captured(arrays, layers, TOKENS)
    lava, blind = (make("lava").layer_rankings(made, budget) for made in (captured, unaware))
    for layer in range(layers):  # LAVa leaves out the keys a local layer cannot see (``Captured.hide_unseen``)
        differs = stats.spearmanr(lava[layer], blind[layer], nan_policy="omit").statistic < 1
        assert differs == (model["layer_types"][layer] == local), layer
    for label, method in methods.items():
        rows = per_layer.filter(pl.col("method") == label)
        assert_rows_rank_as(rows, method.layer_rankings(captured, budget), ranked, oracle, with_kendall=True)
    # the evidence CLAA's selection keeps, at its layer on the layout: a global one (5), not l_p = 4
    selection = make("claa").select_offline(captured, Budget.from_keep(0.2))
    assert selection.layer == 5 and make("claa").select_offline(unaware, Budget.from_keep(0.2)).layer == 4
    kept = np.isin(np.arange(30, 34), selection.positions.numpy()).mean()
    claa = per_layer.filter(pl.col("method") == "claa")
    assert claa["evidence_kept"].to_list() == [None] * 5 + [kept] + [None] * 2
    assert sweep["method"].unique(maintain_order=True).to_list() == [f"claa-n{n}" for n in CLAA_SWEEP]  # 8 included
    spearmans = set()
    for n in CLAA_SWEEP:
        rows = sweep.filter(pl.col("method") == f"claa-n{n}")
        assert_rows_rank_as(rows, make("claa", aggregation_window=n).layer_rankings(captured, budget), ranked, oracle)
        spearmans.add(tuple(rows["spearman"].round(6)))
    assert len(spearmans) == len(CLAA_SWEEP)  # each n ranks apart

    # compare's unit on these examples: by default the prompt span, the evidence its spans name, the layout
    _, _, found = compare_example(record, probes=(), methods=methods, budget=budget, needle_keep=0.2, layout=layout)
    for got, made in zip(found, (per_layer, pl.DataFrame(), sweep), strict=True):  # no probes: no per-head rows
        assert got.frame().equals(made)
    unspanned = store.example("ex1")
    _, _, found = compare_example(unspanned, probes=(), methods=methods, budget=budget, needle_keep=0.2, layout=layout)
    nothing_to_find = Reference(oracle, np.zeros(TOKENS - 8, dtype=bool), 0.2)
    for got, made in zip(found, evaluate_example(unspanned, nothing_to_find, (), methods, budget, ranked, layout), strict=True):
        assert got.frame().equals(made.frame())
    _, _, light = compare_example(record, probes=(), methods=methods, budget=budget, needle_keep=0.2, layout=layout, detailed=False)
    assert light[0].frame()["kendall"].null_count() == light[0].frame().height and light[2].frame().is_empty()


def test_a_references_metric_columns_by_hand_with_the_oracle_and_without():
    """Each column of ``Reference.metrics`` row by row against the metrics one at a time (scipy,
    ``topk_recall``, ``needle_recall``); without an oracle its columns are NaN, float like the rest."""
    rng = np.random.default_rng(11)
    scores, oracle = rng.random((3, 40)), rng.random(40)
    evidence = spans_mask([(5, 8)], 40)
    columns = Reference(oracle, evidence, 6).metrics(scores)
    assert list(columns) == [
        "spearman", "kendall", "recall_at_10", "recall_at_20", "recall_at_40", "needle_recall", "evidence_kept", "adjacent_spearman",
    ]
    assert all(values.dtype == np.float64 and values.shape == (3,) for values in columns.values())
    assert np.allclose(columns["spearman"], [stats.spearmanr(row, oracle).statistic for row in scores])
    assert np.allclose(columns["kendall"], [stats.kendalltau(row, oracle).statistic for row in scores])
    for name, rate in (("recall_at_10", 0.1), ("recall_at_20", 0.2), ("recall_at_40", 0.4)):
        assert np.allclose(columns[name], [topk_recall(row, oracle, rate) for row in scores]), name
    assert np.allclose(columns["needle_recall"], [needle_recall(row, evidence, 6) for row in scores])
    assert len(set(columns["needle_recall"])) > 1  # the rows find different shares of the evidence
    assert np.isnan(columns["evidence_kept"]).all()
    assert np.isnan(columns["adjacent_spearman"][0])
    assert np.allclose(columns["adjacent_spearman"][1:], [stats.spearmanr(scores[i - 1], scores[i]).statistic for i in (1, 2)])

    free = Reference(None, evidence, 6).metrics(scores)
    assert all(values.dtype == np.float64 for values in free.values())
    for name in ("spearman", "kendall", "recall_at_10", "recall_at_20", "recall_at_40", "evidence_kept"):
        assert np.isnan(free[name]).all(), name
    assert np.array_equal(free["needle_recall"], columns["needle_recall"])
    assert np.array_equal(free["adjacent_spearman"], columns["adjacent_spearman"], equal_nan=True)


def test_compare_at_several_keeps_is_one_comparison_per_keep_with_the_same_options_each_frame_naming_its_keep(store_path, tmp_path):
    from rankkit import defaults
    from rankkit.eval.compare import compare_keeps, output_paths

    results = compare_keeps(store_path, keep="0.2,0.5", methods=["window", "claa"], pairs="claa:window", workers=1)
    assert [result.keep for result in results] == [0.2, 0.5] and [result.needle_keep for result in results] == [0.2, 0.5]
    assert [result.tested_pairs for result in results] == [[("claa", "window")]] * 2
    for result, keep in zip(results, (0.2, 0.5), strict=True):
        assert result.per_layer["method"].unique(maintain_order=True).to_list() == ["window", "claa"]
        frames = (result.per_layer, result.per_head, result.sweep, result.curve, result.stability, result.summary, result.pairs)
        for frame in frames:
            assert frame.height and frame["keep"].to_list() == [keep] * frame.height
            assert frame["needle_keep"].to_list() == [keep] * frame.height
        for frame in (result.per_layer, result.per_head, result.sweep):  # each example's rows name its task
            assert frame["task"].to_list() == ["niah"] * frame.height
        assert result.per_layer.equals(compare_store(store_path, keep=keep, methods=["window", "claa"], workers=1).per_layer)

    (counted,) = compare_keeps(store_path, budget=12, needle_keep=6, methods=["window"], workers=1)
    assert (counted.keep, counted.needle_keep) == (12, 6)
    (default,) = compare_keeps(store_path, methods=["window"], workers=1)
    assert default.keep == defaults.KEEP

    out, written = tmp_path / "both.parquet", []
    compare_keeps(store_path, keep=[0.1, 0.5], out=out, methods=["window"], workers=1, written=written)
    assert written == output_paths(out)
    assert sorted(pl.read_parquet(out)["keep"].unique()) == [0.1, 0.5]
    with pytest.raises(RankkitError, match="exists"):
        compare_keeps(store_path, keep=0.1, out=out, methods=["window"], workers=1)
    again = compare_keeps(store_path, keep=0.2, out=out, methods=["window"], workers=1, overwrite=True)
    assert pl.read_parquet(out)["keep"].unique().to_list() == [0.2] and again[0].keep == 0.2


def test_compare_at_several_keeps_refuses_an_out_inside_the_store_before_any_work(store_path, monkeypatch):
    from rankkit.eval import compare

    def no_work(*args, **kwargs):
        raise AssertionError("compared before the output was claimed")

    monkeypatch.setattr(compare, "compare_store", no_work)
    with pytest.raises(RankkitError, match="is one of this command's inputs"):
        compare.compare_keeps(store_path, keep="0.1,0.2", out=store_path / "inside.parquet", methods=["window"])


def test_a_summary_of_no_rows_is_an_empty_frame():
    from rankkit.eval.compare import summary_frame

    per_layer = pl.DataFrame(schema={"method": pl.String, "example_id": pl.String, "layer": pl.Int32, "spearman": pl.Float64})
    assert summary_frame(per_layer, {"window": 3, "specprefill": None}).equals(pl.DataFrame())


def test_results_never_replace_a_file_made_after_they_were_claimed(result, tmp_path, monkeypatch):
    """A file another process writes between the claim and the write is refused there too."""
    from rankkit.eval import compare

    claim = compare.claim_outputs

    def claimed_then_taken(paths, store, **options):
        claimed = claim(paths, store, **options)
        claimed[0].write_bytes(b"someone's")
        return claimed

    monkeypatch.setattr(compare, "claim_outputs", claimed_then_taken)
    with pytest.raises(RankkitError):
        compare.write_results([result], tmp_path / "compare.parquet")
    assert (tmp_path / "compare.parquet").read_bytes() == b"someone's"


def test_compare_summarises_probes_at_any_layer_of_the_model_and_refuses_one_past_it(store_path):
    summary = compare_store(store_path, layer=0, methods=["window"], workers=1).summary
    assert summary.select("method", "layer").rows() == [("window", 0)]
    last = compare_store(store_path, layer=LAYERS - 1, methods=["window"], workers=1).summary
    assert last["layer"].to_list() == [LAYERS - 1]
    refusal = f"layer {LAYERS} (--layer) is outside the model's layers 0..{LAYERS - 1}"
    with pytest.raises(RankkitError, match=f"^{re.escape(refusal)}$"):
        compare_store(store_path, layer=LAYERS, methods=["window"], workers=1)
