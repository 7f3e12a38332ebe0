"""Speculative Prefill (Liu et al. 2025) as CLAA Eq. 3 and Appendix D.3 Listing 3 write it.

A draft model prefills the whole prompt and greedily generates k lookahead tokens; the
query of each lookahead token (fed back, as Listing 3 feeds ``next_token``) scores every
prompt token by its raw logits against the draft's prompt keys, maximised over layers
and heads and averaged over the k queries (Eq. 3; the oracle's aggregation, with the
draft's k tokens in place of the answer). The base model then re-prefills only the top
tokens at their original positions (two-pass mode). The draft's prefill and lookahead
count in TTFT and in the method's compute.

``draft_model`` is a model spec (``default``, a folder or a hub id); when it names the
model being run, that model drafts for itself.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

from rankkit.methods.base import Method, Pass, register, reprefill_selected
from rankkit.methods.selection import forced_mask, top_k_with_forced
from rankkit.oracle import AnswerAttention, average_pool
from rankkit.runner import Runner, greedy_continue

_DRAFTS: dict[tuple[str, str], Runner] = {}


@functools.cache
def _model_folder(spec: str) -> str:
    from rankkit import models

    return str(models.resolve_folder(spec))  # hashes the default model's GGUF: once per process


def draft_runner(spec: str, runner: Runner) -> Runner:
    """The runner of the draft model ``spec`` on ``runner``'s device; ``runner`` itself if it is that model."""
    from rankkit import models

    folder = _model_folder(spec)
    if str(getattr(runner.config, "_name_or_path", "")) == folder:
        return runner
    key = (folder, str(runner.device))
    if key not in _DRAFTS:
        _DRAFTS[key] = Runner(models.load(spec, device=runner.device).model)
    return _DRAFTS[key]


def lookahead_scores(
    draft: Runner, input_ids: torch.Tensor, lookahead: int
) -> tuple[torch.Tensor, list[Pass]]:
    """Eq. 3 scores [T] of the prompt from ``lookahead`` draft tokens, and the draft's passes."""
    length = int(input_ids.numel())
    attention = AnswerAttention(draft.num_layers, length)
    prefill = draft.prefill(input_ids)
    generated = greedy_continue(draft, prefill, lookahead, [attention])
    # greedy_continue feeds back every token but the last; the last one's query counts too (Listing 3)
    draft.decode_step(generated[-1], length + len(generated) - 1, prefill.cache, [attention])
    steps = len(generated)
    passes = [
        Pass.prefill("draft", prefill.live_tokens),
        Pass(
            "lookahead",
            [1] * (steps * draft.num_layers),
            [length + step + 1 for step in range(steps) for _ in range(draft.num_layers)],
        ),
    ]
    return attention.mean, passes


@register
@dataclass
class SpecPrefill(Method):
    name: ClassVar[str] = "specprefill"
    draft_model: str = "default"
    lookahead: int = 8  # k
    kernel_size: int = 1  # CLAA Table 4 lists no pooling for SpecPrefill

    def prefill(self, runner, input_ids, budget):
        length = int(input_ids.numel())
        scores, passes = lookahead_scores(draft_runner(self.draft_model, runner), input_ids, self.lookahead)
        scores = average_pool(scores, self.kernel_size)
        keep = top_k_with_forced(scores, budget.resolve(length, always_kept=1), forced_mask(length, 1))
        return reprefill_selected(runner, input_ids, keep.to(runner.device), passes, None)
