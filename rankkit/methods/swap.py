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

The layer's cache is laid out in regions of ``block_size`` slots, one per block the layer
holds after its prefill, a block's entry at its position's offset in the block (a slot no
entry takes is padding), and the generated tokens after them. A block leaves its region as
padding and a loaded block takes a free one, so a swap writes slices at offsets the host
knows: no shape changes, nothing is read from the device, and the same swap acts on the
prefill's cache or on a ``StaticKVCache`` copied from it, which a CUDA graph decodes over.
Since Alg. 1 decides on the host, the host has just waited for the device when a swap begins,
and the first layer that reads a loaded block is the next one: the copies run on the compute
stream, from page-locked memory on CUDA, in the order the step needs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from rankkit.cache import KVCache


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


class BlockSwap:
    """Algorithm 1 for the cache of one ``layer`` (see the module docstring)."""

    def __init__(
        self,
        cache: KVCache,
        layer: int,
        *,
        block_size: int,
        prompt_length: int,
        gamma: float,
        positions: np.ndarray | None = None,
    ):
        """Lays ``cache``'s entries of ``layer`` out in regions. ``positions``: their original positions,
        in entry order, as the host knows them (None: read once from the cache)."""
        self.layer = layer
        self.block_size = block_size
        self.gamma = gamma
        self.host: dict[int, HostBlock] = {}
        if positions is None:
            positions = cache.positions[layer][0].cpu().numpy()
        prompt = positions < prompt_length
        held = np.unique(positions[prompt] // block_size)
        self.regions = {int(block): region for region, block in enumerate(held)}  # the blocks on the device
        self.free: list[int] = []  # regions no block holds
        regions_end = held.shape[0] * block_size  # generated tokens follow, in the order they came
        region_of = np.searchsorted(held, positions // block_size)
        slots = np.where(
            prompt, region_of * block_size + positions % block_size, regions_end + positions - prompt_length
        )
        device = cache.keys[layer].device
        self.pinned = device.type == "cuda"
        size = regions_end + int((~prompt).sum())
        cache.rearrange(layer, _to_device(torch.from_numpy(slots), device, self.pinned), size)

    @property
    def active(self) -> set[int]:
        """B_active: the blocks on the device."""
        return set(self.regions)

    def swap(self, candidate: set[int], cache: KVCache) -> SwapDecision:
        """Alg. 1 with ``candidate`` on this layer of ``cache`` (the one it was laid out in, or a copy of it)."""
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
        self._offload(decision.offloaded, cache)
        self._drop(leaving, cache)
        self._load(decision.loaded, cache)
        return decision

    def offload_inactive(self, active: set[int], cache: KVCache) -> None:
        """Prefill's pruning: move every device block outside ``active`` to the host."""
        leaving = self.active - active
        self._offload(leaving - self.host.keys(), cache)
        self._drop(leaving, cache)

    def pool(self) -> set[int]:
        """Every block this layer holds, on the device or the host."""
        return self.active | self.host.keys()

    def _region(self, block: int) -> tuple[int, int]:
        return self.regions[block] * self.block_size, self.block_size

    def _offload(self, blocks: set[int], cache: KVCache) -> None:
        keys, values, positions = cache.keys[self.layer], cache.values[self.layer], cache.positions[self.layer]
        for block in sorted(blocks):
            start, size = self._region(block)
            self.host[block] = HostBlock(
                *(_to_host(tensor.narrow(dim, start, size), self.pinned) for tensor, dim in ((keys, 2), (values, 2), (positions, 1)))
            )

    def _drop(self, blocks: set[int], cache: KVCache) -> None:
        for block in sorted(blocks):
            cache.clear(self.layer, *self._region(block))
            self.free.append(self.regions.pop(block))

    def _load(self, blocks: set[int], cache: KVCache) -> None:
        self.free.sort()
        for block in sorted(blocks):
            self.regions[block] = self.free.pop(0)
            piece = self.host[block]
            device = cache.keys[self.layer].device
            cache.write(
                self.layer,
                self._region(block)[0],
                *(_to_device(tensor, device, self.pinned) for tensor in (piece.keys, piece.values, piece.positions)),
            )

    def host_bytes(self) -> int:
        return sum(block.nbytes for block in self.host.values())


def _to_device(tensor: torch.Tensor, device: torch.device, pinned: bool) -> torch.Tensor:
    """``tensor`` (host memory) on ``device``; from page-locked memory on CUDA the copy is asynchronous."""
    if pinned and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=pinned)


def _to_host(tensor: torch.Tensor, pinned: bool) -> torch.Tensor:
    if not pinned:
        return tensor.clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
