"""Data spec strings: which examples to load.

    niah:length=N[,n=K][,depths=D1;D2;...][,seed=S]
    ruler:task=NAME,length=N[,n=K][,seed=S]
    PATH.jsonl[:n=K]

``length`` is the whole prompt's size in tokens of the given tokenizer. niah makes
``n`` independent examples (a haystack and a needle each, depths spread over 0..100%),
or with ``depths`` one needle in one haystack at every depth listed (then ``n`` may be
left out; ``rankkit.data.niah``). ``seed`` defaults to 0; the same spec and tokenizer give the same examples.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from rankkit import outputs
from rankkit.checks import check_prompt_lengths, check_spec_length, first_repeated
from rankkit.data.example import Example
from rankkit.data.jsonl import export_jsonl, load_jsonl, missing_data_file
from rankkit.data.niah import niah_examples
from rankkit.data.ruler import RULER_VERSION, TASKS, ruler_examples
from rankkit.errors import RankkitError

KEYS = {
    "niah": ("n", "length", "depths", "seed"),
    "ruler": ("task", "n", "length", "seed"),
    "jsonl": ("n",),
}
_JSONL_SPEC = re.compile(r"(?P<path>.*?\.jsonl)(?::(?P<params>.*))?")
USAGE = "use niah:length=N,n=K, ruler:task=NAME,length=N,n=K, or PATH.jsonl[:n=K]"


def spec_text(spec: str | os.PathLike) -> str:
    """A data spec as text: a path (``Path("ex.jsonl")``) is the spec of its file. Every call taking a
    spec reads it here first, so what it records (a store's meta, a journal's identity) is the text."""
    if isinstance(spec, os.PathLike):
        return os.fspath(spec)
    if not isinstance(spec, str):
        raise RankkitError(f"a data spec is a string or a path, not {type(spec).__name__} {spec!r}; {USAGE}")
    return spec


def parse_spec(spec: str | os.PathLike) -> tuple[str, dict[str, str]]:
    """(kind, parameters) of a spec, keys checked; a jsonl spec's parameters include its ``path``."""
    spec = spec_text(spec).strip()
    if ".jsonl" in spec:
        jsonl = _JSONL_SPEC.fullmatch(spec)
        if jsonl is None:
            raise RankkitError(f"cannot read data spec '{spec}': after .jsonl only ':n=K' may follow")
        return "jsonl", {**_parameters("jsonl", spec, jsonl["params"] or ""), "path": jsonl["path"]}
    kind, _, rest = spec.partition(":")
    if kind not in ("niah", "ruler"):
        raise RankkitError(f"unknown data kind '{kind}' in '{spec}'; {USAGE}")
    return kind, _parameters(kind, spec, rest)


def format_spec(kind: str, params: dict[str, object]) -> str:
    """The spec string of ``kind`` (niah or ruler) with ``params``, keys in their usual order and
    ``depths`` joined by ';', None meaning not given: ``format_spec("ruler", {"task": "vt", "length": 2048})``
    is "ruler:task=vt,length=2048". ``read_spec`` checks it like any spec."""
    if kind not in ("niah", "ruler"):
        raise RankkitError(f"unknown data kind '{kind}'; {USAGE}")
    unknown = [key for key, value in params.items() if value is not None and key not in KEYS[kind]]
    if unknown:
        raise RankkitError(f"{kind} does not take {', '.join(unknown)}; its keys are {', '.join(KEYS[kind])}")
    items = [
        f"{key}={';'.join(f'{depth:g}' for depth in params[key]) if key == 'depths' else params[key]}"
        for key in KEYS[kind]
        if params.get(key) is not None
    ]
    return f"{kind}:{','.join(items)}"


def _parameters(kind: str, spec: str, text: str) -> dict[str, str]:
    params: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, equals, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not equals or not key or not value:
            raise RankkitError(f"expected key=value, got '{item}' in data spec '{spec}'")
        if key not in KEYS[kind]:
            raise RankkitError(
                f"{kind} does not take '{key}' (in '{spec}'); its keys are {', '.join(KEYS[kind])}"
            )
        if key in params:
            raise RankkitError(f"'{key}' is given twice in data spec '{spec}'")
        params[key] = value
    return params


def _integer(
    params: dict[str, str], key: str, spec: str, *, default: int | None = None, minimum: int = 1
) -> int:
    if key not in params:
        if default is None:
            raise RankkitError(f"data spec '{spec}' needs {key}=N; {USAGE}")
        return default
    try:
        value = int(params[key])
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise RankkitError(f"{key} must be an integer >= {minimum}, got '{params[key]}' in '{spec}'")
    return value


def _depths(params: dict[str, str], spec: str) -> list[float] | None:
    if "depths" not in params:
        return None
    try:
        depths = [float(depth) for depth in params["depths"].split(";")]
    except ValueError:
        depths = []
    if not depths or not all(0 <= depth <= 100 for depth in depths):
        raise RankkitError(
            f"depths must be percentages in 0..100 separated by ';' (e.g. depths=10;50;90), "
            f"got '{params['depths']}' in '{spec}'"
        )
    twice = first_repeated(depths)
    if twice is not None:  # the two examples would be one, counted twice
        raise RankkitError(f"depths names {twice:g} twice in '{spec}'; list each depth once")
    return depths


@dataclass(frozen=True)
class DataSpec:
    """A data spec with every value read and checked; building its examples needs only a tokenizer."""

    kind: str  # niah, ruler or jsonl
    spec: str
    path: str | None = None  # jsonl
    n: int | None = None  # the first n lines of a jsonl; the examples of ruler
    length: int | None = None  # prompt tokens of niah and ruler
    depths: tuple[float, ...] | None = None  # niah's depth sweep
    task: str | None = None  # ruler
    seed: int = 0


def read_spec(spec: str) -> DataSpec:
    """Check every key and value of ``spec`` (no tokenizer, no model): a bad spec fails before any loading."""
    kind, params = parse_spec(spec)
    if kind == "jsonl":
        n = _integer(params, "n", spec) if "n" in params else None
        return DataSpec(kind, spec, path=params["path"], n=n)
    length = _integer(params, "length", spec)
    seed = _integer(params, "seed", spec, default=0, minimum=0)
    if kind == "niah":
        depths = _depths(params, spec)
        if depths is None:
            return DataSpec(kind, spec, n=_integer(params, "n", spec, default=1), length=length, seed=seed)
        if "n" in params and _integer(params, "n", spec) != len(depths):
            raise RankkitError(
                f"n={params['n']} but {len(depths)} depths are listed in '{spec}'; give one of them"
            )
        return DataSpec(kind, spec, length=length, depths=tuple(depths), seed=seed)
    if "task" not in params:
        raise RankkitError(f"'{spec}' needs task=NAME, one of {', '.join(TASKS)}")
    if params["task"] not in TASKS:
        raise RankkitError(f"unknown RULER task '{params['task']}'; choose one of {', '.join(TASKS)}")
    n = _integer(params, "n", spec, default=1)
    return DataSpec(kind, spec, n=n, length=length, task=params["task"], seed=seed)


def data_fingerprint(spec: str) -> dict[str, str | int]:
    """What identifies a spec's examples beyond the spec itself: a jsonl file's content hash
    (``data_sha256``), since a run resumed after the file changed would mix two datasets under one
    name; the generator's version for ruler (``ruler_version``), whose same spec made other
    examples before; nothing for niah, whose spec makes its examples."""
    parsed = read_spec(spec)
    if parsed.kind == "ruler":
        return {"ruler_version": RULER_VERSION}
    if parsed.kind != "jsonl":
        return {}
    path = Path(parsed.path)
    if not path.is_file():
        raise RankkitError(missing_data_file(path))
    # a sweep asks once per unit of every stage: the file is read again only once it changed
    found = path.stat()
    identity = (str(path.resolve()), found.st_ino, found.st_size, found.st_mtime_ns)
    if identity not in _FILE_HASHES:
        try:
            _FILE_HASHES[identity] = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as error:
            raise RankkitError(outputs.read_failure(path, error)) from None
    return {"data_sha256": _FILE_HASHES[identity]}


_FILE_HASHES: dict[tuple[str, int, int, int], str] = {}  # a data file's sha256 by its identity on disk


def load_examples(spec: str, tokenizer) -> list[Example]:
    """The examples a spec names, at least one, each with an id a store can hold (a JSONL file's are
    checked as it is read); ``tokenizer`` (a HF tokenizer) measures synthetic lengths."""
    data = read_spec(spec)
    if data.kind == "jsonl":
        examples = load_jsonl(data.path, limit=data.n)
        if data.n is not None and len(examples) < data.n:  # a run would count fewer than the spec names
            raise RankkitError(
                f"{data.path} holds {len(examples)} example(s), fewer than n={data.n} in '{spec}'; "
                f"give n={len(examples)} or leave n out"
            )
        return examples
    if tokenizer is None:
        raise RankkitError(
            f"'{spec}' is fitted to a length in tokens: pass a tokenizer (e.g. --model default)"
        )
    if data.kind == "niah":
        depths = None if data.depths is None else list(data.depths)
        return niah_examples(tokenizer, length=data.length, n=data.n, depths=depths, seed=data.seed)
    return ruler_examples(tokenizer, task=data.task, n=data.n, length=data.length, seed=data.seed)


def export_spec(
    spec: str | os.PathLike,
    tokenizer,
    path: str | Path,
    *,
    overwrite: bool = False,
    config=None,
    allow_overlength: bool = False,
) -> int:
    """Write the examples of ``spec`` to a JSONL file that loads back to the same examples; returns their count.

    An existing ``path`` is replaced only with ``overwrite``; the spec's own file never is. With the
    ``config`` of the model ``tokenizer`` is of, a prompt longer than its positions is refused as
    capture refuses it (unless ``allow_overlength``), before the file is written.
    """
    spec = spec_text(spec)
    outputs.claim([path], overwrite=overwrite, inputs=[read_spec(spec).path])
    if config is not None:
        check_spec_length(spec, config, allow_overlength=allow_overlength)
    examples = load_examples(spec, tokenizer)
    if config is not None:
        check_prompt_lengths(tokenizer, examples, config, allow_overlength=allow_overlength)
    export_jsonl(examples, path, overwrite=overwrite)
    return len(examples)
