"""SIGINT and SIGTERM end a long command cleanly, saying what finished work it kept."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rankkit.errors import Interrupted


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


# Signals that arrived inside ``keep_on_interrupt`` and have not yet become its ``Interrupted``. Python
# raises a handler's KeyboardInterrupt wherever the main thread is, and where it is in a weakref
# callback or a ``__del__`` that the garbage collector runs, the exception is printed ("Exception
# ignored in ...") and dropped: without this note the command would go on as if never interrupted.
_noted: list[int] = []


def _note_and_interrupt(signum, frame) -> None:
    _noted.append(signum)
    raise KeyboardInterrupt


def stop_if_interrupted() -> None:
    """Between a long loop's items: the KeyboardInterrupt of a signal whose own was dropped (``_noted``)."""
    if _noted:
        raise KeyboardInterrupt


@contextmanager
def keep_on_interrupt(kept: Callable[[], str]) -> Iterator[None]:
    """Turn SIGINT or SIGTERM inside the block into ``Interrupted(kept())``.

    ``kept()`` is asked only after the signal, so it describes the work finished by then. Blocks
    nest (a sweep's bench): the outermost one's ``kept()`` describes the whole command's work, so
    its message replaces the inner one's. SIGTERM is treated like Ctrl-C (a KeyboardInterrupt) only
    in the main thread, where Python delivers signals. A signal whose KeyboardInterrupt was dropped
    stops the block at the next ``stop_if_interrupted`` of its loop, or else as the block ends.
    """
    signals = (signal.SIGINT, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ()
    previous = {signum: signal.signal(signum, _note_and_interrupt) for signum in signals}
    try:
        yield
        stop_if_interrupted()
    except (KeyboardInterrupt, Interrupted):
        _noted.clear()  # the Interrupted raised here carries it
        raise Interrupted(kept()) from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """SIGINT and SIGTERM arriving inside the block are noted, and raised again at its end.

    For a command's import of torch while its workers start: torch's C++ runs Python code as
    it loads, and a KeyboardInterrupt raised in there cannot unwind through it, so the process
    aborts ("terminate called after throwing an instance of 'pybind11::error_already_set'").
    A handler that only notes the signal raises nothing (blocking the signal would not do:
    the pool's threads would still take it). Outside the main thread, where Python delivers
    no signal, the block changes nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {
        signum: signal.signal(signum, lambda signum, frame: arrived.append(signum)) for signum in signals
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if arrived:  # to this thread, with the handlers of before: a KeyboardInterrupt, or what SIGTERM did
        signal.raise_signal(arrived[0])


def interrupt_on_sigterm() -> None:
    """SIGTERM from now on ends the command as Ctrl-C does (a KeyboardInterrupt): its cleanup runs and
    it says so, where the default handler ends the process at once, silently, and leaves a write's
    staging file behind. Worker pools are spawned, and a spawned process starts with the default."""
    signal.signal(signal.SIGTERM, _interrupt)


def ignore_interrupts() -> None:
    """SIGINT and SIGTERM are ignored from now on, for a process that has finished its work and says
    so: Python keeps an ignored signal ignored to its very end, where it restores any other handler to
    the default that kills the process. SIGKILL still ends one that hangs as it exits."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
