"""AdaKV (Feng et al. 2024), KV-only: SnapKV's scores, with the layer's budget shared out over its heads.

A layer keeps ``kv_heads`` x budget entries in all, as SnapKV does, but not the same number
per head: the entries are the best of the layer's scores over all heads at once, so a head
whose attention is concentrated keeps few tokens and one whose attention is spread keeps
many. Each head first gets its observation window and its ``safeguard`` share of the rest of
the budget (its best ``int(safeguard x (budget - window))`` other tokens), so no head is emptied. Probe ``window``
(W=32, avg pooled, kernel 7) as SnapKV; the scores are attention mass, comparable across heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from rankkit.errors import RankkitError
from rankkit.methods.base import Budget, Selection, bounded, register
from rankkit.methods.selection import (
    Captured,
    NeverSelect,
    SelectionHook,
    descending_order,
    forced_mask,
    one_pass,
    with_forced,
)
from rankkit.methods.snapkv import SnapKV


def adaptive_head_mask(
    scores: torch.Tensor, keep: int, forced: torch.Tensor, safeguard: float
) -> torch.Tensor:
    """Each head's kept entries as a mask [heads, S] from scores [heads, S]: the ``heads`` x ``keep``
    best entries over all heads, after the ``forced`` tokens and each head's best ``int(safeguard x
    (keep - forced))`` others are put first. Ties go to the earlier head, then the earlier token.
    Made on the device: ``forced`` is a host mask, so the guaranteed share needs no read."""
    heads, length = scores.shape
    ranked = with_forced(scores, forced.to(scores.device))
    forced_count = int(forced.sum())
    guaranteed = int(safeguard * (keep - forced_count))
    if guaranteed:
        first = descending_order(ranked)[:, : forced_count + guaranteed]  # the forced tokens lead the order
        ranked = ranked.scatter(-1, first.to(scores.device), float("inf"))
    chosen = descending_order(ranked.reshape(-1))[: heads * keep].to(scores.device)
    kept = torch.zeros(heads * length, dtype=torch.bool, device=scores.device)
    return kept.scatter_(0, chosen, True).view(heads, length)


def adaptive_head_selection(
    scores: torch.Tensor, keep: int, forced: torch.Tensor, safeguard: float
) -> list[torch.Tensor]:
    """``adaptive_head_mask``'s kept entries per head, as sorted index tensors."""
    return [torch.nonzero(head).flatten() for head in adaptive_head_mask(scores, keep, forced, safeguard)]


class AdaptiveHeadsHook(SelectionHook):
    """A KV-only ``SelectionHook`` whose layers keep ``adaptive_head_selection``'s entries per KV head."""

    def __init__(self, probe, keep: int, *, window: int, safeguard: float):
        super().__init__(probe, NeverSelect(), keep, window=window, compress_from=0)
        self.safeguard = safeguard

    def after_layer(self, layer, state):
        scores, self.scores = self.scores, None
        live = state.positions.shape[0]
        if self.keep < live:
            kept = adaptive_head_mask(scores, self.keep, forced_mask(live, self.window, 0), self.safeguard)
            # the widest head sizes the cache: one read per layer, none per head
            state.cache.compress_to_mask(layer, kept, int(kept.sum(dim=1).max()))


@register
@dataclass
class AdaKV(SnapKV):
    name: ClassVar[str] = "adakv"
    # AdaKV's alpha: the share of the budget every head keeps by its own ranking
    safeguard: float = bounded(0.2, 0, 1, reference="α, AdaKV")

    def prefill(self, runner, input_ids, budget):
        keep = budget.resolve(int(input_ids.numel()), self.minimum_keep())
        hook = AdaptiveHeadsHook(self.probe(), keep, window=self.window_size, safeguard=self.safeguard)
        return one_pass(runner, input_ids, hook)

    def select_offline(self, captured: Captured, budget: Budget, *, layer: int | None = None) -> Selection:
        if layer is None or not 0 <= layer < captured.num_layers:
            raise RankkitError(
                f"method '{self.name}' keeps a set per layer and KV head: "
                f"name the layer with --layer (0..{captured.num_layers - 1})"
            )
        scores = self.captured_scores(captured)[layer]
        length = captured.num_tokens
        keep = budget.resolve(length, self.minimum_keep())
        if keep >= length:
            return Selection(layer, torch.arange(length).expand(scores.shape[0], length))
        forced = forced_mask(length, self.window_size)
        return Selection(layer, adaptive_head_selection(scores, keep, forced, self.safeguard))

    def layer_rankings(self, captured: Captured, budget: Budget) -> dict[int | None, torch.Tensor]:
        """Per layer, each token's best score over the heads (an entry of any head can win a place),
        the observation window first."""
        scores = self.captured_scores(captured)
        forced = forced_mask(captured.num_tokens, self.window_size)
        return dict(enumerate(with_forced(scores.amax(dim=1), forced).unbind(0)))
