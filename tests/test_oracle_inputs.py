"""The oracle's edges: teacher-forcing nothing, tokenizing a reference answer (no special tokens, an
empty one refused), and the oracle method's offline face reading a store's oracle scores."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from rankkit.errors import RankkitError
from rankkit.methods import Budget, make
from rankkit.methods.selection import ORACLE_SCORES, Captured
from rankkit.oracle import EmptyAnswer, teacher_force, tokenize_answer
from rankkit.runner import Runner


def test_teacher_forcing_no_tokens_gives_no_logits_and_leaves_the_cache_alone(random_ids):
    runner = Runner(tiny_model("llama"))
    prefill = runner.prefill(random_ids)
    keys_before = [keys.clone() for keys in prefill.cache.positions]
    logits = teacher_force(runner, prefill, [])
    assert logits.shape == (0, runner.config.vocab_size) and logits.device == runner.device
    assert all(torch.equal(a, b) for a, b in zip(prefill.cache.positions, keys_before, strict=True))
    # two tokens: the logits of the two decode steps, in order
    forced = teacher_force(runner, runner.prefill(random_ids), [3, 5])
    fresh = runner.prefill(random_ids)
    first = runner.decode_step(3, 40, fresh.cache, ())
    second = runner.decode_step(5, 41, fresh.cache, ())
    assert torch.equal(forced, torch.stack([first, second]))


def test_a_reference_answer_is_tokenized_without_special_tokens(default_tokenizer):
    ids = tokenize_answer(default_tokenizer, " 4172")
    assert ids == default_tokenizer.encode(" 4172", add_special_tokens=False)
    assert default_tokenizer.decode(ids) == " 4172"


class BosTokenizer:
    """Prepends BOS (id 1) unless told not to, as a Llama tokenizer does; one id per character."""

    def __call__(self, text, add_special_tokens=True):
        if not isinstance(add_special_tokens, bool):
            raise TypeError("add_special_tokens must be a bool")
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(char) % 97 for char in text]}


def test_a_tokenizer_that_adds_bos_gives_no_bos_and_an_empty_answer_is_refused():
    assert tokenize_answer(BosTokenizer(), "ab") == [ord("a") % 97, ord("b") % 97]
    with pytest.raises(EmptyAnswer, match="the reference answer is empty"):
        tokenize_answer(BosTokenizer(), "")


def _captured(scores: torch.Tensor, num_layers: int = 3) -> Captured:
    return Captured({ORACLE_SCORES: scores}, num_layers=num_layers, num_tokens=scores.numel())


ORACLE = torch.tensor([0.5, 3.0, -1.0, 2.0, 0.25, 1.0, 4.0, 0.0])


def test_the_oracle_method_ranks_every_layer_by_the_stored_oracle_scores_with_its_window_forced():
    method = make("oracle", pruning_layer=1, window_size=2)
    scores = method.captured_scores(_captured(ORACLE))
    assert scores.shape == (3, 1, 8) and torch.equal(scores[2, 0], ORACLE)
    expected = ORACLE.clone()
    expected[-2:] = float("inf")
    rankings = method.layer_rankings(_captured(ORACLE), Budget.from_tokens(4))
    assert list(rankings) == [0, 1, 2]
    assert all(torch.equal(ranking, expected) for ranking in rankings.values())
    selection = method.select_offline(_captured(ORACLE), Budget.from_tokens(4))
    # the window (6, 7), then the best others: 1 (3.0), 3 (2.0)
    assert selection.layer == 1 and selection.positions.tolist() == [1, 3, 6, 7]


def test_the_oracle_method_names_itself_when_a_store_lacks_the_oracle():
    method = make("oracle", pruning_layer=1)
    with pytest.raises(RankkitError, match="method 'oracle' needs captured 'oracle'"):
        method.captured_scores(Captured({}, num_layers=3, num_tokens=8))
