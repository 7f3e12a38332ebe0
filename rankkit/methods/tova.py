"""TOVA (Oren et al. 2024), KV-only: keep the tokens the newest query attends to, in prefill and in decode.

TOVA treats the cache as a fixed number of states. Its score is the last query's softmax
attention averaged over every head of a layer, so a layer evicts the same tokens from all
its heads. At the end of the prefill each layer's cache keeps the budget's best tokens by
the last prompt token's attention (the last token itself always kept); after every decode
step, each layer whose cache passed the budget drops the one entry the new token attended
to least (the new token's own entry included); a budget that covers the prompt evicts
nothing, in decoding either. Probe ``last_token_heads`` (the last
query's attention per query head) summed over the heads: the sum ranks as the average does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from rankkit.cache import KVCache
from rankkit.methods.base import full_prefill, make_probe, register
from rankkit.methods.selection import (
    Captured,
    NeverSelect,
    PolicyMethod,
    SelectionHook,
    one_pass,
)
from rankkit.runner import AttentionCall


class AllHeads:
    """A per-head probe's scores summed over all its rows, the same row for each KV head."""

    def __init__(self, probe):
        self.probe = probe

    def score(self, call: AttentionCall) -> torch.Tensor:
        return self.probe.score(call).sum(0).expand(call.key.shape[1], -1)


def least_attended(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The entry [1] with the lowest of ``scores`` [S], among ties the latest of ``positions`` [S] (a
    NaN, a key a local layer does not see, is never the lowest): on the device, whatever the order
    of the entries."""
    scores = scores.nan_to_num(torch.inf)
    lowest = scores == scores.min()
    return torch.where(lowest, positions, -1).argmax()[None]


class TovaHook(SelectionHook):
    """The prefill's KV-only selection, then TOVA's eviction after every decode step."""

    def __init__(self, probe, keep: int):
        super().__init__(probe, NeverSelect(), keep, window=1, compress_from=0)
        self.step_scores: dict[int, torch.Tensor] = {}  # layer -> the new token's attention [S]

    def on_attention(self, call: AttentionCall) -> None:
        if call.phase == "prefill":
            super().on_attention(call)
        else:
            self.step_scores[call.layer] = self.probe.score(call)[0]

    def after_decode_step(self, cache: KVCache, position: int) -> None:
        for layer, scores in self.step_scores.items():
            length = scores.shape[0]
            if length > self.keep:
                cache.evict(layer, least_attended(scores, cache.positions[layer][0]))
        self.step_scores.clear()


@register
@dataclass
class TOVA(PolicyMethod):
    name: ClassVar[str] = "tova"

    def probe(self):
        return make_probe("last_token_heads")

    def forced(self, keep):
        return 1, 0  # the last prompt token

    def prefill(self, runner, input_ids, budget):
        length = int(input_ids.numel())
        bound, keep, _, _ = self._plan(runner.num_layers, length, budget, runner.layer_types)
        if keep >= length:  # a budget that covers the prompt keeps everything, in decoding too
            return full_prefill(runner, input_ids)
        hook = TovaHook(AllHeads(bound.probe()), keep)
        run = one_pass(runner, input_ids, hook)
        run.decode_hooks = [hook]
        return run

    def captured_scores(self, captured: Captured) -> torch.Tensor:
        """The stored per-query-head attention [L, q_heads, T] summed over the heads, one row per KV head."""
        summed = super().captured_scores(captured).sum(1, keepdim=True)
        return summed.expand(-1, captured.kv_heads or 1, -1)
