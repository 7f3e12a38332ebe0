"""Attention of the last few queries over every key, the one quantity most probes start from.

Everything is computed per KV head with its query heads grouped beside it
([kv_heads, group, W, S], query head ``h`` reads KV head ``h // group`` as in HF's
``repeat_kv``), so keys are never repeated per query head and the largest tensor is
W x S per query head, never S x S.

Inputs may be bf16/fp16: queries and keys are upcast once and every product and sum
accumulates in float32.

Visibility comes from original positions, not indices: key ``i`` is visible to query
``j`` when ``key_position[i] <= query_position[j]``, ``i`` is not cache padding, and on
a sliding-window layer ``key_position[i] > query_position[j] - window``. This is the
mask the model itself applies, and it stays right after pruning or over a cache.

The logits and softmax are the ones the model computes: soft-capped where the family
caps (Gemma 2/3) and normalized with the family's attention sinks (GPT-OSS), through
``AttentionCall.cap`` and ``AttentionCall.softmax``. Keys a local layer cannot see at
all get no score: ``ProbeRecorder`` stores NaN for them.
"""

from __future__ import annotations

import torch

from rankkit.cache import allowed_keys
from rankkit.errors import RankkitError
from rankkit.runner import AttentionCall


def check_window_size(window_size: int) -> None:
    if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
        raise RankkitError(f"window_size must be an integer of at least 1, not {window_size!r}")


def window_length(call: AttentionCall, window_size: int) -> int:
    """The queries actually used: the last ``window_size``, or all of them when fewer arrived (T < W)."""
    return min(window_size, call.query.shape[2])


SHARED_WINDOW = "window"  # AttentionCall.shared: (probabilities of the widest window, its last query's logits)


def share_window(call: AttentionCall, window_size: int) -> None:
    """Compute the attention of the widest window that several probes of one call read, once.

    A narrower window's probabilities are its last rows (each query's softmax is its own, whatever
    other queries the window holds) and the last query's logits are kept beside them; the other
    rows' logits are dropped, so only one W x S block per query head stays alive.
    """
    logits = window_logits(call, window_size)
    call.shared[SHARED_WINDOW] = (call.softmax(logits), logits[:, :, -1:].clone())


def window_logits(call: AttentionCall, window_size: int) -> torch.Tensor:
    """Scaled, capped logits of the window queries: float32 [kv_heads, group, W, S].

    Keys a query cannot see (later positions, cache padding, outside a sliding window) are -inf.
    """
    shared = call.shared.get(SHARED_WINDOW)
    if shared is not None and window_length(call, window_size) == 1:
        return shared[1]
    kv_heads, keys_length = call.key.shape[1], call.key.shape[2]
    window = window_length(call, window_size)
    queries = call.query[0, :, -window:].float().reshape(kv_heads, call.group_size * window, -1)
    keys = call.key[0].float()
    logits = torch.bmm(queries, keys.transpose(1, 2)).mul_(call.scaling)
    logits = call.cap(logits.view(kv_heads, call.group_size, window, keys_length))
    if call.sees_every_key:  # a decode step over a plain cache: nothing to hide, nothing to launch
        return logits
    return logits.masked_fill_(hidden_keys(call, window)[:, None], float("-inf"))


def hidden_keys(call: AttentionCall, window: int) -> torch.Tensor:
    """Bool [kv_heads or 1, W, S]: True where one of the last ``window`` queries cannot see a key, the
    model's own mask (``allowed_keys``) turned over.

    Made once for the layers of a step that read the same positions (``AttentionCall.per_step``):
    at every scoring layer but the first, one operator applies it where four made it.
    """
    key_positions, query_positions = call.key_positions, call.query_positions[-window:]

    def make() -> torch.Tensor:
        # every head reads the same keys when the positions are one row expanded (a prefill's)
        per_head = key_positions.stride(0) != 0
        return ~allowed_keys(key_positions, query_positions, call.sliding_window, per_head)[0]

    return call.per_step("hidden_keys", (key_positions, query_positions), (call.sliding_window,), make)


def window_attention(call: AttentionCall, window_size: int) -> torch.Tensor:
    """Softmax attention of each window query, summed over the window: float32 [kv_heads, group, S].

    CLAA Eq. 5 / ASL Algorithm 1 lines 3-4 before any head reduction or pooling; a key
    outside a query's causal view contributes zero for that query.
    """
    shared = call.shared.get(SHARED_WINDOW)
    window = window_length(call, window_size)
    if shared is not None and shared[0].shape[2] >= window:
        return shared[0][:, :, -window:].sum(dim=2)
    return call.softmax(window_logits(call, window_size)).sum(dim=2)
