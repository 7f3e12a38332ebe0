"""Progress drawn from the library's ``Progress`` events (stage, done, total): bars on a terminal,
and one plain line per finished step with counts and ETA where stderr is a log or a pipe (a bar
there would be written only once, at the end)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rankkit.cli import release_warnings
from rankkit.progress import SKIPPED

status = Console(stderr=True)


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


class ProgressLines:
    """A callback for ``Progress`` events writing a line whenever a step finishes (``done`` grows), and one
    at the start: "bench 3/12 25% 0:41 elapsed, ETA 2:03: timed ex1 claa keep=0.1". Time counts from
    the callback's creation; the ETA extrapolates the steps this run did, so the steps a resumed run
    skipped do not shorten it."""

    def __init__(self, what: str, console: Console, *, with_stage: bool = True, clock=time.monotonic):
        self.what, self.console, self.clock, self.with_stage = what, console, clock, with_stage
        self.started = clock()
        self.rate_since = (self.started, 0)  # (time, done) the rate of the steps still to come counts from
        self.shown = -1

    def line(self, event, now: float) -> str:
        since_time, since_done = self.rate_since
        counts = f"{event.done}/{event.total} {100 * event.done // event.total}%" if event.total else str(event.done)
        eta = ""
        if event.total and event.done > since_done:
            rate = (now - since_time) / (event.done - since_done)
            eta = f", ETA {_duration(rate * (event.total - event.done))}"
        step = f"{event.stage} {event.detail}" if self.with_stage else event.detail
        return f"{self.what} {counts} {_duration(now - self.started)} elapsed{eta}: {step}".rstrip(": ")

    def __call__(self, event) -> None:
        release_warnings()  # the work has started
        now = self.clock()
        if event.stage == SKIPPED:
            self.rate_since = (now, event.done)
        if event.done > self.shown:
            self.shown = event.done
            self.console.print(self.line(event, now), markup=False, highlight=False, soft_wrap=True)


@contextmanager
def progress_bar(what: str) -> Iterator:
    """A callback for ``Progress`` events: one bar on stderr while the block runs (lines off a terminal)."""
    if not status.is_terminal:
        yield ProgressLines(what, status)
        return
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
        release_warnings()  # the work has started
        bar.start()  # on the first event: a command refused before any work draws no bar
        bar.update(task, completed=event.done, total=event.total, description=f"{event.stage} {event.detail}")

    try:
        yield show
    finally:
        bar.stop()


@contextmanager
def stage_bars(what: str) -> Iterator:
    """A callback for ``Progress`` events of several stages: one bar per stage, in the order they start
    (off a terminal, lines per stage)."""
    if not status.is_terminal:
        lines: dict[str, ProgressLines] = {}

        def log(event) -> None:
            lines.setdefault(event.stage, ProgressLines(f"{what} {event.stage}", status, with_stage=False))(event)

        yield log
        return
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
        release_warnings()
        bars.start()
        if event.stage not in tasks:
            tasks[event.stage] = bars.add_task("", total=None, stage=f"{what} {event.stage}")
        bars.update(tasks[event.stage], completed=event.done, total=event.total, description=event.detail)

    try:
        yield show
    finally:
        bars.stop()
