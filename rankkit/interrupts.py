"""SIGINT and SIGTERM end a long command cleanly, saying what finished work it kept."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rankkit.errors import Interrupted


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@contextmanager
def keep_on_interrupt(kept: Callable[[], str]) -> Iterator[None]:
    """Turn SIGINT or SIGTERM inside the block into ``Interrupted(kept())``.

    ``kept()`` is asked only after the signal, so it describes the work finished by then.
    SIGTERM is treated like Ctrl-C (a KeyboardInterrupt) only in the main thread, where
    Python delivers signals.
    """
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if in_main_thread else None
    try:
        yield
    except KeyboardInterrupt:
        raise Interrupted(kept()) from None
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
