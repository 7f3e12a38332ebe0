"""TOVA's decode-time eviction against its budget, on a model with sliding-window layers, and its
offline scores from a store that did not record the KV heads."""

from __future__ import annotations

import pytest
import torch
from test_hybrid import hybrid_runner

from rankkit.methods import Budget, Captured, make

LOCAL_LAYERS, GLOBAL_LAYERS = (0, 1, 3, 4), (2, 5)  # test_hybrid's model: 16-token windows on the local ones


@pytest.fixture(scope="module")
def runner():
    return hybrid_runner()


def test_a_cache_under_the_budget_grows_and_one_at_the_budget_evicts_the_least_attended(runner):
    prompt = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1))
    run = make("tova").prefill(runner, prompt, Budget.from_tokens(20))
    cache = run.result.cache
    sizes = []
    for step in range(5):
        runner.decode_step(5, 40 + step, cache, run.decode_hooks)
        sizes.append([cache.positions[layer].shape[1] for layer in range(6)])
    # a local layer kept only the 16 keys it sees: it grows to the budget of 20, then evicts
    assert [[size[layer] for layer in LOCAL_LAYERS] for size in sizes] == [
        [n] * 4 for n in (17, 18, 19, 20, 20)
    ]
    assert all(size[layer] == 20 for size in sizes for layer in GLOBAL_LAYERS)
    # the token at 44 no longer sees 24..28 (weight 0): among those ties the latest, 28, leaves
    for layer in LOCAL_LAYERS:
        for head in cache.positions[layer]:
            assert sorted(head.tolist()) == [24, 25, 26, 27, *range(29, 45)], layer


def test_a_store_without_kv_heads_gives_one_row_of_summed_attention():
    torch.manual_seed(0)
    scores = torch.rand(2, 4, 6)  # two layers, four query heads
    key = make("tova").probe().key
    tova = make("tova")
    summed = scores.sum(1, keepdim=True)
    assert torch.equal(tova.captured_scores(Captured({key: scores}, 2, 6)), summed)
    assert torch.equal(tova.captured_scores(Captured({key: scores}, 2, 6, kv_heads=2, query_heads=4)),
                       summed.expand(-1, 2, -1))  # fmt: skip


def test_one_kv_head_keeps_the_budget_through_decoding():
    """Multi-query attention: the one row of heads-summed scores evicts one entry per step."""
    from conftest import one_kv_head_runner

    single = one_kv_head_runner()
    prompt = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1))
    run = make("tova").prefill(single, prompt, Budget.from_tokens(20))
    cache = run.result.cache
    for step in range(3):
        single.decode_step(5, 40 + step, cache, run.decode_hooks)
        for layer in range(3):
            assert cache.positions[layer].shape == (1, 20), (step, layer)


def test_the_least_attended_entry_is_found_by_position_whatever_the_slot_order():
    from rankkit.methods.tova import least_attended

    positions = torch.tensor([0, 9, 4, 7, 2])  # a cache after evictions: entries out of position order
    assert least_attended(torch.tensor([0.3, 0.1, 0.2, 0.1, 0.5]), positions, None).tolist() == [1]  # tie: 9 is later
    nan = float("nan")  # a key a local layer does not see is never the one evicted
    assert least_attended(torch.tensor([nan, 0.4, 0.2, nan, 0.3]), positions, None).tolist() == [2]
    # the first token can be the least attended: position 0 is found as any other
    assert least_attended(torch.tensor([0.05, 0.4, 0.2, 0.1, 0.3]), positions, None).tolist() == [0]
    # where the cache is padded, an empty slot (position -1) is never the one evicted, whatever its score
    padded = torch.tensor([0, -1, 4, 7, 2])
    assert least_attended(torch.tensor([0.3, 0.0, 0.2, 0.1, 0.5]), padded, torch.inf).tolist() == [3]


def test_evicting_moves_the_last_entry_into_the_slot_and_shortens_the_layer():
    from rankkit.cache import KVCache

    cache = KVCache(1)
    cache.begin_step(torch.arange(5))
    keys = torch.arange(5.0)[None, None, :, None].expand(1, 2, -1, 3).clone()
    cache.update(keys, -keys, 0)
    cache.begin_step(torch.tensor([5]))
    cache.update(torch.full((1, 2, 1, 3), 5.0), torch.full((1, 2, 1, 3), -5.0), 0)  # a step's own entry
    cache.evict(0, torch.tensor([1]))
    assert cache.positions[0].tolist() == [[0, 5, 2, 3, 4]] * 2
    assert cache.keys[0][0, :, :, 0].tolist() == [[0.0, 5.0, 2.0, 3.0, 4.0]] * 2
    assert cache.values[0][0, :, 1, 0].tolist() == [-5.0, -5.0]
    cache.evict(0, torch.tensor([4]))  # the last entry itself
    assert cache.positions[0].tolist() == [[0, 5, 2, 3]] * 2
    cache.begin_step(torch.tensor([6]))
    cache.update(torch.full((1, 2, 1, 3), 6.0), torch.full((1, 2, 1, 3), -6.0), 0)  # appended where 4 was
    assert cache.positions[0].tolist() == [[0, 5, 2, 3, 6]] * 2 and cache.keys[0][0, 0, 4, 0] == 6.0
