"""The runner against transformers' own forward and generate, and its pruning and cache semantics."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from rankkit.cache import PADDING, KVCache
from rankkit.runner import LayerHook, Runner


class Recorder(LayerHook):
    def __init__(self):
        self.calls = []

    def on_attention(self, call):
        self.calls.append((call.layer, call.phase, call.query_positions.clone(), call.key_positions.clone()))


class PruneAfter(LayerHook):
    def __init__(self, layer, keep):
        self.layer, self.keep = layer, keep

    def after_layer(self, layer, state):
        if layer == self.layer:
            state.prune(self.keep)


def test_full_prefill_matches_model_logits(family, random_ids):
    model = tiny_model(family)
    with torch.inference_mode():
        expected = model(random_ids[None]).logits[0]
    result = Runner(model).prefill(random_ids, logits_at="all")
    assert torch.allclose(result.logits, expected, atol=1e-4)
    assert result.live_tokens == [40, 40, 40]


def test_greedy_decode_matches_generate(family, random_ids):
    model = tiny_model(family)
    expected = model.generate(random_ids[None], max_new_tokens=12, do_sample=False)[0, 40:].tolist()
    assert Runner(model).generate(random_ids, 12).tokens == expected


@pytest.mark.parametrize("family_name", ["llama", "gemma2"])  # SDPA, and eager for soft-capping
def test_plain_model_call_is_unchanged_after_a_run(family_name):
    model = tiny_model(family_name)
    implementation = model.config._attn_implementation
    ids = torch.arange(20)
    with torch.inference_mode():
        before = model(ids[None]).logits
        Runner(model).generate(ids, 3)
        after = model(ids[None]).logits
    assert model.config._attn_implementation == implementation
    assert torch.equal(before, after)


def test_explicit_per_layer_device_map_runs_like_the_model(tiny_folder):
    """The device-map load path with one entry per layer, on CPU (one device: placement is a no-op here)."""
    from rankkit import models

    layout = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    layout |= {f"model.layers.{index}": "cpu" for index in range(3)}
    loaded = models.load(str(tiny_folder), device="cpu", device_map=layout)
    ids = torch.arange(5, 45)
    expected = loaded.model.generate(ids[None], max_new_tokens=4, do_sample=False)[0, 40:].tolist()
    generation = Runner(loaded.model).generate(ids, 4)
    assert generation.tokens == expected
    assert all(keys.device.type == "cpu" for keys in generation.prefill.cache.keys)
    spread = Runner(loaded.model)
    spread.spread = True  # the path of layers on several devices: every tensor follows its layer
    assert spread.generate(ids, 4).tokens == expected


def test_a_decode_step_on_one_device_moves_nothing_per_layer(random_ids):
    """A ``.to`` to the device a tensor is already on launches nothing but still costs the host a
    dispatch, per layer, which an eager GPU decode pays in time: only a spread runner calls them."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from rankkit.runner import greedy_continue

    class Moves(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += str(func) in ("aten.to.device", "aten.to.dtype_layout", "aten._to_copy.default")
            return func(*args, **(kwargs or {}))

    moved = Counter()
    for spread in (False, True):
        runner = Runner(tiny_model("llama"))
        assert not runner.spread
        runner.spread = spread
        with torch.inference_mode():
            prefill = runner.prefill(random_ids)
            with Moves() as moves:
                greedy_continue(runner, prefill, 3)  # two decode steps
        moved[spread] = moves.count
    # the hidden state, cos, sin and the queries' positions, at every layer of both steps
    assert moved[True] - moved[False] == 4 * runner.num_layers * 2


def _reference_pruned_logits(model, ids, layer, keep):
    """Layers up to ``layer`` on every token, then only ``keep`` with their original positions."""
    body = model.model
    with torch.inference_mode():
        hidden = body.embed_tokens(ids[None])
        positions = torch.arange(ids.shape[0])
        for index, decoder in enumerate(body.layers):
            if index == layer + 1:
                hidden, positions = hidden[:, keep], positions[keep]
            n = hidden.shape[1]
            causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
            hidden = decoder(
                hidden,
                attention_mask=causal,
                position_ids=positions[None],
                position_embeddings=body.rotary_emb(hidden, positions[None]),
            )
        return model.lm_head(body.norm(hidden))[0, -1]


@pytest.mark.parametrize("family_name", ["llama", "qwen3"])
def test_pruning_keeps_original_positions(family_name, random_ids):
    model = tiny_model(family_name)
    keep = torch.tensor([0, 3, 4, 10, 17, 25, 31, 39])
    expected = _reference_pruned_logits(model, random_ids, 0, keep)
    recorder = Recorder()
    result = Runner(model).prefill(random_ids, hooks=[PruneAfter(0, keep), recorder])
    assert torch.allclose(result.logits, expected, atol=1e-4)
    assert result.live_tokens == [40, 8, 8]
    for layer, _, query_positions, key_positions in recorder.calls:
        if layer > 0:  # pruned tokens are gone from every later layer, survivors keep their ids
            assert query_positions.tolist() == keep.tolist()
            assert key_positions[0].tolist() == keep.tolist()


def test_pruning_nothing_is_a_no_op(random_ids):
    model = tiny_model("llama")
    runner = Runner(model)
    full = runner.prefill(random_ids, logits_at="all")
    pruned = runner.prefill(random_ids, hooks=[PruneAfter(1, torch.arange(40))], logits_at="all")
    assert torch.equal(full.logits, pruned.logits)


def test_decode_positions_continue_from_prompt_length(random_ids):
    model = tiny_model("llama")
    recorder = Recorder()
    keep = torch.tensor([0, 5, 39])
    Runner(model).generate(random_ids, 4, hooks=[PruneAfter(0, keep), recorder])
    decode_positions = [
        int(q[0]) for layer, phase, q, _ in recorder.calls if phase == "decode" and layer == 0
    ]
    assert decode_positions == [40, 41, 42]
    decode_keys_layer2 = [k for layer, phase, _, k in recorder.calls if phase == "decode" and layer == 2][0]
    assert decode_keys_layer2[0].tolist() == [0, 5, 39, 40]


def test_two_pass_reprefill_with_original_positions_matches_pruning_at_the_embeddings(random_ids):
    model = tiny_model("qwen2")
    keep = torch.tensor([1, 2, 8, 20, 39])
    reference = _reference_pruned_logits(model, random_ids, -1, keep)
    result = Runner(model).prefill(random_ids[keep], positions=keep)
    assert torch.allclose(result.logits, reference, atol=1e-4)
    assert result.prompt_length == 40


def test_ragged_compression_equals_masking_the_dropped_entries(random_ids):
    model = tiny_model("llama")
    runner = Runner(model)
    kept_per_head = [torch.tensor([0, 1, 7, 30, 39]), torch.arange(0, 40, 3)]

    compressed = runner.prefill(random_ids)
    for layer in range(runner.num_layers):
        compressed.cache.compress(layer, kept_per_head)
    masked = runner.prefill(random_ids)
    for layer in range(runner.num_layers):
        positions = masked.cache.positions[layer].clone()
        for head, kept in enumerate(kept_per_head):
            dropped = torch.ones(40, dtype=torch.bool)
            dropped[kept] = False
            positions[head, dropped] = PADDING
        masked.cache.positions[layer] = positions
        masked.cache.padded[layer] = True

    token = int(compressed.logits.argmax())
    got = runner.decode_step(token, 40, compressed.cache)
    expected = runner.decode_step(token, 40, masked.cache)
    assert torch.allclose(got, expected, atol=1e-5)
    assert compressed.cache.keys[0].shape[2] == 15  # padded to the longest head, plus the new token
    assert compressed.cache.kept_tokens(0).tolist() == [6, 15]


def _prefill(cache: KVCache, layer: int, keys: torch.Tensor, values: torch.Tensor | None = None) -> None:
    """Fill an empty layer as a prefill does: ``keys`` [1, kv_heads, S, d] at positions 0..S-1."""
    cache.begin_step(torch.arange(keys.shape[2]))
    cache.update(keys, keys if values is None else values, layer)


def test_compress_gathers_per_head_entries_and_counts_bytes():
    cache = KVCache(1)
    keys = torch.arange(2 * 6 * 2, dtype=torch.float32).reshape(1, 2, 6, 2)
    _prefill(cache, 0, keys, keys + 100)
    cache.compress(0, [torch.tensor([1, 4]), torch.tensor([5])])
    assert cache.positions[0].tolist() == [[1, 4], [5, PADDING]]
    assert cache.keys[0][0, 0].tolist() == [[2.0, 3.0], [8.0, 9.0]]
    assert cache.values[0][0, 1, 0].tolist() == [122.0, 123.0]
    assert cache.nbytes() == 3 * 2 * 4 * 2
    assert cache.nbytes(live_only=False) == 4 * 2 * 4 * 2
    mask = cache.attention_mask(0, torch.tensor([6]))
    assert mask[0, :, 0].tolist() == [[True, True], [True, False]]

    even = KVCache(1)  # as many per head: no padding, so a decode step attends with no mask
    _prefill(even, 0, keys)
    even.compress(0, [torch.tensor([1, 4]), torch.tensor([0, 5])])
    assert even.positions[0].tolist() == [[1, 4], [0, 5]] and not even.padded[0]
    assert even.attention_mask(0, torch.tensor([6])) is None


def test_an_eviction_chooses_among_every_slot_and_never_an_empty_one():
    """``evictable``: every slot of the layer, and where it has padding the score that ranks an empty
    slot last for eviction (TOVA drops the lowest)."""
    cache = KVCache(1)
    _prefill(cache, 0, torch.zeros(1, 2, 6, 2))
    assert cache.evictable(0) == (6, None)
    cache.compress(0, [torch.tensor([1, 4]), torch.tensor([5])])
    assert cache.evictable(0) == (2, torch.inf)


def test_one_token_appends_write_in_place_until_the_headroom_is_spent():
    """Decoding's appends are amortized O(1): the first copies a layer into a buffer with room for
    max(128, an eighth of its entries) more, each later one writes into that buffer, and only the
    append that finds it full copies the layer again."""
    cache = KVCache(2)
    for layer, length in enumerate((40, 2040)):
        _prefill(cache, layer, torch.zeros(1, 2, length, 4))

    def capacity(layer: int) -> int:  # entries the keys' storage holds
        return cache.keys[layer].untyped_storage().nbytes() // (2 * 4 * 4)

    buffers = []
    for position in range(2040, 2040 + 130):
        cache.begin_step(torch.tensor([position]))
        for layer in range(2):
            key = torch.full((1, 2, 1, 4), float(position))
            cache.update(key, -key, layer)
        buffers.append(cache.keys[0].data_ptr())
        if position == 2040:
            assert [capacity(0), capacity(1)] == [41 + 128, 2041 + 2041 // 8]
    assert len(set(buffers[:129])) == 1 and buffers[129] != buffers[128]  # 169 entries fill the first
    assert capacity(0) == 170 + 128 and cache.get_seq_length(0) == 170
    assert cache.positions[0][:, 38:42].tolist() == [[38, 39, 2040, 2041]] * 2
    assert cache.values[1][0, 1, -1].tolist() == [-2169.0] * 4 and cache.keys[0][0, 0, 40, 0] == 2040.0
    cache.compress(0, torch.tensor([[0, 169], [1, 169]]))  # a gathered copy: the old buffer is no longer its
    cache.begin_step(torch.tensor([2170]))
    cache.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4), 0)
    assert cache.positions[0].tolist() == [[0, 2169, 2170], [1, 2169, 2170]]


def _plain_steps(cache: KVCache, positions, layers) -> None:
    """One-token steps at ``positions``, each through ``layers``, every entry's keys its position."""
    for position in positions:
        cache.begin_step(torch.tensor([position]))
        for layer in layers:
            entry = torch.full((1, 2, 1, 2), float(position))
            cache.update(entry, -entry, layer)


def _shared_positions_cache(layers: int) -> KVCache:
    """``layers`` layers of a four-token prefill and two plain steps: the same positions in each."""
    cache = KVCache(layers)
    cache.begin_step(torch.arange(4))
    for layer in range(layers):
        keys = torch.arange(4.0)[None, None, :, None].expand(1, 2, 4, 2)
        cache.update(keys, -keys, layer)
    _plain_steps(cache, (4, 5), range(layers))
    return cache


def test_layers_holding_the_same_positions_share_one_append_and_a_write_in_place_reaches_no_other_layer():
    """A plain step's layers hold the same positions, which the first layer's append writes for all
    (``KVCache._append_positions``). A layer that then writes positions in place (an eviction, a
    clear, an append after a cut) first copies them into a buffer of its own, so no other layer sees it;
    a layer that holds other positions of the same shape appends its own."""
    cache = _shared_positions_cache(3)
    grown = [[0, 1, 2, 3, 4, 5]] * 2
    assert cache.positions[1] is cache.positions[0] and cache.positions[2] is cache.positions[0]
    assert cache.positions[0].tolist() == grown and cache.keys[2][0, 1, :, 0].tolist() == [0, 1, 2, 3, 4, 5]
    cache.evict(0, torch.tensor([1]))  # the layer that wrote them: the last entry moves into slot 1
    cache.clear(1, 0, 1)
    assert cache.positions[0].tolist() == [[0, 5, 2, 3, 4]] * 2
    assert cache.positions[1].tolist() == [[PADDING, 1, 2, 3, 4, 5]] * 2
    assert cache.positions[2].tolist() == grown
    _plain_steps(cache, (6,), range(3))
    assert cache.positions[0].tolist() == [[0, 5, 2, 3, 4, 6]] * 2
    assert cache.positions[1].tolist() == [[PADDING, 1, 2, 3, 4, 5, 6]] * 2
    assert cache.positions[2].tolist() == [[0, 1, 2, 3, 4, 5, 6]] * 2

    cut = _shared_positions_cache(2)
    cut.truncate(0, 3)  # the layer that wrote them reads three; the other still reads six
    _plain_steps(cut, (9,), (0,))
    assert cut.positions[0].tolist() == [[0, 1, 2, 9]] * 2 and cut.positions[1].tolist() == grown
    own = cut.positions[0].data_ptr()
    _plain_steps(cut, (10,), (0,))  # past what the other layer read: in place again
    assert cut.positions[0].data_ptr() == own and cut.positions[0].tolist() == [[0, 1, 2, 9, 10]] * 2

    apart = KVCache(2)
    for layer, start in enumerate((0, 10)):  # the same shape, other positions
        apart.begin_step(torch.arange(start, start + 4))
        apart.update(torch.zeros(1, 2, 4, 2), torch.zeros(1, 2, 4, 2), layer)
    _plain_steps(apart, (14,), range(2))
    assert apart.positions[0].tolist() == [[0, 1, 2, 3, 14]] * 2
    assert apart.positions[1].tolist() == [[10, 11, 12, 13, 14]] * 2


def test_a_plain_decodes_shared_positions_are_written_in_one_buffer_step_after_step():
    """The layer that writes a plain step's positions for all writes the next step's after the entries
    the others read, in the same buffer, far past the slots named at the first append."""
    cache = _shared_positions_cache(3)
    buffer = cache.positions[0].data_ptr()
    _plain_steps(cache, range(6, 13), range(3))
    assert cache.positions[0].data_ptr() == buffer
    assert all(cache.positions[layer] is cache.positions[0] for layer in (1, 2))
    assert cache.positions[2].tolist() == [list(range(13))] * 2 and cache.keys[1][0, 0, 4:, 0].tolist() == list(range(4, 13))


def test_several_tokens_append_after_the_entries_with_their_positions_in_every_head():
    cache = KVCache(1)
    _prefill(cache, 0, torch.zeros(1, 2, 2, 1))
    cache.begin_step(torch.tensor([5, 6, 7]))
    keys = torch.arange(1.0, 7.0).reshape(1, 2, 3, 1)
    cache.update(keys, -keys, 0)
    assert cache.positions[0].tolist() == [[0, 1, 5, 6, 7]] * 2
    assert cache.keys[0][0, :, :, 0].tolist() == [[0, 0, 1, 2, 3], [0, 0, 4, 5, 6]]
    assert cache.values[0][0, 1, 2:, 0].tolist() == [-4.0, -5.0, -6.0]


def test_a_layer_that_copied_the_positions_other_layers_read_writes_in_its_copy_from_then_on():
    """The first eviction of the layer that wrote a step's shared positions copies them (the other
    layers still read them); each later one writes in that copy, one copy in all, not one a step."""
    cache = _shared_positions_cache(2)
    cache.evict(0, torch.tensor([1]))
    copy = cache.positions[0].data_ptr()
    assert copy != cache.positions[1].data_ptr()
    cache.evict(0, torch.tensor([0]))
    assert cache.positions[0].data_ptr() == copy and cache.positions[0].tolist() == [[4, 5, 2, 3]] * 2
    assert cache.positions[1].tolist() == [[0, 1, 2, 3, 4, 5]] * 2


def _padded_cache() -> KVCache:
    """One layer of six entries compressed per head to four and two: head 1 holds two of padding."""
    cache = KVCache(1)
    keys = torch.zeros(1, 2, 6, 2)
    _prefill(cache, 0, keys)
    cache.compress(0, [torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5])])
    return cache


def _decode_mask(cache: KVCache) -> list[list[bool]]:
    return cache.attention_mask(0, torch.tensor([6]))[0, :, 0].tolist()


def test_a_decode_mask_made_at_one_step_follows_each_later_change_of_the_padding():
    """A padded layer's decode mask is made once and reused (``_decode_mask``); every operation that
    moves padding (clear, write, truncate and the append after it, rearrange, compress) makes the
    next step's mask anew."""
    cache = _padded_cache()
    assert _decode_mask(cache) == [[True] * 4, [True, True, False, False]]
    cache.clear(0, 0, 1)  # slot 0 of each head is padding now
    assert _decode_mask(cache) == [[False, True, True, True], [False, True, False, False]]
    entry = torch.ones(1, 2, 1, 2)
    cache.write(0, 2, entry, entry, torch.tensor([[2], [3]]))  # head 1's slot 2 is real again
    assert _decode_mask(cache) == [[False, True, True, True], [False, True, True, False]]
    cache.truncate(0, 3)
    assert _decode_mask(cache) == [[False, True, True], [False, True, True]]
    cache.begin_step(torch.tensor([6]))  # into slot 3, which was padding in head 1 before the cut
    cache.update(entry, entry, 0)
    assert _decode_mask(cache) == [[False, True, True, True], [False, True, True, True]]
    cache.rearrange(0, torch.tensor([3, 0, 1, 2]), 4)  # the entry in slot 0 moves to 3, the rest down one
    assert _decode_mask(cache) == [[True, True, True, False], [True, True, True, False]]
    cache.compress(0, [torch.tensor([1, 2]), torch.tensor([2])])
    assert _decode_mask(cache) == [[True, True], [True, False]]


def test_a_padded_layers_decode_mask_is_made_once_for_the_steps_its_room_holds():
    """A padded layer's decode mask is made with room for max(128, an eighth of its entries) more, as
    the buffers are, and made again only at the step whose entry it has no room for."""
    cache = KVCache(2)
    _prefill(cache, 0, torch.zeros(1, 2, 1100, 2))
    cache.compress(0, [torch.arange(1040), torch.arange(10)])  # 1,040 slots, head 1's 1,030 of them padding
    _prefill(cache, 1, torch.zeros(1, 2, 6, 2))
    cache.compress(1, [torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5])])
    made = {0: [], 1: []}  # the steps at which each layer's mask was made anew
    masks = {}
    for step in range(133):
        _plain_steps(cache, (1100 + step,), range(2))
        for layer in range(2):
            mask = cache.attention_mask(layer, torch.tensor([1100 + step]))
            if mask.data_ptr() != masks.get(layer):
                made[layer].append(step)
            masks[layer] = mask.data_ptr()
    assert made == {0: [0, 131], 1: [0, 129]}  # room to 1,041 + 130 and 5 + 128 entries
    assert mask[0, :, 0].tolist() == [[True] * 137, [True, True, False, False] + [True] * 133]
    long = cache.attention_mask(0, torch.tensor([1232]))[0, :, 0]
    assert long.shape[-1] == 1040 + 133 and long[0].all() and long[1, :10].all() and not long[1, 10:1040].any()


def test_a_rearranged_layer_with_no_padding_is_not_fresh_for_several_queries():
    """After its entries move (SlimInfer's swap), a layer whose slots are all real again is no fresh
    prefill: several queries over it get a mask from positions, where plain causal would be refused."""
    cache = KVCache(1)
    _prefill(cache, 0, torch.zeros(1, 2, 4, 1))
    cache.rearrange(0, torch.tensor([3, 2, 1, 0]), 4)
    cache.declare_padding(0, False)
    mask = cache.attention_mask(0, torch.tensor([2, 4]))
    assert mask is not None and mask[0, 0].tolist() == [[False, True, True, True], [True] * 4]


def test_a_local_layers_mask_is_per_head_over_a_cache_compressed_per_head():
    """Heads compressed apart hold different positions, padded or not: a sliding window's decode mask,
    and any mask of several queries, is made per head (not from the first head's positions)."""
    padded = _padded_cache()  # positions [[0, 1, 2, 3], [4, 5, -1, -1]]
    local = padded.attention_mask(0, torch.tensor([6]), sliding_window=4)[0, :, 0].tolist()
    assert local == [[False, False, False, True], [True, True, False, False]]
    cache = KVCache(1)
    _prefill(cache, 0, torch.zeros(1, 2, 6, 2))
    unpruned = cache.attention_mask(0, torch.tensor([6]), sliding_window=4)  # heads alike: one row for all
    assert unpruned.tolist() == [[[[False, False, False, True, True, True]]]]
    cache.compress(0, torch.tensor([[0, 1, 2, 3], [2, 3, 4, 5]]))  # as many per head: no padding
    local = cache.attention_mask(0, torch.tensor([6]), sliding_window=4)[0, :, 0].tolist()
    assert local == [[False, False, False, True], [False, True, True, True]]
    two_queries = cache.attention_mask(0, torch.tensor([3, 4]))
    assert two_queries[0, :, :, :].tolist() == [
        [[True, True, True, True], [True, True, True, True]],
        [[True, True, False, False], [True, True, True, False]],
    ]


def test_an_empty_cache_holds_nothing_and_layer_0_is_the_default_length():
    cache = KVCache(2)
    assert cache.get_seq_length() == cache.get_seq_length(1) == 0
    assert cache.kept_tokens_per_layer() == [] and cache.nbytes() == 0
    _prefill(cache, 1, torch.zeros(1, 2, 3, 2))
    assert (cache.get_seq_length(), cache.get_seq_length(1), cache.kept_tokens_per_layer()) == (0, 3, [[3, 3]])


def test_a_window_or_a_held_size_the_layer_cannot_keep_is_refused():
    cache = _padded_cache()  # four entries
    for size, full_length in ((0, 5), (3, 2), (2, 4)):
        with pytest.raises(ValueError, match=f"layer 0: a window of {size} in {full_length} entries"):
            cache.keep_recent_window(0, size, full_length)
    cache.keep_recent_window(0, 1, 5)  # the step's own token alone: the smallest window
    with pytest.raises(ValueError, match="layer 0 holds 4 entries, more than 3"):
        cache.hold_size(0, 3)


def test_rearranged_entries_leave_their_empty_slots_as_padding_no_step_attends():
    cache = KVCache(1)
    keys = torch.arange(8.0).reshape(1, 2, 4, 1)
    _prefill(cache, 0, keys, -keys)
    cache.rearrange(0, torch.tensor([2, 0, 4, 1]), 4)  # entry 2 dropped (slot 4), slot 3 left empty
    assert cache.positions[0].tolist() == [[1, 3, 0, PADDING]] * 2
    assert cache.keys[0][0, :, :3, 0].tolist() == [[1.0, 3.0, 0.0], [5.0, 7.0, 4.0]]
    assert cache.values[0][0, 1, :3, 0].tolist() == [-5.0, -7.0, -4.0]
    assert cache.attention_mask(0, torch.tensor([4]))[0, :, 0].tolist() == [[True, True, True, False]] * 2


def test_a_fork_keeps_the_padding_mask_and_the_ring_slot_it_was_made_with():
    cache = _padded_cache()
    cache.keep_recent_window(0, 2, 5)  # slots 3 and 4 of the five are the ring
    for position in (6, 7):  # the first fills the layer, the second writes the ring's first slot
        cache.begin_step(torch.tensor([position]))
        cache.update(torch.zeros(1, 2, 1, 2), torch.zeros(1, 2, 1, 2), 0)
    assert _decode_mask(cache) == [[True] * 5, [True, True, False, True, True]]
    in_place = cache.keys[0].data_ptr()
    cache.begin_step(torch.tensor([8]))  # the ring's second slot, in the buffer the first write made
    cache.update(torch.zeros(1, 2, 1, 2), torch.zeros(1, 2, 1, 2), 0)
    assert cache.keys[0].data_ptr() == in_place and cache.positions[0][:, 3:].tolist() == [[7, 8]] * 2
    twin = cache.fork()
    assert _decode_mask(twin) == _decode_mask(cache) and twin.next_slot(0) == cache.next_slot(0) == 3
    assert twin.positions[0].tolist() == [[0, 1, 2, 7, 8], [4, 5, PADDING, 7, 8]]


def test_a_decode_steps_mask_hides_padding_and_a_local_layers_old_keys():
    from rankkit.cache import allowed_keys

    positions = torch.tensor([[0, 3, PADDING, 7], [PADDING, 2, 5, 7]])
    for query in (7, 8):  # the step's own token is in the cache, or not yet
        one_query = allowed_keys(positions, torch.tensor([query]), None, per_head=True)
        assert one_query.tolist() == [[[[True, True, False, True]], [[False, True, True, True]]]]
    local = allowed_keys(positions, torch.tensor([8]), sliding_window=4, per_head=True)
    assert local.tolist() == [[[[False, False, False, True]], [[False, False, True, True]]]]
    two_queries = allowed_keys(positions, torch.tensor([4, 8]), None, per_head=False)
    assert two_queries.tolist() == [[[[True, True, False, False], [True, True, False, True]]]]


def test_uniform_compression_to_every_entry_changes_nothing(random_ids):
    model = tiny_model("mistral")
    runner = Runner(model)
    full = runner.generate(random_ids, 6).tokens
    prefill = runner.prefill(random_ids)
    for layer in range(runner.num_layers):
        prefill.cache.compress(layer, torch.arange(40).expand(2, -1))
    from rankkit.runner import greedy_continue

    assert greedy_continue(runner, prefill, 6) == full


def test_forked_caches_grow_independently(random_ids):
    model = tiny_model("llama")
    runner = Runner(model)
    prefill = runner.prefill(random_ids)
    twin = prefill.cache.fork()
    first = runner.decode_step(5, 40, prefill.cache)
    runner.decode_step(7, 41, prefill.cache)
    again = runner.decode_step(5, 40, twin)
    assert torch.allclose(first, again, atol=1e-6)
    assert twin.get_seq_length() == 41 and prefill.cache.get_seq_length() == 42
    assert prefill.cache.positions[0][0, -2:].tolist() == [40, 41]


def test_multimodal_gemma3_runs_its_text_decoder_alone(random_ids):
    """A ``gemma3`` checkpoint (vision tower + text decoder) used for text: the runner drives the decoder."""
    from conftest import tiny_config
    from transformers import AutoConfig, AutoModelForCausalLM

    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = AutoConfig.for_model(
        "gemma3",
        text_config=tiny_config("gemma3_text").to_dict(),
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=96,
        boi_token_index=94,
        eoi_token_index=95,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ids = random_ids % 90  # clear of the image tokens
    with torch.inference_mode():
        expected = model(input_ids=ids[None]).logits[0]
    assert torch.allclose(Runner(model).prefill(ids, logits_at="all").logits, expected, atol=1e-4)


@pytest.mark.parametrize("queries", [1, 2, 5, 7])  # one decode query (every key), then causal rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_attention_is_the_capped_causal_softmax_with_sinks_worked_out_per_head(queries, dtype):
    """The attention Gemma 2/3 (soft-capping) and GPT-OSS (sinks) run, against each output worked out one
    query head and one query at a time: query i of ``queries`` new ones over 7 keys sees the keys up to
    its own position, and a sink takes its share of the softmax without a value."""
    import math

    from rankkit.runner import AttentionCall, eager_attention

    generator = torch.Generator().manual_seed(queries)
    kv_heads, group, keys, dim, scaling, softcap = 2, 3, 7, 4, 0.5, 2.0
    query = torch.randn(1, kv_heads * group, queries, dim, generator=generator).to(dtype)
    key, value = (torch.randn(1, kv_heads, keys, dim, generator=generator).to(dtype) for _ in range(2))
    sinks = torch.randn(kv_heads * group, generator=generator)
    call = AttentionCall(
        0, "prefill", query, key, value, torch.arange(keys - queries, keys),
        torch.arange(keys).expand(kv_heads, -1), scaling, softcap=softcap, sinks=sinks,
    )  # fmt: skip
    got = eager_attention(call, None)
    assert got.shape == (1, queries, kv_heads * group, dim) and got.dtype == dtype
    expected = torch.zeros(queries, kv_heads * group, dim, dtype=torch.float64)
    for head in range(kv_heads * group):
        for row in range(queries):
            seen = range(keys - queries + row + 1)
            logits = [
                softcap * math.tanh(float(query[0, head, row].double() @ key[0, head // group, at].double()) * scaling / softcap)
                for at in seen
            ]  # fmt: skip
            normalizer = sum(map(math.exp, logits)) + math.exp(float(sinks[head]))
            for at, logit in zip(seen, logits, strict=True):
                expected[row, head] += math.exp(logit) / normalizer * value[0, head // group, at].double()
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2  # bfloat16 logits, as the family's eager code has them
    torch.testing.assert_close(got[0].double(), expected, rtol=tolerance, atol=tolerance)


def test_a_bfloat16_model_prefills_and_decodes_as_transformers_does(random_ids):
    """Half precision reaches SDPA's causal prefill, a masked prefill after pruning and the one-query
    decode (flash-attn's path is CUDA's alone: on the CPU every half-precision call is SDPA's)."""
    model = tiny_model("llama").to(torch.bfloat16)
    with torch.inference_mode():
        expected = model(random_ids[None]).logits[0]
    runner = Runner(model)
    result = runner.prefill(random_ids, logits_at="all")
    assert result.logits.dtype == torch.bfloat16
    torch.testing.assert_close(result.logits, expected, rtol=0.02, atol=0.02)
    generated = model.generate(random_ids[None], max_new_tokens=6, do_sample=False)[0, 40:].tolist()
    assert runner.generate(random_ids, 6).tokens == generated
    keep = torch.arange(0, 40, 2)
    pruned = runner.prefill(random_ids, hooks=[PruneAfter(0, keep)], logits_at="all")
    assert pruned.live_tokens == [40, 20, 20] and torch.isfinite(pruned.logits).all()


def test_two_prompt_tokens_attend_causally(random_ids):
    """The shortest causal prefill: the first token must not see the second."""
    model = tiny_model("llama")
    with torch.inference_mode():
        expected = model(random_ids[None, :2]).logits[0]
    torch.testing.assert_close(Runner(model).prefill(random_ids[:2], logits_at="all").logits, expected, rtol=1e-4, atol=1e-4)


def test_greedy_decoding_reports_each_token_as_chosen_and_stops_at_any_eos_the_model_names(random_ids):
    from rankkit.runner import greedy_continue

    model = tiny_model("llama")
    runner = Runner(model)
    seen = []
    tokens = greedy_continue(runner, runner.prefill(random_ids), 5, on_token=seen.append, stop_at_eos=False)
    assert seen == tokens and len(tokens) == 5
    assert greedy_continue(runner, runner.prefill(random_ids), 0) == [] == runner.generate(random_ids, 0).tokens
    # the generation config's EOS ids (one or a list, as Llama 3 has), else the model config's, else none
    model.generation_config.eos_token_id, model.config.eos_token_id = [tokens[1], 96], 3
    assert runner.eos_ids() == {tokens[1], 96}
    assert runner.generate(random_ids, 5).tokens == tokens[:2]  # the EOS ends the answer and is kept
    model.generation_config.eos_token_id = None
    assert runner.eos_ids() == {3}
    model.config.eos_token_id = None
    assert runner.eos_ids() == set()


@pytest.mark.parametrize("queries", [1, 3])  # a decode step (its query heads folded per KV head), a prefill
@pytest.mark.parametrize("mask_heads", [0, 1, 2])  # no mask, one for every head, one per KV head
def test_attention_is_each_query_heads_softmax_over_the_keys_its_kv_head_may_see(queries, mask_heads):
    """``Runner.attention`` against each query head and query worked out alone, in the layout the
    attention modules expect: [1, queries, query heads, head_dim]."""
    import math

    runner = Runner(tiny_model("llama"))
    generator = torch.Generator().manual_seed(queries + mask_heads)
    kv_heads, group, keys, dim, scaling = 2, 3, 6, 4, 0.5
    query = torch.randn(1, kv_heads * group, queries, dim, generator=generator)
    key, value = (torch.randn(1, kv_heads, keys, dim, generator=generator) for _ in range(2))
    if mask_heads:
        mask = torch.rand(1, mask_heads, queries, keys, generator=generator) < 0.6
        mask[..., -1] = True  # each query sees itself
    else:
        mask = None  # causal over a fresh prompt's keys; one query sees every key
        if queries > 1:
            key, value = key[:, :, :queries], value[:, :, :queries]
    got = runner.attention(query, key, value, mask, scaling)
    assert got.shape == (1, queries, kv_heads * group, dim)
    for head in range(kv_heads * group):
        kv_head = head // group
        for row in range(queries):
            seen = [at for at in range(key.shape[2]) if (mask[0, kv_head % mask_heads, row, at] if mask_heads else at <= row + key.shape[2] - queries)]
            weights = [math.exp(float(query[0, head, row] @ key[0, kv_head, at]) * scaling) for at in seen]
            expected = sum(weight * value[0, kv_head, at] for weight, at in zip(weights, seen, strict=True)) / sum(weights)
            torch.testing.assert_close(got[0, row, head], expected, rtol=1e-5, atol=1e-5)


def test_causal_attention_over_cached_keys_without_a_mask_is_refused():
    """Plain causal attention aligns queries with the first keys; over a cache they are the last ones."""
    runner = Runner(tiny_model("llama"))
    query, key = torch.zeros(1, 4, 3, 8), torch.zeros(1, 2, 5, 8)
    with pytest.raises(ValueError, match="^causal attention over a cache needs an explicit mask$"):
        runner.attention(query, key, key, None, 1.0)


def test_flash_attentions_call_takes_its_layout_scale_and_causality(random_ids):
    """flash-attn runs only on CUDA; here a stand-in with ``flash_attn_func``'s contract (``[batch, seq,
    heads, dim]`` in and out, grouped KV heads, ``softmax_scale``, ``causal``) shows the runner hands it
    the prefill's and the decode's attention as SDPA computes them."""

    def flash_attn_func(query, key, value, softmax_scale, causal):
        assert query.shape[1] == key.shape[1] or not causal  # a fresh prompt, or one decode query
        out = torch.nn.functional.scaled_dot_product_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
            is_causal=causal, scale=softmax_scale, enable_gqa=True,
        )  # fmt: skip
        calls.append(causal)
        return out.transpose(1, 2)

    calls = []
    model = tiny_model("llama").to(torch.bfloat16)
    for layer in model.model.layers:
        layer.self_attn.scaling *= 0.7  # not SDPA's and flash-attn's default, 1/sqrt(head_dim)
    plain, flash = Runner(model), Runner(model)
    flash._flash = flash_attn_func
    assert torch.equal(flash.prefill(random_ids, logits_at="all").logits, plain.prefill(random_ids, logits_at="all").logits)
    assert calls == [True] * flash.num_layers
    assert flash.generate(random_ids, 4).tokens == plain.generate(random_ids, 4).tokens
    assert calls[flash.num_layers * 2 :] == [False] * flash.num_layers * 3  # the decode steps: one query each


def test_a_decode_step_cut_in_parts_runs_each_layer_as_the_whole_step_does(random_ids):
    """Host work after a layer (``decode_breaks``) cuts a decode step in parts; the layers of a later part
    keep their own index: Gemma 3's local and global layers rotate with their own RoPE there too."""

    class HostWorkAfter(LayerHook):
        def __init__(self, *layers):
            self.decode_breaks, self.seen = layers, []

        def after_decode_layer(self, layer, cache):
            self.seen.append(layer)

    runner = Runner(tiny_model("gemma3_text"))  # local, global, local layers
    hook = HostWorkAfter(0)
    assert runner.decode_parts([hook]) == [range(0, 1), range(1, 3)]
    assert runner.decode_parts([HostWorkAfter(2)]) == [range(0, 3)]  # after the last layer: the step's end
    assert runner.decode_parts([HostWorkAfter(1), HostWorkAfter(0, 1)]) == [range(0, 1), range(1, 2), range(2, 3)]
    whole, cut = runner.prefill(random_ids), runner.prefill(random_ids)
    token = torch.argmax(whole.logits)
    torch.testing.assert_close(runner.decode_step(token, 40, cut.cache, [hook]), runner.decode_step(token, 40, whole.cache))
    assert hook.seen == [0]


def test_rankkits_attention_outside_a_runners_step_is_refused(random_ids):
    """The registered attention has no cache or hooks outside a prefill or decode step: a model call
    made while it is installed fails in one line instead of attending wrongly."""
    from rankkit.errors import RankkitError

    model = tiny_model("llama")
    runner = Runner(model)
    with runner._installed(), pytest.raises(RankkitError, match=r"^rankkit's attention runs only inside Runner\.prefill and decode_step$"):
        model(random_ids[None])
    assert model.config._attn_implementation != "rankkit"


def test_feed_last_feeds_back_the_last_token_unless_it_is_eos(random_ids):
    """The oracle and SpecPrefill's lookahead score with the query of every answer token, the last one
    too; an EOS ends the answer unfed."""
    from rankkit.runner import greedy_continue

    class StepPositions(LayerHook):
        def __init__(self):
            self.positions = []

        def after_decode_step(self, cache, position):
            self.positions.append(position)

    model = tiny_model("llama")
    runner, hook = Runner(model), StepPositions()
    tokens = greedy_continue(runner, runner.prefill(random_ids), 3, [hook], feed_last=True, stop_at_eos=False)
    assert len(tokens) == 3 and hook.positions == [40, 41, 42]
    model.generation_config.eos_token_id = tokens[1]
    hook = StepPositions()
    assert greedy_continue(runner, runner.prefill(random_ids), 3, [hook], feed_last=True) == tokens[:2]
    assert hook.positions == [40]
