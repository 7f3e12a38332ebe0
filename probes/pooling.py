"""Pooling of a probe's scores before its observation window (the rule itself: rankkit.pooling)."""

from __future__ import annotations

import torch

from rankkit.pooling import check_pooling, pool_tokens

__all__ = ["check_pooling", "pool_before_window", "pooling_layout"]


def pooling_layout(pooling: str, kernel_size: int, unpooled_last: int) -> dict:
    """How a ``pool_before_window`` probe's stored scores are laid out, for the score array's attributes.

    The last ``min(unpooled_last, T)`` positions hold the window's scores as computed
    (unpooled sums); every position before them holds pooled scores.
    """
    return {
        "pooling": pooling,
        "kernel_size": kernel_size,
        "unpooled_last": unpooled_last,
        "layout": "pooled before the last min(unpooled_last, T) positions, unpooled sums at them",
    }


def pool_before_window(
    scores: torch.Tensor, window_tokens: int, pooling: str, kernel_size: int
) -> torch.Tensor:
    """Pool the tokens before the last ``window_tokens`` on their own; keep the window's scores as computed.

    As in ASL Algorithm 1 lines 4-5 (and SnapKV): only the past-only histogram is pooled,
    so no window score leaks into its neighbours before the window. ``scores`` are a probe's,
    computed from one attention call: every key is scored (``ProbeRecorder`` marks the keys a
    local layer cannot see only afterwards), so no NaN needs leaving out.
    """
    past = scores.shape[-1] - window_tokens
    pooled_past = pool_tokens(scores[..., :past], pooling, kernel_size, scored=True)
    return torch.cat([pooled_past, scores[..., past:]], dim=-1)
