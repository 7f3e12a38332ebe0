"""FastKV / SnapKV / CLAA / ASL: pooled attention from an observation window of the last queries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from rankkit.runner import AttentionCall

from .attention import check_window_size, window_attention, window_length
from .base import Probe, register
from .pooling import check_pooling, pool_before_window, pooling_layout


@dataclass
class PooledWindowProbe(Probe):
    """A probe that reads the attention of the last ``window_size`` queries and pools the scores of
    the keys before that window (``pooling`` over ``kernel_size``); each subclass gives its paper's
    defaults and its ``score``."""

    window_size: int
    kernel_size: int
    pooling: str

    def __post_init__(self) -> None:
        check_window_size(self.window_size)
        check_pooling(self.pooling, self.kernel_size)

    def layout(self) -> dict:
        return pooling_layout(self.pooling, self.kernel_size, self.window_size)

    def attention_window(self) -> int:
        return self.window_size


@register
@dataclass
class WindowProbe(PooledWindowProbe):
    """Window attention, CLAA Eq. 5 (= CLAA Eq. 2, FastKV's) as computed by ASL Algorithm 1 lines 3-6.

    For KV head g and key i::

        score[g, i] = sum_{h in group g} pool( sum_{j in window} softmax(q_j^h K^T * scaling + causal)[i] )

    - the window is the last ``window_size`` queries, each causal within the window; when
      fewer queries arrive (T < W) all of them form the window;
    - summed over the window and over the query heads of the group, as the papers sum
      (CLAA Eq. 5 sums over all heads: the sum of the KV-head rows is exactly Eq. 5;
      CLAA Eq. 4 averages over the group instead, the same ranking within a head);
    - pooled per query head before the group sum (ASL lines 5-6), over the tokens before
      the window only (ASL line 4, SnapKV). The window tokens keep their summed
      attention unpooled: the methods always keep them, and their scores are only
      reported, never compared against pooled ones by a selection.

    Defaults are FastKV's and CLAA's (W=8, avg pooling, kernel 7); ASL and SnapKV use W=32.
    """

    name: ClassVar[str] = "window"
    window_size: int = 8
    kernel_size: int = 7
    pooling: str = "avg"

    def score(self, call: AttentionCall) -> torch.Tensor:
        attention = window_attention(call, self.window_size)
        window = window_length(call, self.window_size)
        return pool_before_window(attention, window, self.pooling, self.kernel_size).sum(dim=1)
