"""SAGE-KV on sliding-window layers and at its budget's bounds, online (prefill) and offline
(``select_offline``, and ``layer_rankings`` as ``rankkit compare`` reads it), against the slow
reference of tests/test_hybrid.py. The model has one KV head for four query heads, so each
kept set is the union of four query heads' top-k."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import attended_keys_recorder
from test_hybrid import LastQueryAttention, cached, hybrid_runner, reference_sage_kv

from rankkit.errors import RankkitError
from rankkit.methods import Budget, Captured, make
from rankkit.methods.sage_kv import SageSplit, sage_split
from rankkit.runner import Runner

LOCAL, GLOBAL = "sliding_attention", "full_attention"
LAYERS = (LOCAL, GLOBAL, LOCAL)
WINDOW = 16  # a local layer's last query sees the last 16 of the 40 prompt tokens
GROUP = 4  # query heads per KV head


@pytest.fixture(scope="module")
def runner() -> Runner:
    # peaked attention, so the query heads' top-k differ
    return hybrid_runner(layers=LAYERS, window=WINDOW, kv_heads=1)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def attention(runner, prompt) -> dict[int, torch.Tensor]:
    """Each layer's last-query softmax attention per query head [1, GROUP, 40]."""
    recorder = LastQueryAttention()
    runner.prefill(prompt, hooks=[recorder])
    return recorder.layers


def seen(layer: int, length: int = 40) -> list[int]:
    return list(range(length - WINDOW if LAYERS[layer] == LOCAL else 0, length))


def store(attention, length: int = 40) -> Captured:
    """The stored per-query-head attention of the last token, as `rankkit capture` writes it."""
    scores = torch.stack([attention[layer].flatten(0, 1) for layer in range(len(LAYERS))])
    key = make("sage-kv").probe().key
    return Captured({key: scores}, len(LAYERS), length, LAYERS, WINDOW, kv_heads=1, query_heads=GROUP)


def recent_window(keep: int, seen_positions: list[int]) -> int:
    """Step 1's recent window on a layer seeing ``seen_positions``: the rest of the budget after B/4
    sinks and G x B/(2G) evicted candidates, plus the sinks it cannot see; all it sees if that fits."""
    if len(seen_positions) <= keep:
        return len(seen_positions)
    sinks, per_query_head = keep // 4, keep // (2 * GROUP)
    lost = sum(1 for position in range(sinks) if position not in seen_positions)
    return max(1, keep - sinks - GROUP * per_query_head) + lost


def always_kept(length: int, keep: int, seen_positions: list[int]) -> set[int]:
    """Step 1's sinks a layer sees (none when everything it sees fits) and its recent window."""
    sinks = 0 if len(seen_positions) <= keep else keep // 4
    recent = recent_window(keep, seen_positions)
    return {p for p in range(sinks) if p in seen_positions} | set(range(length - recent, length))


def test_a_split_on_a_layer_that_misses_its_oldest_keys():
    split = sage_split(16, 2)
    assert split == SageSplit(sinks=4, per_query_head=4, recent=4, first_seen=0)
    assert split.seeing(0, 40, 16) is split and split.seeing(0, 10, 16) is split  # a layer that sees all
    # what the layer sees fits the budget, up to equality: all of it, as its recent window
    assert split.seeing(24, 40, 16) == SageSplit(0, 0, 16, 24)
    assert split.seeing(30, 40, 16) == SageSplit(0, 0, 10, 30)
    # it does not: the sinks it cannot see go to the recent window
    assert split.seeing(23, 40, 16) == SageSplit(4, 4, 8, 23)
    assert split.seeing(3, 40, 16) == SageSplit(4, 4, 7, 3)


@pytest.mark.parametrize("tokens", [8, 16, 20])  # under, at and over the 16 keys a local layer sees
def test_prefill_and_the_store_keep_only_keys_each_layer_sees(runner, prompt, attention, tokens):
    method = make("sage-kv")
    budget = Budget.from_tokens(tokens)
    run = method.prefill(runner, prompt, budget)
    captured = store(attention)
    for layer in range(len(LAYERS)):
        expected = reference_sage_kv(attention[layer], tokens, GROUP, seen(layer))
        assert cached(run, layer) == expected, layer
        offline = method.select_offline(captured, budget, layer=layer)
        assert offline.layer == layer and offline.as_lists() == expected, layer
    # Step 4: the token at 40 joins each layer's own recent window; the one at 41 takes the place
    # of its oldest entry, which the step at 40 still saw
    attended = attended_keys_recorder()
    for position in (40, 41):
        runner.decode_step(5, position, run.result.cache, [attended])
    for layer in range(len(LAYERS)):
        evicted = 40 - recent_window(tokens, seen(layer))
        (kept,) = reference_sage_kv(attention[layer], tokens, GROUP, seen(layer))
        assert attended.steps[0][layer] == [kept + [40]], layer
        assert attended.steps[1][layer] == [[p for p in kept if p != evicted] + [40, 41]], layer
        assert cached(run, layer) == attended.steps[1][layer], layer


def test_layer_rankings_put_step_1s_tokens_first_then_each_tokens_best_query_head(attention):
    captured = store(attention)
    for tokens in (8, 20):
        rankings = make("sage-kv").layer_rankings(captured, Budget.from_tokens(tokens))
        assert list(rankings) == list(range(len(LAYERS)))
        for layer, ranking in rankings.items():
            forced = always_kept(40, tokens, seen(layer))
            expected = [
                math.inf
                if p in forced
                else max(attention[layer][0, :, p].tolist())
                if p in seen(layer)
                else -math.inf
                for p in range(40)
            ]
            assert ranking.tolist() == expected, (tokens, layer)


def test_a_budget_that_covers_the_prompt_keeps_what_full_prefill_keeps(runner, prompt, attention):
    """Every key of a global layer, the keys a local layer's window saw (full prefill's local layers
    roll them), online and offline."""
    method = make("sage-kv")
    run = method.prefill_for_decoding(runner, prompt, Budget.from_tokens(40))
    full = make("full").prefill_for_decoding(runner, prompt, Budget.from_tokens(40))
    for layer in range(len(LAYERS)):
        assert cached(run, layer) == cached(full, layer) == [seen(layer)], layer
        offline = method.select_offline(store(attention), Budget.from_tokens(40), layer=layer)
        assert offline.layer == layer and offline.as_lists() == [seen(layer)], layer
    assert not run.decode_hooks  # no decode rule beyond full prefill's


def test_the_smallest_budget_keeps_a_sink_place_and_the_last_token(attention):
    # two tokens at the least: sinks B/4 = 0, k = 0, so the recent window holds both
    selected = make("sage-kv").select_offline(store(attention), Budget.from_tokens(1), layer=1)
    assert selected.as_lists() == [[38, 39]]


def test_one_query_head_per_kv_head_keeps_each_heads_own_top_k():
    torch.manual_seed(3)
    scores = torch.rand(2, 2, 12)  # two layers, two KV heads with one query head each
    key = make("sage-kv").probe().key
    captured = Captured({key: scores}, 2, 12, (LOCAL, GLOBAL), 6, kv_heads=2, query_heads=2)
    # the local layer sees positions 6..11; budget 8: sinks 2 (unseen: to the recent window), k 4
    selected = make("sage-kv").select_offline(captured, Budget.from_tokens(8), layer=0)
    assert selected.as_lists() == [list(range(6, 12))] * 2
    selected = make("sage-kv").select_offline(captured, Budget.from_tokens(5), layer=0)  # sinks 1, k 2
    for head, kept in enumerate(selected.as_lists()):
        recent = {10, 11, 9}  # 5 - 1 - 2, with the unseen sink
        best = sorted(range(6, 9), key=lambda p: -scores[0, head, p].item())[:2]
        assert kept == sorted(recent | set(best)), head


def test_the_store_must_hold_the_attention_per_query_head_and_name_a_layer(attention):
    method = make("sage-kv")
    budget = Budget.from_tokens(8)
    captured = store(attention)
    for layer in (None, -1, 3):
        with pytest.raises(RankkitError) as refused:
            method.select_offline(captured, budget, layer=layer)
        assert str(refused.value) == (
            "method 'sage-kv' keeps a set per layer and KV head: name the layer with --layer (0..2)"
            if layer is None
            else f"--layer {layer} is not a layer of this model (0..2); give one in that range"
        )
    per_kv_head = (
        "method 'sage-kv' needs 'last_token_heads' per query head, which this store does not hold"
        " (it predates that layout); recapture it with `rankkit capture`"
    )
    key = method.probe().key
    scores = captured.arrays[key]
    for kv_heads, query_heads in [(None, GROUP), (1, 2 * GROUP)]:
        old = Captured({key: scores}, 3, 40, LAYERS, WINDOW, kv_heads=kv_heads, query_heads=query_heads)
        with pytest.raises(RankkitError) as refused:
            method.layer_rankings(old, budget)
        assert str(refused.value) == per_kv_head
    with pytest.raises(RankkitError) as refused:
        method.select_offline(Captured({}, 3, 40, kv_heads=1, query_heads=GROUP), budget, layer=0)
    assert str(refused.value) == f"method 'sage-kv' needs captured {key!r}, which this example lacks"
