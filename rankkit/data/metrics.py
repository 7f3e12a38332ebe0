"""Answer metrics: RULER's string matches and LongBench's metrics, each scoring in [0, 1].

Every metric takes the prediction and all reference answers. RULER's metrics use
the answers together; LongBench's score each reference and keep the best, as
LongBench's ``scorer`` does. Where LongBench leans on a library, the behaviour of
the version it names is reproduced here:

- ``rouge_l`` is the ``rouge`` package's ROUGE-L (pltrdy, 1.0.x): sentences split on
  ".", words on single spaces, case kept, and the union-LCS counted over *distinct*
  words; an empty prediction scores 0 (the package raises, LongBench returns 0);
- ``code_sim`` is fuzzywuzzy's ``fuzz.ratio`` without python-Levenshtein, i.e.
  difflib's ``SequenceMatcher`` ratio rounded to a whole percent;
- the Chinese metrics segment words with ``jieba``, which must be installed.
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

from rankkit.data.example import Example
from rankkit.errors import RankkitError

# --- RULER ---


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """Fraction of the answers found in the prediction (case-insensitive substring)."""
    if not answers:
        return 0.0
    found = prediction.lower()
    return sum(answer.lower() in found for answer in answers) / len(answers)


def string_match_part(prediction: str, answers: Sequence[str]) -> float:
    """1 if any answer is found in the prediction (case-insensitive substring)."""
    found = prediction.lower()
    return float(any(answer.lower() in found for answer in answers))


# --- LongBench: one reference at a time ---


def _normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (SQuAD's normalisation)."""
    text = "".join(char for char in text.lower() if char not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


_ZH_PUNCTUATION = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."


def _normalize_zh_answer(text: str) -> str:
    text = "".join(char for char in text.lower() if char not in string.punctuation + _ZH_PUNCTUATION)
    return "".join(text.split())


def _token_f1(prediction_tokens: Sequence[str], reference_tokens: Sequence[str]) -> float:
    same = sum((Counter(prediction_tokens) & Counter(reference_tokens)).values())
    if same == 0:
        return 0.0
    precision = same / len(prediction_tokens)
    recall = same / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def _qa_f1(prediction: str, reference: str) -> float:
    return _token_f1(_normalize_answer(prediction).split(), _normalize_answer(reference).split())


def _jieba_words(text: str) -> list[str]:
    try:
        import jieba
    except ImportError as error:
        raise RankkitError(
            "LongBench's Chinese metrics segment words with jieba: pip install jieba"
        ) from error
    return list(jieba.cut(text, cut_all=False))


def _qa_f1_zh(prediction: str, reference: str) -> float:
    def tokens(text: str) -> list[str]:
        return [word for word in map(_normalize_zh_answer, _jieba_words(text)) if word]

    return _token_f1(tokens(prediction), tokens(reference))


def _rouge_sentences(text: str) -> list[list[str]]:
    """Sentences as the rouge package cuts them, each a list of words."""
    return [" ".join(piece.split()).split(" ") for piece in text.split(".") if piece]


def _lcs_words(reference: list[str], candidate: list[str]) -> set[str]:
    """Words of one longest common subsequence, traced back with the rouge package's tie-breaking."""
    rows, cols = len(reference), len(candidate)
    table = [[0] * (cols + 1) for _ in range(rows + 1)]
    for i in range(1, rows + 1):
        for j in range(1, cols + 1):
            if reference[i - 1] == candidate[j - 1]:
                table[i][j] = table[i - 1][j - 1] + 1
            else:
                table[i][j] = max(table[i - 1][j], table[i][j - 1])
    words, i, j = set(), rows, cols
    while i and j:
        if reference[i - 1] == candidate[j - 1]:
            words.add(reference[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def _rouge_l(prediction: str, reference: str) -> float:
    candidate, gold = _rouge_sentences(prediction), _rouge_sentences(reference)
    if not candidate or not gold:
        return 0.0
    union: set[str] = set()
    for gold_sentence in gold:
        for candidate_sentence in candidate:
            union |= _lcs_words(gold_sentence, candidate_sentence)
    recall = len(union) / len({word for sentence in gold for word in sentence})
    precision = len(union) / len({word for sentence in candidate for word in sentence})
    return 2 * precision * recall / (precision + recall + 1e-8)


def _rouge_l_zh(prediction: str, reference: str) -> float:
    return _rouge_l(" ".join(_jieba_words(prediction)), " ".join(_jieba_words(reference)))


def _classification(prediction: str, reference: str, all_classes: Sequence[str]) -> float:
    matches = [name for name in all_classes if name in prediction]
    # LongBench drops classes that are only part of the reference while iterating over
    # the same list, which skips the class after each one dropped; kept so scores match
    index = 0
    while index < len(matches):
        if matches[index] in reference and matches[index] != reference:
            del matches[index]
        index += 1
    return 1.0 / len(matches) if reference in matches else 0.0


def _numbers_match(prediction: str, number: str) -> float:
    """Share of the numbers in the prediction that equal ``number``."""
    numbers = re.findall(r"\d+", prediction)
    return sum(found == number for found in numbers) / len(numbers) if numbers else 0.0


def _retrieval(prediction: str, reference: str, label: str = "Paragraph ") -> float:
    paragraph = re.search(re.escape(label) + r"(\d+)", reference)
    return _numbers_match(prediction, paragraph.group(1)) if paragraph else 0.0


def _retrieval_zh(prediction: str, reference: str) -> float:
    return _retrieval(prediction, reference, label="段落")


def _count(prediction: str, reference: str) -> float:
    return _numbers_match(prediction, str(reference))


def _fuzz_ratio(first: str, second: str) -> int:
    """fuzzywuzzy's ``fuzz.ratio``: its checks for equal and empty strings give what difflib does."""
    return int(round(100 * difflib.SequenceMatcher(None, first, second).ratio()))


def _code_sim(prediction: str, reference: str) -> float:
    """Similarity of the first line of code, skipping lines with fences or comments."""
    lines = prediction.lstrip("\n").split("\n")
    first_code_line = next((line for line in lines if not any(mark in line for mark in ("`", "#", "//"))), "")
    return _fuzz_ratio(first_code_line, reference) / 100


def _best_of(per_reference: Callable[[str, str], float]) -> Callable[[str, Sequence[str]], float]:
    """Score against each reference and keep the best, as LongBench's scorer does."""

    def metric(prediction: str, answers: Sequence[str]) -> float:
        return max((per_reference(prediction, answer) for answer in answers), default=0.0)

    metric.__name__ = per_reference.__name__.lstrip("_")
    metric.__doc__ = per_reference.__doc__
    return metric


def classification(prediction: str, answers: Sequence[str], all_classes: Sequence[str] = ()) -> float:
    """LongBench's classification score; without ``all_classes`` the answers stand for the classes."""
    classes = all_classes or answers
    return max((_classification(prediction, answer, classes) for answer in answers), default=0.0)


qa_f1 = _best_of(_qa_f1)
qa_f1_zh = _best_of(_qa_f1_zh)
rouge_l = _best_of(_rouge_l)
rouge_l_zh = _best_of(_rouge_l_zh)
retrieval = _best_of(_retrieval)
retrieval_zh = _best_of(_retrieval_zh)
count = _best_of(_count)
code_sim = _best_of(_code_sim)

METRICS: dict[str, Callable[..., float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "qa_f1": qa_f1,
    "qa_f1_zh": qa_f1_zh,
    "rouge_l": rouge_l,
    "rouge_l_zh": rouge_l_zh,
    "classification": classification,
    "retrieval": retrieval,
    "retrieval_zh": retrieval_zh,
    "count": count,
    "code_sim": code_sim,
}


def score(example: Example, prediction: str) -> float:
    """The example's metric on ``prediction``, in [0, 1]."""
    if example.metric not in METRICS:
        raise RankkitError(
            f"unknown metric '{example.metric}' in example {example.id}; use one of {', '.join(METRICS)}"
        )
    if example.meta.get("first_line_only"):  # LongBench keeps only the first line for few-shot tasks
        prediction = prediction.lstrip("\n").split("\n")[0]
    if example.metric == "classification":
        return classification(prediction, example.answers, tuple(example.meta.get("all_classes") or ()))
    return METRICS[example.metric](prediction, example.answers)
