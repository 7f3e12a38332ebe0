"""Checks every command runs on its options before the model loads (or before any compute)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from rankkit.errors import RankkitError


def check_layer(layer: int, num_layers: int, method: str) -> None:
    """A selection layer (``--layer``) must be one of the model's layers."""
    if not 0 <= layer < num_layers:
        raise RankkitError(
            f"--layer {layer} is not a layer of this model ({num_layers} layers, 0..{num_layers - 1}) "
            f"for method '{method}'; give a layer in that range or leave --layer out"
        )


def check_length(num_tokens: int, config, what: str, *, allow_overlength: bool = False) -> None:
    """A prompt longer than the model's ``max_position_embeddings`` is refused unless forced."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None or num_tokens <= limit:
        return
    message = f"{what} has {num_tokens} tokens, more than the model's {limit} positions"
    if not allow_overlength:
        raise RankkitError(f"{message}; shorten it, or pass --allow-overlength to run it anyway")
    warnings.warn(f"{message}; running it anyway (--allow-overlength)", stacklevel=2)


def check_token_counts(lengths: list[int]) -> None:
    """``--lengths``: the prompt lengths a measurement runs, each at least one token."""
    if not lengths or min(lengths) < 1:
        shown = ",".join(map(str, lengths)) or "nothing"
        raise RankkitError(f"--lengths takes positive token counts, not {shown}; e.g. --lengths 1024,4096")
    twice = first_repeated(lengths)
    if twice is not None:  # rows are keyed by length: one length's figures would stand for both
        raise RankkitError(f"--lengths names {twice} twice; name each length once")


def check_spec_length(data: str, config, *, allow_overlength: bool = False) -> None:
    """A synthetic data spec's ``length`` is checked against the model before anything loads. Allowed, it
    is not warned of here: its prompts' own check (``check_prompt_lengths``) warns with their lengths."""
    from rankkit.data import read_spec

    length = read_spec(data).length
    if length is not None and not allow_overlength:
        check_length(length, config, f"'{data}'")


def check_prompt_lengths(tokenizer, examples, config, *, allow_overlength: bool = False) -> list:
    """The prompts of ``examples``, each checked against the model's positions before any compute."""
    from rankkit.prompting import example_prompt

    prompts = [example_prompt(tokenizer, example) for example in examples]
    for example, prompt in zip(examples, prompts, strict=True):
        what = f"the prompt of example {example.id!r}"
        check_length(prompt.num_tokens, config, what, allow_overlength=allow_overlength)
    return prompts


def warn_clamped(budget, prompt_lengths: Sequence[int], option: str = "--budget", whole: str = "prompt") -> None:
    """A token budget larger than a prompt keeps the whole prompt: say so once for the prompts of
    ``prompt_lengths`` it exceeds, instead of clamping silently (a line per example buried the rest),
    naming the ``option`` it was given as and what it keeps the ``whole`` of (a ranked span)."""
    over = [length for length in prompt_lengths if budget.tokens is not None and budget.tokens > length]
    if over:
        longest = f"{max(over)} tokens" + (" or fewer" if len(set(over)) > 1 else "")
        warnings.warn(
            f"{option} {budget.tokens} is larger than the {whole} ({longest}); it keeps all of it "
            f"(in {len(over)} of {len(prompt_lengths)} {whole}s)",
            stacklevel=2,
        )


def warn_raised(method, budget, prompt_lengths: Sequence[int]) -> None:
    """A budget below what ``method`` always keeps (a window, sinks, a block) is raised to it
    (``Method.kept_tokens``): say so once for the prompts of ``prompt_lengths`` it raises, instead of
    labelling the rows with a budget they did not keep."""
    counts = [(budget.resolve(length), method.kept_tokens(budget, length)) for length in prompt_lengths]
    raised = [(asked, kept) for asked, kept in counts if kept > asked]
    if raised:
        asked, kept = raised[0]
        warnings.warn(
            f"{budget.label} asks for {asked} token(s), fewer than {method.name} always keeps; it keeps {kept} "
            f"(in {len(raised)} of {len(prompt_lengths)} prompts)",
            stacklevel=2,
        )


def warn_budgets(budgets, methods, prompt_lengths: Sequence[int]) -> None:
    """Warn of each of ``budgets`` above a prompt of ``prompt_lengths`` (``warn_clamped``), then below
    what each of ``methods`` always keeps (``warn_raised``): what every command that takes a budget says
    of it before it runs, once for all its prompts."""
    for budget in budgets:
        warn_clamped(budget, prompt_lengths)
    for method in methods:
        for budget in budgets:
            warn_raised(method, budget, prompt_lengths)


# what every output of a ``random:<shape>`` run says of itself
TIMING_ONLY = "timing only: random weights (random:<shape>), so answers, accuracy and rankings mean nothing"


def refuse_timing_only_store(meta: dict, path, what: str) -> None:
    """Refuse ``what`` (a comparison with the oracle, a report, a dashboard) on a store captured with
    random weights (``random:<shape>``, its meta's ``timing_only``): its rankings and oracle mean nothing."""
    if meta.get("timing_only"):
        raise RankkitError(
            f"store {path} was captured with {meta['model']['id']}, {TIMING_ONLY}: "
            f"capture a real model to {what}"
        )


def warn_timing_only_store(meta: dict, path) -> None:
    """Say so where an output is drawn from a store captured with random weights but needs no oracle
    (ASL's curves, kept positions, compare --no-oracle): the figures are right, and mean nothing."""
    if meta.get("timing_only"):
        warnings.warn(f"store {path} was captured with {meta['model']['id']}: {TIMING_ONLY}", stacklevel=3)


def check_value_ranges(frame, ranges, what: str, writer: str) -> None:
    """Refuse a frame ``writer`` wrote (a bench's, a diffusion probe's) that holds a value outside
    what it writes: ``ranges`` holds (column, lowest, highest, whether the lowest itself is out).
    Missing values pass; a file edited or damaged since is refused before it makes a figure."""
    import math

    import polars as pl

    for column, lowest, highest, lowest_out in ranges:
        if column not in frame.columns:
            continue
        value = pl.col(column).cast(pl.Float64)
        below = value <= lowest if lowest_out else value < lowest
        outside = frame.filter(value.is_not_null() & (below | (value > highest) | value.is_infinite()))
        if outside.height:
            row = outside.row(0, named=True)
            named = {"example": row.get("example_id", row.get("example")), "method": row.get("method")}
            where = ", ".join(f"{key} {name}" for key, name in named.items() if name is not None)
            opening = "(" if lowest_out or math.isinf(lowest) else "["
            bounds = f"{opening}{lowest:g}, {highest:g}{')' if math.isinf(highest) else ']'}"
            raise RankkitError(
                f"{what} holds {column} {row[column]} ({where}), outside {bounds}: not as {writer} wrote it; "
                "run it again, or pass the file it wrote"
            )


def first_repeated(items: Sequence[Any]) -> Any:
    """The first item ``items`` holds twice, or None."""
    return next((item for number, item in enumerate(items) if item in items[:number]), None)


def check_unique_rows(frame, keys: Sequence[str], what: str, writer: str) -> None:
    """Refuse a frame ``writer`` wrote in which two rows share ``keys`` (one example's row of one method and
    budget, say): a file joined with a copy of itself, whose figures would take either row at random."""
    import polars as pl

    present = [key for key in keys if key in frame.columns]
    if not present:
        return
    repeated = frame.filter(pl.struct(present).is_duplicated())
    if repeated.height:
        row = repeated.row(0, named=True)
        named = ", ".join(f"{key} {row[key]}" for key in present)
        raise RankkitError(
            f"{what} holds more than one row of {named} ({repeated.height} rows share a key); {writer} "
            "writes one each: run it again, or pass the file it wrote"
        )
