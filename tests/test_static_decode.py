"""The opt-in static-cache decode (``Runner(model, cuda_graphs=True)``, ``--cuda-graphs``): on CPU
the same static code runs eagerly, and must choose exactly the tokens the dynamic cache does."""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext

import numpy as np
import pytest
import torch
from conftest import tiny_model

from rankkit.cache import STATIC_BUCKET, KVCache, StaticKVCache
from rankkit.methods import REGISTRY, Budget, make
from rankkit.methods.measure import run_once
from rankkit.runner import LayerHook, Runner, greedy_continue

NEW_TOKENS = 8


def _both(family: str) -> tuple[Runner, Runner]:
    model = tiny_model(family)
    return Runner(model), Runner(model, cuda_graphs=True)


def test_static_decode_gives_the_dynamic_caches_tokens_and_logits(family, random_ids):
    eager, static = _both(family)
    expected = eager.generate(random_ids, NEW_TOKENS).tokens
    assert static.generate(random_ids, NEW_TOKENS).tokens == expected
    prefill = eager.prefill(random_ids)
    token = torch.argmax(prefill.logits)
    dynamic_logits = eager.decode_step(token, 40, eager.prefill(random_ids).cache)
    static_logits = static.decoder(static.prefill(random_ids), 4)(token, 40)
    torch.testing.assert_close(static_logits, dynamic_logits, rtol=1e-5, atol=1e-5)


class NoTextTokenizer:
    def decode(self, tokens, **kwargs):
        return ""


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_method_decodes_the_same_tokens_statically(name, random_ids):
    eager, static = _both("llama")
    runs = []
    for runner in (eager, static):
        method = make(name)
        method.prepare(runner, random_ids, tokenizer=NoTextTokenizer())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runs.append(run_once(runner, method, random_ids, Budget.from_keep(0.5), NEW_TOKENS))
        assert not [each for each in caught if "CUDA graph" in str(each.message)]  # none decodes eagerly
    assert runs[1].tokens == runs[0].tokens
    assert runs[1].kv_bytes == runs[0].kv_bytes
    assert static._static_decodes  # decoded over the static cache, as a graph would


@pytest.mark.parametrize("keep", [0.5, 0.2])  # at 0.2 the windows (4 and 1 entries) wrap in 8 steps
@pytest.mark.parametrize("name", ["streamingllm", "sage-kv"])
def test_a_rolling_window_rolls_the_static_cache_as_the_dynamic_one(name, keep, random_ids):
    """The window's eviction two ways, the dynamic cache's ring of slots written from the host and
    the static cache's kept on the device: after every step each head holds the same entries
    (positions and keys), whatever the slot order: the entries before the window, then the last
    ``size`` tokens (the step's own included)."""
    eager, static = _both("llama")
    budget = Budget.from_keep(keep)
    caches = []
    for runner in (eager, static):
        run = make(name).prefill(runner, random_ids, budget)
        assert run.decode_hooks == []  # the window is the cache's: nothing in Python at a step
        if runner is eager:
            windows = dict(run.result.cache.windows)
            before = [[_live_positions(run.result.cache, layer, head) for head in range(2)] for layer in range(runner.num_layers)]
        step = runner.decoder(run.result, NEW_TOKENS, run.decode_hooks)
        token = torch.argmax(run.result.logits)
        for position in range(40, 40 + NEW_TOKENS):
            token = torch.argmax(step(token, position))
        caches.append(step.cache if runner is static else run.result.cache)
    assert isinstance(caches[1], StaticKVCache)
    assert sorted(windows) == list(range(caches[0].num_layers))
    end = 40 + NEW_TOKENS
    for layer in range(caches[0].num_layers):
        size = windows[layer].size
        assert size < NEW_TOKENS or keep == 0.5  # at 0.2 the ring wraps
        for head in range(2):
            expected, held = (_live_entries(cache, layer, head) for cache in caches)
            assert [p for p, _ in held] == [p for p, _ in expected] and held[-1][0] == end - 1
            assert len(expected) < 40  # the window rolled: the cache did not grow by the steps
            kept_before = before[layer][head][: len(before[layer][head]) - (size - 1)]
            assert [p for p, _ in expected] == kept_before + list(range(end - size, end))
            for (_, key), (_, reference) in zip(held, expected, strict=True):
                torch.testing.assert_close(key, reference)


def test_a_static_cache_made_mid_window_writes_where_the_dynamic_ring_left_off(random_ids):
    """A static cache loaded from a dynamic one whose rings have rolled (steps written in the window)
    takes each ring up at the slot the dynamic cache writes next, not at the window's first."""
    from dataclasses import replace

    eager, static = _both("llama")
    run = make("streamingllm").prefill(eager, random_ids, Budget.from_keep(0.2))  # 4 sinks, a ring of 5
    cache = run.result.cache
    token = torch.argmax(run.result.logits)
    for position in range(40, 43):  # the first step fills the ring, the next two write its first slots
        token = torch.argmax(eager.decode_step(token, position, cache))
    assert [cache.next_slot(layer) for layer in range(eager.num_layers)] == [6] * eager.num_layers
    step = static.decoder(replace(run.result, cache=cache.fork()), NEW_TOKENS)
    for position in range(43, 43 + NEW_TOKENS):  # round the ring and more
        expected = eager.decode_step(token, position, cache)
        torch.testing.assert_close(step(token, position), expected, rtol=1e-5, atol=1e-5)
        token = torch.argmax(expected)


def test_a_static_cache_refuses_to_be_compressed(random_ids):
    cache = StaticKVCache(Runner(tiny_model("llama")).prefill(random_ids).cache, NEW_TOKENS)
    with pytest.raises(RuntimeError, match="a static cache is for decoding only; compress the cache before"):
        cache.compress(0, torch.zeros(2, 1, dtype=torch.long))


def _live_positions(cache, layer, head) -> list[int]:
    return sorted(p for p in cache.positions[layer][head].tolist() if p != -1)


def _live_entries(cache, layer, head) -> list[tuple[int, torch.Tensor]]:
    """(position, key) of a head's real entries, in position order (slots are in any order)."""
    live = cache.positions[layer][head] != -1
    entries = zip(cache.positions[layer][head][live].tolist(), cache.keys[layer][0, head][live], strict=True)
    return sorted(entries, key=lambda entry: entry[0])


def test_a_decode_of_the_same_shape_reuses_the_static_buffers(random_ids):
    eager, static = _both("llama")
    ids = [random_ids, random_ids.flip(0)]
    expected = [eager.generate(each, NEW_TOKENS).tokens for each in ids]
    first = static.generate(ids[0], NEW_TOKENS).tokens
    (buffers,) = static._static_decodes.values()
    kept = static.kept_static_uses()
    assert static.reused_static_bytes(kept) == 0
    second = static.generate(ids[1], NEW_TOKENS).tokens
    assert list(static._static_decodes.values()) == [buffers]  # the same buffers (on CUDA the same graph), refilled
    assert [first, second] == expected
    prefill = static.prefill(ids[1])
    assert static.reused_static_bytes(kept) == StaticKVCache.buffer_bytes(StaticKVCache.shape_of(prefill.cache, NEW_TOKENS))
    # the keys, values and positions of every slot: 3 layers of 256 slots, 2 KV heads of 16
    assert static.reused_static_bytes(kept) == 3 * 256 * 2 * (2 * 16 * 4 + 8)


def _decode_of(runner: Runner, ids: torch.Tensor, keep: float):
    run = make("snapkv").prefill(runner, ids, Budget.from_keep(keep))
    return runner.decoder(run.result, NEW_TOKENS, run.decode_hooks)


@pytest.mark.parametrize(("decodes_that_fit", "reused"), [(2, True), (1, False)])
def test_interleaved_shapes_each_keep_their_decode_while_their_share_of_memory_allows(
    monkeypatch, decodes_that_fit, reused
):
    """Methods timed in interleaved rounds replay their own graphs, the kept buffers bounded in bytes,
    the least recently used dropped first."""
    runner = Runner(tiny_model("llama"), cuda_graphs=True)
    long_ids = torch.randint(0, 97, (2 * STATIC_BUCKET,), generator=torch.Generator().manual_seed(2))
    first = _decode_of(runner, long_ids, 1.0)
    shape = next(iter(runner._static_decodes)).shape
    assert StaticKVCache.buffer_bytes(shape) == sum(
        tensor.numel() * tensor.element_size()
        for tensor in (*first.cache.keys, *first.cache.values, *first.cache.positions)
    )
    share = decodes_that_fit * StaticKVCache.buffer_bytes(shape)
    monkeypatch.setattr(runner, "_static_decodes_bytes", lambda: share)
    other = _decode_of(runner, long_ids, 0.1)  # one bucket, where the whole prompt takes three
    assert other is not first
    again = _decode_of(runner, long_ids, 1.0)
    assert (again is first) == reused
    assert len(runner._static_decodes) == decodes_that_fit


def test_kept_static_decodes_fill_their_share_to_the_byte_and_the_least_recently_used_goes_first(monkeypatch):
    """Decodes of a three-bucket (X), a one-bucket (Y) and a two-bucket (Z) cache, X reused before Z comes:
    a share of exactly X + Y + Z keeps all three; of exactly X + Z, Y goes (used least recently); a byte
    less and X must go too."""
    model = tiny_model("llama")
    ids = torch.randint(0, 97, (3 * STATIC_BUCKET,), generator=torch.Generator().manual_seed(3))
    cut = {"X": 3, "Y": 1, "Z": 2}  # buckets per layer, each filled to its last slot by the decode's tokens
    prefills = {name: Runner(model).prefill(ids[: buckets * STATIC_BUCKET - NEW_TOKENS]) for name, buckets in cut.items()}
    shape = {name: StaticKVCache.shape_of(prefill.cache, NEW_TOKENS) for name, prefill in prefills.items()}
    size = {name: StaticKVCache.buffer_bytes(shape[name]) for name in shape}
    assert size["Y"] < size["Z"] < size["X"]
    for share, kept in (
        (size["X"] + size["Y"] + size["Z"], "YXZ"),
        (size["X"] + size["Z"], "XZ"),
        (size["X"] + size["Z"] - 1, "Z"),
    ):
        runner = Runner(model, cuda_graphs=True)
        monkeypatch.setattr(runner, "_static_decodes_bytes", lambda share=share: share)
        for name in "XYXZ":
            runner.decoder(prefills[name], NEW_TOKENS)
        assert [key.shape for key in runner._static_decodes] == [shape[name] for name in kept], share


def test_a_decode_part_is_compiled_once_per_runner_and_part_and_a_cut_of_the_layers_compiles_its_own(monkeypatch):
    """``--compile-decode``: each part's step is compiled once and kept; ``first_layers`` cuts (a
    self-draft) keep their own, whose steps end at their own last layer (the target's would not)."""
    monkeypatch.setattr(torch, "compile", lambda step: ("compiled", step))
    runner = Runner(tiny_model("llama"), cuda_graphs=True, compile_decode=True)
    whole = runner.static_part(range(3))
    assert whole is runner.static_part(range(3)) and whole != runner.static_part(range(1))
    (_, step) = whole.args[0]  # torch.compile's, run outside any dispatch mode
    assert step.func == runner._decode_part and step.args == (range(3),)
    draft = runner.first_layers(2)
    assert draft is runner.first_layers(2) and draft.num_layers == 2 and runner.num_layers == 3
    (_, step) = draft.static_part(range(2)).args[0]
    assert step.func.__self__ is draft and step.args == (range(2),)
    assert draft.first_layers(1).num_layers == 1
    eager = Runner(runner.model, cuda_graphs=True)
    assert eager.static_part(range(3)).func == eager._decode_part  # not compiled


def test_static_cache_pads_each_layer_to_a_bucket_and_masks_the_tail(random_ids):
    runner = Runner(tiny_model("llama"))
    cache = runner.prefill(random_ids).cache
    cache.compress(1, [torch.tensor([0, 5, 39]), torch.tensor([2, 39])])  # ragged heads
    static = StaticKVCache(cache, room=4)
    assert static.positions[0].shape == (2, STATIC_BUCKET)
    assert static.positions[1][:, :4].tolist() == [[0, 5, 39, -1], [2, 39, -1, -1]]
    assert (static.positions[1][:, 3:] == -1).all()
    assert static.nbytes() == cache.nbytes()
    mask = static.attention_mask(1, torch.tensor([40]))
    assert mask[0, :, 0, :4].tolist() == [[True, True, True, False], [True, True, False, False]]
    assert StaticKVCache.shape_of(cache, 4) == ((1, 1, 1), (2, 16), torch.float32, cache.keys[0].device, ())


SLIMINFER_SMALL_BLOCKS = {"block_size": 8, "unit_size": 2, "window_size": 2, "pruning_layers": (0,)}


def test_a_decode_hook_a_graph_cannot_replay_warns_and_decodes_eagerly(random_ids, monkeypatch):
    """A hook with no ``replay_key`` (a plugin's, say; here TOVA's eviction stripped of its key)."""
    from rankkit.methods.tova import TovaEviction

    monkeypatch.setattr(TovaEviction, "replay_key", None)
    runs = []
    for runner in _both("gemma2"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runs.append(run_once(runner, make("tova"), random_ids, Budget.from_keep(0.5), NEW_TOKENS))
        runs[-1].warnings = [str(each.message) for each in caught if "graph" in str(each.message)]
        assert not runner._static_decodes
    assert runs[1].tokens == runs[0].tokens
    assert runs[0].warnings == []
    assert runs[1].warnings == [
        "method 'tova' acts at every decode step, which a CUDA graph cannot replay: it decodes eagerly"
    ]


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_sliminfers_swaps_run_between_the_static_decodes_parts_prompt_after_prompt(family, random_ids):
    """Under ``--cuda-graphs`` a SlimInfer step is two parts, cut after its pruning layer, where Alg. 1
    runs on the host (γ = 1: every change of candidate moves blocks). Over the static cache it makes
    the dynamic cache's decisions and tokens, the governed layer holds the dynamic one's entries slot
    for slot after every step, and the second prompt runs through the first one's kept decode with
    its own blocks: the pruning layer's unit keys and ring of queries taken over, its own swaps run."""
    eager, static = _both(family)
    params = {**SLIMINFER_SMALL_BLOCKS, "gamma": 1.0}
    for ids in (random_ids, random_ids.flip(0)):
        runs = [make("sliminfer", **params).prefill(runner, ids, Budget.from_keep(0.5)) for runner in (eager, static)]
        hooks = [run.decode_hooks[0] for run in runs]
        assert hooks[1].decode_breaks == (0,) and Runner.replays(hooks[1:])
        steps = [runner.decoder(run.result, NEW_TOKENS, run.decode_hooks) for runner, run in zip((eager, static), runs, strict=True)]
        assert steps[1].parts == [range(0, 1), range(1, 3)] and steps[1].current == (hooks[1],)
        tokens = [torch.argmax(run.result.logits) for run in runs]
        for position in range(40, 40 + NEW_TOKENS):
            tokens = [torch.argmax(step(token, position)) for step, token in zip(steps, tokens, strict=True)]
            assert int(tokens[0]) == int(tokens[1])
            dynamic, fixed = runs[0].result.cache, steps[1].cache
            for layer in (1, 2):
                held = dynamic.positions[layer].shape[1]
                assert torch.equal(fixed.positions[layer][:, :held], dynamic.positions[layer])
                assert (fixed.positions[layer][:, held:] == -1).all()
                torch.testing.assert_close(fixed.keys[layer][:, :, :held], dynamic.keys[layer])
        assert hooks[1].decisions == hooks[0].decisions
        assert sum(decision.swapped for decision in hooks[0].decisions) >= 2
    assert len(static._static_decodes) == 1 and next(iter(static._static_decodes.values())).reuses == 1


@pytest.mark.graphs
def test_sliminfers_compiled_parts_trace_whole_and_choose_the_eager_tokens(random_ids):
    """``--compile-decode`` with SlimInfer: each part of the step compiles as one graph with no break
    (its scoring, ring of queries and choice included; the sort is torch's, as on CUDA), and the
    compiled decode makes the eager dynamic cache's decisions and tokens, prompt after prompt."""
    from torch._dynamo.utils import counters

    counters.clear()
    model = tiny_model("llama")
    eager, compiled = Runner(model), Runner(model, cuda_graphs=True, compile_decode=True)
    params = {**SLIMINFER_SMALL_BLOCKS, "gamma": 1.0}
    for ids in (random_ids, random_ids.flip(0)):
        methods = [make("sliminfer", **params) for _ in range(2)]
        runs = []
        for runner, method in zip((eager, compiled), methods, strict=True):
            run = method.prefill(runner, ids, Budget.from_keep(0.5))
            runs.append((greedy_continue(runner, run.result, NEW_TOKENS, run.decode_hooks), run.decode_hooks[0]))
        assert runs[1][0] == runs[0][0]
        assert runs[1][1].decisions == runs[0][1].decisions and any(each.swapped for each in runs[0][1].decisions)
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]  # one per part


@pytest.mark.parametrize(("family", "keep"), [("llama", 0.5), ("llama", 0.2), ("gemma2", 0.2), ("gemma2", 0.5)])
def test_tovas_eviction_runs_over_the_static_cache_as_over_the_dynamic_one(family, keep, random_ids):
    """TOVA evicts at every step from every layer past the budget, which a graph replays: after every
    step each head of both caches holds the same entries (positions, keys and values), the static
    cache's among its first budget + 1 slots (the one it freed is what the next step writes), the rest
    padding. gemma2's local layers see 8 keys: at the budget at 0.2, under it at 0.5, where they grow
    by an entry a step until they reach it, in both caches, the static one deciding on the device
    whether the step evicts."""
    eager, static = _both(family)
    budget = Budget.from_keep(keep)
    runs = [make("tova").prefill(runner, random_ids, budget) for runner in (eager, static)]
    keep_tokens = budget.resolve(40)
    assert all(run.result.cache.held == dict.fromkeys(range(eager.num_layers), keep_tokens) for run in runs)
    assert runs[1].decode_hooks[0].replay_key == "tova-eviction"
    steps = [runner.decoder(run.result, NEW_TOKENS, run.decode_hooks) for runner, run in zip((eager, static), runs, strict=True)]
    assert isinstance(steps[1].cache, StaticKVCache)
    dynamic, fixed = runs[0].result.cache, steps[1].cache
    prefilled = [dynamic.get_seq_length(layer) for layer in range(eager.num_layers)]
    assert max(prefilled) == keep_tokens and (min(prefilled) < keep_tokens) == ((family, keep) == ("gemma2", 0.5))
    tokens = [torch.argmax(run.result.logits) for run in runs]
    decoded = 2 * NEW_TOKENS  # a local layer under the budget reaches it and evicts too
    for position in range(40, 40 + decoded):
        tokens = [torch.argmax(step(token, position)) for step, token in zip(steps, tokens, strict=True)]
        assert int(tokens[0]) == int(tokens[1])
        for layer in range(eager.num_layers):
            length = dynamic.get_seq_length(layer)
            assert length == min(keep_tokens, prefilled[layer] + position - 39)
            assert (fixed.positions[layer][:, keep_tokens + 1 :] == -1).all()
            for head, positions in enumerate(fixed.positions[layer]):
                slots = torch.nonzero(positions != -1)[:, 0]
                slots = slots[torch.argsort(positions[slots])]
                order = torch.argsort(dynamic.positions[layer][head])
                assert torch.equal(positions[slots], dynamic.positions[layer][head, order])
                torch.testing.assert_close(fixed.keys[layer][0, head, slots], dynamic.keys[layer][0, head, order])
                torch.testing.assert_close(fixed.values[layer][0, head, slots], dynamic.values[layer][0, head, order])


def test_a_static_decode_is_kept_by_its_hooks_work_too(random_ids, monkeypatch):
    """Full's decode and TOVA's over caches of one shape are two graphs: full never replays an eviction."""
    eager, static = _both("llama")
    monkeypatch.setattr(static, "_static_decodes_bytes", lambda: float("inf"))
    tova = [run_once(runner, make("tova"), random_ids, Budget.from_keep(0.5), NEW_TOKENS) for runner in (eager, static)]
    full = [run_once(runner, make("full"), random_ids, Budget.from_keep(1.0), NEW_TOKENS) for runner in (eager, static)]
    assert [tova[1].tokens, full[1].tokens] == [tova[0].tokens, full[0].tokens]
    keys = list(static._static_decodes)
    assert [key.hooks for key in keys] == [("tova-eviction",), ()] and keys[0].shape[:4] == keys[1].shape[:4]


def test_a_held_layer_under_its_size_gets_a_buffer_for_its_size_and_the_slot_a_step_writes():
    """A local layer that saw fewer keys than TOVA's budget fills up to it and then writes one slot more
    before each eviction: its buffer takes budget + 1 slots, more than its entries and the steps need."""
    cache = KVCache(2)
    cache.begin_step(torch.arange(100))
    for layer in range(2):
        cache.update(torch.zeros(1, 2, 100, 16), torch.zeros(1, 2, 100, 16), layer)
    cache.hold_size(0, STATIC_BUCKET)
    assert StaticKVCache.buckets(cache, 4) == [2, 1]  # 257 slots, and 104
    assert [keys.shape[2] for keys in StaticKVCache(cache, 4).keys] == [2 * STATIC_BUCKET, STATIC_BUCKET]
    cache.hold_size(0, STATIC_BUCKET - 1)
    assert StaticKVCache.buckets(cache, 4) == [1, 1]  # 256 slots


def test_tovas_static_decodes_at_two_budgets_are_two_graphs(random_ids, monkeypatch):
    """A graph's eviction chooses among the first budget + 1 slots, a host number it was captured
    with: TOVA at 20 and at 16 entries a layer, over buffers of one size, keeps two static decodes,
    and each replays the eager dynamic cache's tokens."""
    eager, static = _both("llama")
    monkeypatch.setattr(static, "_static_decodes_bytes", lambda: float("inf"))
    for keep in (0.5, 0.4, 0.5):
        runs = [run_once(runner, make("tova"), random_ids, Budget.from_keep(keep), NEW_TOKENS) for runner in (eager, static)]
        assert runs[1].tokens == runs[0].tokens, keep
    shapes = [key.shape for key in static._static_decodes]
    assert [shape[4] for shape in shapes] == [tuple((layer, 16) for layer in range(3)), tuple((layer, 20) for layer in range(3))]
    assert shapes[0][:4] == shapes[1][:4]


def test_greedy_decoding_past_eos_when_asked(random_ids):
    runner = Runner(tiny_model("llama"))
    prefill = runner.prefill(random_ids)
    tokens = greedy_continue(runner, prefill, NEW_TOKENS)
    runner.model.generation_config.eos_token_id = tokens[2]
    assert greedy_continue(runner, runner.prefill(random_ids), NEW_TOKENS) == tokens[:3]
    assert greedy_continue(runner, runner.prefill(random_ids), NEW_TOKENS, stop_at_eos=False) == tokens


def test_cuda_graphs_with_a_device_map_is_refused_before_anything_loads():
    from rankkit.bench import Setup
    from rankkit.errors import RankkitError

    with pytest.raises(RankkitError, match="--cuda-graphs decodes on one device"):
        Setup(device_map="auto", cuda_graphs=True)


def test_compile_decode_without_cuda_graphs_is_refused_before_anything_loads():
    from rankkit.bench import Setup
    from rankkit.errors import RankkitError

    for make_it in (lambda: Setup(compile_decode=True), lambda: Runner(tiny_model("llama"), compile_decode=True)):
        with pytest.raises(RankkitError, match="--compile-decode compiles the static-cache decode step: add --cuda-graphs"):
            make_it()


@pytest.mark.graphs
def test_the_static_decode_step_traces_as_one_graph_with_no_break(family, random_ids):
    """What ``--compile-decode`` compiles: every family's whole static step, so the fusion spans it."""
    import torch._dynamo

    torch._dynamo.reset()
    runner = Runner(tiny_model(family), cuda_graphs=True)
    cache = StaticKVCache(runner.prefill(random_ids).cache, NEW_TOKENS)
    with torch.inference_mode():
        explained = torch._dynamo.explain(runner._decode)(torch.zeros((1, 1), dtype=torch.long), torch.tensor([40]), cache, ())
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.graphs
@pytest.mark.parametrize("split", [False, True])  # SDPA's masked kernel, or the split path CUDA takes
def test_a_compiled_static_decode_chooses_the_dynamic_caches_tokens(random_ids, split):
    """``--compile-decode``: the static step compiled by torch.compile (inductor's C++ kernels on CPU,
    Triton's on CUDA) chooses the eager dynamic cache's tokens, for full and then for a rolling window
    that wraps in the steps: the same buffers and the same compiled graph, whole (windows are data)."""
    from torch._dynamo.utils import counters

    counters.clear()
    model = tiny_model("llama")
    eager, compiled = Runner(model), Runner(model, cuda_graphs=True, compile_decode=True)
    compiled.split_decode_from = 0 if split else None
    assert compiled.generate(random_ids, NEW_TOKENS).tokens == eager.generate(random_ids, NEW_TOKENS).tokens
    runs = [
        run_once(runner, make("streamingllm"), random_ids, Budget.from_keep(0.2), NEW_TOKENS)
        for runner in (eager, compiled)
    ]
    assert runs[1].tokens == runs[0].tokens
    assert len(compiled._static_decodes) == 1  # one cache shape (40 entries and 8 fit one bucket)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


@pytest.mark.graphs
def test_a_compiled_step_first_run_under_the_cpu_memory_tracker_still_compiles(random_ids):
    """A bench's first warm-up on CPU tracks peak memory in a Python dispatch mode; torch.compile first
    called under one ran the step eagerly and never compiled that code again, so every later run of
    `rankkit bench --cuda-graphs --compile-decode` on CPU timed the eager step. The warm-up now
    compiles the step, its peak is measured, and a timed run after it compiles nothing more."""
    from torch._dynamo.utils import counters

    from rankkit.methods.measure import warm_up

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("llama")
    eager, compiled = Runner(model), Runner(model, cuda_graphs=True, compile_decode=True)
    budget = Budget.from_keep(1.0)
    peak = warm_up(compiled, make("full"), random_ids, budget, NEW_TOKENS, tokenizer=None, runs=1)
    assert peak > 0 and counters["stats"]["unique_graphs"] == 1
    timed = run_once(compiled, make("full"), random_ids, budget, NEW_TOKENS)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert timed.tokens == eager.generate(random_ids, NEW_TOKENS).tokens


@pytest.mark.graphs
def test_tovas_eviction_compiles_into_the_static_step_whole(random_ids):
    """``--compile-decode`` with a hook a graph replays: TOVA's scoring and eviction trace into the one
    compiled step (no break), which chooses the eager dynamic cache's tokens, prompt after prompt."""
    from torch._dynamo.utils import counters

    counters.clear()
    model = tiny_model("llama")
    eager, compiled = Runner(model), Runner(model, cuda_graphs=True, compile_decode=True)
    for ids in (random_ids, random_ids.flip(0)):
        runs = [run_once(runner, make("tova"), ids, Budget.from_keep(0.2), NEW_TOKENS) for runner in (eager, compiled)]
        assert runs[1].tokens == runs[0].tokens
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


@pytest.mark.parametrize("keys", [40, 256, 600])  # below one split, exactly two, two and a tail
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_decode_attention_is_sdpa_over_the_same_mask(keys, dtype):
    from rankkit.runner import split_decode_attention

    generator = torch.Generator().manual_seed(keys)
    kv_heads, group, dim = 2, 3, 16
    query, key, value = (
        torch.randn(1, kv_heads, rows, dim, generator=generator).to(dtype) for rows in (group, keys, keys)
    )
    mask = torch.rand(1, kv_heads, 1, keys, generator=generator) < 0.7  # ragged heads, padding anywhere
    mask[..., -1] = True  # the new token sees itself
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.float(), key.float(), value.float(), attn_mask=mask, scale=0.3
    )
    got = split_decode_attention(query, key, value, mask, 0.3)
    assert got.shape == (1, kv_heads, group, dim) and got.dtype == dtype
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0.05, "atol": 0.02}
    torch.testing.assert_close(got.float(), expected, **tolerance)
    shared = mask[:, :1]  # one mask for every head (a cache whose heads keep the same entries)
    torch.testing.assert_close(
        split_decode_attention(query, key, value, shared, 0.3).float(),
        torch.nn.functional.scaled_dot_product_attention(
            query.float(), key.float(), value.float(), attn_mask=shared, scale=0.3
        ),
        **tolerance,
    )


@pytest.mark.parametrize("name", ["full", "sage-kv", "adakv", "streamingllm"])
def test_the_split_masked_decode_chooses_sdpas_tokens(name, random_ids, monkeypatch):
    """The split path, on by default on CUDA, turned on here: a static cache (masked tail) and ragged
    heads (masked padding) decode the tokens SDPA's masked kernels choose."""
    from rankkit import runner as runner_module

    split = runner_module.split_decode_attention
    calls = []
    monkeypatch.setattr(runner_module, "split_decode_attention", lambda *args: calls.append(1) or split(*args))
    eager, static = _both("llama")
    assert eager.split_decode_from is None  # off on CPU
    static.split_decode_from = 0  # however few the keys
    runs = []
    for runner in (eager, static):
        method = make(name)
        method.prepare(runner, random_ids, tokenizer=NoTextTokenizer())
        runs.append(run_once(runner, method, random_ids, Budget.from_keep(0.5), NEW_TOKENS))
    assert runs[1].tokens == runs[0].tokens
    assert len(calls) == (NEW_TOKENS - 1) * static.num_layers  # every layer of every decode step split
    static.split_decode_from = 10_000  # more keys than the cache holds: SDPA's kernel, no split
    run_once(static, method, random_ids, Budget.from_keep(0.5), NEW_TOKENS)
    assert len(calls) == (NEW_TOKENS - 1) * static.num_layers


def _counting_splits(monkeypatch) -> list:
    from rankkit import runner as runner_module

    split = runner_module.split_decode_attention
    calls = []
    monkeypatch.setattr(runner_module, "split_decode_attention", lambda *args: calls.append(1) or split(*args))
    return calls


def test_an_unmasked_decode_step_leaves_its_keys_to_sdpa_however_many(random_ids, monkeypatch):
    """A dynamic cache's step (no mask) is never split: split at 32k and 64k keys, the step took 1.30x
    model.generate's, whose unmasked SDPA kernel is faster than the masked one (docs/benchmarks.md, "GPU")."""
    calls = _counting_splits(monkeypatch)
    eager, lowered = Runner(tiny_model("llama")), Runner(tiny_model("llama"))
    lowered.split_decode_from = lowered.split_decode_from_in_graphs = 0
    assert lowered.generate(random_ids, NEW_TOKENS).tokens == eager.generate(random_ids, NEW_TOKENS).tokens
    assert calls == []


@pytest.mark.parametrize("capturing", [False, True])
def test_a_masked_decode_step_splits_from_its_modes_threshold_and_an_unmasked_one_never(capturing, monkeypatch):
    """Inside a captured graph launches cost nothing, so a masked step splits from fewer keys there;
    the split attends as SDPA does, and an unmasked step stays with SDPA at any length."""
    calls = _counting_splits(monkeypatch)
    runner = Runner(tiny_model("llama"), cuda_graphs=True)
    runner.split_decode_from, runner.split_decode_from_in_graphs = (600, 300) if capturing else (300, 600)
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(1, 6, 1, 16, generator=generator)  # 3 query heads per KV head
    key, value = (torch.randn(1, 2, 300, 16, generator=generator) for _ in range(2))
    mask = torch.rand(1, 2, 1, 300, generator=generator) < 0.8
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(3, dim=1), value.repeat_interleave(3, dim=1),
        attn_mask=mask.repeat_interleave(3, dim=1), scale=0.25,
    ).transpose(1, 2)
    with runner.capturing() if capturing else nullcontext():
        torch.testing.assert_close(runner.attention(query, key, value, mask, 0.25), expected, rtol=1e-5, atol=1e-5)
        assert len(calls) == 1  # 300 keys: this mode's threshold exactly, short of the other's 600
        runner.split_decode_from = runner.split_decode_from_in_graphs = 0
        runner.attention(query, key, value, None, 0.25)
    assert len(calls) == 1


class StandInGraph:
    """``torch.cuda.CUDAGraph`` in name only: it records its pool and its replays (nothing runs on a CPU)."""

    log: list = []

    def pool(self):
        return ("pool of", id(self))

    def replay(self):
        StandInGraph.log.append(("replay", self))


class PartRecorder(LayerHook):
    """Host work after layer 0, logged between the replays."""

    decode_breaks = (0,)
    replay_key = "part-recorder"

    def after_decode_layer(self, layer, cache):
        StandInGraph.log.append(("host work after", layer))


def test_a_step_cut_in_parts_is_captured_as_a_graph_per_part_and_replayed_with_the_host_work_between(
    random_ids, monkeypatch
):
    """The orchestration a CUDA graph decode of several parts needs, with stand-in graphs (a CPU captures
    nothing): after the warm-up each part is captured once, the later ones in the first one's memory
    pool, each reading the part before's output; every step replays the parts in order, the host
    work of the decode's own hooks between them, and returns the last part's output."""
    captures, StandInGraph.log = [], []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)

    @contextmanager
    def capture(graph, pool=None):
        captures.append((graph, pool))
        yield

    monkeypatch.setattr(torch.cuda, "graph", capture)
    runner = Runner(tiny_model("llama"), cuda_graphs=True)
    prefill = runner.prefill(random_ids)
    decode = runner.decoder(prefill, NEW_TOKENS, [PartRecorder()])
    decode.graphed = True  # as on CUDA
    assert decode.parts == [range(0, 1), range(1, 3)]
    token = torch.argmax(prefill.logits)
    decode(token, 40)  # the warm-up, eagerly: its host work too
    assert not captures and StandInGraph.log == [("host work after", 0)]
    StandInGraph.log.clear()
    logits = decode(token, 41)
    first, second = decode.graphs
    assert captures == [(first, None), (second, first.pool())]
    hidden = runner.config.hidden_size
    assert decode.outputs[0].shape == (1, 1, hidden) and logits is decode.outputs[1]  # hidden state, then logits
    assert StandInGraph.log == [("replay", first), ("host work after", 0), ("replay", second)]
    decode(token, 42)
    assert len(captures) == 2 and StandInGraph.log[3:] == StandInGraph.log[:3]


def test_a_graphs_warm_up_step_makes_the_captures_choices(random_ids, monkeypatch):
    """The warm-up step before a capture runs as the capture will (the graph's split threshold), so a
    compiled step is compiled there and the capture replays it, not a second compilation."""
    calls = _counting_splits(monkeypatch)
    runner = Runner(tiny_model("llama"), cuda_graphs=True)
    runner.split_decode_from, runner.split_decode_from_in_graphs = 10_000, 0
    prefill = runner.prefill(random_ids)
    decode = runner.decoder(prefill, NEW_TOKENS)
    decode.graphed = True  # as on CUDA; only the warm-up runs here, the capture needs a GPU
    decode(torch.argmax(prefill.logits), 40)
    assert decode.warmed and not decode.graphs and not runner._capturing
    assert len(calls) == runner.num_layers


@pytest.mark.parametrize("name", ["snapkv", "streamingllm", "sage-kv"])
def test_a_compressed_cache_holds_no_tensor_beyond_its_entries(name, random_ids):
    """After the cut, and after rolled decode steps, every tensor the cache keeps shares storage
    with its entries (or is the step's positions, or the slot numbers its appends write): nothing keeps
    the prefill's uncut keys alive."""
    from torch.utils._pytree import tree_leaves

    runner = Runner(tiny_model("llama"))
    run = make(name).prefill(runner, random_ids, Budget.from_keep(0.2))
    cache = run.result.cache
    for decoded in (False, True):
        if decoded:
            greedy_continue(runner, run.result, NEW_TOKENS, run.decode_hooks)
        # besides the entries: a padded layer's decode mask, one bool per entry and head (with room)
        masks = list(cache._real.values())
        assert all(mask.dtype == torch.bool and mask.shape[:-1] == (1, 2, 1) for mask in masks)
        # the slot numbers appends write, made once (a view of them is a step's slots)
        offsets = list(cache._offsets.values())
        assert all(torch.equal(numbers, torch.arange(len(numbers))) for numbers in offsets) and len(offsets) <= 1
        entries = [*cache.keys, *cache.values, *cache.positions, cache._incoming, *masks, *offsets]
        allowed = {tensor.untyped_storage().data_ptr() for tensor in entries}
        held = [leaf for leaf in tree_leaves(vars(cache)) if isinstance(leaf, torch.Tensor)]
        assert held and all(tensor.untyped_storage().data_ptr() in allowed for tensor in held), decoded


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_specprefills_lookahead_replays_the_drafts_static_decode_prompt_after_prompt(family, random_ids):
    """With ``--cuda-graphs`` the draft's lookahead decodes over its static cache, as a graph would: the
    same Eq. 3 rows as the eager draft for each prompt, the second prompt through the first one's kept
    decode (whose hook wrote them: ``AnswerAttention.replayed_as``), and the first prompt's rows kept."""
    from rankkit.methods.specprefill import draft_runner, lookahead_scores

    eager, static = _both(family)
    prompts = [random_ids, random_ids.flip(0)]
    expected = [lookahead_scores(draft_runner("layers:2", eager), ids, 4)[0] for ids in prompts]
    got = [lookahead_scores(draft_runner("layers:2", static), ids, 4)[0] for ids in prompts]
    assert got[0].shape == (4, 40) and not torch.equal(expected[0], expected[1])
    for rows, want in zip(got, expected, strict=True):
        torch.testing.assert_close(rows, want, rtol=1e-5, atol=1e-5)
    (key,) = static._static_decodes  # one kept decode of the draft, reused by the second prompt
    assert key.hooks == ("answer-attention:2x40:softmax=False:rows=4",) and len(key.shape[0]) == 2
    kept = static.kept_static_uses()  # a run's memory counts the draft's kept buffers it reuses
    lookahead_scores(draft_runner("layers:2", static), prompts[0], 4)
    assert static.reused_static_bytes(kept) == StaticKVCache.buffer_bytes(key.shape) > 0


def test_the_oracle_decodes_over_the_static_cache_as_over_the_dynamic_one(random_ids):
    """The oracle's answer queries through a kept static decode: each prompt's own means, none summed
    into the next prompt's."""
    from rankkit.oracle import answer_informed_oracle

    eager, static = _both("llama")
    for ids in (random_ids, random_ids.flip(0), random_ids):
        results = [answer_informed_oracle(runner, ids, tokenizer=NoTextTokenizer(), max_new_tokens=4) for runner in (eager, static)]
        assert results[1].answer_tokens == results[0].answer_tokens
        np.testing.assert_allclose(results[1].scores, results[0].scores, rtol=1e-5)
        np.testing.assert_allclose(results[1].layer_scores, results[0].layer_scores, rtol=1e-5)
    assert len(static._static_decodes) == 1


@pytest.mark.graphs
def test_a_self_draft_compiles_its_own_step_after_the_target_compiled_its(random_ids):
    """``--compile-decode``: the target's compiled step runs every layer, so a draft of its first layers,
    cut after the target compiled, compiles its own: the answer attention traces into it whole (one
    graph, no break, prompt after prompt), and it scores as the eager draft does."""
    from torch._dynamo.utils import counters

    from rankkit.methods.specprefill import draft_runner, lookahead_scores

    model = tiny_model("llama")
    eager, compiled = Runner(model), Runner(model, cuda_graphs=True, compile_decode=True)
    compiled.generate(random_ids, 2)
    draft = draft_runner("layers:1", compiled)
    assert draft is draft_runner("layers:1", compiled) and draft.static_part(range(1)) is not compiled.static_part(range(1))
    counters.clear()
    for ids in (random_ids, random_ids.flip(0)):
        rows, _ = lookahead_scores(draft, ids, 3)
        want, _ = lookahead_scores(draft_runner("layers:1", eager), ids, 3)
        torch.testing.assert_close(rows, want, rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
