"""AdaKV (Feng et al. 2024), KV-only: SnapKV's scores, with the layer's budget shared out over its heads.

A layer keeps ``kv_heads`` x budget entries in all, as SnapKV does, but not the same number
per head: the entries are the best of the layer's scores over all heads at once, so a head
whose attention is concentrated keeps few tokens and one whose attention is spread keeps
many. Each head first gets its observation window and its ``safeguard`` share of the rest of
the budget (its best ``int(safeguard x (budget - window))`` other tokens), so no head is emptied. Probe ``window``
(W=32, avg pooled, kernel 7) as SnapKV; the scores are attention mass, comparable across heads.
On a local (sliding-window) layer only keys the layer can attend to are entries, as for every
per-head method (``top_k_seen``): the others are never kept and take none of the budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from rankkit.methods.base import Budget, Selection, bounded, register
from rankkit.methods.selection import (
    Captured,
    NeverSelect,
    SelectionHook,
    check_head_layer,
    descending_order,
    forced_mask,
    one_pass,
    with_forced,
)
from rankkit.methods.snapkv import SnapKV


def adaptive_head_mask(
    scores: torch.Tensor, keep: int, window: int, safeguard: float, unseen: torch.Tensor | None = None
) -> torch.Tensor:
    """Each head's kept entries as a mask [heads, S] from scores [heads, S]: the ``heads`` x ``keep``
    best entries over all heads, after the last ``window`` tokens and each head's best
    ``guaranteed_share`` others are put first. Ties go to the earlier head, then the earlier token.
    Keys in ``unseen`` [heads, S] (outside a local layer's window) are never kept, forced or not,
    and take none of the places. Made on the device: the window's size and the guaranteed share
    are host numbers, so nothing is read."""
    heads, length = scores.shape
    ranked = _last_if_unseen(with_forced(scores, forced_mask(length, window, device=scores.device)), unseen)
    first_count = min(window, length) + guaranteed_share(keep, window, length, safeguard)
    if first_count > min(window, length):  # no share (safeguard 0): no per-head sort in the prefill
        first = descending_order(ranked)[:, :first_count]  # the forced tokens lead the order
        # a head that sees fewer keys than its first places keeps those it sees, no more
        ranked = _last_if_unseen(ranked.scatter(1, first.to(scores.device), float("inf")), unseen)
    chosen = descending_order(ranked.reshape(-1))[: heads * keep].to(scores.device)
    kept = torch.zeros(heads * length, dtype=torch.bool, device=scores.device)
    kept = kept.scatter_(0, chosen, True).view(heads, length)
    # where the layer sees fewer entries than its places, the places left over fell on unseen keys
    return kept if unseen is None else kept & ~unseen


def _last_if_unseen(ranked: torch.Tensor, unseen: torch.Tensor | None) -> torch.Tensor:
    return ranked if unseen is None else ranked.masked_fill(unseen, float("-inf"))


def guaranteed_share(keep: int, window: int, length: int, safeguard: float) -> int:
    """The tokens besides the window each head keeps by its own ranking: ``int(safeguard x (keep - window))``."""
    return int(safeguard * (keep - min(window, length)))


def widest_head(heads: int, keep: int, window: int, length: int, safeguard: float) -> int:
    """The most entries one head can keep: the layer's ``heads`` x ``keep`` less what every other head
    is guaranteed (its window and its share), known without reading the scores."""
    guaranteed = min(window, length) + guaranteed_share(keep, window, length, safeguard)
    return min(length, heads * keep - (heads - 1) * guaranteed)


def adaptive_head_selection(
    scores: torch.Tensor, keep: int, window: int, safeguard: float, unseen: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """``adaptive_head_mask``'s kept entries per head, as sorted index tensors."""
    kept = adaptive_head_mask(scores, keep, window, safeguard, unseen)
    return [torch.nonzero(head).flatten() for head in kept]


class AdaptiveHeadsHook(SelectionHook):
    """A KV-only ``SelectionHook`` whose layers keep ``adaptive_head_selection``'s entries per KV head.

    Each layer's cache is cut to ``widest_head`` (on a local layer, at most its window's keys), a
    width the host knows, so no layer reads the device; ``trim`` then cuts every layer to its
    widest head with one read once the prefill is over.
    """

    def __init__(self, probe, keep: int, *, window: int, safeguard: float):
        super().__init__(probe, NeverSelect(), keep, window=window, compress_from=0)
        self.safeguard = safeguard
        self.compressed: list[int] = []
        self.sliding_window: int | None = None  # the current layer's window (None: a global layer)

    def on_attention(self, call):
        super().on_attention(call)
        if call.phase == "prefill":
            self.sliding_window = call.sliding_window
            if self.unseen is None:  # the ranking over all heads masks them, even where the host could count them
                self.unseen = call.unseen_keys()

    def after_layer(self, layer, state):
        scores, self.scores = self.scores, None
        live = state.positions.shape[0]
        if self.keep < live:
            kept = adaptive_head_mask(scores, self.keep, self.window, self.safeguard, self.unseen)
            width = widest_head(scores.shape[0], self.keep, self.window, live, self.safeguard)
            if self.sliding_window is not None:  # a local layer's last query sees its window's keys, no more
                width = min(width, self.sliding_window)
            state.cache.compress_to_mask(layer, kept, width)
            self.compressed.append(layer)

    def trim(self, cache) -> None:
        cache.trim_padding(self.compressed)


@register
@dataclass
class AdaKV(SnapKV):
    name: ClassVar[str] = "adakv"
    # AdaKV's alpha: the share of the budget every head keeps by its own ranking
    safeguard: float = bounded(0.2, 0, 1, reference="α, AdaKV")

    def prefill(self, runner, input_ids, budget):
        keep = self.kept_tokens(budget, int(input_ids.numel()))
        hook = AdaptiveHeadsHook(self.probe(), keep, window=self.window_size, safeguard=self.safeguard)
        run = one_pass(runner, input_ids, hook)
        hook.trim(run.result.cache)
        return run

    def select_offline(self, captured: Captured, budget: Budget, *, layer: int | None = None) -> Selection:
        check_head_layer(self.name, layer, captured.num_layers)
        keep = self.kept_tokens(budget, captured.num_tokens)
        scores = captured.hide_unseen(self.captured_scores(captured))[layer]  # NaN: keys the layer could not see
        selected = adaptive_head_selection(scores, keep, self.window_size, self.safeguard, scores.isnan())
        return Selection(layer, selected)

    def layer_rankings(self, captured: Captured, budget: Budget) -> dict[int | None, torch.Tensor]:
        """Per layer, each token's best score over the heads (an entry of any head can win a place),
        the observation window first and keys a local layer cannot see last."""
        scores = self.captured_scores(captured)
        forced = forced_mask(captured.num_tokens, self.window_size)
        return dict(enumerate(captured.unseen_last(with_forced(scores.amax(dim=1), forced)).unbind(0)))
