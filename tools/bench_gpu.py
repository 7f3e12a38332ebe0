"""The GPU table of docs/benchmarks.md ("GPU") in one process, for a lease too short to reload an 8B model per command.

Each step calls the library function behind one command of ``make bench-gpu`` with that
command's arguments (``rankkit.overhead.run_overhead``, ``rankkit.bench.bench``); the only
difference is that every model is built once and shared by the steps (``models.load`` is
memoised here), and peak memory is the CUDA allocator's, read in this process
(``overhead.peak_memory``) instead of a fresh one per side. Steps run in the order given,
each under its own time limit; a step that fails or runs out of time is recorded and the
next one starts. One JSON object per step goes to ``OUT/gpu-table.jsonl`` as it finishes. The
``profile-*`` steps record where a decode step's and a capture's device time goes (torch.profiler).

    python3 tools/bench_gpu.py OUT [STEP ...]   # default: every step, in STEPS order
"""

from __future__ import annotations

import json
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

from rankkit import models, overhead
from rankkit.bench import BenchSettings, Setup, bench, summary
from rankkit.methods.base import Budget

SHAPE = "random:llama-3.1-8b"
SMALL = "random:smollm2-135m"  # the default model's architecture: its timings, without its 93 MB wheel
KV_METHODS = ["sliminfer", "specprefill", "lava", "sage-kv", "streamingllm", "snapkv"]
PROMPT_PRUNING = ["gemfilter", "fastkv", "claa"]
KEEP = [Budget.from_keep(0.1)]


def _overhead(scenario, lengths, repeats=3, memory=False, cuda_graphs=False, model=SHAPE, compile_decode=False):
    def run():
        rows = overhead.run_overhead(
            scenario,
            lengths,
            model_spec=model,
            repeats=repeats,
            with_memory=False,
            cuda_graphs=cuda_graphs,
            compile_decode=compile_decode,
        )
        if memory:
            for row in rows:
                for side in ("baseline", "rankkit"):
                    peak = overhead.peak_memory(
                        scenario, side, row["tokens"], model, "auto", cuda_graphs, compile_decode
                    )
                    row[f"{side}_peak_bytes"] = peak
                row["memory_ratio"] = row["rankkit_peak_bytes"] / row["baseline_peak_bytes"]
        return rows

    return run


def _bench(
    methods, data, model=SHAPE, cuda_graphs=False, max_new_tokens=32, warmup=1, repeats=2, compile_decode=False
):
    def run():
        frame = bench(
            methods,
            KEEP,
            data,
            settings=BenchSettings(max_new_tokens=max_new_tokens, warmup=warmup, repeats=repeats),
            setup=Setup(model=model, cuda_graphs=cuda_graphs, compile_decode=compile_decode),
        )
        return summary(frame).to_dicts()

    return run


def _profile(scenario, length, model=SHAPE, top=25, sides_profiled=("rankkit",)):
    """Each named side of an overhead scenario under torch.profiler, after a warm-up: the operators
    and kernels by device time (by CPU time where there is no GPU), their top rows and the table."""

    def run():
        from torch.profiler import ProfilerActivity, profile

        loaded = models.load(model, device="auto")
        on_gpu = loaded.device.type == "cuda"
        sort_by = "device_time_total" if on_gpu else "cpu_time_total"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        profiled_sides = {}
        with torch.inference_mode():
            sides = overhead._sides(scenario, loaded, length)
            for side in sides_profiled:
                work = getattr(sides, side)
                work()
                with profile(activities=activities) as profiled:
                    work()
                    if on_gpu:
                        torch.cuda.synchronize()
                averages = profiled.key_averages()
                rows = sorted(averages, key=lambda event: getattr(event, sort_by), reverse=True)[:top]
                profiled_sides[side] = {
                    "top": [{"name": row.key, "calls": row.count, "us": getattr(row, sort_by)} for row in rows],
                    "table": averages.table(sort_by=sort_by, row_limit=top),
                }
        return profiled_sides

    return run


def _split_threshold(
    key_counts=(1024, 2048, 4096, 8192, 16384, 32768), calls=32, kv_heads=8, group=4, head_dim=128
):
    """A masked decode step's attention at the 8B shape, SDPA against ``runner.split_decode_attention``,
    per call: eagerly (launches included) and replayed from a graph of ``calls`` calls (a layer's
    worth each), for where ``SPLIT_DECODE_FROM`` should lie in each mode."""

    def run():
        from rankkit.runner import split_decode_attention

        device, dtype = torch.device("cuda"), torch.bfloat16
        ways = {
            "sdpa": lambda query, key, value, mask: torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, scale=head_dim**-0.5
            ),
            "split": lambda query, key, value, mask: split_decode_attention(
                query, key, value, mask, head_dim**-0.5
            ),
        }
        rows = []
        for keys in key_counts:
            query = torch.randn(1, kv_heads, group, head_dim, device=device, dtype=dtype)
            key, value = (
                torch.randn(1, kv_heads, keys, head_dim, device=device, dtype=dtype) for _ in range(2)
            )
            mask = torch.rand(1, kv_heads, 1, keys, device=device) > 0.1
            inputs = (query, key, value, mask)
            row = {"keys": keys}
            for name, attend in ways.items():
                for _ in range(3):
                    attend(*inputs)
                torch.cuda.synchronize()
                started = time.perf_counter()
                for _ in range(calls):
                    attend(*inputs)
                torch.cuda.synchronize()
                row[f"{name}_eager_us"] = (time.perf_counter() - started) / calls * 1e6
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(calls):
                        attend(*inputs)
                graph.replay()
                torch.cuda.synchronize()
                started = time.perf_counter()
                for _ in range(5):
                    graph.replay()
                torch.cuda.synchronize()
                row[f"{name}_graph_us"] = (time.perf_counter() - started) / (5 * calls) * 1e6
            rows.append(row)
        return rows

    return run


# name: (time limit in seconds, the run), in the order of what the next lease must measure first:
# the rows changed since the last one (the split thresholds in graphed and eager decode, the rolling
# windows written by the cache's update, the compiled decode step, the page-locked transfer at 64k
# and 128k, the 128k rows the last lease's time cut off), then where the time goes, then the rest
STEPS = {
    "methods-32k-graphs": (120, _bench(KV_METHODS, "niah:n=1,length=32768", cuda_graphs=True)),
    "decode": (90, _overhead("decode", [8192, 32768])),
    "decode-compiled": (240, _overhead("decode", [32768], cuda_graphs=True, compile_decode=True)),
    "methods-32k-compiled": (
        240,
        _bench(["snapkv", "streamingllm", "lava"], "niah:n=1,length=32768", cuda_graphs=True, compile_decode=True),
    ),
    "methods-32k": (200, _bench(PROMPT_PRUNING + KV_METHODS, "niah:n=1,length=32768")),
    "capture-long": (150, _overhead("capture", [65536, 131072], repeats=1, memory=True)),
    "methods-128k": (200, _bench(PROMPT_PRUNING, "niah:n=1,length=131072", repeats=1)),
    "decode-graphs": (120, _overhead("decode", [8192, 32768], cuda_graphs=True)),
    "capture": (90, _overhead("capture", [8192, 32768], memory=True)),
    # where the time goes: decode attention per call, a decode step at 32k, a capture at 8k
    "split-threshold": (30, _split_threshold()),
    "profile-decode": (90, _profile("decode", 32768)),
    "profile-capture": (60, _profile("capture", 8192, sides_profiled=("baseline", "rankkit"))),
    "small-4k": (
        90,
        _bench(
            PROMPT_PRUNING + ["asl", "snapkv", "specprefill", "sliminfer"],
            "niah:n=4,length=4096",
            model=SMALL,
            max_new_tokens=8,
            repeats=3,
        ),
    ),
    "runner": (60, _overhead("runner", [8192, 32768])),
}


def _memoised_load():
    loaded: dict[str, models.LoadedModel] = {}
    load = models.load

    def shared(spec, **options):
        if spec not in loaded:
            loaded[spec] = load(spec, **options)
        return loaded[spec]

    return shared


class StepTimeout(Exception):
    pass


def _out_of_time(signum, frame):
    raise StepTimeout


def main(out: Path, names: list[str]) -> None:
    unknown = [name for name in names if name not in STEPS]
    if unknown:
        sys.exit(f"unknown step {', '.join(unknown)}: use {', '.join(STEPS)}")
    warnings.simplefilter("ignore")
    models.load = _memoised_load()
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGALRM, _out_of_time)
    environment = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    with open(out / "gpu-table.jsonl", "a") as journal:
        journal.write(json.dumps({"step": "environment", **environment}) + "\n")
        for name in names:
            limit, run = STEPS[name]
            started = time.perf_counter()
            print(f"[{time.strftime('%H:%M:%S')}] {name} (limit {limit} s)", flush=True)
            signal.alarm(limit)
            try:
                record = {"step": name, "rows": run()}
            except StepTimeout:
                record = {"step": name, "error": f"out of time after {limit} s"}
            except Exception as error:  # one step's failure is a finding, not the end of the lease
                record = {"step": name, "error": repr(error), "traceback": traceback.format_exc()}
            finally:
                signal.alarm(0)
            record["seconds"] = time.perf_counter() - started
            journal.write(json.dumps(record, default=str) + "\n")
            journal.flush()
            print(json.dumps(record, default=str)[:3000], flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] or list(STEPS))
