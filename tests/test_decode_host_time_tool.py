"""tools/decode_host_time.py, the CPU measure docs/benchmarks.md quotes for the eager decode step's host
time against transformers' own step."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.processes
def test_the_tool_times_both_steps_and_counts_their_dispatches():
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "decode_host_time.py"), "--layers", "2", "--prompt", "16",
         "--steps", "3", "--rounds", "6"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    times = re.search(r"rankkit's step ([\d.]+) ms, transformers' ([\d.]+) ms", done.stdout)
    ratio = re.search(r"ratio ([\d.]+) \[([\d.]+), ([\d.]+)\]", done.stdout)
    counts = re.search(r"rankkit (\d+) \(([\d.]+) a layer\), transformers (\d+)", done.stdout)
    assert times and ratio and counts, done.stdout
    assert all(float(value) > 0 for value in times.groups())
    low, middle, high = float(ratio[2]), float(ratio[1]), float(ratio[3])
    assert low <= middle <= high
    ours, theirs = int(counts[1]), int(counts[3])
    assert float(counts[2]) == ours / 2 and ours > theirs > 0  # the cache's positions cost a few more
