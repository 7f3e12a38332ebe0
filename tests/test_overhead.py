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


def test_analysis_cost_times_every_step_on_a_synthetic_store(tmp_path):
    from rankkit import stores
    from rankkit.eval.cost import LAYERS, PROBES, STEPS, build_store, run_analysis_cost

    build_store(tmp_path / "s.zarr", examples=2, tokens=80)
    record = stores.open(tmp_path / "s.zarr").example("synthetic:0")
    assert record.probes == sorted(PROBES) and record.score_shape("window") == (LAYERS, 3, 80)
    assert record.has_oracle and record.attrs["spans"]["context_tokens"] == [0, 48]

    rows = run_analysis_cost(2, [80], workers=1)
    assert [row["step"] for row in rows] == list(STEPS)
    for row in rows:
        assert row["files_per_example"] == 3 and row["seconds"] > 0 and row["peak_mib"] > 10
        assert row["seconds_per_example"] == row["seconds"] / 2
        assert (row["output_mib"] is None) == (row["step"] != "dashboard")
    assert rows[-1]["output_mib"] > 0.1  # the page carries plotly itself
