"""Honest wall-clock time and peak memory on CPU and CUDA.

CUDA: events around the work with synchronisation, and the allocator's peak.
CPU: ``perf_counter``, and the process's peak resident set size (Linux ``VmHWM``),
reset before the work by writing 5 to ``/proc/self/clear_refs``; the figure is the
peak above the resident size at the start, so it counts what the work itself needed.
Where the kernel does not allow the reset, peak memory is reported as None.
"""

from __future__ import annotations

import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", _STATUS.read_text()).group(1))


def _reset_cpu_peak() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


@dataclass
class Measurement:
    seconds: float = 0.0
    peak_bytes: int | None = None


@contextmanager
def measure(device: torch.device):
    """Time and peak extra memory of the block: ``with measure(dev) as m: ...; m.seconds, m.peak_bytes``."""
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
    tracked = _STATUS.exists() and _reset_cpu_peak()
    baseline = _status_kib("VmRSS") if tracked else 0
    started = time.perf_counter()
    yield result
    result.seconds = time.perf_counter() - started
    if tracked:
        result.peak_bytes = (_status_kib("VmHWM") - baseline) * 1024
