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


def test_one_head_that_wins_every_contest_keeps_exactly_the_widest_head():
    """The bound the cache is cut to before the scores are read is reached: with every entry of
    head 0 above every other head's, head 0 keeps heads x keep less the others' window and share."""
    from rankkit.methods.adakv import adaptive_head_mask, widest_head

    heads, length, keep, window, safeguard = 4, 50, 10, 2, 0.5
    scores = torch.rand(heads, length, generator=torch.Generator().manual_seed(0))
    scores[0] += 1.0
    kept = adaptive_head_mask(scores, keep, window, safeguard)
    # each other head: its window (2) and its share int(0.5 x (10 - 2)) = 4
    assert kept.sum(dim=1).tolist() == [22, 6, 6, 6]
    assert widest_head(heads, keep, window, length, safeguard) == 22
    assert widest_head(heads, 30, window, length, safeguard) == 50  # never past the prompt
