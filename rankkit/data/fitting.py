"""Fit synthetic examples to a prompt length in tokens, and assemble contexts with evidence spans.

``length=N`` bounds the whole built prompt (chat template included): the fitter
looks for the largest haystack whose prompt has at most N tokens, measuring with
the real tokenizer, and stops once it is within ``TOLERANCE`` of N.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rankkit.data.example import Example
from rankkit.errors import RankkitError
from rankkit.prompting import example_prompt

TOLERANCE = 0.01
# Regula falsi can crawl when the token count is not quite linear in the size; every
# few steps a bisection halves the bracket so the search always ends quickly.
_BISECT_EVERY = 3
_MAX_STEPS = 64
_FIRST_PROBE_UNITS = 8  # without a guess, the first step only measures tokens per unit

# A text piece and the evidence span inside it (relative to the piece), if any.
Piece = tuple[str, tuple[int, int] | None]


def prompt_tokens(tokenizer, example: Example) -> int:
    return example_prompt(tokenizer, example).num_tokens


def fit_to_length(
    build: Callable[[int], Example],
    tokenizer,
    target: int,
    *,
    min_size: int,
    max_size: int,
    guess: int | None = None,
) -> tuple[Example, int]:
    """The example ``build(size)`` with the largest size whose prompt fits in ``target`` tokens.

    ``build`` must be deterministic and its prompt must grow with ``size``. Returns
    the example (its meta gains ``prompt_tokens``) and the size, a good ``guess``
    for the next example of the same kind.
    """
    measured: dict[int, tuple[Example, int]] = {}

    def measure(size: int) -> int:
        example = build(size)
        measured[size] = (example, prompt_tokens(tokenizer, example))
        return measured[size][1]

    lo, lo_tokens = min_size, measure(min_size)
    if lo_tokens > target:
        raise RankkitError(
            f"length={target} is too short for this task: its smallest prompt takes {lo_tokens} tokens; "
            f"ask for length >= {lo_tokens}"
        )
    hi, hi_tokens = max_size + 1, None  # hi: smallest size known not to fit
    aim = target * (1 - TOLERANCE / 2)
    size = guess
    for step in range(_MAX_STEPS):
        if lo_tokens >= target * (1 - TOLERANCE) or hi - lo <= 1:
            break
        if size is None:
            if hi_tokens is not None and step % _BISECT_EVERY == _BISECT_EVERY - 1:
                size = (lo + hi) // 2
            else:
                size = _secant_step(lo, lo_tokens, measured, aim)
        size = min(max(size, lo + 1), hi - 1)
        tokens = measure(size)
        if tokens <= target:
            lo, lo_tokens = size, tokens
        else:
            hi, hi_tokens = size, tokens
        size = None
    example, tokens = measured[lo]
    return dataclasses.replace(example, meta={**example.meta, "prompt_tokens": tokens}), lo


def _secant_step(lo: int, lo_tokens: int, measured: dict[int, tuple[Example, int]], aim: float) -> int:
    """Next size to try: along the line through ``lo`` and the nearest other measured size."""
    others = [size for size in measured if size != lo]
    if not others:
        return lo + _FIRST_PROBE_UNITS
    other = min(others, key=lambda size: abs(size - lo))
    rate = max(abs(measured[other][1] - lo_tokens), 1) / abs(other - lo)  # tokens per unit
    return lo + round((aim - lo_tokens) / rate)


def join_pieces(pieces: Sequence[Piece], separator: str) -> tuple[str, tuple[tuple[int, int], ...]]:
    """Join text pieces and return the evidence spans, shifted to the joined text."""
    parts: list[str] = []
    spans: list[tuple[int, int]] = []
    position = 0
    for index, (text, span) in enumerate(pieces):
        if index:
            parts.append(separator)
            position += len(separator)
        if span is not None:
            spans.append((position + span[0], position + span[1]))
        parts.append(text)
        position += len(text)
    return "".join(parts), tuple(spans)


def whole(text: str) -> Piece:
    """A piece that is evidence in full (a needle)."""
    return text, (0, len(text))


@dataclass(frozen=True)
class TokenizedText:
    """A long text tokenized once, so a haystack of any token count is a cheap slice."""

    text: str
    token_ends: list[int]  # char end of each token

    @classmethod
    def of(
        cls, tokenizer, text: str, min_tokens: int, separator: str = "\n\n", *, repeat: bool = True
    ) -> TokenizedText:
        """Tokenize just enough of ``text`` for ``min_tokens`` tokens, repeating it if it is too short
        (or, without ``repeat``, all of it: then it may hold fewer)."""
        source = text
        chars = min(len(source), 5 * min_tokens + 1000)
        while True:
            prefix = source[:chars]
            encoded = tokenizer(prefix, add_special_tokens=False, return_offsets_mapping=True)
            ends = [int(end) for _, end in encoded["offset_mapping"]]
            # one spare token: the last one may be cut in the middle of a word
            if len(ends) > min_tokens:
                return cls(prefix, ends)
            if chars >= len(source):
                if not repeat:
                    return cls(prefix, ends)
                source = source + separator + text  # too short: the haystack repeats, as Kamradt's does
            chars = min(len(source), 2 * chars)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ends)

    def prefix_chars(self, num_tokens: int) -> int:
        """Length of the longest prefix made of at most ``num_tokens`` tokens that ends between words."""
        if num_tokens <= 0:
            return 0
        end = self.token_ends[min(num_tokens, self.num_tokens) - 1]
        if end < len(self.text) and not self.text[end].isspace():
            end = max(self.text.rfind(" ", 0, end), self.text.rfind("\n", 0, end), 0)
        return len(self.text[:end].rstrip())

    def token_start_char(self, token_index: int) -> int:
        """Char offset where token ``token_index`` starts (the end of the token before it)."""
        return 0 if token_index <= 0 else self.token_ends[token_index - 1]


def last_boundary_at_or_before(boundaries: Sequence[int], position: int) -> int:
    """The largest boundary <= position (0 when there is none)."""
    index = bisect_right(boundaries, position)
    return boundaries[index - 1] if index else 0
