"""Hybrid models (local sliding-window layers beside global ones): methods select at global
layers by default, online and offline alike, and a local layer's compressed cache keeps only
keys the layer can attend to."""

from __future__ import annotations

import pytest
import torch

from rankkit.methods import Budget, Captured, make
from rankkit.methods.base import on_global_layers
from rankkit.runner import Runner

LOCAL, GLOBAL = "sliding_attention", "full_attention"
HYBRID_LAYERS = (LOCAL, LOCAL, GLOBAL, LOCAL, LOCAL, GLOBAL)  # Gemma-style local:global 2:1
WINDOW = 8


def hybrid_runner(seed: int = 0) -> Runner:
    """A tiny Qwen2 whose layers follow ``HYBRID_LAYERS``, with an 8-token window on the local ones."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=len(HYBRID_LAYERS),
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        use_sliding_window=True,
        sliding_window=WINDOW,
        layer_types=list(HYBRID_LAYERS),
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():  # peaked attention, so rankings differ between tokens
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
    return Captured(arrays, runner.num_layers, int(ids.numel()), runner.layer_types)


# ---- item 1: default selection layers on global layers


def test_default_layers_move_to_the_nearest_global_layer_ties_to_the_earlier():
    assert on_global_layers(3, HYBRID_LAYERS) == 2  # 2 is one away, 5 two
    assert on_global_layers(4, HYBRID_LAYERS) == 5
    assert on_global_layers(2, (GLOBAL, LOCAL, LOCAL, LOCAL, GLOBAL)) == 0  # a tie: the earlier
    assert on_global_layers((2, 4, 5), HYBRID_LAYERS) == (2, 5)  # SlimInfer's layers, once each
    assert on_global_layers(3, None) == 3 and on_global_layers(3, (LOCAL,) * 6) == 3

    # round(15 * 6 / 32) = 3, a local layer: every pruning method's default moves to 2
    for name, parameter in [("fastkv", "tsp_layer"), ("claa", "pruning_layer"), ("gemfilter", "routing_layer")]:
        assert getattr(make(name).bind(6), parameter) == 3
        assert getattr(make(name).bind(6, HYBRID_LAYERS), parameter) == 2
        assert getattr(make(name).with_layer(4).bind(6, HYBRID_LAYERS), parameter) == 4  # --layer as given
    assert make("sliminfer").bind(6, HYBRID_LAYERS).pruning_layers == (2, 5)
    assert make("claa").resolved(6, HYBRID_LAYERS)["pruning_layer"] == 2  # what a run records


def test_runner_reads_layer_types_only_when_some_layer_is_local(runner):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    from rankkit.runner import layer_types

    assert runner.layer_types == HYBRID_LAYERS
    assert layer_types(LlamaConfig()) is None and layer_types(MistralConfig(sliding_window=8)) is None
    assert layer_types(Qwen2Config(num_hidden_layers=2)) is None  # named types, no window: all global
    assert layer_types(Qwen2Config(num_hidden_layers=2, layer_types=[GLOBAL, LOCAL])) is None


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
    from rankkit.eval.offline import store_layer_types
    from rankkit.models import LoadedModel

    class Tokenizer:
        def __len__(self):
            return 97

    def meta(model):
        return run_meta(LoadedModel(model, Tokenizer(), "tiny", "hash", torch.device("cpu")), [], "niah")

    hybrid = meta(runner.model)
    assert hybrid["model"]["layer_types"] == list(HYBRID_LAYERS)
    assert store_layer_types(hybrid) == list(HYBRID_LAYERS)

    from conftest import tiny_model

    plain = meta(tiny_model("llama"))
    assert "layer_types" not in plain["model"] and store_layer_types(plain) is None


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
            meta["model"]["layer_types"] = layer_types
        writer = stores.create(tmp_path / f"{name}.zarr", meta)
        writer.write_example("ex0", attrs={}, tokens=random_ids.numpy(), scores=recorder.scores())
        (row,) = select_store(tmp_path / f"{name}.zarr", "claa", Budget.from_keep(0.4))
        assert row["layer"] == layer  # a store without layer types is all-global, as stores were
    online = claa.prefill(runner, random_ids, Budget.from_keep(0.4))
    assert row["selected_positions"] == online.kept_positions.tolist()
