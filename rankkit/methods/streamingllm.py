"""StreamingLLM (Xiao et al. 2024), KV-only: attention sinks plus the most recent tokens.

A recency score (the key's original position) x no selection layer x KV-only mode:
after each layer's attention its cache keeps the first ``sink_tokens`` tokens and fills
the rest of the budget with the most recent ones. No attention is looked at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from rankkit.methods.base import Method, register
from rankkit.methods.selection import NeverSelect, SelectionHook, one_pass
from rankkit.runner import AttentionCall


class Recency:
    """Scores every key by its original position: later is better."""

    def score(self, call: AttentionCall) -> torch.Tensor:
        return call.key_positions.float()


@register
@dataclass
class StreamingLLM(Method):
    name: ClassVar[str] = "streamingllm"
    sink_tokens: int = 4  # StreamingLLM's four initial tokens

    def prefill(self, runner, input_ids, budget):
        keep = budget.resolve(int(input_ids.numel()), always_kept=self.sink_tokens + 1)
        hook = SelectionHook(Recency(), NeverSelect(), keep, sinks=self.sink_tokens, compress_from=0)
        return one_pass(runner, input_ids, hook)
