"""The overhead benchmark's plumbing on a tiny model (its figures come from `rankkit overhead`, not tests)."""

from __future__ import annotations

import math

from rankkit.overhead import run_overhead


def test_runner_overhead_rows_hold_times_and_tensor_memory(tiny_folder):
    (row,) = run_overhead("runner", [64], model_spec=str(tiny_folder), device="cpu", repeats=1)
    assert row["tokens"] == 64 and row["baseline_s"] > 0 and row["rankkit_s"] > 0
    assert math.isclose(row["time_ratio"], row["rankkit_s"] / row["baseline_s"])
    # the runner allocates what model(...) allocates for the same prefill, give or take its own bookkeeping
    assert 0.8 <= row["memory_ratio"] <= 1.1


def test_memory_only_run_skips_timing(tiny_folder):
    (row,) = run_overhead("capture", [32], model_spec=str(tiny_folder), device="cpu", with_timing=False)
    assert math.isnan(row["time_ratio"]) and row["rankkit_peak_bytes"] > 0
