"""SlimInfer: block scores from fine-grained token units of the keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

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
        kv_heads, keys_length = call.key.shape[1], call.key.shape[2]
        unit_keys = unit_means(call.key[0].float(), self.unit_size)
        window = window_length(call, self.window_size)
        mean_queries = call.query[0, :, -window:].float().mean(dim=1).view(kv_heads, call.group_size, -1)
        similarity = torch.bmm(mean_queries, unit_keys.transpose(1, 2))  # [kv_heads, group, units]
        if self.head_mean == "all":
            similarity = similarity.mean(dim=(0, 1)).expand(kv_heads, -1)
        else:
            similarity = similarity.mean(dim=1)
        units_per_block = self.block_size // self.unit_size
        blocks = -(-similarity.shape[1] // units_per_block)
        padded = F.pad(similarity, (0, blocks * units_per_block - similarity.shape[1]), value=float("-inf"))
        block_scores = padded.view(kv_heads, blocks, units_per_block).amax(dim=-1)
        return block_scores.repeat_interleave(self.block_size, dim=1)[:, :keys_length]


def unit_means(keys: torch.Tensor, unit_size: int) -> torch.Tensor:
    """Mean key of every run of ``unit_size`` consecutive tokens: [kv_heads, S, d] -> [kv_heads, units, d]."""
    kv_heads, length, dim = keys.shape
    units = -(-length // unit_size)
    padded = F.pad(keys, (0, 0, 0, units * unit_size - length))
    sums = padded.view(kv_heads, units, unit_size, dim).sum(dim=2)
    counts = torch.full((units,), unit_size, dtype=keys.dtype, device=keys.device)
    counts[-1] = length - (units - 1) * unit_size
    return sums / counts[:, None]
