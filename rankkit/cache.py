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

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

PADDING = -1
# a layer's entries come in three kinds, keys, values and positions (``KVCache._entry_lists``), each
# along its own axis
ENTRY_AXES = (2, 2, 1)
KEYS, VALUES, POSITIONS = 0, 1, 2


def _views_of(buffer: torch.Tensor | None, entries: torch.Tensor) -> bool:
    """Whether ``entries`` are a view of ``buffer`` (from its start): what a cache writes in place."""
    return buffer is not None and buffer.data_ptr() == entries.data_ptr()


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``host`` (values the host decided, such as slots) on ``device``. On CUDA the copy
    starts from page-locked memory, so the host goes on launching work instead of waiting for the
    device to reach the copy, as a copy from pageable memory would."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def allowed_keys(
    key_positions: torch.Tensor, query_positions: torch.Tensor, sliding_window: int | None, per_head: bool
) -> torch.Tensor:
    """Bool [1, kv_heads (``per_head``) or 1, n, S]: a query attends to a real key no later than
    itself, and within ``sliding_window`` of it where the layer has one. The one masking rule.

    A decode step's one query (n = 1, a global layer) comes after every entry a cache holds,
    since each was written by an earlier step or by this one: only padding is hidden, one
    operator where the comparison with the query takes three, at every layer of every step.
    """
    keys = key_positions[:, None, :] if per_head else key_positions[:1, None, :]
    if query_positions.shape[0] == 1 and sliding_window is None:
        return (keys != PADDING)[None]
    queries = query_positions[None, :, None]
    allowed = (keys <= queries) & (keys != PADDING)
    if sliding_window is not None:
        allowed &= keys > queries - sliding_window
    return allowed[None]


@dataclass(frozen=True)
class _Appended:
    """A layer's positions before a step (kept alive, so no other tensor takes their address) and after
    its append (``KVCache._append_positions``)."""

    before: torch.Tensor
    positions: torch.Tensor
    layer: int


@dataclass(frozen=True)
class RecentWindow:
    """A layer's rolling window (``KVCache.keep_recent_window``): its last ``size`` of ``full_length`` entries."""

    size: int
    full_length: int

    @property
    def first_slot(self) -> int:
        return self.full_length - self.size

    def slot_after(self, slot: int) -> int:
        """The slot a step writes after one wrote ``slot``: the next, or back to the window's first
        (``StaticKVCache.begin_step`` is the same rule on the device, for every layer at once)."""
        return self.first_slot if slot + 1 == self.full_length else slot + 1


class KVCache:
    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.positions: list[torch.Tensor | None] = [None] * num_layers
        self.padded = [False] * num_layers
        self.heads_differ = [False] * num_layers  # compressed per head: positions differ between heads
        self._fresh = [False] * num_layers
        self._incoming: torch.Tensor | None = None
        self._step_slots: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # ``_append``'s, made once a step
        self._offsets: dict[torch.device, torch.Tensor] = {}  # 0, 1, 2, ... on each device (``_slots``)
        self._buffers: dict[int, list] = {}  # each layer's buffers of its own, per kind of entry (_owned)
        # (kind, layer) -> how many of the entries in the layer's buffer of that kind other layers read
        # too (``_append_positions``): the buffer is written in place only after them
        self._lent: dict[tuple[int, int], int] = {}
        self._step_positions: dict[tuple, _Appended] = {}  # ``_append_positions``'s, made once a step
        self.windows: dict[int, RecentWindow] = {}  # the layers that keep a rolling window (keep_recent_window)
        self._window_slots: dict[int, int] = {}  # each full window's slot the next step writes
        self.held: dict[int, int] = {}  # the layers whose decode evicts back to this many entries (hold_size)
        self._real: dict[int, torch.Tensor] = {}  # each padded layer's unpadded entries, with room (decode_mask)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def begin_step(self, positions: torch.Tensor) -> None:
        """Positions [n] of the tokens whose keys the next ``update`` calls bring."""
        self._incoming = positions
        self._step_slots = {}
        self._step_positions = {}

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        incoming = self._incoming
        if incoming.device != key.device:  # a device map: beside its layer's keys (a same-device .to costs too)
            incoming = incoming.to(key.device)
        fresh = self._fresh[layer_idx] = self.keys[layer_idx] is None
        window = self._full_window(layer_idx) if self.windows and not fresh else None
        if fresh:
            self.keys[layer_idx], self.values[layer_idx] = key, value
            self.positions[layer_idx] = incoming.expand(key.shape[1], -1)
        elif window is not None and key.shape[2] == 1:
            self._write_in_window(layer_idx, window, (key, value, incoming))
        else:
            self._append(layer_idx, (key, value, incoming))
        return self.keys[layer_idx], self.values[layer_idx]

    def _entry_lists(self) -> tuple[list, list, list]:
        """keys, values and positions: the lists ``ENTRY_AXES`` and a layer's buffers follow."""
        return self.keys, self.values, self.positions

    def _append(self, layer: int, new: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Append ``new`` (keys, values, positions [n], the same for every head) to the layer's entries,
        written into spare room when its buffers have some.

        Decoding appends one token per step; growing a buffer with headroom makes that
        amortized O(1) instead of a full copy per step. A view is only ever extended in a
        buffer it owns, so a fork that shares views (``fork``) never sees the other's writes.
        One step appends at every layer of a host-bound decode, so the work here is the
        fewest operators that can do it: one write and one view per kind of entry, the slots written
        and the positions for every head made once a step for the layers of one length (``_step_slots``),
        and positions written once for the layers that hold the same (``_append_positions``).
        """
        length, added = self.keys[layer].shape[2], new[0].shape[2]
        end = length + added
        shared = (length, new[0].shape[1], new[0].device)  # the layers of a plain step share one
        if shared not in self._step_slots:
            self._step_slots[shared] = self._slots(length, added, shared[2]), new[2].expand(shared[1], -1)
        slots, positions = self._step_slots[shared]
        for kind in (KEYS, VALUES):
            self._extend(kind, layer, slots, new[kind], end)
        self._append_positions(layer, slots, positions, end)

    def _append_positions(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, end: int) -> None:
        """``_extend`` the layer's positions, unless another layer's held the same entries before the
        step: then it takes that layer's appended positions, the same values, and writes nothing. The
        layers of a plain decode hold the same positions, so one of them writes them for all."""
        before = self.positions[layer]
        key = (before.data_ptr(), before.shape, before.stride(), before.device)
        appended = self._step_positions.get(key)
        if appended is not None:
            self.positions[layer] = appended.positions
            self._lent[POSITIONS, appended.layer] = end
            return
        self._extend(POSITIONS, layer, slots, positions, end)
        self._step_positions[key] = _Appended(before, self.positions[layer], layer)

    def _extend(self, kind: int, layer: int, slots: torch.Tensor, entry: torch.Tensor, end: int) -> None:
        """Write ``entry`` at ``slots``, after the layer's entries of ``kind``, in place where their buffer
        is the layer's own, has room, and no other layer reads past them (``_lent``)."""
        entries, axis = self._entry_lists()[kind], ENTRY_AXES[kind]
        current = entries[layer]
        length = current.shape[axis]
        buffers = self._buffers.setdefault(layer, [None, None, None])
        buffer = buffers[kind]
        read_beyond = self._lent.get((kind, layer), 0) > length  # a write here would change another layer's
        if not _views_of(buffer, current) or buffer.shape[axis] < end or read_beyond:
            shape = list(current.shape)
            shape[axis] = end + max(128, end // 8)
            buffer = buffers[kind] = current.new_empty(shape)
            buffer.narrow(axis, 0, length).copy_(current)
            self._lent.pop((kind, layer), None)
        buffer.index_copy_(axis, slots, entry)
        entries[layer] = buffer.narrow(axis, 0, end)

    def _slots(self, start: int, count: int, device: torch.device) -> torch.Tensor:
        """The slot numbers ``start`` .. ``start + count`` on ``device``: a view of offsets made once and
        grown by doubling, so a step's appends launch nothing to name the slots they write."""
        offsets = self._offsets.get(device)
        if offsets is None or offsets.shape[0] < start + count:
            offsets = self._offsets[device] = torch.arange(2 * (start + count), device=device)
        return offsets.narrow(0, start, count)

    def keep_recent_window(self, layer: int, size: int, full_length: int) -> None:
        """From the step that brings ``layer`` to ``full_length`` entries on, each one-token step writes
        over the oldest of the layer's last ``size`` entries, its rolling window (that step's token
        included), instead of growing the cache: StreamingLLM's and SAGE-KV's (Step 4) recent
        window, the entries before it untouched. Between steps the cache holds what the last step
        attended to.

        When the window fills, its entries lie in its slots in position order, as a prefill and the
        appends after it leave them (a head's padding lies before them), so the window is a ring of
        slots from then on: the slot a step writes is a host number, the same for every head, and a
        step writes into it as an append would at the end, no search and no move. Entry order is
        free: masks come from positions.
        """
        if not 0 < size <= full_length or full_length <= self.get_seq_length(layer):
            raise ValueError(f"layer {layer}: a window of {size} in {full_length} entries, which it holds")
        self.windows[layer] = RecentWindow(size, full_length)

    def roll_local_layer(self, layer: int, sliding_window: int) -> None:
        """Keep a local layer's last ``sliding_window`` entries and roll a ring of ``sliding_window`` + 1
        over them in decoding (``keep_recent_window``): what transformers' sliding-window cache keeps,
        where appending would hold every key for good.

        The layer's entries lie in position order in every head with no padding, so the entries
        before the last window lie a window behind the next query, and before a step the oldest of
        sliding_window + 1 distinct earlier positions lies a window behind the step's query: the
        cut and the ring drop only keys no later step can see. Fewer entries than the ring grow
        into it first, as every window does.
        """
        length = self.get_seq_length(layer)
        if sliding_window < length:
            for entries, axis in zip(self._entry_lists(), ENTRY_AXES, strict=True):
                # a copy, so the older entries' memory is freed
                entries[layer] = entries[layer].narrow(axis, length - sliding_window, sliding_window).clone()
            self._buffers.pop(layer, None)
            self._fresh[layer] = False
        self.keep_recent_window(layer, sliding_window + 1, sliding_window + 1)

    def hold_size(self, layer: int, size: int) -> None:
        """Declare that every decode step of ``layer`` that brings it past ``size`` entries is followed
        by an ``evict``, so the layer grows by one entry a step until it holds ``size`` between steps
        (TOVA's fixed number of states; a local layer that saw fewer keys starts below it): what lets
        a static cache keep the layer in its first ``size`` + 1 slots (``StaticKVCache.evict``). The
        dynamic cache appends and evicts as it would without this."""
        if self.get_seq_length(layer) > size:
            raise ValueError(f"layer {layer} holds {self.get_seq_length(layer)} entries, more than {size}")
        self.held[layer] = size

    def _full_window(self, layer: int) -> RecentWindow | None:
        """The layer's window once the layer holds all of it (its steps write in the window), else None."""
        window = self.windows.get(layer)
        return window if window is not None and self.get_seq_length(layer) == window.full_length else None

    def _write_in_window(self, layer: int, window: RecentWindow, new: tuple) -> None:
        slot = self._window_slot(layer, window)
        self._window_slots[layer] = window.slot_after(slot)
        for kind, (entry, axis) in enumerate(zip(new, ENTRY_AXES, strict=True)):
            self._owned(kind, layer).narrow(axis, slot, 1).copy_(entry)

    def _window_slot(self, layer: int, window: RecentWindow) -> int:
        """The slot of a full window the layer's next step writes: its first until a step has written."""
        return self._window_slots.get(layer, window.first_slot)

    def _owned(self, kind: int, layer: int) -> torch.Tensor:
        """The layer's entries of ``kind`` (``ENTRY_AXES``), first copied into a buffer of this cache's own
        unless they are a view of one: only such a buffer is written in place (a prefill's tensor, or
        one a fork shares with its twin, is not)."""
        entries = self._entry_lists()[kind]
        buffers = self._buffers.setdefault(layer, [None, None, None])
        if not _views_of(buffers[kind], entries[layer]) or (kind, layer) in self._lent:
            entries[layer] = buffers[kind] = entries[layer].clone()
            self._lent.pop((kind, layer), None)
        return entries[layer]

    def evict(self, layer: int, slot: torch.Tensor) -> None:
        """Drop every head's entry at ``slot`` (a one-element index on the device): the layer's last
        entry takes its place and the layer is one entry shorter. Nothing is read from the device
        and one entry is copied, where keeping all the others would gather the whole layer (entry
        order is free: masks come from positions)."""
        for kind, (entries, axis) in enumerate(zip(self._entry_lists(), ENTRY_AXES, strict=True)):
            owned = self._owned(kind, layer)
            last = owned.shape[axis] - 1
            owned.index_copy_(axis, slot, owned.narrow(axis, last, 1).clone())  # the slot may be the last one
            entries[layer] = owned.narrow(axis, 0, last)

    def evictable(self, layer: int) -> tuple[int, float | None]:
        """The slots an ``evict`` of ``layer`` chooses among (its first this many), and the score an empty
        one of them (position ``PADDING``) ranks by: here every entry, padding never dropped (None:
        the layer has none)."""
        return self.positions[layer].shape[1], torch.inf if self.padded[layer] else None

    def rearrange(self, layer: int, slots: torch.Tensor, size: int) -> None:
        """Move every entry of ``layer`` to its slot of ``slots`` [S] (on the device) among ``size`` slots;
        the slots no entry takes are padding, and an entry whose slot is ``size`` is dropped. Nothing
        is read: the host chose ``size`` (entry order is free: masks come from positions)."""
        for entries, axis, fill in zip(self._entry_lists(), ENTRY_AXES, (0, 0, PADDING), strict=True):
            current = entries[layer]
            shape = list(current.shape)
            shape[axis] = size + 1  # slot ``size`` takes the dropped entries
            entries[layer] = current.new_full(shape, fill).index_copy_(axis, slots, current).narrow(axis, 0, size)
        self.padded[layer] = True
        self._fresh[layer] = False
        for memo in (self._real, self.windows, self._window_slots, self.held):  # made for the layer's old entries
            memo.pop(layer, None)

    def truncate(self, layer: int, length: int) -> None:
        """Keep the layer's first ``length`` slots."""
        for entries, axis in zip(self._entry_lists(), ENTRY_AXES, strict=True):
            entries[layer] = entries[layer].narrow(axis, 0, length)
        self._real.pop(layer, None)

    def declare_padding(self, layer: int, padded: bool) -> None:
        """Whether any of the layer's slots is padding, as the host knows: a layer with none is attended
        by a decode step with no mask. The padding itself is unchanged, so a decode mask made for it stays."""
        self.padded[layer] = padded

    def write(
        self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Write entries (``positions`` [kv_heads, n], -1 marking padding) over the layer's slots from
        ``start`` on, in place: what moves a block back into a slot a block left (SlimInfer Alg. 1)."""
        for kind, (new, axis) in enumerate(zip((keys, values, positions), ENTRY_AXES, strict=True)):
            self._owned(kind, layer).narrow(axis, start, new.shape[axis]).copy_(new, non_blocking=True)
        self._real.pop(layer, None)  # the padding moved

    def clear(self, layer: int, start: int, length: int) -> None:
        """Mark the layer's slots ``start`` .. ``start + length`` as padding, in place."""
        self._owned(POSITIONS, layer).narrow(1, start, length).fill_(PADDING)
        self._real.pop(layer, None)

    def next_slot(self, layer: int) -> int:
        """The slot the layer's next one-token step writes."""
        window = self._full_window(layer)
        return self.get_seq_length(layer) if window is None else self._window_slot(layer, window)

    def fork(self) -> KVCache:
        """A cache sharing these entries that grows independently (several continuations of one prefill)."""
        twin = KVCache(self.num_layers)
        twin.keys, twin.values, twin.positions = list(self.keys), list(self.values), list(self.positions)
        twin.padded = list(self.padded)
        twin.heads_differ = list(self.heads_differ)
        twin.windows = dict(self.windows)
        twin._window_slots = dict(self._window_slots)  # the slot order of the entries they share
        twin.held = dict(self.held)
        twin._real = dict(self._real)  # never written once made
        self._buffers.clear()  # a write in place would show in the twin: each copies before its next
        self._lent.clear()
        return twin

    def attention_mask(
        self, layer: int, query_positions: torch.Tensor, sliding_window: int | None = None
    ) -> torch.Tensor | None:
        """Boolean mask [1, kv_heads or 1, n, S] (True = attend), or None when plain causal suffices.

        None means: a fresh prefill (keys are exactly the queries, in order) or one query
        over an unpadded cache of earlier tokens, on a global layer. A sliding-window layer
        always gets its mask: whether the window cuts in would have to be read from the
        device at every layer.
        """
        n = query_positions.shape[0]
        if self.sees_every_key(layer, n, sliding_window):
            return None
        if self._fresh[layer] and not self.padded[layer] and sliding_window is None:
            return None  # plain causal
        if n == 1 and sliding_window is None:
            return self._decode_mask(layer, query_positions)
        per_head = self.padded[layer] or self.heads_differ[layer]
        return allowed_keys(self.positions[layer], query_positions, sliding_window, per_head)

    def sees_every_key(self, layer: int, queries: int, sliding_window: int | None) -> bool:
        """Whether each of ``queries`` new tokens may attend to every entry of the layer: one query
        over a cache of earlier tokens with no padding, on a global layer."""
        return queries == 1 and not self.padded[layer] and sliding_window is None

    def _decode_mask(self, layer: int, query_positions: torch.Tensor) -> torch.Tensor:
        """A padded global layer's decode mask, made once and narrowed at every later step: an entry a
        step appends or writes in a window is real, so the mask is made with True in the room after
        the entries, and a step launches nothing for it (the mask is the cache's padding, which only
        ``compress`` changes)."""
        positions = self.positions[layer]
        length = positions.shape[1]
        real = self._real.get(layer)
        if real is None or real.shape[-1] < length:
            allowed = allowed_keys(positions, query_positions, None, per_head=True)
            real = allowed.new_ones(*allowed.shape[:-1], length + max(128, length // 8))
            real[..., :length] = allowed
            self._real[layer] = real
        return real[..., :length]

    def compress(self, layer: int, keep: torch.Tensor | list[torch.Tensor]) -> None:
        """Keep, per KV head, the cache entries at ``keep`` (ascending indices into the current entries).

        ``keep`` is [kv_heads, k] when every head keeps k entries, or a list of one index
        tensor per head when budgets differ (the shorter heads are padded). The indices come
        ascending, as every top-k here returns them, so the entries stay in their order
        without a sort per compressed layer.
        """
        keys, values, positions = self.keys[layer], self.values[layer], self.positions[layer]
        if isinstance(keep, torch.Tensor):
            index = keep.to(keys.device)
            lengths = None
        else:
            per_head = [k.to(keys.device).reshape(-1) for k in keep]
            index = pad_sequence(per_head, batch_first=True)  # padded with entry 0, marked as padding below
            lengths = [k.numel() for k in per_head]
        gather = index[None, :, :, None].expand(1, -1, -1, keys.shape[-1])
        self.keys[layer] = keys.gather(2, gather)
        self.values[layer] = values.gather(2, gather)
        new_positions = positions.gather(1, index)
        if lengths is not None and min(lengths) < max(lengths):  # sizes the host knows: no device read
            rows = [row[:length] for row, length in zip(new_positions, lengths, strict=True)]
            new_positions = pad_sequence(rows, batch_first=True, padding_value=PADDING)
            self.padded[layer] = True
        self.positions[layer] = new_positions
        self.heads_differ[layer] = True
        self._fresh[layer] = False
        for memo in (self._real, self.windows, self._window_slots, self.held):  # made for the layer's old entries
            memo.pop(layer, None)

    def compress_to_mask(self, layer: int, kept: torch.Tensor, width: int) -> None:
        """Keep, per KV head, the entries where ``kept`` [kv_heads, S] is True, padded to ``width``.

        ``width`` is a bound the caller knows (a budget) on how many any head keeps, so the
        cache's shape needs nothing read from the device, where ragged index lists would.
        """
        width = min(width, kept.shape[1])
        dropped = ~kept.to(self.positions[layer].device)
        # the kept entries first, each group in entry order; then back into entry order
        first = torch.sort(dropped.to(torch.uint8), dim=1, stable=True).indices[:, :width]
        index = torch.sort(first, dim=1).values
        self.compress(layer, index)
        self.positions[layer] = self.positions[layer].masked_fill(dropped.gather(1, index), PADDING)
        self.padded[layer] = True

    def trim_padding(self, layers: list[int]) -> None:
        """Shrink each of ``layers`` to its widest head's real entries, with one read of all widths.

        A method that compresses to a bound it knows without reading (``compress_to_mask``
        with a budget) calls this once its prefill is over, so decoding reads no padding
        beyond the widest head; the entries kept, their order and the padding that stays
        are those one ``compress_to_mask`` at the exact width would leave.
        """
        if not layers:
            return
        widths = torch.stack([self.kept_tokens(layer).amax() for layer in layers]).tolist()
        for layer, width in zip(layers, widths, strict=True):
            if width < self.positions[layer].shape[1]:
                self.compress_to_mask(layer, self.positions[layer] != PADDING, width)

    def kept_tokens(self, layer: int) -> torch.Tensor:
        """Number of real (unpadded) entries per KV head [kv_heads]."""
        return (self.positions[layer] != PADDING).sum(dim=1)

    def kept_tokens_per_layer(self) -> list[list[int]]:
        """Real entries per KV head of every filled layer, read from the device at once."""
        counts = [self.kept_tokens(layer) for layer, keys in enumerate(self.keys) if keys is not None]
        return torch.stack(counts).tolist() if counts else []

    def nbytes(self, live_only: bool = True) -> int:
        """Bytes of keys and values; ``live_only`` counts real entries only, not padding."""
        filled = [layer for layer, keys in enumerate(self.keys) if keys is not None]
        if live_only:
            entries = [sum(kept) for kept in self.kept_tokens_per_layer()]
        else:
            entries = [self.positions[layer].numel() for layer in filled]
        return sum(
            count * self.keys[layer].shape[-1] * self.keys[layer].element_size() * 2
            for layer, count in zip(filled, entries, strict=True)
        )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        positions = self.positions[layer_idx]
        return 0 if positions is None else positions.shape[1]


STATIC_BUCKET = 256  # static buffers grow in steps of this many entries, so nearby lengths share a shape


class StaticKVCache(KVCache):
    """Decoding over buffers of fixed size: what lets a decode step be captured once as a CUDA graph.

    Each layer's entries are copied into a buffer with room for ``room`` more tokens (rounded
    up to ``STATIC_BUCKET``); the unused tail has position -1, so the one masking rule
    (``allowed_keys``) hides it, as it hides the padding of ragged heads. Each step writes its
    token at the layer's next slot, an index kept on the device (in a rolling window, the
    ring's next slot: ``KVCache.keep_recent_window``), so no shape and no host value changes
    from step to step. ``load`` refills the same buffers from another cache of the same shape
    (a cached graph replays over them).
    """

    def __init__(self, cache: KVCache, room: int):
        super().__init__(cache.num_layers)
        for layer, buckets in enumerate(self.buckets(cache, room)):
            keys, positions = cache.keys[layer], cache.positions[layer]
            capacity = buckets * STATIC_BUCKET
            self.keys[layer] = keys.new_zeros(*keys.shape[:2], capacity, keys.shape[-1])
            self.values[layer] = self.keys[layer].clone()
            self.positions[layer] = positions.new_full((positions.shape[0], capacity), PADDING)
        self.padded = [True] * cache.num_layers
        # per layer, on the device: the slot the last step wrote, and the window's slots [start, end)
        # the writes cycle through (a layer without one: its buffer, whose end no step reaches)
        self._slots = torch.zeros(3, cache.num_layers, dtype=torch.long, device=cache.keys[0].device)
        self._written, self._window_starts, self._window_ends = self._slots
        self.load(cache)

    @staticmethod
    def buckets(cache: KVCache, room: int) -> list[int]:
        """Each layer's buffer, in ``STATIC_BUCKET``s: its entries and ``room`` more, and a held layer
        (``hold_size``) its size and the one slot a step writes before its eviction, which may be
        more where a local layer starts under its size."""
        slots = [
            max(positions.shape[1] + room, cache.held.get(layer, -1) + 1)
            for layer, positions in enumerate(cache.positions)
        ]
        return [-(-count // STATIC_BUCKET) for count in slots]

    @staticmethod
    def shape_of(cache: KVCache, room: int) -> tuple:
        """What decides whether a static cache (and a graph captured over it) can take ``cache``."""
        buckets = StaticKVCache.buckets(cache, room)
        held = tuple(sorted(cache.held.items()))  # a graph's eviction chooses among a held size's slots
        return (tuple(buckets), tuple(cache.keys[0].shape[1::2]), cache.keys[0].dtype, cache.keys[0].device, held)

    @staticmethod
    def buffer_bytes(shape: tuple) -> int:
        """Bytes the buffers of a static cache of ``shape`` (``shape_of``) hold: keys, values, positions."""
        lengths, (kv_heads, head_dim), dtype, _, _ = shape
        slots = sum(lengths) * STATIC_BUCKET * kv_heads
        return slots * (2 * head_dim * dtype.itemsize + torch.long.itemsize)

    def load(self, cache: KVCache) -> None:
        """Copy ``cache``'s entries into these buffers (every slot after them padding), the sizes its
        layers hold, and the slots its steps write: a window's ring, else the buffer (a held layer's
        from its first eviction on: the slot it freed)."""
        slots = []
        self.held = dict(cache.held)
        for layer in range(self.num_layers):
            length = cache.positions[layer].shape[1]
            self.keys[layer][:, :, :length].copy_(cache.keys[layer])
            self.values[layer][:, :, :length].copy_(cache.values[layer])
            self.positions[layer][:, :length].copy_(cache.positions[layer])
            self.positions[layer][:, length:].fill_(PADDING)
            window = cache.windows.get(layer)
            if window is not None:
                start, end = window.first_slot, window.full_length
            else:
                start, end = 0, self.positions[layer].shape[1]
            slots.append((cache.next_slot(layer) - 1, start, end))  # a step writes one past the last
        self._slots.copy_(to_device(torch.tensor(slots).T, self._slots.device))

    def begin_step(self, positions: torch.Tensor) -> None:
        """As ``KVCache.begin_step``; every layer's write slot moves on, in one go (a window's wraps)."""
        super().begin_step(positions)
        following = self._written + 1
        torch.where(following == self._window_ends, self._window_starts, following, out=self._written)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        slot = self._written[layer_idx : layer_idx + 1]
        self.keys[layer_idx].index_copy_(2, slot, key)
        self.values[layer_idx].index_copy_(2, slot, value)
        heads = self.positions[layer_idx].shape[0]
        self.positions[layer_idx].index_copy_(1, slot, self._incoming.expand(heads, -1))
        return self.keys[layer_idx], self.values[layer_idx]

    def attention_mask(self, layer, query_positions, sliding_window=None):
        return allowed_keys(self.positions[layer], query_positions, sliding_window, per_head=True)

    def evict(self, layer: int, slot: torch.Tensor) -> None:
        """``KVCache.evict`` over fixed buffers, for a layer that holds a size (``hold_size``): the
        entry at ``slot`` (a one-element index on the device) becomes padding, and the next step
        writes its token there. ``slot`` is one of the layer's first size + 1 (``evictable``), an
        empty one ranked lowest: so while the layer is under its size, a step fills an empty slot
        and drops nothing, as the dynamic cache, which only evicts past it, does. Two operators,
        decided on the device; an entry's slot may differ from the dynamic cache's (entry order is
        free: masks come from positions)."""
        self.positions[layer].index_fill_(1, slot, PADDING)
        torch.sub(slot, 1, out=self._written[layer : layer + 1])  # ``begin_step`` moves on by one

    def evictable(self, layer: int) -> tuple[int, float | None]:
        """A held layer's size + 1 first slots, where its entries lie, an empty one ranked lowest: the
        slot the next step writes."""
        return self.held[layer] + 1, -torch.inf

    def _owned(self, kind: int, layer: int) -> torch.Tensor:
        return self._entry_lists()[kind][layer]  # every buffer is this cache's own

    def declare_padding(self, layer: int, padded: bool) -> None:
        pass  # every layer's tail is padding: its steps are masked

    def compress(self, layer, keep):
        raise RuntimeError("a static cache is for decoding only; compress the cache before making it static")
