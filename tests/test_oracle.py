"""The Answer-Informed Oracle against a brute-force reduction of full score matrices, and on real passkeys."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import tiny_model

from rankkit.errors import RankkitError
from rankkit.oracle import answer_informed_oracle
from rankkit.prompting import build_prompt
from rankkit.runner import Runner

RECORD_ATTENTION = "rankkit-test-record"


class CharTokenizer:
    """Enough of a tokenizer for the tiny models: one id per character."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(char) % 97 for char in text]}

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(i) for i in ids)


def record_queries_and_keys(model, ids: torch.Tensor) -> list[tuple]:
    """Post-RoPE (query, key, module) of every layer from one plain HF forward over ``ids``.

    The forward runs each family's own eager attention (caps, sinks, windows and all); no
    runner is involved.
    """
    import sys

    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    recorded = {}

    def record(module, query, key, value, attention_mask, **kwargs):
        recorded[module.layer_idx] = (query[0].double(), key[0].double(), module)
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(RECORD_ATTENTION, record)
    ALL_MASK_ATTENTION_FUNCTIONS.register(RECORD_ATTENTION, eager_mask)
    model.set_attn_implementation(RECORD_ATTENTION)
    with torch.inference_mode():
        model(ids[None])
    return [recorded[layer] for layer in range(len(recorded))]


def slow_pool(values: np.ndarray, kernel: int) -> np.ndarray:
    """Mean of the scored neighbours (NaN: no score) within kernel // 2 on each side."""
    radius = kernel // 2
    windows = [values[max(0, i - radius) : i + radius + 1] for i in range(len(values))]
    return np.array([np.nanmean(w) if not np.isnan(w).all() else np.nan for w in windows])


def brute_force_oracle(model, prompt: torch.Tensor, answer: list[int], *, softmax: bool, kernel: int):
    """Listing 4 the slow way: every answer token's query (fed back) at every layer and head, full matrices.

    Logits are capped as the family caps them, the softmax over the prompt keys carries
    the family's sinks, and a key outside a local layer's window from a query has no score (NaN).
    """
    prompt_length = prompt.shape[0]
    recorded = record_queries_and_keys(model, torch.cat([prompt, torch.tensor(answer)]))
    matrices = []
    for query, key, module in recorded:
        groups = query.shape[0] // key.shape[0]
        answer_queries = query[:, prompt_length : prompt_length + len(answer)]  # [heads, answer, d]
        prompt_keys = key[:, :prompt_length].repeat_interleave(groups, dim=0)  # [heads, T, d]
        logits = answer_queries @ prompt_keys.transpose(1, 2) * module.scaling  # [heads, answer, T]
        softcap = getattr(module, "attn_logit_softcapping", None)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        window = getattr(
            module, "sliding_window", getattr(module.config, "sliding_window", None)
        )  # Mistral: config
        unseen = torch.zeros(len(answer), prompt_length, dtype=torch.bool)
        if window is not None:
            query_positions = torch.arange(prompt_length, prompt_length + len(answer))[:, None]
            unseen = torch.arange(prompt_length)[None] <= query_positions - window
        logits = logits.masked_fill(unseen, float("-inf"))
        if softmax:
            sinks = getattr(module, "sinks", None)
            columns = [logits]
            if sinks is not None:
                columns.append(sinks.detach().double()[:, None, None].expand(-1, len(answer), 1))
            logits = torch.cat(columns, dim=-1).softmax(dim=-1)[..., :prompt_length]
        matrices.append(logits.masked_fill(unseen, float("nan")))
    scores = torch.stack(matrices).numpy()  # [layers, heads, answer, T]
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices are the point here
        oracle = np.nanmean(np.nanmax(scores, axis=(0, 1)), axis=0)
        per_layer = np.nanmean(np.nanmax(scores, axis=1), axis=1)
    return slow_pool(oracle, kernel), np.stack([slow_pool(row, kernel) for row in per_layer])


def assert_matches_brute_force(family_name, prompt, result, *, softmax, kernel):
    expected, expected_layers = brute_force_oracle(
        tiny_model(family_name), prompt, result.answer_tokens, softmax=softmax, kernel=kernel
    )
    np.testing.assert_allclose(result.scores, expected, rtol=1e-5, atol=1e-5, equal_nan=True)
    np.testing.assert_allclose(result.layer_scores, expected_layers, rtol=1e-5, atol=1e-5, equal_nan=True)


ORACLE_FAMILIES = [
    "llama",
    "qwen3",
    "mistral",
    "gemma2",
    "gemma3_text",
    "gpt_oss",
    "smollm3",
    "olmo2",
    "phi3",
    "granite",
    "cohere2",
]


@pytest.mark.parametrize("family_name", ORACLE_FAMILIES)  # GQA, QK-norm, windows, caps, sinks, NoPE
@pytest.mark.parametrize("softmax", [False, True])
def test_generated_answer_oracle_equals_brute_force(family_name, softmax, random_ids):
    model = tiny_model(family_name)
    expected_answer = model.generate(random_ids[None], max_new_tokens=6, do_sample=False)[0, 40:].tolist()
    result = answer_informed_oracle(
        Runner(model), random_ids, tokenizer=CharTokenizer(), max_new_tokens=6, softmax=softmax
    )
    assert result.answer_tokens == expected_answer
    assert not result.ended_with_eos
    assert result.params == {"answer": "generated", "softmax": softmax, "kernel": 7, "max_new_tokens": 6}
    assert result.scores.dtype == np.float32 and result.scores.shape == (40,)
    assert result.layer_scores.shape == (3, 40)
    assert_matches_brute_force(family_name, random_ids, result, softmax=softmax, kernel=7)


@pytest.mark.parametrize("family_name", ["llama", "qwen3"])
@pytest.mark.parametrize("softmax", [False, True])
def test_reference_answer_oracle_equals_brute_force(family_name, softmax, random_ids):
    tokenizer = CharTokenizer()
    result = answer_informed_oracle(
        Runner(tiny_model(family_name)),
        random_ids,
        tokenizer=tokenizer,
        answer="reference",
        reference_answer="gold!",
        softmax=softmax,
        kernel=5,
    )
    assert result.answer_tokens == tokenizer("gold!")["input_ids"]
    assert result.params["answer"] == "reference" and result.params["max_new_tokens"] is None
    assert_matches_brute_force(family_name, random_ids, result, softmax=softmax, kernel=5)


def test_eos_ends_the_answer_and_its_query_is_not_counted(random_ids):
    model = tiny_model("llama")
    free_run = model.generate(random_ids[None], max_new_tokens=8, do_sample=False)[0, 40:].tolist()
    stop_at = next(i for i in range(2, 8) if free_run[i] not in free_run[:i])
    model.generation_config.eos_token_id = free_run[stop_at]
    result = answer_informed_oracle(
        Runner(model), random_ids, tokenizer=CharTokenizer(), max_new_tokens=8, kernel=1
    )
    assert result.ended_with_eos
    assert result.answer_tokens == free_run[:stop_at]
    assert_matches_brute_force("llama", random_ids, result, softmax=False, kernel=1)


def test_a_shared_prefill_gives_the_same_oracle_and_stays_reusable(random_ids):
    runner = Runner(tiny_model("qwen2"))
    prefill = runner.prefill(random_ids)
    cached_before = [keys.shape for keys in prefill.cache.keys]
    shared = answer_informed_oracle(
        runner, random_ids, tokenizer=CharTokenizer(), max_new_tokens=5, prefill=prefill
    )
    fresh = answer_informed_oracle(runner, random_ids, tokenizer=CharTokenizer(), max_new_tokens=5)
    assert [keys.shape for keys in prefill.cache.keys] == cached_before
    np.testing.assert_array_equal(shared.scores, fresh.scores)


def test_a_pruned_prefill_and_bad_options_are_refused(random_ids):
    runner = Runner(tiny_model("llama"))
    pruned = runner.prefill(random_ids)
    pruned.cache.compress(1, torch.arange(10).expand(2, -1))
    with pytest.raises(RankkitError, match="full prefill"):
        answer_informed_oracle(runner, random_ids, tokenizer=CharTokenizer(), prefill=pruned)
    with pytest.raises(RankkitError, match="reference_answer"):
        answer_informed_oracle(runner, random_ids, tokenizer=CharTokenizer(), answer="reference")
    with pytest.raises(RankkitError, match="odd"):
        answer_informed_oracle(runner, random_ids, tokenizer=CharTokenizer(), kernel=4)


# --- the default model on passkeys -------------------------------------------------------------

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key?"
# pass key, filler repetitions, needle depth (fraction of the filler before it), and the shares
# of the oracle's top 5% measured with SmolLM2-135M-Instruct, as (needle sentence, pass key
# digits) for the generated answer (16 tokens) and for the teacher-forced pass key.
PASSKEYS = [
    ("68247", 14, 0.2, {"generated": (0.21, 0.6), "reference": (0.43, 1.0)}),
    ("31904", 16, 0.5, {"generated": (0.29, 0.6), "reference": (0.50, 1.0)}),
    ("75126", 18, 0.8, {"generated": (0.36, 0.6), "reference": (0.57, 1.0)}),
    ("42953", 15, 0.35, {"generated": (0.21, 0.6), "reference": (0.43, 1.0)}),
]
MARGIN = 0.2  # one digit of five; about three tokens of the fourteen-token needle sentence


def passkey_prompt(tokenizer, passkey: str, repetitions: int, depth: float, answer_prefix: str = ""):
    """Filler with the needle at ``depth``: the prompt and the token spans of the needle sentence and of the key."""
    needle = f"The pass key is {passkey}. Remember it."
    cut = round(repetitions * depth)
    context = FILLER * cut + needle + " " + FILLER * (repetitions - cut)
    prompt = build_prompt(tokenizer, context.strip(), QUESTION, answer_prefix=answer_prefix)
    start = len(FILLER) * cut
    key_start = start + needle.index(passkey)
    return (
        prompt,
        prompt.context_token_span(start, start + len(needle)),
        prompt.context_token_span(key_start, key_start + len(passkey)),
    )


def top_share(scores: np.ndarray, span: tuple[int, int], fraction: float = 0.05) -> float:
    """Share of the span's tokens that are among the top ``fraction`` of all tokens by score."""
    top = set(np.argsort(-scores, kind="stable")[: max(1, round(fraction * len(scores)))].tolist())
    return sum(token in top for token in range(*span)) / (span[1] - span[0])


@pytest.mark.integration
@pytest.mark.parametrize(("passkey", "repetitions", "depth", "measured"), PASSKEYS)
def test_default_model_oracle_puts_the_needle_on_top(default_model, passkey, repetitions, depth, measured):
    model, tokenizer = default_model
    runner = Runner(model)
    prompt, needle, key = passkey_prompt(tokenizer, passkey, repetitions, depth)
    assert 300 <= prompt.num_tokens <= 600
    prefill = runner.prefill(prompt.input_ids)
    results = {
        "generated": answer_informed_oracle(
            runner, prompt.input_ids, tokenizer=tokenizer, max_new_tokens=16, prefill=prefill
        ),
        "reference": answer_informed_oracle(
            runner,
            prompt.input_ids,
            tokenizer=tokenizer,
            answer="reference",
            reference_answer=passkey,
            prefill=prefill,
        ),
    }
    assert passkey in results["generated"].answer_text
    for mode, result in results.items():
        needle_share, key_share = measured[mode]
        assert top_share(result.scores, needle) >= needle_share - MARGIN, mode
        assert top_share(result.scores, key) >= key_share - MARGIN, mode


@pytest.mark.parametrize("mirror", ["gemfilter", "fastkv"])
def test_keys_no_answer_query_saw_rank_last_online_and_offline(random_ids, mirror):
    """On a model whose every layer is local (window 16), no answer query sees the oldest keys at any
    layer, and their oracle score is NaN: the oracle method kept them first, before its forced last
    token (gemfilter mirror at 10 tokens: positions 0..9), where compare ranks them last."""
    from test_hybrid import LOCAL, hybrid_runner

    from rankkit.methods import Budget, Captured, make
    from rankkit.methods.selection import ORACLE_SCORES

    runner = hybrid_runner(layers=(LOCAL,) * 4)
    method = make("oracle", mirror=mirror, max_new_tokens=3, kernel_size=1).bind(4)
    method.prepare(runner, random_ids, tokenizer=CharTokenizer())
    stored = answer_informed_oracle(runner, random_ids, tokenizer=CharTokenizer(), max_new_tokens=3, kernel=1).scores
    unseen = np.isnan(stored)
    assert unseen.tolist() == [token <= 24 for token in range(40)]  # the answer's first query, at 40, sees 25..40
    budget = Budget.from_tokens(10)
    ranking = np.where(unseen, -np.inf, stored)
    window = 1 if mirror == "gemfilter" else method.window_size
    ranking[-window:] = np.inf
    expected = sorted(sorted(range(40), key=lambda token: (-ranking[token], token))[:10])
    captured = Captured({ORACLE_SCORES: torch.from_numpy(stored)}, 4, 40, runner.layer_types, 16)
    offline = method.select_offline(captured, budget, layer=0 if mirror == "fastkv" else None)
    assert offline.positions.reshape(-1, 10)[0].tolist() == expected
    run = method.prefill(runner, random_ids, budget)
    assert run.kept_positions.tolist() == expected
