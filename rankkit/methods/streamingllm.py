"""StreamingLLM (Xiao et al. 2024), KV-only: attention sinks plus a rolling window of recent tokens.

A recency score (the key's original position) x no selection layer x KV-only mode:
after each layer's attention its cache keeps the first ``sink_tokens`` tokens and fills
the rest of the budget with the most recent ones. During decoding the window rolls: once
a layer's cache holds the budget, each new token takes the slot of the oldest entry after
the sinks (``KVCache.keep_recent_window``), so the cache stays at sinks + window, as the
paper's cache does (a budget that covers the prompt is full prefill, in decoding too). No attention
is looked at, so its offline face needs nothing captured but the prompt's length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from rankkit.cache import PADDING
from rankkit.methods.base import bounded, register
from rankkit.methods.selection import Captured, PolicyMethod
from rankkit.runner import AttentionCall


class Recency:
    """Scores every key by its original position: later is better."""

    def score(self, call: AttentionCall) -> torch.Tensor:
        return call.key_positions.float()


@register
@dataclass
class StreamingLLM(PolicyMethod):
    name: ClassVar[str] = "streamingllm"
    sink_tokens: int = bounded(4, 0)  # StreamingLLM's four initial tokens

    def probe(self):
        return Recency()

    def forced(self, keep):
        return 0, self.sink_tokens

    def compress_from(self):
        return 0

    def minimum_keep(self):
        return self.sink_tokens + 1  # the last token produces the logits

    def prefill(self, runner, input_ids, budget):
        run = super().prefill(runner, input_ids, budget)
        length = int(input_ids.numel())
        _, keep, _, sinks = self._plan(runner.num_layers, length, budget, runner.layer_types)
        if keep < length:  # a budget that covers the prompt is full prefill, in decoding too (as SAGE-KV's)
            cache = run.result.cache
            layer_sinks, held = [sinks] * cache.num_layers, [keep] * cache.num_layers
            if runner.layer_types is not None:
                # a local layer holds the sinks its window sees, and no more than the window's keys when
                # the budget is wider: one read (recency keeps the same entries in every head)
                counts = torch.stack([_sinks_and_entries(positions[0], sinks) for positions in cache.positions])
                layer_sinks, held = counts.T.tolist()
            for layer, (layer_sink_count, layer_held) in enumerate(zip(layer_sinks, held, strict=True)):
                # with this step's token, the window holds what the layer kept after its sinks, + 1, then
                # the oldest goes: a local layer's ring is its window's keys, not the wider budget
                cache.keep_recent_window(layer, layer_held - layer_sink_count + 1, layer_held + 1)
        return run

    def captured_inputs(self):
        return []

    def captured_scores(self, captured: Captured) -> torch.Tensor:
        """Recency [L, kv_heads, T]: a set per KV head, as the prefill's cache holds (all alike)."""
        positions = torch.arange(captured.num_tokens, dtype=torch.float32)
        return positions.expand(captured.num_layers, captured.kv_heads or 1, -1)


def _sinks_and_entries(positions: torch.Tensor, sinks: int) -> torch.Tensor:
    """[2]: how many of a head's cache ``positions`` are among the first ``sinks`` tokens, and how many
    are real (not padding)."""
    real = positions != PADDING
    return torch.stack([(real & (positions < sinks)).sum(), real.sum()])
