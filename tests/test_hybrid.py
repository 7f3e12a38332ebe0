"""Hybrid models (local sliding-window layers beside global ones): methods select at global
layers by default, online and offline alike, and a local layer's compressed cache keeps only
keys the layer can attend to."""

from __future__ import annotations

import warnings

import pytest
import torch

from rankkit.methods import Budget, Captured, make
from rankkit.methods.base import on_global_layers
from rankkit.runner import Runner

LOCAL, GLOBAL = "sliding_attention", "full_attention"
HYBRID_LAYERS = (LOCAL, LOCAL, GLOBAL, LOCAL, LOCAL, GLOBAL)  # Gemma-style local:global 2:1
WINDOW = 16  # local layers see the last 16 of the 40 prompt tokens


def hybrid_runner(
    seed: int = 0,
    *,
    layers: tuple[str, ...] = HYBRID_LAYERS,
    window: int = WINDOW,
    kv_heads: int | None = None,
    peaked: bool = True,
) -> Runner:
    """The tiny Qwen2 with one layer per entry of ``layers``, a ``window``-token window on the local
    ones; ``peaked`` scales the query and key weights so that rankings differ between tokens."""
    from conftest import tiny_config
    from transformers import AutoModelForCausalLM

    config = tiny_config("qwen2")
    config.num_hidden_layers = len(layers)
    config.layer_types = list(layers)
    config.use_sliding_window, config.sliding_window = True, window
    if kv_heads is not None:
        config.num_key_value_heads = kv_heads
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    if peaked:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    parameter.mul_(8.0)
    return Runner(model.eval())


@pytest.fixture(scope="module")
def runner():
    return hybrid_runner()


def _captured(runner, ids, probes) -> Captured:
    from rankkit.probes import ProbeRecorder

    recorder = ProbeRecorder(probes)
    runner.prefill(ids, hooks=[recorder])
    arrays = {key: torch.from_numpy(scores) for key, scores in recorder.scores().items()}
    return Captured(arrays, runner.num_layers, int(ids.numel()), runner.layer_types, WINDOW)


# ---- item 1: default selection layers on global layers


def test_default_layers_move_to_the_nearest_global_layer_ties_to_the_earlier():
    assert on_global_layers(3, HYBRID_LAYERS) == 2  # 2 is one away, 5 two
    assert on_global_layers(4, HYBRID_LAYERS) == 5
    assert on_global_layers(2, (GLOBAL, LOCAL, LOCAL, LOCAL, GLOBAL)) == 0  # a tie: the earlier
    assert on_global_layers((2, 4, 5), HYBRID_LAYERS) == (2, 5)  # SlimInfer's layers, once each
    assert on_global_layers(3, None) == 3 and on_global_layers(3, (LOCAL,) * 6) == 3

    # round(15 * 6 / 32) = 3, a local layer: every pruning method's default moves to 2
    for name, parameter in [
        ("fastkv", "tsp_layer"),
        ("claa", "pruning_layer"),
        ("gemfilter", "routing_layer"),
    ]:
        assert getattr(make(name).bind(6), parameter) == 3
        assert getattr(make(name).bind(6, HYBRID_LAYERS), parameter) == 2
        assert getattr(make(name).with_layer(4).bind(6, HYBRID_LAYERS), parameter) == 4  # --layer as given
    assert make("sliminfer").bind(6, HYBRID_LAYERS).pruning_layers == (2, 5)
    assert make("claa").resolved(6, HYBRID_LAYERS)["pruning_layer"] == 2  # what a run records


def test_runner_reads_layer_types_only_when_some_layer_is_local(runner):
    from transformers import Llama4TextConfig, LlamaConfig, MistralConfig, Qwen2Config

    from rankkit.runner import layer_types

    assert runner.layer_types == HYBRID_LAYERS
    assert layer_types(LlamaConfig()) is None and layer_types(MistralConfig(sliding_window=8)) is None
    assert layer_types(Qwen2Config(num_hidden_layers=2)) is None  # named types, no window: all global
    assert layer_types(Qwen2Config(num_hidden_layers=2, layer_types=[GLOBAL, LOCAL])) is None
    # a window on every layer, and on none
    windowed = {"num_hidden_layers": 2, "use_sliding_window": True, "sliding_window": 8}
    assert layer_types(Qwen2Config(**windowed, layer_types=[LOCAL, LOCAL])) == (LOCAL, LOCAL)
    assert layer_types(Qwen2Config(**windowed, layer_types=[GLOBAL, GLOBAL])) is None
    # Llama 4's chunked layers have a chunk size, no sliding window
    chunked = Llama4TextConfig(num_hidden_layers=4)
    assert chunked.attention_chunk_size and not getattr(chunked, "sliding_window", None)
    assert layer_types(chunked) == ("chunked_attention",) * 3 + (GLOBAL,)


@pytest.mark.parametrize("name", ["fastkv", "claa", "gemfilter", "sliminfer"])
def test_prefill_and_the_store_select_at_the_same_global_layer(runner, random_ids, name):
    params = {"block_size": 4, "unit_size": 2, "window_size": 2} if name == "sliminfer" else {}
    method = make(name, **params)
    budget = Budget.from_keep(0.4)
    online = method.prefill(runner, random_ids, budget)
    offline = method.select_offline(_captured(runner, random_ids, [method.probe()]), budget)
    assert online.selection_layer == offline.layer == 2
    assert online.kept_positions.tolist() == offline.positions.tolist()


def test_capture_records_layer_types_of_hybrid_models_only(runner):
    from rankkit.capture import run_meta
    from rankkit.eval.offline import recorded_model
    from rankkit.models import LoadedModel

    class Tokenizer:
        def __len__(self):
            return 97

    def meta(model):
        return run_meta(LoadedModel(model, Tokenizer(), "tiny", "hash", torch.device("cpu")), [], "niah:length=64")

    hybrid = meta(runner.model)
    kv_heads = runner.config.num_key_value_heads
    assert recorded_model(hybrid) == {
        "layer_types": list(HYBRID_LAYERS),
        "sliding_window": WINDOW,
        "kv_heads": kv_heads,
        "query_heads": runner.config.num_attention_heads,
    }

    from conftest import tiny_model

    plain = meta(tiny_model("llama"))
    assert "layer_types" not in plain["model"]
    assert recorded_model(plain) == {
        "kv_heads": plain["kv_heads"],
        "query_heads": plain["num_attention_heads"],
    }


def test_select_on_a_hybrid_store_uses_its_recorded_layer_types(runner, random_ids, tmp_path):
    from rankkit import stores
    from rankkit.eval.offline import select_store
    from rankkit.probes import ProbeRecorder

    claa = make("claa")
    recorder = ProbeRecorder([claa.probe()])
    runner.prefill(random_ids, hooks=[recorder])
    meta = {"model": {"id": "tiny"}, "probes": {claa.probe().key: claa.probe().params()}}
    for name, layer_types, layer in [("old", None, 3), ("hybrid", list(HYBRID_LAYERS), 2)]:
        if layer_types is not None:
            meta["model"] |= {"layer_types": layer_types, "sliding_window": WINDOW}
        writer = stores.create(tmp_path / f"{name}.zarr", meta)
        writer.write_example("ex0", attrs={}, tokens=random_ids.numpy(), scores=recorder.scores())
        (row,) = select_store(tmp_path / f"{name}.zarr", "claa", keep=0.4)
        assert row["layer"] == layer  # a store without layer types is all-global, as stores were
    online = claa.prefill(runner, random_ids, Budget.from_keep(0.4))
    assert row["selected_positions"] == online.kept_positions.tolist()


def test_select_says_a_local_layer_keeps_fewer_than_its_budget(runner, random_ids, tmp_path):
    """select's budget_tokens was the most a head kept (16 at a local layer under a budget of 20),
    where bench's is the budget: both are given now, as budget_tokens and kept_tokens."""
    from rankkit import stores
    from rankkit.eval.offline import select_store
    from rankkit.probes import ProbeRecorder

    snapkv = make("snapkv", window_size=4)
    recorder = ProbeRecorder([snapkv.probe()])
    runner.prefill(random_ids, hooks=[recorder])
    model = {"id": "tiny", "layer_types": list(HYBRID_LAYERS), "sliding_window": WINDOW}
    writer = stores.create(tmp_path / "s.zarr", {"model": model, "probes": {snapkv.probe().key: snapkv.probe().params()}})
    writer.write_example("ex0", attrs={}, tokens=random_ids.numpy(), scores=recorder.scores())
    for layer, kept in [(0, WINDOW), (2, 20)]:
        (row,) = select_store(tmp_path / "s.zarr", "snapkv:window_size=4", budget=20, layer=layer)
        assert (row["budget_tokens"], row["kept_tokens"]) == (20, kept), layer
        assert all(len(head) == kept for head in row["selected_positions"])


# ---- item 2: a local layer's compressed cache keeps only keys its window sees


def seen_positions(layer: int, length: int) -> list[int]:
    """The prompt positions a layer's last query attends to, straight from the layer types."""
    first = length - WINDOW if HYBRID_LAYERS[layer] == LOCAL else 0
    return list(range(max(0, first), length))


def reference_keep(scores: list[float], k: int, forced: set[int], seen: list[int]) -> list[int]:
    """The slow rule: among the seen positions, forced ones first, then by score, ties to the earlier."""
    ranked = sorted(seen, key=lambda position: (position not in forced, -scores[position], position))
    return sorted(ranked[:k])


def cached(run, layer: int) -> list[list[int]]:
    positions = run.result.cache.positions[layer]
    return [sorted(p for p in head.tolist() if p >= 0) for head in positions]


@pytest.mark.parametrize(
    "name, params, compressed_layers",
    [
        ("snapkv", {"window_size": 4}, range(6)),
        ("streamingllm", {}, range(6)),
        ("fastkv", {}, range(2)),  # the layers before its (global) TSP layer, 2
    ],
)
def test_per_head_compression_keeps_the_best_keys_a_layer_sees(
    runner, random_ids, name, params, compressed_layers
):
    from rankkit.probes import ProbeRecorder

    method = make(name, **params)
    budget = Budget.from_tokens(10)
    length = int(random_ids.numel())
    recorder = ProbeRecorder([] if name == "streamingllm" else [method.probe()])
    runner.prefill(random_ids, hooks=[recorder])
    recorded = recorder.scores()
    window, sinks = method.bind(6).forced(10)
    forced = set(range(sinks)) | set(range(length - window, length))
    run = method.prefill(runner, random_ids, budget)
    for layer in compressed_layers:
        for head, kept in enumerate(cached(run, layer)):
            if name == "streamingllm":
                scores = [float(position) for position in range(length)]
            else:
                scores = recorded[method.probe().key][layer, head].tolist()
            assert kept == reference_keep(scores, 10, forced, seen_positions(layer, length)), (layer, head)
    if name in ("snapkv", "streamingllm"):  # the offline face knows the window from the store's metadata
        stored = {key: torch.from_numpy(scores) for key, scores in recorded.items()}
        captured = Captured(stored, 6, length, HYBRID_LAYERS, WINDOW, kv_heads=2)
        for layer in range(6):  # a set per KV head, as the cache holds (streamingllm's all alike)
            assert method.select_offline(captured, budget, layer=layer).as_lists() == cached(run, layer), layer
    # on the local layers, the sinks StreamingLLM cannot see gave their places to recent tokens
    if name == "streamingllm":
        assert cached(run, 0)[0] == list(range(30, 40)) and cached(run, 2)[0] == [0, 1, 2, 3, *range(34, 40)]
        # decoding, each layer's window is everything after the sinks it holds (a local layer's all of
        # it), and a step's token
        windows = run.result.cache.windows
        assert [windows[layer].size for layer in range(6)] == [11, 11, 7, 11, 11, 7]
        for position in range(40, 40 + 12):  # more steps than either window holds
            runner.decode_step(5, position, run.result.cache, run.decode_hooks)
        assert cached(run, 0) == [list(range(41, 52))] * 2 and cached(run, 2) == [[0, 1, 2, 3, *range(45, 52)]] * 2


def test_streamingllms_ring_on_a_local_layer_is_its_window_not_a_wider_budget(runner, random_ids):
    """At a budget of 24 a local layer (window 16) kept its 16 keys, then grew a ring of 25 entries in
    decoding, of which a step sees 16; its ring now holds its 16 and a step's token, as SAGE-KV's
    does, while a global layer keeps its 4 sinks and a ring of 21."""
    length = int(random_ids.numel())
    run = make("streamingllm").prefill(runner, random_ids, Budget.from_tokens(24))
    windows = run.result.cache.windows
    assert [windows[layer].size for layer in range(6)] == [17 if kind == LOCAL else 21 for kind in HYBRID_LAYERS]
    for position in range(length, length + 30):  # more steps than any ring holds
        runner.decode_step(5, position, run.result.cache, run.decode_hooks)
    last = length + 29
    for layer, kind in enumerate(HYBRID_LAYERS):
        kept = cached(run, layer)
        if kind == LOCAL:  # what the last step saw, and the one key the next one no longer does
            assert kept == [list(range(last - WINDOW, last + 1))] * 2, layer
        else:
            assert kept == [[0, 1, 2, 3, *range(last - 20, last + 1)]] * 2, layer


class LastQueryAttention:
    """Records each prefill layer's last-query softmax attention per query head [kv_heads, group, S]."""

    def __init__(self):
        self.layers = {}

    def on_attention(self, call):
        from rankkit.probes.attention import window_attention

        if call.phase == "prefill":
            self.layers[call.layer] = window_attention(call, 1)

    def after_layer(self, layer, state):
        pass


def reference_sage_kv(attention, budget: int, group: int, seen: list[int]) -> list[list[int]]:
    """SAGE-KV Steps 1-3 by hand over the keys a layer sees: sinks B/4 (those it sees), k = B/(2G)
    per query head, the recent window the rest plus the sinks it cannot see; all it sees if that fits."""
    length = attention.shape[-1]
    if len(seen) <= budget:
        return [seen] * attention.shape[0]
    sinks = budget // 4
    k = budget // (2 * group)
    lost = sum(1 for position in range(sinks) if position not in seen)
    recent = set(range(length - (budget - sinks - group * k + lost), length))
    always = {position for position in range(sinks) if position in seen} | recent
    candidates = [position for position in seen if position >= sinks and position not in recent]
    kept = []
    for head in attention:
        union = set(always)
        for query_head in head.tolist():
            union |= set(sorted(candidates, key=lambda position: -query_head[position])[:k])
        kept.append(sorted(union))
    return kept


@pytest.mark.parametrize("tokens", [8, 20])  # under and over the 16 keys a local layer sees
def test_sage_kv_keeps_only_keys_a_layer_sees_and_rolls_each_layers_window(runner, random_ids, tokens):
    attention = LastQueryAttention()
    runner.prefill(random_ids, hooks=[attention])
    length = int(random_ids.numel())
    run = make("sage-kv").prefill(runner, random_ids, Budget.from_tokens(tokens))
    for layer in range(6):
        expected = reference_sage_kv(attention.layers[layer], tokens, 2, seen_positions(layer, length))
        assert cached(run, layer) == expected, layer
    # Step 4 rolls each layer's own recent window: the first step's token joins it, the next takes
    # the oldest's slot, and every layer keeps that size (a local layer's too: no key leaves)
    sizes = [[size + 1 for size in run.result.cache.kept_tokens(layer).tolist()] for layer in range(6)]
    for position in (length, length + 1):
        greedy = runner.decode_step(5, position, run.result.cache, run.decode_hooks)
        assert greedy.isfinite().all()
    assert [run.result.cache.kept_tokens(layer).tolist() for layer in range(6)] == sizes
    for layer in range(6):
        assert {length, length + 1} <= set(run.result.cache.positions[layer][0].tolist())


def reference_adakv(rows: torch.Tensor, k: int, window: int, safeguard: float, seen: list[int]) -> list[list[int]]:
    """AdaKV by hand over the keys a layer sees: each head's first window + int(safeguard x (k - window))
    places go to its window and then its best other seen keys (a window reaching past the keys a
    layer sees holds all of them); then the best seen entries over all heads up to heads x k, ties
    to the earlier head, then the earlier token."""
    heads, length = rows.shape
    forced = [position for position in range(length - window, length) if position in seen]
    first_places = window + int(safeguard * (k - window))
    chosen = set()
    for head, row in enumerate(rows.tolist()):
        others = sorted((p for p in seen if p not in forced), key=lambda position: (-row[position], position))
        chosen |= {(head, position) for position in (forced + others)[:first_places]}
    rest = sorted(
        ((head, position) for head in range(heads) for position in seen if (head, position) not in chosen),
        key=lambda entry: (-float(rows[entry]), *entry),
    )
    chosen |= set(rest[: max(0, heads * k - len(chosen))])
    return [sorted(position for h, position in chosen if h == head) for head in range(heads)]


@pytest.mark.parametrize("tokens", [10, 20])  # under and over the 16 keys a local layer sees
def test_adakv_shares_out_only_keys_each_layer_sees_online_and_offline(runner, random_ids, tokens):
    from rankkit.probes import ProbeRecorder

    adakv = make("adakv", window_size=4, safeguard=0.5)
    budget = Budget.from_tokens(tokens)
    length = int(random_ids.numel())
    run = adakv.prefill(runner, random_ids, budget)
    recorder = ProbeRecorder([adakv.probe()])
    runner.prefill(random_ids, hooks=[recorder])
    scores = torch.from_numpy(recorder.scores()[adakv.probe().key])
    captured = Captured({adakv.probe().key: scores}, 6, length, HYBRID_LAYERS, WINDOW, kv_heads=2)
    for layer in range(6):
        expected = reference_adakv(scores[layer], tokens, 4, 0.5, seen_positions(layer, length))
        assert cached(run, layer) == expected, layer
        assert adakv.select_offline(captured, budget, layer=layer).as_lists() == expected, layer
    entries = [sum(len(head) for head in cached(run, layer)) for layer in range(6)]
    # a global layer spends its 2 x budget entries; a local one as many of its 2 x 16 seen as fit
    assert entries == [min(2 * tokens, 2 * WINDOW) if kind == LOCAL else 2 * tokens for kind in HYBRID_LAYERS]
    # each layer is trimmed to its widest head, which on a local layer is at most its window
    assert all(run.result.cache.positions[layer].shape[1] <= WINDOW for layer in range(6) if HYBRID_LAYERS[layer] == LOCAL)


PER_HEAD = ["snapkv", "pyramidkv", "streamingllm", "tova", "adakv", "sage-kv", "lava"]


def _recorded(runner, ids, method) -> Captured:
    """What a store of ``ids`` holds for ``method`` (no probe for streamingllm's positions), with the
    model's head counts."""
    import dataclasses

    captured = _captured(runner, ids, [method.probe()] if method.captured_inputs() else [])
    config = runner.model.config
    return dataclasses.replace(
        captured, kv_heads=config.num_key_value_heads, query_heads=config.num_attention_heads
    )


@pytest.mark.parametrize("name", PER_HEAD)
def test_a_budget_covering_the_prompt_keeps_what_full_prefill_keeps_online_and_offline(runner, random_ids, name):
    """A budget that covers the prompt is full prefill: a global layer keeps every key, a local one the
    keys its window saw, as full prefill's local layers do (``Runner.roll_local_layers``). The offline
    face of snapkv, pyramidkv, streamingllm, tova and adakv reported every key there, as the prefill
    kept them before the local layers rolled."""
    method = make(name)
    length = int(random_ids.numel())
    budget = Budget.from_keep(1.0)
    run = method.prefill_for_decoding(runner, random_ids, budget)
    captured = _recorded(runner, random_ids, method)
    for layer, kind in enumerate(HYBRID_LAYERS):
        kept = cached(run, layer)
        assert kept == [list(range(length - WINDOW if kind == LOCAL else 0, length))] * 2, layer
        assert method.select_offline(captured, budget, layer=layer).as_lists() == kept, layer


def _greedy_logits(runner, run, steps: int) -> tuple[list[int], torch.Tensor]:
    """``steps`` greedy tokens decoded step by step after a method's prefill, and the logits each
    came from [steps, vocab]."""
    logits, tokens = [run.result.logits], []
    for position in range(run.result.prompt_length, run.result.prompt_length + steps):
        tokens.append(int(logits[-1].argmax()))
        logits.append(runner.decode_step(tokens[-1], position, run.result.cache, run.decode_hooks))
    return tokens, torch.stack(logits)


@pytest.mark.parametrize(
    "name, budget",
    [("full", 1.0), ("gemfilter", 0.5), ("fastkv", 0.5), ("specprefill", 0.5), ("snapkv", 0.25)],
)
def test_a_local_layer_keeps_and_rolls_its_windows_last_keys_and_decodes_as_over_every_key(
    runner, random_ids, name, budget
):
    """Full prefill, and every local layer a method leaves in position order, held every key for
    good, where its window sees 16: the layer now keeps its last 16 entries and rolls 17 in
    decoding. Every step's logits are those of the cache that keeps every key (its mask hides
    them), past the ring's first wrap."""
    length, steps = int(random_ids.numel()), 2 * WINDOW + 5
    method, budget = make(name), Budget.from_keep(budget)
    kept_all = method.prefill(runner, random_ids, budget)
    rolled = method.prefill_for_decoding(runner, random_ids, budget)
    for layer, kind in enumerate(HYBRID_LAYERS):
        every, last = cached(kept_all, layer), cached(rolled, layer)
        assert last == ([head[-WINDOW:] for head in every] if kind == LOCAL else every), layer
    tokens, logits = _greedy_logits(runner, rolled, steps)
    expected_tokens, expected_logits = _greedy_logits(runner, kept_all, steps)
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-5)
    for layer, kind in enumerate(HYBRID_LAYERS):
        if kind == LOCAL:  # the last 17 steps' tokens: 2 * 16 + 5 steps wrote over the ring twice
            assert cached(rolled, layer) == [list(range(length + steps - 1 - WINDOW, length + steps))] * 2


def test_full_prefill_decodes_the_tokens_and_bytes_transformers_sliding_window_cache_does(random_ids):
    """Full's greedy tokens on the hybrid model are ``model.generate``'s, whose cache keeps a local
    layer's last keys only; full's KV bytes are 2 global layers of 40 keys and 4 local ones of 16."""
    from rankkit.methods.measure import run_once

    runner = hybrid_runner()
    config = runner.model.config
    expected = runner.model.generate(
        random_ids[None], max_new_tokens=2 * WINDOW, min_new_tokens=2 * WINDOW, do_sample=False
    )[0, 40:].tolist()
    run = run_once(runner, make("full"), random_ids, Budget.from_keep(1.0), 2 * WINDOW)
    assert run.tokens == expected
    entry_bytes = 2 * config.num_key_value_heads * config.hidden_size // config.num_attention_heads * 4
    assert run.kv_bytes == (2 * 40 + 4 * WINDOW) * entry_bytes


@pytest.mark.parametrize("name, budget", [("full", 1.0), ("gemfilter", 0.5), ("snapkv", 0.25)])
def test_the_static_cache_rolls_a_local_layers_ring_as_the_dynamic_one(random_ids, name, budget):
    """The static decode (``--cuda-graphs``; its same code eagerly on CPU) writes each local layer's
    ring where the dynamic cache does: the same tokens, over more steps than the ring holds."""
    from rankkit.methods.measure import run_once

    eager, static = hybrid_runner(), Runner(hybrid_runner().model, cuda_graphs=True)
    runs = [
        run_once(runner, make(name), random_ids, Budget.from_keep(budget), 2 * WINDOW) for runner in (eager, static)
    ]
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == 2 * WINDOW


@pytest.mark.parametrize("name", PER_HEAD)
def test_kv_only_rankings_put_the_keys_a_local_layer_cannot_see_last(runner, random_ids, name):
    """compare's rankings of the KV-only methods ranked a local layer's unseen keys among the others
    (streamingllm's sinks first of all) though no cut keeps them; sage-kv and lava put them last."""
    method = make(name)
    length = int(random_ids.numel())
    rankings = method.layer_rankings(_recorded(runner, random_ids, method), Budget.from_tokens(10))
    for layer, kind in enumerate(HYBRID_LAYERS):
        unseen = torch.arange(length) < length - WINDOW if kind == LOCAL else torch.zeros(length, dtype=torch.bool)
        assert rankings[layer][unseen].isneginf().all() and not rankings[layer][~unseen].isneginf().any(), layer


def test_lava_budgets_go_to_keys_each_layer_sees_online_and_offline(runner, random_ids):
    from rankkit.probes import ProbeRecorder

    lava = make("lava", window_size=4)
    budget = Budget.from_tokens(10)
    length = int(random_ids.numel())
    run = lava.prefill(runner, random_ids, budget)
    recorder = ProbeRecorder([lava.probe()])
    runner.prefill(random_ids, hooks=[recorder])
    scores = torch.from_numpy(recorder.scores()[lava.probe().key])
    captured = Captured({lava.probe().key: scores}, 6, length, HYBRID_LAYERS, WINDOW)
    total = 0
    for layer in range(6):
        kept = cached(run, layer)
        assert all(set(head) <= set(seen_positions(layer, length)) for head in kept), layer
        offline = lava.select_offline(captured, budget, layer=layer).as_lists()
        assert kept == offline, layer
        total += sum(len(head) for head in kept)
    assert total == 10 * 2 * 6  # the whole budget of entries is spent, on keys the layers see


def test_a_local_window_reaching_past_the_sinks_rolls_all_it_holds(random_ids):
    """A local layer whose window reaches the first position after the sinks holds that position,
    and no sink: its decode window is all of its cache, so that position is the first to go. Counted
    as a sink, it would stay for good."""
    runner = hybrid_runner(window=36)  # local layers see positions 4..39 of the 40
    run = make("streamingllm").prefill(runner, random_ids, Budget.from_tokens(36))
    assert cached(run, 0) == [list(range(4, 40))] * 2 and cached(run, 2) == [[0, 1, 2, 3, *range(8, 40)]] * 2
    windows = run.result.cache.windows
    assert [windows[layer].size for layer in range(6)] == [37, 37, 33, 37, 37, 33]
    for position in range(40, 43):
        runner.decode_step(5, position, run.result.cache, run.decode_hooks)
    assert cached(run, 0) == [list(range(6, 43))] * 2 and cached(run, 2) == [[0, 1, 2, 3, *range(10, 43)]] * 2


@pytest.mark.parametrize("name", ["gemfilter", "fastkv", "claa"])
def test_a_shared_selection_at_a_local_layer_ranks_what_the_layer_did_not_score_last_offline(
    runner, random_ids, name
):
    """The store has no score for a key a local layer's last query cannot see (NaN): select at an
    explicit local layer kept those first, the oldest tokens (0..9 at 10 tokens), where the prefill
    keeps the best keys the layer scored."""
    method = make(name).with_layer(0)
    budget = Budget.from_tokens(10)
    captured = _captured(runner, random_ids, [method.probe()])
    offline = method.select_offline(captured, budget)
    online = method.prefill(runner, random_ids, budget).kept_positions
    assert offline.layer == 0 and offline.positions.tolist() == online.tolist()
    assert min(online.tolist()) > 40 - 1 - WINDOW  # all of them keys the layer's last query saw


def test_select_warns_where_a_local_selection_layer_keeps_more_than_the_store_scored(runner, random_ids):
    """ASL at 33 of 40 tokens selects at a local layer whose last query saw 16: the other 17 kept
    offline are the earliest unscored ones, which the prefill ranks by its window's other queries."""
    method, gemfilter = make("asl"), make("gemfilter").with_layer(0)
    captured = _captured(runner, random_ids, [method.probe(), gemfilter.probe()])
    with pytest.warns(UserWarning, match=r"a local layer whose last query saw 16 of the 40 tokens.*keep at most 16"):
        selection = method.select_offline(captured, Budget.from_tokens(10))
    assert HYBRID_LAYERS[selection.layer] == LOCAL
    scored = set(range(40 - WINDOW, 40))
    assert scored <= set(selection.positions.tolist())  # every scored key before any unscored one
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gemfilter.select_offline(captured, Budget.from_tokens(16))  # within what layer 0 scored
