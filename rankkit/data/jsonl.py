"""Examples to and from JSONL files.

A line is either rankkit's schema, ``{id, context, question, answers}`` with optional
``task, preamble, answer_prefix, metric, meta`` and the evidence given as char
spans (``evidence``) or as text to find in the context (``needle``, one string or a
list), or a LongBench record ``{_id, context, input, answers, dataset}``.
``export_jsonl`` writes rankkit's schema in full, so loading the file gives the same
examples back.

Clusters: an example's ``meta.cluster`` names the examples it is one sample with (a shared
haystack or needle; intervals resample clusters, ``rankkit.eval.stats``). Examples that name
none but share their context, or their question and answers, get one (``jsonl-context-{hash}``
or ``jsonl-question-{hash}``, from the shared text; ``rankkit.data.clusters``), joined through
any chain of such shares among the examples loaded; one that shares nothing is its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path

from rankkit import outputs
from rankkit.data.clusters import digest, shared_clusters
from rankkit.data.example import Example
from rankkit.data.longbench import is_longbench_record, longbench_example
from rankkit.data.metrics import METRICS
from rankkit.errors import RankkitError
from rankkit.names import encode_name

REQUIRED_FIELDS = ("id", "context", "question", "answers")


def export_jsonl(examples: Iterable[Example], path: str | Path, *, overwrite: bool = True) -> None:
    """The examples as one JSON object a line at ``path``; without ``overwrite``, never over a file there."""
    lines = (json.dumps(example.to_record(), ensure_ascii=False) + "\n" for example in examples)
    outputs.write_text("".join(lines), path, overwrite=overwrite)


def load_jsonl(path: str | Path, limit: int | None = None) -> list[Example]:
    """The examples in a JSONL file (the first ``limit`` of them when given)."""
    path = Path(path)
    if not path.is_file():
        raise RankkitError(missing_data_file(path))
    examples: list[Example] = []
    first_line: dict[str, int] = {}  # example id -> the line that gave it
    for number, line in _numbered_lines(path):
        if limit is not None and len(examples) >= limit:
            break
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise RankkitError(
                f"{where}:{error.colno}: not valid JSON ({error.msg}); fix or remove that line"
            ) from None
        if not isinstance(record, dict):
            raise RankkitError(f"{where}: each line must be a JSON object")
        longbench = is_longbench_record(record)
        _check_types(record, LONGBENCH_FIELD_TYPES if longbench else FIELD_TYPES, where)
        example = longbench_example(record, where) if longbench else _example(record, where)
        _check_example(example, where)
        if example.id in first_line:
            raise RankkitError(
                f"{where}: id {example.id!r} is also on line {first_line[example.id]}; "
                "every example needs its own id"
            )
        first_line[example.id] = number
        examples.append(example)
    if not examples:
        raise RankkitError(f"{path} holds no example; give a file with one JSON object per line")
    return _clustered(examples)


def _clustered(examples: list[Example]) -> list[Example]:
    """``examples`` with a cluster for those that name none but share a context or a question
    and its answers with another (see the module's docstring)."""
    unnamed = [index for index, example in enumerate(examples) if example.meta.get("cluster") is None]
    units = [
        (
            f"jsonl-context-{digest(examples[index].context)}",
            f"jsonl-question-{digest(json.dumps([examples[index].question, sorted(examples[index].answers)]))}",
        )
        for index in unnamed
    ]
    clustered = list(examples)
    for index, (cluster, size) in zip(unnamed, shared_clusters(units), strict=True):
        if size > 1:
            example = examples[index]
            clustered[index] = dataclasses.replace(example, meta={**example.meta, "cluster": cluster})
    return clustered


def read_context_file(path: str | Path) -> str:
    """A ``--context-file``'s text, read as a JSONL file is: UTF-8 checked by line, an empty one refused."""
    path = Path(path)
    text = "".join(line for _, line in _numbered_lines(path))
    if not text.strip():
        raise RankkitError(f"--context-file {path} is empty; give a file holding the context")
    return text


def context_text(context: str | None, context_file: str | os.PathLike | None) -> str | None:
    """A prompt's context as the Python API takes it: the text ``context``, or the file ``context_file``
    read as ``--context-file`` reads it (``read_context_file``); both at once is refused."""
    if context_file is None:
        return context
    if context:
        raise RankkitError("give the context as text (context=) or as a file (context_file=, --context-file), not both")
    return read_context_file(context_file)


def missing_data_file(path: Path) -> str:
    """Why a JSONL data file named in a spec cannot be used, and the fix."""
    if path.is_dir():
        return f"{path} is a directory, not a JSONL file; give the path of the file"
    return f"no such file: {path}; check the path, or write one with `rankkit data export SPEC --out {path}`"


def _numbered_lines(path: Path):
    """(line number, text) of a UTF-8 file; bytes that are not UTF-8 are named by line, a file that
    cannot be read (no permission, an I/O error) by its path."""
    try:
        with path.open("rb") as lines:
            for number, raw in enumerate(lines, start=1):
                try:
                    yield number, raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    raise RankkitError(
                        f"{path}:{number}: not UTF-8 (byte {error.start + 1}); save the file as UTF-8"
                    ) from None
    except OSError as error:
        raise RankkitError(outputs.read_failure(path, error)) from None


# What each field may hold: JSON types by name; "strings" is one string or a list of strings.
FIELD_TYPES = {
    "id": ("string", "integer"),
    "context": ("string",),
    "question": ("string",),
    "answers": ("string", "strings"),
    "task": ("string",),
    "preamble": ("string",),
    "answer_prefix": ("string",),
    "metric": ("string",),
    "meta": ("object",),
    "evidence": ("spans",),
    "needle": ("string", "strings"),
}
LONGBENCH_FIELD_TYPES = {
    "_id": ("string", "integer"),
    "context": ("string",),
    "input": ("string",),
    "answers": ("string", "strings"),
    "dataset": ("string",),
    "all_classes": ("null", "strings"),
}
_IS = {
    "string": lambda value: isinstance(value, str),
    "integer": lambda value: isinstance(value, int) and not isinstance(value, bool),
    "null": lambda value: value is None,
    "object": lambda value: isinstance(value, dict),
    "strings": lambda value: isinstance(value, list) and all(isinstance(each, str) for each in value),
    "spans": lambda value: (
        isinstance(value, list)
        and all(
            isinstance(span, list) and len(span) == 2 and all(_IS["integer"](end) for end in span)
            for span in value
        )
    ),
}
_SHOWN = {"strings": "a list of strings", "spans": "a list of [start, end] integer pairs", "null": "null"}


def _check_types(record: dict, types: dict[str, tuple[str, ...]], where: str) -> None:
    for key, allowed in types.items():
        if key in record and not any(_IS[kind](record[key]) for kind in allowed):
            wanted = " or ".join(_SHOWN.get(kind, f"a {kind}") for kind in allowed)
            raise RankkitError(f"{where}: '{key}' must be {wanted}, got {json.dumps(record[key])[:40]}")


def _check_example(example: Example, where: str) -> None:
    try:  # refused here, not by capture alone: data export wrote a file every command then refused
        encode_name(example.id)
    except RankkitError as error:
        raise RankkitError(f"{where}: {error}") from None
    if not example.context.strip():
        raise RankkitError(f"{where}: the context of example {example.id!r} is empty; give it text to read")
    texts = {
        "id": example.id,
        "context": example.context,
        "question": example.question,
        "preamble": example.preamble,
        "answer_prefix": example.answer_prefix,
        **{f"answers[{index}]": answer for index, answer in enumerate(example.answers)},
    }
    for field_name, text in texts.items():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise RankkitError(
                f"{where}: '{field_name}' holds a lone surrogate (\\u{ord(text[error.start]):04x} at "
                f"character {error.start}); write the character itself or a valid surrogate pair"
            ) from None


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
            if start > end:
                raise RankkitError(f"{where}: evidence span [{start}, {end}) ends before it starts; give [start, end]")
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
