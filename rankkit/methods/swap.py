"""SlimInfer's overlap-aware KV swapping (SlimInfer Sec. 4.3, Alg. 1) for one layer's cache.

The layer's prompt tokens are grouped into blocks of ``block_size`` original positions.
The device tier is the layer's ``KVCache`` entries: the active blocks plus every
generated token (generated tokens are never swapped). The host tier holds a copy of
every block that was ever offloaded (B_Memory). ``swap(candidate)`` applies Algorithm 1:

    overlap = |B_candidate ∩ B_active| / |B_candidate|
    if overlap < γ:   B_offload = (B_active \\ B_candidate) \\ B_Memory   -> copied to the host
                      B_load    = B_candidate \\ B_active                 -> copied back to the device
                      B_active  = B_candidate (blocks already in B_Memory are simply dropped)
    else:             nothing moves

On CPU the two tiers are two pools of ordinary tensors, so the decisions are exercised and
tested without a GPU. On CUDA the host pool is pinned memory and the copies run on a side
stream; the compute stream waits for them before the layer's cache is next used.
Entry order inside the device cache does not matter: attention masks come from positions.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from rankkit.cache import KVCache


@dataclass
class HostBlock:
    keys: torch.Tensor  # [1, kv_heads, n, head_dim]
    values: torch.Tensor
    positions: torch.Tensor  # [kv_heads, n]


@dataclass
class SwapDecision:
    overlap: float
    swapped: bool
    offloaded: set[int] = field(default_factory=set)  # blocks copied to the host
    loaded: set[int] = field(default_factory=set)  # blocks copied back to the device
    released: set[int] = field(default_factory=set)  # blocks dropped from the device, already on the host


class BlockSwap:
    """Algorithm 1 for the cache of one ``layer`` (see the module docstring)."""

    def __init__(self, cache: KVCache, layer: int, *, block_size: int, prompt_length: int, gamma: float):
        self.cache = cache
        self.layer = layer
        self.block_size = block_size
        self.prompt_length = prompt_length
        self.gamma = gamma
        self.host: dict[int, HostBlock] = {}
        device = cache.keys[layer].device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.active = self.blocks_on_device()

    def blocks_on_device(self) -> set[int]:
        positions = self.cache.positions[self.layer][0]
        return {
            int(block) for block in torch.unique(positions[positions < self.prompt_length] // self.block_size)
        }

    def _block_of_entries(self) -> torch.Tensor:
        """Block id of every device entry [S]; -1 for generated tokens (shared across heads: blocks are whole)."""
        positions = self.cache.positions[self.layer][0]
        return torch.where(
            positions < self.prompt_length, positions // self.block_size, torch.full_like(positions, -1)
        )

    def swap(self, candidate: set[int]) -> SwapDecision:
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
        self._offload(decision.offloaded)
        self._drop(leaving)
        self._load(decision.loaded)
        self.active = set(candidate)
        return decision

    def offload_inactive(self, active: set[int]) -> None:
        """Prefill's pruning: move every device block outside ``active`` to the host."""
        leaving = self.active - active
        self._offload(leaving - self.host.keys())
        self._drop(leaving)
        self.active = set(active)

    def _offload(self, blocks: set[int]) -> None:
        if not blocks:
            return
        keys, values = self.cache.keys[self.layer], self.cache.values[self.layer]
        positions = self.cache.positions[self.layer]
        block_of = self._block_of_entries()
        with torch.cuda.stream(self.stream) if self.cuda else nullcontext():
            if self.cuda:
                self.stream.wait_stream(torch.cuda.current_stream())
            for block in blocks:
                index = torch.nonzero(block_of == block).flatten()
                self.host[block] = HostBlock(
                    _to_host(keys[:, :, index], self.cuda),
                    _to_host(values[:, :, index], self.cuda),
                    _to_host(positions[:, index], self.cuda),
                )

    def _drop(self, blocks: set[int]) -> None:
        if not blocks:
            return
        keep = torch.nonzero(~torch.isin(self._block_of_entries(), self._entries_ids(blocks))).flatten()
        if self.cuda:  # the offload copies read these entries: let them finish before the storage goes
            torch.cuda.current_stream().wait_stream(self.stream)
        self.cache.compress(self.layer, keep.expand(self.cache.keys[self.layer].shape[1], -1))

    def _entries_ids(self, blocks: set[int]) -> torch.Tensor:
        device = self.cache.positions[self.layer].device
        return torch.tensor(sorted(blocks), dtype=torch.long, device=device)

    def _load(self, blocks: set[int]) -> None:
        if not blocks:
            return
        device = self.cache.keys[self.layer].device
        with torch.cuda.stream(self.stream) if self.cuda else nullcontext():
            pieces = [self.host[block] for block in sorted(blocks)]
            keys = torch.cat([piece.keys.to(device, non_blocking=True) for piece in pieces], dim=2)
            values = torch.cat([piece.values.to(device, non_blocking=True) for piece in pieces], dim=2)
            positions = torch.cat([piece.positions.to(device, non_blocking=True) for piece in pieces], dim=1)
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.stream)
        cache, layer = self.cache, self.layer
        cache.keys[layer] = torch.cat([cache.keys[layer], keys], dim=2)
        cache.values[layer] = torch.cat([cache.values[layer], values], dim=2)
        cache.positions[layer] = torch.cat([cache.positions[layer], positions], dim=1)

    def host_bytes(self) -> int:
        return sum(block.keys.nbytes + block.values.nbytes for block in self.host.values())


def _to_host(tensor: torch.Tensor, pinned: bool) -> torch.Tensor:
    if not pinned:
        return tensor.clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
