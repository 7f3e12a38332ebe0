"""Token scores sorted on the CPU: one compiled stable radix sort, shared by the methods' selection
rule (``rankkit.methods.selection.descending_order``) and compare's metrics (``rankkit.eval.ranking``).

The order is descending score, tied scores in token order, and -0.0 tied with 0.0, as torch's
stable sort orders them. Where NaN goes is the caller's: first (above +inf, as torch's
descending sort puts it) or last (below -inf, "no score"). torch's own sort costs about
140 us per 2,048-token row on a CPU; this one about 20.
"""

from __future__ import annotations

import numba
import numpy as np

_SIGN = np.uint64(1 << 63)
_DIGIT_BITS = 11  # 2,048 buckets: a float32 score's 32 bits in three passes


@numba.njit(cache=True, nogil=True)
def sort_buffers(num_tokens):  # pragma: no cover - compiled
    """The scratch arrays ``sort_row`` sorts rows of ``num_tokens`` scores in, reused row after row."""
    return (
        np.empty(num_tokens, np.float64),
        np.empty(num_tokens, np.uint64),
        np.empty(num_tokens, np.uint64),
        np.empty(num_tokens, np.int32),
        np.empty(num_tokens, np.int32),
        np.empty(1 << _DIGIT_BITS, np.int64),
    )


@numba.njit(cache=True, nogil=True)
def sort_row(values, nan_first, buffers):  # pragma: no cover - compiled
    """Sort one row of scores (any real dtype, [T]) in descending order into ``buffers``
    (``sort_buffers``) and return them: ``buffers[1]`` holds the sorted keys (equal keys for
    equal scores, NaN all equal) and ``buffers[3]`` the token at each place.

    A stable LSD radix sort of the scores as unsigned keys that order like the floats, inverted
    so the highest comes first, over the bits in which the row's keys differ only.
    """
    normalized, keys, spare_keys, order, spare_order, counts = buffers
    num_tokens = values.shape[0]
    digit_mask = np.uint64((1 << _DIGIT_BITS) - 1)
    for token in range(num_tokens):
        value = np.float64(values[token])
        # One NaN for all NaN: the positive quiet one orders above +inf, its negation below -inf.
        # -0.0 + 0.0 is 0.0, so the two zeros tie as they compare.
        normalized[token] = (np.nan if nan_first else -np.inf) if value != value else value + 0.0
    bits = normalized.view(np.uint64)
    common_ones, any_ones = ~np.uint64(0), np.uint64(0)
    for token in range(num_tokens):
        # Flipping the sign bit of positives and every bit of negatives orders keys like the
        # floats; inverting that puts the highest score first.
        ascending = ~bits[token] if bits[token] & _SIGN else bits[token] | _SIGN
        keys[token] = ~ascending
        order[token] = token
        common_ones &= keys[token]
        any_ones |= keys[token]
    differing = common_ones ^ any_ones  # float32 scores widened to float64 differ in 32 bits at most
    shift = 0
    while shift < 64 and not (differing >> np.uint64(shift)) & np.uint64(1):
        shift += 1
    while shift < 64 and differing >> np.uint64(shift):
        counts[:] = 0
        for position in range(num_tokens):
            counts[(keys[position] >> np.uint64(shift)) & digit_mask] += 1
        offset = 0
        for bucket in range(1 << _DIGIT_BITS):
            offset, counts[bucket] = offset + counts[bucket], offset
        for position in range(num_tokens):
            key = keys[position]
            bucket = (key >> np.uint64(shift)) & digit_mask
            target = counts[bucket]
            counts[bucket] = target + 1
            spare_keys[target], spare_order[target] = key, order[position]
        keys, spare_keys = spare_keys, keys
        order, spare_order = spare_order, order
        shift += _DIGIT_BITS
    return normalized, keys, spare_keys, order, spare_order, counts


@numba.njit(cache=True, nogil=True)
def run_end(keys, start):  # pragma: no cover - compiled
    """The end of the run of equal keys that starts at ``start`` in sorted ``keys``."""
    end = start + 1
    while end < keys.shape[0] and keys[end] == keys[start]:
        end += 1
    return end


@numba.njit(cache=True, nogil=True)
def _descending_orders(values, nan_first):  # pragma: no cover - compiled; tested through descending_orders
    num_rows, num_tokens = values.shape
    orders = np.empty((num_rows, num_tokens), np.int64)
    buffers = sort_buffers(num_tokens)
    for row in range(num_rows):
        buffers = sort_row(values[row], nan_first, buffers)
        orders[row] = buffers[3]
    return orders


def descending_orders(values: np.ndarray, *, nan_first: bool) -> np.ndarray:
    """int64 indices along the last axis of ``values`` from the highest score down, ties in token
    order; NaN first (``nan_first``, as torch's descending sort) or last."""
    rows = np.ascontiguousarray(values.reshape(-1, values.shape[-1]) if values.ndim else values.reshape(1, 1))
    return _descending_orders(rows, nan_first).reshape(values.shape)
