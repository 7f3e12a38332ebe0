"""AdaKV's offline rankings, as ``rankkit compare`` reads them, against the rule by hand."""

from __future__ import annotations

import math

import torch

from rankkit.methods import Budget, Captured, make


def test_layer_rankings_put_the_window_first_then_each_tokens_best_head():
    torch.manual_seed(0)
    scores = torch.rand(3, 2, 12)  # three layers, two KV heads
    adakv = make("adakv", window_size=4)
    captured = Captured({adakv.probe().key: scores}, 3, 12, kv_heads=2, query_heads=4)
    rankings = adakv.layer_rankings(captured, Budget.from_tokens(6))
    assert list(rankings) == [0, 1, 2]
    for layer, ranking in rankings.items():
        expected = [max(scores[layer, 0, p].item(), scores[layer, 1, p].item()) for p in range(8)]
        assert ranking.tolist() == expected + [math.inf] * 4, layer
