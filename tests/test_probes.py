"""Every probe against a slow float64 reference built from full eager attention matrices."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from conftest import tiny_model

from rankkit.cache import PADDING
from rankkit.errors import RankkitError
from rankkit.probes import (
    REGISTRY,
    LastTokenHeadsProbe,
    LastTokenRawProbe,
    LavaProbe,
    ProbeRecorder,
    TokenUnitsProbe,
    WindowProbe,
    make,
    parse_probes,
)
from rankkit.probes.attention import hidden_keys
from rankkit.runner import AttentionCall, LayerHook, Runner, greedy_continue

TOLERANCE = 1e-5


class Capture(LayerHook):
    """Keeps every prefill layer's attention call for the references."""

    def __init__(self):
        self.calls: list[AttentionCall] = []

    def on_attention(self, call):
        if call.phase == "prefill":
            self.calls.append(call)


_captured: dict[tuple[str, int], list[AttentionCall]] = {}


def captured_calls(family: str, length: int) -> list[AttentionCall]:
    """Attention calls of every layer of a prefill of ``length`` random tokens (cached: models are random but fixed)."""
    if (family, length) not in _captured:
        ids = torch.randint(0, 97, (length,), generator=torch.Generator().manual_seed(length))
        capture = Capture()
        Runner(tiny_model(family)).prefill(ids, hooks=[capture])
        _captured[family, length] = capture.calls
    return _captured[family, length]


# ---- the slow references: full T x T matrices in float64, explicit loops where it reads better


def full_logits(call: AttentionCall) -> torch.Tensor:
    """[q_heads, T, T] scaled logits as the family's eager attention has them: capped, causal, windowed."""
    query = call.query[0].double()
    key = call.key[0].double().repeat_interleave(call.group_size, dim=0)
    logits = query @ key.transpose(1, 2) * call.scaling
    if call.softcap is not None:
        logits = torch.tanh(logits / call.softcap) * call.softcap
    length = logits.shape[-1]
    visible = torch.ones(length, length, dtype=torch.bool).tril()
    if call.sliding_window is not None:
        visible &= ~torch.ones(length, length, dtype=torch.bool).tril(-call.sliding_window)
    return logits.masked_fill(~visible, float("-inf"))


def full_attention(call: AttentionCall) -> torch.Tensor:
    """Softmax rows with each head's sink logit appended to the keys and dropped after (GPT-OSS)."""
    logits = full_logits(call)
    if call.sinks is None:
        return torch.softmax(logits, dim=-1)
    sinks = call.sinks.double()[:, None, None].expand(-1, logits.shape[1], 1)
    return torch.softmax(torch.cat([logits, sinks], dim=-1), dim=-1)[..., :-1]


def reference_pool(row: torch.Tensor, pooling: str, kernel: int) -> torch.Tensor:
    """Average or max over the in-range neighbours (padding left out, as the oracle pools), one token at a
    time; ``avg_padded`` divides by the whole kernel, the zero padding counted (GemFilter's reference)."""
    pooled = torch.empty_like(row)
    half = kernel // 2
    for i in range(row.shape[0]):
        neighbours = row[max(0, i - half) : i + half + 1]
        if pooling == "avg_padded":
            pooled[i] = neighbours.sum() / kernel
        else:
            pooled[i] = neighbours.mean() if pooling == "avg" else neighbours.max()
    return pooled


def pool_past(row: torch.Tensor, window: int, pooling: str, kernel: int) -> torch.Tensor:
    past = row.shape[0] - window
    return torch.cat([reference_pool(row[:past], pooling, kernel), row[past:]])


def kv_heads_of(call):
    return call.key.shape[1]


def group_heads(call, kv_head):
    return range(kv_head * call.group_size, (kv_head + 1) * call.group_size)


def reference_window(call, window_size=8, kernel_size=7, pooling="avg"):
    attention = full_attention(call)
    length = attention.shape[-1]
    window = min(window_size, length)
    scores = torch.zeros(kv_heads_of(call), length, dtype=torch.float64)
    for g in range(kv_heads_of(call)):
        for h in group_heads(call, g):
            summed = attention[h, length - window :].sum(dim=0)
            scores[g] += pool_past(summed, window, pooling, kernel_size)
    return scores


def reference_last_token_raw(call, kernel_size=5, pooling="avg_padded"):
    logits = full_logits(call)
    scores = []
    for g in range(kv_heads_of(call)):
        summed = sum(logits[h, -1] for h in group_heads(call, g))
        scores.append(
            reference_pool(summed, pooling, kernel_size)
        )  # the whole row, the last token's own logit too
    return torch.stack(scores)


def reference_lava(call, window_size=32, kernel_size=7, pooling="max"):
    attention = full_attention(call)
    length = attention.shape[-1]
    window = min(window_size, length)
    scores = []
    for g in range(kv_heads_of(call)):
        largest_value_norm = max(float(call.value[0, g, k].double().abs().sum()) for k in range(length))
        per_head = []
        for h in group_heads(call, g):
            s = largest_value_norm / window * attention[h, length - window :].sum(dim=0)
            per_head.append(pool_past(s, window, pooling, kernel_size))
        scores.append(torch.stack(per_head).max(dim=0).values)
    return torch.stack(scores)


def reference_last_token_heads(call):
    attention = full_attention(call)
    return torch.stack([attention[h, -1] for g in range(kv_heads_of(call)) for h in group_heads(call, g)])


def reference_token_units(call, block_size=64, unit_size=8, window_size=4, head_mean="all"):
    query, key = call.query[0].double(), call.key[0].double()
    length = key.shape[1]
    window = min(window_size, length)
    mean_query = query[:, length - window :].mean(dim=1)  # q_l^h
    q_heads = query.shape[0]
    scores = torch.zeros(kv_heads_of(call), length, dtype=torch.float64)
    for block_start in range(0, length, block_size):
        block_end = min(block_start + block_size, length)
        for g in range(kv_heads_of(call)):
            heads = range(q_heads) if head_mean == "all" else group_heads(call, g)
            best = -math.inf
            for unit_start in range(block_start, block_end, unit_size):
                unit_end = min(unit_start + unit_size, block_end)
                similarity = sum(
                    float(mean_query[h] @ key[h // call.group_size, unit_start:unit_end].mean(dim=0))
                    for h in heads
                ) / len(heads)
                best = max(best, similarity)
            scores[g, block_start:block_end] = best
    return scores


REFERENCES = {
    "window": reference_window,
    "last_token_raw": reference_last_token_raw,
    "lava": reference_lava,
    "token_units": reference_token_units,
    "last_token_heads": reference_last_token_heads,
}


def reference(probe, call):
    return REFERENCES[probe.name](call, **{k: v for k, v in probe.params().items() if k != "probe"})


def assert_matches_reference(probe, calls):
    for call in calls:
        got = probe.score(call)
        assert got.dtype == torch.float32
        expected = reference(probe, call)
        assert got.shape == expected.shape and got.shape[-1] == call.key.shape[2]
        assert torch.allclose(got.double(), expected, atol=TOLERANCE, rtol=TOLERANCE), (
            f"{probe} layer {call.layer}: max error {(got.double() - expected).abs().max():.2e}"
        )


# ---- every probe, every family (MHA, GQA, QK-norm, sliding window), several parameter settings

PROBES = [
    WindowProbe(),
    WindowProbe(window_size=32),  # ASL / SnapKV: the window reaches near the start of 40 tokens
    WindowProbe(window_size=4, kernel_size=5, pooling="max"),
    WindowProbe(kernel_size=1),
    LastTokenRawProbe(),
    LastTokenRawProbe(kernel_size=7, pooling="avg"),
    LastTokenRawProbe(kernel_size=1),
    LastTokenRawProbe(kernel_size=3, pooling="max"),
    LavaProbe(),
    LavaProbe(window_size=8, pooling="avg", kernel_size=3),
    TokenUnitsProbe(block_size=16, unit_size=4),  # 40 tokens: a short last block
    TokenUnitsProbe(block_size=24, unit_size=6, window_size=3, head_mean="group"),  # a short last unit
    TokenUnitsProbe(),  # one block shorter than block_size
    LastTokenHeadsProbe(),
]


@pytest.mark.parametrize("probe", PROBES, ids=str)
def test_probe_matches_full_attention_reference(family, probe):
    assert_matches_reference(probe, captured_calls(family, 40))


@pytest.mark.parametrize("length", [1, 3, 8])
@pytest.mark.parametrize("family_name", ["llama", "qwen3"])
def test_window_longer_than_the_prompt_uses_every_query(family_name, length):
    """T <= W: all T queries form the window, nothing lies before it, so nothing is pooled."""
    calls = captured_calls(family_name, length)
    for probe in (
        WindowProbe(),
        LavaProbe(),
        TokenUnitsProbe(),
        LastTokenRawProbe(kernel_size=7),
        LastTokenHeadsProbe(),
    ):
        assert_matches_reference(probe, calls)
    window = WindowProbe(window_size=32).score(calls[0])
    unpooled = WindowProbe(window_size=length, kernel_size=1).score(calls[0])
    assert torch.equal(window, unpooled)


def test_window_scores_of_the_window_tokens_are_their_summed_attention():
    """The last W tokens are not pooled: each gets the attention the later window queries pay it."""
    call = captured_calls("llama", 40)[1]
    scores = WindowProbe(window_size=8, kernel_size=7).score(call)
    attention = full_attention(call)
    last = attention[:, -1, -1].reshape(2, 2).sum(dim=1)  # only the last query sees the last token
    assert torch.allclose(scores[:, -1].double(), last, atol=TOLERANCE)
    # with every query in the window, each head's attention sums to one per query
    assert torch.allclose(
        WindowProbe(window_size=40, kernel_size=1).score(call).sum(dim=1), torch.full((2,), 80.0)
    )


@pytest.mark.parametrize(
    "family_name, local",
    [("mistral", [True] * 3), ("gemma2", [True, False, True]), ("gpt_oss", [True, False, True])],
)
def test_keys_a_sliding_window_layer_cannot_see_are_recorded_as_nan(family_name, local, random_ids):
    """A window of 8: from position 39 a local layer sees positions 32..39 only; global layers see all."""
    recorder = ProbeRecorder(parse_probes("all"))
    Runner(tiny_model(family_name)).prefill(random_ids, hooks=[recorder])
    for name, recorded in recorder.scores().items():
        for layer, is_local in enumerate(local):
            assert np.isnan(recorded[layer, :, :32]).all() == is_local, (name, layer)
            assert not np.isnan(recorded[layer, :, 32:]).any(), (name, layer)


def test_cache_padding_is_invisible_to_the_window_probes():
    """A key padded away in one head (ragged compression) scores zero there and changes nothing else."""
    call = captured_calls("llama-mha", 40)[1]
    padded_head, padded_key = 1, 5
    key_positions = call.key_positions.clone()
    key_positions[padded_head, padded_key] = PADDING
    padded = dataclasses.replace(call, key_positions=key_positions)
    kept = torch.arange(40) != padded_key
    removed = dataclasses.replace(
        call,
        key=call.key[:, :, kept],
        value=call.value[:, :, kept],
        key_positions=call.key_positions[:, kept],
    )
    for probe in (WindowProbe(kernel_size=1), LavaProbe(kernel_size=1), LastTokenHeadsProbe()):
        scores = probe.score(padded)
        assert float(scores[padded_head, padded_key]) == 0.0
        assert torch.allclose(scores[padded_head, kept], probe.score(removed)[padded_head], atol=TOLERANCE)
    assert float(LastTokenRawProbe().score(padded)[padded_head, padded_key]) == float("-inf")


def test_reduced_precision_inputs_accumulate_in_float32():
    call = captured_calls("llama", 40)[1]
    half = dataclasses.replace(
        call, query=call.query.bfloat16(), key=call.key.bfloat16(), value=call.value.bfloat16()
    )
    upcast = dataclasses.replace(
        call, query=half.query.float(), key=half.key.float(), value=half.value.float()
    )
    for probe in parse_probes("all"):
        got = probe.score(half)
        assert got.dtype == torch.float32
        assert torch.equal(got, probe.score(upcast))


# ---- parameters, registry, parsing


@pytest.mark.parametrize(
    "name, params",
    [
        ("window", {"kernel_size": 4}),
        ("window", {"kernel_size": 0}),
        ("window", {"pooling": "median"}),
        ("window", {"window_size": 0}),
        ("lava", {"kernel_size": 6}),
        ("last_token_raw", {"pooling": "sum"}),
        ("token_units", {"block_size": 60, "unit_size": 8}),
        ("token_units", {"head_mean": "max"}),
        ("token_units", {"unit_size": 0}),
        ("window", {"window": 8}),
        ("nonsense", {}),
    ],
)
def test_bad_parameters_are_clear_errors(name, params):
    with pytest.raises(RankkitError):
        make(name, **params)


def test_make_and_parse_probes():
    assert set(REGISTRY) == {"window", "last_token_raw", "lava", "token_units", "last_token_heads"}
    assert make("window", window_size=32) == WindowProbe(window_size=32)
    assert [p.name for p in parse_probes("window, last_token_raw")] == ["window", "last_token_raw"]
    assert {p.name for p in parse_probes("all")} == set(REGISTRY)
    assert make("lava").params() == {"probe": "lava", "window_size": 32, "kernel_size": 7, "pooling": "max"}
    with pytest.raises(RankkitError):
        parse_probes(" , ")
    with pytest.raises(RankkitError):
        parse_probes("window,snapkv")
    with pytest.raises(RankkitError):
        ProbeRecorder([WindowProbe(), WindowProbe(window_size=8)])
    ProbeRecorder([WindowProbe(), WindowProbe(window_size=32)])  # two settings, two store keys


def test_probe_parameters_in_the_probes_syntax():
    parsed = parse_probes("window:w=32,kernel=5,last_token_raw, window, lava:pooling=avg")
    assert parsed == [
        WindowProbe(window_size=32, kernel_size=5),
        make("last_token_raw"),
        WindowProbe(),
        make("lava", pooling="avg"),
    ]
    assert [probe.key for probe in parsed] == [
        "window:w=32,kernel=5",
        "last_token_raw",
        "window",
        "lava:pooling=avg",
    ]
    assert parse_probes("window:window_size=32") == [WindowProbe(window_size=32)]
    assert parse_probes("window:w=8") == [WindowProbe()]  # the default setting is the plain name
    for bad in ("w=32,window", "window:size=3", "window:w=0"):
        with pytest.raises(RankkitError):
            parse_probes(bad)


# ---- the recorder inside a real prefill


@pytest.mark.parametrize("family_name", ["llama", "llama-mha", "qwen3"])
def test_recorder_equals_the_reference_at_every_layer(family_name, random_ids):
    model = tiny_model(family_name)
    probes = parse_probes("all")
    recorder, capture = ProbeRecorder(probes), Capture()
    Runner(model).prefill(random_ids, hooks=[recorder, capture])
    scores = recorder.scores()
    assert set(scores) == set(REGISTRY)
    for probe in probes:
        recorded = scores[probe.name]
        assert recorded.dtype == np.float32
        for call in capture.calls:
            expected = reference(probe, call).numpy()  # a row per KV head, or per query head
            assert recorded.shape == (3, *expected.shape)
            assert np.allclose(recorded[call.layer], expected, atol=TOLERANCE, rtol=TOLERANCE), probe.name


class PruneAfter(LayerHook):
    def __init__(self, layer, keep):
        self.layer, self.keep = layer, keep

    def after_layer(self, layer, state):
        if layer == self.layer:
            state.prune(self.keep)


def test_recorder_lays_scores_out_by_original_position_after_pruning(random_ids):
    runner = Runner(tiny_model("llama"))
    keep = torch.tensor([0, 3, 4, 10, 17, 25, 31, 39])
    recorder, capture = ProbeRecorder([WindowProbe()]), Capture()
    runner.prefill(random_ids, hooks=[PruneAfter(0, keep), recorder, capture])
    window = recorder.scores()["window"]
    assert window.shape == (3, 2, 40)
    assert not np.isnan(window[0]).any()
    pruned = np.setdiff1d(np.arange(40), keep.numpy())
    assert np.isnan(window[1:, :, pruned]).all()
    expected = reference_window(capture.calls[2]).numpy()  # the reference sees only the 8 kept tokens
    assert np.allclose(window[2][:, keep.numpy()], expected, atol=TOLERANCE)


def test_recorder_ignores_decode_and_restarts_on_a_new_prefill(random_ids):
    runner = Runner(tiny_model("qwen2"))
    recorder = ProbeRecorder([LastTokenHeadsProbe()])
    runner.generate(random_ids[:20], 3, hooks=[recorder])
    query_heads = runner.config.num_attention_heads
    assert recorder.scores()["last_token_heads"].shape == (3, query_heads, 20)
    runner.prefill(random_ids, hooks=[recorder])
    assert recorder.scores()["last_token_heads"].shape == (3, query_heads, 40)
    assert ProbeRecorder([WindowProbe()]).scores() == {}


class WindowMasks(LayerHook):
    """At every attention call, the window mask a probe is given (the step's memo) and one made afresh;
    and the token-unit scores, which keep their layout per step, checked against a fresh layout."""

    def __init__(self, window: int):
        self.window = window
        self.given: list[tuple[str, torch.Tensor]] = []
        self.fresh: list[torch.Tensor] = []
        self.units = TokenUnitsProbe(block_size=8, unit_size=2)

    def on_attention(self, call):
        fresh = dataclasses.replace(call, step_shared={})
        self.given.append((call.phase, hidden_keys(call, self.window)))
        self.fresh.append(hidden_keys(fresh, self.window))
        assert torch.equal(self.units.score(call), self.units.score(fresh))


@pytest.mark.parametrize("family_name", ["llama", "gemma2"])
def test_a_steps_layers_share_one_window_mask_while_their_positions_do(family_name, random_ids):
    """The mask is made once for the layers that read the same positions (a prefill's, until it prunes)
    and made again where they change (after pruning, a compressed cache, a decode step), always the
    mask made afresh; gemma2's local layers get a mask of their own."""
    runner = Runner(tiny_model(family_name))
    masks = WindowMasks(window=8)
    keep = torch.tensor([0, 3, 4, 10, 17, 25, 31, 33, 36, 38, 39])
    prefill = runner.prefill(random_ids, hooks=[PruneAfter(0, keep), masks])
    for layer in range(runner.num_layers):  # ragged heads: each layer's positions differ, with padding
        prefill.cache.compress(layer, [torch.arange(0, 11, 1 + layer), torch.arange(0, 11, 2)])
    greedy_continue(runner, prefill, 3, [masks])
    assert len(masks.given) == 3 * runner.num_layers
    for (_, given), fresh in zip(masks.given, masks.fresh, strict=True):
        assert torch.equal(given, fresh)
    prefill_masks = [mask for phase, mask in masks.given if phase == "prefill"]
    if family_name == "llama":  # layer 0 on all 40 tokens, layers 1 and 2 on the 11 kept
        assert prefill_masks[1] is prefill_masks[2] and prefill_masks[0].shape == (1, 8, 40)
    else:  # local, global, local: each layer's own mask
        assert prefill_masks[1] is not prefill_masks[2]
    decode_masks = [mask for phase, mask in masks.given if phase == "decode"]
    assert all(mask.shape[0] == 2 for mask in decode_masks)  # one row per head: the heads keep different keys


class DecodeCalls(LayerHook):
    def __init__(self):
        self.seen: list[tuple[bool, bool]] = []  # (sees_every_key, whether any key is hidden from it)

    def on_attention(self, call: AttentionCall) -> None:
        if call.phase == "decode":
            self.seen.append((call.sees_every_key, bool(hidden_keys(call, 1).any())))


@pytest.mark.parametrize(
    ("family_name", "ragged", "expected"),
    [("llama", False, True), ("llama", True, False), ("mistral", False, False)],  # plain, padded, a window
)
def test_a_decode_step_skips_the_window_mask_only_where_it_hides_nothing(family_name, ragged, expected, random_ids):
    """``sees_every_key`` (no mask for the probes of one query over a plain cache) holds exactly for a
    decode step over an unpadded global layer, where the mask made afresh hides no key."""
    runner = Runner(tiny_model(family_name))
    prefill = runner.prefill(random_ids)
    if ragged:
        for layer in range(runner.num_layers):
            prefill.cache.compress(layer, [torch.arange(0, 40, 2), torch.arange(0, 40, 3)])
    calls = DecodeCalls()
    greedy_continue(runner, prefill, 12, [calls])  # mistral's window of 8 cuts in
    assert len(calls.seen) == 11 * runner.num_layers
    assert all(skipped == expected for skipped, _ in calls.seen)
    assert not any(skipped and hidden for skipped, hidden in calls.seen)
    assert any(hidden for _, hidden in calls.seen) == (not expected)
