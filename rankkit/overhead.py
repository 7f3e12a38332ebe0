"""What rankkit's own machinery costs over plain transformers, measured side by side.

Each scenario pairs a baseline with the rankkit path doing the same job on the same
prompt: the runner's prefill against ``model(...)``, a capture of every probe against a
plain forward, the oracle against plain greedy generation. Times are medians of
interleaved repeats after a warm-up, so machine noise hits both alike. Peak memory (of
tensors, see ``peak_memory``) is measured in a fresh subprocess per (scenario, side,
length), so neither side inherits the other's state.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rankkit import models
from rankkit.measure import TensorMemoryTracker, measure
from rankkit.runner import Runner

ORACLE_NEW_TOKENS = 16


@dataclass
class Sides:
    baseline: Callable[[], object]
    rankkit: Callable[[], object]


def prompt_ids(tokenizer, length: int, seed: int = 0) -> torch.Tensor:
    """A prompt of exactly ``length`` ordinary tokens; attention cost does not depend on content."""
    generator = torch.Generator().manual_seed(seed)
    special = set(tokenizer.all_special_ids)
    vocabulary = torch.tensor([i for i in range(len(tokenizer)) if i not in special][:20000])
    return vocabulary[torch.randint(0, vocabulary.numel(), (length,), generator=generator)]


def _runner_sides(model, tokenizer, ids) -> Sides:
    runner = Runner(model)
    return Sides(
        baseline=lambda: model(ids[None], logits_to_keep=1, use_cache=True),
        rankkit=lambda: runner.prefill(ids),
    )


def _capture_sides(model, tokenizer, ids) -> Sides:
    from rankkit.probes import ProbeRecorder, parse_probes

    runner = Runner(model)

    def capture():
        recorder = ProbeRecorder(parse_probes("all"))
        runner.prefill(ids, hooks=[recorder])
        return recorder.scores()

    return Sides(baseline=lambda: model(ids[None], logits_to_keep=1, use_cache=True), rankkit=capture)


def _oracle_sides(model, tokenizer, ids) -> Sides:
    from rankkit.oracle import answer_informed_oracle

    runner = Runner(model)
    # Both sides generate exactly the same number of tokens: EOS is switched off for the baseline
    # and the oracle is given the baseline's answer to teacher-force.
    plain = model.generate(
        ids[None], max_new_tokens=ORACLE_NEW_TOKENS, min_new_tokens=ORACLE_NEW_TOKENS, do_sample=False
    )
    answer_text = tokenizer.decode(plain[0, ids.shape[0] :])
    return Sides(
        baseline=lambda: model.generate(
            ids[None], max_new_tokens=ORACLE_NEW_TOKENS, min_new_tokens=ORACLE_NEW_TOKENS, do_sample=False
        ),
        rankkit=lambda: answer_informed_oracle(
            runner,
            ids,
            tokenizer=tokenizer,
            answer="reference",
            reference_answer=answer_text,
            max_new_tokens=ORACLE_NEW_TOKENS,
        ),
    )


SCENARIOS: dict[str, tuple[Callable, str, str]] = {
    "runner": (_runner_sides, "model(...) prefill", "Runner.prefill"),
    "capture": (_capture_sides, "model(...) prefill", "capture, all probes, all layers"),
    "oracle": (
        _oracle_sides,
        f"model.generate, {ORACLE_NEW_TOKENS} tokens",
        "answer-informed oracle, same tokens",
    ),
}


def _sides(scenario: str, loaded, length: int) -> Sides:
    build = SCENARIOS[scenario][0]
    ids = prompt_ids(loaded.tokenizer, length).to(loaded.device)
    return build(loaded.model, loaded.tokenizer, ids)


def peak_memory(scenario: str, side: str, length: int, model_spec: str, device: str) -> int:
    """Peak extra tensor memory of one side's first run (call it in a fresh process).

    CUDA: the allocator's peak. CPU: the peak of live tensor storages the run created,
    counted operator by operator (``TensorMemoryTracker``); the process's resident size
    is no measure here, since glibc keeps freed blocks and fragments differently for two
    runs with the same tensor footprint.
    """
    loaded = models.load(model_spec, device=device)
    with torch.inference_mode():
        run = getattr(_sides(scenario, loaded, length), side)
        if loaded.device.type == "cuda":
            with measure(loaded.device) as m:
                run()
            return m.peak_bytes
        with TensorMemoryTracker() as tracker:
            run()
    return tracker.peak


def _peak_in_subprocess(scenario: str, side: str, length: int, model_spec: str, device: str) -> int | None:
    call = f"peak_memory({scenario!r}, {side!r}, {length}, {model_spec!r}, {device!r})"
    code = (
        f"import json, torch; torch.set_num_threads({torch.get_num_threads()}); "
        f"from rankkit.overhead import peak_memory; print(json.dumps({call}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _interleaved_times(sides: Sides, device, repeats: int, progress) -> dict[str, list[float]]:
    times = {"baseline": [], "rankkit": []}
    with torch.inference_mode():
        sides.baseline(), sides.rankkit()  # warm-up, excluded
        for _ in range(repeats):
            for side in ("baseline", "rankkit"):
                with measure(device) as m:
                    getattr(sides, side)()
                times[side].append(m.seconds)
            if progress:
                progress()
    return times


def run_overhead(
    scenario: str,
    lengths: list[int],
    *,
    model_spec: str = "default",
    device: str = "auto",
    repeats: int = 5,
    with_memory: bool = True,
    with_timing: bool = True,
    progress=None,
) -> list[dict]:
    """One row per length: median seconds of both sides, their ratio, and peak memory of both."""
    loaded = models.load(model_spec, device=device)
    baseline_name, rankkit_name = SCENARIOS[scenario][1:]
    rows = []
    for length in lengths:
        times = {"baseline": [float("nan")], "rankkit": [float("nan")]}
        if with_timing:
            times = _interleaved_times(_sides(scenario, loaded, length), loaded.device, repeats, progress)
        row = {
            "scenario": scenario,
            "model": loaded.model_id,
            "device": str(loaded.device),
            "tokens": length,
            "baseline": baseline_name,
            "rankkit": rankkit_name,
            "baseline_s": statistics.median(times["baseline"]),
            "rankkit_s": statistics.median(times["rankkit"]),
            "repeats": repeats,
        }
        row["time_ratio"] = row["rankkit_s"] / row["baseline_s"]
        if with_memory:
            for side in ("baseline", "rankkit"):
                row[f"{side}_peak_bytes"] = _peak_in_subprocess(scenario, side, length, model_spec, device)
            if row["baseline_peak_bytes"] and row["rankkit_peak_bytes"] is not None:
                row["memory_ratio"] = row["rankkit_peak_bytes"] / row["baseline_peak_bytes"]
        rows.append(row)
    return rows
