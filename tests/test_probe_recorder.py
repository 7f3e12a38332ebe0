"""ProbeRecorder on hand-made attention calls: the scores laid out by original position (pruned
keys, cache padding, a local layer's unseen keys, rows per KV head or per query head) against a
plain loop, and which prefill it keeps."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest
import torch

from rankkit.cache import PADDING
from rankkit.errors import RankkitError
from rankkit.probes import Probe, ProbeRecorder


@dataclass
class HandedKV(Probe):
    """The scores each call carries for its KV heads."""

    name: ClassVar[str] = "handed_kv"

    def score(self, call) -> torch.Tensor:
        return call.kv_scores


@dataclass
class HandedHeads(Probe):
    """The scores each call carries for its query heads (G rows per KV head)."""

    name: ClassVar[str] = "handed_heads"

    def score(self, call) -> torch.Tensor:
        return call.head_scores


def call(layer, key_positions, unseen=None, group=2, phase="prefill", seed=0):
    """An attention call of ``len(key_positions)`` KV heads, with scores drawn for both probes."""
    positions = torch.tensor(key_positions)
    generator = torch.Generator().manual_seed(seed * 100 + layer)
    kv_heads, keys = positions.shape
    return SimpleNamespace(
        layer=layer,
        phase=phase,
        key_positions=positions,
        unseen_keys=lambda: None if unseen is None else torch.tensor(unseen),
        kv_scores=torch.rand(kv_heads, keys, generator=generator),
        head_scores=torch.rand(kv_heads * group, keys, generator=generator),
    )


def laid_out_by_hand(calls, attribute, length):
    """[layers, rows, length]: each row's score at its KV head's key position; NaN where no key
    of that position was scored, or its layer could not see it."""
    rows = getattr(calls[0], attribute).shape[0]
    out = np.full((len(calls), rows, length), np.nan, np.float32)
    for index, each in enumerate(calls):
        scores, positions, unseen = getattr(each, attribute), each.key_positions, each.unseen_keys()
        group = rows // positions.shape[0]
        for row in range(rows):
            for key in range(positions.shape[1]):
                head = row // group
                position = int(positions[head, key])
                if position != PADDING and not (unseen is not None and bool(unseen[head, key])):
                    out[index, row, position] = float(scores[row, key])
    return out


def record(probes, calls):
    recorder = ProbeRecorder(probes)
    for each in calls:
        recorder.on_attention(each)
    return recorder.scores()


def test_scores_are_laid_out_by_original_position():
    calls = [
        call(0, [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]),
        # pruned per KV head, padded, and local: the first key of each head out of the window
        call(
            1,
            [[0, 2, 5, PADDING], [1, 3, 4, 5]],
            unseen=[[True, False, False, False], [True, False, False, False]],
        ),
        call(2, [[5, 2, PADDING, PADDING], [4, PADDING, 1, PADDING]]),
    ]
    scores = record([HandedKV(), HandedHeads()], calls)
    assert list(scores) == ["handed_kv", "handed_heads"]
    assert scores["handed_kv"].shape == (3, 2, 6) and scores["handed_heads"].shape == (3, 4, 6)
    for key, attribute in (("handed_kv", "kv_scores"), ("handed_heads", "head_scores")):
        assert scores[key].dtype == np.float32
        np.testing.assert_array_equal(scores[key], laid_out_by_hand(calls, attribute, 6), err_msg=key)
    assert np.isnan(scores["handed_kv"][1, 0, [0, 1, 3, 4]]).all()
    assert not np.isnan(scores["handed_kv"][0]).any()


def test_the_length_is_one_past_the_largest_position_of_any_layer():
    calls = [call(0, [[0, 1, 2]]), call(1, [[7, PADDING, 2]])]
    scores = record([HandedKV()], calls)["handed_kv"]
    assert scores.shape == (2, 1, 8)
    np.testing.assert_array_equal(scores, laid_out_by_hand(calls, "kv_scores", 8))


def test_one_layer_one_probe():
    calls = [call(0, [[2, 0, PADDING, 1]], unseen=[[False, True, False, False]])]
    scores = record([HandedHeads()], calls)["handed_heads"]
    np.testing.assert_array_equal(scores, laid_out_by_hand(calls, "head_scores", 3))
    assert np.isnan(scores[0, :, 0]).all()


def test_a_new_prefill_starts_over_and_decode_is_ignored():
    recorder = ProbeRecorder([HandedKV()])
    last = call(0, [[0, 1, 2, 3, 4]], seed=2)
    for each in (call(0, [[0, 1, 2]], seed=1), last):  # a one-layer model, twice
        recorder.on_attention(each)
    np.testing.assert_array_equal(recorder.scores()["handed_kv"], laid_out_by_hand([last], "kv_scores", 5))
    recorder.on_attention(call(0, [[0, 1, 2, 3, 4, 5]], phase="decode", seed=3))
    np.testing.assert_array_equal(recorder.scores()["handed_kv"], laid_out_by_hand([last], "kv_scores", 5))
    first = [call(layer, [[0, 1, 2]], seed=4) for layer in range(4)]
    again = [call(layer, [[0, 1, 2, 3]], seed=5) for layer in (2, 3)]  # arrives at a layer it recorded
    for each in first + again:
        recorder.on_attention(each)
    np.testing.assert_array_equal(recorder.scores()["handed_kv"], laid_out_by_hand(again, "kv_scores", 4))


def test_nothing_recorded_or_nothing_to_record_is_empty():
    assert ProbeRecorder([HandedKV()]).scores() == {}
    assert record([], [call(0, [[0, 1, 2]])]) == {}


def test_a_probe_may_be_recorded_once():
    with pytest.raises(RankkitError, match="each probe may be recorded once; got handed_kv, handed_kv"):
        ProbeRecorder([HandedKV(), HandedKV()])


def test_probes_reading_window_attention_share_one_computation_and_score_as_alone(monkeypatch):
    """The widest window's attention is computed once per layer for every probe of a recorder; each
    probe's scores are those it gives recorded on its own (a narrower window is the widest's last rows)."""
    from conftest import tiny_model

    from rankkit.probes import attention, parse_probes
    from rankkit.runner import Runner

    runner = Runner(tiny_model("llama"))
    ids = torch.randint(0, 97, (48,), generator=torch.Generator().manual_seed(5))
    probes = parse_probes("all")
    assert sorted(probe.attention_window() or 0 for probe in probes) == [0, 1, 1, 8, 32]
    computed = []
    logits = attention.window_logits
    monkeypatch.setattr(attention, "window_logits", lambda call, w: computed.append(w) or logits(call, w))

    def scores(recorded):
        recorder = ProbeRecorder(recorded)
        runner.prefill(ids, hooks=[recorder])
        return recorder.scores()

    together = scores(probes)
    assert computed == [32] * runner.num_layers  # lava's window, which holds every narrower one
    for probe in probes:
        alone = scores([probe])
        np.testing.assert_allclose(together[probe.key], alone[probe.key], rtol=1e-5, atol=1e-6)
    assert len(computed) > runner.num_layers  # alone, each window probe computed its own
