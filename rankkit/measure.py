"""Honest wall-clock time and peak memory on CPU and CUDA.

Time: CUDA events around the work with synchronisation; on CPU ``perf_counter``.
Peak memory: on CUDA the allocator's peak above what was allocated before. On CPU the
process's resident size is no measure (glibc keeps freed blocks, so two runs with the
same tensor footprint differ by 1.8x), so ``TensorMemoryTracker`` adds up the storage
bytes every operator creates and subtracts them when freed. It costs a Python call per
operator: use it in an untimed run.
"""

from __future__ import annotations

import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Measurement:
    seconds: float = 0.0
    peak_bytes: int | None = None  # CUDA only; on CPU use TensorMemoryTracker


@contextmanager
def measure(device: torch.device):
    """Time (and on CUDA peak extra memory) of the block: ``with measure(dev) as m: ...; m.seconds``."""
    result = Measurement()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield result
        end.record()
        synchronize(device)
        result.seconds = start.elapsed_time(end) / 1000
        result.peak_bytes = torch.cuda.max_memory_allocated(device) - baseline
        return
    started = time.perf_counter()
    yield result
    result.seconds = time.perf_counter() - started


class TensorMemoryTracker(TorchDispatchMode):
    """Live and peak bytes of the tensor storages created by operators while active (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._track(tensor.untyped_storage(), inputs)
        return out

    def _track(self, storage, inputs: set[int]) -> None:
        key = storage.data_ptr()
        if key == 0 or key in inputs or key in self._storages:  # empty, a view / in-place result, or known
            return
        size = storage.nbytes()
        self._storages.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self._storages.discard(key)
        self.live -= size
