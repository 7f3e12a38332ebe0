"""SlimInfer: block scores from fine-grained token units of the keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from rankkit.errors import RankkitError
from rankkit.runner import AttentionCall

from .attention import check_window_size, window_length
from .base import Probe, register

HEAD_MEANS = ("all", "group")


@register
@dataclass
class TokenUnitsProbe(Probe):
    """SlimInfer block importance, Eq. 1-2, reported for every token of the block.

    The keys are cut, from the first, into blocks of ``block_size`` and each block into
    token units of ``unit_size`` consecutive tokens (the last block and unit may be
    shorter and average only the tokens they have). For block j and KV head g::

        k_rep^g(j, m)   = mean of the keys of unit m of block j                     (Eq. 1)
        q_l^h           = mean of the last ``window_size`` queries of head h
        r(j)            = max_m mean_{h in heads} q_l^h . k_rep^{g(h)}(j, m)         (Eq. 2)
        score[g, i]     = r(block of token i)

    The dot product is unscaled, as in Eq. 2. ``head_mean="all"`` averages over all H
    query heads as Eq. 2 does, so every KV-head row holds the same paper score;
    ``"group"`` averages only over the query heads of KV head g (a per-head variant).
    The window is all queries when fewer than ``window_size`` arrive. Defaults are the
    paper's: blocks of 64, units of 8, a query window of 4.
    """

    name: ClassVar[str] = "token_units"
    block_size: int = 64
    unit_size: int = 8
    window_size: int = 4
    head_mean: str = "all"

    def __post_init__(self) -> None:
        check_window_size(self.window_size)
        if self.unit_size < 1 or self.block_size % self.unit_size != 0:
            raise RankkitError(
                f"block_size ({self.block_size}) must be a positive multiple of unit_size ({self.unit_size})"
            )
        if self.head_mean not in HEAD_MEANS:
            raise RankkitError(f"head_mean must be one of {', '.join(HEAD_MEANS)}, not {self.head_mean!r}")

    def score(self, call: AttentionCall) -> torch.Tensor:
        positions = call.key_positions[0]
        layout = call.per_step(
            "token_units",
            (positions,),
            (self.unit_size, self.block_size),
            lambda: UnitLayout.of(positions, self.unit_size, self.block_size),
        )
        window = window_length(call, self.window_size)
        mean_query = call.query[0, :, -window:].float().mean(dim=1)
        means = layout.slots.mean_keys(call.key[0].float())
        best = layout.blocks.maxima(unit_similarity(mean_query, means, self.head_mean))
        return best[:, layout.block_of_key]


def run_index(values: torch.Tensor) -> torch.Tensor:
    """Each entry's run of equal values in ascending ``values`` [S], numbered from 0: a compact
    index made on the device, where ``torch.unique`` would read its size back (keys stay in
    position order, so units and blocks are runs)."""
    starts = torch.ones_like(values, dtype=torch.bool)
    starts[1:] = values[1:] != values[:-1]
    return torch.cumsum(starts, 0) - 1


@dataclass(frozen=True)
class UnitSlots:
    """SlimInfer Eq. 1's token units of keys at ``positions`` [S] (ascending): runs of ``unit_size``
    original positions, so they stay whole after pruning, and there are as many slots as keys, so
    no size is read from the device."""

    unit_of_key: torch.Tensor  # [S] each key's unit slot
    unit_ids: torch.Tensor  # [S] the units present, in position order, then -1 for spare slots
    keys_per_unit: torch.Tensor  # [S] float, at least 1 (a spare slot averages nothing)

    @classmethod
    def of(cls, positions: torch.Tensor, unit_size: int) -> UnitSlots:
        units = positions // unit_size
        unit_of_key = run_index(units)
        slots = units.numel()
        counts = torch.zeros(slots, device=positions.device).index_add_(
            0, unit_of_key, torch.ones(slots, device=positions.device)
        )
        ids = torch.full_like(units, -1).scatter_(0, unit_of_key, units)
        return cls(unit_of_key, ids, counts.clamp(min=1))

    def mean_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """SlimInfer Eq. 1: the mean key of every unit slot [kv_heads, S, d] of float32 ``keys``
        [kv_heads, S, d]; a unit cut short (the last, or a pruned run) averages what it has."""
        sums = keys.new_zeros(keys.shape).index_add_(1, self.unit_of_key, keys)
        return sums / self.keys_per_unit[None, :, None]


def unit_similarity(query: torch.Tensor, means: torch.Tensor, head_mean: str = "all") -> torch.Tensor:
    """SlimInfer Eq. 2's inner term: q_l . k_rep per unit, averaged over query heads, [kv_heads, units].

    ``query`` is q_l, the mean window query of each query head [q_heads, d]; query head h reads
    KV head h // group. ``"all"`` averages over every query head as Eq. 2 does (the same row for
    every KV head), ``"group"`` over the query heads of each KV head.
    """
    kv_heads = means.shape[0]
    grouped = query.view(kv_heads, -1, query.shape[-1])
    similarity = torch.bmm(grouped, means.transpose(1, 2))  # [kv_heads, group, units]
    if head_mean == "all":
        return similarity.mean(dim=(0, 1)).expand(kv_heads, -1)
    return similarity.mean(dim=1)


@dataclass(frozen=True)
class UnitBlocks:
    """Where each unit slot of ``UnitSlots`` falls among the blocks: what Eq. 2's max over a block's
    units needs besides the similarities, fixed for as long as the unit keys are (a SlimInfer
    pruning layer's whole decode)."""

    blocks: torch.Tensor  # [units] the blocks that hold a unit, ascending, then -1 for spare slots
    block_of_unit: torch.Tensor  # [units] each unit slot's place in ``blocks``
    spare: torch.Tensor  # [units] the spare slots

    @classmethod
    def of(cls, unit_ids: torch.Tensor, unit_size: int, block_size: int) -> UnitBlocks:
        """``unit_ids`` are ``UnitSlots.unit_ids`` (spare slots -1)."""
        spare = unit_ids < 0
        block_ids = torch.where(spare, -1, unit_ids * unit_size // block_size)
        # the spare slots trail the units, so they form the last run, which no key reads
        block_of_unit = run_index(torch.where(spare, block_ids.max() + 1, block_ids))
        blocks = torch.full_like(unit_ids, -1).scatter_(0, block_of_unit, block_ids)
        return cls(blocks, block_of_unit, spare)

    def maxima(self, similarity: torch.Tensor) -> torch.Tensor:
        """SlimInfer Eq. 2: each block's score [kv_heads, units], the max over its units' ``similarity``
        [kv_heads, units] (-inf at spares)."""
        best = similarity.new_full(similarity.shape, float("-inf"))
        index = self.block_of_unit.expand(similarity.shape[0], -1)
        return best.scatter_reduce(1, index, similarity.masked_fill(self.spare, float("-inf")), reduce="amax")


@dataclass(frozen=True)
class UnitLayout:
    """The units, the blocks Eq. 2 groups them into and each key's block: everything the probe needs
    besides the keys and queries, a function of the positions alone, so the layers of a step that
    read the same positions share it (``AttentionCall.per_step``)."""

    slots: UnitSlots
    blocks: UnitBlocks
    block_of_key: torch.Tensor  # [S] each key's block, numbered as ``blocks`` places them

    @classmethod
    def of(cls, positions: torch.Tensor, unit_size: int, block_size: int) -> UnitLayout:
        slots = UnitSlots.of(positions, unit_size)
        blocks = UnitBlocks.of(slots.unit_ids, unit_size, block_size)
        return cls(slots, blocks, run_index(positions // block_size))
