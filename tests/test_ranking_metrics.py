"""rankkit.eval.ranking by hand: rows of any rank and dtype, per-row references, the edges (one
token, constant rows, unscored NaN tokens, empty targets) and no warning on any of them."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from scipy import stats

from rankkit.eval.ranking import (
    Ranked,
    descending_ranks,
    kendall,
    needle_recall,
    overlap_share,
    row_metrics,
    spans_mask,
    spearman,
    top_k_mask,
    topk_recall,
)


@pytest.fixture(autouse=True)
def warnings_fail():
    """A metric that is undefined is NaN, silently: a warning here fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_half_precision_scores_rank_as_their_values():
    scores = np.array([[1.0, 3.0, 2.0, 3.0], [0.5, 0.25, 0.75, 0.0]], dtype=np.float16)
    ranked = Ranked(scores)
    assert ranked.places.tolist() == [[3, 0, 2, 1], [1, 2, 0, 3]]
    assert ranked.average_ranks.tolist() == [[1.0, 3.5, 2.0, 3.5], [3.0, 2.0, 4.0, 1.0]]
    assert ranked.tied_pairs.tolist() == [1, 0]


def test_a_picked_row_carries_every_array_of_its_row():
    values = np.array([[3.0, 1.0, 3.0, 2.0], [4.0, 3.0, 2.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    ranked = Ranked(values)
    for row in range(3):
        picked = ranked[row]
        alone = Ranked(values[row])
        assert picked.shape == alone.shape == (4,)
        for name in ("places", "average_ranks", "dense_ranks", "tied_pairs", "spread"):
            np.testing.assert_array_equal(getattr(picked, name), getattr(alone, name), err_msg=name)
    # the squared deviations of the average ranks from 2.5: [1, 2.25, 1, 0.25], [2.25, 0.25, 0.25, 2.25]
    assert ranked.spread.tolist() == [4.5, 5.0, 0.0]
    assert ranked.tied_pairs.tolist() == [1, 0, 6]


def test_ranked_keeps_every_leading_axis():
    rng = np.random.default_rng(3)
    values = rng.integers(0, 4, size=(2, 3, 5)).astype(np.float64)
    ranked = Ranked(values)
    assert ranked.places.shape == ranked.average_ranks.shape == ranked.dense_ranks.shape == (2, 3, 5)
    assert ranked.tied_pairs.shape == ranked.spread.shape == (2, 3)
    for layer, head in np.ndindex(2, 3):
        alone = Ranked(values[layer, head])
        assert ranked.tied_pairs[layer, head] == alone.tied_pairs
        assert ranked.spread[layer, head] == alone.spread
        np.testing.assert_array_equal(ranked.average_ranks[layer, head], stats.rankdata(values[layer, head]))


def test_spearman_against_a_reference_per_row():
    """Rows broadcast: a [L, H, T] reference scores each row against its own row."""
    rng = np.random.default_rng(5)
    scores = rng.integers(0, 5, size=(2, 3, 9)).astype(np.float64)
    reference = rng.integers(0, 5, size=(2, 3, 9)).astype(np.float64)
    reference[1, 2] = 7.0  # a constant reference row
    rho = spearman(scores, reference)
    assert rho.shape == (2, 3)
    for layer, head in np.ndindex(2, 3):
        if (layer, head) == (1, 2):
            assert np.isnan(rho[layer, head])
            continue
        expected = stats.spearmanr(scores[layer, head], reference[layer, head]).statistic
        assert rho[layer, head] == pytest.approx(expected, abs=1e-12)


def test_two_tokens_correlate_fully_or_not_at_all():
    reference = np.array([1.0, 2.0])
    assert spearman(np.array([[0.0, 5.0], [5.0, 0.0]]), reference).tolist() == [1.0, -1.0]
    assert kendall(np.array([[0.0, 5.0], [5.0, 0.0]]), reference).tolist() == [1.0, -1.0]
    found = row_metrics(np.array([[0.0, 5.0], [5.0, 0.0], [1.0, 1.0]]), Ranked(reference), chained=True)
    assert found["spearman"][:2].tolist() == [1.0, -1.0] and np.isnan(found["spearman"][2])
    assert np.isnan(found["chained"][0]) and found["chained"][1] == -1.0 and np.isnan(found["chained"][2])


def test_undefined_correlations_are_nan_without_a_warning():
    reference = np.array([3.0, 1.0, 2.0, 5.0])
    constant = np.full((2, 4), 2.0)
    assert np.isnan(spearman(constant, reference)).all()
    assert np.isnan(kendall(constant, reference)).all()
    assert np.isnan(spearman(reference, np.ones(4)))
    assert np.isnan(kendall(reference, np.ones(4)))
    unscored = np.full(4, np.nan)  # no token scored: all tied
    assert np.isnan(spearman(unscored, reference)) and np.isnan(kendall(unscored, reference))
    one_token = np.array([[1.0]])
    assert np.isnan(spearman(one_token, np.array([2.0]))).all()
    assert np.isnan(kendall(one_token, np.array([2.0]))).all()


def test_row_metrics_with_nothing_to_find_are_nan_without_a_warning():
    scores = np.array([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    reference = Ranked(np.array([4.0, 3.0, 2.0, 1.0]))
    tops = np.array([[True, True, False, False], [False, False, False, False]])
    found = row_metrics(
        scores, reference, top_sets=tops, top_ks=[2, 2], evidence=np.zeros(4, bool), needle_k=2
    )
    assert found["overlap"][:, 0].tolist() == [1.0, 0.0]
    assert np.isnan(found["overlap"][:, 1]).all()
    assert np.isnan(found["evidence"]).all()
    assert found["spearman"].tolist() == [1.0, -1.0]
    assert np.isnan(found["kendall"]).all()  # not asked for
    assert np.isnan(found["chained"]).all()  # not asked for


def test_unscored_tokens_are_the_last_places():
    np.testing.assert_array_equal(descending_ranks(np.array([1.0, np.nan, 3.0, np.nan])), [1, 2, 0, 3])
    np.testing.assert_array_equal(top_k_mask(np.array([np.nan, 1.0, np.nan, 2.0]), 3), [1, 1, 0, 1])


def test_recall_per_layer_and_head_against_per_row_references():
    """[L, H, T] scores against a [L, H, T] reference: each row's top 2 against its own row's."""
    scores = np.array(
        [
            [[5.0, 4.0, 0.0, 0.0], [0.0, 0.0, 5.0, 4.0], [5.0, 0.0, 4.0, 0.0]],
            [[0.0, 5.0, 4.0, 0.0], [5.0, 0.0, 0.0, 4.0], [0.0, 0.0, 4.0, 5.0]],
        ]
    )
    reference = np.broadcast_to(np.array([4.0, 3.0, 2.0, 1.0]), (2, 3, 4)).copy()
    reference[1] = [1.0, 2.0, 3.0, 4.0]  # the second layer's reference ranks the other way
    recall = topk_recall(scores, reference, 2)
    assert recall.tolist() == [[1.0, 0.0, 0.5], [0.5, 0.5, 1.0]]
    np.testing.assert_array_equal(topk_recall(scores, reference, 0.3), recall)  # 30% of 4 tokens: 2
    kept = top_k_mask(scores, 2)
    targets = np.zeros((2, 3, 4), bool)
    targets[0, 0, 3] = targets[1, 2, 2:] = True
    shares = overlap_share(kept, targets)
    assert shares[0, 0] == 0.0 and shares[1, 2] == 1.0
    assert np.isnan(shares[0, 1:]).all() and np.isnan(shares[1, :2]).all()


def test_needle_recall_per_layer_and_head():
    scores = np.array(
        [[[5.0, 4.0, 0.0, 1.0], [0.0, 1.0, 5.0, 4.0]], [[9.0, 0.0, 0.0, 8.0], [1.0, 2.0, 3.0, 4.0]]]
    )
    evidence = np.array([0, 1, 1, 0])  # any truthy mask
    assert needle_recall(scores, evidence, 0.5).tolist() == [[0.5, 0.5], [0.0, 0.5]]
    assert needle_recall(scores, evidence, 3).tolist() == [[0.5, 1.0], [0.5, 1.0]]


def test_spans_mask_clips_every_span_to_the_tokens():
    np.testing.assert_array_equal(spans_mask([[0, 1]], 4), [1, 0, 0, 0])
    np.testing.assert_array_equal(spans_mask([[-3, 2]], 4), [1, 1, 0, 0])
    np.testing.assert_array_equal(spans_mask([[3, 9]], 4), [0, 0, 0, 1])
    np.testing.assert_array_equal(spans_mask([[-5, -1], [0, 0], [2, 1]], 4), [0, 0, 0, 0])
    np.testing.assert_array_equal(spans_mask([(1, 2), (2, 3)], 4), [0, 1, 1, 0])
    assert spans_mask([[1, 3]], 4).dtype == bool


def test_row_metrics_score_every_layer_and_head_at_once():
    rng = np.random.default_rng(9)
    scores = rng.integers(0, 4, size=(2, 3, 7)).astype(np.float64)
    reference = rng.random(7)
    found = row_metrics(scores, Ranked(reference), with_kendall=True)
    assert found["spearman"].shape == found["kendall"].shape == (6,)
    for row, values in enumerate(scores.reshape(6, 7)):
        expected = stats.spearmanr(values, reference).statistic
        assert found["spearman"][row] == pytest.approx(expected, abs=1e-12)
        assert found["kendall"][row] == pytest.approx(
            stats.kendalltau(values, reference).statistic, abs=1e-12
        )


def test_evidence_without_a_needle_keep_finds_nothing():
    found = row_metrics(np.array([[3.0, 2.0, 1.0]]), None, evidence=np.array([True, False, False]))
    assert found["evidence"].tolist() == [0.0]


def test_row_metrics_take_any_truthy_masks():
    scores = np.array([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    found = row_metrics(
        scores,
        None,
        top_sets=np.array([[0, 2, 0, 5]]),
        top_ks=[2],
        evidence=np.array([3, 0, 0, 1]),
        needle_k=1,
    )
    assert found["overlap"].tolist() == [[0.5], [0.5]]
    assert found["evidence"].tolist() == [0.5, 0.5]
