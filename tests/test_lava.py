"""LAVa online (``prefill``) and offline (``rankkit compare``, ``rankkit select``) against plain loops.

The store holds the ``lava`` probe's scores [L, kv_heads, T]; ``Lava.layer_rankings`` ranks each
layer's tokens by their best entry over the KV heads, the recent window first (LAVa never evicts
it) and, on a sliding-window layer, the keys its last query cannot see last (never kept). On a
hybrid model, Algorithms 1-2 share the budget among the keys each layer sees, online and offline.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from test_hybrid import hybrid_runner

from rankkit.methods import Budget, Captured, make

LAYERS, HEADS, TOKENS, WINDOW, SLIDING = 3, 2, 9, 2, 5
KINDS = ["full_attention", "sliding_attention", "full_attention"]


def stored_scores() -> torch.Tensor:
    scores = torch.rand(LAYERS, HEADS, TOKENS, generator=torch.Generator().manual_seed(3))
    scores[2, :, 1] = 0.5  # a tie across the heads: the token's best entry is that value
    return scores


def captured(method, sliding: bool) -> Captured:
    return Captured(
        {method.captured_inputs()[0]: stored_scores()},
        num_layers=LAYERS,
        num_tokens=TOKENS,
        layer_types=KINDS if sliding else None,
        sliding_window=SLIDING if sliding else None,
    )


def reference_rankings(scores: list, sliding: bool) -> dict:
    """Per layer and token: +inf in the window, -inf for a key a local layer's last query cannot see
    (it sees the last ``SLIDING`` keys), else the largest of its KV heads' scores."""
    rankings = {}
    for layer in range(LAYERS):
        row = []
        for token in range(TOKENS):
            if token >= TOKENS - WINDOW:
                row.append(float("inf"))
            elif sliding and KINDS[layer] == "sliding_attention" and token < TOKENS - SLIDING:
                row.append(float("-inf"))
            else:
                best = scores[layer][0][token]
                for head in range(1, HEADS):
                    best = max(best, scores[layer][head][token])
                row.append(best)
        rankings[layer] = row
    return rankings


@pytest.mark.parametrize("sliding", [False, True], ids=["global", "sliding-window"])
def test_layer_rankings_rank_each_token_by_its_best_kv_head_window_first_unseen_last(sliding):
    method = make("lava", window_size=WINDOW)
    rankings = method.layer_rankings(captured(method, sliding), Budget.from_keep(0.5))
    expected = reference_rankings(stored_scores().tolist(), sliding)
    assert list(rankings) == list(expected)
    for layer, ranking in rankings.items():
        assert ranking.tolist() == pytest.approx(expected[layer])


# ---- Algorithms 1-2 on a hybrid model: local layers' unseen keys are no entries -----------------

LOCAL, GLOBAL = "sliding_attention", "full_attention"
HYBRID = (LOCAL, GLOBAL, LOCAL, GLOBAL)
SEES = 8  # a local layer's last query sees the last 8 of the 24 prompt tokens
LENGTH, LAVA_WINDOW, KEPT_TOKENS = 24, 4, 10


@pytest.fixture(scope="module")
def hybrid():
    """The tiny Qwen2 with ``HYBRID`` layers, its prompt and the stored ``lava`` scores (NaN: unseen)."""
    from rankkit.probes import ProbeRecorder

    runner = hybrid_runner(layers=HYBRID, window=SEES, peaked=False)
    ids = torch.randint(0, 97, (LENGTH,), generator=torch.Generator().manual_seed(5))
    method = make("lava", window_size=LAVA_WINDOW)
    recorder = ProbeRecorder([method.probe()])
    runner.prefill(ids, hooks=[recorder])
    scores = torch.from_numpy(recorder.scores()[method.probe().key])
    return runner, ids, method, scores


def real_shares(total: int, weights: list[float], caps: list[float]) -> list[float]:
    """Shares of ``total`` proportional to the weights, those past their cap fixed at it and the rest
    shared again (every share at its cap when they cannot hold ``total``)."""
    if total >= sum(caps):
        return list(caps)
    fixed: dict[int, float] = {}
    while True:
        open_ = [i for i in range(len(weights)) if i not in fixed]
        remaining = total - sum(fixed.values())
        weight = sum(weights[i] for i in open_)
        proposal = {i: remaining * weights[i] / weight for i in open_}
        passing = [i for i in open_ if proposal[i] > caps[i]]
        if not passing:
            return [fixed[i] if i in fixed else proposal[i] for i in range(len(weights))]
        fixed.update({i: caps[i] for i in passing})


def water_filling(total: int, weights: list[float], caps: list[int]) -> list[int]:
    """``real_shares`` in whole entries, by largest remainder, ties to the earlier share."""
    if total >= sum(caps):
        return list(caps)
    shares = real_shares(total, weights, caps)
    whole = [int(share // 1) for share in shares]
    by_remainder = sorted(range(len(shares)), key=lambda i: (-(shares[i] - whole[i]), i))
    for i in by_remainder[: total - sum(whole)]:
        whole[i] += 1
    return whole


def test_recompressing_after_every_layer_leaves_each_layer_its_share_among_all():
    """Why LAVa budgets once, after the prefill: Alg. 2 recompresses layers 0..l after each layer l,
    each to its entropy's share of 𝔹 among them, within what it still holds; every layer ends at its
    share among all L, the one apportioning (real shares, on random cases whose caps bind)."""
    generator = random.Random(11)
    for case in range(500):
        layers = generator.randint(1, 12)
        entropy = [generator.uniform(0.01, 1.0) for _ in range(layers)]
        caps = [float(generator.randint(0, 60)) for _ in range(layers)]
        total = generator.randint(0, int(sum(caps)))
        held: list[float] = []
        for layer in range(layers):
            held.append(caps[layer])
            shares = real_shares(total, entropy[: layer + 1], held)
            held = [min(h, share) for h, share in zip(held, shares, strict=True)]
        assert held == pytest.approx(real_shares(total, entropy, caps), abs=1e-9), case


def reference_lava(scores: list, length: int, window: int, kept_tokens: int) -> dict:
    """LAVa Alg. 1-2 from scores [L][H][T] (NaN: a key the layer cannot see, no entry): each layer's
    normalised entropy over its seen entries outside the window, 𝔹 = (keep - w) x H x L shared by it
    within each layer's seen entries, and per head the window plus the layer's best B_l entries."""
    layers, heads = len(scores), len(scores[0])
    entries, entropy = [], []
    for rows in scores:
        seen = [(h, i) for h in range(heads) for i in range(length - window) if rows[h][i] == rows[h][i]]
        total = sum(max(rows[h][i], 0.0) for h, i in seen)
        probabilities = [max(rows[h][i], 0.0) / total for h, i in seen]
        entropy.append(-sum(p * math.log(p) for p in probabilities if p > 0) / len(seen))
        entries.append(seen)
    shares = water_filling((kept_tokens - window) * heads * layers, entropy, [len(seen) for seen in entries])
    kept = {}
    for layer, rows in enumerate(scores):
        ranked = sorted(entries[layer], key=lambda e: (-rows[e[0]][e[1]], e[0] * length + e[1]))
        best = ranked[: shares[layer]]
        kept[layer] = [
            sorted([i for h, i in best if h == head] + list(range(length - window, length)))
            for head in range(heads)
        ]
    return kept


def held(run, layer: int) -> list[list[int]]:
    """The prompt positions each KV head of a layer's cache holds after a prefill."""
    from rankkit.cache import PADDING

    return [sorted(p for p in head if p != PADDING) for head in run.result.cache.positions[layer].tolist()]


def test_lava_on_a_hybrid_model_shares_the_budget_among_the_keys_each_layer_sees(hybrid):
    runner, ids, method, scores = hybrid
    budget = Budget.from_tokens(KEPT_TOKENS)
    expected = reference_lava(scores.tolist(), LENGTH, LAVA_WINDOW, KEPT_TOKENS)
    # 𝔹 = 48 entries: a local layer sees 2 heads x 4 keys outside its window, fewer than its share,
    # so each keeps those 8 and the global layers share the other 32; every layer keeps its window
    assert [sum(map(len, expected[layer])) for layer in range(4)] == [8 + 8, 16 + 8, 8 + 8, 16 + 8]
    run = method.prefill(runner, ids, budget)
    stored = Captured({method.probe().key: scores}, len(HYBRID), LENGTH, HYBRID, SEES)
    for layer in range(len(HYBRID)):
        assert held(run, layer) == expected[layer], layer
        assert method.select_offline(stored, budget, layer=layer).as_lists() == expected[layer], layer
        # each cut cache is as wide as its widest head: no entries of padding beyond it
        assert run.result.cache.positions[layer].shape[1] == max(map(len, expected[layer])), layer


def test_lava_at_the_whole_prompt_keeps_what_full_prefill_keeps(hybrid):
    """Every key of a global layer and the keys a local layer's window saw (full prefill's local layers
    roll them), online and offline."""
    runner, ids, method, scores = hybrid
    stored = Captured({method.probe().key: scores}, len(HYBRID), LENGTH, HYBRID, SEES)
    for budget in (Budget.from_tokens(LENGTH), Budget.from_keep(1.0)):
        run = method.prefill_for_decoding(runner, ids, budget)
        for layer, kind in enumerate(HYBRID):
            expected = [list(range(LENGTH - SEES if kind == LOCAL else 0, LENGTH))] * 2
            assert held(run, layer) == expected, layer
            assert method.select_offline(stored, budget, layer=layer).as_lists() == expected, layer
    # one token short of it, the local layers keep only the keys they see
    run = method.prefill(runner, ids, Budget.from_tokens(LENGTH - 1))
    assert held(run, 0) == held(run, 2) == [list(range(LENGTH - SEES, LENGTH))] * 2


def test_normalized_entropy_counts_only_the_keys_a_layer_sees():
    """Eq. 6-7 by hand: p = s / sum(s) over the seen (non-NaN) entries, H = -sum p log p / their count."""
    from rankkit.methods.lava import normalized_entropy

    scores = torch.tensor([[0.5, float("nan"), 0.25], [float("nan"), 0.25, -1.0]])
    seen = [0.5, 0.25, 0.25, 0.0]  # a negative score counts as 0, an entry still
    total = sum(seen)
    expected = -sum(s / total * math.log(s / total) for s in seen if s > 0) / len(seen)
    assert normalized_entropy(scores).item() == pytest.approx(expected, rel=1e-12)
    assert normalized_entropy(torch.full((2, 3), float("nan"))).item() == 0.0  # nothing to budget


def test_windowless_drops_the_recent_window_and_with_window_marks_it():
    from rankkit.methods.lava import windowless, with_window

    scores = torch.arange(10.0).view(2, 5)
    assert torch.equal(windowless(scores, 2), scores[:, :3])
    assert windowless(scores, 9).shape == (2, 0)
    marked = with_window(torch.tensor([[1.0, float("nan"), 3.0, 4.0]]), 1)
    assert marked.tolist() == [[1.0, float("-inf"), 3.0, float("inf")]]


def test_layer_budgets_share_by_float64_entropy_and_count_one_layers_heads():
    """Entropies 1 and 1 + 1e-9 share one entry: float64 gives it to the second layer by the
    largest remainder (float32 would read them as equal and give it to the first)."""
    from rankkit.methods.lava import layer_budgets

    scores = torch.rand(1, 6, generator=torch.Generator().manual_seed(0))
    assert layer_budgets([scores, scores], [1.0, 1.0 + 1e-9], 1, 0, 1) == [0, 1]
    assert layer_budgets([scores.expand(3, -1)], [0.5], 2, 0, 1) == [6]  # (2 - 0) x 3 heads x 1 layer


def test_best_entries_is_a_boolean_mask_of_the_first_budget_entries_of_the_order():
    from rankkit.methods.lava import best_entries

    kept = best_entries(torch.tensor([5, 0, 3, 1, 2, 4]), 3, 2)
    assert kept.dtype == torch.bool
    assert kept.tolist() == [[True, False, False], [True, False, True]]
