"""The offline face (``select_offline``) of every method that keeps a set per layer and KV head:
the layer it answers for, the layers it refuses, and a budget that covers the prompt."""

from __future__ import annotations

import pytest
import torch

from rankkit.errors import RankkitError
from rankkit.methods import Budget, Captured, make

LAYERS, TOKENS, KV_HEADS, QUERY_HEADS = 3, 12, 2, 4
PER_LAYER_AND_HEAD = ["adakv", "lava", "sage-kv", "pyramidkv", "snapkv", "tova"]


def captured_for(method) -> Captured:
    # SAGE-KV ranks by each query head's attention; the others store a row per KV head.
    rows = QUERY_HEADS if method.name == "sage-kv" else KV_HEADS
    scores = torch.rand(LAYERS, rows, TOKENS, generator=torch.Generator().manual_seed(3))
    return Captured({method.probe().key: scores}, LAYERS, TOKENS, kv_heads=KV_HEADS, query_heads=QUERY_HEADS)


@pytest.mark.parametrize("name", PER_LAYER_AND_HEAD)
@pytest.mark.parametrize("layer", [None, -1, LAYERS])
def test_a_layer_outside_the_model_or_none_is_refused_naming_the_range(name, layer):
    method = make(name)
    with pytest.raises(RankkitError) as refused:
        method.select_offline(captured_for(method), Budget.from_tokens(6), layer=layer)
    assert str(refused.value) == (
        f"method '{name}' keeps a set per layer and KV head: name the layer with --layer (0..{LAYERS - 1})"
        if layer is None
        else f"--layer {layer} is not a layer of this model (0..{LAYERS - 1}); give one in that range"
    )


@pytest.mark.parametrize("name", PER_LAYER_AND_HEAD)
@pytest.mark.parametrize("budget", [Budget.from_keep(1.0), Budget.from_tokens(TOKENS)])
def test_a_budget_covering_the_prompt_keeps_every_token_in_every_head_of_the_named_layer(name, budget):
    method = make(name)
    for layer in range(LAYERS):
        selection = method.select_offline(captured_for(method), budget, layer=layer)
        assert selection.layer == layer
        assert selection.as_lists() == [list(range(TOKENS))] * KV_HEADS


@pytest.mark.parametrize("name", PER_LAYER_AND_HEAD)
def test_a_pruning_selection_answers_for_the_layer_it_was_asked(name):
    method = make(name)
    for layer in range(LAYERS):
        selection = method.select_offline(captured_for(method), Budget.from_tokens(6), layer=layer)
        assert selection.layer == layer
        kept = selection.as_lists()
        assert len(kept) == KV_HEADS and all(TOKENS - 1 in head for head in kept)  # the last token


def test_pyramidkv_keeps_a_prompt_shorter_than_its_window_whole_at_every_layer():
    from rankkit.methods.pyramidkv import layer_budgets

    # Before, the share beyond a 32-token window of a 12-token prompt was negative: budgets of -7.
    assert layer_budgets(3, 12, 12, 32, 20.0) == [12, 12, 12]


def test_pyramidkv_caps_its_widest_layer_at_the_prompt_and_gives_the_rest_to_the_narrowest():
    """PyramidKV's budgets when the widest layer's share (2a - a / beta) passes the T - w tokens beyond
    the window: it is T - w, the narrowest 2a - (T - w), a straight line between."""
    from rankkit.methods.pyramidkv import layer_budgets

    # a = 10, beta 10: high 19 > 18 = T - w, so high 18 and low 2; layers 18, 10, 2, plus the window
    assert layer_budgets(3, 20, 12, 2, 10.0) == [20, 12, 4]
    # a = 13, beta 20: high 25.35 is cut to 18, low 26 - 18 = 8
    assert layer_budgets(3, 20, 15, 2, 20.0) == [20, 15, 10]
    assert layer_budgets(3, 20, 12, 2, 2.0) == [17, 12, 7]  # uncapped: high 15, low 5
