"""A KV cache that remembers each entry's original position and lets heads keep different tokens.

Per layer it holds ``keys``/``values`` [1, kv_heads, S, head_dim] and ``positions``
[kv_heads, S]. Compressing a layer to a different number of tokens per head (SAGE-KV,
LAVa, SnapKV with head budgets) pads the shorter heads to the longest and marks the
padding with position -1; the attention mask is then built from positions alone, which
also keeps causality and sliding windows right after pruning, because original
positions never change.

It satisfies the one method transformers' attention modules call on a cache,
``update(key, value, layer_idx)``.
"""

from __future__ import annotations

import torch

PADDING = -1


class KVCache:
    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.positions: list[torch.Tensor | None] = [None] * num_layers
        self.padded = [False] * num_layers
        self._fresh = [False] * num_layers
        self._incoming: torch.Tensor | None = None
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._ready: dict[int, torch.cuda.Event] = {}

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def begin_step(self, positions: torch.Tensor) -> None:
        """Positions [n] of the tokens whose keys the next ``update`` calls bring."""
        self._incoming = positions

    def wait_before_update(self, layer: int, event: torch.cuda.Event) -> None:
        """Make the next ``update`` of ``layer`` wait for ``event`` (entries written on a side stream)."""
        self._ready[layer] = event

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        ready = self._ready.pop(layer_idx, None)
        if ready is not None:
            torch.cuda.current_stream().wait_event(ready)
        new_positions = self._incoming.to(key.device).expand(key.shape[1], -1)  # beside its layer's keys
        self._fresh[layer_idx] = self.keys[layer_idx] is None
        if self._fresh[layer_idx]:
            self.keys[layer_idx], self.values[layer_idx] = key, value
            self.positions[layer_idx] = new_positions
        else:
            self.keys[layer_idx] = self._append(self.keys, layer_idx, key, dim=2)
            self.values[layer_idx] = self._append(self.values, layer_idx, value, dim=2)
            self.positions[layer_idx] = self._append(self.positions, layer_idx, new_positions, dim=1)
        return self.keys[layer_idx], self.values[layer_idx]

    def _append(self, entries: list, layer: int, new: torch.Tensor, dim: int) -> torch.Tensor:
        """``entries[layer]`` with ``new`` appended along ``dim``, written into spare room when there is some.

        Decoding appends one token per step; growing a buffer with headroom makes that
        amortized O(1) instead of a full copy per step. A view is only ever extended in a
        buffer it owns, so a fork that shares views (``fork``) never sees the other's writes.
        """
        current = entries[layer]
        length, added = current.shape[dim], new.shape[dim]
        buffer = self._buffers.get((id(entries), layer))
        if buffer is None or buffer.data_ptr() != current.data_ptr() or buffer.shape[dim] < length + added:
            shape = list(current.shape)
            shape[dim] = length + added + max(128, (length + added) // 8)
            buffer = current.new_empty(shape)
            buffer.narrow(dim, 0, length).copy_(current)
            self._buffers[(id(entries), layer)] = buffer
        buffer.narrow(dim, length, added).copy_(new)
        return buffer.narrow(dim, 0, length + added)

    def fork(self) -> KVCache:
        """A cache sharing these entries that grows independently (several continuations of one prefill)."""
        twin = KVCache(self.num_layers)
        twin.keys, twin.values, twin.positions = list(self.keys), list(self.values), list(self.positions)
        twin.padded = list(self.padded)
        return twin

    def attention_mask(
        self, layer: int, query_positions: torch.Tensor, sliding_window: int | None = None
    ) -> torch.Tensor | None:
        """Boolean mask [1, kv_heads or 1, n, S] (True = attend), or None when plain causal suffices.

        None means: a fresh prefill (keys are exactly the queries, in order) or one query
        over an unpadded cache of earlier tokens, with no sliding window cutting in.
        """
        key_positions = self.positions[layer]
        n = query_positions.shape[0]
        window_cuts = sliding_window is not None and (
            int(query_positions.max()) - int(key_positions[key_positions != PADDING].min()) >= sliding_window
        )
        if not self.padded[layer] and not window_cuts and (self._fresh[layer] or n == 1):
            return None
        keys = key_positions[:, None, :]
        queries = query_positions[None, :, None]
        allowed = (keys <= queries) & (keys != PADDING)
        if sliding_window is not None:
            allowed &= keys > queries - sliding_window
        if not self.padded[layer]:
            allowed = allowed[:1]
        return allowed[None]

    def compress(self, layer: int, keep: torch.Tensor | list[torch.Tensor]) -> None:
        """Keep, per KV head, the cache entries at ``keep`` (indices into the current entries).

        ``keep`` is [kv_heads, k] when every head keeps k entries, or a list of one index
        tensor per head when budgets differ (the shorter heads are padded).
        """
        keys, values, positions = self.keys[layer], self.values[layer], self.positions[layer]
        if isinstance(keep, torch.Tensor):
            index = torch.sort(keep.to(keys.device), dim=1).values
            valid = None
        else:
            per_head = [torch.sort(k.to(keys.device).reshape(-1)).values for k in keep]
            width = max(int(k.numel()) for k in per_head)
            index = torch.zeros(len(per_head), width, dtype=torch.long, device=keys.device)
            valid = torch.zeros_like(index, dtype=torch.bool)
            for head, kept in enumerate(per_head):
                index[head, : kept.numel()] = kept
                valid[head, : kept.numel()] = True
        gather = index[None, :, :, None].expand(1, -1, -1, keys.shape[-1])
        self.keys[layer] = keys.gather(2, gather)
        self.values[layer] = values.gather(2, gather)
        new_positions = positions.gather(1, index)
        if valid is not None and not bool(valid.all()):
            new_positions = new_positions.masked_fill(~valid, PADDING)
            self.padded[layer] = True
        self.positions[layer] = new_positions
        self._fresh[layer] = False

    def kept_tokens(self, layer: int) -> torch.Tensor:
        """Number of real (unpadded) entries per KV head [kv_heads]."""
        return (self.positions[layer] != PADDING).sum(dim=1)

    def nbytes(self, live_only: bool = True) -> int:
        """Bytes of keys and values; ``live_only`` counts real entries only, not padding."""
        total = 0
        for keys, positions in zip(self.keys, self.positions, strict=True):
            if keys is None:
                continue
            per_entry = keys.shape[-1] * keys.element_size() * 2
            entries = int((positions != PADDING).sum()) if live_only else positions.numel()
            total += entries * per_entry
        return total

    def get_seq_length(self, layer_idx: int = 0) -> int:
        positions = self.positions[layer_idx]
        return 0 if positions is None else positions.shape[1]
