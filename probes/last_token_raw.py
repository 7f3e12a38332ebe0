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
    KV-head rows is exactly Eq. 1), then pooled along the whole row, the last token's own
    logit included. The defaults are GemFilter's reference code: an average over kernel 5,
    stride 1, padding 2, the zero padding counted (``avg_padded``, torch's ``avg_pool1d``
    default). CLAA's comparison pools every method with kernel 7 (``kernel_size=7``). In a
    prefill the last query sees every key; a key it could not see (cache padding) scores -inf.
    """

    name: ClassVar[str] = "last_token_raw"
    kernel_size: int = 5
    pooling: str = "avg_padded"

    def __post_init__(self) -> None:
        check_pooling(self.pooling, self.kernel_size)

    def layout(self) -> dict:
        return pooling_layout(self.pooling, self.kernel_size, 0)

    def attention_window(self) -> int:
        return 1

    def score(self, call: AttentionCall) -> torch.Tensor:
        summed = window_logits(call, 1)[:, :, 0].sum(dim=1)
        return pool_before_window(summed, 0, self.pooling, self.kernel_size)
