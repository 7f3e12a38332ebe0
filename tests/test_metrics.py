"""Metrics on cases worked out by hand (RULER's string matches, LongBench's metrics)."""

import sys
import types
import warnings

import pytest
from hypothesis import example as known_case
from hypothesis import given, settings
from hypothesis import strategies as st

from rankkit.data import METRICS, Example, score
from rankkit.errors import RankkitError


def metric(name: str, prediction: str, *answers: str) -> float:
    return METRICS[name](prediction, answers)


def test_string_match_all_is_the_fraction_of_answers_found_ignoring_case():
    assert metric("string_match_all", "The numbers are 123 and 456.", "123", "456", "789") == pytest.approx(
        2 / 3
    )
    assert metric("string_match_all", "DOLORES PARK, with a sandwich", "sandwich", "Dolores Park") == 1.0
    assert metric("string_match_all", "anything") == 0.0


def test_string_match_part_needs_any_one_answer():
    assert metric("string_match_part", "It is in france.", "France", "French Republic") == 1.0
    assert metric("string_match_part", "It is in Spain.", "France", "French Republic") == 0.0


def test_qa_f1_by_hand():
    # "the cat sat" -> [cat, sat]; "a cat sat down" -> [cat, sat, down]
    # precision 2/2, recall 2/3, F1 = 2 * 1 * 2/3 / (1 + 2/3) = 0.8
    assert metric("qa_f1", "the cat sat", "a cat sat down") == pytest.approx(0.8)
    # punctuation, case and articles do not count; the best reference wins
    assert metric("qa_f1", "The Cat, sat!", "dog", "cat sat") == pytest.approx(1.0)
    assert metric("qa_f1", "nothing in common", "cat sat") == 0.0


def test_rouge_l_counts_distinct_words_of_the_lcs():
    # LCS("the cat is on the mat", "the cat sat on the mat") = the cat on the mat -> distinct
    # {the, cat, on, mat} = 4; distinct words: reference 5, prediction 5 -> P = R = F = 0.8
    assert metric("rouge_l", "the cat sat on the mat", "the cat is on the mat") == pytest.approx(
        0.8, abs=1e-7
    )
    # summary level: each reference sentence meets every predicted sentence, so the
    # union of LCS words is {a, b, c, d} although the sentences are paired differently
    assert metric("rouge_l", "a b. c d", "a c. b d") == pytest.approx(1.0, abs=1e-7)
    # one common word out of two on each side
    assert metric("rouge_l", "b a", "a b") == pytest.approx(0.5, abs=1e-7)
    # case is kept, and an empty prediction scores 0 (the rouge package raises there)
    assert metric("rouge_l", "The", "the") == 0.0
    assert metric("rouge_l", "", "the cat") == 0.0


def test_classification_splits_credit_and_drops_classes_inside_the_reference():
    classes = ("Location", "Human being", "Human")
    # "Human" is part of the reference "Human being", so it is dropped
    assert METRICS["classification"]("Human being", ("Human being",), classes) == 1.0
    assert METRICS["classification"]("Location or Human being", ("Human being",), classes) == 0.5
    assert METRICS["classification"]("Entity", ("Human being",), classes) == 0.0
    # LongBench removes while iterating, skipping the class after a dropped one:
    # [ab, abc, abcd] -> drop ab, skip abc -> [abc, abcd] -> 1/2
    assert METRICS["classification"]("abcd", ("abcd",), ("ab", "abc", "abcd")) == 0.5
    # the first class matched is checked too: "Human", inside "Human being", goes
    assert METRICS["classification"]("Human being", ("Human being",), ("Human", "Human being")) == 1.0
    assert METRICS["classification"]("Human being", ()) == 0.0  # no answer: nothing to credit


def test_retrieval_and_count_reward_the_right_number_among_all_numbers():
    assert metric("retrieval", "Paragraph 12", "Paragraph 12") == 1.0
    assert metric("retrieval", "Paragraph 12 or Paragraph 3", "Paragraph 12") == 0.5
    assert metric("retrieval", "I do not know", "Paragraph 12") == 0.0
    assert metric("retrieval", "Paragraph 12", "the twelfth") == 0.0  # a reference naming no paragraph
    assert metric("retrieval_zh", "段落5", "段落5") == 1.0
    assert metric("count", "There are 7 unique paragraphs.", "7") == 1.0
    assert metric("count", "7 or 8", "7") == 0.5


def test_code_sim_takes_the_first_code_line_and_rounds_to_a_percent():
    prediction = "```python\n# the next line\nx = foo(1)\n```"
    assert metric("code_sim", prediction, "x = foo(1)") == 1.0
    # difflib ratio 2 * 3 matches / 8 chars = 0.75; 2 * 2 / 6 = 0.667 -> 67%
    assert metric("code_sim", "abcd", "abce") == 0.75
    assert metric("code_sim", "abc", "abd") == 0.67
    assert metric("code_sim", "# only a comment", "x = 1") == 0.0
    assert metric("code_sim", "\n\nXY = 1", "XY = 1") == 1.0  # only newlines are stripped before the first line


def test_chinese_metrics_segment_with_jieba(monkeypatch):
    def one_char_words(text, cut_all):
        assert cut_all is False  # jieba's accurate mode, as LongBench's: its full mode adds overlapping words
        return iter(text)

    monkeypatch.setitem(sys.modules, "jieba", types.SimpleNamespace(cut=one_char_words))
    # punctuation is dropped after segmentation: [北, 京] against [北, 京]
    assert metric("qa_f1_zh", "北京。", "北京") == 1.0
    # [北, 京, 市] against [北, 京]: P = 2/3, R = 1 -> F1 = 0.8
    assert metric("qa_f1_zh", "北京市", "北京") == pytest.approx(0.8)
    assert metric("rouge_l_zh", "北京", "北京") == pytest.approx(1.0, abs=1e-7)


def test_chinese_words_lose_their_punctuation_and_spaces_and_are_lower_cased(monkeypatch):
    """Words of several characters, segmented at "|": each normalised whole (LongBench's normalize_zh_answer)."""
    monkeypatch.setitem(sys.modules, "jieba", types.SimpleNamespace(cut=lambda text, cut_all: iter(text.split("|"))))
    assert metric("qa_f1_zh", "北 京，|市", "北京|市") == 1.0
    # [北京, 市] against [北京]: P = 1/2, R = 1 -> F1 = 2/3; a word of punctuation alone is dropped
    assert metric("qa_f1_zh", "北京|市|。", "北京") == pytest.approx(2 / 3)
    # lower case, not upper: "ß" stays itself where upper case would make it "SS", as "ss" is
    assert metric("qa_f1_zh", "Beijing", "beijing") == 1.0 and metric("qa_f1_zh", "ß", "ss") == 0.0


def test_chinese_metrics_without_jieba_say_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "jieba", None)  # makes `import jieba` fail
    with pytest.raises(RankkitError, match="pip install jieba"):
        metric("qa_f1_zh", "北京", "北京")


def example(**fields) -> Example:
    return Example(**{"id": "x", "task": "t", "context": "", "question": "", "answers": ("yes",), **fields})


def test_score_uses_the_example_metric_and_longbench_conventions():
    assert score(example(answers=("1234", "5678")), "1234 only") == 0.5
    assert score(example(metric="qa_f1", answers=("cat",)), "cat") == 1.0
    # few-shot LongBench tasks are scored on the first line only
    first_line = example(metric="qa_f1", answers=("Paris",), meta={"first_line_only": True})
    assert score(first_line, "\nParis\nQuestion: what is the capital of Spain?") == 1.0
    # only leading newlines go: a first line of spaces is the line scored; the line is scored whole
    assert score(first_line, " \nParis") == 0.0
    tower = example(metric="qa_f1", answers=("Xavier tower",), meta={"first_line_only": True})
    assert score(tower, "\nXavier tower\nmore") == 1.0
    # classification reads its classes from the example
    classified = example(
        metric="classification", answers=("Location",), meta={"all_classes": ["Location", "Entity"]}
    )
    assert score(classified, "Location or Entity") == 0.5
    assert score(classified, "Entity") == 0.0  # a class that is not the answer earns nothing


def test_score_rejects_an_unknown_metric():
    with pytest.raises(RankkitError, match="unknown metric 'bleu'"):
        score(example(metric="bleu"), "yes")


# Sentences of a few words, where a longest common subsequence repeats words and ties (which of two
# the package traces back changes the distinct words counted), and text of odd spacing, newlines,
# full stops and comment marks: what the metrics must split, count and break as the packages
# LongBench scores with do.
_SENTENCES = st.lists(st.lists(st.sampled_from(["a", "b", "c", "cat"]), max_size=6).map(" ".join), max_size=3).map(". ".join)
_ODD_TEXT = st.lists(st.sampled_from(["a", "b", "cat", "The", " ", "  ", ".", "\n", "#", "`", "//"]), max_size=14).map("".join)
_TEXT = st.one_of(_SENTENCES, _ODD_TEXT)


def _longbench_rouge_l(prediction: str, reference: str) -> float:
    """LongBench's ROUGE-L: the rouge package's F of one pair, 0 where the package refuses the pair."""
    from rouge import Rouge

    try:
        return Rouge().get_scores([prediction], [reference], avg=True)["rouge-l"]["f"]
    except ValueError:  # "Hypothesis is empty." or "Reference is empty."
        return 0.0


def _longbench_code_sim(prediction: str, reference: str) -> float:
    """LongBench's code similarity: fuzzywuzzy's ratio of the first line without a fence or a comment."""
    with warnings.catch_warnings():  # fuzzywuzzy warns that it runs without python-Levenshtein, as LongBench's does
        warnings.simplefilter("ignore")
        from fuzzywuzzy import fuzz
    lines = prediction.lstrip("\n").split("\n")
    first = next((line for line in lines if "`" not in line and "#" not in line and "//" not in line), "")
    return fuzz.ratio(first, reference) / 100


@settings(max_examples=500, deadline=None)
@given(prediction=_TEXT, reference=_TEXT)
@known_case(prediction="b c a a", reference="a a b c")  # LCS "a a" or "b c": the package traces back "b c"
@known_case(prediction="", reference="")
def test_rouge_l_and_code_sim_equal_the_packages_longbench_scores_with(prediction, reference):
    assert metric("rouge_l", prediction, reference) == pytest.approx(_longbench_rouge_l(prediction, reference), abs=1e-12)
    assert metric("code_sim", prediction, reference) == _longbench_code_sim(prediction, reference)
