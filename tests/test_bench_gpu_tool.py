"""tools/bench_gpu.py, the GPU table in one process: a lease (15 minutes of device time, drawn by
chance) must not be spent on a step that cannot run, nor record a command that is not the one run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import bench_gpu  # noqa: E402

OUT = Path("runs/bench-gpu")


def _parsed(argv: list[str]) -> dict:
    """The options ``argv`` (``rankkit COMMAND ...``) gives its command, as rankkit's CLI parses them."""
    import rankkit.cli.commands  # noqa: F401  (each command registers on import)
    from rankkit.cli.app import command

    name = argv[1]
    return command().commands[name].make_context(name, argv[2:]).params


def _steps_of(kind) -> list[str]:
    return [name for name, (_, step) in bench_gpu.STEPS.items() if isinstance(step, kind)]


@pytest.mark.parametrize("name", _steps_of(bench_gpu.Bench))
def test_a_bench_steps_command_asks_for_what_the_step_runs(name):
    step = bench_gpu.STEPS[name][1]
    options = _parsed(step.command(OUT, name))
    assert options["model"] == step.model and options["methods"] == ",".join(step.methods)
    assert options["keep"] == str(bench_gpu.KEEP) and options["data"] == step.data
    assert (options["max_new_tokens"], options["warmup"], options["repeats"]) == (
        step.max_new_tokens,
        step.warmup,
        step.repeats,
    )
    assert (options["cuda_graphs"], options["compile_decode"]) == (step.cuda_graphs, step.compile_decode)
    assert options["out"] == OUT / f"{name}.parquet" and options["overwrite"]


@pytest.mark.parametrize("name", _steps_of(bench_gpu.Overhead))
def test_an_overhead_steps_command_asks_for_what_the_step_runs(name):
    step = bench_gpu.STEPS[name][1]
    options = _parsed(step.command(OUT, name))
    assert (options["scenario"], options["model"], options["repeats"]) == (step.scenario, step.model, step.repeats)
    assert options["lengths"] == ",".join(map(str, step.lengths))
    assert (options["memory"], options["cuda_graphs"], options["compile_decode"]) == (
        step.memory,
        step.cuda_graphs,
        step.compile_decode,
    )
    assert options["as_json"]


@pytest.mark.integration
@pytest.mark.processes
def test_every_step_of_the_gpu_table_runs_at_smoke_size_on_the_cpu(tmp_path):
    """Every step, scaled down (``--smoke``: the default model's architecture with a few layers, a few hundred tokens),
    runs to its rows, and records the command it stands for; a step that needs CUDA says so."""
    # every step but decode-compiled: `rankkit overhead decode --cuda-graphs --compile-decode`, which test_overhead's
    # compile test runs on a tiny model; here its compiling took 34 s more on a fresh machine's cold cache
    steps = [name for name in bench_gpu.STEPS if name != "decode-compiled"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_gpu.py"), str(tmp_path), "--smoke", *steps],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "gpu-table.jsonl").read_text().splitlines()]
    assert records[0] == records[0] | {"step": "environment", "smoke": True}
    by_step = {record["step"]: record for record in records[1:]}
    assert list(by_step) == steps
    for name in steps:
        _, step = bench_gpu.STEPS[name]
        record = by_step[name]
        assert "error" not in record, (name, record.get("traceback"))
        smoke_model = str(bench_gpu.smoke_model_folder(tmp_path))
        assert record["command"] == " ".join(step.smoke(smoke_model).command(tmp_path, name))
        if step.needs_cuda:
            assert record["skipped"] == "needs CUDA"
            continue
        assert record["rows"], name
        if isinstance(step, bench_gpu.Bench):
            methods = {row["method"] for row in record["rows"]}
            assert methods == {"full", *step.methods} and (tmp_path / f"{name}.parquet").exists()
        if isinstance(step, bench_gpu.Overhead):
            assert [row["tokens"] for row in record["rows"]] == [bench_gpu.SMOKE_LENGTH]
            assert all(row["model"] == smoke_model and row["time_ratio"] > 0 for row in record["rows"])


def test_an_interrupted_step_is_recorded_and_ends_the_run(tmp_path, monkeypatch):
    """A lease's ``timeout -s INT`` reaches a bench step as ``Interrupted``: the step's record says so
    and no later step starts (run 4 went on compiling the next step until the lease killed it)."""
    from rankkit.errors import Interrupted

    started = []

    class Step:
        needs_cuda = False

        def __init__(self, name, interrupt):
            self.name, self.interrupt = name, interrupt

        def command(self, out, name):
            return ["rankkit", name]

        def run(self, out, name):
            started.append(name)
            if self.interrupt:
                raise Interrupted("interrupted: kept 0 finished")
            return [{"row": name}]

    steps = {name: (10, Step(name, name == "second")) for name in ("first", "second", "third")}
    monkeypatch.setattr(bench_gpu, "STEPS", steps)
    with pytest.raises(SystemExit) as stopped:
        bench_gpu.main(tmp_path, list(steps))
    assert stopped.value.code == 130 and started == ["first", "second"]
    records = [json.loads(line) for line in (tmp_path / "gpu-table.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == ["environment", "first", "second"]
    assert records[1]["rows"] == [{"row": "first"}]
    assert records[2]["interrupted"] and records[2]["error"] == "interrupted: kept 0 finished"


def test_device_idle_counts_the_time_between_kernels_once_and_names_the_longest_gaps():
    """Overlapping kernels are busy once; the wait before the first kernel (the host's first launches)
    is apart from the gaps between kernels, each gap named by the kernels either side."""
    kernels = [(40.0, 50.0, "c"), (10.0, 20.0, "a"), (15.0, 30.0, "b"), (50.0, 55.0, "d"), (70.0, 71.0, "e")]
    idle = bench_gpu.device_idle(kernels, host_start=0.0, top=2)
    assert idle | {"longest_gaps": None} == {
        "span_us": 71.0,
        "busy_us": 36.0,  # a 10, b's 10 past a, c 10, d 5, e 1
        "before_first_kernel_us": 10.0,
        "gaps_us": 25.0,  # 30-40 and 55-70
        "longest_gaps": None,
    }
    assert idle["longest_gaps"] == [
        {"at_us": 55.0, "us": 15.0, "after": "d", "before": "e"},
        {"at_us": 0.0, "us": 10.0, "after": "start", "before": "a"},
    ]
    assert bench_gpu.device_idle([(5.0, 9.0, "a")], host_start=5.0)["before_first_kernel_us"] == 0.0


def test_a_profiles_waits_read_the_profilers_events():
    """What a GPU profile adds, run on a CPU profile's events: no kernels, so no wait and no CUDA call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        torch.ones(64, 64) @ torch.ones(64, 64)
    waits = bench_gpu.Profile("runner", 8)._waits(profiled.events(), profiled.key_averages())
    assert waits["device_idle"]["span_us"] == 0.0 and waits["device_idle"]["longest_gaps"] == []
    assert waits["runtime_calls"] == []
