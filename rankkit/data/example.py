"""One evaluation example and its JSON form."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Example:
    """What a model is asked, what counts as right, and where the evidence sits in the context."""

    id: str
    task: str  # e.g. "niah", "ruler/niah_single_2", "longbench/hotpotqa", "jsonl"
    context: str
    question: str  # text after the context (RULER: the query sentence)
    answers: tuple[str, ...]
    preamble: str = ""  # text before the context (RULER: the task instruction)
    answer_prefix: str = ""  # appended after the generation prompt (RULER's answer prefix)
    evidence: tuple[tuple[int, int], ...] = ()  # char spans [start, end) inside context
    metric: str = "string_match_all"  # a name in rankkit.data.METRICS
    meta: dict = field(default_factory=dict)  # JSON-serialisable: depth, length target, seed...

    def evidence_texts(self) -> list[str]:
        return [self.context[start:end] for start, end in self.evidence]

    def to_record(self) -> dict:
        """The JSON object ``export_jsonl`` writes; loading that file gives this example back."""
        return {
            "id": self.id,
            "task": self.task,
            "preamble": self.preamble,
            "context": self.context,
            "question": self.question,
            "answer_prefix": self.answer_prefix,
            "answers": list(self.answers),
            "evidence": [list(span) for span in self.evidence],
            "metric": self.metric,
            "meta": self.meta,
        }
