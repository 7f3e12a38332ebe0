"""The oracle's edges: teacher-forcing nothing, tokenizing a reference answer (no special tokens, an
empty one refused), and the oracle method's offline face reading a store's oracle scores."""

from __future__ import annotations

import numpy as np
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


LOW_SIX = torch.tensor([0.5, 3.0, -1.0, 2.0, 0.25, 1.0, -2.0, 0.0])  # position 6 ranks low


@pytest.mark.parametrize(
    ("mirror", "kept"),
    [("gemfilter", [1, 3, 7]), ("fastkv", [1, 6, 7]), ("claa", [1, 6, 7])],
)
def test_each_mirror_forces_its_own_tokens_offline(mirror, kept):
    """Listing 4 (GemFilter's mirror) forces the last token only; the one-pass mirrors their window."""
    layered = {} if mirror == "gemfilter" else {"pruning_layer": 1, "window_size": 2}  # Listing 4 reads neither
    method = make("oracle", mirror=mirror, **layered)
    assert method.select_offline(_captured(LOW_SIX), Budget.from_tokens(3)).positions.tolist() == kept


def test_the_gemfilter_mirror_ranks_by_the_oracle_with_the_last_token_forced_and_always_keeps_one():
    """Listing 4 forces the last token alone, online, offline and in ``rankkit compare``'s ranking (one
    ranking, not one per layer: its selection runs before any layer)."""
    method = make("oracle", mirror="gemfilter")
    expected = LOW_SIX.clone()
    expected[-1] = float("inf")
    rankings = method.layer_rankings(_captured(LOW_SIX), Budget.from_tokens(3))
    assert list(rankings) == [None] and torch.equal(rankings[None], expected)
    assert method.minimum_keep() == 1 and make("oracle", window_size=2).minimum_keep() == 2
    with pytest.raises(RankkitError, match="method 'oracle' needs captured 'oracle'"):
        method.select_offline(Captured({}, num_layers=3, num_tokens=8), Budget.from_tokens(3))


def test_only_the_claa_mirror_defers_compression_by_its_m_layers():
    assert make("oracle", mirror="claa", deferred_layers=2).compress_from() == 2
    assert make("oracle", mirror="fastkv").compress_from() == 0  # m given to it is refused


def test_the_oracle_method_refuses_to_prefill_before_it_has_a_ranking(random_ids):
    runner = Runner(tiny_model("llama"))
    with pytest.raises(RankkitError, match="call prepare"):
        make("oracle").prefill(runner, random_ids, Budget.from_tokens(8))


def test_the_gemfilter_mirror_prefills_only_the_top_tokens_at_their_own_positions(random_ids):
    """Listing 4's oracle_prefill: one forward pass over the kept tokens alone, at their original
    positions, so each layer's cache is that of the model run on those tokens."""
    runner = Runner(tiny_model("llama"))
    method = make("oracle", mirror="gemfilter")
    method.ranking = torch.rand(40, generator=torch.Generator().manual_seed(5))
    run = method.prefill(runner, random_ids, Budget.from_tokens(10))
    kept = torch.cat([torch.topk(method.ranking[:-1], 9).indices.sort().values, torch.tensor([39])])
    assert run.kept_positions.tolist() == kept.tolist()
    alone = runner.prefill(random_ids[kept], positions=kept)
    for layer in range(runner.num_layers):
        assert torch.allclose(run.result.cache.keys[layer], alone.cache.keys[layer], atol=1e-6)


class DigitTokenizer:
    """Ids as text, one character each (decoded ids are bracketed); ``special`` ids are shown unless skipped."""

    def __init__(self, special=()):
        self.special = set(special)

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [int(char) for char in text]}

    def decode(self, tokens, skip_special_tokens=False):
        return "".join(f"<{t}>" for t in tokens if not (skip_special_tokens and t in self.special))


def test_a_generated_answer_ending_at_eos_ranks_by_the_tokens_before_it(random_ids):
    """The answer is the greedy tokens before EOS (flagged), its text without special tokens; an
    answer that is EOS at once has nothing to rank by; a reference answer never ended at EOS."""
    from rankkit.oracle import answer_informed_oracle

    runner = Runner(tiny_model("llama"))
    first, second, third = runner.generate(random_ids, 3).tokens
    runner.model.generation_config.eos_token_id = third
    tokenizer = DigitTokenizer(special={first})
    result = answer_informed_oracle(runner, random_ids, tokenizer=tokenizer, max_new_tokens=3)
    assert result.ended_with_eos is True and result.answer_tokens == [first, second]
    assert result.answer_text == f"<{second}>"  # the special first token is not shown
    assert result.scores.dtype == result.layer_scores.dtype == np.float32
    reference = answer_informed_oracle(
        runner, random_ids, tokenizer=DigitTokenizer(), answer="reference", reference_answer="12"
    )
    assert reference.ended_with_eos is False and reference.answer_tokens == [1, 2]
    runner.model.generation_config.eos_token_id = first
    with pytest.raises(EmptyAnswer, match="answered with EOS at once"):
        answer_informed_oracle(runner, random_ids, tokenizer=DigitTokenizer(), max_new_tokens=3)


def test_an_unknown_answer_mode_is_refused_naming_the_modes():
    from rankkit.oracle import oracle_params

    with pytest.raises(RankkitError, match="--answer must be one of generated, reference, got 'gold'"):
        oracle_params("gold", False, 7, 8)
