"""A parameter's type and form as the Python API takes it: what the command line's options would have
read from text (a whole number, a switch, a comma-separated list), checked before anything runs."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from numbers import Integral, Real
from typing import Any

from rankkit.errors import RankkitError


def check_count(value: Any, option: str, minimum: int = 1) -> None:
    """A count (``--limit``, ``--repeats``) given through the Python API is refused as the command line
    refuses it: a slice by -1 or a median of no rounds would run and print the wrong thing."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise RankkitError(f"{option} must be a whole number >= {minimum}, got {value!r}")


def check_number(value: Any, option: str, *, whole: bool = False) -> None:
    """A number given through the Python API as something else (the text "3" the command line reads
    as 3) is refused naming what it got, before a comparison fails in a raw TypeError or a range
    check calls the text out of range."""
    if isinstance(value, bool) or not isinstance(value, Integral if whole else Real):
        raise RankkitError(
            f"{option} takes {'a whole number' if whole else 'a number'}, not {type(value).__name__} {value!r}"
        )


def check_flag(value: Any, option: str) -> None:
    """A switch (``--softmax``) given through the Python API must be True or False: the text "yes"
    would be stored as it is."""
    if not isinstance(value, bool):
        raise RankkitError(f"{option} must be True or False, not {type(value).__name__} {value!r}")


def comma_list(text: str | None, option: str) -> list[str]:
    """The names in a comma-separated option value; an option given but naming nothing is refused."""
    if text is None:
        return []
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise RankkitError(f"{option} {text!r} names nothing; give comma-separated names, e.g. {option} a,b")
    return names


def read_number(text: str, kind: Callable[[str], Any], option: str, fix: str) -> Any:
    """``text`` read as the command line reads a number (``kind``: int, float or ``int_or_float``);
    a refusal says what it is not (``fix``)."""
    try:
        return kind(text)
    except ValueError:
        raise RankkitError(f"{option} {text!r} is not {fix}") from None


def int_or_float(text: str) -> int | float:
    """A budget as written: a whole number is a token count (2048), anything else a keep rate (0.1)."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def as_list(value: Any, option: str, kind: Callable[[str], Any] | None = None, fix: str | None = None) -> list:
    """A list parameter of the Python API, in each form its command-line option takes: a list or
    tuple (any iterable), or one comma-separated string read as the command line reads it (each
    part by ``kind`` where it holds numbers, a part that is none refused as not ``fix``, by default
    "a number; give e.g. ..."); a single value alone (``0.1``) is a list of one."""
    if isinstance(value, str):
        names = comma_list(value, option)
        if kind is None:
            return names
        what = "a whole number" if kind is int else "a number"
        fix = fix or f"{what}; give e.g. {option} {_example(kind)}"
        return [read_number(name, kind, option, fix) for name in names]
    if isinstance(value, Iterable):
        return list(value)
    return [value]


def _example(kind: Callable[[str], Any]) -> str:
    return "0,15" if kind is int else "0.1,0.2"
