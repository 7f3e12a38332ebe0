"""SAGE-KV: the last prompt token's attention, per KV head group."""

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
    """SAGE-KV Step 2: the softmax attention of the last prompt token, max over the group.

    For KV head g and key i::

        score[g, i] = max_{h in group g} softmax(q_last^h K^T * scaling)[i]

    SAGE-KV takes a top-k per query head and keeps, per KV head, the union over its
    group; the group maximum is the one score per KV head that keeps a token which any
    head of the group attends to strongly (the same conservative rule as LAVa's GQA max).
    Sink and recent tokens, which SAGE-KV keeps regardless, are scored like every other
    token. No pooling: SAGE-KV selects single tokens.
    """

    name: ClassVar[str] = "last_token_heads"

    def score(self, call: AttentionCall) -> torch.Tensor:
        return window_attention(call, 1).amax(dim=1)
