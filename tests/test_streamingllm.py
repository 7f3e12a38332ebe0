"""StreamingLLM's rolling window in decoding on a model with a single KV head (multi-query attention)."""

from __future__ import annotations

import torch

from rankkit.methods import Budget, make
from rankkit.runner import Runner


def test_the_window_rolls_past_the_sinks_with_one_kv_head():
    from conftest import attended_keys_recorder, one_kv_head_runner

    runner = one_kv_head_runner()
    prompt = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(1))
    run = make("streamingllm").prefill(runner, prompt, Budget.from_tokens(8))
    cache = run.result.cache
    attended = attended_keys_recorder()
    for step in range(3):
        runner.decode_step(5, 20 + step, cache, [attended])
    for layer in range(3):  # the sinks, the window of 4 and the step's own token; the cache holds what it saw
        assert attended.steps[-1][layer] == [[0, 1, 2, 3, 18, 19, 20, 21, 22]], layer
        assert sorted(cache.positions[layer][0].tolist()) == [0, 1, 2, 3, 18, 19, 20, 21, 22], layer


def test_a_budget_covering_the_prompt_is_a_full_prefill_that_keeps_every_key_in_decoding(random_ids):
    """StreamingLLM (and TOVA, which evicts in decoding too) at a budget of the whole prompt: the
    prefill is the full one and no decode step evicts."""
    from conftest import tiny_model

    from rankkit.methods.base import full_prefill

    runner = Runner(tiny_model("llama"))
    full = full_prefill(runner, random_ids)
    for name in ("streamingllm", "tova"):
        run = make(name).prefill(runner, random_ids, Budget.from_tokens(40))
        assert torch.equal(run.result.logits, full.result.logits), name
        cache = run.result.cache
        for step in range(3):
            runner.decode_step(5, 40 + step, cache, run.decode_hooks)
        assert all(sorted(cache.positions[layer][0].tolist()) == list(range(43)) for layer in range(3)), name
