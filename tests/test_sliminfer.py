"""SlimInfer's offline faces (``select_offline`` for ``rankkit select``, ``layer_rankings`` for
``rankkit compare``) against a slow reference of its Eq. 1-2 block scoring in plain loops.

The reference reads the post-RoPE queries and keys a full prefill of a tiny random model
computes and shares no code with rankkit: blocks of 8 positions, units of 2, a query window
of 2, on a prompt whose last block is short (44 = 5 x 8 + 4).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_model

from rankkit.errors import RankkitError
from rankkit.methods import Budget, Captured, make
from rankkit.runner import GLOBAL_ATTENTION, SLIDING_ATTENTION, LayerHook, Runner

LENGTH = 44
BLOCK, UNIT, WINDOW = 8, 2, 2
PARAMS = {"block_size": BLOCK, "unit_size": UNIT, "window_size": WINDOW}


class Recorder(LayerHook):
    """Every layer's prefill Q [q_heads, T, d] and K [kv_heads, T, d] in float64."""

    def __init__(self):
        self.layers = {}

    def on_attention(self, call):
        if call.phase == "prefill":
            self.layers[call.layer] = (call.query[0].double().clone(), call.key[0].double().clone())


@pytest.fixture(scope="module")
def setup():
    """The queries and keys of each layer, and the ``token_units`` scores a store captures."""
    from rankkit.probes import ProbeRecorder

    runner = Runner(tiny_model("llama"))
    ids = torch.randint(0, 97, (LENGTH,), generator=torch.Generator().manual_seed(11))
    recorder, probes = Recorder(), ProbeRecorder([make("sliminfer", **PARAMS).probe()])
    runner.prefill(ids, hooks=[recorder, probes])
    arrays = {key: torch.from_numpy(scores) for key, scores in probes.scores().items()}
    return recorder.layers, Captured(arrays, runner.num_layers, LENGTH)


def dot(a, b) -> float:
    return sum(float(x) * float(y) for x, y in zip(a.tolist(), b.tolist(), strict=True))


def reference_block_scores(query, key) -> list[float]:
    """Eq. 2: r(B_j) = max over the units m of B_j of (1/H) sum_h q_l^h . k_rep(j, m), where q_l^h is
    the mean of head h's last w queries and k_rep (Eq. 1) the mean of the unit's keys, read
    through the KV head of h's group."""
    q_heads, kv_heads = query.shape[0], key.shape[0]
    mean_query = [sum(query[h, t] for t in range(LENGTH - WINDOW, LENGTH)) / WINDOW for h in range(q_heads)]
    scores = []
    for start in range(0, LENGTH, BLOCK):
        units = []
        for unit in range(start, min(start + BLOCK, LENGTH), UNIT):
            members = range(unit, min(unit + UNIT, LENGTH))
            per_head = []
            for h in range(q_heads):
                group = h // (q_heads // kv_heads)
                unit_key = sum(key[group, p] for p in members) / len(members)
                per_head.append(dot(mean_query[h], unit_key))
            units.append(sum(per_head) / q_heads)
        scores.append(max(units))
    return scores


def reference_kept(scores: list[float], keep_tokens: int) -> list[int]:
    """The first block and the best others (ties to the earlier block), ceil(keep / block) blocks in all."""
    count = max(1, math.ceil(keep_tokens / BLOCK))
    others = sorted(range(1, len(scores)), key=lambda b: (-scores[b], b))[: count - 1]
    return [p for p in range(LENGTH) if p // BLOCK in {0, *others}]


# pruning layers (1, 2) on three layers; the first keeps 2x the budget
# (a budget under one block is raised to it: keep 0.1 of 44 is 5 tokens, 8 with the sink block)
@pytest.mark.parametrize(
    ("budget", "first_keeps"),
    [(Budget(keep=0.1), 16), (Budget(keep=0.3), 28), (Budget(tokens=12), 24), (Budget(keep=0.5), LENGTH)],
)
def test_offline_faces_rank_and_keep_blocks_by_eq_1_2_at_the_first_pruning_layer(setup, budget, first_keeps):
    layers, captured = setup
    method = make("sliminfer", **PARAMS)
    expected_scores = reference_block_scores(*layers[1])

    rankings = method.layer_rankings(captured, budget)
    assert list(rankings) == [1]
    ranking = rankings[1]
    assert ranking.dtype == torch.float32 and ranking.shape == (LENGTH,)
    assert torch.isinf(ranking[:BLOCK]).all() and (ranking[:BLOCK] > 0).all()  # the sink block, always kept
    per_token = torch.tensor([expected_scores[p // BLOCK] for p in range(BLOCK, LENGTH)], dtype=torch.float32)
    torch.testing.assert_close(ranking[BLOCK:], per_token, rtol=1e-5, atol=1e-5)

    selection = method.select_offline(captured, budget)
    assert selection.layer == 1
    expected = reference_kept(expected_scores, first_keeps)
    assert selection.positions.tolist() == expected
    # the ranking orders the blocks as the selection takes them
    by_rank = sorted(range(LENGTH), key=lambda p: (-float(ranking[p]), p))
    assert sorted(by_rank[: len(expected)]) == expected


def synthetic(layer_types=None) -> Captured:
    """A store of one KV head (MQA) over 3 layers and 20 tokens: blocks of 4, each token holding its
    block's score, which differs per layer: layer l's block j scores (j * (7 + l)) % 5."""
    blocks = torch.arange(20) // 4
    scores = torch.stack([((blocks * (7 + layer)) % 5).float() for layer in range(3)])[:, None, :]
    key = make("sliminfer", block_size=4, unit_size=2).probe().key
    return Captured({key: scores}, 3, 20, layer_types=layer_types)


def test_on_a_hybrid_model_the_offline_faces_read_the_nearest_global_layer():
    method = make("sliminfer", block_size=4, unit_size=2)
    budget = Budget(tokens=6)  # 2x at the first of two pruning layers: 12 tokens, 3 blocks
    # every layer global: pruning layers (1, 2); layer 1's blocks score 0, 3, 1, 4, 2
    plain = method.select_offline(synthetic(), budget)
    assert plain.layer == 1 and plain.positions.tolist() == [*range(0, 8), *range(12, 16)]
    hybrid = synthetic([GLOBAL_ATTENTION, SLIDING_ATTENTION, GLOBAL_ATTENTION])  # (1, 2) move to (0, 2)
    selection = method.select_offline(hybrid, budget)
    assert selection.layer == 0  # layer 0's blocks score 0, 2, 4, 1, 3
    assert selection.positions.tolist() == [*range(0, 4), *range(8, 12), *range(16, 20)]
    ranking = method.layer_rankings(hybrid, budget)
    assert list(ranking) == [0]
    assert ranking[0].tolist() == [math.inf] * 4 + [2.0] * 4 + [4.0] * 4 + [1.0] * 4 + [3.0] * 4


@pytest.mark.parametrize("face", ["select_offline", "layer_rankings"])
def test_a_store_without_the_token_units_scores_is_refused_naming_the_method(face):
    method = make("sliminfer", block_size=4, unit_size=2)
    key = method.probe().key
    with pytest.raises(
        RankkitError, match=f"^method 'sliminfer' needs captured '{key}', which this example lacks$"
    ):
        getattr(method, face)(Captured({}, 3, 20), Budget.from_keep(0.5))


def test_chosen_blocks_are_the_first_eligible_then_the_best_others_with_minus_one_for_missing():
    """Sec. 4.2 by hand: the attention sink's block (the first eligible slot), then the best
    ``count - 1`` other eligible blocks; places no eligible block fills hold -1."""
    from rankkit.methods.sliminfer import block_count, chosen_blocks

    blocks = torch.tensor([0, 1, 2, 3, -1])  # a spare slot last
    scores = torch.tensor([5.0, 1.0, 3.0, 2.0, 0.0])
    eligible = torch.tensor([True, True, True, True, False])
    assert chosen_blocks(blocks, scores, 1, eligible).tolist() == [0]
    assert chosen_blocks(blocks, scores, 3, eligible).tolist() == [0, 2, 3]
    assert chosen_blocks(blocks, scores, 6, eligible).tolist() == [0, 2, 3, 1, -1, -1]
    later = torch.tensor([False, True, True, True, False])  # block 0 gone: block 1 leads
    assert chosen_blocks(blocks, scores, 2, later).tolist() == [1, 2]
    assert [block_count(tokens, 8) for tokens in (0, 3, 8, 9)] == [1, 1, 1, 2]


def test_a_decode_step_chooses_among_every_block_a_kept_token_lies_in_even_a_lone_one():
    """The pool each decode step chooses from (Alg. 1) is every block the governed layers hold a token
    of: the chosen blocks and the query window's. A prompt of 5 x 8 + 1 tokens ends in a block of one
    token, and the window of 2 reaches one token into the block before it: each holds one kept token."""
    from rankkit.methods.sliminfer import SlimInferHook

    ids = torch.randint(0, 97, (41,), generator=torch.Generator().manual_seed(3))
    run = make("sliminfer", **PARAMS).prefill(Runner(tiny_model("llama")), ids, Budget.from_tokens(8))
    (hook,) = [each for each in run.decode_hooks if isinstance(each, SlimInferHook)]
    for entry in hook.schedule.values():
        choice = entry.decode_choice
        eligible = choice.others.clone().index_fill_(0, choice.first, True)
        pool = {int(block) for block in choice.blocks[eligible]}
        assert pool == entry.chosen | {39 // BLOCK, 40 // BLOCK}
        assert not {39 // BLOCK, 40 // BLOCK} & entry.chosen  # else a lone token's block was chosen anyway


def test_the_papers_schedule_keeps_4x_2x_1x_and_each_pruning_layer_governs_up_to_the_next():
    """Sec. 5 on 32 layers: pruning at layers 10, 20 and 30 with the 8k/4k/2k budgets; each governs
    the caches after it up to and with the next pruning layer's (built from its kept tokens)."""
    method = make("sliminfer", pruning_layers=(10, 20, 30))
    schedule = method._schedule(32, 32768, Budget.from_tokens(2048))
    assert [(entry.layer, entry.keep_tokens, entry.governed) for entry in schedule] == [
        (10, 8192, list(range(11, 21))),
        (20, 4096, list(range(21, 31))),
        (30, 2048, [31]),
    ]
    assert [entry.keep_tokens for entry in method._schedule(32, 5000, Budget.from_tokens(2048))] == [5000, 4096, 2048]
