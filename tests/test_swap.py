"""SlimInfer Alg. 1's decisions (the overlap it reports, the empty candidate), the host pool's size,
and the CUDA stream protocol of a load, with stand-in streams so it runs on any machine."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from test_methods import _block_cache

from rankkit.methods.swap import BlockSwap, SwapDecision


def blocks(gamma: float) -> BlockSwap:
    """Four blocks of 8 positions over two KV heads of width 4, blocks 1 and 2 on the host."""
    swap = BlockSwap(_block_cache(), 0, block_size=8, prompt_length=32, gamma=gamma)
    swap.offload_inactive({0, 3})
    return swap


def test_a_decision_reports_the_overlap_it_compared_with_gamma():
    swap = blocks(gamma=0.5)
    assert swap.swap(set()) == SwapDecision(1.0, swapped=False)  # no candidate: nothing to fetch
    assert swap.swap({0, 1}) == SwapDecision(0.5, swapped=False)  # 0.5 is not below 0.5
    assert swap.swap({0, 1, 2, 3}) == SwapDecision(0.5, swapped=False)
    decision = swap.swap({1, 2, 3})  # one of three active
    assert decision == SwapDecision(1 / 3, swapped=True, offloaded={0}, loaded={1, 2}, released=set())


def test_host_bytes_counts_the_keys_and_values_of_every_offloaded_block():
    swap = blocks(gamma=0.5)
    assert swap.host_bytes() == 2 * 2 * (2 * 8 * 4 * 4)  # blocks 1 and 2: keys and values, float32
    swap.swap({1, 2})  # 0 and 3 join the host pool
    assert swap.host_bytes() == 4 * 2 * (2 * 8 * 4 * 4)


class Stream:
    def __init__(self):
        self.waited = []

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        self.waited.append(event)


class Event:
    stream = None

    def record(self, stream):
        self.stream = stream


def test_a_load_on_cuda_hands_its_tensors_to_the_compute_stream_after_the_side_streams_copy(monkeypatch):
    swap = blocks(gamma=0.9)
    swap.swap({0, 1})  # block 3 to the host too (on the CPU: offloading pins memory on CUDA only)
    side, compute, marked = Stream(), Stream(), []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: compute)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: marked.append((tensor, stream)))
    swap.cuda, swap.stream = True, side
    assert swap.swap({0, 3}).loaded == {3}  # block 1 is released, block 3 loaded from the host
    cache = swap.cache
    # the side stream read the old entries; the compute stream owns the new ones
    assert [stream for _, stream in marked] == [side] * 3 + [compute] * 3
    assert all(tensor is new for (tensor, _), new in zip(marked[3:], (cache.keys[0], cache.values[0],
                                                                     cache.positions[0]), strict=True))  # fmt: skip
    # the layer's next update waits on the compute stream for the copy the side stream made
    cache.begin_step(torch.tensor([32]))
    cache.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), 0)
    assert len(compute.waited) == 1 and compute.waited[0].stream is side
    assert sorted(cache.positions[0][0].tolist()) == [*range(8), *range(24, 33)]


def test_one_kv_head_with_generated_tokens_before_the_swap_keeps_exactly_the_active_blocks():
    """Built on a cache that already holds generated tokens (position 32 is the first past a 32-token
    prompt), with one KV head: the generated tokens belong to no block and stay through every swap,
    and the device holds exactly the active blocks' entries, with their own keys and values."""
    cache = _block_cache(kv_heads=1)
    for position in (32, 33):
        cache.begin_step(torch.tensor([position]))
        cache.update(torch.full((1, 1, 1, 4), float(position)), torch.full((1, 1, 1, 4), -float(position)), 0)
    swap = BlockSwap(cache, 0, block_size=8, prompt_length=32, gamma=0.9)
    assert swap.blocks_on_device() == {0, 1, 2, 3}
    swap.offload_inactive({1, 3})
    for candidate, active in (({1, 3}, {1, 3}), ({0, 1}, {0, 1}), ({2, 3}, {2, 3}), ({0, 3}, {0, 3})):
        swap.swap(candidate)
        assert swap.blocks_on_device() == active
        positions = sorted(cache.positions[0][0].tolist())
        wanted = sorted([p for block in active for p in range(8 * block, 8 * block + 8)] + [32, 33])
        assert positions == wanted
        entries = cache.positions[0][0]
        assert torch.equal(cache.keys[0][0, 0, :, 0], entries.float())  # each entry's own key
        assert torch.equal(cache.values[0][0, 0, :, 0], -entries.float())
