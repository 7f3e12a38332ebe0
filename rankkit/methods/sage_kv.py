"""SAGE-KV Sec. 2 Steps 1-4, Appendix A.2: KV-only after a full prefill.

Step 1 cuts every layer's cache into sink tokens S, evicted candidates E, recent
tokens R and the last token. Step 2: each query head h takes the top-k of E by the
last prompt token's softmax attention (its own head, not a group summary); a KV head
keeps the union of its G query heads' top-k, so KV heads keep different numbers of
tokens (the cache pads them). Step 3: the reduced cache is S + union + R + last token.
Compressing after each layer's attention equals compressing after the prefill: a
prefill never reads an earlier layer's cache.

Step 4: during decoding each new token's KV joins the recent window and the oldest
entry of the window is evicted, so the cache size stays constant. The new entry is
written into the evicted entry's slot (entry order is free: masks come from positions),
so a step costs no cache copy: the window is the cache's (``KVCache.keep_recent_window``),
a ring of the recent window's slots and one more, since each step attends to the window
and its own token before the oldest goes.

Budget split for a budget of B tokens (Appendix A.2): sink window B/4; k per query head
with G query heads per KV head; the recent window takes the rest (B - B/4 - G*k, the last
token included). The appendix's formula for k did not survive the paper's text; its two
worked examples fix it as k = B / (2G'), G' being G rounded up to a power of two: Llama
(G = 4, B = 8192) k = 1024, recent 2048; Qwen2.5 (G = 7) k = 512, recent 2560, where
B/(2G) would give 585. A budget that covers the prompt is full prefill, in decoding too.

On a local (sliding-window) layer, tokens older than the window are never kept: sink
tokens the layer cannot see give their share to its recent window, and when everything
the layer sees fits the budget it keeps all of it, as its recent window (``SageSplit.seeing``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from rankkit.errors import RankkitError
from rankkit.methods.base import Budget, Method, Selection, full_prefill, make_probe, register
from rankkit.methods.selection import Captured, check_head_layer, descending_order
from rankkit.runner import AttentionCall, LayerHook, PrefillState


@dataclass
class SageSplit:
    sinks: int
    per_query_head: int  # k
    recent: int  # recent tokens, the last token included
    first_seen: int = 0  # on a local layer, the entries before this one lie outside its window

    def seeing(self, first_seen: int, length: int, budget: int) -> SageSplit:
        """This split on a layer that cannot attend to its first ``first_seen`` of ``length`` entries."""
        if not first_seen:
            return self
        if length - first_seen <= budget:
            return SageSplit(0, 0, length - first_seen, first_seen)
        return replace(self, recent=self.recent + min(first_seen, self.sinks), first_seen=first_seen)


def sage_split(budget: int, group_size: int) -> SageSplit:
    """Appendix A.2's split of ``budget`` (see the module docstring)."""
    sinks = budget // 4
    per_query_head = budget // (2 * (1 << (group_size - 1).bit_length()))
    return SageSplit(sinks, per_query_head, max(1, budget - sinks - group_size * per_query_head))


def union_of_head_top_k(attention: torch.Tensor, split: SageSplit) -> list[torch.Tensor]:
    """Step 2-3: per KV head, the kept entry indices (sinks, union of its query heads' top-k of E, recent).

    ``attention`` is the last token's attention per query head, [kv_heads, group, S].
    """
    return [torch.nonzero(head).flatten() for head in kept_union(attention, split)]


def kept_union(attention: torch.Tensor, split: SageSplit) -> torch.Tensor:
    """Steps 2-3 as a mask [kv_heads, S] (True = kept), made on the device without reading it back."""
    length = attention.shape[-1]
    start = max(split.sinks, split.first_seen)
    recent_start = max(start, length - split.recent)
    evicted = attention[..., start:recent_start]
    k = min(split.per_query_head, evicted.shape[-1])
    top = descending_order(evicted)[..., :k]  # [kv_heads, group, k] into the span, ties to the earlier token
    kept = torch.zeros(attention.shape[0], length, dtype=torch.bool, device=attention.device)
    kept[:, min(split.first_seen, split.sinks) : split.sinks] = True
    kept[:, recent_start:] = True
    kept[:, start:recent_start].scatter_(1, top.flatten(1), True)
    return kept


class SageKVHook(LayerHook):
    """Steps 1-3 on every layer's cache during prefill; Step 4's window is the cache's."""

    kept: torch.Tensor | None  # the layer's kept mask, from its attention until its cache is cut

    def __init__(self, budget: int, group_size: int):
        self.budget = budget
        self.split = sage_split(budget, group_size)
        self.layer_splits: dict[int, SageSplit] = {}  # each layer's, as its window shapes it

    def on_attention(self, call: AttentionCall) -> None:
        if call.phase != "prefill":
            return
        from rankkit.probes.attention import window_attention  # probes load late, as in make_probe

        first_seen = call.first_seen_key()
        if first_seen is None:  # a prefill's keys are in position order: those a local layer cannot see come first
            first_seen = int(call.unseen_keys()[0].sum())
        split = self.split.seeing(first_seen, call.key.shape[2], self.budget)
        self.layer_splits[call.layer] = split
        self.kept = kept_union(window_attention(call, 1), split)

    def after_layer(self, layer: int, state: PrefillState) -> None:
        kept, self.kept = self.kept, None
        cache = state.cache
        cache.compress_to_mask(layer, kept, self.budget)  # no head keeps more than the budget
        # Step 4: with a step's token the recent window holds one entry more, then its oldest goes
        width = cache.get_seq_length(layer)
        cache.keep_recent_window(layer, self.layer_splits[layer].recent + 1, width + 1)


@register
@dataclass
class SageKV(Method):
    name: ClassVar[str] = "sage-kv"

    def probe(self):
        return make_probe("last_token_heads")

    def prefill(self, runner, input_ids, budget):
        config = runner.config
        group_size = config.num_attention_heads // config.num_key_value_heads
        length = int(input_ids.numel())
        keep = self.kept_tokens(budget, length)
        if keep >= length:
            return full_prefill(runner, input_ids)
        return full_prefill(runner, input_ids, hooks=[SageKVHook(keep, group_size)])

    def minimum_keep(self):
        return 2  # a sink and the last token

    # -- the offline face: Steps 1-3 on the stored per-query-head attention of the last token --

    def captured_inputs(self):
        return [self.probe().key]

    def _attention(self, captured: Captured) -> torch.Tensor:
        """The last token's attention [L, kv_heads, group, T], NaN where a local layer sees no key."""
        scores = captured.hide_unseen(captured.get(self.probe().key, self.name))
        layers, rows, length = scores.shape
        if captured.kv_heads is None or rows != captured.query_heads:
            raise RankkitError(
                f"method '{self.name}' needs {self.probe().key!r} per query head, which this store does "
                "not hold (it predates that layout); recapture it with `rankkit capture`"
            )
        return scores.reshape(layers, captured.kv_heads, rows // captured.kv_heads, length)

    def select_offline(self, captured: Captured, budget: Budget, *, layer=None) -> Selection:
        check_head_layer(self.name, layer, captured.num_layers)
        attention = self._attention(captured)[layer]
        kv_heads, group_size, length = attention.shape
        keep = self.kept_tokens(budget, length)
        if keep >= length:
            return Selection(layer, captured.seen_positions(layer).expand(kv_heads, -1))
        first_seen = int(attention[0, 0].isnan().sum())  # unseen keys are the oldest ones
        split = sage_split(keep, group_size).seeing(first_seen, length, keep)
        # Step 2 ranks only keys past the sinks and the unseen ones: the NaN are never read
        return Selection(layer, union_of_head_top_k(attention, split))

    def layer_rankings(self, captured: Captured, budget: Budget) -> dict[int | None, torch.Tensor]:
        """Per layer, each token's highest attention over the query heads (the order the union takes
        tokens in), with the sinks and recent window Step 1 always keeps at +inf."""
        attention = self._attention(captured).nan_to_num(-torch.inf)
        length = attention.shape[-1]
        keep = self.kept_tokens(budget, length)
        split = sage_split(keep, attention.shape[2])
        rankings = {}
        maxima = attention.flatten(1, 2).amax(dim=1)
        unseen = maxima.isneginf().sum(dim=1).tolist()
        for layer, scores in enumerate(maxima):
            seen = split.seeing(unseen[layer], length, keep)
            scores[seen.first_seen : seen.sinks] = torch.inf  # the sinks it sees (none when past them)
            scores[length - seen.recent :] = torch.inf  # the recent window is never longer than the prompt
            rankings[layer] = scores
        return rankings
