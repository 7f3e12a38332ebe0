"""GemFilter: raw (pre-softmax) attention logits of the last prompt token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from rankkit.runner import AttentionCall

from .attention import window_logits
from .base import Probe, register
from .pooling import check_pooling, pool_before_window, pooling_layout


@register
@dataclass
class LastTokenRawProbe(Probe):
    """GemFilter, CLAA Eq. 1: the last query's scaled logits, summed over heads.

    For KV head g and key i::

        score[g, i] = pool( sum_{h in group g} q_last^h . k_i * scaling )

    Summed over the query heads of the group (Eq. 1 sums over all heads: the sum of the
    KV-head rows is exactly Eq. 1), then pooled. GemFilter does not pool, so the default
    kernel is 1 (none); CLAA's comparison pools every method with avg kernel 7. The last
    token itself is left unpooled, like every probe's window. In a prefill the last query
    sees every key; a key it could not see (cache padding) scores -inf.
    """

    name: ClassVar[str] = "last_token_raw"
    kernel_size: int = 1
    pooling: str = "avg"

    def __post_init__(self) -> None:
        check_pooling(self.pooling, self.kernel_size)

    def layout(self) -> dict:
        return pooling_layout(self.pooling, self.kernel_size, 1)

    def score(self, call: AttentionCall) -> torch.Tensor:
        summed = window_logits(call, 1)[:, :, 0].sum(dim=1)
        return pool_before_window(summed, 1, self.pooling, self.kernel_size)
