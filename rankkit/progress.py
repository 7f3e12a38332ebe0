"""Progress as structured events the library computes and any front end can draw.

A command reports ``Progress(stage, done, total)`` after each step; ``done`` never
passes ``total``, and ``total`` counts every step the command takes (warm-ups and
repeats included), so a bar drawn from the events ends exactly at its total.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    stage: str  # what the step was: "calibrating", "warm-up", "timed", "skipped", "written", ...
    done: int  # steps finished so far, 0 <= done <= total
    total: int | None  # every step of the command, or None when unknown beforehand
    detail: str = ""  # which item: an example id, a method and budget


ProgressCallback = Callable[[Progress], None]

# The stage of a step a resumed run found finished: it took no time, so no ETA counts it.
SKIPPED = "skipped"


def ignore(event: Progress) -> None:
    """The default callback: no front end."""
