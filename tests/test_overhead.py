"""The overhead benchmark's plumbing on a tiny model (its figures come from `rankkit overhead`, not tests)."""

from __future__ import annotations

import math
import time
from contextlib import contextmanager

import pytest
import torch

from rankkit import models
from rankkit.overhead import run_overhead


def test_runner_overhead_rows_hold_times_and_tensor_memory(tiny_folder):
    (row,) = run_overhead("runner", [64], model_spec=str(tiny_folder), device="cpu", repeats=1)
    assert row["tokens"] == 64 and row["baseline_s"] > 0 and row["rankkit_s"] > 0
    assert math.isclose(row["time_ratio"], row["rankkit_s"] / row["baseline_s"])
    # the runner allocates what model(...) allocates for the same prefill, give or take its own bookkeeping
    assert 0.8 <= row["memory_ratio"] <= 1.1


def test_a_memory_only_run_reports_no_times_in_any_output(tiny_folder, monkeypatch):
    """Times not measured are missing (null in --json, '-' in the table), never NaN: NaN is not JSON,
    and a table would print it as a figure. Neither timing nor memory is a refusal."""
    import json
    import subprocess
    import sys

    from typer.testing import CliRunner

    from rankkit import overhead
    from rankkit.cli import commands  # noqa: F401
    from rankkit.cli.app import app

    # peaks measured in this process (the same rows, test_peak_memory_measured_in_this_process_...),
    # not in four fresh ones
    monkeypatch.setattr(overhead, "_peak_in_subprocess", overhead.peak_memory)

    arguments = ["overhead", "decode", "--model", str(tiny_folder), "--device", "cpu", "--lengths", "40"]
    result = CliRunner().invoke(app, [*arguments, "--no-timing", "--json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout, parse_constant=lambda name: pytest.fail(f"{name} in --json"))
    assert row["baseline_s"] is row["rankkit_s"] is row["time_ratio"] is row["bound_ratio"] is None
    assert row["repeats"] == 0 and row["bound_s"] > 0 and row["rankkit_peak_bytes"] > 0
    shown = CliRunner().invoke(app, [*arguments, "--no-timing"], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    assert "nan" not in shown.stdout.lower()
    refused = subprocess.run(
        [sys.executable, "-m", "rankkit.cli", *arguments, "--no-timing", "--no-memory"], capture_output=True, text=True
    )
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "rankkit: error: --no-timing with --no-memory leaves nothing to measure: drop one of them"
    ]


def test_analysis_cost_times_every_step_on_a_synthetic_store(tmp_path):
    from rankkit import stores
    from rankkit.eval.cost import LAYERS, STEPS, build_store, run_analysis_cost
    from rankkit.methods import probes_methods_need

    build_store(tmp_path / "s.zarr", examples=2, tokens=80)
    record = stores.open(tmp_path / "s.zarr").example("synthetic:0")
    assert record.probes == sorted(probe.key for probe in probes_methods_need())  # a default capture's
    assert record.score_shape("window") == (LAYERS, 3, 80)
    assert record.has_oracle and record.attrs["spans"]["context_tokens"] == [0, 48]

    rows = run_analysis_cost(2, [80], workers=1)
    assert [row["step"] for row in rows] == list(STEPS)
    for row in rows:
        assert row["files_per_example"] == 3 and row["seconds"] > 0 and row["peak_mib"] > 10
        assert row["seconds_per_example"] == row["seconds"] / 2
        assert (row["output_mib"] is None) == (row["step"] != "dashboard")
    assert rows[-1]["output_mib"] > 0.1  # the page carries plotly itself


def test_decode_sides_choose_the_same_tokens_and_time_per_token(tiny_folder):
    import torch

    from rankkit import models
    from rankkit.overhead import DECODE_NEW_TOKENS, _sides

    loaded = models.load(str(tiny_folder), device="cpu")
    sides = _sides("decode", loaded, 48)
    with torch.inference_mode():
        generated = sides.baseline()[0, 48:].tolist()
        assert sides.baseline()[0, 48:].tolist() == generated  # the cache is cropped back between runs
        decoded = sides.rankkit()
    assert len(generated) == DECODE_NEW_TOKENS and decoded[:DECODE_NEW_TOKENS] == generated
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    table = loaded.model.get_input_embeddings().weight
    assert loaded.model.get_output_embeddings().weight is not table  # so a step reads one row of it
    kv = 3 * 2 * 2 * 16 * 48 * 4  # layers x (K, V) x kv heads x head_dim x tokens x fp32
    step = weights - table.numel() * 4 + table.shape[1] * 4 + kv
    assert sides.steps == DECODE_NEW_TOKENS and sides.bytes_per_step == step


def test_the_runner_and_the_baselines_call_transformers_by_its_current_names(tiny_folder):
    """transformers renamed the cache argument (``past_key_values`` to ``cache``): an old name works
    with a deprecation warning on the user's terminal, then stops working. Prefill, decode and the
    ``model.generate`` baseline raise no such warning, Python's or transformers' logger's."""
    import logging
    import warnings

    from rankkit.overhead import _sides

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught, torch.inference_mode():
            warnings.simplefilter("always")
            sides = _sides("decode", models.load(str(tiny_folder), device="cpu"), 24)
            sides.baseline(), sides.rankkit()
    finally:
        logger.removeHandler(handler)
    deprecations = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert [m for m in deprecations if "transformers" in m or "cache" in m] == []
    assert [message for message in said if "deprecated" in message] == []


def test_a_loaded_model_keeps_no_autograd_state_outside_inference_mode(tiny_folder):
    """A forward run outside ``inference_mode`` (the decode baseline's cache, a user's own call)
    must not store activations for backward: at 8B x 32k tokens that is tens of GB."""
    from rankkit import models
    from rankkit.overhead import _sides

    loaded = models.load(str(tiny_folder), device="cpu")
    assert not loaded.model.training and not any(p.requires_grad for p in loaded.model.parameters())
    outputs = loaded.model(torch.arange(40)[None], use_cache=True)
    assert outputs.logits.grad_fn is None and outputs.cache.layers[0].keys.grad_fn is None
    sides = _sides("decode", loaded, 48)
    cached = sides.baseline.__closure__  # the baseline's prompt cache, built as the row builds it
    (cache,) = [cell.cell_contents for cell in cached if hasattr(cell.cell_contents, "crop")]
    assert cache.get_seq_length() == 47 and cache.layers[0].keys.grad_fn is None


def test_decode_overhead_row_is_per_token_with_the_bound_of_the_steps_bytes(tiny_folder):
    import torch

    from rankkit import measure

    (row,) = run_overhead(
        "decode",
        [48],
        model_spec=str(tiny_folder),
        device="cpu",
        repeats=1,
        with_memory=False,
        cuda_graphs=True,
    )
    assert row["rankkit"] == "Runner decode, time per token, CUDA graphs"
    assert row["baseline_s"] > 0 and row["rankkit_s"] > 0
    # a CPU is in no data sheet: its bound is at the bandwidth measured in this process
    assert row["bandwidth_source"] == "measured"
    loaded = models.load(str(tiny_folder), device="cpu")
    kv_bytes = 3 * 2 * 2 * 16 * 48 * 4  # layers x (K, V) x kv heads x head_dim x tokens x fp32
    step = measure.decode_step_bytes(loaded.model, kv_bytes)
    assert row["bound_s"] == pytest.approx(step / measure.read_bandwidth(torch.device("cpu")))
    assert row["bound_ratio"] == pytest.approx(row["rankkit_s"] / row["bound_s"])
    assert row["read_bound_s"] == row["bound_s"]


def test_the_bandwidth_is_the_data_sheets_for_a_gpu_it_names_and_measured_elsewhere(monkeypatch):
    import torch

    from rankkit import measure

    monkeypatch.setattr(measure, "read_bandwidth", lambda device: 7.5e11)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert measure.memory_bandwidth(torch.device("cuda")) == measure.Bandwidth(3.35e12, "data sheet")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert measure.memory_bandwidth(torch.device("cuda")) == measure.Bandwidth(7.5e11, "measured")
    assert measure.memory_bandwidth(torch.device("cpu")) == measure.Bandwidth(7.5e11, "measured")


def test_the_measured_bandwidth_is_a_buffers_bytes_over_its_fastest_read(monkeypatch):
    import torch

    from rankkit import measure

    times = iter([0.5, 0.25, 0.4, 0.3, 0.9])

    @contextmanager
    def timed(device):
        yield measure.Measurement(seconds=next(times))

    monkeypatch.setattr(measure, "measure", timed)
    monkeypatch.setattr(measure, "READ_BYTES", 2**20)
    measure._read_bandwidth.cache_clear()
    try:
        assert measure.read_bandwidth(torch.device("cpu")) == 2**20 / 0.25
        assert measure.read_bandwidth(torch.device("cpu")) == 2**20 / 0.25  # once per process
    finally:
        measure._read_bandwidth.cache_clear()


def test_the_read_streams_a_gibibyte_within_half_of_a_gpus_free_memory(monkeypatch):
    from rankkit import measure

    assert measure.read_buffer_bytes(torch.device("cpu")) == 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (600 * 2**20, 80 * 2**30))
    assert measure.read_buffer_bytes(torch.device("cuda")) == 300 * 2**20
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * 2**30, 80 * 2**30))
    assert measure.read_buffer_bytes(torch.device("cuda")) == 2**30


def test_a_decode_step_reads_one_row_of_an_input_embedding_the_head_does_not_share():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rankkit.measure import decode_step_bytes

    shape = dict(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    for tied in (True, False):
        model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=tied)).to(torch.bfloat16)
        every_weight = sum(p.numel() for p in model.parameters()) * 2
        table = 1000 * 32 * 2
        expected = every_weight if tied else every_weight - table + 32 * 2
        assert decode_step_bytes(model, kv_bytes=100) == expected + 100


def test_overhead_decode_command_prints_time_per_token_and_the_bound(tiny_folder):
    import json

    from typer.testing import CliRunner

    from rankkit.cli import commands  # noqa: F401
    from rankkit.cli.app import app

    arguments = ["overhead", "decode", "--model", str(tiny_folder), "--device", "cpu", "--lengths", "40"]
    result = CliRunner().invoke(app, [*arguments, "--repeats", "1", "--no-memory", "--cuda-graphs", "--json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)
    assert row["tokens"] == 40 and row["rankkit"].endswith("CUDA graphs")
    assert row["bound_ratio"] == pytest.approx(row["rankkit_s"] / row["bound_s"]) and row["bound_ratio"] > 1
    shown = CliRunner().invoke(app, [*arguments, "--repeats", "1", "--no-memory"], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    assert "bound at the measured memory bandwidth" in shown.stdout
    assert "bound×: rankkit's time over the bound" in shown.stdout  # every column is in the legend
    assert "bound_ratio" not in shown.stdout


def test_overhead_decode_compiles_the_static_step_only_with_cuda_graphs(tiny_folder):
    import json
    import subprocess
    import sys

    from typer.testing import CliRunner

    from rankkit.cli import commands  # noqa: F401
    from rankkit.cli.app import app

    arguments = ["overhead", "decode", "--model", str(tiny_folder), "--device", "cpu", "--lengths", "40"]
    refused = subprocess.run(
        [sys.executable, "-m", "rankkit.cli", *arguments, "--compile-decode"], capture_output=True, text=True
    )
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines() == [
        "rankkit: error: --compile-decode compiles the static-cache decode step: add --cuda-graphs"
    ]
    both = [*arguments, "--repeats", "1", "--no-memory", "--cuda-graphs", "--compile-decode", "--json"]
    result = CliRunner().invoke(app, both)
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)
    assert row["rankkit"].endswith("CUDA graphs, compiled") and row["rankkit_s"] > 0


@pytest.mark.parametrize(
    ("arguments", "unused"),
    [
        (["analysis", "--examples", "2", "--no-memory", "--no-timing"], "--memory/--no-memory, --timing/--no-timing"),
        (["analysis", "--examples", "2", "--cuda-graphs", "--threads", "1"], "--cuda-graphs, --threads"),
        (["capture", "--examples", "5", "--workers", "2"], "--examples, --workers"),
    ],
)
def test_an_option_the_scenario_does_not_use_is_refused(arguments, unused):
    """`overhead analysis --no-memory --no-timing` printed seconds and peak memory anyway, and
    `overhead capture --examples 5` ran as if it had not been given."""
    from typer.testing import CliRunner

    from rankkit.cli import commands  # noqa: F401
    from rankkit.cli.app import app
    from rankkit.errors import RankkitError

    result = CliRunner().invoke(app, ["overhead", *arguments, "--lengths", "256"])
    assert isinstance(result.exception, RankkitError), result.output
    assert str(result.exception) == f"overhead {arguments[0]} does not use {unused}; leave it out"


def test_the_two_sides_alternate_which_runs_first():
    """A repeat's second run meets what the first left (allocator, caches): each side runs first in
    every other repeat, after one warm-up each, and each side's times are its own."""
    from rankkit.overhead import Sides, interleaved_times

    order = []
    sides = Sides(
        baseline=lambda: order.append("baseline") or time.sleep(0.02),  # the slower side, whichever runs first
        rankkit=lambda: order.append("rankkit"),
    )
    repeats = []
    times = interleaved_times(sides, torch.device("cpu"), 4, lambda: repeats.append(len(order)))
    assert order == ["baseline", "rankkit"] + ["baseline", "rankkit", "rankkit", "baseline"] * 2
    assert repeats == [4, 6, 8, 10]  # reported after each repeat's two runs
    assert len(times["rankkit"]) == 4 and max(times["rankkit"]) < 0.02 <= min(times["baseline"])


def test_peak_memory_measured_in_this_process_matches_the_fresh_processes(tiny_folder):
    """``memory_in_process`` (what tools/bench_gpu.py asks, its model loaded once) gives the rows the
    fresh processes give: the same tensors counted, the same ratio rule."""
    fresh, here = (
        run_overhead("runner", [64], model_spec=str(tiny_folder), device="cpu", with_timing=False, memory_in_process=same)[0]
        for same in (False, True)
    )
    for key in ("baseline_peak_bytes", "rankkit_peak_bytes", "memory_ratio"):
        assert here[key] == fresh[key] > 0, key


def test_overhead_refuses_a_length_it_cannot_run_before_the_model_loads():
    """A token count below one is a one-line refusal naming the fix (exit 2), before any model loads:
    the model named here does not exist."""
    import subprocess
    import sys

    for scenario, lengths in [("decode", "0"), ("runner", "64,-3"), ("analysis", "0")]:
        model = [] if scenario == "analysis" else ["--model", "/nowhere"]  # analysis runs no model
        arguments = ["overhead", scenario, *model, "--lengths", lengths]
        refused = subprocess.run([sys.executable, "-m", "rankkit.cli", *arguments], capture_output=True, text=True)
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.strip().splitlines() == [
            f"rankkit: error: --lengths takes positive token counts, not {lengths}; e.g. --lengths 1024,4096"
        ]


def test_overhead_runs_past_the_models_positions_only_when_allowed(tiny_folder):
    from rankkit.errors import RankkitError
    from rankkit.eval.cost import run_analysis_cost

    settings = {"model_spec": str(tiny_folder), "device": "cpu", "repeats": 1, "with_memory": False}
    refused = "the prompt of --lengths 600 has 600 tokens, more than the model's 512 positions; shorten it, or pass"
    with pytest.raises(RankkitError, match=refused):
        run_overhead("runner", [64, 600], **settings)
    with pytest.warns(UserWarning, match="more than the model's 512 positions; running it anyway"):
        rows = run_overhead("runner", [600], allow_overlength=True, **settings)
    assert [row["tokens"] for row in rows] == [600] and rows[0]["rankkit_s"] > 0
    with pytest.raises(RankkitError, match="--examples takes a positive count, not 0"):
        run_analysis_cost(0, [80], workers=1)
    # it failed inside its first step, on a store whose spans it had made outside the prompt
    with pytest.raises(RankkitError, match=r"^--lengths 79 is too short for a synthetic example: it needs at least 80 tokens"):
        run_analysis_cost(1, [2048, 79], workers=1)


def test_the_time_ratio_is_the_median_of_each_repeats_ratio_with_its_interval(tiny_folder, monkeypatch):
    """Paired as bench's ratios are: a burst of load that slows both sides of a repeat cancels. Here
    the ratio of medians (4 / 3.5) would be 1.14; each repeat's own ratio is 1 or 2, mostly 1."""
    from rankkit import overhead

    baseline = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    rankkit = [2.0, 2.0, 3.0, 8.0, 5.0, 6.0]
    monkeypatch.setattr(
        overhead, "interleaved_times", lambda *args, **kwargs: {"baseline": baseline, "rankkit": rankkit}
    )
    (row,) = run_overhead("runner", [64], model_spec=str(tiny_folder), device="cpu", with_memory=False)
    assert row["repeats"] == 6 and (row["baseline_s"], row["rankkit_s"]) == (3.5, 4.0)
    assert row["time_ratio"] == 1.0
    # six repeats: [min, max] of the ratios covers their median 97% of the time
    assert (row["time_ratio_ci_low"], row["time_ratio_ci_high"]) == (1.0, 2.0)
    baseline.pop(), rankkit.pop()
    (row,) = run_overhead("runner", [64], model_spec=str(tiny_folder), device="cpu", with_memory=False, repeats=5)
    assert row["time_ratio"] == 1.0 and row["time_ratio_ci_low"] is row["time_ratio_ci_high"] is None


def test_a_memory_run_that_fails_in_its_fresh_process_is_one_line_naming_the_fix(tiny_folder):
    """The peak of each side is measured in a process of its own; one that dies there (out of memory,
    say) is refused in the child's own last words, not a traceback of the parent's."""
    from rankkit import overhead
    from rankkit.errors import RankkitError

    with pytest.raises(
        RankkitError,
        match=r"^measuring the rankkit side's peak memory at 40 tokens in a fresh process failed "
        r"\(rankkit.errors.RankkitError: model '.*missing': no such folder; .*\); pass --no-memory to time it alone$",
    ):
        overhead._peak_in_subprocess("runner", "rankkit", 40, str(tiny_folder / "missing"), "cpu", False, False)
