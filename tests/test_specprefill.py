"""SpecPrefill's pieces: Eq. 3 against plain loops, the pooled prefill's kept tokens, the offline face
over a store's draft scores, the default self-draft and a bad ``layers:N`` refused with the fix."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from rankkit.errors import RankkitError
from rankkit.methods import Budget, make
from rankkit.methods.selection import DRAFT_SCORES, Captured
from rankkit.methods.specprefill import draft_runner, eq3, self_draft_spec
from rankkit.runner import Runner

# k = 2 lookahead queries x 2 layers x 3 heads x T = 5 prompt tokens
LOOKAHEAD = torch.tensor(
    [
        [
            [[0.0, 1.0, 2.0, -1.0, 0.5], [3.0, -2.0, 0.0, 0.0, 0.25], [1.0, 1.0, 1.0, 1.0, 1.0]],
            [[-1.0, 4.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0], [2.0, 0.5, 3.0, -3.0, 2.0]],
        ],
        [
            [[1.0, 0.0, 0.0, 5.0, 1.0], [0.0, 0.0, 1.0, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0, -1.0]],
            [[2.0, 2.0, 2.0, 2.0, 2.0], [0.0, 6.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 3.0]],
        ],
    ]
)


def eq3_by_loops(lookahead: torch.Tensor) -> list[float]:
    """Eq. 3: for every token, the max over layers and heads of each query, averaged over the queries."""
    steps, layers, heads, length = lookahead.shape
    means = []
    for token in range(length):
        maxima = [
            max(
                lookahead[step, layer, head, token].item() for layer in range(layers) for head in range(heads)
            )
            for step in range(steps)
        ]
        means.append(sum(maxima) / steps)
    return means


def test_eq3_is_the_mean_over_queries_of_the_max_over_layers_and_heads():
    expected = eq3_by_loops(LOOKAHEAD)
    assert expected == [2.5, 5.0, 2.5, 3.5, 2.5]
    assert eq3(LOOKAHEAD).tolist() == expected
    assert eq3(LOOKAHEAD[:, :, 0]).tolist() == eq3_by_loops(LOOKAHEAD[:, :, :1])  # [k, L, T]
    aggregated = torch.tensor(expected)
    assert eq3(aggregated) is aggregated  # a [T] array is taken as already aggregated


def _captured(scores: torch.Tensor) -> Captured:
    return Captured({DRAFT_SCORES: scores}, num_layers=2, num_tokens=scores.shape[-1])


@pytest.mark.parametrize("stored", [LOOKAHEAD, torch.tensor([2.5, 5.0, 2.5, 3.5, 2.5])])
def test_the_offline_face_ranks_by_eq3_of_the_stored_scores_with_the_last_token_forced(stored):
    method = make("specprefill")
    rankings = method.layer_rankings(_captured(stored), Budget.from_tokens(2))
    assert list(rankings) == [None]
    assert rankings[None].tolist() == [2.5, 5.0, 2.5, 3.5, float("inf")]
    # keep 3: the last token, then 1 (5.0) and 3 (3.5)
    selection = method.select_offline(_captured(stored), Budget.from_tokens(3))
    assert selection.layer is None and selection.positions.tolist() == [1, 3, 4]
    pooled = make("specprefill", kernel_size=3).layer_rankings(_captured(stored), Budget.from_tokens(2))
    # average pooling over the neighbours that exist: (2.5 + 5) / 2, (2.5 + 5 + 2.5) / 3, ...
    assert pooled[None][:4].tolist() == pytest.approx([3.75, 10 / 3, 11 / 3, 8.5 / 3])


def test_the_offline_face_names_itself_when_a_store_lacks_the_draft_scores():
    with pytest.raises(RankkitError, match="method 'specprefill' needs captured 'draft_scores/lookahead'"):
        make("specprefill").select_offline(Captured({}, num_layers=2, num_tokens=5), Budget.from_tokens(2))


def test_the_default_draft_is_the_first_quarter_of_the_layers_rounded_up():
    assert [self_draft_spec(layers) for layers in (1, 4, 5, 30)] == [
        "layers:1",
        "layers:1",
        "layers:2",
        "layers:8",
    ]
    assert make("specprefill").bind(30).draft_model == "layers:8"


@pytest.mark.parametrize("spec", ["layers:0", "layers:4", "layers:x", "layers:"])
def test_a_self_draft_outside_the_targets_layers_is_refused_with_a_valid_one(spec):
    runner = Runner(tiny_model("llama"))  # 3 layers
    with pytest.raises(
        RankkitError, match=rf"draft '{spec}' needs a layer count in 1\.\.3: use e\.g\. --draft layers:1$"
    ):
        draft_runner(spec, runner)
    draft = draft_runner("layers:3", runner)
    assert draft.num_layers == 3 and draft_runner("layers:2", runner).num_layers == 2
    assert runner.num_layers == 3  # the target keeps its layers


def test_the_prefill_keeps_the_top_of_the_average_pooled_eq3_and_always_the_last_token(random_ids):
    runner = Runner(tiny_model("llama"))
    method = make("specprefill", lookahead=2, kernel_size=3)
    lookahead, _ = method.draft_scores(runner, random_ids)  # [k, T]: each query's max over layers and heads
    length = random_ids.numel()
    means = [sum(lookahead[:, token].tolist()) / 2 for token in range(length)]
    pooled = []
    for token in range(length):  # average over the neighbours that exist (no padding counted)
        window = means[max(0, token - 1) : token + 2]
        pooled.append(sum(window) / len(window))
    pooled[-1] = float("inf")  # the last token is always kept
    order = sorted(range(length), key=lambda token: (-pooled[token], token))
    run = method.prefill(runner, random_ids, Budget.from_tokens(6))
    assert run.kept_positions.tolist() == sorted(order[:6])
    assert method.prefill(runner, random_ids, Budget.from_tokens(1)).kept_positions.tolist() == [length - 1]


def test_a_draft_folder_is_the_target_itself_loaded_once_or_refused_for_another_tokenizer(
    tiny_folder, tmp_path
):
    """The target's own folder drafts with the target's runner; another folder loads once and is
    reused; a folder whose tokenizer reads an id otherwise (here: another EOS) is refused."""
    import shutil

    from transformers import AutoTokenizer

    from rankkit import models

    runner = Runner(models.load(str(tiny_folder), device="cpu").model)
    assert draft_runner(str(tiny_folder), runner) is runner
    copies = [tmp_path / name for name in ("copy", "other-eos")]
    for copy in copies:
        shutil.copytree(tiny_folder, copy)
    draft = draft_runner(str(copies[0]), runner)
    assert draft is not runner and draft_runner(str(copies[0]), runner) is draft
    tokenizer = AutoTokenizer.from_pretrained(copies[1])
    tokenizer.eos_token = "<|im_start|>"
    tokenizer.save_pretrained(copies[1])
    with pytest.raises(RankkitError, match="eos_token .*name a draft with the target's tokenizer"):
        draft_runner(str(copies[1]), runner)


def test_an_ending_eos_is_not_a_lookahead_query_and_an_eos_at_once_is_refused(random_ids):
    """Listing 3 feeds back every drafted token but an EOS that ends the answer: a draft whose third
    token is EOS scores with two queries; one whose first token is EOS has none and is refused."""
    from rankkit.methods.specprefill import lookahead_scores

    draft = Runner(tiny_model("llama"))
    first, second, third, _ = draft.generate(random_ids, 4).tokens
    assert len({first, second, third}) == 3
    draft.model.generation_config.eos_token_id = third
    scores, passes = lookahead_scores(draft, random_ids, 4)
    assert scores.shape[0] == 2  # the queries of the first two tokens, fed back at 40 and 41
    assert passes[1].keys == [41] * draft.num_layers + [42] * draft.num_layers
    draft.model.generation_config.eos_token_id = first
    with pytest.raises(RankkitError, match="answered with EOS at once"):
        lookahead_scores(draft, random_ids, 4)


def test_keys_no_layer_of_the_draft_could_see_count_as_no_attention():
    """A draft of local layers only (a hybrid model's first layers) scores the keys outside every window
    NaN; Eq. 3 ranked them first, above the forced last token: on a hybrid model drafting with
    layers:2 (two local layers, window 16) the prefill kept positions 0..19 of 40 and not the last."""
    from test_hybrid import WINDOW, hybrid_runner

    lookahead = LOOKAHEAD.clone()
    lookahead[0, :, :, 0] = float("nan")  # the first query saw key 0 at no layer, the second did
    lookahead[:, :, :, 2] = float("nan")  # no query saw key 2
    assert eq3(lookahead).tolist() == [1.0, 5.0, 0.0, 3.5, 2.5]  # as if their attention were 0
    assert eq3(torch.tensor([1.0, float("nan")])).tolist() == [1.0, 0.0]

    runner = hybrid_runner()
    torch.manual_seed(1)
    ids = torch.randint(0, 100, (40,))
    method = make("specprefill", draft_model="layers:2", lookahead=2)
    scores, _ = method.draft_scores(runner, ids)
    unseen = scores.isnan().all(dim=0)
    assert unseen.tolist() == [position <= 40 - WINDOW for position in range(40)]  # both steps' windows
    kept = method.prefill(runner, ids, Budget.from_tokens(10)).kept_positions.tolist()
    means = scores.nan_to_num(nan=0.0).mean(dim=0).tolist()
    means[-1] = float("inf")
    assert kept == sorted(sorted(range(40), key=lambda token: (-means[token], token))[:10])
    assert 39 in kept and min(kept) > 40 - WINDOW
