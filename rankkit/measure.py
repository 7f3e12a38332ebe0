"""Honest wall-clock time and peak memory on CPU and CUDA: the one place rankkit times and weighs work.

Time: on CUDA, events recorded on the current stream and read after one
synchronisation at the end (``Timeline``), so timing adds no sync points inside the
run; on CPU ``perf_counter``, with freed memory held by the process (``hold_freed_memory``).

Peak memory is "bytes of tensors allocated by the work, at their peak, above what was
allocated before it" (model weights excluded):
- CUDA: the allocator's peak minus what was allocated at the start (``PeakMemory``;
  includes kernel workspaces), measured in the timed run;
- CPU: the process's resident size is no measure (glibc keeps freed blocks, so two runs
  with the same tensor footprint differ by 1.8x), so ``TensorMemoryTracker`` adds up
  the storage bytes every operator creates and subtracts them when freed. It costs a
  Python call per operator: use it in an untimed run. Scratch buffers inside a CPU
  kernel that are not tensors are not seen, nor what a ``--compile-decode`` step allocates
  (it runs outside dispatch modes, which would keep it from compiling: one token's temporaries).
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# glibc's mallopt parameters and the largest block it lets come from the heap (HEAP_MAX_SIZE / 2).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
HEAP_BLOCK_LIMIT = 32 * 2**20
NEVER_TRIM = 2**31 - 1  # mallopt takes a C int


@functools.cache
def hold_freed_memory() -> bool:
    """Keep the memory a CPU run frees for the next run, so a timed run does not pay the kernel to map
    pages again: glibc returns the heap's free top to the kernel past a threshold that moves with
    the sizes freed, and a prefill's next tensors then fault their pages in afresh. A 2k-token
    prefill of the default model took 0 to 400,000 such faults and 4.0-4.7 s from run to run;
    with this, at most 10,000 and 3.9-4.3 s. Blocks up to glibc's largest heap block come from
    the heap, and the heap is never trimmed; larger ones are mapped for each use, as before.
    Done once per process, for the process (its resident size stays at its peak); False where
    the C library is not glibc."""
    if "CS_GNU_LIBC_VERSION" not in getattr(os, "confstr_names", {}):
        return False
    mallopt = ctypes.CDLL(None).mallopt
    return bool(mallopt(M_MMAP_THRESHOLD, HEAP_BLOCK_LIMIT)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))


class Timeline:
    """Marks points in time; ``seconds`` between marks is valid after ``finish``. On a CPU it holds the
    process's freed memory first (``hold_freed_memory``): a time is the work's, not the kernel's."""

    def __init__(self, device: torch.device):
        if device.type == "cpu":
            hold_freed_memory()
        self.device = device
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:  # on this device's stream, where a model spread over GPUs runs a layer elsewhere
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def finish(self) -> None:
        synchronize(self.device)

    def seconds(self, start: int, end: int) -> float:
        if self.cuda:
            return self.marks[start].elapsed_time(self.marks[end]) / 1000.0
        return self.marks[end] - self.marks[start]


class PeakMemory:
    """The CUDA allocator's peak above what was allocated when this was made; ``None`` on CPU.

    Making it synchronises and resets the device's peak statistics, so make it just
    before the work.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.baseline = 0
        synchronize(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.baseline = torch.cuda.memory_allocated(device)

    def bytes(self) -> int | None:
        if self.device.type != "cuda":
            return None
        return torch.cuda.max_memory_allocated(self.device) - self.baseline


@dataclass
class Measurement:
    seconds: float = 0.0
    peak_bytes: int | None = None  # CUDA only; on CPU use TensorMemoryTracker


@contextmanager
def measure(device: torch.device):
    """Time (and on CUDA peak extra memory) of the block: ``with measure(dev) as m: ...; m.seconds``."""
    result = Measurement()
    peak = PeakMemory(device)
    timeline = Timeline(device)
    timeline.mark()
    yield result
    timeline.mark()
    timeline.finish()
    result.seconds = timeline.seconds(0, 1)
    result.peak_bytes = peak.bytes()


# Peak memory bandwidth of the GPUs whose name torch reports, from the vendors' data sheets.
DATA_SHEET_BANDWIDTH = {
    "H100 80GB HBM3": 3.35e12,  # SXM
    "H100 NVL": 3.9e12,
    "H100 PCIe": 2.0e12,
    "H200": 4.8e12,
    "A100-SXM4-80GB": 2.039e12,
    "A100-SXM4-40GB": 1.555e12,
    "A100 80GB PCIe": 1.935e12,
    "L40S": 0.864e12,
}
# What the measured read streams: far more than any cache of a device, so it comes from memory.
READ_BYTES = 2**30
READ_REPEATS = 5


@dataclass(frozen=True)
class Bandwidth:
    """Bytes per second the device's memory delivers, and where the figure comes from."""

    bytes_per_s: float
    source: str  # "data sheet" (a GPU named in DATA_SHEET_BANDWIDTH) or "measured" (``read_bandwidth``)


def memory_bandwidth(device: torch.device) -> Bandwidth:
    """The data sheet's peak for a GPU it names; elsewhere (a CPU, an unlisted GPU) the measured
    ``read_bandwidth``, so every device has a bound and every figure says which kind it is."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        rate = next((rate for known, rate in DATA_SHEET_BANDWIDTH.items() if known in name), None)
        if rate is not None:
            return Bandwidth(rate, "data sheet")
    return Bandwidth(read_bandwidth(device), "measured")


def read_bandwidth(device: torch.device) -> float:
    """Bytes per second one sum over a buffer far larger than the device's caches reads, the best of
    ``READ_REPEATS`` (as STREAM reports): what a memory-bound step can at best stream here, with the
    threads torch uses now. Measured once per process for each device and thread count. On a host
    shared with other machines (a cloud VM's CPU) their reads count against it."""
    return _read_bandwidth(str(device), torch.get_num_threads())


@functools.cache
def _read_bandwidth(device: str, threads: int) -> float:
    where = torch.device(device)
    # float32: a sum of 16-bit floats is bound by the conversion on a CPU, not by the reads
    buffer = torch.zeros(read_buffer_bytes(where) // 4, device=where)
    with torch.inference_mode():
        buffer.sum()  # warm-up: the kernel's first launch
        seconds = []
        for _ in range(READ_REPEATS):
            with measure(where) as timed:
                buffer.sum()
            seconds.append(timed.seconds)
    return buffer.nbytes / min(seconds)


def read_buffer_bytes(device: torch.device) -> int:
    """``READ_BYTES``, on a GPU within half of what a loaded model leaves free."""
    if device.type != "cuda":
        return READ_BYTES
    return min(READ_BYTES, torch.cuda.mem_get_info(device)[0] // 2)


def decode_step_bytes(model: torch.nn.Module, kv_bytes: int) -> int:
    """What one greedy decode step must read from memory: each weight it multiplies by (an input
    embedding table that is not also the output head gives one row, not the table) and ``kv_bytes``
    of KV cache. Over a ``Bandwidth`` it bounds a memory-bound step's time from below."""
    weights = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    if output is None or output.weight is not embedding:
        weights -= (embedding.shape[0] - 1) * embedding.shape[1] * embedding.element_size()
    return weights + kv_bytes


def counterbalanced(items: list, round_index: int) -> list:
    """``items`` in the order round ``round_index`` of interleaved timing runs them: as given in even
    rounds, reversed in odd ones, so no item always runs first or always follows the same one."""
    return items if round_index % 2 == 0 else items[::-1]


def paired_ratios(numerators: list[float | None], denominators: list[float | None]) -> list[float]:
    """Each round's ratio of two interleaved sides, round by round (paired, so a burst of load that
    slows both cancels); a round missing either time, or with a zero denominator, has none. Every
    ratio rankkit reports between two timed paths is the median of these."""
    return [
        mine / theirs for mine, theirs in zip(numerators, denominators, strict=True) if mine is not None and theirs
    ]


class OperatorLaunches(TorchDispatchMode):
    """Counts the operators that launch device work while active (views launch nothing): what an
    eager step's host time is made of where it is launch-bound, as a decode step of an 8B model or
    a small model's prefill is on an H100. Counted on any device, the same operators as on CUDA.
    With ``views`` it counts every operator dispatched: a view launches nothing, yet costs the host
    its dispatch."""

    def __init__(self, views: bool = False):
        super().__init__()
        self.views = views
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += self.views or not func.is_view
        return func(*args, **(kwargs or {}))


def launches_of(work: Callable[[], object]) -> int:
    """Operators ``work()`` launches, counted on a second run: what the first builds lazily (a memo,
    a compiled sort) is not a per-run cost."""
    work()
    with OperatorLaunches() as counted:
        work()
    return counted.count


def _operator_tensors(values) -> Iterator[torch.Tensor]:
    """The tensors among an operator's arguments or results: each a tensor or a list of them (an
    ATen schema nests no deeper). Torch's general tree walk was a third of the tracker's cost: a
    tracked 1k-token generation of the default model took 1.38x an untracked one, and takes 1.28x
    (``tools/tracker_cost.py``, docs/benchmarks.md)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from (item for item in value if isinstance(item, torch.Tensor))


class TensorMemoryTracker(TorchDispatchMode):
    """Live and peak bytes of the tensor storages created by operators while active (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {tensor.untyped_storage().data_ptr() for tensor in _operator_tensors((*args, *kwargs.values()))}
        for tensor in _operator_tensors((out,)):
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
