"""StreamingLLM (Xiao et al. 2024), KV-only: attention sinks plus the most recent tokens.

A recency score (the key's original position) x no selection layer x KV-only mode:
after each layer's attention its cache keeps the first ``sink_tokens`` tokens and fills
the rest of the budget with the most recent ones. No attention is looked at, so its
offline face needs nothing captured but the prompt's length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

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

    def captured_inputs(self):
        return []

    def captured_scores(self, captured: Captured) -> torch.Tensor:
        positions = torch.arange(captured.num_tokens, dtype=torch.float32)
        return positions.expand(captured.num_layers, 1, -1)
