"""StreamingLLM (Xiao et al. 2024), KV-only: attention sinks plus a rolling window of recent tokens.

A recency score (the key's original position) x no selection layer x KV-only mode:
after each layer's attention its cache keeps the first ``sink_tokens`` tokens and fills
the rest of the budget with the most recent ones. During decoding the window rolls: once
a layer's cache holds more than the budget, each new token evicts the oldest entry after
the sinks, so the cache stays at sinks + window, as the paper's cache does (a budget that
covers the prompt keeps everything, in decoding too). No attention
is looked at, so its offline face needs nothing captured but the prompt's length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from rankkit.cache import KVCache
from rankkit.methods.base import bounded, register
from rankkit.methods.selection import Captured, PolicyMethod
from rankkit.runner import AttentionCall, LayerHook


class Recency:
    """Scores every key by its original position: later is better."""

    def score(self, call: AttentionCall) -> torch.Tensor:
        return call.key_positions.float()


class RollingWindow(LayerHook):
    """Decoding: every layer's cache keeps its sinks and ``capacity`` entries at most; the newest entry
    takes the slot of the oldest one after the sinks (``KVCache.roll_recent_window``, no cache copy).

    ``rolling_from_start``: every layer already holds ``capacity`` entries, so every step rolls every
    layer, the same device work each time, which a CUDA graph can capture.
    """

    def __init__(self, capacity: int, sink_tokens: int, rolling_from_start: bool):
        self.capacity = capacity
        self.sink_tokens = sink_tokens
        self.rolling_from_start = rolling_from_start

    def graph_key(self):
        return ("streamingllm", self.capacity, self.sink_tokens) if self.rolling_from_start else None

    def after_decode_step(self, cache: KVCache, position: int | torch.Tensor) -> None:
        for layer in range(cache.num_layers):
            positions = cache.positions[layer][0]  # recency keeps the same entries in every head
            # a static cache's buffers are wider than the capacity: it only decodes a window rolling from the start
            if positions.numel() <= self.capacity:
                continue
            # the oldest entry after the sinks (padding, -1, is below them), found on the device: no read
            # of it per layer and step
            after_sinks = positions.masked_fill(
                positions < self.sink_tokens, torch.iinfo(positions.dtype).max
            )
            cache.roll_recent_window(layer, after_sinks.min())


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
            held = [cache.get_seq_length(layer) for layer in range(cache.num_layers)]
            run.decode_hooks = [RollingWindow(keep, sinks, rolling_from_start=min(held) >= keep)]
        return run

    def captured_inputs(self):
        return []

    def captured_scores(self, captured: Captured) -> torch.Tensor:
        positions = torch.arange(captured.num_tokens, dtype=torch.float32)
        return positions.expand(captured.num_layers, 1, -1)
