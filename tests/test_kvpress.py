"""rankkit's KV-only methods against the same presses of NVIDIA kvpress, run on one prompt.

Each test prefills a tiny random Llama once under a kvpress press and once under the rankkit
method with matched parameters, recovers which prompt positions each layer and KV head of
kvpress's cache still holds (its compressed keys matched against the full prefill's keys,
or, for AdaKV, which masks instead of compressing, the entries it masks), and asserts they
are rankkit's kept positions exactly. Where the two define a method differently (pooling at
the edges, PyramidKV's counts, AdaKV's safeguard) the test asserts the difference as
docs/methods.md states it. kvpress is pinned and installed without its dependencies by
``make install`` (it pins an older transformers); these tests skip only when it is missing.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from test_kv_methods import _kept
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from rankkit.methods import Budget, make
from rankkit.methods.base import make_probe
from rankkit.methods.pyramidkv import LayerBudgetHook, layer_budgets
from rankkit.methods.selection import forced_mask, one_pass, top_k_with_forced
from rankkit.runner import LayerHook, Runner

# Importing kvpress wraps every attention function transformers knows (for AdaKV's masking in
# decoding, which these prefill-only tests do not need): each is put back, so no other test runs
# through kvpress's code.
_UNPATCHED = {name: ALL_ATTENTION_FUNCTIONS[name] for name in ALL_ATTENTION_FUNCTIONS}
kvpress = pytest.importorskip(
    "kvpress", reason="kvpress is not importable: `make install` installs it (pinned, --no-deps)"
)
for _name, _function in _UNPATCHED.items():
    ALL_ATTENTION_FUNCTIONS[_name] = _function
from kvpress.utils import compute_n_kept  # noqa: E402  (after the skip)

LENGTH, WINDOW, LAYERS, KV_HEADS = 64, 4, 3, 2
KEPT = 16  # tokens per layer and KV head
RATIO = 1 - KEPT / LENGTH  # kvpress's compression ratio for the same count: int(64 x 0.25) = 16
IDS = torch.randint(0, 97, (LENGTH,), generator=torch.Generator().manual_seed(5))


@contextmanager
def pressed(press, model):
    """``press(model)`` for the transformers rankkit runs on: kvpress 0.5.5's hook reads the cache
    as ``past_key_values`` and the prefill test off ``cache_position``, which transformers 5
    renamed ``cache`` and dropped (``position_ids`` carries the same positions); the press's own
    hook runs with those two names given back, nothing else changed."""

    def hook(module, args, kwargs, output):
        renamed = {**kwargs, "past_key_values": kwargs["cache"], "cache_position": kwargs["position_ids"][0]}
        return press.forward_hook(module, args, renamed, output)

    press.post_init_from_model(model)
    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _prefill_cache(model, press=None):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        if press is None:
            model(IDS[None], cache=cache)
        else:
            with pressed(press, model):
                model(IDS[None], cache=cache)
    return cache


def kvpress_kept(press) -> list[list[list[int]]]:
    """Per layer and KV head, the prompt positions whose keys kvpress's compressed cache holds."""
    model = tiny_model("llama")
    full, compressed = _prefill_cache(model), _prefill_cache(model, press)
    kept = []
    for layer in range(LAYERS):
        full_keys, kept_keys = full.layers[layer].keys[0], compressed.layers[layer].keys[0]
        same = (kept_keys[:, :, None, :] == full_keys[:, None, :, :]).all(-1)  # [heads, kept, T]
        assert (same.sum(-1) == 1).all()  # every kept key is one prompt position's key
        kept.append([sorted(head.nonzero()[:, 1].tolist()) for head in same])
    return kept


def kvpress_unmasked(press) -> list[list[list[int]]]:
    """Per layer and KV head, the positions AdaKV leaves unmasked (it masks pruned keys in
    attention instead of dropping them from the cache)."""
    model = tiny_model("llama")
    _prefill_cache(model, press)
    kept = []
    for layer in model.model.layers:
        _, heads, positions = layer.self_attn.masked_key_indices
        unmasked = torch.ones(KV_HEADS, LENGTH, dtype=torch.bool)
        unmasked[heads, positions] = False
        kept.append([head.nonzero().flatten().tolist() for head in unmasked])
    return kept


def rankkit_kept(spec: str, budget: Budget, **params) -> list[list[list[int]]]:
    cache = make(spec, **params).prefill(Runner(tiny_model("llama")), IDS, budget).result.cache
    return [_kept(cache, layer) for layer in range(LAYERS)]


def test_the_matched_ratio_keeps_rankkits_count_and_no_attention_function_stays_wrapped():
    assert compute_n_kept(LENGTH, RATIO) == KEPT == Budget.from_keep(KEPT / LENGTH).resolve(LENGTH)
    assert all(ALL_ATTENTION_FUNCTIONS[name] is function for name, function in _UNPATCHED.items())
    assert "kvpress" not in ALL_ATTENTION_FUNCTIONS["sdpa"].__module__


@pytest.mark.parametrize(
    ("spec", "params", "press"),
    [
        ("snapkv", {"window_size": WINDOW, "kernel_size": 1},
         lambda: kvpress.SnapKVPress(compression_ratio=RATIO, window_size=WINDOW, kernel_size=1)),
        ("streamingllm", {"sink_tokens": 4}, lambda: kvpress.StreamingLLMPress(compression_ratio=RATIO, n_sink=4)),
        ("tova", {}, lambda: kvpress.TOVAPress(compression_ratio=RATIO)),
    ],
    ids=["snapkv", "streamingllm", "tova"],
)  # fmt: skip
def test_each_layer_and_head_keeps_what_the_kvpress_press_keeps(spec, params, press):
    expected = kvpress_kept(press())
    assert rankkit_kept(spec, Budget.from_tokens(KEPT), **params) == expected
    assert all(len(head) == KEPT for layer in expected for head in layer)


class WindowScores(LayerHook):
    """Each prefill layer's ``window`` probe scores [kv_heads, T]."""

    def __init__(self, probe):
        self.probe, self.by_layer = probe, {}

    def on_attention(self, call):
        if call.phase == "prefill":
            self.by_layer[call.layer] = self.probe.score(call)


def test_kvpress_snapkv_pooling_counts_the_zero_padding_at_the_edges():
    """kvpress's avg pooling divides every neighbourhood by the kernel, zero padding included
    (F.avg_pool1d's default); rankkit averages the neighbours that exist. So kvpress keeps the
    top tokens of rankkit's unpooled scores pooled that way, and at kernel 3 that differs."""
    kernel = 3
    scores = WindowScores(make_probe("window", window_size=WINDOW, kernel_size=1))
    Runner(tiny_model("llama")).prefill(IDS, hooks=[scores])
    past = LENGTH - WINDOW
    padded_pooling = []
    for layer in range(LAYERS):
        unpooled = scores.by_layer[layer]
        pooled = F.avg_pool1d(unpooled[:, None, :past], kernel, stride=1, padding=kernel // 2)[:, 0]
        ranked = torch.cat([pooled, unpooled[:, past:]], dim=-1)
        padded_pooling.append(top_k_with_forced(ranked, KEPT, forced_mask(LENGTH, WINDOW)).tolist())
    press = kvpress.SnapKVPress(compression_ratio=RATIO, window_size=WINDOW, kernel_size=kernel)
    assert kvpress_kept(press) == padded_pooling
    own = rankkit_kept("snapkv", Budget.from_tokens(KEPT), window_size=WINDOW, kernel_size=kernel)
    assert own != padded_pooling  # the edges' scores differ enough here to change a kept token


def test_pyramidkv_counts_hold_the_window_in_kvpress_and_add_it_on_top_in_rankkit():
    """kvpress spreads T (1 - r) over the layers as rankkit spreads budget - W, but its counts
    include the window: at r = 1 - (budget - W) / T every layer keeps W fewer tokens than
    rankkit's, the top of the same SnapKV order."""
    beta, budget = 2, Budget.from_tokens(KEPT)
    method = make("pyramidkv", window_size=WINDOW, kernel_size=1, beta=beta)
    counts = method.budgets(LAYERS, LENGTH, budget)
    assert counts == layer_budgets(LAYERS, LENGTH, KEPT, WINDOW, beta) == [22, 16, 10]
    press = kvpress.PyramidKVPress(
        compression_ratio=1 - (KEPT - WINDOW) / LENGTH, window_size=WINDOW, kernel_size=1, beta=beta
    )
    kept = kvpress_kept(press)
    assert [len(layer[0]) for layer in kept] == [count - WINDOW for count in counts] == [18, 12, 6]
    fewer = LayerBudgetHook(method.probe(), [count - WINDOW for count in counts], window=WINDOW)
    cache = one_pass(Runner(tiny_model("llama")), IDS, fewer).result.cache
    assert [_kept(cache, layer) for layer in range(LAYERS)] == kept
    own = rankkit_kept("pyramidkv", budget, window_size=WINDOW, kernel_size=1, beta=beta)
    assert all(set(k) < set(o) for kl, ol in zip(kept, own) for k, o in zip(kl, ol))  # noqa: B905


def test_kvpress_pyramidkv_falls_back_to_snapkv_when_its_last_layer_would_keep_less_than_the_window():
    """kvpress keeps round(T (1 - r)) in every layer when T (1 - r) / beta < W: at beta 20 here,
    which is SnapKV's kept set; rankkit's PyramidKV still spreads its counts."""
    press = kvpress.PyramidKVPress(compression_ratio=RATIO, window_size=WINDOW, kernel_size=1, beta=20)
    snapkv = rankkit_kept("snapkv", Budget.from_tokens(KEPT), window_size=WINDOW, kernel_size=1)
    assert kvpress_kept(press) == snapkv
    pyramid = make("pyramidkv", window_size=WINDOW, kernel_size=1, beta=20)
    assert pyramid.budgets(LAYERS, LENGTH, Budget.from_tokens(KEPT)) == [27, 16, 5]


@pytest.mark.parametrize(
    ("alpha", "safeguard"),
    # kvpress guards int(alpha x 16) entries counting the window; rankkit int(safeguard x 12) beyond it
    [(0.0, 0.0), (0.5, 0.35)],  # none beyond the window; 8 - 4 = int(0.35 x 12) = 4 beyond it
)
def test_adakv_keeps_the_entries_kvpress_adakv_leaves_unmasked(alpha, safeguard):
    assert int(alpha * KEPT) - WINDOW * (alpha > 0) == int(safeguard * (KEPT - WINDOW))
    press = kvpress.AdaKVPress(
        kvpress.SnapKVPress(compression_ratio=RATIO, window_size=WINDOW, kernel_size=1), alpha_safeguard=alpha
    )
    expected = kvpress_unmasked(press)
    kept = rankkit_kept("adakv", Budget.from_tokens(KEPT), window_size=WINDOW, kernel_size=1, safeguard=safeguard)
    assert kept == expected
    assert all(sum(len(head) for head in layer) == KV_HEADS * KEPT for layer in expected)
    assert any(len(layer[0]) != len(layer[1]) for layer in expected)  # the heads' shares differ
