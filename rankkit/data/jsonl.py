"""Examples to and from JSONL files.

A line is either rankkit's schema, ``{id, context, question, answers}`` with optional
``task, preamble, answer_prefix, metric, meta`` and the evidence given as char
spans (``evidence``) or as text to find in the context (``needle``, one string or a
list), or a LongBench record ``{_id, context, input, answers, dataset}``.
``export_jsonl`` writes rankkit's schema in full, so loading the file gives the same
examples back.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from rankkit.data.example import Example
from rankkit.data.longbench import is_longbench_record, longbench_example
from rankkit.data.metrics import METRICS
from rankkit.errors import RankkitError

REQUIRED_FIELDS = ("id", "context", "question", "answers")


def export_jsonl(examples: Iterable[Example], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for example in examples:
            out.write(json.dumps(example.to_record(), ensure_ascii=False) + "\n")


def load_jsonl(path: str | Path, limit: int | None = None) -> list[Example]:
    """The examples in a JSONL file (the first ``limit`` of them when given)."""
    path = Path(path)
    if not path.is_file():
        raise RankkitError(f"no such file: {path}")
    examples: list[Example] = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if limit is not None and len(examples) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise RankkitError(
                    f"{where}: not valid JSON ({error.msg}); fix or remove that line"
                ) from error
            if not isinstance(record, dict):
                raise RankkitError(f"{where}: each line must be a JSON object")
            examples.append(
                longbench_example(record, where) if is_longbench_record(record) else _example(record, where)
            )
    return examples


def _example(record: dict, where: str) -> Example:
    missing = [key for key in REQUIRED_FIELDS if key not in record]
    if missing:
        raise RankkitError(
            f"{where}: missing {', '.join(missing)}; a line needs {', '.join(REQUIRED_FIELDS)} "
            "(or LongBench's _id, context, input, answers, dataset)"
        )
    context = record["context"]
    metric = record.get("metric", "string_match_all")
    if metric not in METRICS:
        raise RankkitError(f"{where}: unknown metric '{metric}'; use one of {', '.join(METRICS)}")
    answers = record["answers"]
    return Example(
        id=str(record["id"]),
        task=record.get("task", "jsonl"),
        preamble=record.get("preamble", ""),
        context=context,
        question=record["question"],
        answer_prefix=record.get("answer_prefix", ""),
        answers=(answers,) if isinstance(answers, str) else tuple(answers),
        evidence=_evidence(record, context, where),
        metric=metric,
        meta=record.get("meta", {}),
    )


def _evidence(record: dict, context: str, where: str) -> tuple[tuple[int, int], ...]:
    if "evidence" in record:
        spans = tuple((int(start), int(end)) for start, end in record["evidence"])
        for start, end in spans:
            if not 0 <= start <= end <= len(context):
                raise RankkitError(f"{where}: evidence span [{start}, {end}) is outside the context")
        return spans
    needles = record.get("needle") or []
    spans = []
    for needle in [needles] if isinstance(needles, str) else needles:
        start = context.find(needle)
        if start < 0:
            raise RankkitError(f"{where}: the needle {needle[:40]!r} is not in the context")
        spans.append((start, start + len(needle)))
    return tuple(spans)
