"""What a method gets from ``PolicyMethod`` and ``Method`` when it declares only the required parts.

docs/extending.md promises a plugin's method the defaults of the table there: no forced tokens
(``forced`` is (0, 0)), no per-head compression (``compress_from`` None), one pass, and, for a
method that is no ``PolicyMethod``, an offline face that refuses by name. rankkit's own methods
all override ``forced``, so only a method written as a plugin would be reached by a change there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from conftest import tiny_model

from rankkit.errors import RankkitError
from rankkit.methods import Budget, Captured, make
from rankkit.methods.base import make_probe
from rankkit.methods.selection import FixedLayer, PolicyMethod
from rankkit.probes import ProbeRecorder
from rankkit.runner import Runner


@dataclass
class KeepByLastQuery(PolicyMethod):
    """The least a selecting method declares: its probe and the layer it selects at."""

    name: ClassVar[str] = "keep_by_last_query"
    layer: int = 1

    def probe(self):
        return make_probe("last_token_raw", kernel_size=1)

    def policy(self, num_layers, keep):
        return FixedLayer(self.layer)


@dataclass
class KeyByLastQueryPerHead(PolicyMethod):
    """The least a KV-only method declares: its probe."""

    name: ClassVar[str] = "key_by_last_query_per_head"

    def probe(self):
        return make_probe("last_token_raw", kernel_size=1)


def slow_top(scores: list[float], k: int) -> list[int]:
    """The positions of the k highest scores, ties to the earlier token, in position order."""
    ranked = sorted(range(len(scores)), key=lambda position: (-scores[position], position))
    return sorted(ranked[:k])


# The first and the last token score lowest, so a forced sink or window token would show.
LAYER_SCORES = torch.tensor(
    [
        [[0.0, 5, 1, 7, 3, 2, 6, 0], [0.0, 1, 1, 1, 1, 1, 1, 0]],
        [[0.0, 2, 9, 1, 4, 8, 3, 0], [0.0, 1, 0, 6, 0, 1, 2, 0]],
    ]
)  # [layers 2, kv_heads 2, tokens 8]


def stored(method) -> Captured:
    return Captured({method.probe().key: LAYER_SCORES}, num_layers=2, num_tokens=8)


def test_a_selecting_method_that_forces_nothing_keeps_the_plain_top_k_offline():
    method = KeepByLastQuery()
    assert method.forced(3) == (0, 0) and method.minimum_keep() == 0
    summed = LAYER_SCORES[1].sum(0).tolist()  # [0, 3, 9, 7, 4, 9, 5, 0]
    kept = method.select_offline(stored(method), Budget.from_tokens(3))
    assert kept.layer == 1 and kept.positions.tolist() == slow_top(summed, 3) == [2, 3, 5]
    rankings = method.layer_rankings(stored(method), Budget.from_tokens(3))
    assert {layer: ranking.tolist() for layer, ranking in rankings.items()} == {1: summed}  # none at +inf


def test_a_kv_only_method_that_forces_nothing_keeps_each_heads_plain_top_k_offline():
    method = KeyByLastQueryPerHead()
    expected = {0: [[3, 6], [1, 2]], 1: [[2, 5], [3, 6]]}
    for layer in (0, 1):
        kept = method.select_offline(stored(method), Budget.from_tokens(2), layer=layer)
        assert [slow_top(head.tolist(), 2) for head in LAYER_SCORES[layer]] == expected[layer]
        assert kept.layer == layer and kept.as_lists() == expected[layer]


def test_a_selecting_method_that_forces_nothing_prunes_to_what_it_selects_offline():
    """Online, the same defaults: the kept set is the stored scores' plain top-k, pruned in one pass."""
    runner = Runner(tiny_model("llama"))
    ids = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(3))
    method = KeepByLastQuery()
    recorder = ProbeRecorder([method.probe()])
    runner.prefill(ids, hooks=[recorder])
    arrays = {key: torch.from_numpy(scores) for key, scores in recorder.scores().items()}
    captured = Captured(arrays, runner.num_layers, 24)
    summed = arrays[method.probe().key][1].double().sum(0).tolist()
    run = method.prefill(runner, ids, Budget.from_tokens(5))
    expected = slow_top(summed, 5)
    assert run.kept_positions.tolist() == expected
    assert method.select_offline(captured, Budget.from_tokens(5)).positions.tolist() == expected
    assert len(run.passes) == 1 and run.live_tokens == [24, 24, 5]  # one pass, pruned after layer 1
    # no per-head compression before the selection; from it on, the cache holds the kept 5
    assert [keys.shape[-2] for keys in run.result.cache.keys] == [24, 5, 5]


@pytest.mark.parametrize("face", ["select_offline", "layer_rankings"])
def test_a_method_without_an_offline_face_refuses_naming_itself(face):
    captured = Captured({}, num_layers=2, num_tokens=8)
    refusal = "^method 'full' has no offline face: it ranks nothing a store captures$"
    with pytest.raises(RankkitError, match=refusal):
        getattr(make("full"), face)(captured, Budget.from_keep(0.5))


def test_methods_share_an_offline_key_only_when_they_rank_alike():
    """SnapKV and LAVa hold the same parameter values (window 32, kernel 7), as do TOVA and SAGE-KV
    (none): their keys still differ by class. ASL's two-pass variant ranks as ASL does: one key."""
    from rankkit.methods import make

    def key(name):
        return make(name).bind(12).offline_key()

    assert key("snapkv") != key("lava") and key("tova") != key("sage-kv")
    assert key("asl") == key("asl-2pass")
    assert make("asl", tau=0.5).bind(12).offline_key() != key("asl-2pass")
