"""What analysis costs at benchmark scale: ``rankkit overhead analysis``.

Builds a synthetic store through the stores API (N examples x T tokens x 30 layers x the
six probe settings of a default capture, 9 query / 3 KV heads, with oracles) and runs ``compare --oracle`` (all probes and methods),
``variance`` and ``dashboard`` on it, each as its command in a fresh process so that its wall time and
peak resident memory (the largest of the command and its workers, from ``wait4``) are
its own. Scores are random: the metrics' cost does not depend on their values.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from rankkit.checks import check_token_counts
from rankkit.errors import RankkitError
from rankkit.progress import Progress, ProgressCallback, ignore

LAYERS = 30
KV_HEADS = 3
QUERY_HEADS = 9  # the default model's shape; last_token_heads keeps a row per query head
QUESTION_TOKENS = 32  # after the context, like a prompt's question and observation window
NEEDLE_TOKENS = 8  # the evidence, at the middle of the prompt
# the needle at the middle and its end inside the context: T // 2 + 8 <= T - 32
MIN_TOKENS = 2 * (QUESTION_TOKENS + NEEDLE_TOKENS)

STEPS = {  # each command as a user runs it (compare writes every frame it makes)
    "compare": ["compare", "{store}", "--out", "{compare_out}", "--workers", "{workers}", "--json"],
    "variance": ["variance", "{store}", "--workers", "{workers}", "--json"],
    "dashboard": ["dashboard", "{store}", "--out", "{out}", "--workers", "{workers}"],
}


def build_store(path: Path, examples: int, tokens: int, seed: int = 0) -> None:
    """A store of ``examples`` synthetic examples of ``tokens`` tokens, each with an oracle."""
    from rankkit import stores
    from rankkit.methods import probes_methods_need

    probes = [probe.key for probe in probes_methods_need()]  # a default capture's
    rng = np.random.default_rng(seed)
    meta = {"num_layers": LAYERS, "num_attention_heads": QUERY_HEADS, "kv_heads": KV_HEADS}
    writer = stores.create(path, {"model": {"id": "synthetic", "num_hidden_layers": LAYERS}, **meta})
    context = [0, tokens - QUESTION_TOKENS]
    needle = tokens // 2
    for index in range(examples):
        spans = {"context_tokens": context, "evidence_tokens": [[needle, needle + NEEDLE_TOKENS]]}
        writer.write_example(
            f"synthetic:{index}",
            attrs={"task": "synthetic", "spans": spans},
            tokens=rng.integers(0, 50_000, tokens),
            scores={
                probe: rng.random(
                    (LAYERS, QUERY_HEADS if probe == "last_token_heads" else KV_HEADS, tokens),
                    dtype=np.float32,
                )
                for probe in probes
            },
        )
        oracle_layers = rng.random((LAYERS, tokens), dtype=np.float32)
        writer.add_oracle(
            f"synthetic:{index}", oracle=oracle_layers.mean(axis=0), oracle_layers=oracle_layers, attrs={}
        )


def run_analysis_cost(
    examples: int,
    lengths: list[int],
    *,
    workers: int | None = None,
    progress: ProgressCallback = ignore,
) -> list[dict[str, Any]]:
    """One row per (length, step): wall seconds, seconds per example, peak MiB, files per example,
    and for the dashboard the page's size in MiB. ``progress`` gets an event per store built and step run."""
    from rankkit.eval.parallel import checked_workers

    check_token_counts(lengths)
    if min(lengths) < MIN_TOKENS:
        raise RankkitError(
            f"--lengths {min(lengths)} is too short for a synthetic example: it needs at least {MIN_TOKENS} "
            f"tokens (a context holding an {NEEDLE_TOKENS}-token needle, then a {QUESTION_TOKENS}-token "
            "question); e.g. --lengths 2048"
        )
    if examples < 1:
        raise RankkitError(f"--examples takes a positive count, not {examples}")
    processes = checked_workers(workers)
    rows = []
    done, total = itertools.count(1), len(lengths) * (1 + len(STEPS))
    for tokens in lengths:
        with tempfile.TemporaryDirectory(prefix="rankkit-analysis-") as scratch:
            store = Path(scratch) / "synthetic.zarr"
            start = time.perf_counter()
            build_store(store, examples, tokens)
            os.sync()  # the build's writeback (gigabytes at 1,000 examples) is not the first step's to pay
            build_s = time.perf_counter() - start
            first_example = next((store / "examples").iterdir())
            files = sum(1 for file in first_example.rglob("*") if file.is_file())
            progress(Progress("built", next(done), total, f"{examples} examples of {tokens} tokens"))
            report = Path(scratch) / "report.html"
            for step, arguments in STEPS.items():
                values = {
                    "store": store,
                    "out": report,
                    "compare_out": Path(scratch) / "compare.parquet",
                    "workers": processes,
                }
                seconds, peak_bytes = _timed_command([argument.format(**values) for argument in arguments])
                rows.append(
                    {
                        "step": step,
                        "examples": examples,
                        "tokens": tokens,
                        "workers": processes,
                        "seconds": seconds,
                        "seconds_per_example": seconds / examples,
                        "peak_mib": peak_bytes / 2**20,
                        "files_per_example": files,
                        "output_mib": report.stat().st_size / 2**20 if step == "dashboard" else None,
                        "build_seconds": build_s,
                    }
                )
                progress(Progress("timed", next(done), total, f"{step} at {tokens} tokens"))
    return rows


def _timed_command(arguments: list[str]) -> tuple[float, int]:
    """Wall time and peak resident bytes of ``rankkit ARGUMENTS`` (its workers included)."""
    with tempfile.TemporaryFile("w+") as errors:
        start = time.perf_counter()
        process = subprocess.Popen(
            [sys.executable, "-m", "rankkit.cli", *arguments], stdout=subprocess.DEVNULL, stderr=errors
        )
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status) != 0:
            errors.seek(0)
            lines = errors.read().strip().splitlines()
            raise RankkitError(f"analysis step failed: {lines[-1] if lines else status}")
    return seconds, usage.ru_maxrss * 1024  # Linux reports kibibytes
