"""Token scores sorted on the CPU: one compiled stable radix sort, shared by the methods' selection
rule (``rankkit.methods.selection.descending_order``) and compare's metrics (``rankkit.eval.ranking``).

The order is descending score, tied scores in token order, and -0.0 tied with 0.0, as torch's
stable sort orders them. Where NaN goes is the caller's: first (above +inf, as torch's
descending sort puts it) or last (tied with -inf: "no score"). torch's own sort costs about
140 us per 2,048-token row on a CPU; this one about 15.

Scores become unsigned keys that order like the floats, inverted so the highest comes first,
and an LSD radix sort runs over the bits in which a row's keys differ only: as few passes as
11-bit digits allow, each digit no wider than that number of passes needs, and each pass
counting the next one's digits as it moves the keys. A row whose scores are all float32
values (every captured score is one) sorts 32-bit keys, each packed with its token into one
64-bit word; any other row sorts 64-bit keys with its tokens beside them.
"""

from __future__ import annotations

import functools

import numba
import numpy as np

_SIGN = np.uint64(1 << 63)
_SIGN32 = np.uint32(1 << 31)
_LOW_HALF = np.uint64(0xFFFFFFFF)
_HALF = np.uint64(32)
_MAX_DIGIT_BITS = 11  # 2,048 buckets at most: a float32 key's 32 bits in three passes


@numba.njit(cache=True, nogil=True)
def sort_buffers(num_tokens):  # pragma: no cover - compiled
    """The scratch arrays ``sort_row`` sorts rows of ``num_tokens`` scores in, reused row after row."""
    return (
        np.empty(num_tokens, np.float64),
        np.empty(num_tokens, np.uint64),
        np.empty(num_tokens, np.uint64),
        np.empty(num_tokens, np.int32),
        np.empty(num_tokens, np.int32),
        np.empty((2, 1 << _MAX_DIGIT_BITS), np.int32),
        np.empty(num_tokens, np.float32),
    )


@numba.njit(cache=True, nogil=True)
def sort_row(values, nan_first, buffers):  # pragma: no cover - compiled
    """Sort one row of scores (any real dtype, [T]) in descending order into ``buffers``
    (``sort_buffers``) and return them: ``buffers[1]`` holds the sorted keys (equal keys for
    equal scores, NaN all equal) and ``buffers[3]`` the token at each place."""
    wide, keys, spare_keys, order, spare_order, counts, narrow = buffers
    if _narrow_keys(values, nan_first, narrow, keys):
        keys, spare_keys, order, spare_order = _radix_passes(
            keys, spare_keys, order, spare_order, counts, _differing_bits(keys) & ~_LOW_HALF, False
        )
        for place in range(values.shape[0]):
            packed = keys[place]
            order[place], keys[place] = np.int32(packed & _LOW_HALF), packed >> _HALF
    else:
        _wide_keys(values, nan_first, wide, keys, order)
        keys, spare_keys, order, spare_order = _radix_passes(
            keys, spare_keys, order, spare_order, counts, _differing_bits(keys), True
        )
    return wide, keys, spare_keys, order, spare_order, counts, narrow


@numba.njit(cache=True, nogil=True)
def _narrow_keys(values, nan_first, narrow, keys):  # pragma: no cover - compiled
    """Each token's 32-bit key in the high half of ``keys``, its index in the low half, when every
    score is a float32 value (NaN aside); False, with ``keys`` undefined, for any other row."""
    missing = np.float32(np.nan) if nan_first else np.float32(-np.inf)
    for token in range(values.shape[0]):
        value = values[token]
        if value != value:
            narrow[token] = missing
            continue
        single = np.float32(value)
        if single != value:
            return False
        narrow[token] = single + np.float32(0.0)  # -0.0 + 0.0 is 0.0: the two zeros tie, as they compare
    bits = narrow.view(np.uint32)
    for token in range(values.shape[0]):
        # Flipping the sign bit of positives and every bit of negatives orders keys like the
        # floats; inverting that puts the highest score first.
        key = bits[token] if bits[token] & _SIGN32 else ~bits[token] & ~_SIGN32
        keys[token] = (np.uint64(key) << _HALF) | np.uint64(token)
    return True


@numba.njit(cache=True, nogil=True)
def _wide_keys(values, nan_first, wide, keys, order):  # pragma: no cover - compiled
    """Each token's 64-bit key (as ``_narrow_keys`` makes 32-bit ones) in ``keys``, tokens in ``order``."""
    for token in range(values.shape[0]):
        value = np.float64(values[token])
        # One NaN for all NaN: the positive quiet one orders above +inf.
        wide[token] = (np.nan if nan_first else -np.inf) if value != value else value + 0.0
    bits = wide.view(np.uint64)
    for token in range(values.shape[0]):
        keys[token] = bits[token] if bits[token] & _SIGN else ~bits[token] & ~_SIGN
        order[token] = token


@numba.njit(cache=True, nogil=True)
def _differing_bits(keys):  # pragma: no cover - compiled
    """The bits that are not the same in every key."""
    common, any_ones = ~np.uint64(0), np.uint64(0)
    for key in keys:
        common &= key
        any_ones |= key
    return common ^ any_ones


@numba.njit(cache=True, nogil=True)
def _radix_passes(keys, spare_keys, order, spare_order, counts, differing, carry_order):  # pragma: no cover
    """Stable LSD passes over the ``differing`` bits of ``keys``, moving ``order`` along when
    ``carry_order``; returns the four arrays with the sorted ones first."""
    low = 0
    while low < 64 and not (differing >> np.uint64(low)) & np.uint64(1):
        low += 1
    high = low
    while high < 64 and differing >> np.uint64(high):
        high += 1
    passes = -(-(high - low) // _MAX_DIGIT_BITS)
    if not passes:  # every key equal: already in token order
        return keys, spare_keys, order, spare_order
    width = -(-(high - low) // passes)
    mask, buckets = np.uint64((1 << width) - 1), 1 << width
    counts[0, :buckets] = 0
    for key in keys:
        counts[0, (key >> np.uint64(low)) & mask] += 1
    for step in range(passes):
        shift = np.uint64(low + step * width)
        following = np.uint64(min(low + (step + 1) * width, 63))  # past the last pass: counted, unread
        current, upcoming = counts[step & 1], counts[1 - (step & 1)]
        offset = 0
        for bucket in range(buckets):
            offset, current[bucket] = offset + current[bucket], offset
        upcoming[:buckets] = 0
        for position in range(keys.shape[0]):
            key = keys[position]
            target = current[(key >> shift) & mask]
            current[(key >> shift) & mask] = target + 1
            spare_keys[target] = key
            upcoming[(key >> following) & mask] += 1
            if carry_order:
                spare_order[target] = order[position]
        keys, spare_keys = spare_keys, keys
        order, spare_order = spare_order, order
    return keys, spare_keys, order, spare_order


@numba.njit(cache=True, nogil=True)
def run_end(keys, start):  # pragma: no cover - compiled
    """The end of the run of equal keys that starts at ``start`` in sorted ``keys``."""
    end = start + 1
    while end < keys.shape[0] and keys[end] == keys[start]:
        end += 1
    return end


@numba.njit(cache=True, nogil=True)
def _descending(values, nan_first, as_places):  # pragma: no cover - compiled; tested through its callers
    num_rows, num_tokens = values.shape
    found = np.empty((num_rows, num_tokens), np.int64)
    buffers = sort_buffers(num_tokens)
    for row in range(num_rows):
        buffers = sort_row(values[row], nan_first, buffers)
        order = buffers[3]
        if as_places:
            for place in range(num_tokens):
                found[row, order[place]] = place
        else:
            found[row] = order
    return found


@functools.cache
def load_compiled() -> None:
    """Make the methods' sort ready in this process: compiled on its first use after an install
    (seconds), loaded from numba's cache after that (a tenth of a second). Timed runs call this
    first, so that the cost is not charged to whichever method sorts first. The methods rank
    float32 and float64 scores (``rankkit.methods.selection``)."""
    for dtype in (np.float32, np.float64):
        _descending(np.zeros((1, 2), dtype), True, False)


def descending_orders(values: np.ndarray, *, nan_first: bool) -> np.ndarray:
    """int64 indices along the last axis of ``values`` from the highest score down, ties in token
    order; NaN first (``nan_first``, as torch's descending sort) or last."""
    return _descending(_rows(values), nan_first, False).reshape(values.shape)


def descending_places(values: np.ndarray, *, nan_first: bool) -> np.ndarray:
    """Each entry's place in ``descending_orders`` along the last axis (0 = highest score), int64."""
    return _descending(_rows(values), nan_first, True).reshape(values.shape)


def _rows(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values.reshape(-1, values.shape[-1]) if values.ndim else values.reshape(1, 1))
