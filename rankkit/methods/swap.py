"""SlimInfer's overlap-aware KV swapping (SlimInfer Sec. 4.3, Alg. 1) for one layer's cache.

The layer's prompt tokens are grouped into blocks of ``block_size`` original positions.
The device tier is the layer's ``KVCache`` entries: the active blocks plus every
generated token (generated tokens are never swapped). The host tier holds a copy of
every block that was ever offloaded (B_Memory). ``swap(candidate, cache)`` applies Algorithm 1:

    overlap = |B_candidate ∩ B_active| / |B_candidate|
    if overlap < γ:   B_offload = (B_active \\ B_candidate) \\ B_Memory   -> copied to the host
                      B_load    = B_candidate \\ B_active                 -> copied back to the device
                      B_active  = B_candidate (blocks already in B_Memory are simply dropped)
    else:             nothing moves

The layer's cache is laid out in regions of ``block_size`` slots, one per block of B_active
after the prefill (Alg. 1 never makes B_active larger), a block's entry at its position's
offset in the block (a slot no entry takes is padding), and the generated tokens after them.
A block leaves its region as padding and a loaded block takes a free one, so a swap writes
slices at offsets the host knows: no shape changes, nothing is read from the device, and the
same swap acts on the prefill's cache or on a ``StaticKVCache`` copied from it, which a CUDA
graph decodes over. The host knows which regions hold padding: a layer without any decodes
with no mask, as an unpadded cache does.
Since Alg. 1 decides on the host, the host has just waited for the device when a swap begins,
and the first layer that reads a loaded block is the next one: the copies run on the compute
stream, from page-locked memory on CUDA, in the order the step needs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from rankkit.cache import KVCache, to_device


@dataclass
class HostBlock:
    keys: torch.Tensor  # [1, kv_heads, block_size, head_dim], the block's region
    values: torch.Tensor
    positions: torch.Tensor  # [kv_heads, block_size], -1 where the region held no entry

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


@dataclass
class SwapDecision:
    overlap: float
    swapped: bool
    offloaded: set[int] = field(default_factory=set)  # blocks copied to the host
    loaded: set[int] = field(default_factory=set)  # blocks copied back to the device
    released: set[int] = field(default_factory=set)  # blocks dropped from the device, already on the host


@dataclass(eq=False)  # its slots are an array, which == does not reduce to a bool
class BlockLayout:
    """Where a layer's entries go: a region of ``block_size`` slots per block of B_active after the
    prefill, each entry at its position's offset in its block, then the generated tokens, then the
    leaving blocks' regions (cut off once they are on the host). It is a function of the entries'
    positions alone, so the layers one pruning layer governs, whose caches hold the same positions,
    share one, and its slots are copied to a device once for all of them."""

    block_size: int
    sizes: dict[int, int]  # each block's real entries
    starts: dict[int, int]  # B_active's regions: each block's first slot
    leaving_starts: dict[int, int]  # the other blocks' regions, past the kept slots
    kept: int  # the slots that stay on the device
    slots: np.ndarray  # [S]: each entry's slot, in entry order
    _on_device: dict[torch.device, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, positions: np.ndarray, *, block_size: int, prompt_length: int, active: set[int]) -> BlockLayout:
        """The layout of a layer whose entries hold ``positions`` (original positions, in entry order)."""
        prompt = positions < prompt_length
        prompt_blocks = positions[prompt] // block_size
        blocks, counts = np.unique(prompt_blocks, return_counts=True)
        sizes = dict(zip(blocks.tolist(), counts.tolist(), strict=True))
        staying = sorted(active & sizes.keys())
        leaving = sorted(sizes.keys() - active)
        # the staying blocks' regions, the generated tokens in the order they came, the leaving blocks'
        generated = len(staying) * block_size
        kept = generated + int((~prompt).sum())
        starts = {block: index * block_size for index, block in enumerate(staying)}
        leaving_starts = {block: kept + index * block_size for index, block in enumerate(leaving)}
        first_slot = starts | leaving_starts
        first_slots = np.array([first_slot[block] for block in sizes])  # in ``blocks``' order
        slots = generated + positions - prompt_length
        slots[prompt] = first_slots[np.searchsorted(blocks, prompt_blocks)] + positions[prompt] % block_size
        return cls(block_size, sizes, starts, leaving_starts, kept, slots)

    def slots_on(self, device: torch.device) -> torch.Tensor:
        """The slots on ``device``, copied there once for every layer laid out on it."""
        if device not in self._on_device:
            self._on_device[device] = to_device(torch.from_numpy(self.slots), device)
        return self._on_device[device]


class BlockSwap:
    """Algorithm 1 for the cache of one ``layer`` (see the module docstring)."""

    def __init__(self, cache: KVCache, layer: int, layout: BlockLayout, *, gamma: float):
        """Lays ``cache``'s entries of ``layer`` out as ``layout`` says and moves the blocks that leave
        B_active to the host."""
        self.layer = layer
        self.layout = layout
        self.gamma = gamma
        self.host: dict[int, HostBlock] = {}
        self.starts = dict(layout.starts)  # a swap moves blocks between regions
        device = cache.keys[layer].device
        self.pinned = device.type == "cuda"
        size = layout.kept + len(layout.leaving_starts) * layout.block_size
        cache.rearrange(layer, layout.slots_on(device), size)
        self.free: list[int] = []  # starts of the regions no block holds
        self._offload(layout.leaving_starts, cache)
        cache.truncate(layer, layout.kept)
        self._declare_padding(cache)

    @property
    def active(self) -> set[int]:
        """B_active: the blocks on the device."""
        return set(self.starts)

    def swap(self, candidate: set[int], cache: KVCache) -> SwapDecision:
        """Alg. 1 with ``candidate`` on this layer of ``cache`` (the one it was laid out in, or a copy of it)."""
        if len(candidate) > len(self.starts) + len(self.free):
            raise ValueError(f"a candidate of {len(candidate)} blocks, where layer {self.layer} has room for {len(self.starts) + len(self.free)}")
        overlap = len(candidate & self.active) / len(candidate) if candidate else 1.0
        if overlap >= self.gamma:
            return SwapDecision(overlap, swapped=False)
        leaving = self.active - candidate
        decision = SwapDecision(
            overlap,
            swapped=True,
            offloaded=leaving - self.host.keys(),
            loaded=candidate - self.active,
            released=leaving & self.host.keys(),
        )
        self._offload({block: self.starts[block] for block in decision.offloaded}, cache)
        for block in sorted(leaving):
            start = self.starts.pop(block)
            cache.clear(self.layer, start, self.layout.block_size)
            self.free.append(start)
        self.free.sort()
        for block in sorted(decision.loaded):
            self.starts[block] = self.free.pop(0)
            piece = self.host[block]
            cache.write(self.layer, self.starts[block], piece.keys, piece.values, piece.positions)
        self._declare_padding(cache)
        return decision

    def pool(self) -> set[int]:
        """Every block this layer holds, on the device or the host."""
        return self.active | self.host.keys()

    def _offload(self, starts: dict[int, int], cache: KVCache) -> None:
        """Copy the regions of the blocks of ``starts`` (block -> its region's first slot) to the host."""
        keys, values, positions = cache.keys[self.layer], cache.values[self.layer], cache.positions[self.layer]
        for block, start in sorted(starts.items()):
            self.host[block] = HostBlock(
                *(
                    _to_host(tensor.narrow(dim, start, self.layout.block_size), self.pinned)
                    for tensor, dim in ((keys, 2), (values, 2), (positions, 1))
                )
            )

    def _declare_padding(self, cache: KVCache) -> None:
        """A free region or a block with fewer entries than its region is padding, which a step then masks."""
        partial = any(self.layout.sizes[block] < self.layout.block_size for block in self.starts)
        cache.declare_padding(self.layer, bool(self.free) or partial)

    def host_bytes(self) -> int:
        return sum(block.nbytes for block in self.host.values())


def _to_host(tensor: torch.Tensor, pinned: bool) -> torch.Tensor:
    """A copy of ``tensor`` in host memory; on CUDA page-locked and not waited for (``models.to_host``
    waits), since only later copies on the same stream read it."""
    if not pinned:
        return tensor.clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
