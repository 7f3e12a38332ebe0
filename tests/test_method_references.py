"""Every method against a slow reference written from its paper in plain loops.

Each reference reads only the post-RoPE queries, keys and values a full prefill of a tiny
random model computes, and shares no code with rankkit: its own softmax, pooling and top-k
(by sorting). Ties go to the earlier token (docs/methods.md). The exact positions each
method keeps, from ``prefill`` (what ``rankkit prefill --json`` prints) and from
``select_offline`` (``rankkit select``), per KV head where the method keeps a set per head,
must equal the reference's at keep 0.1, 0.3 and 0.5. The same references are then checked
through the command line: ``rankkit capture`` + ``rankkit select`` and ``rankkit prefill --json``
on the same model saved as a folder and the same tokens given as text, for every registered method.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import pytest
import torch
from conftest import attended_keys_recorder, tiny_model

from rankkit.cache import PADDING
from rankkit.errors import RankkitError
from rankkit.methods import REGISTRY, Budget, Captured, make
from rankkit.methods.selection import DRAFT_SCORES, ORACLE_SCORES
from rankkit.runner import LayerHook, Runner, greedy_continue

LENGTH = 48
KEEPS = [0.1, 0.3, 0.5]


class Recorder(LayerHook):
    """Every layer's prefill Q [q_heads, T, d], K and V [kv_heads, T, d] in float64, and its scaling."""

    def __init__(self):
        self.layers = {}

    def on_attention(self, call):
        if call.phase == "prefill":
            self.layers[call.layer] = (
                call.query[0].double().clone(),
                call.key[0].double().clone(),
                call.value[0].double().clone(),
                call.scaling,
            )


@pytest.fixture(scope="module")
def setup():
    runner = Runner(tiny_model("llama"))
    ids = torch.randint(0, 97, (LENGTH,), generator=torch.Generator().manual_seed(7))
    recorder = Recorder()
    runner.prefill(ids, hooks=[recorder])
    return runner, ids, recorder.layers


# ---- the reference's own arithmetic ---------------------------------------------------------


def softmax(values: list[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


def dot(a, b) -> float:
    return sum(float(x) * float(y) for x, y in zip(a.tolist(), b.tolist(), strict=True))


def pool(row: list[float], kernel: int, how: str) -> list[float]:
    """Stride 1, padding kernel // 2: ``avg`` over the neighbours that exist, ``avg_padded`` over the
    whole kernel (zeros counted), ``max`` over the neighbours that exist."""
    half, out = kernel // 2, []
    for i in range(len(row)):
        neighbours = row[max(0, i - half) : i + half + 1]
        if how == "avg":
            out.append(sum(neighbours) / len(neighbours))
        elif how == "avg_padded":
            out.append(sum(neighbours) / kernel)
        else:
            out.append(max(neighbours))
    return out


def ranked(scores: list[float], forced=()) -> list[int]:
    """Positions from the best down: forced first, then descending score, ties to the earlier token."""
    return sorted(range(len(scores)), key=lambda i: (i not in forced, -scores[i], i))


def top(scores: list[float], k: int, forced=()) -> list[int]:
    return sorted(ranked(scores, set(forced))[:k])


def keep_of(keep: float, floor: int = 1) -> int:
    return min(LENGTH, max(math.ceil(keep * LENGTH), floor))


def heads_of(group: int, q_heads: int, kv_heads: int) -> range:
    size = q_heads // kv_heads
    return range(group * size, (group + 1) * size)


def window_scores(layer, window: int, kernel: int = 7) -> list[list[float]]:
    """CLAA Eq. 2/4/5, ASL Alg. 1: per KV head, the window queries' softmax attention summed over the
    window and the group's query heads, the positions before the window avg-pooled on their own."""
    query, key, _, scaling = layer
    q_heads, kv_heads = query.shape[0], key.shape[0]
    per_head = []
    for g in range(kv_heads):
        summed = [0.0] * LENGTH
        for h in heads_of(g, q_heads, kv_heads):
            for t in range(LENGTH - window, LENGTH):
                probabilities = softmax([dot(query[h, t], key[g, j]) * scaling for j in range(t + 1)])
                for j, p in enumerate(probabilities):
                    summed[j] += p
        past = LENGTH - window
        per_head.append(pool(summed[:past], kernel, "avg") + summed[past:])
    return per_head


def head_sum(per_head: list[list[float]]) -> list[float]:
    return [sum(row[i] for row in per_head) for i in range(LENGTH)]


def window_of(size: int) -> range:
    return range(LENGTH - size, LENGTH)


# ---- what a method gives, through both faces ----------------------------------------------


@dataclass(frozen=True)
class Expected:
    """What the reference says a method keeps: ``selected``, its shared selection at ``layer`` (None for
    KV-only methods, which keep a set per layer and head), and ``caches``, each KV head's cache per
    layer after the prefill (the layers the reference follows)."""

    name: str
    params: dict
    selected: list[int] | None = None
    layer: int | None = None
    caches: dict[int, list[list[int]]] = field(default_factory=dict)

    def method(self):
        return make(self.name, **self.params)

    @property
    def spec(self) -> str:
        """The method as ``--method`` takes it: ``NAME:PARAM=VALUE,...``."""
        given = ",".join(f"{key}={value}" for key, value in self.params.items())
        return f"{self.name}:{given}" if given else self.name


def every_layer(positions: list[int], heads: int = 2) -> dict[int, list[list[int]]]:
    return {layer: [positions] * heads for layer in range(3)}


def cache_sets(run, layer) -> list[list[int]]:
    return [[p for p in head if p != PADDING] for head in run.result.cache.positions[layer].tolist()]


def captured(runner, ids, method) -> Captured:
    from rankkit.probes import ProbeRecorder

    probes = [method.probe()] if method.captured_inputs() else []
    recorder = ProbeRecorder(probes)
    runner.prefill(ids, hooks=[recorder])
    arrays = {key: torch.from_numpy(scores) for key, scores in recorder.scores().items()}
    config = runner.config
    return Captured(
        arrays,
        runner.num_layers,
        LENGTH,
        kv_heads=config.num_key_value_heads,
        query_heads=config.num_attention_heads,
    )


def offline(runner, ids, method, keep, layer=None):
    return method.select_offline(captured(runner, ids, method), Budget.from_keep(keep), layer=layer)


def prefill_keeping(runner, ids, method, keep, expected: list[int]):
    """The method's prefill, after checking that it and ``select`` keep ``expected`` at the selection."""
    run = method.prefill(runner, ids, Budget.from_keep(keep))
    assert run.kept_positions.tolist() == expected
    assert offline(runner, ids, method, keep).positions.tolist() == expected
    return run


class NoTextTokenizer:
    """Tiny models have no tokenizer; the oracle only decodes its answer for display."""

    def decode(self, tokens, **kwargs):
        return ""


# ---- shared selections ----------------------------------------------------------------------


def expected_gemfilter(setup, keep) -> Expected:
    query, key, _, scaling = setup[2][1]
    logits = [
        sum(dot(query[h, -1], key[h // 2, j]) * scaling for h in range(query.shape[0])) for j in range(LENGTH)
    ]
    expected = top(pool(logits, 5, "avg_padded"), keep_of(keep), [LENGTH - 1])
    return Expected("gemfilter", {"routing_layer": 1}, expected, 1, every_layer(expected))


@pytest.mark.parametrize("keep", KEEPS)
def test_gemfilter_keeps_the_top_of_the_head_summed_last_query_logits_avg_pooled_with_kernel_5(setup, keep):
    runner, ids, _ = setup
    expected = expected_gemfilter(setup, keep)
    assert (make("gemfilter").bind(32).routing_layer, make("gemfilter").bind(30).routing_layer) == (15, 14)
    run = prefill_keeping(runner, ids, expected.method(), keep, expected.selected)
    assert all(cache_sets(run, layer) == expected.caches[layer] for layer in range(3))


def expected_fastkv(setup, keep) -> Expected:
    layers = setup[2]
    k = keep_of(keep, 8)
    scores = {layer: window_scores(layers[layer], 8) for layer in (0, 1)}
    expected = top(head_sum(scores[1]), k, window_of(8))
    # Listing 2: kv_cache[l] = top_k_indices of layer l's own scores up to the TSP layer
    caches = {layer: [top(row, k, window_of(8)) for row in scores[layer]] for layer in (0, 1)}
    return Expected("fastkv", {"tsp_layer": 1}, expected, 1, {**caches, 2: [expected, expected]})


@pytest.mark.parametrize("keep", KEEPS)
def test_fastkv_prunes_by_the_head_sum_and_every_layer_to_tsp_caches_its_own_per_head_top_k(setup, keep):
    runner, ids, _ = setup
    expected = expected_fastkv(setup, keep)
    run = prefill_keeping(runner, ids, expected.method(), keep, expected.selected)
    assert {layer: cache_sets(run, layer) for layer in range(3)} == expected.caches


def expected_claa(setup, keep) -> Expected:
    layers = setup[2]
    k = keep_of(keep, 8)
    scores = {layer: window_scores(layers[layer], 8) for layer in (1, 2)}
    sums = [head_sum(scores[layer]) for layer in (1, 2)]
    expected = top([max(a, b) for a, b in zip(*sums, strict=True)], k, window_of(8))
    caches = {0: [list(range(LENGTH))] * 2}  # deferred: m = 1
    for layer in (1, 2):  # Listing 5: compression_indices of the layer's own scores
        caches[layer] = [top(row, k, window_of(8)) for row in scores[layer]]
    params = {"pruning_layer": 2, "aggregation_window": 2, "deferred_layers": 1}
    return Expected("claa", params, expected, 2, caches)


@pytest.mark.parametrize("keep", KEEPS)
def test_claa_prunes_by_the_max_over_its_window_of_layers_and_defers_compression(setup, keep):
    runner, ids, _ = setup
    expected = expected_claa(setup, keep)
    run = prefill_keeping(runner, ids, expected.method(), keep, expected.selected)
    assert run.selection_layer == expected.layer
    assert {layer: cache_sets(run, layer) for layer in range(3)} == expected.caches


@pytest.fixture(scope="module")
def deep_setup():
    """The setup on six layers: room for a buffer that starts after the deferred layers."""
    runner = Runner(tiny_model("llama", layers=6))
    ids = torch.randint(0, 97, (LENGTH,), generator=torch.Generator().manual_seed(7))
    recorder = Recorder()
    runner.prefill(ids, hooks=[recorder])
    return runner, ids, recorder.layers


@pytest.mark.parametrize("keep", [0.3, 0.5])  # at 0.1 the budget is the window alone
def test_claa_aggregates_the_last_n_layers_up_to_pruning_not_every_layer_after_the_deferred(deep_setup, keep):
    """CLAA Listing 5: a deque of maxlen n filled from layer m holds layers l_p-n+1..l_p at l_p."""
    runner, ids, layers = deep_setup
    k = keep_of(keep, 8)
    scores = {layer: window_scores(layers[layer], 8) for layer in range(1, 5)}
    sums = {layer: head_sum(per_head) for layer, per_head in scores.items()}

    def max_over(buffer) -> list[int]:
        return top([max(sums[layer][i] for layer in buffer) for i in range(LENGTH)], k, window_of(8))

    expected = max_over((3, 4))
    assert expected != max_over((1, 2, 3, 4))  # the case tells the buffer's bounds apart
    method = make("claa", pruning_layer=4, aggregation_window=2, deferred_layers=1)
    run = prefill_keeping(runner, ids, method, keep, expected)
    caches = {0: [list(range(LENGTH))] * 2}  # deferred: m = 1
    caches |= {layer: [top(row, k, window_of(8)) for row in scores[layer]] for layer in range(1, 5)}
    caches[5] = [expected, expected]
    assert run.selection_layer == 4
    assert {layer: cache_sets(run, layer) for layer in range(6)} == caches


def reference_rank_variance(sums: dict[int, list[float]], min_layer, observed, top_k, window, tau, last):
    """ASL Alg. 2: the first layer from L_min whose mean rank variance over U, relative to L_min's, is
    below tau (the last layer otherwise), and the relative variance of every layer from L_min."""
    ranks = {}
    for layer, scores in sums.items():
        order = ranked(scores[: len(scores) - window])
        ranks[layer] = {token: place for place, token in enumerate(order)}
    initial, relative, selected = None, {}, None
    for layer in range(min_layer, last + 1):
        rows = [ranks[index] for index in range(max(0, layer - observed + 1), layer + 1)]
        union = [t for t in rows[0] if any(row[t] < top_k for row in rows)]
        variances = []
        for token in union:
            values = [row[token] for row in rows]
            mean = sum(values) / len(values)
            variances.append(sum((v - mean) ** 2 for v in values) / len(values))
        variance = sum(variances) / len(variances)
        initial = variance if initial is None else initial
        relative[layer] = variance / initial if initial > 0 else 0.0
        if selected is None and (relative[layer] < tau or layer == last):
            selected = layer
    return selected, relative


def asl_reference(setup, keep, tau):
    """ASL's selection layer, its kept positions, the relative variance per layer and the per-head
    top-k of every layer (Alg. 1 compresses each layer up to the selection to its own)."""
    k = keep_of(keep, 5)  # the window and at least one ranked token
    layer, selected, relative = reference_asl_at(setup, k, tau)
    own = {index: [top(row, k, window_of(4)) for row in window_scores(setup[2][index], 4)] for index in range(3)}
    return layer, selected, relative, own


def expected_asl(setup, keep, tau=0.3, name="asl") -> Expected:
    layer, expected, _, own = asl_reference(setup, keep, tau)
    params = {"window_size": 4, "min_layer": 1, "observed_layers": 2, "tau": tau}
    # one pass: each layer up to the selection keeps its own top-k, the later ones the selection;
    # two passes: only the selection goes through every layer
    caches = {index: own[index] if index <= layer else [expected] * 2 for index in range(3)}
    return Expected(name, params, expected, layer, caches if name == "asl" else every_layer(expected))


@pytest.mark.parametrize("keep", KEEPS)
@pytest.mark.parametrize("tau", [0.3, 1e-9])
def test_asl_selects_at_alg_2s_layer_and_keeps_its_top_k_plus_the_window(setup, keep, tau):
    runner, ids, _ = setup
    for name in ("asl", "asl-2pass"):
        expected = expected_asl(setup, keep, tau, name)
        method = expected.method()
        run = method.prefill(runner, ids, Budget.from_keep(keep))
        assert (run.selection_layer, run.kept_positions.tolist()) == (expected.layer, expected.selected)
        selection = offline(runner, ids, method, keep)
        assert (selection.layer, selection.positions.tolist()) == (expected.layer, expected.selected)
        assert {layer: cache_sets(run, layer) for layer in range(3)} == expected.caches
    _, _, relative, _ = asl_reference(setup, keep, tau)
    curve = make("asl", window_size=4, min_layer=1, observed_layers=2).variance_curve(
        captured(runner, ids, make("asl", window_size=4)), Budget.from_keep(keep)
    )
    assert math.isnan(curve[0]) and curve[1:] == pytest.approx([relative[1], relative[2]], rel=1e-12)


def test_asl_below_its_window_ranks_one_token_as_at_the_budget_w_plus_1(setup):
    """Alg. 2's k = budget - W: a budget of 1 gave k <= 0, an empty union and a variance of 0/0 read
    as settled, a selection layer and a flat curve made up; it now rounds up to W + 1, as the window does."""
    runner, ids, _ = setup
    method = make("asl", window_size=4, min_layer=1, observed_layers=2)
    layer, expected, relative = reference_asl_at(setup, 5)
    for budget in (Budget.from_tokens(1), Budget.from_tokens(4), Budget.from_tokens(5)):
        run = method.prefill(runner, ids, budget)
        assert (run.selection_layer, run.kept_positions.tolist()) == (layer, expected)
        curve = method.variance_curve(captured(runner, ids, make("asl", window_size=4)), budget)
        assert curve[1:] == pytest.approx([relative[1], relative[2]], rel=1e-12) and relative[2] != 0


def reference_asl_at(setup, kept_tokens, tau=0.3):
    """ASL's selection layer, its kept positions and relative variances, keeping ``kept_tokens``."""
    layers = setup[2]
    scores = {layer: window_scores(layers[layer], 4) for layer in range(3)}
    sums = {layer: head_sum(scores[layer]) for layer in range(3)}
    layer, relative = reference_rank_variance(sums, 1, 2, kept_tokens - 4, 4, tau, 2)
    return layer, top(sums[layer], kept_tokens, window_of(4)), relative


def test_asl_alg_2_reads_zero_variance_at_l_min_as_settled_and_ranks_ties_by_token_order():
    from rankkit.methods.asl import RankVariance

    # tokens 1 and 2 tie: token 1 ranks first; identical rankings at L_min: variance 0, relative 0
    tied = torch.tensor([[3.0, 5.0, 5.0, 1.0, 9.0]])
    policy = RankVariance(tau=0.3, min_layer=1, observed_layers=2, top_k=2, window=1, last_layer=4)
    assert policy.decide(0, tied) is None
    assert policy._ranks(tied.sum(0)).tolist() == [2.0, 0.0, 1.0, 3.0]
    assert policy.decide(1, tied) is not None and policy.relative_variance == {1: 0.0}
    # hand-computed: ranks [0,1,2,3] then [3,2,1,0]; U = every token; variances 2.25, 0.25, 0.25, 2.25
    first, second = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]), torch.tensor([[1.0, 2.0, 3.0, 4.0, 0.0]])
    policy = RankVariance(tau=0.3, min_layer=1, observed_layers=2, top_k=2, window=1, last_layer=4)
    policy.decide(0, first)
    assert policy.decide(1, second) is None and policy.initial_variance == 1.25
    assert policy.decide(2, second) is not None and policy.relative_variance == {1: 1.0, 2: 0.0}


def expected_sliminfer(setup, keep) -> Expected:
    query, key, _, _ = setup[2][1]
    q_heads, kv_heads = query.shape[0], key.shape[0]
    mean_query = [query[h, -2:].mean(dim=0) for h in range(q_heads)]  # q_l, window w = 2
    block_score = {}
    for block in range(LENGTH // 8):
        unit_scores = []
        for unit in range(block * 8, block * 8 + 8, 2):
            per_head = [
                dot(mean_query[h], key[h * kv_heads // q_heads, unit : unit + 2].mean(dim=0))
                for h in range(q_heads)
            ]
            unit_scores.append(sum(per_head) / q_heads)  # Eq. 1: the unit's mean key; Eq. 2: head mean
        block_score[block] = max(unit_scores)
    blocks = math.ceil(min(LENGTH, keep_of(keep, 8) * 2) / 8)  # the first of two pruning layers: 2x
    others = sorted((b for b in block_score if b), key=lambda b: (-block_score[b], b))[: blocks - 1]
    expected = [p for p in range(LENGTH) if p // 8 in {0, *others}]
    # the pruning layers default to (1, 2) on three layers
    return Expected("sliminfer", {"block_size": 8, "unit_size": 2, "window_size": 2}, expected, 1)


@pytest.mark.parametrize("keep", KEEPS)
def test_sliminfer_keeps_the_first_block_and_the_best_blocks_by_eq_1_2(setup, keep):
    runner, ids, _ = setup
    expected = expected_sliminfer(setup, keep)
    assert expected.method().bind(3).pruning_layers == (1, 2)
    run = prefill_keeping(runner, ids, expected.method(), keep, expected.selected)
    assert run.selection_layer == expected.layer


def oracle_ranking(setup) -> torch.Tensor:
    """The oracle's per-token ranking (its answer's attention; tested against its own reference in
    tests/test_oracle.py), the one input of its selection."""
    runner, ids, _ = setup
    method = make("oracle", pruning_layer=1, max_new_tokens=4)
    method.prepare(runner, ids, tokenizer=NoTextTokenizer())
    return method.ranking


def expected_oracle(setup, keep) -> Expected:
    expected = top(oracle_ranking(setup).tolist(), keep_of(keep, 8), window_of(8))
    return Expected("oracle", {"pruning_layer": 1, "max_new_tokens": 4}, expected, 1)


@pytest.mark.parametrize("keep", KEEPS)
def test_oracle_keeps_the_top_of_its_ranking_with_the_mirrors_window(setup, keep):
    runner, ids, _ = setup
    expected = expected_oracle(setup, keep)
    method = expected.method()
    method.prepare(runner, ids, tokenizer=NoTextTokenizer())
    assert method.prefill(runner, ids, Budget.from_keep(keep)).kept_positions.tolist() == expected.selected
    stored = Captured({ORACLE_SCORES: method.ranking}, 3, LENGTH)
    assert method.select_offline(stored, Budget.from_keep(keep)).positions.tolist() == expected.selected


LOOKAHEAD = 8  # SpecPrefill's default k, the one a capture's draft scores hold


def expected_specprefill(setup, keep) -> Expected:
    runner, ids, _ = setup
    draft_calls = []

    class DraftRecorder(LayerHook):
        def on_attention(self, call):
            if call.phase == "decode":
                draft_calls.append(
                    (call.query[0, :, -1].double(), call.key[0, :, :LENGTH].double(), call.scaling)
                )

    from rankkit.methods.specprefill import draft_runner

    draft = draft_runner(make("specprefill").bind(3).draft_model, runner)
    greedy_continue(draft, draft.prefill(ids), LOOKAHEAD, [DraftRecorder()], feed_last=True)
    per_query = []
    for step in range(LOOKAHEAD):  # Eq. 3: max over the draft's layers and heads, mean over the k queries
        calls = draft_calls[step * draft.num_layers : (step + 1) * draft.num_layers]
        per_query.append(
            [
                max(dot(q[h], k[h // 2, j]) * s for q, k, s in calls for h in range(q.shape[0]))
                for j in range(LENGTH)
            ]
        )
    scores = [sum(row[j] for row in per_query) / LOOKAHEAD for j in range(LENGTH)]
    expected = top(scores, keep_of(keep), [LENGTH - 1])
    # two passes: only the selection goes through every layer; the draft selects before any layer
    return Expected("specprefill", {}, expected, None, every_layer(expected))


@pytest.mark.parametrize("keep", KEEPS)
def test_specprefill_keeps_the_top_of_eq_3_over_the_drafts_lookahead_queries(setup, keep):
    runner, ids, _ = setup
    expected = expected_specprefill(setup, keep)
    method = expected.method()
    assert method.lookahead == LOOKAHEAD
    run = method.prefill(runner, ids, Budget.from_keep(keep))
    assert run.kept_positions.tolist() == expected.selected
    assert {layer: cache_sets(run, layer) for layer in range(3)} == expected.caches
    lookahead, _ = method.draft_scores(runner, ids)
    stored = Captured({DRAFT_SCORES: lookahead}, 3, LENGTH)
    assert method.select_offline(stored, Budget.from_keep(keep)).positions.tolist() == expected.selected


def test_specprefill_refuses_a_draft_with_another_tokenizer_in_one_line(tiny_folder):
    from rankkit.methods.specprefill import draft_runner

    target = Runner(tiny_model("llama"))  # 97 tokens; the draft has the default model's tokenizer
    with pytest.raises(
        RankkitError, match=r"vocabulary of \d+ tokens, the target 97.*--draft layers:N"
    ) as error:
        draft_runner(str(tiny_folder), target)
    assert "\n" not in str(error.value)


# ---- KV-only methods: a set per layer and KV head --------------------------------------------


def check_kv_only(setup, keep, expected: Expected):
    """A KV-only method's prefill caches and its offline per-layer sets are the reference's."""
    runner, ids, _ = setup
    method = expected.method()
    run = method.prefill(runner, ids, Budget.from_keep(keep))
    stored = captured(runner, ids, method)
    for layer, heads in expected.caches.items():
        assert [sorted(head) for head in cache_sets(run, layer)] == heads
        assert method.select_offline(stored, Budget.from_keep(keep), layer=layer).as_lists() == heads
    return run


def expected_snapkv(setup, keep) -> Expected:
    k = keep_of(keep, 8)
    caches = {
        layer: [top(row, k, window_of(8)) for row in window_scores(setup[2][layer], 8)] for layer in range(3)
    }
    return Expected("snapkv", {"window_size": 8}, caches=caches)


@pytest.mark.parametrize("keep", KEEPS)
def test_snapkv_every_layer_keeps_each_heads_top_k_and_the_window(setup, keep):
    check_kv_only(setup, keep, expected_snapkv(setup, keep))


def pyramid_counts(k: int, window: int, beta: float, layers: int) -> list[int]:
    """PyramidKV: beyond the window, layer counts fall in an arithmetic sequence from the first layer to
    the last, whose count is 1/beta of their mean (the first capped at the tokens there are)."""
    mean = k - window
    last = mean / beta
    first = 2 * mean - last
    if first > LENGTH - window:
        first = LENGTH - window
        last = 2 * mean - first
    return [round(first - (first - last) * layer / (layers - 1)) + window for layer in range(layers)]


def expected_pyramidkv(setup, keep) -> Expected:
    counts = pyramid_counts(keep_of(keep, 8), 8, 20.0, 3)
    caches = {
        layer: [top(row, counts[layer], window_of(8)) for row in window_scores(setup[2][layer], 8)]
        for layer in range(3)
    }
    return Expected("pyramidkv", {"window_size": 8}, caches=caches)


@pytest.mark.parametrize("keep", KEEPS)
def test_pyramidkv_every_layer_keeps_each_heads_top_of_its_own_shrinking_count(setup, keep):
    # by hand at keep 0.3 (15 of 48, 7 beyond the window): 13.65, 7.0, 0.35 -> 14, 7, 0 beyond the window
    assert pyramid_counts(15, 8, 20.0, 3) == [22, 15, 8]
    check_kv_only(setup, keep, expected_pyramidkv(setup, keep))


def expected_adakv(setup, keep, safeguard=0.2) -> Expected:
    """AdaKV: the window and each head's best int(safeguard x (k - window)) others, then the best of the
    layer's entries over all heads up to heads x k, ties to the earlier head, then the earlier token."""
    k = keep_of(keep, 8)
    caches = {}
    for layer in range(3):
        rows = window_scores(setup[2][layer], 8)
        guaranteed = int(safeguard * (k - 8))
        chosen = set()
        for head, row in enumerate(rows):
            chosen |= {(head, i) for i in window_of(8)}
            chosen |= {(head, i) for i in ranked(row[: LENGTH - 8])[:guaranteed]}
        rest = sorted(
            ((head, i) for head in range(len(rows)) for i in range(LENGTH) if (head, i) not in chosen),
            key=lambda entry: (-rows[entry[0]][entry[1]], entry[0], entry[1]),
        )
        chosen |= set(rest[: len(rows) * k - len(chosen)])
        caches[layer] = [sorted(i for h, i in chosen if h == head) for head in range(len(rows))]
    return Expected("adakv", {"window_size": 8}, caches=caches)


@pytest.mark.parametrize("keep", KEEPS)
def test_adakv_every_layer_shares_its_heads_budget_by_the_best_entries_after_each_heads_safeguard(setup, keep):
    expected = expected_adakv(setup, keep)
    if keep_of(keep, 8) > 8:  # beyond the window the heads' shares really differ
        assert any(len(heads[0]) != len(heads[1]) for heads in expected.caches.values())
    check_kv_only(setup, keep, expected)


def expected_tova(setup, keep) -> Expected:
    """TOVA: the last query's softmax attention summed over every head of the layer, its top-k with the
    last token kept, the same set in every KV head."""
    caches = {}
    for layer in range(3):
        query, key, _, scaling = setup[2][layer]
        summed = [0.0] * LENGTH
        for h in range(query.shape[0]):
            attention = softmax([dot(query[h, -1], key[h // 2, j]) * scaling for j in range(LENGTH)])
            summed = [a + b for a, b in zip(summed, attention, strict=True)]
        caches[layer] = [top(summed, keep_of(keep), [LENGTH - 1])] * 2
    return Expected("tova", {}, caches=caches)


@pytest.mark.parametrize("keep", KEEPS)
def test_tova_every_layer_keeps_the_top_of_the_last_querys_attention_over_all_heads(setup, keep):
    check_kv_only(setup, keep, expected_tova(setup, keep))


def expected_streamingllm(setup, keep) -> Expected:
    k = keep_of(keep, 5)
    return Expected("streamingllm", {}, caches=every_layer([0, 1, 2, 3, *range(LENGTH - (k - 4), LENGTH)]))


@pytest.mark.parametrize("keep", KEEPS)
def test_streamingllm_keeps_sinks_and_a_window_that_rolls_in_decoding(setup, keep):
    runner, ids, _ = setup
    k = keep_of(keep, 5)
    expected = expected_streamingllm(setup, keep).caches[0][0]
    method = make("streamingllm")
    run = method.prefill(runner, ids, Budget.from_keep(keep))
    assert all(cache_sets(run, layer) == [expected, expected] for layer in range(3))
    assert offline(runner, ids, method, keep, layer=1).as_lists() == [expected, expected]  # a set per KV head
    tiny = method.prefill(runner, ids, Budget.from_tokens(2))  # raised to the sinks and the last token
    assert all(cache_sets(tiny, layer) == [[0, 1, 2, 3, LENGTH - 1]] * 2 for layer in range(3))
    attended = attended_keys_recorder()
    greedy_continue(runner, run.result, 5, [attended])  # the 4 tokens fed back: positions 48..51
    # each step sees the sinks, the window's k - 4 tokens and its own; the cache holds what the
    # last one saw, and the next token takes the oldest's slot
    for step, position in enumerate(range(LENGTH, LENGTH + 4)):
        rolled = [0, 1, 2, 3, *range(position - (k - 4), position + 1)]
        assert all(heads == [rolled, rolled] for heads in attended.steps[step].values())
    assert all(sorted(head) == rolled for layer in range(3) for head in cache_sets(run, layer))


def sage_reference(layer, budget: int) -> list[list[int]]:
    """SAGE-KV Steps 1-3, Appendix A.2's split: per query head the top-k of E by the last token's softmax."""
    query, key, _, scaling = layer
    q_heads, kv_heads = query.shape[0], key.shape[0]
    group = q_heads // kv_heads
    sinks, per_head = budget // 4, budget // (2 * group)
    recent = max(1, budget - sinks - group * per_head)
    evicted = list(range(sinks, LENGTH - recent))
    kept = []
    for g in range(kv_heads):
        chosen = set(range(sinks)) | set(range(LENGTH - recent, LENGTH))
        for h in heads_of(g, q_heads, kv_heads):
            attention = softmax([dot(query[h, -1], key[g, j]) * scaling for j in range(LENGTH)])
            chosen |= set(sorted(evicted, key=lambda i: (-attention[i], i))[:per_head])
        kept.append(sorted(chosen))
    return kept


def expected_sage_kv(setup, keep) -> Expected:
    budget = keep_of(keep, 2)
    return Expected("sage-kv", {}, caches={layer: sage_reference(setup[2][layer], budget) for layer in range(3)})


@pytest.mark.parametrize("keep", KEEPS)
def test_sage_kv_keeps_the_union_of_its_query_heads_top_k_and_rolls_the_recent_window(setup, keep):
    runner, _, _ = setup
    budget = keep_of(keep, 2)
    expected = expected_sage_kv(setup, keep)
    run = check_kv_only(setup, keep, expected)
    attended = attended_keys_recorder()
    greedy_continue(runner, run.result, 5, [attended])  # Step 4: positions 48..51 roll the window on
    recent = max(1, budget - budget // 4 - 2 * (budget // 4))
    for step, position in enumerate(range(LENGTH, LENGTH + 4)):
        for layer in range(3):  # a step sees the kept entries, the last recent tokens and its own
            rolled = [
                [p for p in head if p < LENGTH - recent] + list(range(position - recent, position + 1))
                for head in expected.caches[layer]
            ]
            assert attended.steps[step][layer] == rolled
            if step == 3:  # the cache holds what the last step saw
                assert [sorted(head) for head in cache_sets(run, layer)] == rolled


def lava_scores(layer, window: int) -> list[list[float]]:
    """LAVa Eq. 5 per KV head: the largest value L1 norm / w x the window's softmax attention, max-pooled
    with kernel 7 before the window, max over the group's query heads (Sec. 4.3)."""
    query, key, value, scaling = layer
    q_heads, kv_heads = query.shape[0], key.shape[0]
    rows = []
    for g in range(kv_heads):
        norm = max(sum(abs(float(x)) for x in value[g, j].tolist()) for j in range(LENGTH))
        per_head = []
        for h in heads_of(g, q_heads, kv_heads):
            summed = [0.0] * LENGTH
            for t in range(LENGTH - window, LENGTH):
                for j, p in enumerate(softmax([dot(query[h, t], key[g, j]) * scaling for j in range(t + 1)])):
                    summed[j] += p
            scaled = [norm / window * s for s in summed]
            past = LENGTH - window
            per_head.append(pool(scaled[:past], 7, "max") + scaled[past:])
        rows.append([max(row[i] for row in per_head) for i in range(LENGTH)])
    return rows


def lava_entropy(rows: list[list[float]], window: int) -> float:
    """Eq. 6-7: the normalised entropy of the layer's scores outside the window."""
    entries = [s for row in rows for s in row[: LENGTH - window]]
    total = sum(entries)
    return -sum(s / total * math.log(s / total) for s in entries if s > 0) / len(entries)


def test_lava_eq_6_7_budgets_on_a_hand_computed_three_layer_example():
    from rankkit.methods.lava import layer_budgets, normalized_entropy

    assert normalized_entropy(torch.ones(2, 2)) == pytest.approx(math.log(4) / 4)
    assert normalized_entropy(torch.tensor([[1.0, 0.0], [0.0, 0.0]])) == 0.0
    inf = float("inf")
    # 3 layers, 2 heads, 6 tokens, window 2: each layer has 8 entries outside the window
    layer = torch.tensor([[1.0, 2, 3, 4, inf, inf], [4.0, 3, 2, 1, inf, inf]])
    # 𝔹 = (keep 4 - w 2) x 2 heads x 3 layers = 12, by entropy 0.5 : 0.3 : 0.2 = 6 : 3.6 : 2.4;
    # whole entries 6, 3, 2 and the last one to the largest remainder (0.6): 6, 4, 2; plus 4 window entries
    assert layer_budgets([layer] * 3, [0.5, 0.3, 0.2], 4, 2, 3) == [10, 8, 6]
    # 𝔹 = 18: 16.2 for the first layer passes its 8 entries outside the window; the other 10 are shared
    assert layer_budgets([layer] * 3, [0.9, 0.05, 0.05], 5, 2, 3) == [12, 9, 9]


def largest_remainder(total: int, weights: list[float]) -> list[int]:
    exact = [total * w / sum(weights) for w in weights]
    whole = [math.floor(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: -(exact[i] - whole[i]))[: total - sum(whole)]:
        whole[i] += 1
    return whole


def expected_lava(setup, keep) -> Expected:
    layers = setup[2]
    window = 8
    k = keep_of(keep, window)
    scores = [lava_scores(layers[layer], window) for layer in range(3)]
    entropy = [lava_entropy(rows, window) for rows in scores]
    shares = largest_remainder((k - window) * 2 * 3, entropy)  # no layer reaches its 80 entries here
    caches = {}
    for layer in range(3):
        entries = [(h, i) for h in range(2) for i in range(LENGTH - window)]  # flattened head-major
        best = sorted(entries, key=lambda e: (-scores[layer][e[0]][e[1]], e[0] * LENGTH + e[1]))[
            : shares[layer]
        ]
        caches[layer] = [
            sorted([i for h, i in best if h == head] + list(window_of(window))) for head in range(2)
        ]
    return Expected("lava", {"window_size": window}, caches=caches)


@pytest.mark.parametrize("keep", KEEPS)
def test_lava_keeps_each_layers_entropy_budget_of_its_best_entries_outside_the_window(setup, keep):
    check_kv_only(setup, keep, expected_lava(setup, keep))


def test_a_rolling_window_overwrites_the_oldest_entry_after_the_sinks_once_the_layer_is_full():
    from rankkit.cache import KVCache

    cache = KVCache(2)
    kept = [torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2, 5, 6])]  # layer 0 holds fewer

    def step(positions):
        for layer, layer_positions in enumerate(positions):
            cache.begin_step(layer_positions)
            values = layer_positions.float()[None, None, :, None].expand(1, 2, -1, 3).clone()
            cache.update(values, -values, layer)

    step(kept)
    for layer in range(2):  # StreamingLLM's capacity 5 with 2 sinks: a window of 3, 4 with a step's token
        cache.keep_recent_window(layer, 4, 6)
    step([torch.tensor([9])] * 2)
    assert cache.positions[0].tolist() == [[0, 1, 2, 9]] * 2  # below capacity: appended
    assert cache.positions[1].tolist() == [[0, 1, 2, 5, 6, 9]] * 2  # full now: nothing evicted yet
    twin = cache.fork()
    step([torch.tensor([10])] * 2)
    assert cache.positions[0].tolist() == [[0, 1, 2, 9, 10]] * 2
    assert cache.positions[1].tolist() == [[0, 1, 10, 5, 6, 9]] * 2  # 2 is no sink: the oldest after them
    assert cache.keys[1][0, :, 2, 0].tolist() == [10.0, 10.0] and cache.values[1][0, :, 2, 0].tolist() == [
        -10.0,
        -10.0,
    ]
    assert twin.positions[1].tolist() == [[0, 1, 2, 5, 6, 9]] * 2  # a fork's entries are its own
    for position, expected in ((11, [0, 1, 10, 11, 6, 9]), (12, [0, 1, 10, 11, 12, 9]), (13, [0, 1, 10, 11, 12, 13])):
        step([torch.tensor([position])] * 2)
        assert cache.positions[1].tolist() == [expected] * 2  # the ring of slots 2-5 wraps
    assert cache.positions[0].tolist() == [[0, 1, 12, 13, 10, 11]] * 2  # full at 11; then 2 and 9 went
    with pytest.raises(ValueError, match="which it holds"):
        cache.keep_recent_window(1, 4, 6)


# ---- the same references through the command line --------------------------------------------


def expected_full(setup, keep) -> Expected:
    return Expected("full", {}, caches=every_layer(list(range(LENGTH))))


REFERENCES = {
    "full": expected_full,
    "gemfilter": expected_gemfilter,
    "fastkv": expected_fastkv,
    "claa": expected_claa,
    "asl": expected_asl,
    "asl-2pass": lambda setup, keep: expected_asl(setup, keep, name="asl-2pass"),
    "sliminfer": expected_sliminfer,
    "oracle": expected_oracle,
    "specprefill": expected_specprefill,
    "snapkv": expected_snapkv,
    "pyramidkv": expected_pyramidkv,
    "adakv": expected_adakv,
    "tova": expected_tova,
    "streamingllm": expected_streamingllm,
    "sage-kv": expected_sage_kv,
    "lava": expected_lava,
}
_computed: dict[tuple[str, float], Expected] = {}


def reference(setup, name: str, keep: float) -> Expected:
    """``REFERENCES[name]`` at ``keep``, computed once per module (the references are slow)."""
    if (name, keep) not in _computed:
        _computed[name, keep] = REFERENCES[name](setup, keep)
    return _computed[name, keep]


def rankkit(*args) -> tuple[int, str, str]:
    """``rankkit ARGS`` in this process through the CLI's entry point: (exit status, stdout, stderr)."""
    import contextlib
    import io
    import signal
    import sys
    import warnings

    from rankkit.cli import main

    out, err, status = io.StringIO(), io.StringIO(), 0
    argv = sys.argv
    # main ignores interrupts once it has finished, for the rest of its process: here, the tests'
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    sys.argv = ["rankkit", *map(str, args)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            main()
    except SystemExit as exit_status:
        status = exit_status.code or 0
    finally:
        sys.argv = argv
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    return status, out.getvalue(), err.getvalue()


def word_tokenizer(words: list[str]):
    """A whitespace tokenizer whose token ``words[i]`` is id i, without special tokens or chat template."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(WordLevel({word: index for index, word in enumerate(words)}, unk_token=words[0]))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


WORDS = [f"w{index}" for index in range(97)]  # one word per id of the tiny models' vocabulary


@pytest.fixture(scope="module")
def command_line(setup, tmp_path_factory):
    """The references' model saved as a folder with a word tokenizer, the references' tokens as a JSONL
    example (so the prompt is those 48 tokens), and a store of it captured by ``rankkit capture`` with
    every probe the references' methods rank by, the oracle and the draft's lookahead scores."""
    runner, ids, _ = setup
    root = tmp_path_factory.mktemp("references-cli")
    folder = root / "model"
    runner.model.save_pretrained(folder)
    word_tokenizer(WORDS).save_pretrained(folder)
    words = [WORDS[token] for token in ids.tolist()]
    data = root / "prompt.jsonl"
    record = {"id": "ex0", "context": " ".join(words[:40]), "question": " ".join(words[40:]), "answers": ["w1"]}
    data.write_text(json.dumps(record) + "\n")
    probes = set()
    for name in REFERENCES:
        method = reference(setup, name, KEEPS[0]).method()
        if name != "full":
            probes |= {key for key in method.captured_inputs() if key not in (ORACLE_SCORES, DRAFT_SCORES)}
    store = root / "store.zarr"
    status, _, error = rankkit(
        "capture", "--model", folder, "--data", data, "--out", store, "--probes", ",".join(sorted(probes)),
        "--oracle", "--max-new-tokens", 4, "--draft", "layers:1", "--device", "cpu", "--json",
    )  # fmt: skip
    assert status == 0, error
    return folder, data, store


def prefill_json(command_line, spec: str, keep: float) -> dict:
    folder, data, _ = command_line
    budget = [] if spec == "full" else ["--keep", keep]  # full keeps every token: a budget is refused
    status, out, error = rankkit(
        "prefill", "--model", folder, "--data", data, "--method", spec, *budget, "--json",
        "--kept-layers", "0,1,2", "--max-new-tokens", 1, "--warmup", 0, "--repeats", 1, "--device", "cpu",
    )  # fmt: skip
    assert status == 0, error
    return json.loads(out)


def select_json(command_line, spec: str, keep: float, *layer) -> dict:
    status, out, error = rankkit("select", command_line[2], "--method", spec, "--keep", keep, *layer, "--json")
    assert status == 0, error
    (row,) = json.loads(out)
    return row


@pytest.mark.parametrize("keep", KEEPS)
@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_rankkit_select_and_prefill_json_keep_the_references_positions(setup, command_line, name, keep):
    assert name in REFERENCES, f"method {name!r} has no reference: add one to REFERENCES"
    expected = reference(setup, name, keep)
    from rankkit import stores

    assert stores.open(command_line[2]).example("ex0").tokens[:].tolist() == setup[1].tolist()
    payload = prefill_json(command_line, expected.spec, keep)
    assert (payload["length"], payload["selected_positions"]) == (LENGTH, expected.selected)
    if expected.selected is not None:
        assert payload["selection_layer"] == expected.layer
    kept = payload["kept_positions_by_layer"]
    for layer, heads in expected.caches.items():
        assert [sorted(head) for head in kept[str(layer)]] == heads, layer
    if name == "full":  # it keeps everything: nothing a store holds ranks it
        status, out, error = rankkit("select", command_line[2], "--method", "full", "--keep", keep)
        assert (status, out) == (2, "") and error.count("\n") == 1 and "no offline face" in error
    elif expected.selected is not None:
        row = select_json(command_line, expected.spec, keep)
        assert (row["layer"], row["selected_positions"]) == (expected.layer, expected.selected)
        assert row["kept_tokens"] == len(expected.selected)
    else:
        for layer, heads in expected.caches.items():
            chosen = select_json(command_line, expected.spec, keep, "--layer", layer)["selected_positions"]
            assert chosen == heads, layer  # a set per KV head, as the cache holds


def model_folder(setup, path, words: list[str]):
    """The references' model saved at ``path`` with the word tokenizer of ``words``."""
    setup[0].model.save_pretrained(path)
    word_tokenizer(words).save_pretrained(path)
    return path


def test_a_draft_whose_tokenizer_reads_an_id_otherwise_is_refused_in_one_line_before_any_work(
    setup, command_line, tmp_path, monkeypatch
):
    from rankkit import models

    swapped = [*WORDS]
    swapped[3], swapped[5] = swapped[5], swapped[3]  # the same 97 tokens, two of them at each other's id
    draft = model_folder(setup, tmp_path / "swapped", swapped)
    target, data, _ = command_line

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the draft was checked")

    monkeypatch.setattr(models, "load", no_weights)
    line = (
        f"rankkit: error: draft model '{draft}' reads token id 3 as 'w5', the target as 'w3': "
        "name a draft with the target's tokenizer, or --draft layers:N\n"
    )
    common = ("--model", target, "--data", data, "--draft", draft, "--device", "cpu")
    out = tmp_path / "store.zarr"
    for command in (
        ("prefill", "--method", "specprefill", "--keep", 0.3, "--json", *common),
        ("bench", "--methods", "specprefill", "--keep", 0.3, "--out", tmp_path / "bench.parquet", *common),
        ("capture", "--out", out, "--probes", "window", *common),
    ):
        assert rankkit(*command) == (2, "", line), command[0]
    assert not out.exists() and not (tmp_path / "bench.parquet").exists()
    with_eos = word_tokenizer(WORDS)
    with_eos.add_special_tokens({"eos_token": "w96"})
    assert models.tokenizer_difference(with_eos, word_tokenizer(WORDS)) == "has eos_token 'w96', the target None"


def test_a_draft_with_the_targets_tokenizer_in_another_folder_drafts_as_the_targets_own_layers(
    setup, command_line, tmp_path
):
    draft = model_folder(setup, tmp_path / "copy", WORDS)  # the same weights and tokenizer, elsewhere
    own = prefill_json(command_line, "specprefill:draft_model=layers:3", 0.3)
    copied = prefill_json(command_line, f"specprefill:draft_model={draft}", 0.3)
    assert copied["selected_positions"] == own["selected_positions"]
    assert len(own["selected_positions"]) == keep_of(0.3)
