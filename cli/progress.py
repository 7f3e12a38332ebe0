"""A progress bar drawn from the library's ``Progress`` events (stage, done, total)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

status = Console(stderr=True)


@contextmanager
def progress_bar(what: str) -> Iterator:
    """A callback for ``Progress`` events, drawing one bar on stderr while the block runs."""
    bar = Progress(
        TextColumn(f"[bold]{what}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=status,
    )
    task = bar.add_task("", total=None)

    def show(event) -> None:
        bar.start()  # on the first event: a command refused before any work draws no bar
        bar.update(task, completed=event.done, total=event.total, description=f"{event.stage} {event.detail}")

    try:
        yield show
    finally:
        bar.stop()


@contextmanager
def stage_bars(what: str) -> Iterator:
    """A callback for ``Progress`` events of several stages: one bar per stage, in the order they start."""
    bars = Progress(
        TextColumn("[bold]{task.fields[stage]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=status,
    )
    tasks: dict[str, int] = {}

    def show(event) -> None:
        bars.start()
        if event.stage not in tasks:
            tasks[event.stage] = bars.add_task("", total=None, stage=f"{what} {event.stage}")
        bars.update(tasks[event.stage], completed=event.done, total=event.total, description=event.detail)

    try:
        yield show
    finally:
        bars.stop()
