"""LAVa: window attention scaled by each head's largest value norm."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from rankkit.cache import PADDING
from rankkit.runner import AttentionCall

from .attention import window_attention, window_length
from .base import register
from .pooling import pool_before_window
from .window import PooledWindowProbe


@register
@dataclass
class LavaProbe(PooledWindowProbe):
    """LAVa score, Eq. 5, with the GQA group maximum of Sec. 4.3.

    For KV head g and key i::

        s_h[i]     = max_k ||V_g[k]||_1 / w * sum_{j in window} softmax(q_j^h K^T * scaling + causal)[i]
        score[g,i] = max_{h in group g} pool(s_h)[i]

    ``w`` is the number of window queries used (Eq. 5 divides by the window size; the
    window is the last ``window_size`` queries, or all of them when T < W), and the
    value-norm maximum runs over every (non-padding) key of the layer. The query heads
    of a group share V, so the per-head scale is the group's. Max pooling with kernel 7
    is the paper's (Sec. 5 / Appendix D); pooling and the group max commute for it.
    Tokens before the window are pooled; the window tokens, which LAVa never evicts,
    keep their score as computed. The paper does not state w; the default 32 is
    SnapKV's, whose window LAVa adopts.
    """

    name: ClassVar[str] = "lava"
    window_size: int = 32
    kernel_size: int = 7
    pooling: str = "max"

    def score(self, call: AttentionCall) -> torch.Tensor:
        window = window_length(call, self.window_size)
        value_norms = call.value[0].float().abs().sum(dim=-1).masked_fill_(call.key_positions == PADDING, 0.0)
        scale = value_norms.amax(dim=-1) / window
        scored = window_attention(call, self.window_size) * scale[:, None, None]
        return pool_before_window(scored, window, self.pooling, self.kernel_size).amax(dim=1)
