"""SnapKV-style 1-D pooling of per-token scores, shared by every probe that pools.

Stride 1 and padding ``kernel_size // 2`` keep the length, so the kernel must be odd.
Average pooling counts the zero padding (``count_include_pad=True``, torch's default,
which SnapKV and ASL Algorithm 1 line 5 use): the ``kernel_size // 2`` tokens at each
edge are divided by the full kernel. Max pooling ignores the padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rankkit.errors import RankkitError

POOLINGS = ("avg", "max")


def check_pooling(pooling: str, kernel_size: int) -> None:
    """Fail early, at probe construction, on a pooling that could not keep the length."""
    if pooling not in POOLINGS:
        raise RankkitError(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise RankkitError(
            f"kernel_size must be a positive odd number (length-preserving pooling), not {kernel_size}"
        )


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


def pool_tokens(scores: torch.Tensor, pooling: str, kernel_size: int) -> torch.Tensor:
    """Pool ``scores`` [..., T] along the token axis; the result has the same shape."""
    length = scores.shape[-1]
    if kernel_size == 1 or length == 0:
        return scores
    pool = F.avg_pool1d if pooling == "avg" else F.max_pool1d
    rows = scores.reshape(-1, 1, length)
    return pool(rows, kernel_size, stride=1, padding=kernel_size // 2).reshape(scores.shape)


def pool_before_window(
    scores: torch.Tensor, window_tokens: int, pooling: str, kernel_size: int
) -> torch.Tensor:
    """Pool the tokens before the last ``window_tokens`` on their own; keep the window's scores as computed.

    As in ASL Algorithm 1 lines 4-5 (and SnapKV): only the past-only histogram is pooled,
    so no window score leaks into its neighbours before the window.
    """
    past = scores.shape[-1] - window_tokens
    pooled_past = pool_tokens(scores[..., :past], pooling, kernel_size)
    return torch.cat([pooled_past, scores[..., past:]], dim=-1)
