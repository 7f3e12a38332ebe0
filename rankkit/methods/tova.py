"""TOVA (Oren et al. 2024), KV-only: keep the tokens the newest query attends to, in prefill and in decode.

TOVA treats the cache as a fixed number of states. Its score is the last query's softmax
attention averaged over every head of a layer, so a layer evicts the same tokens from all
its heads. At the end of the prefill each layer's cache keeps the budget's best tokens by
the last prompt token's attention (the last token itself always kept); after every decode
step, each layer whose cache passed the budget drops the one entry the new token attended
to least (the new token's own entry included); a budget that covers the prompt evicts
nothing, in decoding either. Probe ``last_token_heads`` (the last
query's attention per query head) summed over the heads: the sum ranks as the average does.

The eviction is device work of fixed shapes: the prefill leaves every layer at the budget, or
under it where a local layer saw fewer keys (``KVCache.hold_size``), so over a static cache every
step writes one slot and frees one among the budget's and that one (an empty one first, so a layer
under the budget drops nothing), decided on the device, and a CUDA graph replays it
(``TovaEviction.replay_key``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from rankkit.cache import PADDING, KVCache
from rankkit.methods.base import full_prefill, make_probe, register
from rankkit.methods.selection import (
    Captured,
    NeverSelect,
    PolicyMethod,
    SelectionHook,
    one_pass,
)
from rankkit.runner import AttentionCall, LayerHook


class AllHeads:
    """A per-head probe's scores summed over all its rows, the same row for each KV head."""

    def __init__(self, probe):
        self.probe = probe

    def score(self, call: AttentionCall) -> torch.Tensor:
        return self.probe.score(call).sum(0).expand(call.key.shape[1], -1)


def least_attended(scores: torch.Tensor, positions: torch.Tensor, padding_score: float | None) -> torch.Tensor:
    """The entry [1] with the lowest of ``scores`` [S], among ties the latest of ``positions`` [S], on
    the device, whatever the order of the entries. A NaN (a key a local layer does not see) is never
    the lowest; an empty slot (position ``PADDING``) scores ``padding_score`` (None: there is none),
    and among empty slots tied lowest the first is taken."""
    scores = scores.nan_to_num(torch.inf)
    if padding_score is not None:
        scores = scores.masked_fill(positions == PADDING, padding_score)
    lowest = scores == scores.min()
    return torch.where(lowest, positions, PADDING - 1).argmax()[None]


class TovaEviction(LayerHook):
    """TOVA's eviction after every decode step: each layer that holds more than ``keep`` entries drops
    the one the step's token attended to least."""

    replay_key = "tova-eviction"

    def __init__(self, probe, keep: int):
        self.probe = probe
        self.keep = keep
        self.step_scores: dict[int, torch.Tensor] = {}  # layer -> the new token's attention [S]

    def on_attention(self, call: AttentionCall) -> None:
        if call.phase == "decode":
            self.step_scores[call.layer] = self.probe.score(call)[0]

    def after_decode_step(self, cache: KVCache, position: int) -> None:
        for layer, scores in self.step_scores.items():
            if scores.shape[0] > self.keep:  # over a static cache the scores span its buffer: it decides
                slots, padding_score = cache.evictable(layer)
                positions = cache.positions[layer][0, :slots]
                cache.evict(layer, least_attended(scores[:slots], positions, padding_score))
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
        if keep >= length:  # a budget that covers the prompt is full prefill, in decoding too
            return full_prefill(runner, input_ids)
        probe = AllHeads(bound.probe())
        run = one_pass(runner, input_ids, SelectionHook(probe, NeverSelect(), keep, window=1, compress_from=0))
        for layer in range(runner.num_layers):
            run.result.cache.hold_size(layer, keep)
        run.decode_hooks = [TovaEviction(probe, keep)]
        return run

    def captured_scores(self, captured: Captured) -> torch.Tensor:
        """The stored per-query-head attention [L, q_heads, T] summed over the heads, one row per KV head."""
        summed = super().captured_scores(captured).sum(1, keepdim=True)
        return summed.expand(-1, captured.kv_heads or 1, -1)
