"""SlimInfer Alg. 1's decisions (the overlap it reports, the empty candidate), the host pool's size,
and the regions a swap writes: each block at its own offsets, the same on the prefill's cache and on a
static copy of it."""

from __future__ import annotations

import torch
from test_methods import _block_cache

from rankkit.cache import StaticKVCache
from rankkit.methods.swap import BlockSwap, SwapDecision


def blocks(gamma: float) -> tuple[BlockSwap, object]:
    """Four blocks of 8 positions over two KV heads of width 4, blocks 1 and 2 on the host."""
    cache = _block_cache()
    swap = BlockSwap(cache, 0, block_size=8, prompt_length=32, gamma=gamma)
    swap.offload_inactive({0, 3}, cache)
    return swap, cache


def test_a_decision_reports_the_overlap_it_compared_with_gamma():
    swap, cache = blocks(gamma=0.5)
    assert swap.swap(set(), cache) == SwapDecision(1.0, swapped=False)  # no candidate: nothing to fetch
    assert swap.swap({0, 1}, cache) == SwapDecision(0.5, swapped=False)  # 0.5 is not below 0.5
    assert swap.swap({0, 1, 2, 3}, cache) == SwapDecision(0.5, swapped=False)
    decision = swap.swap({1, 2, 3}, cache)  # one of three active
    assert decision == SwapDecision(1 / 3, swapped=True, offloaded={0}, loaded={1, 2}, released=set())


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
    """A layer holding part of a block (the query window's tokens 29-31 of block 3) and two whole
    ones: each block in its own region at its positions' offsets, partial ones padded; a block that
    leaves turns its region to padding, one that comes back takes the first free region, whole."""
    cache = _block_cache()
    cache.compress(0, torch.tensor([[*range(8), *range(16, 24), 29, 30, 31]] * 2))
    swap = BlockSwap(cache, 0, block_size=8, prompt_length=32, gamma=0.9, positions=cache.positions[0][0].numpy())
    pad = [-1] * 8
    assert _regions(cache) == [[*range(8)], [*range(16, 24)], [-1] * 5 + [29, 30, 31]]
    swap.offload_inactive({0, 2}, cache)
    assert _regions(cache) == [[*range(8)], [*range(16, 24)], pad]
    cache.begin_step(torch.tensor([32]))  # a generated token: after the regions, never swapped
    cache.update(torch.full((1, 2, 1, 4), 32.0), torch.full((1, 2, 1, 4), -32.0), 0)
    decision = swap.swap({0, 3}, cache)
    assert (decision.offloaded, decision.loaded, decision.released) == ({2}, {3}, set())
    assert _regions(cache) == [[*range(8)], [-1] * 5 + [29, 30, 31], pad, [32]]  # the first free region
    swap.swap({2, 3}, cache)  # block 0 leaves region 0, block 2 comes back from the host into it
    assert _regions(cache) == [[*range(16, 24)], [-1] * 5 + [29, 30, 31], pad, [32]]
    real = cache.positions[0] >= 0
    assert torch.equal(cache.keys[0][0, :, :, 0][real], cache.positions[0][real].float())  # each entry's own key
    assert torch.equal(cache.values[0][0, :, :, 0][real], -cache.positions[0][real].float())
    assert cache.kept_tokens(0).tolist() == [12, 12]


def test_a_swap_on_a_static_copy_writes_what_it_writes_on_the_cache_it_was_laid_out_in():
    """The decode over a ``StaticKVCache`` swaps the copy's regions, slot for slot as a twin swaps the
    dynamic cache's, only padding after them; the prefill's cache it was copied from stays as it was."""
    prefill, mirror = _block_cache(), _block_cache()
    swap, twin = (BlockSwap(cache, 0, block_size=8, prompt_length=32, gamma=0.9) for cache in (prefill, mirror))
    swap.offload_inactive({0, 3}, prefill)
    twin.offload_inactive({0, 3}, mirror)
    static, laid_out = StaticKVCache(prefill, 4), prefill.positions[0].clone()
    for candidate in ({0, 1}, {2, 3}, {0, 3}):
        assert swap.swap(candidate, static) == twin.swap(candidate, mirror)
        assert torch.equal(static.positions[0][:, :32], mirror.positions[0])
        assert torch.equal(static.keys[0][:, :, :32], mirror.keys[0])
        assert torch.equal(static.values[0][:, :, :32], mirror.values[0])
        assert (static.positions[0][:, 32:] == -1).all()
    assert torch.equal(prefill.positions[0], laid_out)


def test_one_kv_head_with_generated_tokens_before_the_swap_keeps_exactly_the_active_blocks():
    """Built on a cache that already holds generated tokens (position 32 is the first past a 32-token
    prompt), with one KV head: the generated tokens belong to no block and stay through every swap,
    and the device holds exactly the active blocks' entries, with their own keys and values."""
    cache = _block_cache(kv_heads=1)
    for position in (32, 33):
        cache.begin_step(torch.tensor([position]))
        cache.update(torch.full((1, 1, 1, 4), float(position)), torch.full((1, 1, 1, 4), -float(position)), 0)
    swap = BlockSwap(cache, 0, block_size=8, prompt_length=32, gamma=0.9)
    assert swap.active == {0, 1, 2, 3}
    swap.offload_inactive({1, 3}, cache)
    for candidate, active in (({1, 3}, {1, 3}), ({0, 1}, {0, 1}), ({2, 3}, {2, 3}), ({0, 3}, {0, 3})):
        swap.swap(candidate, cache)
        assert swap.active == active
        entries = cache.positions[0][0]
        real = entries >= 0
        wanted = sorted([p for block in active for p in range(8 * block, 8 * block + 8)] + [32, 33])
        assert sorted(entries[real].tolist()) == wanted
        assert torch.equal(cache.keys[0][0, 0, real, 0], entries[real].float())  # each entry's own key
        assert torch.equal(cache.values[0][0, 0, real, 0], -entries[real].float())
