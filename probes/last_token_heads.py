"""SAGE-KV: the last prompt token's attention, per query head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from rankkit.runner import AttentionCall

from .attention import window_attention
from .base import Probe, register


@register
@dataclass
class LastTokenHeadsProbe(Probe):
    """SAGE-KV Step 2: the softmax attention of the last prompt token, per query head.

    For query head h and key i::

        score[h, i] = softmax(q_last^h K^T * scaling)[i]

    Rows are query heads, grouped by KV head (row h belongs to KV head h // G, the order
    of the model's own head repeat), because SAGE-KV takes a top-k per query head and a KV
    head keeps the union over its group: no one score per KV head gives that union. Sink
    and recent tokens, which SAGE-KV keeps regardless, are scored like every other token.
    No pooling: SAGE-KV selects single tokens.
    """

    name: ClassVar[str] = "last_token_heads"

    def attention_window(self) -> int:
        return 1

    def score(self, call: AttentionCall) -> torch.Tensor:
        return window_attention(call, 1).flatten(0, 1)
