"""Every method's selection run for real on tiny models: keep 1.0 is full, positions stay original,
and each method's cache holds what its paper says, layer by layer."""

from __future__ import annotations

import pytest
from conftest import tiny_model

from rankkit.methods import REGISTRY, Budget, make
from rankkit.methods.measure import run_once
from rankkit.runner import LayerHook, Runner

PROMPT_LENGTH = 40


class PositionRecorder(LayerHook):
    def __init__(self):
        self.calls = []

    def on_attention(self, call):
        self.calls.append((call.layer, call.phase, call.query_positions.clone(), call.key_positions.clone()))


def _tiny(family="llama"):
    return Runner(tiny_model(family))


def _full_tokens(runner, ids, new_tokens=8):
    return runner.generate(ids, new_tokens).tokens


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_keep_all_reproduces_full_greedy_output(name, family, random_ids):
    runner = _tiny(family)
    run = run_once(runner, make(name), random_ids, Budget.from_keep(1.0), 8)
    assert run.tokens == _full_tokens(runner, random_ids)
    assert run.kv_tokens_per_layer == [PROMPT_LENGTH] * runner.num_layers


def test_budget_counts_forced_tokens_and_caps_at_the_prompt():
    assert Budget.from_keep(0.1).resolve(1000, always_kept=8) == 100
    assert Budget.from_keep(0.001).resolve(1000, always_kept=8) == 8
    assert Budget.from_tokens(5000).resolve(1000) == 1000
    assert Budget.from_tokens(64).label == "budget=64"


@pytest.mark.parametrize("name", ["gemfilter", "fastkv", "claa"])
def test_pruned_tokens_keep_their_original_positions(name, random_ids):
    runner = _tiny()
    method = make(name).with_layer(1)
    recorder = PositionRecorder()
    run = method.prefill(runner, random_ids, Budget.from_tokens(12))
    kept = run.kept_positions.tolist()
    assert len(kept) == 12 and kept[-1] == PROMPT_LENGTH - 1 and kept == sorted(kept)
    for layer in range(2, runner.num_layers):  # after the selection every layer's cache is the selection
        assert run.result.cache.positions[layer][0].tolist() == kept
    runner.decode_step(int(run.result.logits.argmax()), PROMPT_LENGTH, run.result.cache, [recorder])
    decode_positions = {int(q[0]) for _, phase, q, _ in recorder.calls if phase == "decode"}
    assert decode_positions == {PROMPT_LENGTH}


def test_fastkv_cache_holds_the_snapkv_budget_before_tsp_and_the_selection_from_it(random_ids):
    runner = _tiny()
    run = make("fastkv", tsp_layer=1, window_size=4).prefill(runner, random_ids, Budget.from_tokens(10))
    cache = run.result.cache
    assert run.live_tokens == [40, 40, 10]
    assert cache.kept_tokens(0).tolist() == [10, 10]  # per head, SnapKV-style
    for layer in (1, 2):
        assert cache.positions[layer][0].tolist() == run.kept_positions.tolist()
        assert cache.positions[layer][1].tolist() == run.kept_positions.tolist()
    assert cache.positions[0][:, -4:].tolist() == [list(range(36, 40))] * 2  # the window is always kept


def test_gemfilter_every_layer_holds_the_selected_tokens(random_ids):
    runner = _tiny()
    run = make("gemfilter", routing_layer=1).prefill(runner, random_ids, Budget.from_tokens(10))
    assert [p.label for p in run.passes] == ["selection", "main"]
    assert run.passes[0].queries == [40, 40]  # the first pass stops after layer r
    assert run.live_tokens == [10, 10, 10]
    for layer in range(3):
        assert run.result.cache.positions[layer][0].tolist() == run.kept_positions.tolist()


def test_claa_defers_compression_and_aggregates_the_max_over_layers(random_ids):
    runner = _tiny()
    run = make("claa", pruning_layer=2, aggregation_window=2, deferred_layers=1).prefill(
        runner, random_ids, Budget.from_tokens(10)
    )
    cache = run.result.cache
    assert cache.kept_tokens(0).tolist() == [40, 40]  # layer < m: uncompressed
    assert cache.kept_tokens(1).tolist() == [10, 10]
    assert cache.positions[2][0].tolist() == run.kept_positions.tolist()
    assert run.selection_layer == 2


def test_snapkv_every_layer_holds_the_budget_per_head(random_ids):
    runner = _tiny()
    run = make("snapkv", window_size=4).prefill(runner, random_ids, Budget.from_tokens(10))
    assert run.live_tokens == [40, 40, 40]
    for layer in range(3):
        assert run.result.cache.kept_tokens(layer).tolist() == [10, 10]


def test_streamingllm_keeps_sinks_and_the_most_recent_tokens(random_ids):
    runner = _tiny()
    run = make("streamingllm", sink_tokens=4).prefill(runner, random_ids, Budget.from_tokens(10))
    expected = [0, 1, 2, 3, *range(34, 40)]
    for layer in range(3):
        assert run.result.cache.positions[layer].tolist() == [expected, expected]


def test_unknown_method_and_layer_errors_name_the_fix():
    from rankkit.errors import RankkitError

    with pytest.raises(RankkitError, match="known: "):
        make("nope")
    with pytest.raises(RankkitError, match="no selection layer"):
        make("snapkv").with_layer(3)
