"""Speculative Prefill (Liu et al. 2025) as CLAA Eq. 3 and Appendix D.3 Listing 3 write it.

A draft model prefills the whole prompt and greedily generates k lookahead tokens; the
query of each lookahead token (fed back, as Listing 3 feeds ``next_token``) scores every
prompt token by its raw logits against the draft's prompt keys, maximised over layers
and heads and averaged over the k queries (Eq. 3; the oracle's aggregation, with the
draft's k tokens in place of the answer). The base model then re-prefills only the top
tokens at their original positions (two-pass mode). The draft's prefill and lookahead
count in TTFT and in the method's ideal ratio (a lookahead step's layers and LM head at their
share of full's measured decode step, ``CostModel.ideal_ratio``). The lookahead decodes from the draft's own
prefill cache (the prompt is never run again) and scores every head of a layer in one product
on the device (``AnswerAttention``): a lookahead step reads back only its greedy token. With
``--cuda-graphs`` the lookahead replays the draft's own graph, as a decode does.

``draft_model`` is ``layers:N`` or a model spec (``default``, a folder or a hub id) whose
tokenizer is the target's. ``layers:N`` drafts with the target's own first N layers, its
final norm and its LM head (no weights copied): a self-speculative draft, a deviation from
the paper's separate small model of the same family, which a single-model setup lacks.
The default, ``layers:⌈L/4⌉``, costs about a quarter of a full prefill.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from rankkit.errors import RankkitError
from rankkit.methods.base import (
    LOOKAHEAD,
    Budget,
    Method,
    Pass,
    Selection,
    bounded,
    depth_field,
    register,
    reprefill_selected,
)
from rankkit.methods.selection import DRAFT_SCORES, Captured, forced_mask, top_k_with_forced, with_forced
from rankkit.oracle import AnswerAttention
from rankkit.pooling import pool_tokens
from rankkit.runner import Runner, greedy_continue

_DRAFTS: dict[tuple[str, str], Runner] = {}
SELF_DRAFT = "layers:"


def self_draft_spec(num_layers: int) -> str:
    """The default draft: the target's first ⌈L/4⌉ layers."""
    return f"{SELF_DRAFT}{math.ceil(num_layers / 4)}"


@functools.cache
def _model_folder(spec: str) -> str:
    from rankkit import models

    return str(models.resolve_folder(spec))  # hashes the default model's GGUF: once per process


def draft_runner(spec: str, runner: Runner) -> Runner:
    """The runner that drafts for ``runner``: its first N layers for ``layers:N``, else the model ``spec``."""
    if spec.startswith(SELF_DRAFT):
        return _first_layers(runner, spec)
    from rankkit import models

    folder = _model_folder(spec)
    target = str(getattr(runner.config, "_name_or_path", ""))
    if target == folder:
        return runner
    key = (folder, str(runner.device))
    if key not in _DRAFTS:
        # a model built in memory has no folder: only its vocabulary size can be compared
        check_draft(spec, target or None, runner.config.vocab_size)
        _DRAFTS[key] = Runner(models.load(spec, device=runner.device).model)
    return _DRAFTS[key]


def draft_problem(spec: str, target: str | None, vocab_size: int) -> str | None:
    """Why the draft model ``spec`` cannot draft for the model ``target`` (a spec or folder; None
    where it has none) of ``vocab_size`` ids, or None: the one check of a draft against its target.

    The draft reads the target's token ids, so it needs as many embeddings and, where the
    target's tokenizer is known, the same tokenizer (``models.tokenizer_difference``: every id
    read as the same token). Only configs and tokenizers load, no weights.
    """
    from rankkit import models

    drafted = models.load_config(spec).vocab_size
    if drafted != vocab_size:
        return f"draft model '{spec}' has a vocabulary of {drafted} tokens, the target {vocab_size}"
    if target is None:
        return None
    difference = models.tokenizer_difference(models.load_tokenizer(spec), models.load_tokenizer(target))
    return None if difference is None else f"draft model '{spec}' {difference}"


def check_draft(spec: str, target: str | None, vocab_size: int) -> None:
    """Refuse, in one line naming the fix, a draft model ``draft_problem`` finds fault with."""
    problem = draft_problem(spec, target, vocab_size)
    if problem:
        raise RankkitError(f"{problem}: name a draft with the target's tokenizer, or --draft layers:N")


def check_drafts(methods, target: str, config) -> None:
    """Before any weights load: refuse a SpecPrefill among ``methods`` whose draft model cannot draft for
    the model ``target`` (its ``config``); a self-draft (``layers:N``) is the target's own layers."""
    for method in methods:
        if isinstance(method, SpecPrefill):
            spec = method.bind(config.num_hidden_layers).draft_model
            if spec.startswith(SELF_DRAFT):
                _self_draft_layers(spec, config.num_hidden_layers)
            else:
                check_draft(spec, target, config.vocab_size)


def _self_draft_layers(spec: str, num_layers: int) -> int:
    """N of the self-draft spec ``layers:N`` for a model of ``num_layers`` layers, refused outside 1..num_layers."""
    count = spec.removeprefix(SELF_DRAFT)
    if not count.isdigit() or not 1 <= int(count) <= num_layers:
        raise RankkitError(
            f"draft '{spec}' needs a layer count in 1..{num_layers}: use e.g. --draft {self_draft_spec(num_layers)}"
        )
    return int(count)


def _first_layers(runner: Runner, spec: str) -> Runner:
    """``runner.first_layers(N)`` for the spec ``layers:N``, its N checked."""
    return runner.first_layers(_self_draft_layers(spec, runner.num_layers))


def lookahead_scores(
    draft: Runner, input_ids: torch.Tensor, lookahead: int
) -> tuple[torch.Tensor, list[Pass]]:
    """Eq. 3 scores [T] of the prompt from ``lookahead`` draft tokens, and the draft's passes."""
    length = int(input_ids.numel())
    attention = AnswerAttention(draft.num_layers, length, per_token_steps=lookahead)
    prefill = draft.prefill(input_ids)
    # the last token's query counts too (Listing 3 feeds back every ``next_token``)
    generated = greedy_continue(draft, prefill, lookahead, [attention], feed_last=True)
    steps = len(generated) - int(generated[-1] in draft.eos_ids())  # an ending EOS is not fed back
    if steps == 0:
        raise RankkitError("the draft answered with EOS at once: no lookahead query to score with")
    passes = [
        Pass.prefill("draft", prefill.live_tokens),
        Pass(
            LOOKAHEAD,
            [1] * (steps * draft.num_layers),
            [length + step + 1 for step in range(steps) for _ in range(draft.num_layers)],
            heads=steps + 1,  # each step's, and the prefill's that chose the first token
        ),
    ]
    # a copy: a kept graph's next lookahead writes these rows again (``AnswerAttention.replayed_as``)
    return attention.token_maxima[:steps].clone(), passes


def eq3(lookahead: torch.Tensor) -> torch.Tensor:
    """Eq. 3 from lookahead scores [k, ..., T]: max over layers and heads, mean over the k queries.

    A key no layer of the draft could see from a query (NaN: outside every local window the
    draft has) had no attention from it: it counts as 0, so it ranks under every key the
    draft attended to, where a NaN would have ranked first. A [T] array is taken as already
    aggregated.
    """
    if lookahead.ndim == 1:
        return lookahead.nan_to_num(nan=0.0) if lookahead.isnan().any() else lookahead
    maxima = lookahead.reshape(lookahead.shape[0], -1, lookahead.shape[-1]).amax(dim=1)
    return maxima.nan_to_num(nan=0.0).mean(dim=0)


@register
@dataclass
class SpecPrefill(Method):
    name: ClassVar[str] = "specprefill"
    draft_model: str | None = depth_field(self_draft_spec)  # default layers:⌈L/4⌉
    lookahead: int = bounded(8, 1)  # k
    kernel_size: int = bounded(1, 1)  # CLAA Table 4 lists no pooling for SpecPrefill

    def draft_scores(self, runner: Runner, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[Pass]]:
        """The draft's lookahead scores [k, T] (what a capture stores) and the draft's passes."""
        draft = draft_runner(self.bind(runner.num_layers).draft_model, runner)
        return lookahead_scores(draft, input_ids, self.lookahead)

    def prefill(self, runner, input_ids, budget):
        length = int(input_ids.numel())
        lookahead, passes = self.draft_scores(runner, input_ids)
        scores = pool_tokens(eq3(lookahead), "avg", self.kernel_size)
        forced = forced_mask(length, 1, device=scores.device)
        keep = top_k_with_forced(scores, self.kept_tokens(budget, length), forced)  # never below 1: the last token
        return reprefill_selected(runner, input_ids, keep, passes, None)

    # -- the offline face: the draft's lookahead scores a capture stored --------------------

    def captured_inputs(self):
        return [DRAFT_SCORES]

    @classmethod
    def drafted_as(cls, settings: dict) -> str:
        """The method spec ranking by the draft ``settings`` (``draft_settings``' keys) describe."""
        return f"{cls.name}:" + ",".join(f"{key}={value}" for key, value in settings.items())

    def draft_settings(self, num_layers: int) -> dict:
        """What made the lookahead scores this method ranks by (a store's ``draft`` must match it): the
        draft model and its lookahead k. The pooling applies to the stored scores, so it may differ."""
        resolved = self.resolved(num_layers)
        return {key: resolved[key] for key in ("draft_model", "lookahead")}

    def _ranking(self, captured: Captured) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 3 from the stored lookahead scores [k, ..., T] (max over layers and heads, mean over
        the k queries; a [T] array is taken as aggregated), pooled; and the forced last token."""
        lookahead = captured.get(DRAFT_SCORES, self.name).float()
        return pool_tokens(eq3(lookahead), "avg", self.kernel_size), forced_mask(captured.num_tokens, 1)

    def select_offline(self, captured: Captured, budget: Budget, *, layer=None) -> Selection:
        scores, forced = self._ranking(captured)
        return Selection(None, top_k_with_forced(scores, self.kept_tokens(budget, captured.num_tokens), forced))

    def layer_rankings(self, captured: Captured, budget: Budget) -> dict[int | None, torch.Tensor]:
        scores, forced = self._ranking(captured)
        return {None: with_forced(scores, forced)}
