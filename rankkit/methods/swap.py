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

On CPU the two tiers are two pools of ordinary tensors and every copy is synchronous, so
the decisions are exercised and tested without a GPU. On CUDA the host pool is pinned
memory and every copy runs on a side stream: the side stream first waits for the compute
work that wrote the entries, the compute stream waits (through an event the cache holds)
only when the layer's cache is next updated, so a fetch decided after one layer's
attention overlaps the compute up to the next layer that reads it (SlimInfer Sec. 3.2).
Tensors crossing streams are marked with ``record_stream`` so the allocator never reuses
their memory while the other stream still reads it.
Entry order inside the device cache does not matter: attention masks come from positions.

The host knows which block every device entry belongs to (``layout``: the caller hands the
entries' positions over, generated tokens are appended as the cache grows and loaded blocks as
they are copied in), so no decision and no copy reads the device: a block's entries are cut
from one stable sort of the entries by block, at offsets the host counts.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from rankkit.cache import KVCache

GENERATED = -1  # the block of a generated token: never swapped


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
        """``positions``: the original positions of the layer's cache entries, in entry order, as the
        host knows them (None: read once from the cache)."""
        self.cache = cache
        self.layer = layer
        self.block_size = block_size
        self.prompt_length = prompt_length
        self.gamma = gamma
        self.host: dict[int, HostBlock] = {}
        device = cache.keys[layer].device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        if positions is None:
            positions = cache.positions[layer][0].cpu().numpy()
        # the block of each entry, as the host knows it
        self.layout = np.where(positions < prompt_length, positions // block_size, GENERATED)
        self.active = self.blocks_on_device()

    def _layout(self) -> np.ndarray:
        """Each device entry's block (GENERATED: a token generated since, appended to the cache)."""
        grown = self.cache.positions[self.layer].shape[1] - self.layout.shape[0]
        if grown:  # the layout is read several times per decode step: copy it only when the cache grew
            self.layout = np.concatenate([self.layout, np.full(grown, GENERATED)])
        return self.layout

    def blocks_on_device(self) -> set[int]:
        layout = self._layout()
        return {int(block) for block in np.unique(layout[layout >= 0])}

    def _block_of_entries(self) -> torch.Tensor:
        """Block id of every device entry [S], GENERATED for generated tokens (head 0's: blocks are whole,
        so every KV head holds the same positions)."""
        positions = self.cache.positions[self.layer][0]
        return torch.where(positions < self.prompt_length, positions // self.block_size, GENERATED)

    def _entries_by_block(self) -> dict[int, torch.Tensor]:
        """Every device block's entries, ascending: slices of one stable sort of the entries by block,
        where the host's ``layout`` says each block's run starts and ends; made once for a swap's
        offload and drop."""
        by_block = torch.sort(self._block_of_entries(), stable=True).indices
        blocks, counts = np.unique(self._layout(), return_counts=True)
        ends = np.cumsum(counts)
        return {
            int(block): by_block[int(end - count) : int(end)]
            for block, count, end in zip(blocks, counts, ends, strict=True)
        }

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
        entries = self._entries_by_block() if leaving else {}
        self._offload(decision.offloaded, entries)
        self._drop(leaving, entries)
        self._load(decision.loaded)
        self.active = set(candidate)
        return decision

    def offload_inactive(self, active: set[int]) -> None:
        """Prefill's pruning: move every device block outside ``active`` to the host."""
        leaving = self.active - active
        entries = self._entries_by_block() if leaving else {}
        self._offload(leaving - self.host.keys(), entries)
        self._drop(leaving, entries)
        self.active = set(active)

    def pool(self) -> set[int]:
        """Every block this layer holds, on the device or the host."""
        return self.active | self.host.keys()

    def _side_stream(self):
        if not self.cuda:
            return nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(self.stream)

    def _offload(self, blocks: set[int], entries: dict[int, torch.Tensor]) -> None:
        if not blocks:
            return
        keys, values = self.cache.keys[self.layer], self.cache.values[self.layer]
        positions = self.cache.positions[self.layer]
        with self._side_stream():
            for block in sorted(blocks):
                index = entries[block]
                self.host[block] = HostBlock(
                    _to_host(keys[:, :, index], self.cuda),
                    _to_host(values[:, :, index], self.cuda),
                    _to_host(positions[:, index], self.cuda),
                )
        self._read_on_side_stream(keys, values, positions)

    def _drop(self, blocks: set[int], entries: dict[int, torch.Tensor]) -> None:
        if not blocks:
            return
        layout = self._layout()
        staying = [index for block, index in entries.items() if block not in blocks]
        device = self.cache.positions[self.layer].device
        # each block's entries ascend, but a block fetched back lies after later ones
        keep = torch.cat(staying).sort().values if staying else torch.zeros(0, dtype=torch.long, device=device)
        self.cache.compress(self.layer, keep.expand(self.cache.keys[self.layer].shape[1], -1))
        self.layout = layout[~np.isin(layout, sorted(blocks))]

    def _load(self, blocks: set[int]) -> None:
        if not blocks:
            return
        cache, layer = self.cache, self.layer
        device = cache.keys[layer].device
        layout = self._layout()
        pieces = [self.host[block] for block in sorted(blocks)]
        current = (cache.keys[layer], cache.values[layer], cache.positions[layer])
        with self._side_stream():
            keys = torch.cat([current[0], *(_to_device(piece.keys, device=device) for piece in pieces)], 2)
            values = torch.cat(
                [current[1], *(_to_device(piece.values, device=device) for piece in pieces)], 2
            )
            positions = torch.cat(
                [current[2], *(_to_device(piece.positions, device=device) for piece in pieces)], 1
            )
        cache.keys[layer], cache.values[layer], cache.positions[layer] = keys, values, positions
        loaded = [np.full(self.host[block].positions.shape[1], block) for block in sorted(blocks)]
        self.layout = np.concatenate([layout, *loaded])
        if self.cuda:
            self._read_on_side_stream(*current)
            compute = torch.cuda.current_stream()
            for tensor in (keys, values, positions):
                tensor.record_stream(compute)
            loaded = torch.cuda.Event()
            loaded.record(self.stream)
            cache.wait_before_update(layer, loaded)

    def _read_on_side_stream(self, *tensors: torch.Tensor) -> None:
        """The side stream reads ``tensors``: their memory must outlive its copies, not just the Python names."""
        if self.cuda:
            for tensor in tensors:
                tensor.record_stream(self.stream)

    def host_bytes(self) -> int:
        return sum(block.keys.nbytes + block.values.nbytes for block in self.host.values())


def _to_device(tensor: torch.Tensor, *, device: torch.device) -> torch.Tensor:
    """A host block's tensor copied back; from pinned memory the copy is asynchronous (on CUDA)."""
    return tensor.to(device=device, non_blocking=True)


def _to_host(tensor: torch.Tensor, pinned: bool) -> torch.Tensor:
    if not pinned:
        return tensor.clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
