"""PyramidKV, AdaKV and TOVA against plain-loop references written from their papers, on a tiny model:
the cache each method leaves is exactly what the loops keep, online and from a store's scores."""

from __future__ import annotations

import math

import torch
from conftest import tiny_model

from rankkit.methods import Budget, make
from rankkit.methods.selection import Captured
from rankkit.runner import LayerHook, Runner, greedy_continue

LENGTH = 64
WINDOW, KERNEL = 4, 3


class Recorder(LayerHook):
    """Every attention call's queries, keys, scaling and key positions, per layer (decode: per step)."""

    def __init__(self):
        self.prefill: dict[int, tuple] = {}
        self.decode: list[dict[int, tuple]] = []

    def on_attention(self, call):
        entry = (call.query[0].float().clone(), call.key[0].float().clone(), call.scaling,
                 call.key_positions.clone())  # fmt: skip
        if call.phase == "prefill":
            self.prefill[call.layer] = entry
        else:
            if call.layer == 0:
                self.decode.append({})
            self.decode[-1][call.layer] = entry


class Snapshot(LayerHook):
    """Each layer's kept positions per KV head after every decode step."""

    def __init__(self):
        self.after_steps = []

    def after_decode_step(self, cache, position):
        self.after_steps.append([_kept(cache, layer) for layer in range(cache.num_layers)])


def _kept(cache, layer) -> list[list[int]]:
    return [sorted(p for p in head.tolist() if p >= 0) for head in cache.positions[layer]]


def _setup():
    runner = Runner(tiny_model("llama"))
    ids = torch.randint(0, 97, (LENGTH,), generator=torch.Generator().manual_seed(5))
    recorder = Recorder()
    runner.prefill(ids, hooks=[recorder])  # KV-only methods: every layer sees these very queries and keys
    return runner, ids, recorder.prefill


def _snapkv_scores(query, key, scaling) -> list[list[float]]:
    """SnapKV's score per KV head and key, written out: the last WINDOW queries' causal softmax attention
    summed over the window, averaged over a KERNEL neighbourhood inside the tokens before the window
    (no padding counted), summed over the query heads of the KV head; window keys unpooled."""
    q_heads, kv_heads = query.shape[0], key.shape[0]
    group, past = q_heads // kv_heads, LENGTH - WINDOW
    scores = []
    for g in range(kv_heads):
        total = [0.0] * LENGTH
        for h in range(g * group, (g + 1) * group):
            summed = [0.0] * LENGTH
            for j in range(past, LENGTH):
                logits = key[g, : j + 1] @ query[h, j] * scaling
                attention = torch.softmax(logits, dim=0)
                for i in range(j + 1):
                    summed[i] += float(attention[i])
            for i in range(LENGTH):
                if i < past:
                    near = range(max(0, i - KERNEL // 2), min(past, i + KERNEL // 2 + 1))
                    total[i] += sum(summed[n] for n in near) / len(near)
                else:
                    total[i] += summed[i]
        scores.append(total)
    return scores


def _top(scores: list[float], count: int, forced: set[int]) -> set[int]:
    """The forced tokens, then the best others by score, ties to the earlier token."""
    others = sorted((i for i in range(len(scores)) if i not in forced), key=lambda i: (-scores[i], i))
    return forced | set(others[: count - len(forced)])


def _captured(scores: dict[int, list[list[float]]], key: str, kv_heads: int) -> Captured:
    array = torch.tensor([scores[layer] for layer in sorted(scores)], dtype=torch.float32)
    return Captured({key: array}, num_layers=len(scores), num_tokens=LENGTH, kv_heads=kv_heads, query_heads=4)


def test_pyramidkv_keeps_snapkv_top_tokens_under_budgets_falling_with_depth():
    runner, ids, recorded = _setup()
    method = make("pyramidkv", window_size=WINDOW, kernel_size=KERNEL, beta=2)
    budget = Budget.from_keep(0.25)
    # keep 16 of 64 a layer on average; beyond the 4-token window a = 12: low 12 / 2 = 6, high 2 x 12 - 6 = 18,
    # falling by (18 - 6) / 2 per layer, the window on top
    assert method.budgets(3, LENGTH, budget) == [22, 16, 10]
    cache = method.prefill(runner, ids, budget).result.cache
    scores = {layer: _snapkv_scores(*recorded[layer][:3]) for layer in range(3)}
    window = set(range(LENGTH - WINDOW, LENGTH))
    captured = _captured(scores, method.probe().key, 2)
    for layer, count in enumerate([22, 16, 10]):
        expected = [sorted(_top(head, count, window)) for head in scores[layer]]
        assert _kept(cache, layer) == expected
        assert method.select_offline(captured, budget, layer=layer).as_lists() == expected


def test_adakv_shares_the_layer_budget_over_heads_after_each_heads_safeguard():
    runner, ids, recorded = _setup()
    method = make("adakv", window_size=WINDOW, kernel_size=KERNEL, safeguard=0.2)
    budget = Budget.from_keep(0.25)  # 16 a head, 32 over the two KV heads; the safeguard int(0.2 x 12) = 2
    cache = method.prefill(runner, ids, budget).result.cache
    scores = {layer: _snapkv_scores(*recorded[layer][:3]) for layer in range(3)}
    captured = _captured(scores, method.probe().key, 2)
    window = set(range(LENGTH - WINDOW, LENGTH))
    sizes = set()
    for layer in range(3):
        first = [_top(head, WINDOW + 2, window) for head in scores[layer]]  # window, then each head's best 2
        entries = sorted(
            ((head, i) for head in range(2) for i in range(LENGTH)),
            key=lambda entry: (-math.inf if entry[1] in first[entry[0]] else -scores[layer][entry[0]][entry[1]],
                               entry[0], entry[1]),
        )[:32]  # fmt: skip
        expected = [sorted(i for head, i in entries if head == wanted) for wanted in range(2)]
        assert _kept(cache, layer) == expected
        assert method.select_offline(captured, budget, layer=layer).as_lists() == expected
        sizes.add(tuple(len(head) for head in expected))
    assert sum(next(iter(sizes))) == 32 and any(a != b for a, b in sizes)  # the heads' shares differ


def _tova_scores(query, key, scaling) -> list[float]:
    """TOVA's score: the newest query's softmax attention averaged (here summed) over all heads."""
    q_heads, kv_heads = query.shape[0], key.shape[0]
    group = q_heads // kv_heads
    totals = [0.0] * key.shape[1]
    for h in range(q_heads):
        attention = torch.softmax(key[h // group] @ query[h, -1] * scaling, dim=0)
        for i in range(key.shape[1]):
            totals[i] += float(attention[i])
    return totals


def test_tova_keeps_the_last_tokens_favourites_and_evicts_one_entry_per_decode_step():
    runner, ids, recorded = _setup()
    method = make("tova")
    budget = Budget.from_tokens(16)
    recorder, snapshot = Recorder(), Snapshot()
    run = method.prefill(runner, ids, budget)
    cache = run.result.cache
    for layer in range(3):
        scores = _tova_scores(*recorded[layer][:3])
        expected = sorted(_top(scores, 16, {LENGTH - 1}))
        assert _kept(cache, layer) == [expected, expected]  # both KV heads keep one set
    captured = Captured({"last_token_heads": torch.stack([
        torch.stack([torch.softmax(recorded[layer][1][h // 2] @ recorded[layer][0][h, -1] * recorded[layer][2], 0)
                     for h in range(4)]) for layer in range(3)])},
        num_layers=3, num_tokens=LENGTH, kv_heads=2, query_heads=4)  # fmt: skip
    assert method.select_offline(captured, budget, layer=1).as_lists() == _kept(cache, 1)

    greedy_continue(runner, run.result, 6, [recorder, *run.decode_hooks, snapshot])
    assert len(recorder.decode) == 5  # the first answer token comes from the prefill's logits
    for step, calls in enumerate(recorder.decode):
        for layer, (query, key, scaling, positions) in calls.items():
            scores = _tova_scores(query, key, scaling)
            assert len(scores) == 17  # the budget and the new token
            lowest = min(range(17), key=lambda i: (scores[i], -i))  # ties: the latest goes
            survivors = sorted(p for i, p in enumerate(positions[0].tolist()) if i != lowest)
            assert snapshot.after_steps[step][layer] == [survivors, survivors]


def test_the_least_attended_entry_is_the_lowest_score_then_the_latest_and_an_empty_slot_as_told():
    """``least_attended`` on 300 random rows of tied scores, shuffled positions and empty slots, against
    the rule picked out by hand: an empty slot never goes where it scores +inf (the dynamic cache's
    padding), the first empty one goes where it scores -inf (the static cache's free slot), and
    otherwise the lowest score, among ties the latest position."""
    from rankkit.methods.tova import least_attended

    generator = torch.Generator().manual_seed(3)
    for _ in range(300):
        length = int(torch.randint(2, 12, (1,), generator=generator))
        scores = torch.randint(0, 3, (length,), generator=generator).float()  # ties, often
        positions = torch.randperm(length, generator=generator)
        empty = torch.rand(length, generator=generator) < 0.3
        empty[int(torch.randint(0, length, (1,), generator=generator))] = False  # an entry at least
        positions[empty] = -1
        entries = [i for i in range(length) if not empty[i]]
        latest_lowest = max(entries, key=lambda i: (-scores[i], positions[i]))
        assert int(least_attended(scores, positions, torch.inf)) == latest_lowest
        first_empty = next((i for i in range(length) if empty[i]), latest_lowest)
        assert int(least_attended(scores, positions, -torch.inf)) == first_empty
        if not empty.any():
            assert int(least_attended(scores, positions, None)) == latest_lowest


def test_trimming_a_cache_cut_to_a_bound_leaves_what_one_cut_to_the_widest_head_leaves():
    from rankkit.cache import KVCache

    generator = torch.Generator().manual_seed(5)
    keys = torch.randn(1, 3, 40, 4, generator=generator)
    kept = torch.rand(3, 40, generator=generator) < torch.tensor([[0.2], [0.5], [0.35]])
    widest = int(kept.sum(dim=1).max())

    def cache_of_keys() -> KVCache:
        cache = KVCache(1)
        cache.begin_step(torch.arange(40))
        cache.update(keys, keys + 1, 0)
        return cache

    exact, bounded = cache_of_keys(), cache_of_keys()
    exact.compress_to_mask(0, kept, widest)
    bounded.compress_to_mask(0, kept, widest + 9)
    assert bounded.positions[0].shape[1] == widest + 9
    bounded.trim_padding([0])
    assert torch.equal(bounded.positions[0], exact.positions[0])
    assert torch.equal(bounded.keys[0], exact.keys[0]) and torch.equal(bounded.values[0], exact.values[0])
    real = [sorted(torch.nonzero(head).flatten().tolist()) for head in kept]
    assert [[p for p in row.tolist() if p >= 0] for row in bounded.positions[0]] == real
