"""What rankkit's own machinery costs over plain transformers, measured side by side.

Each scenario pairs a baseline with the rankkit path doing the same job on the same
prompt: the runner's prefill against ``model(...)``, a capture of every probe against a
plain forward, the oracle against plain greedy generation, the runner's decode step
against ``model.generate``'s (time per token, and the memory-bandwidth bound of a step). Times are medians of
interleaved repeats after a warm-up, so machine noise hits both alike. Peak memory (of
tensors, see ``peak_memory``) is measured in a fresh subprocess per (scenario, side,
length), so neither side inherits the other's state.
"""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rankkit import defaults, models
from rankkit.checks import check_length, check_token_counts
from rankkit.errors import RankkitError
from rankkit.eval.stats import median_interval
from rankkit.measure import (
    OperatorLaunches,
    TensorMemoryTracker,
    counterbalanced,
    decode_step_bytes,
    measure,
    memory_bandwidth,
    paired_ratios,
    read_bandwidth,
)
from rankkit.progress import Progress, ProgressCallback, ignore
from rankkit.runner import Runner, check_decode_options, greedy_continue

ORACLE_NEW_TOKENS = 16
DECODE_NEW_TOKENS = 32


@dataclass
class Sides:
    baseline: Callable[[], object]
    rankkit: Callable[[], object]
    steps: int = 1  # times are reported per step (decode: per token)
    bytes_per_step: int | None = None  # what one step must read from memory, where that bounds it


def prompt_ids(tokenizer, length: int, seed: int = 0) -> torch.Tensor:
    """A prompt of exactly ``length`` ordinary tokens; attention cost does not depend on content."""
    generator = torch.Generator().manual_seed(seed)
    special = set(tokenizer.all_special_ids)
    vocabulary = torch.tensor([i for i in range(len(tokenizer)) if i not in special][:20000])
    return vocabulary[torch.randint(0, vocabulary.numel(), (length,), generator=generator)]


def _runner_sides(runner: Runner, tokenizer, ids) -> Sides:
    model = runner.model
    return Sides(
        baseline=lambda: model(ids[None], logits_to_keep=1, use_cache=True),
        rankkit=lambda: runner.prefill(ids),
    )


def _capture_sides(runner: Runner, tokenizer, ids) -> Sides:
    from rankkit.probes import ProbeRecorder, parse_probes

    model = runner.model

    def capture():
        recorder = ProbeRecorder(parse_probes("all"))
        runner.prefill(ids, hooks=[recorder])
        return recorder.scores()

    return Sides(baseline=lambda: model(ids[None], logits_to_keep=1, use_cache=True), rankkit=capture)


def _oracle_sides(runner: Runner, tokenizer, ids) -> Sides:
    from rankkit.oracle import answer_informed_oracle

    model = runner.model
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


def _decode_sides(runner: Runner, tokenizer, ids) -> Sides:
    """``DECODE_NEW_TOKENS`` one-token steps after the prompt on each side, the prompt's KV already cached.

    ``model.generate`` continues from a cache of all but the last prompt token (cropped back
    after each run), so its steps are the last prompt token and the answer but one; the
    runner continues from its prefill's cache (a fork per run). Both decode past EOS.
    """
    from dataclasses import replace

    model = runner.model
    steps = DECODE_NEW_TOKENS
    cached = model(ids[None, :-1], logits_to_keep=1, use_cache=True).cache
    prefill = runner.prefill(ids)

    def generate():
        cached.crop(ids.shape[0] - 1 - cached.get_seq_length())  # negative: the tokens the last run added
        return model.generate(
            ids[None], cache=cached, max_new_tokens=steps, min_new_tokens=steps, do_sample=False
        )

    def decode():
        return greedy_continue(
            runner, replace(prefill, cache=prefill.cache.fork()), steps + 1, stop_at_eos=False
        )

    return Sides(generate, decode, steps=steps, bytes_per_step=decode_step_bytes(model, prefill.cache.nbytes()))


SCENARIOS: dict[str, tuple[Callable, str, str]] = {
    "runner": (_runner_sides, "model(...) prefill", "Runner.prefill"),
    "capture": (_capture_sides, "model(...) prefill", "capture, all probes, all layers"),
    "oracle": (
        _oracle_sides,
        f"model.generate, {ORACLE_NEW_TOKENS} tokens",
        "answer-informed oracle, same tokens",
    ),
    "decode": (_decode_sides, "model.generate, time per token", "Runner decode, time per token"),
}


@dataclass
class PlainDecodes:
    """A prompt prefilled in rankkit's runner and in the model itself, ready to decode one token at a time
    in each: ``ours(token, position)`` a plain runner step, ``theirs(token)`` ``model(...)`` over
    transformers' own DynamicCache. Both return the step's next-token logits [vocab]."""

    ours: Callable[[torch.Tensor, int], torch.Tensor]
    theirs: Callable[[torch.Tensor], torch.Tensor]
    first_token: torch.Tensor  # the prefill's greedy token, on the device


def plain_decodes(runner: Runner, ids: torch.Tensor, steps: int) -> PlainDecodes:
    model = runner.model
    cache = model(ids[None], use_cache=True).cache
    prefill = runner.prefill(ids)

    def theirs(token: torch.Tensor) -> torch.Tensor:
        return model(token.reshape(1, 1), cache=cache, use_cache=True).logits[0, -1]

    return PlainDecodes(runner.decoder(prefill, steps), theirs, torch.argmax(prefill.logits))


@torch.inference_mode()
def step_dispatches(runner: Runner, ids: torch.Tensor) -> tuple[int, int]:
    """Operators one plain decode step after ``ids`` dispatches, views included (each costs the host its
    dispatch): rankkit's runner's and transformers' own step, each counted after a first step."""
    decodes = plain_decodes(runner, ids, 2)
    token = decodes.first_token
    decodes.ours(token, len(ids))
    decodes.theirs(token)
    with OperatorLaunches(views=True) as ours:
        decodes.ours(token, len(ids) + 1)
    with OperatorLaunches(views=True) as theirs:
        decodes.theirs(token)
    return ours.count, theirs.count


@torch.inference_mode()  # a side's own setup (a prompt cache, a prefill) keeps no autograd state
def _sides(scenario: str, loaded, length: int, cuda_graphs: bool = False, compile_decode: bool = False) -> Sides:
    build = SCENARIOS[scenario][0]
    ids = prompt_ids(loaded.tokenizer, length).to(loaded.device)
    runner = Runner(loaded.model, cuda_graphs=cuda_graphs, compile_decode=compile_decode)
    return build(runner, loaded.tokenizer, ids)


def peak_memory(
    scenario: str,
    side: str,
    length: int,
    model_spec: str,
    device: str,
    cuda_graphs: bool = False,
    compile_decode: bool = False,
) -> int:
    """Peak extra tensor memory of one side's first run (call it in a fresh process).

    CUDA: the allocator's peak. CPU: the peak of live tensor storages the run created,
    counted operator by operator (``TensorMemoryTracker``); the process's resident size
    is no measure here, since glibc keeps freed blocks and fragments differently for two
    runs with the same tensor footprint.
    """
    loaded = models.load(model_spec, device=device)
    with torch.inference_mode():
        run = getattr(_sides(scenario, loaded, length, cuda_graphs, compile_decode), side)
        if loaded.device.type == "cuda":
            with measure(loaded.device) as m:
                run()
            return m.peak_bytes
        with TensorMemoryTracker() as tracker:
            run()
    return tracker.peak


def _peak_in_subprocess(
    scenario: str, side: str, length: int, model_spec: str, device: str, cuda_graphs: bool, compile_decode: bool
) -> int | None:
    arguments = f"{scenario!r}, {side!r}, {length}, {model_spec!r}, {device!r}, {cuda_graphs}, {compile_decode}"
    call = f"peak_memory({arguments})"
    code = (
        f"import json, torch; torch.set_num_threads({torch.get_num_threads()}); "
        f"from rankkit.overhead import peak_memory; print(json.dumps({call}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:  # out of memory, say: the child's last line says why
        reason = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise RankkitError(
            f"measuring the {side} side's peak memory at {length} tokens in a fresh process failed ({reason}); "
            "pass --no-memory to time it alone"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def interleaved_times(sides: Sides, device, repeats: int, on_repeat: Callable[[], None]) -> dict[str, list[float]]:
    """Seconds of each side per repeat, after one warm-up of each, the sides' order alternating
    (``counterbalanced``) so that their times pair round by round (``paired_ratios``)."""
    times = {"baseline": [], "rankkit": []}
    with torch.inference_mode():
        sides.baseline(), sides.rankkit()  # warm-up, excluded
        for repeat in range(repeats):
            for side in counterbalanced(["baseline", "rankkit"], repeat):
                with measure(device) as m:
                    getattr(sides, side)()
                times[side].append(m.seconds)
            on_repeat()
    return times


def run_overhead(
    scenario: str,
    lengths: list[int],
    *,
    model_spec: str = "default",
    device: str = "auto",
    repeats: int = defaults.OVERHEAD_REPEATS,
    with_memory: bool = True,
    with_timing: bool = True,
    cuda_graphs: bool = False,
    compile_decode: bool = False,
    memory_in_process: bool = False,
    allow_overlength: bool = False,
    progress: ProgressCallback = ignore,
    threads: int | None = None,
) -> list[dict]:
    """One row per length: median seconds of both sides (per token for ``decode``), their ratio (the
    median of the ratios of each interleaved repeat, as bench's, with its 95% interval over the
    ``repeats`` from six of them on: ``eval.stats.median_interval``), and peak memory of both. ``decode`` rows add ``bound_s``, the time to read what a step must
    (``measure.decode_step_bytes``) at the device's bandwidth (``measure.memory_bandwidth``: the data
    sheet's for a GPU it names, else measured; ``bandwidth_source`` says which), ``bound_ratio``,
    the runner's time over it, and ``read_bound_s``, the same bytes at the measured bandwidth.
    ``cuda_graphs`` runs the runner's static decode, ``compile_decode`` its compiled step. Peak memory comes from a fresh process per side, or with
    ``memory_in_process`` from this one (a model loaded once serves every row: on CUDA the
    allocator's peak is the same, on CPU what earlier runs left allocated may count). A length past
    the model's positions is refused unless ``allow_overlength``. ``progress`` gets an event per timed
    repeat. ``threads`` sets torch's CPU threads for the process, so both sides run on the same ones
    (``models.use_threads``)."""
    models.use_threads(threads)
    check_token_counts(lengths)  # before the model loads
    check_decode_options(cuda_graphs, compile_decode)
    if not (with_timing or with_memory):
        raise RankkitError("--no-timing with --no-memory leaves nothing to measure: drop one of them")
    config = models.load_config(model_spec)
    for length in lengths:
        check_length(length, config, f"the prompt of --lengths {length}", allow_overlength=allow_overlength)
    loaded = models.load(model_spec, device=device)
    baseline_name, rankkit_name = SCENARIOS[scenario][1:]
    rows = []
    done = itertools.count(1)
    for length in lengths:
        sides = _sides(scenario, loaded, length, cuda_graphs, compile_decode)
        # a side not timed has no time: None, never a NaN that prints as a figure or breaks --json
        seconds = dict.fromkeys(("baseline", "rankkit"))
        ratios = []
        if with_timing:
            times = interleaved_times(
                sides,
                loaded.device,
                repeats,
                lambda length=length: progress(Progress("timed", next(done), len(lengths) * repeats, f"{length} tokens")),
            )
            seconds = {side: statistics.median(times[side]) / sides.steps for side in seconds}
            ratios = paired_ratios(times["rankkit"], times["baseline"])
        ratio_low, ratio_high = median_interval(ratios)
        row = {
            "scenario": scenario,
            "model": loaded.model_id,
            "device": str(loaded.device),
            "tokens": length,
            "baseline": baseline_name,
            "rankkit": rankkit_name + (", CUDA graphs" if cuda_graphs else "") + (", compiled" if compile_decode else ""),
            "baseline_s": seconds["baseline"],
            "rankkit_s": seconds["rankkit"],
            "repeats": repeats if with_timing else 0,
            "time_ratio": statistics.median(ratios) if ratios else None,
            "time_ratio_ci_low": ratio_low,
            "time_ratio_ci_high": ratio_high,
        }
        if sides.bytes_per_step is not None:
            bandwidth = memory_bandwidth(loaded.device)  # a measured one is measured once per process
            row["bound_s"] = sides.bytes_per_step / bandwidth.bytes_per_s
            row["bound_ratio"] = _ratio(row["rankkit_s"], row["bound_s"])
            row["bandwidth_source"] = bandwidth.source
            # what a streaming read achieves here: how much of a data sheet's bound a step could reach
            row["read_bound_s"] = sides.bytes_per_step / read_bandwidth(loaded.device)
        del sides  # its caches, before the memory runs
        if with_memory:
            peak = peak_memory if memory_in_process else _peak_in_subprocess
            for side in ("baseline", "rankkit"):
                row[f"{side}_peak_bytes"] = peak(
                    scenario, side, length, model_spec, device, cuda_graphs, compile_decode
                )
            if row["baseline_peak_bytes"] and row["rankkit_peak_bytes"] is not None:
                row["memory_ratio"] = row["rankkit_peak_bytes"] / row["baseline_peak_bytes"]
        rows.append(row)
    return rows


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or denominator is None else numerator / denominator
