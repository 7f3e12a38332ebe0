"""SnapKV-style 1-D pooling of per-token scores: the one pooling rule of the probes and the oracle.

Stride 1 and padding ``kernel_size // 2`` keep the length, so the kernel must be odd.

One pooling convention for every ranking rankkit compares, probes and the oracle alike:
average pooling leaves the padding out (``count_include_pad=False``), each output is the
mean of the neighbours that exist. The papers write POOL1D without saying how the edges
are padded (CLAA Alg. 1 for the oracle, ASL Alg. 1 line 5 and SnapKV for the window);
the oracle pools raw logits, which can be negative, so zero padding would pull its
first and last tokens toward zero, and the same convention for the
softmax probes keeps a comparison between them about ranks, not edge effects. (SnapKV's
and ASL's code use torch's default, which counts the padding: a deviation at the
``kernel_size // 2`` tokens of each edge.) Max pooling ignores the padding.

``avg_padded`` is the other convention, torch's ``avg_pool1d`` default: the zero padding
counts in every edge mean. GemFilter's reference code pools its logits that way, so its
probe uses it to keep the method's selection as the reference makes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rankkit.errors import RankkitError

POOLINGS = ("avg", "avg_padded", "max")


def check_pooling(pooling: str, kernel_size: int, setting: str = "kernel_size") -> None:
    """Fail on a pooling that could not keep the length: early, at probe construction, and again in
    ``pool_tokens``, whose callers pass names of their own (an unknown one must not average).
    ``setting`` is the kernel's name where it was given (the oracle's ``--kernel``)."""
    if pooling not in POOLINGS:
        raise RankkitError(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
    if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
        raise RankkitError(
            f"{setting} must be a positive odd integer (length-preserving pooling), not {kernel_size!r}"
        )


def pool_tokens(scores: torch.Tensor, pooling: str, kernel_size: int, *, scored: bool = False) -> torch.Tensor:
    """Pool ``scores`` [..., T] along the token axis; the result has the same shape.

    NaN entries (keys a sliding-window layer could not see) are not neighbours in an
    average either: a window holding only NaN stays NaN. ``scored`` says the caller knows
    every entry is scored (no NaN, as in scores just computed from one attention call):
    an average is then one pooling operator, the same values the NaN-aware five give.
    """
    check_pooling(pooling, kernel_size)
    length = scores.shape[-1]
    if kernel_size == 1 or length == 0:
        return scores
    rows = scores.reshape(-1, 1, length)
    padding = kernel_size // 2
    if pooling == "max":
        return F.max_pool1d(rows, kernel_size, stride=1, padding=padding).reshape(scores.shape)
    if scored:
        pooled = F.avg_pool1d(rows, kernel_size, stride=1, padding=padding, count_include_pad=pooling == "avg_padded")
        return pooled.reshape(scores.shape)
    if pooling == "avg_padded":  # an unseen (NaN) key counts as padding, and stays NaN
        unscored = rows.isnan()
        pooled = F.avg_pool1d(rows.masked_fill(unscored, 0.0), kernel_size, stride=1, padding=padding)
        return pooled.masked_fill(unscored, float("nan")).reshape(scores.shape)
    window = dict(kernel_size=kernel_size, stride=1, padding=padding, count_include_pad=False)
    unscored = rows.isnan()
    summed = F.avg_pool1d(rows.masked_fill(unscored, 0.0), **window)  # infinities stay infinite
    pooled = summed / F.avg_pool1d((~unscored).to(rows.dtype), **window)
    return pooled.reshape(scores.shape)
