"""Every method's selection run for real on tiny models: keep 1.0 is full, positions stay original,
and each method's cache holds what its paper says, layer by layer."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from conftest import tiny_model

from rankkit.errors import RankkitError
from rankkit.methods import REGISTRY, Budget, make
from rankkit.methods.measure import run_once
from rankkit.methods.selection import ORACLE_SCORES, Captured
from rankkit.runner import LayerHook, Runner, greedy_continue

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


class NoTextTokenizer:
    """Tiny models have no tokenizer; the oracle only decodes its answer for display."""

    def decode(self, tokens, **kwargs):
        return ""


def _prepared(name, runner, ids, **params):
    method = make(name, **params)
    method.prepare(runner, ids, tokenizer=NoTextTokenizer())
    return method


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_keep_all_reproduces_full_greedy_output(name, family, random_ids):
    runner = _tiny(family)
    run = run_once(runner, _prepared(name, runner, random_ids), random_ids, Budget.from_keep(1.0), 8)
    assert run.tokens == _full_tokens(runner, random_ids)
    # every prompt key, and on a hybrid family's local layer the window's last ones, as full keeps; but
    # SlimInfer's blocks (Alg. 1) on the layers after its first pruning layer, which keep their own rule
    window = getattr(runner.config, "sliding_window", None)
    rolled = [kind == "sliding_attention" for kind in runner.layer_types or [None] * runner.num_layers]
    if name == "sliminfer":
        first = make(name).bind(runner.num_layers, runner.layer_types).pruning_layers[0]
        rolled = [is_local and layer <= first for layer, is_local in enumerate(rolled)]
    assert run.kv_tokens_per_layer == [min(window, PROMPT_LENGTH) if rolls else PROMPT_LENGTH for rolls in rolled]


def test_budget_counts_forced_tokens_and_caps_at_the_prompt():
    assert Budget.from_keep(0.1).resolve(1000, always_kept=8) == 100
    assert Budget.from_keep(0.001).resolve(1000, always_kept=8) == 8
    assert Budget.from_tokens(5000).resolve(1000) == 1000
    assert Budget.from_tokens(64).label == "budget=64"


def test_a_budget_is_one_of_keep_or_tokens():
    from rankkit.errors import RankkitError

    assert Budget.one_of(0.1, None) == Budget.from_keep(0.1)
    assert Budget.one_of(None, 64) == Budget.from_tokens(64)
    for neither_or_both in [(None, None), (0.1, 64)]:
        with pytest.raises(RankkitError, match=r"^give exactly one of --keep \(e.g. 0.1\) or --budget \(e.g. 2048\)$"):
            Budget.one_of(*neither_or_both)


def test_budgets_are_read_by_name_in_every_form_and_given_back_by_name():
    """keep= holds rates and budget= token counts, as a list, one value or the options' comma text;
    a sweep's budgets go back to the keywords they came from (the sweep's bench got them positionally)."""
    from rankkit.errors import RankkitError
    from rankkit.methods import budget_keywords, given_budgets

    rates = [Budget.from_keep(0.1), Budget.from_keep(1)]
    assert given_budgets(keep="0.1,1") == given_budgets(keep=[0.1, 1]) == rates
    assert given_budgets(budget=64) == given_budgets(budget="64") == [Budget.from_tokens(64)]
    assert given_budgets(required=False) == []
    assert budget_keywords(rates) == {"keep": [0.1, 1]}
    assert budget_keywords([Budget.from_tokens(64)]) == {"budget": [64]}
    assert given_budgets(**budget_keywords(rates)) == rates
    with pytest.raises(RankkitError, match=r"^exactly one of --keep .*, not both: give keep rates or token counts$"):
        budget_keywords([Budget.from_keep(0.1), Budget.from_tokens(64)])
    with pytest.raises(RankkitError, match=r"^--budget '0.5' is not a token count; give e.g. --budget 2048"):
        given_budgets(budget="0.5")
    with pytest.raises(RankkitError, match=r"^give exactly one of --keep"):
        given_budgets()


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
    for layer in (0, 1):  # per head, SnapKV-style, TSP included (Listing 2): heads choose differently
        assert cache.kept_tokens(layer).tolist() == [10, 10]
        assert cache.positions[layer][0].tolist() != cache.positions[layer][1].tolist()
        assert (
            cache.positions[layer][:, -4:].tolist() == [list(range(36, 40))] * 2
        )  # the window is always kept
    assert cache.positions[2].tolist() == [run.kept_positions.tolist()] * 2


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
    assert cache.kept_tokens(2).tolist() == [10, 10]  # l_p caches its own per-head top-k (Listing 5)
    assert cache.positions[2].tolist() != [run.kept_positions.tolist()] * 2
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


def test_asl_selects_where_the_relative_rank_variance_drops_below_tau(random_ids):
    from rankkit.methods.asl import RankVariance, descending_ranks

    assert descending_ranks(torch.tensor([0.1, 0.9, 0.5])).tolist() == [2.0, 0.0, 1.0]
    policy = RankVariance(tau=0.3, min_layer=1, observed_layers=2, top_k=2, window=1, last_layer=5)
    shuffled = torch.tensor([[1.0, 2.0, 3.0, 4.0, 0.0]])
    assert policy.decide(0, shuffled) is None  # before L_min: ranks cached only
    assert policy.decide(1, shuffled.flip(-1)) is None  # L_min sets the initial variance
    assert policy.relative_variance[1] == 1.0
    assert policy.decide(2, shuffled.flip(-1)) is not None  # ranks stopped moving: variance 0 < tau
    assert policy.relative_variance[2] == 0.0


@pytest.mark.parametrize("name", ["asl", "asl-2pass"])
def test_asl_every_layer_holds_the_budget(name, random_ids):
    runner = _tiny()
    run = make(name, window_size=4, min_layer=1, observed_layers=2).prefill(
        runner, random_ids, Budget.from_tokens(10)
    )
    assert run.selection_layer in (1, 2)
    for layer in range(3):
        assert run.result.cache.kept_tokens(layer).tolist() == [10, 10]


@pytest.mark.parametrize("mirror", ["gemfilter", "fastkv", "claa"])
def test_oracle_keeps_its_top_ranked_tokens_in_the_mirrored_architecture(mirror, random_ids):
    runner = _tiny()
    layered = {} if mirror == "gemfilter" else {"pruning_layer": 1, "window_size": 2}  # Listing 4 reads neither
    method = _prepared("oracle", runner, random_ids, mirror=mirror, max_new_tokens=4, **layered)
    run = method.prefill(runner, random_ids, Budget.from_tokens(10))
    window = (
        1 if mirror == "gemfilter" else 2
    )  # Listing 4 keeps the last token; the one-pass mirrors their window
    expected = set(torch.topk(method.ranking[:-window], 10 - window).indices.tolist()) | set(
        range(40 - window, 40)
    )
    assert set(run.kept_positions.tolist()) == expected
    assert run.result.cache.positions[2][0].tolist() == sorted(expected)
    if mirror == "gemfilter":
        assert [p.label for p in run.passes] == ["main"]  # the ranking is offline: no first pass
        assert run.selection_layer is None and method.resolved(3)["pruning_layer"] is None
    # the offline face keeps the same positions at the same layer, from the stored oracle alone
    captured = Captured({ORACLE_SCORES: method.ranking}, 3, 40)
    offline = method.select_offline(captured, Budget.from_tokens(10))
    assert offline.positions.tolist() == sorted(expected) and offline.layer == run.selection_layer


@pytest.mark.parametrize(
    ("mirror", "unread"),
    [
        ("gemfilter", {"pruning_layer": 1}),
        ("gemfilter", {"deferred_layers": 2}),
        ("gemfilter", {"window_size": 4}),
        ("fastkv", {"deferred_layers": 2}),
    ],
)
def test_an_oracle_parameter_its_mirror_never_reads_is_refused(mirror, unread):
    (name,) = unread
    with pytest.raises(RankkitError, match=rf"^method 'oracle': mirror={mirror} reads no {name}; drop it$"):
        make("oracle", mirror=mirror, **unread)
    with pytest.raises(RankkitError, match="no selection layer to set; drop --layer"):
        make("oracle", mirror="gemfilter").with_layer(1)
    assert make("oracle", mirror="claa", deferred_layers=2).with_layer(1).pruning_layer == 1


def test_specprefill_counts_the_draft_and_keeps_the_last_token(random_ids):
    runner = _tiny()
    run = make("specprefill", lookahead=3).prefill(runner, random_ids, Budget.from_tokens(10))
    assert [p.label for p in run.passes] == ["draft", "lookahead", "main"]
    assert run.passes[0].queries == [40]  # the default draft: the first ⌈3/4⌉ = 1 layer
    assert run.passes[1].queries == [1] * 3 and run.passes[1].keys == [41, 42, 43]
    assert run.kept_positions[-1] == 39 and run.live_tokens == [10, 10, 10]


def test_specprefills_ideal_ratio_counts_the_drafts_prefill_and_lookahead_steps(random_ids):
    from rankkit.methods.measure import CostModel

    runner, model = _tiny(), CostModel(linear=1.0, quadratic=0.01, ffn_share=0.5, head_layers=2.0)

    def layer(queries, keys):
        return queries + 0.01 * queries * keys

    full = 3 * layer(40, 40)
    ideal = {}
    for draft_layers in (1, 2):
        method = make("specprefill", lookahead=3, draft_model=f"layers:{draft_layers}")
        passes = method.prefill(runner, random_ids, Budget.from_tokens(10)).passes
        steps = 3 * draft_layers  # three lookahead tokens through each draft layer
        heads = 4 * 2.0  # the draft prefill's LM head and each step's, each worth 2 layers
        drafted = draft_layers * layer(40, 40) + 3 * layer(10, 10)
        # full's decode step of 2.5 s: 3 layers and a head worth 2, 0.5 s a layer
        ideal[draft_layers] = model.ideal_ratio(passes, 40, 3, decode_step_s=2.5)
        assert ideal[draft_layers] == pytest.approx((drafted + (steps + heads) * 0.5) / full)
        by_compute = sum(layer(1, keys) for keys in (41, 42, 43)) * draft_layers  # a + b·m per step
        assert model.ideal_ratio(passes, 40, 3) == pytest.approx((drafted + by_compute + heads) / full)
    assert ideal[2] > ideal[1]


def test_self_draft_is_the_targets_first_layers_norm_and_head(random_ids):
    from rankkit.errors import RankkitError
    from rankkit.methods.specprefill import draft_runner, eq3, lookahead_scores

    runner = _tiny()
    draft = draft_runner("layers:2", runner)
    assert draft.num_layers == 2 and runner.num_layers == 3 and draft.model is runner.model
    with torch.inference_mode():
        hidden = runner.model(random_ids[None], output_hidden_states=True).hidden_states[2]
        expected = runner.model.lm_head(runner.model.model.norm(hidden))[0, -1]
    assert torch.allclose(draft.prefill(random_ids).logits, expected, atol=1e-5)
    for bad in ("layers:0", "layers:4", "layers:two"):
        with pytest.raises(RankkitError, match="layers:1"):
            draft_runner(bad, runner)

    recorder = PositionRecorder()
    recorder.on_attention = lambda call: (
        call.phase == "decode"
        and recorder.calls.append(
            (call.query[0, :, -1].float().clone(), call.key[0, :, :40].float().clone(), call.scaling)
        )
    )
    lookahead, _ = lookahead_scores(draft, random_ids, 4)
    greedy_continue(draft, draft.prefill(random_ids), 4, [recorder], feed_last=True)
    assert lookahead.shape == (4, 40) and len(recorder.calls) == 4 * 2
    for step in range(4):  # Eq. 3 inside the mean: each lookahead query's max over draft layers and heads
        expected = torch.full((40,), float("-inf"))
        for query, key, scaling in recorder.calls[2 * step : 2 * step + 2]:
            for head in range(4):
                expected = torch.maximum(expected, key[head // 2] @ query[head] * scaling)
        assert torch.allclose(lookahead[step], expected, atol=1e-5)
    assert torch.allclose(eq3(lookahead), lookahead.mean(dim=0))


class QueryKeyRecorder(LayerHook):
    def __init__(self):
        self.prefill = {}

    def on_attention(self, call):
        if call.phase == "prefill":
            self.prefill[call.layer] = (
                call.query[0].float().clone(),
                call.key[0].float().clone(),
                call.scaling,
            )


def _sage_reference(query, key, scaling, split):
    """SAGE-KV Steps 1-3 written out: per query head h, the top-k of E by the last token's softmax attention."""
    q_heads, kv_heads, length = query.shape[0], key.shape[0], key.shape[1]
    group = q_heads // kv_heads
    evicted = list(range(split.sinks, length - split.recent))
    kept = []
    for g in range(kv_heads):
        chosen = set(range(split.sinks)) | set(range(length - split.recent, length))
        for h in range(g * group, (g + 1) * group):
            attention = torch.softmax(key[g] @ query[h, -1] * scaling, dim=0)
            ranked = sorted(evicted, key=lambda i: -float(attention[i]))
            chosen |= set(ranked[: split.per_query_head])
        kept.append(sorted(chosen))
    return kept


def test_sage_kv_keeps_the_union_of_each_query_heads_top_k_and_rolls_the_recent_window():
    from rankkit.methods.sage_kv import SageSplit, sage_split

    # Appendix A.2's worked examples, B = 8192: Llama (G = 4) and Qwen2.5 (G = 7)
    assert sage_split(8192, 4) == SageSplit(sinks=2048, per_query_head=1024, recent=2048)
    assert sage_split(8192, 7) == SageSplit(sinks=2048, per_query_head=512, recent=2560)
    assert sage_split(8192, 1).per_query_head == 4096 and sage_split(8192, 8).per_query_head == 512
    runner = _tiny()
    ids = torch.randint(0, 97, (64,), generator=torch.Generator().manual_seed(3))
    recorder = QueryKeyRecorder()
    runner.prefill(ids, hooks=[recorder])
    split = sage_split(16, 2)  # sinks 4, k 4 per query head, recent 4 (the last token included)
    run = make("sage-kv").prefill(runner, ids, Budget.from_tokens(16))
    cache = run.result.cache
    expected = {layer: _sage_reference(*recorder.prefill[layer], split) for layer in range(3)}
    for layer in range(3):
        kept = [sorted(p for p in head.tolist() if p >= 0) for head in cache.positions[layer]]
        assert kept == expected[layer]

    sizes = [[size + 1 for size in cache.kept_tokens(layer).tolist()] for layer in range(3)]
    tokens = greedy_continue(runner, run.result, 6, run.decode_hooks)
    assert len(tokens) == 6
    for layer in range(3):  # Step 4: constant size (the window and a step's token), the window rolled on
        assert cache.kept_tokens(layer).tolist() == sizes[layer]
        for head, wanted in zip(cache.positions[layer], expected[layer], strict=True):
            kept = sorted(p for p in head.tolist() if p >= 0)
            rolled = [p for p in wanted if p < 64 - split.recent] + list(range(68 - split.recent, 69))
            assert kept == rolled


def water_filling(total: int, weights: list[float], caps: list[int]) -> list[int]:
    """LAVa's budgets as plain rounds on the host: shares past their cap fixed at it and the rest
    shared again until none passes, then the last fractions by largest remainder."""
    if total >= sum(caps):
        return list(caps)
    if total <= 0:
        return [0] * len(caps)
    shares = [0.0] * len(weights)
    open_ = list(range(len(weights)))
    remaining = float(total)
    while open_:
        weight = sum(weights[i] for i in open_)
        proposal = {
            i: remaining * weights[i] / weight if weight > 0 else remaining / len(open_) for i in open_
        }
        fixed = [i for i in open_ if proposal[i] > caps[i]]
        if not fixed:
            shares = [proposal.get(i, shares[i]) for i in range(len(weights))]
            break
        for i in fixed:
            shares[i] = caps[i]
            remaining -= caps[i]
        open_ = [i for i in open_ if i not in fixed]
    whole = [math.floor(share) for share in shares]
    for i in sorted(range(len(whole)), key=lambda i: shares[i] - whole[i], reverse=True)[
        : total - sum(whole)
    ]:
        whole[i] += 1
    return whole


def test_lavas_budgets_apportioned_at_once_on_the_device_are_the_rounds_of_water_filling():
    from rankkit.methods.lava import apportion

    def on_device(total, weights, caps):
        weights = torch.tensor(weights, dtype=torch.float64)
        return apportion(total, weights, torch.tensor(caps, dtype=torch.long)).tolist()

    assert (
        on_device(10, [1.0, 1.0, 2.0], [10, 10, 10])
        == water_filling(10, [1.0, 1.0, 2.0], [10] * 3)
        == [3, 2, 5]
    )
    assert on_device(10, [1.0, 100.0], [20, 6]) == [4, 6]
    generator = random.Random(7)
    for case in range(3000):
        count = generator.randint(1, 40)
        weights = [
            generator.choice([0.0, 0.25, generator.random(), generator.random() * 1e-3]) for _ in range(count)
        ]
        caps = [generator.choice([0, 3, generator.randint(0, 500)]) for _ in range(count)]
        total = generator.randint(-5, sum(caps) + 20)
        assert on_device(total, weights, caps) == water_filling(total, weights, caps), case


def test_lava_head_budgets_sum_to_layer_budgets_which_sum_to_the_total(random_ids):
    from rankkit.methods.lava import LavaBudgets

    runner = _tiny()
    hook = LavaBudgets(make_probe_lava(), keep_tokens=10, window=4, num_layers=3)
    result = runner.prefill(random_ids, hooks=[hook])
    hook.evict(result.cache)
    kept = [int(result.cache.kept_tokens(layer).sum()) for layer in range(3)]
    assert kept == hook.budgets and sum(kept) == 10 * 2 * 3
    for layer in range(3):  # the window of every head survives every recompression
        for head_positions in result.cache.positions[layer].tolist():
            assert {36, 37, 38, 39} <= set(head_positions)


def make_probe_lava():
    from rankkit.methods.base import make_probe

    return make_probe("lava", window_size=4)


def _block_cache(length=32, kv_heads=2, dim=4):
    from rankkit.cache import KVCache

    cache = KVCache(1)
    positions = torch.arange(length)
    keys = positions.float()[None, None, :, None].expand(1, kv_heads, length, dim).clone()
    cache.begin_step(positions)
    cache.update(keys, -keys, 0)
    return cache


def _block_swap(cache, *, active: set[int], gamma: float):
    """Alg. 1 for layer 0 of ``cache`` (a 32-token prompt in blocks of 8), laid out by the positions it holds."""
    from rankkit.methods.swap import BlockLayout, BlockSwap

    layout = BlockLayout.of(cache.positions[0][0].numpy(), block_size=8, prompt_length=32, active=active)
    return BlockSwap(cache, 0, layout, gamma=gamma)


def _device_entries(cache):
    """The real entries (padding left out), in position order."""
    positions = cache.positions[0][0]
    order = torch.argsort(positions)[(positions < 0).sum() :]
    return cache.positions[0][:, order], cache.keys[0][:, :, order], cache.values[0][:, :, order]


def test_swap_follows_algorithm_1_and_restores_identical_kv():
    cache = _block_cache()
    original = _device_entries(cache)
    swap = _block_swap(cache, active={0, 3}, gamma=0.9)
    assert swap.active == {0, 3} and set(swap.host) == {1, 2}
    cache.begin_step(torch.tensor([32]))  # a generated token: never swapped
    cache.update(torch.full((1, 2, 1, 4), 99.0), torch.full((1, 2, 1, 4), -99.0), 0)

    assert not swap.swap({0, 3}, cache).swapped  # overlap 1 >= gamma
    decision = swap.swap({0, 1}, cache)  # overlap 0.5 < 0.9
    assert decision.swapped and decision.offloaded == {3} and decision.loaded == {1} and not decision.released
    assert swap.active == {0, 1} and set(swap.host) == {1, 2, 3}
    decision = swap.swap({0, 3}, cache)  # block 1 already has a host copy: released, not copied again
    assert decision.released == {1} and decision.offloaded == set() and decision.loaded == {3}
    assert swap.active | set(swap.host) == {0, 1, 2, 3}  # no block lost

    positions, keys, values = _device_entries(cache)
    assert 32 in positions[0].tolist()
    prompt = positions[0] < 32
    wanted = torch.isin(original[0][0], torch.tensor([*range(8), *range(24, 32)]))
    assert torch.equal(positions[:, prompt], original[0][:, wanted])
    assert torch.equal(keys[:, :, prompt], original[1][:, :, wanted])
    assert torch.equal(values[:, :, prompt], original[2][:, :, wanted])


def test_swap_threshold_gamma_decides_whether_blocks_move():
    cache = _block_cache()
    swap = _block_swap(cache, active={0, 3}, gamma=0.5)
    assert not swap.swap({0, 1}, cache).swapped  # overlap 0.5 is not below gamma 0.5
    assert swap.swap({1, 2}, cache).swapped  # overlap 0


class SlimRecorder(LayerHook):
    """Queries and keys at the pruning layers, and after every decode step each governed layer's active blocks."""

    def __init__(self, slim):
        self.slim = slim
        self.prefill, self.decode, self.active = {}, {0: [], 1: []}, []

    def on_attention(self, call):
        if call.layer in (0, 1):
            record = (
                call.query[0].float().clone(),
                call.key[0].float().clone(),
                call.key_positions[0].clone(),
            )
            if call.phase == "prefill":
                self.prefill[call.layer] = record
            else:
                self.decode[call.layer].append(record[0][:, -1])

    def after_decode_step(self, cache, position):
        self.active.append({layer: set(self.slim.schedule[layer].swaps[0].active) for layer in (0, 1)})


def _slim_block_scores(query, key, positions, block_size=8, unit_size=2):
    """SlimInfer Eq. 1-2 written out: r(B_j) = max_m (1/H) sum_h q^h . mean(keys of unit m of B_j)."""
    q_heads, kv_heads = query.shape[0], key.shape[0]
    scores = {}
    for block in sorted({int(p) // block_size for p in positions}):
        best = float("-inf")
        for unit in range(block * block_size // unit_size, (block + 1) * block_size // unit_size):
            members = [i for i, p in enumerate(positions.tolist()) if p // unit_size == unit]
            if not members:
                continue
            total = 0.0
            for h in range(q_heads):
                k_rep = key[h // (q_heads // kv_heads), members].mean(dim=0)
                total += float(query[h] @ k_rep)
            best = max(best, total / q_heads)
        scores[block] = best
    return scores


def _slim_candidate(scores, count):
    others = sorted((b for b in scores if b != min(scores)), key=lambda b: -scores[b])
    return {min(scores), *others[: count - 1]}


def test_sliminfer_prunes_after_attention_and_swaps_in_the_same_step_as_the_papers_eq_1_2_and_alg_1():
    from rankkit.methods.sliminfer import ffn_on_kept_tokens

    runner = _tiny()
    ids = torch.randint(0, 97, (64,), generator=torch.Generator().manual_seed(5))
    method = make("sliminfer", pruning_layers=(0, 1), block_size=8, unit_size=2, window_size=2)
    slim = method.hook(3, 64, Budget.from_tokens(16))  # layer 0 keeps 4 blocks, layer 1 keeps 2
    recorder = SlimRecorder(slim)
    ffn_rows = []
    with ffn_on_kept_tokens(runner, slim):  # registered after its hooks, the recorder sees what the FFN gets
        mlp = runner.body.layers[0].mlp.register_forward_pre_hook(
            lambda m, args: ffn_rows.append(args[0].shape[1])
        )
        prefill = runner.prefill(ids, hooks=[recorder, slim])
    mlp.remove()

    live, active = torch.arange(64), {}
    for layer, count in ((0, 4), (1, 2)):
        query, key, positions = recorder.prefill[layer]
        assert torch.equal(positions, live)
        active[layer] = _slim_candidate(_slim_block_scores(query[:, -2:].mean(dim=1), key, positions), count)
        live = torch.tensor([p for p in live.tolist() if p // 8 in active[layer] or p >= 62])
        assert prefill.live_tokens[layer + 1] == live.numel()  # the query window (62, 63) stays live
        kept = prefill.cache.positions[layer + 1][0]
        kept = kept[kept >= 0]  # the governed layers hold their blocks in regions, padded (``BlockSwap``)
        assert sorted(kept.tolist()) == [p for p in live.tolist() if p // 8 in active[layer]]
    assert 0 in (prefill.cache.positions[2][0] // 8).tolist()  # the first block, always
    assert ffn_rows == [prefill.live_tokens[1]]  # the pruning layer's FFN ran on the kept tokens only
    assert prefill.cache.positions[0].shape[1] == 64  # its attention saw them all, its cache keeps them

    # decoding through Runner.generate: each step's candidate drives that same step's swap
    pools = {layer: slim.schedule[layer].swaps[0].pool() for layer in (0, 1)}
    unit_keys = {layer: recorder.prefill[layer] for layer in (0, 1)}
    greedy_continue(runner, prefill, 7, [recorder, slim])
    assert len(recorder.active) == 6
    for step, after in enumerate(recorder.active):
        for layer, count in ((0, 4), (1, 2)):
            window = torch.stack(recorder.decode[layer][max(0, step - 1) : step + 1]).mean(dim=0)
            _, key, positions = unit_keys[layer]
            scores = _slim_block_scores(window, key, positions)
            chosen = _slim_candidate({b: v for b, v in scores.items() if b in pools[layer]}, count)
            chosen &= pools[layer]
            if len(chosen & active[layer]) / len(chosen) < 0.9:  # Alg. 1
                active[layer] = chosen
            assert after[layer] == active[layer]
    assert any(decision.swapped for decision in slim.decisions)
    for layer in (1, 2):  # no block lost between the tiers
        swap = slim.governor[layer].swaps[0]
        assert swap.pool() == pools[layer - 1]
        held = prefill.cache.positions[layer][0]
        assert set((held[(held >= 0) & (held < 64)] // 8).tolist()) == swap.active


def test_sliminfers_pass_counts_the_tokens_each_layers_ffn_ran_on_for_its_ideal_ratio():
    runner = _tiny()
    ids = torch.randint(0, 97, (64,), generator=torch.Generator().manual_seed(5))
    method = make("sliminfer", pruning_layers=(0, 1), block_size=8, unit_size=2, window_size=2)
    ffn_rows = []
    hooks = [
        layer.mlp.register_forward_hook(lambda m, args, output: ffn_rows.append(args[0].shape[1]))
        for layer in runner.body.layers
    ]
    run = method.prefill(runner, ids, Budget.from_tokens(16))
    for hook in hooks:
        hook.remove()
    (main,) = run.passes
    live = run.live_tokens
    assert main.queries == main.keys == live and live[0] == 64 > live[1] > live[2]
    # the pruning layers' FFNs ran on the tokens the next layer gets; the last layer's on its own
    assert main.ffn_queries == ffn_rows == [live[1], live[2], live[2]]


def test_runner_generate_runs_the_decode_hooks_per_step_hook():
    runner = _tiny()
    ids = torch.randint(0, 97, (64,), generator=torch.Generator().manual_seed(5))
    slim = make("sliminfer", pruning_layers=(0, 1), block_size=8, unit_size=2, window_size=2).hook(
        3, 64, Budget.from_tokens(16)
    )
    steps = PositionRecorder()
    steps.after_decode_step = lambda cache, position: steps.calls.append(position)
    runner.generate(ids, 5, hooks=[slim], decode_hooks=[slim, steps])
    assert len(slim.decisions) == 2 * 4  # two governed layers, four decode steps
    assert any(decision.swapped for decision in slim.decisions)
    assert [c for c in steps.calls if isinstance(c, int)] == [64, 65, 66, 67]


@pytest.fixture(scope="module")
def default_runner(default_model):
    return Runner(default_model.model)


@pytest.fixture(scope="module")
def short_prompt(default_model):
    from rankkit.prompting import build_prompt

    context = "The secret code is 4172. " + "Grass is green and the sky is blue. " * 12
    return build_prompt(default_model.tokenizer, context, "What is the secret code?").input_ids


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_keep_all_reproduces_full_on_the_default_model(name, default_model, default_runner, short_prompt):
    method = make(name)
    method.prepare(default_runner, short_prompt, tokenizer=default_model.tokenizer)
    run = run_once(default_runner, method, short_prompt, Budget.from_keep(1.0), 6)
    assert run.tokens == default_runner.generate(short_prompt, 6).tokens


@pytest.mark.integration
@pytest.mark.parametrize("name", ["gemfilter", "fastkv", "claa", "asl"])
def test_pruned_methods_keep_original_positions_on_the_default_model(name, default_runner, short_prompt):
    run = make(name).prefill(default_runner, short_prompt, Budget.from_keep(0.3))
    length = int(short_prompt.numel())
    kept = run.kept_positions.tolist()
    assert (
        kept == sorted(kept)
        and kept[-1] == length - 1
        and len(kept) == Budget.from_keep(0.3).resolve(length, 32)
    )
    after = range(run.selection_layer + 1, default_runner.num_layers)  # the selection layer caches per head
    assert all(run.result.cache.positions[layer][0].tolist() == kept for layer in after)
    assert run.result.prompt_length == length


# ---- the offline face: the kept set from captured scores is the one the prefill keeps


def _captured(runner, ids, probes):
    from rankkit.methods import Captured
    from rankkit.probes import ProbeRecorder

    recorder = ProbeRecorder(probes)
    runner.prefill(ids, hooks=[recorder])
    arrays = {key: torch.from_numpy(scores) for key, scores in recorder.scores().items()}
    config = runner.config
    heads = {"kv_heads": config.num_key_value_heads, "query_heads": config.num_attention_heads}
    return Captured(arrays, runner.num_layers, int(ids.numel()), **heads)


OFFLINE_FACES = {
    "gemfilter": {},
    "fastkv": {},
    "claa": {},
    "asl": {},
    "asl-2pass": {},
    "snapkv": {},
    "streamingllm": {},
    "sage-kv": {},
    "pyramidkv": {"window_size": 4, "beta": 2},
    "adakv": {"window_size": 4},
    "tova": {},
    "sliminfer": {"pruning_layers": (1, 2), "block_size": 4, "unit_size": 2, "window_size": 2},
}


@pytest.mark.parametrize("name", list(OFFLINE_FACES))
@pytest.mark.parametrize("budget", [Budget.from_keep(0.1), Budget.from_keep(0.4), Budget.from_tokens(36)])
def test_offline_selection_is_the_prefill_selection(name, budget, random_ids):
    from rankkit.cache import PADDING

    runner = _tiny()
    method = make(name, **OFFLINE_FACES[name])
    probes = [] if name == "streamingllm" else [method.probe()]
    captured = _captured(runner, random_ids, probes)
    online = method.prefill(runner, random_ids, budget)
    if online.kept_positions is None:  # KV-only: a set per KV head in every layer's cache
        for layer in range(runner.num_layers):
            kept = online.result.cache.positions[layer]  # [kv_heads, k], padded where heads keep fewer
            cached = [[p for p in head if p != PADDING] for head in kept.tolist()]
            offline = method.select_offline(captured, budget, layer=layer).positions
            if isinstance(offline, torch.Tensor):  # StreamingLLM: one set for all heads
                offline = offline.expand_as(kept)
            assert [head.tolist() for head in offline] == cached
        with pytest.raises(RankkitError):
            method.select_offline(captured, budget)
        return
    offline = method.select_offline(captured, budget)
    assert offline.layer == online.selection_layer
    assert offline.positions.tolist() == online.kept_positions.tolist()


def test_layer_parameters_bind_to_the_model_depth():
    claa = make("claa")
    assert claa.resolved(30) == {
        "pruning_layer": 14,  # round(15 * 30 / 32)
        "aggregation_window": 4,
        "deferred_layers": 4,
        "window_size": 8,
        "kernel_size": 7,
    }
    assert make("asl").bind(30).min_layer == 10 and make("asl").bind(30).observed_layers == 8
    assert make("claa", pruning_layer=3).bind(30).pruning_layer == 3
    assert make("fastkv").with_layer(2).bind(4).tsp_layer == 2
    assert make("gemfilter").selection_parameter == "routing_layer"
    with pytest.raises(RankkitError):
        make("fastkv").with_layer(9).bind(4)
    assert make("snapkv").selection_parameter is None


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("claa:aggregation_window=0", "method 'claa': aggregation_window=0 is outside [1, L]"),
        ("claa:aggregation_window=abc", "method 'claa': aggregation_window='abc' is not an integer"),
        ("claa:window_size=2.5", "method 'claa': window_size=2.5 is not an integer"),
        ("asl:tau=nan", "method 'asl': tau=nan is not a number"),
        ("asl:tau=0", "method 'asl': tau=0 is outside (0, inf) (τ, ASL Alg. 2)"),
        ("asl:tau=inf", "method 'asl': tau=inf is outside (0, inf) (τ, ASL Alg. 2)"),
        ("snapkv:window_size=inf", "method 'snapkv': window_size=inf is not an integer"),
        ("streamingllm:sink_tokens=-4", "method 'streamingllm': sink_tokens=-4 is outside [0, inf)"),
        ("sliminfer:gamma=5", "method 'sliminfer': gamma=5 is outside [0, 1] (γ, SlimInfer Alg. 1)"),
        ("sliminfer:pruning_layers=3", "method 'sliminfer': pruning_layers=3 is not a list of layers"),
        ("snapkv:window_size=0", "method 'snapkv': window_size=0 is outside [1, inf)"),
        ("specprefill:lookahead=0", "method 'specprefill': lookahead=0 is outside [1, inf)"),
        ("oracle:max_new_tokens=0", "method 'oracle': max_new_tokens=0 is outside [1, inf)"),
        ("asl:observed_layers=1", "method 'asl': observed_layers=1 is outside [2, L]"),
        ("pyramidkv:beta=0.5", "method 'pyramidkv': beta=0.5 is outside [1, inf) (β, PyramidKV)"),
        ("adakv:safeguard=2", "method 'adakv': safeguard=2 is outside [0, 1] (α, AdaKV)"),
    ],
)
def test_a_parameter_outside_its_declared_range_is_refused_on_construction(spec, message):
    """What compare and select parse (``method_from_spec``) and the Python API (``make``) refuse alike."""
    from rankkit.eval.offline import method_from_spec
    from rankkit.probes import parse_named

    ((name, params),) = parse_named(spec, "method")
    for build in (lambda: method_from_spec(spec), lambda: make(name, **params)):
        with pytest.raises(RankkitError) as refused:
            build()
        assert str(refused.value) == message


@pytest.mark.parametrize(
    ("method", "message"),
    [
        (make("claa", deferred_layers=50), "method 'claa': deferred_layers=50 is outside [0, 30]"),
        (make("claa", aggregation_window=31), "method 'claa': aggregation_window=31 is outside [1, 30]"),
        (make("asl", min_layer=30), "method 'asl': min_layer=30 is outside [0, 29]"),
        (
            make("sliminfer", pruning_layers=(3, 30)),
            "method 'sliminfer': pruning_layers=(3, 30) is outside [0, 29]",
        ),
        (
            make("fastkv", tsp_layer=30),
            "method 'fastkv': tsp_layer=30 is outside [0, 29]; pick a layer with --layer",
        ),
    ],
)
def test_a_layer_parameter_past_the_models_depth_is_refused_when_bound(method, message):
    with pytest.raises(RankkitError) as refused:
        method.bind(30)
    assert str(refused.value) == message


def test_a_method_built_directly_is_refused_when_bound():
    from rankkit.methods.streamingllm import StreamingLLM

    with pytest.raises(RankkitError, match="sink_tokens=-4 is outside"):
        StreamingLLM(sink_tokens=-4).bind(30)


def test_ranks_break_ties_toward_the_earlier_token():
    from rankkit.methods.selection import descending_ranks, top_k_with_forced

    scores = torch.tensor([1.0, 3.0, 3.0, 3.0, 0.0])
    assert descending_ranks(scores).tolist() == [3, 0, 1, 2, 4]
    assert top_k_with_forced(scores, 2).tolist() == [1, 2]
    forced = torch.tensor([False, False, False, False, True])
    assert top_k_with_forced(scores, 2, forced).tolist() == [1, 4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64])
def test_the_compiled_cpu_order_is_torchs_stable_descending_sort(dtype):
    """On a CPU the selection rule sorts with rankkit.sorting; it orders every token as torch's
    stable descending sort does: ties, -0.0 and 0.0, +-inf, NaN (first) and all-NaN rows."""
    from rankkit.methods.selection import descending_order, descending_ranks

    generator = torch.Generator().manual_seed(0)
    for length in (1, 2, 7, 64, 2_049):
        values = torch.randint(-3, 4, (3, length), generator=generator).double()
        if dtype.is_floating_point:
            values[values == 3] = float("nan")
            values[values == -3] = -0.0
            values[values == 2] = float("inf")
            values[values == -2] = float("-inf")
            values[1] = float("nan")
            values[2] += torch.rand(length, generator=generator, dtype=torch.float64)
        scores = values.to(dtype)
        sortable = scores if scores.is_floating_point() else scores.float()
        expected = torch.sort(sortable, dim=-1, descending=True, stable=True).indices
        assert torch.equal(descending_order(scores), expected)
        assert torch.equal(descending_order(scores[2]), expected[2])
        places = torch.empty_like(expected).scatter_(-1, expected, torch.arange(length).expand_as(expected))
        assert torch.equal(descending_ranks(scores), places)


def test_the_sort_made_ready_before_timing_is_the_one_every_method_ranks_with():
    """``load_compiled`` compiles (or loads) every kind of array the methods sort, so none is
    compiled later, inside a timed run."""
    from rankkit import sorting
    from rankkit.methods.selection import descending_order, descending_ranks

    sorting.load_compiled()
    ready = set(sorting._descending.signatures)
    scores = torch.randn(4, 300)
    for ranked in (scores, scores.double(), scores.half(), scores.bfloat16(), scores[:, ::3], scores[0], scores.T):
        descending_order(ranked)
        descending_ranks(ranked)
    assert set(sorting._descending.signatures) == ready and len(ready) == 2


@pytest.mark.parametrize(
    "draw",
    [
        lambda rng, length: rng.random(length, dtype=np.float32),  # float32, one sign: 32-bit keys
        lambda rng, length: rng.standard_normal(length).astype(np.float32),  # both signs
        lambda rng, length: (rng.standard_normal(length) * 1e30).astype(np.float32) ** 3,  # +-inf, zeros
        lambda rng, length: rng.random(length, dtype=np.float32).astype(
            np.float64
        ),  # float32 values in float64
        lambda rng, length: rng.standard_normal(length),  # float64 values: 64-bit keys
        lambda rng, length: np.exp(rng.standard_normal(length) * 300),  # float64 beyond float32's range
        lambda rng, length: np.full(length, 0.25, np.float32),  # one key: no pass at all
    ],
)
@pytest.mark.parametrize("nan_first", [True, False])
def test_the_radix_sort_orders_as_a_stable_sort_on_both_key_widths(draw, nan_first):
    from rankkit.sorting import descending_orders

    rng = np.random.default_rng(3)
    for length in (1, 5, 2_048, 33_000):
        with np.errstate(over="ignore"):  # the draws that overflow to infinity do so on purpose
            values = draw(rng, length)
        values[rng.random(length) < 0.05] = np.nan
        values[rng.random(length) < 0.05] = values[0]  # ties
        wide = values.astype(np.float64)
        sortable = np.where(np.isnan(wide), np.inf if nan_first else -np.inf, wide)
        # first, NaN goes above +inf; last, it ties with -inf (no score is as low as the lowest)
        above_inf = np.isnan(wide) & nan_first
        expected = np.lexsort((np.arange(length), ~above_inf, -sortable))
        assert np.array_equal(descending_orders(values, nan_first=nan_first), expected), length


@pytest.fixture(scope="module")
def default_store(tmp_path_factory, default_runner, short_prompt):
    """A store of the short prompt with every probe setting the methods rank by, as a capture writes it."""
    from rankkit import stores
    from rankkit.capture import write_draft_scores
    from rankkit.methods import probes_methods_need
    from rankkit.probes import ProbeRecorder

    probes = [*probes_methods_need(), make("sliminfer", **ONLINE_SLIMINFER).probe()]
    recorder = ProbeRecorder(probes)
    default_runner.prefill(short_prompt, hooks=[recorder])
    path = tmp_path_factory.mktemp("select") / "store.zarr"
    writer = stores.create(path, {"model": {"id": "default"}, "probes": {p.key: p.params() for p in probes}})
    writer.write_example("ex0", attrs={}, tokens=short_prompt.numpy(), scores=recorder.scores())
    write_draft_scores(writer, default_runner, make("specprefill"), "ex0", short_prompt)
    return path


ONLINE_SLIMINFER = {"block_size": 16, "unit_size": 4}  # blocks small enough to prune a short prompt


@pytest.mark.integration
@pytest.mark.parametrize(
    "name", ["gemfilter", "fastkv", "claa", "asl", "asl-2pass", "sliminfer", "specprefill"]
)
@pytest.mark.parametrize("keep", [0.1, 0.4])
def test_select_from_the_store_is_what_prefill_keeps_on_the_default_model(
    name, keep, default_store, default_runner, short_prompt
):
    from rankkit.eval.offline import select_store

    params = ONLINE_SLIMINFER if name == "sliminfer" else {}
    spec = name + "".join(f"{',' if index else ':'}{k}={v}" for index, (k, v) in enumerate(params.items()))
    (row,) = select_store(default_store, spec, keep=keep)
    online = make(name, **params).prefill(default_runner, short_prompt, Budget.from_keep(keep))
    assert row["example_id"] == "ex0" and row["method"] == spec  # named with its parameters
    assert row["layer"] == online.selection_layer
    assert row["selected_positions"] == online.kept_positions.tolist()
    assert row["kept_tokens"] == len(row["selected_positions"])
    assert row["budget_tokens"] == make(name, **params).kept_tokens(Budget.from_keep(keep), short_prompt.numel())


def test_lava_offline_kept_entries_are_its_prefill_cache(random_ids):
    from rankkit.cache import PADDING

    runner = _tiny()
    method = make("lava", window_size=4, kernel_size=3)
    captured = _captured(runner, random_ids, [method.probe()])
    for budget in (Budget.from_keep(0.1), Budget.from_keep(0.4)):
        online = method.prefill(runner, random_ids, budget)
        for layer in range(runner.num_layers):
            cached = [
                [p for p in head if p != PADDING] for head in online.result.cache.positions[layer].tolist()
            ]
            assert method.select_offline(captured, budget, layer=layer).as_lists() == cached


def test_the_oracle_methods_offline_face_refuses_an_oracle_made_with_other_settings():
    from types import SimpleNamespace

    from rankkit.eval.offline import missing_inputs

    method = make("oracle", max_new_tokens=16)
    made = {"answer": "generated", "softmax": False, "kernel": 7, "max_new_tokens": 16}
    record = SimpleNamespace(id="a", has_oracle=True, attrs={"oracle_params": made})
    assert missing_inputs(method, record, {}) is None
    for other in ({"kernel": 5}, {"max_new_tokens": 32}, {"softmax": True}, {"answer": "reference"}):
        record.attrs = {"oracle_params": {**made, **other}}
        problem = missing_inputs(method, record, {})
        assert problem.startswith("example 'a' holds an oracle made with") and "\n" not in problem
        assert "rankkit oracle STORE --redo --max-new-tokens 16 --kernel 7" in problem


PROBE_SETTINGS = {"window_size": 16, "kernel_size": 3, "block_size": 32, "unit_size": 4}  # none a default


def _probe_settings() -> list[tuple[str, str]]:
    """(method, setting) for each setting a method's probe shares with it."""
    import dataclasses

    pairs = []
    for name in sorted(REGISTRY):
        probe = getattr(make(name), "probe", lambda: None)()
        if dataclasses.is_dataclass(probe):
            pairs += [(name, spec.name) for spec in dataclasses.fields(probe) if spec.name in PROBE_SETTINGS]
    return pairs


@pytest.mark.parametrize(("name", "setting"), _probe_settings())
def test_a_methods_probe_takes_the_methods_own_settings_of_what_they_share(name, setting):
    """The probe a method scores with (and ``rankkit compare`` reads its store array by) is built from
    the method's settings: one set off its default reaches the probe."""
    value = PROBE_SETTINGS[setting]
    assert getattr(make(name), setting) != value
    assert getattr(make(name, **{setting: value}).probe(), setting) == value


def test_every_probe_setting_of_the_ranking_methods_is_checked():
    assert {name for name, _ in _probe_settings()} >= {"snapkv", "adakv", "lava", "claa", "fastkv", "gemfilter", "sliminfer", "asl"}
