"""The GPU table of docs/benchmarks.md ("GPU") in one process, for a lease too short to reload an 8B model per command.

Each step is one command of that table, declared once here: the step runs the library function
behind its ``rankkit`` command line (``rankkit.overhead.run_overhead``, ``rankkit.bench.bench``)
with that line's arguments, and records the line itself, so the figure and the command that
reproduces it come from one declaration (``make bench-gpu`` runs this tool). What differs from
running the lines one by one: every model is built once and shared by the steps
(``models.loaded_once``), and an overhead step's peak memory is the CUDA allocator's, read in
this process (``run_overhead(memory_in_process=True)``), where the command starts a fresh
process per side. Steps run in the order given, each under its own time limit; a step that
fails or runs out of time is recorded and the next one starts, one interrupted (Ctrl-C, or the
SIGINT of a lease's ``timeout -s INT``) is recorded and ends the run (exit status 130). One JSON object per step goes to
``OUT/gpu-table.jsonl`` as it finishes, a bench step's rows also to ``OUT/<step>.parquet``. The
``profile-*`` steps record where a decode step's, a capture's and the runner's prefill's device time goes
(torch.profiler); ``split-threshold`` times one decode attention call both ways, on CUDA only.

``--smoke`` runs every step at a size a CPU finishes in minutes (the default model's architecture
with a few of its layers, saved under OUT as any user's model folder; a few hundred tokens, one
round, two new tokens): what the test suite runs, so a lease never starts with a step that cannot run.

    python3 tools/bench_gpu.py OUT [--smoke] [STEP ...]   # default: every step, in STEPS order
"""

from __future__ import annotations

import json
import signal
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from rankkit import models, overhead
from rankkit.bench import BenchSettings, Setup, bench, summary
from rankkit.errors import Interrupted

SHAPE = "random:llama-3.1-8b"
SMALL = "random:smollm2-135m"  # the default model's architecture: its timings, without its 93 MB wheel
KV_METHODS = ("sliminfer", "specprefill", "lava", "sage-kv", "streamingllm", "snapkv", "tova")
PROMPT_PRUNING = ("gemfilter", "fastkv", "claa")
KEEP = 0.1
# --smoke: the steps' arguments scaled to what a CPU runs in seconds
SMOKE_LAYERS = 4  # every step's code path; a compiled decode step's compiling grows with the layers
SMOKE_LENGTH = 256
SMOKE_NIAH_LENGTH = 512  # a needle prompt needs room for its needle and question


def _flags(**flags: bool) -> list[str]:
    return [f"--{name.replace('_', '-')}" for name, on in flags.items() if on]


@dataclass(frozen=True)
class Overhead:
    """``rankkit overhead SCENARIO``: rankkit's path against plain transformers'."""

    scenario: str
    lengths: tuple[int, ...]
    repeats: int = 3
    memory: bool = False
    cuda_graphs: bool = False
    compile_decode: bool = False
    model: str = SHAPE
    needs_cuda = False

    def command(self, out: Path, name: str) -> list[str]:
        lengths = ",".join(map(str, self.lengths))
        return [
            *("rankkit", "overhead", self.scenario, "--model", self.model, "--lengths", lengths),
            *("--repeats", str(self.repeats), *_flags(cuda_graphs=self.cuda_graphs, compile_decode=self.compile_decode)),
            *([] if self.memory else ["--no-memory"]),
            "--json",
        ]

    def run(self, out: Path, name: str) -> list[dict]:
        return overhead.run_overhead(
            self.scenario,
            list(self.lengths),
            model_spec=self.model,
            repeats=self.repeats,
            with_memory=self.memory,
            memory_in_process=True,  # the memoised model, not a fresh process reloading it per side
            cuda_graphs=self.cuda_graphs,
            compile_decode=self.compile_decode,
        )

    def smoke(self, model: str) -> Overhead:
        return replace(self, model=model, lengths=(SMOKE_LENGTH,), repeats=1)


@dataclass(frozen=True)
class Bench:
    """``rankkit bench`` at keep ``KEEP`` over needle prompts of ``length`` tokens."""

    methods: tuple[str, ...]
    length: int
    examples: int = 1
    model: str = SHAPE
    cuda_graphs: bool = False
    compile_decode: bool = False
    max_new_tokens: int = 32
    warmup: int = 1
    repeats: int = 2
    needs_cuda = False

    @property
    def data(self) -> str:
        return f"niah:n={self.examples},length={self.length}"

    def command(self, out: Path, name: str) -> list[str]:
        return [
            *("rankkit", "bench", "--model", self.model, "--methods", ",".join(self.methods)),
            *("--keep", str(KEEP), "--data", self.data, "--max-new-tokens", str(self.max_new_tokens)),
            *("--warmup", str(self.warmup), "--repeats", str(self.repeats)),
            *_flags(cuda_graphs=self.cuda_graphs, compile_decode=self.compile_decode),
            *("--out", str(out / f"{name}.parquet"), "--overwrite", "--format", "json"),
        ]

    def run(self, out: Path, name: str) -> list[dict]:
        frame = bench(
            list(self.methods),
            self.data,
            keep=KEEP,
            out=out / f"{name}.parquet",
            overwrite=True,
            settings=BenchSettings(max_new_tokens=self.max_new_tokens, warmup=self.warmup, repeats=self.repeats),
            setup=self.setup(),
        )
        return summary(frame).to_dicts()

    def setup(self) -> Setup:
        return Setup(model=self.model, cuda_graphs=self.cuda_graphs, compile_decode=self.compile_decode)

    def smoke(self, model: str) -> Bench:
        warmup = self.setup().warmups_needed
        return replace(self, model=model, length=SMOKE_NIAH_LENGTH, examples=1, max_new_tokens=2, warmup=warmup, repeats=1)


def _tool_command(out: Path, name: str) -> list[str]:
    return ["python3", "tools/bench_gpu.py", str(out), name]


def device_idle(kernels: list[tuple[float, float, str]], host_start: float, top: int = 5) -> dict:
    """Where the device waited, from its kernels' (start, end, name) in µs and the time the host began
    the work: its time from then to the last kernel's end (``span_us``), its kernels' busy time
    (overlaps counted once), the time before its first kernel (the host's first launches), and the
    ``top`` longest gaps between kernels with the kernels either side. Time the host spends between
    kernels (a copy from pageable memory, a read, launches slower than the kernels they start)
    shows here, where the kernels' own times cannot show it."""
    kernels = sorted(kernels)
    busy, gaps, reach, before = 0.0, [], host_start, "start"
    for start, end, name in kernels:
        if start > reach:
            gaps.append({"at_us": reach - host_start, "us": start - reach, "after": before, "before": name})
        busy += max(0.0, end - max(start, reach))
        if end > reach:
            reach, before = end, name
    first = max(0.0, kernels[0][0] - host_start) if kernels else 0.0
    return {
        "span_us": reach - host_start,
        "busy_us": busy,
        "before_first_kernel_us": first,
        "gaps_us": sum(gap["us"] for gap in gaps) - first,
        "longest_gaps": sorted(gaps, key=lambda gap: gap["us"], reverse=True)[:top],
    }


RUNTIME_CALLS = ("cuda", "cu")  # the CUDA runtime's and driver's calls, as the profiler names them


@dataclass(frozen=True)
class Profile:
    """Each named side of an overhead scenario under torch.profiler, after a warm-up: the operators
    and kernels by device time (by CPU time where there is no GPU), their top rows and the table;
    on a GPU also where the device waited (``device_idle``) and the host's calls into CUDA by time
    (a stream synchronisation or an allocation there is time the device may wait)."""

    scenario: str
    length: int
    sides: tuple[str, ...] = ("rankkit",)
    model: str = SHAPE
    top: int = 25
    needs_cuda = False
    command = staticmethod(_tool_command)

    def run(self, out: Path, name: str) -> dict:
        from torch.profiler import ProfilerActivity, profile

        loaded = models.load(self.model, device="auto")
        on_gpu = loaded.device.type == "cuda"
        sort_by = "device_time_total" if on_gpu else "cpu_time_total"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        profiled_sides = {}
        with torch.inference_mode():
            sides = overhead._sides(self.scenario, loaded, self.length)
            for side in self.sides:
                work = getattr(sides, side)
                work()
                with profile(activities=activities) as profiled:
                    work()
                    if on_gpu:
                        torch.cuda.synchronize()
                averages = profiled.key_averages()
                rows = sorted(averages, key=lambda event: getattr(event, sort_by), reverse=True)[: self.top]
                profiled_sides[side] = {
                    "top": [{"name": row.key, "calls": row.count, "us": getattr(row, sort_by)} for row in rows],
                    "table": averages.table(sort_by=sort_by, row_limit=self.top),
                }
                if on_gpu:
                    profiled_sides[side] |= self._waits(profiled.events(), averages)
        return profiled_sides

    def _waits(self, events, averages) -> dict:
        from torch.autograd import DeviceType

        kernels = [(e.time_range.start, e.time_range.end, e.name) for e in events if e.device_type == DeviceType.CUDA]
        host_start = min(e.time_range.start for e in events if e.device_type == DeviceType.CPU)
        runtime = sorted(
            (row for row in averages if row.key.startswith(RUNTIME_CALLS)), key=lambda row: row.cpu_time_total, reverse=True
        )
        return {
            "device_idle": device_idle(kernels, host_start),
            "runtime_calls": [{"name": row.key, "calls": row.count, "us": row.cpu_time_total} for row in runtime[: self.top]],
        }

    def smoke(self, model: str) -> Profile:
        return replace(self, model=model, length=SMOKE_LENGTH, top=5)


@dataclass(frozen=True)
class SplitThreshold:
    """A masked decode step's attention at the 8B shape, SDPA against ``runner.split_decode_attention``,
    per call: eagerly (launches included) and replayed from a graph of ``calls`` calls (a layer's
    worth each), for where ``SPLIT_DECODE_FROM`` should lie in each mode."""

    key_counts: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
    calls: int = 32
    kv_heads: int = 8
    group: int = 4
    head_dim: int = 128
    needs_cuda = True
    command = staticmethod(_tool_command)

    def run(self, out: Path, name: str) -> list[dict]:
        from rankkit.runner import split_decode_attention

        device, dtype = torch.device("cuda"), torch.bfloat16
        scale = self.head_dim**-0.5
        ways = {
            "sdpa": lambda query, key, value, mask: torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, scale=scale
            ),
            "split": lambda query, key, value, mask: split_decode_attention(query, key, value, mask, scale),
        }
        rows = []
        for keys in self.key_counts:
            query = torch.randn(1, self.kv_heads, self.group, self.head_dim, device=device, dtype=dtype)
            key, value = (
                torch.randn(1, self.kv_heads, keys, self.head_dim, device=device, dtype=dtype) for _ in range(2)
            )
            mask = torch.rand(1, self.kv_heads, 1, keys, device=device) > 0.1
            inputs = (query, key, value, mask)
            row = {"keys": keys}
            for way, attend in ways.items():
                for _ in range(3):
                    attend(*inputs)
                torch.cuda.synchronize()
                started = time.perf_counter()
                for _ in range(self.calls):
                    attend(*inputs)
                torch.cuda.synchronize()
                row[f"{way}_eager_us"] = (time.perf_counter() - started) / self.calls * 1e6
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(self.calls):
                        attend(*inputs)
                graph.replay()
                torch.cuda.synchronize()
                started = time.perf_counter()
                for _ in range(5):
                    graph.replay()
                torch.cuda.synchronize()
                row[f"{way}_graph_us"] = (time.perf_counter() - started) / (5 * self.calls) * 1e6
            rows.append(row)
        return rows

    def smoke(self, model: str) -> SplitThreshold:
        return replace(self, key_counts=(1024,), calls=2)


# name: (time limit in seconds, the step), in the order a lease should measure them, since its time
# may run out (docs/benchmarks.md, "GPU"): first what no lease has measured since the change it
# checks (eager decode at 8k, whose target was missed, with fewer dispatches a layer; an unmasked
# 64k step left to SDPA; the bench's full step at 32k unsplit; the compiled static step, minutes of
# compiling; the 128k rows, run 1's), then the rest of the rows whose targets were missed (the
# runner's 8k prefill, the graphed KV methods, the small model),
# then the rest, and where the time goes. The rows whose target is a ratio near 1 (the runner, eager
# decode) take 6 repeats, the fewest whose median ratio has an interval (eval.stats.median_interval).
STEPS = {
    # a plain eager step with 2 operators a layer beyond transformers' step, where it had 10
    "decode": (150, Overhead("decode", (8192, 32768), repeats=6)),
    # an unmasked step over 64k keys, left to SDPA (split there in run 5, it took 1.30x model.generate's)
    "decode-long": (150, Overhead("decode", (65536,), repeats=6)),
    "methods-32k": (200, Bench(PROMPT_PRUNING + KV_METHODS, 32768)),
    "decode-compiled": (240, Overhead("decode", (32768,), cuda_graphs=True, compile_decode=True)),
    "methods-32k-compiled": (
        240,
        Bench(("snapkv", "streamingllm", "lava"), 32768, cuda_graphs=True, compile_decode=True),
    ),
    "methods-128k": (200, Bench(PROMPT_PRUNING, 131072, repeats=1)),
    "runner": (90, Overhead("runner", (8192, 32768), repeats=6)),
    "methods-32k-graphs": (120, Bench(KV_METHODS, 32768, cuda_graphs=True)),
    "small-4k": (
        90,
        Bench(
            PROMPT_PRUNING + ("asl", "snapkv", "specprefill", "sliminfer"),
            4096,
            examples=4,
            model=SMALL,
            max_new_tokens=8,
            repeats=3,
        ),
    ),
    "capture-long": (150, Overhead("capture", (65536, 131072), repeats=1, memory=True)),
    "capture": (90, Overhead("capture", (8192, 32768), memory=True)),
    "decode-graphs": (120, Overhead("decode", (8192, 32768), cuda_graphs=True)),
    # where the time goes: decode attention per call, a decode step at 32k, a capture and the runner's prefill at 8k
    "split-threshold": (30, SplitThreshold()),
    "profile-decode": (90, Profile("decode", 32768)),
    "profile-capture": (60, Profile("capture", 8192, sides=("baseline", "rankkit"))),
    "profile-runner": (60, Profile("runner", 8192, sides=("baseline", "rankkit"))),
}


def smoke_model_folder(out: Path) -> Path:
    return out / "smoke-model"


def make_smoke_model(out: Path) -> str:
    """``SMALL``'s architecture with ``SMOKE_LAYERS`` layers and seeded random weights, saved with the
    default model's tokenizer as an HF folder (``smoke_model_folder``): the smoke's model, loaded
    as a user's folder is."""
    from transformers import AutoModelForCausalLM

    config = models.random_config(SMALL)
    config.num_hidden_layers = SMOKE_LAYERS
    with torch.random.fork_rng():
        torch.manual_seed(models.RANDOM_SEED)
        model = AutoModelForCausalLM.from_config(config)
    folder = smoke_model_folder(out)
    model.save_pretrained(folder)
    models.load_tokenizer(SMALL).save_pretrained(folder)
    return str(folder)


class StepTimeout(Exception):
    pass


def _out_of_time(signum, frame):
    raise StepTimeout


def _run_step(name: str, limit: int, step, out: Path) -> dict:
    record = {"step": name, "command": " ".join(step.command(out, name))}
    if step.needs_cuda and not torch.cuda.is_available():
        return record | {"skipped": "needs CUDA"}
    started = time.perf_counter()
    signal.alarm(limit)
    try:
        record["rows"] = step.run(out, name)
    except StepTimeout:
        record["error"] = f"out of time after {limit} s"
    except Interrupted as error:  # Ctrl-C or the lease's own timeout: what was kept, then no further step
        record |= {"error": str(error), "interrupted": True}
    except Exception as error:  # one step's failure is a finding, not the end of the lease
        record |= {"error": repr(error), "traceback": traceback.format_exc()}
    finally:
        signal.alarm(0)
    record["seconds"] = time.perf_counter() - started
    return record


def main(out: Path, names: list[str], smoke: bool = False) -> None:
    unknown = [name for name in names if name not in STEPS]
    if unknown:
        sys.exit(f"unknown step {', '.join(unknown)}: use {', '.join(STEPS)}")
    warnings.simplefilter("ignore")
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGALRM, _out_of_time)
    environment = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "smoke": smoke,
    }
    smoke_model = make_smoke_model(out) if smoke else None
    with open(out / "gpu-table.jsonl", "a") as journal, models.loaded_once():
        journal.write(json.dumps({"step": "environment", **environment}) + "\n")
        for name in names:
            limit, step = STEPS[name]
            print(f"[{time.strftime('%H:%M:%S')}] {name} (limit {limit} s)", flush=True)
            record = _run_step(name, limit, step.smoke(smoke_model) if smoke else step, out)
            journal.write(json.dumps(record, default=str) + "\n")
            journal.flush()
            print(json.dumps(record, default=str)[:3000], flush=True)
            if record.get("interrupted"):
                sys.exit(130)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


if __name__ == "__main__":
    arguments = sys.argv[1:]
    smoke = "--smoke" in arguments
    if smoke:
        arguments.remove("--smoke")
    if not arguments:
        sys.exit("usage: python3 tools/bench_gpu.py OUT [--smoke] [STEP ...]")
    main(Path(arguments[0]), arguments[1:] or list(STEPS), smoke)
