"""SlimInfer Alg. 1's decisions (the overlap it reports, the empty candidate), the host pool's size,
and the regions a swap writes: each block at its own offsets, the same on the prefill's cache and on a
static copy of it, and the padding the host declares."""

from __future__ import annotations

import pytest
import torch
from test_methods import _block_cache, _block_swap

from rankkit.cache import StaticKVCache
from rankkit.methods.swap import BlockSwap, SwapDecision


def blocks(gamma: float, cache=None) -> tuple[BlockSwap, object]:
    """Four blocks of 8 positions over two KV heads of width 4, blocks 1 and 2 on the host."""
    cache = _block_cache() if cache is None else cache
    return _block_swap(cache, active={0, 3}, gamma=gamma), cache


def test_a_decision_reports_the_overlap_it_compared_with_gamma():
    swap, cache = blocks(gamma=0.5)
    assert swap.swap(set(), cache) == SwapDecision(1.0, swapped=False)  # no candidate: nothing to fetch
    assert swap.swap({0, 1}, cache) == SwapDecision(0.5, swapped=False)  # 0.5 is not below 0.5
    assert swap.swap({3}, cache) == SwapDecision(1.0, swapped=False)
    decision = swap.swap({1, 2}, cache)  # none active
    assert decision == SwapDecision(0.0, swapped=True, offloaded={0, 3}, loaded={1, 2}, released=set())
    assert swap.swap({0, 2}, cache) == SwapDecision(0.5, swapped=False)
    decision = swap.swap({0, 3}, cache)  # 1 and 2 have host copies already: released, not copied again
    assert decision == SwapDecision(0.0, swapped=True, offloaded=set(), loaded={0, 3}, released={1, 2})


def test_a_candidate_larger_than_the_layers_regions_is_refused():
    """SlimInfer's candidate never outgrows B_active after the prefill (both are the budget's blocks):
    a larger one would need a region the layer, and a static copy of it, does not have."""
    swap, cache = blocks(gamma=0.5)
    with pytest.raises(ValueError, match="a candidate of 3 blocks, where layer 0 has room for 2"):
        swap.swap({0, 1, 2}, cache)
    assert swap.swap({1}, cache).swapped  # one region holds block 1, the other is free: still room for 2
    with pytest.raises(ValueError, match="a candidate of 3 blocks, where layer 0 has room for 2"):
        swap.swap({0, 1, 2}, cache)


def test_host_bytes_counts_the_keys_and_values_of_every_offloaded_block():
    swap, cache = blocks(gamma=0.5)
    assert swap.host_bytes() == 2 * 2 * (2 * 8 * 4 * 4)  # blocks 1 and 2: keys and values, float32
    swap.swap({1, 2}, cache)  # 0 and 3 join the host pool
    assert swap.host_bytes() == 4 * 2 * (2 * 8 * 4 * 4)


def _regions(cache, block_size=8):
    """Each region's positions (head 0), -1 for padding: what the slots hold, in slot order."""
    positions = cache.positions[0][0].tolist()
    return [positions[start : start + block_size] for start in range(0, len(positions), block_size)]


def test_blocks_sit_at_their_offsets_in_regions_a_swap_frees_and_fills():
    """A layer holding two whole blocks and part of a third (the query window's tokens 29-31 of block
    3): B_active's blocks in regions at their positions' offsets, the rest on the host; a block that
    leaves turns its region to padding, one that comes back takes the first free region, whole,
    partial ones padded; the cache is declared padded exactly while a region holds padding."""
    cache = _block_cache()
    cache.compress(0, torch.tensor([[*range(8), *range(16, 24), 29, 30, 31]] * 2))
    swap = _block_swap(cache, active={0, 2}, gamma=0.9)
    pad = [-1] * 8
    assert _regions(cache) == [[*range(8)], [*range(16, 24)]] and set(swap.host) == {3}
    assert not cache.padded[0] and cache.attention_mask(0, torch.tensor([32])) is None
    cache.begin_step(torch.tensor([32]))  # a generated token: after the regions, never swapped
    cache.update(torch.full((1, 2, 1, 4), 32.0), torch.full((1, 2, 1, 4), -32.0), 0)
    decision = swap.swap({0, 3}, cache)
    assert (decision.offloaded, decision.loaded, decision.released) == ({2}, {3}, set())
    assert _regions(cache) == [[*range(8)], [-1] * 5 + [29, 30, 31], [32]] and cache.padded[0]
    swap.swap({2}, cache)  # two blocks leave, block 2 comes back from the host into the first free region
    assert _regions(cache) == [[*range(16, 24)], pad, [32]] and cache.padded[0]
    mask = cache.attention_mask(0, torch.tensor([33]))[0, 0, 0]
    assert mask.tolist() == [True] * 8 + [False] * 8 + [True]
    swap.swap({0, 2}, cache)
    assert _regions(cache) == [[*range(16, 24)], [*range(8)], [32]] and not cache.padded[0]
    real = cache.positions[0] >= 0
    assert torch.equal(cache.keys[0][0, :, :, 0][real], cache.positions[0][real].float())  # each entry's own key
    assert torch.equal(cache.values[0][0, :, :, 0][real], -cache.positions[0][real].float())


def test_a_swap_on_a_static_copy_writes_what_it_writes_on_the_cache_it_was_laid_out_in():
    """The decode over a ``StaticKVCache`` swaps the copy's regions, slot for slot as a twin swaps the
    dynamic cache's, only padding after them; the prefill's cache it was copied from stays as it was."""
    (swap, prefill), (twin, mirror) = blocks(gamma=0.9), blocks(gamma=0.9)
    static, laid_out = StaticKVCache(prefill, 4), prefill.positions[0].clone()
    for candidate in ({0, 1}, {2, 3}, {0, 3}):
        assert swap.swap(candidate, static) == twin.swap(candidate, mirror)
        assert torch.equal(static.positions[0][:, :16], mirror.positions[0])
        assert torch.equal(static.keys[0][:, :, :16], mirror.keys[0])
        assert torch.equal(static.values[0][:, :, :16], mirror.values[0])
        assert (static.positions[0][:, 16:] == -1).all()
    assert torch.equal(prefill.positions[0], laid_out)


def test_one_kv_head_with_generated_tokens_before_the_swap_keeps_exactly_the_active_blocks():
    """Built on a cache that already holds generated tokens (position 32 is the first past a 32-token
    prompt), with one KV head: the generated tokens belong to no block and stay through every swap,
    and the device holds exactly the active blocks' entries, with their own keys and values."""
    cache = _block_cache(kv_heads=1)
    for position in (32, 33):
        cache.begin_step(torch.tensor([position]))
        cache.update(torch.full((1, 1, 1, 4), float(position)), torch.full((1, 1, 1, 4), -float(position)), 0)
    swap = _block_swap(cache, active={1, 3}, gamma=0.9)
    assert swap.active == {1, 3} and set(swap.host) == {0, 2}
    for candidate, active in (({1, 3}, {1, 3}), ({0, 1}, {0, 1}), ({2, 3}, {2, 3}), ({0, 3}, {0, 3})):
        swap.swap(candidate, cache)
        assert swap.active == active
        entries = cache.positions[0][0]
        real = entries >= 0
        wanted = sorted([p for block in active for p in range(8 * block, 8 * block + 8)] + [32, 33])
        assert sorted(entries[real].tolist()) == wanted and entries.shape[0] == 18  # two regions, two tokens
        assert torch.equal(cache.keys[0][0, 0, real, 0], entries[real].float())  # each entry's own key
        assert torch.equal(cache.values[0][0, 0, real, 0], -entries[real].float())
