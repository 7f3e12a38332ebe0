"""One way to turn (context, question) into model input, with token spans.

The user turn is ``preamble + context + separator + question``; the answer prefix,
as RULER does, is appended after the generation prompt so the model continues it.
Every part's character range in the final text is tracked, and the tokenizer's
offset mapping turns any character range into a token range.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from rankkit.errors import RankkitError

_MARK = "\x00RANKKIT_USER_TURN\x00"


@dataclass(frozen=True)
class Prompt:
    """A tokenized prompt and where its parts are, in characters and tokens."""

    text: str
    input_ids: torch.Tensor  # [T] int64
    token_offsets: list[tuple[int, int]]  # per token, char range in ``text``
    context_chars: tuple[int, int]
    question_chars: tuple[int, int]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def token_span(self, start_char: int, end_char: int) -> tuple[int, int]:
        """Token range [start, end) of the tokens overlapping text[start_char:end_char]."""
        starts = [s for s, _ in self.token_offsets]
        ends = [e for _, e in self.token_offsets]
        first = bisect_right(ends, start_char)
        last = bisect_left(starts, end_char)
        return first, max(first, last)

    @property
    def context_tokens(self) -> tuple[int, int]:
        return self.token_span(*self.context_chars)

    @property
    def question_tokens(self) -> tuple[int, int]:
        return self.token_span(*self.question_chars)

    def context_token_span(self, start_in_context: int, end_in_context: int) -> tuple[int, int]:
        """Token range of a character range given relative to the context (e.g. a needle)."""
        offset = self.context_chars[0]
        return self.token_span(offset + start_in_context, offset + end_in_context)


def build_prompt(
    tokenizer,
    context: str,
    question: str,
    *,
    preamble: str = "",
    answer_prefix: str = "",
    separator: str = "\n\n",
    use_chat_template: bool | None = None,
) -> Prompt:
    """Build the prompt with the model's chat template when it has one.

    ``use_chat_template=None`` uses the template if the tokenizer defines one.
    """
    user_turn = preamble + context + separator + question
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if use_chat_template is None:
        use_chat_template = has_template
    if use_chat_template and not has_template:
        raise RankkitError("this tokenizer has no chat template; pass use_chat_template=False")
    if use_chat_template:
        wrapped = tokenizer.apply_chat_template(
            [{"role": "user", "content": _MARK}], tokenize=False, add_generation_prompt=True
        )
        head, tail = wrapped.split(_MARK)
    else:
        head, tail = "", ""
    text = head + user_turn + tail + answer_prefix
    context_start = len(head) + len(preamble)
    question_start = context_start + len(context) + len(separator)

    encoded = tokenizer(text, add_special_tokens=not use_chat_template, return_offsets_mapping=True)
    offsets = [(int(s), int(e)) for s, e in encoded["offset_mapping"]]
    return Prompt(
        text=text,
        input_ids=torch.tensor(encoded["input_ids"], dtype=torch.long),
        token_offsets=offsets,
        context_chars=(context_start, context_start + len(context)),
        question_chars=(question_start, question_start + len(question)),
    )


def example_prompt(tokenizer, example) -> Prompt:
    """The prompt of a ``rankkit.data.Example``, with its chat-template choice (LongBench prompts some without)."""
    return build_prompt(
        tokenizer,
        example.context,
        example.question,
        preamble=example.preamble,
        answer_prefix=example.answer_prefix,
        use_chat_template=example.meta.get("use_chat_template"),
    )


def check_answered(examples: Iterable[tuple[str, Sequence[str]]], follower: str, fixes: str) -> None:
    """Refuse, by id, the first of ``examples`` ((id, answers) pairs) without answers, before any is run:
    ``follower`` (the oracle's ``--answer reference``, the diffusion probe) follows each one's first."""
    for example_id, answers in examples:
        if not answers:
            raise RankkitError(f"example {example_id!r} has no answers, and {follower} follows its first; {fixes}")


def reference_answer(answers, answer_prefix: str) -> str:
    """The first gold answer as the model would continue the prompt (after an answer prefix, with its space)."""
    if not answers:
        raise RankkitError("answer='reference' needs examples with answers")
    return f" {answers[0]}" if answer_prefix else answers[0]
