"""Datasets: Kamradt's needle in a haystack, RULER's synthetic tasks, JSONL files (ours and LongBench's).

A spec string picks the examples (see ``rankkit.data.spec``); every example carries
its context, question, answers, the char spans of its evidence and the name of the
metric that scores it.
"""

from rankkit.data.example import Example
from rankkit.data.jsonl import context_text, export_jsonl, load_jsonl, read_context_file
from rankkit.data.metrics import METRICS, score
from rankkit.data.spec import (
    DataSpec,
    data_fingerprint,
    export_spec,
    format_spec,
    load_examples,
    parse_spec,
    read_spec,
    spec_text,
)

__all__ = [
    "data_fingerprint",
    "read_context_file",
    "context_text",
    "METRICS",
    "Example",
    "export_jsonl",
    "export_spec",
    "format_spec",
    "load_examples",
    "load_jsonl",
    "parse_spec",
    "read_spec",
    "DataSpec",
    "score",
    "spec_text",
]
