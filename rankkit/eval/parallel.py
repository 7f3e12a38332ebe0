"""A store's examples as a stream, evaluated one at a time by a pool of worker processes.

    frames = list(map_examples(store_path, example_ids, partial(evaluate_one, option=...), workers=2))

Each worker opens the store once and reads one example at a time, so memory holds one
example's arrays per worker plus what the evaluations return. Results come back in the
order of ``example_ids`` whatever the number of workers, so one worker and many give
identical frames. ``evaluate`` must be picklable: a module-level function, or a
``functools.partial`` of one with picklable arguments.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, TypeVar

from rankkit.defaults import usable_cores
from rankkit.errors import RankkitError
from rankkit.interrupts import deferred_interrupts
from rankkit.values import check_count

Result = TypeVar("Result")

# Examples handed to a worker at once: enough to amortise the round trip, few enough that
# results stream back in order without one worker holding up the rest.
_EXAMPLES_PER_TASK = 4

_worker_store: Any = None


def default_workers() -> int:
    """One worker per CPU the process may use."""
    return usable_cores()


def checked_workers(workers: int | None) -> int:
    """``workers`` (default: ``default_workers``), refused below 1 and above the CPUs this process may
    use: a worker is a process with its own copy of the libraries (about 150 MB), and more of them
    than CPUs only wait on each other."""
    if workers is None:
        return default_workers()
    check_count(workers, "--workers")
    cores = usable_cores()
    if workers > cores:
        raise RankkitError(
            f"--workers {workers} is more than the {cores} CPUs this process may use; give at most {cores} "
            "(the default is one per CPU)"
        )
    return workers


def _useful_processes(workers: int, examples: int) -> int:
    """Of ``workers`` (checked), the processes worth starting for ``examples``: each gets at least one
    task's worth of examples, since spawning one costs more than evaluating a few."""
    return min(workers, -(-examples // _EXAMPLES_PER_TASK))


def map_examples(
    path: str | os.PathLike,
    example_ids: Sequence[str],
    evaluate: Callable[[Any], Result],
    *,
    workers: int | None = None,
) -> Iterator[Result]:
    """``evaluate(record)`` for every example id of the store at ``path``, in order."""
    from rankkit import stores

    processes = _useful_processes(checked_workers(workers), len(example_ids))
    if processes <= 1:
        store = stores.open(path)
        for example_id in example_ids:
            yield evaluate(store.example(example_id))
        return
    with _worker_pool(os.fspath(path), processes) as pool:
        yield from pool.imap(
            partial(_evaluate_in_worker, evaluate), example_ids, chunksize=_EXAMPLES_PER_TASK
        )


@contextmanager
def shared_workers(
    path: str | os.PathLike, workers: int | None = None, *, now: bool = False
) -> Iterator[None]:
    """Inside, the ``map_examples`` calls over the store at ``path`` share one pool of workers,
    started by the first and ended on leaving: a command that runs several analyses of one
    store (the dashboard runs compare, variance and the explorer) pays the workers' start-up,
    about 3 s of imports each, once.

    With ``now``, the pool of ``workers`` (default: one per CPU) starts on entering: a command
    that has still to import the library starts its workers first, and their imports overlap
    its own. It starts only the workers the store's examples would use (``_useful_processes``):
    on a store of a few examples, none, where two that never got a task made `rankkit compare`
    wait 2 s for their start-up to end. Inside another ``shared_workers`` of the same store, this
    one is the other's.
    """
    key = _pool_key(path)
    if key in _shared_pools:
        yield
        return
    _shared_pools[key] = None
    finished = False
    try:
        processes = checked_workers(workers)
        if now and processes > 1:
            processes = _useful_processes(processes, _examples_held(path))
            if processes > 1:
                _shared_pools[key] = processes, _new_pool(os.fspath(path), processes)
        yield
        finished = True
    finally:
        started = _shared_pools.pop(key, None)
        if started is not None:
            _end_pool(started[1], finished=finished)


_shared_pools: dict[str, tuple[int, Any] | None] = {}  # by _pool_key


def _examples_held(path: str | os.PathLike) -> int:
    """The whole examples of the store at ``path``, read from its metadata; 0 where it cannot be read,
    which the command's own reading of it then reports."""
    from rankkit import stores

    try:
        return len(stores.open(path))
    except (RankkitError, OSError):
        return 0


def _pool_key(path: str | os.PathLike) -> str:
    return os.path.abspath(os.fspath(path))


@contextmanager
def _worker_pool(path: str, processes: int) -> Iterator[Any]:
    """A pool of ``processes`` workers on the store at ``path``: the one ``shared_workers`` keeps
    (when it has as many workers or more), or a pool of its own, ended on leaving."""
    key = _pool_key(path)
    shared = _shared_pools.get(key)
    if shared is not None and shared[0] >= processes:
        yield shared[1]
        return
    pool = _new_pool(path, processes)
    if key in _shared_pools and shared is None:
        _shared_pools[key] = processes, pool
        yield pool
        return
    finished = False
    try:
        yield pool
        finished = True
    finally:
        _end_pool(pool, finished=finished)


def _end_pool(pool: Any, *, finished: bool) -> None:
    """Let the workers of a ``finished`` pool end on their own, which releases its semaphores (a terminate
    makes Python warn of leaked ones); end them at once after an error or interrupt.

    An interrupt arriving meanwhile (a second Ctrl-C; ``timeout`` signals the process and then its group)
    is raised once they have ended: raised inside the pool's join, it left the pool's finalizer printing a
    traceback below the command's one line."""
    with deferred_interrupts():
        if finished:
            pool.close()
            pool.join()
        else:
            pool.terminate()


def _new_pool(path: str, processes: int) -> Any:
    # spawn, not fork: the parent may hold polars and BLAS thread pools that a fork copies mid-use.
    context = multiprocessing.get_context("spawn")
    with _ignoring_ctrl_c():
        threads = max(1, default_workers() // processes)
        return context.Pool(processes, initializer=_start_worker, initargs=(path, threads))


@contextmanager
def _ignoring_ctrl_c() -> Iterator[None]:
    """Workers started inside ignore SIGINT from birth (an ignored signal survives exec).

    Ctrl-C reaches the whole process group: the parent alone turns it into one line
    (``rankkit.interrupts``) and ends the pool, where workers would each print a traceback,
    and a worker lost to it would leave the parent waiting for its results forever.
    Signals can be set only from the main thread; elsewhere the workers keep the default.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _start_worker(path: str, threads: int) -> None:
    """Open the store once; share the CPUs among the workers, whose torch, polars and blosc
    thread pools would each take every core (four busy threads on two cores ran compare slower)."""
    os.environ.setdefault("POLARS_MAX_THREADS", str(threads))  # read when polars is first imported
    import torch
    from numcodecs import blosc

    from rankkit import stores

    torch.set_num_threads(threads)
    blosc.set_nthreads(threads)
    # A pool ends early (an error, Ctrl-C) with SIGTERM, which kills a worker wherever it is:
    # a Python handler runs only once the main thread next runs Python, never while it waits on
    # the task queue that the ending pool holds. The worker's own locks (blosc makes one on its
    # first read) come from the fork context, which unlinks them at birth: from the spawn
    # context each was a named semaphore that a killed worker left Python warning was leaked.
    multiprocessing.set_start_method("fork", force=True)
    # The last of a worker's exit handlers: a worker has sent every result and has nothing to
    # flush, and the interpreter's teardown of torch and numba would keep the pool waiting a second.
    multiprocessing.util.Finalize(None, os._exit, args=(0,), exitpriority=-1)
    # What every analysis a worker runs needs, loaded before its first example: when the pool
    # starts early (``shared_workers(now=True)``) this overlaps the command's own imports.
    import numpy as np

    from rankkit.eval import compare  # noqa: F401
    from rankkit.sorting import descending_orders

    descending_orders(np.zeros((1, 1), np.float32), nan_first=False)  # starts numba
    global _worker_store
    try:
        _worker_store = stores.open(path)
    except Exception as error:  # a pool restarts a worker whose start fails, forever: fail its tasks
        _worker_store = error


def _evaluate_in_worker(evaluate: Callable[[Any], Result], example_id: str) -> Result:
    if isinstance(_worker_store, Exception):
        raise _worker_store
    return evaluate(_worker_store.example(example_id))
