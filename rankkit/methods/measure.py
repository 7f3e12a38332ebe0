"""Timing, memory and the compute model for one method run: written once, used by every method.

Times and peak memory come from ``rankkit.measure`` (its docstring says what they
mean on each device). TTFT ends when the first token is chosen; TPOT is the mean time
of the decode steps after it; end-to-end is TTFT plus all decode steps. On CUDA the
peak is measured in the timed run; on CPU ``TensorMemoryTracker`` costs a Python call
per operator, so it runs during the (untimed) warm-up, never the timed run.

Compute model (rankkit's own, docs/methods.md): a layer that runs n queries over m
keys costs a·n + b·n·m (a·n + b·n² in a prefill). ``CostModel.fit`` calibrates a and b from timed full
prefills at a few prompt lengths; a method's ideal TTFT ratio is the cost of the layers
it ran (every pass) over the cost of a full prefill. Where a layer's FFN ran on fewer tokens
than its attention, the FFN's share of a (``ffn_share``, from the FFNs' timed share of a
prefill) is charged for the tokens it ran on. A draft's lookahead steps are priced from full's
measured decode step, the LM head counted in layers' worth (``head_layers``, from its FLOPs).
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from rankkit.measure import (
    Measurement,
    PeakMemory,
    TensorMemoryTracker,
    Timeline,
    counterbalanced,
    paired_ratios,
)
from rankkit.measure import measure as timed_block
from rankkit.methods.base import LOOKAHEAD, Budget, Method, Pass, is_number
from rankkit.model_cache import DamagedCacheFile, cache_root, read_cache_json, write_atomically
from rankkit.runner import Runner, greedy_continue
from rankkit.sorting import load_compiled


@dataclass
class MethodRun:
    """One method on one prompt: its answer tokens and every measurement."""

    method: str
    params: dict
    budget: str
    prompt_length: int
    tokens: list[int]
    ttft_s: float
    tpot_s: float | None  # None when no decode step ran (a one-token answer)
    e2e_s: float
    kv_bytes: int  # live KV entries after prefill, padding excluded
    kv_tokens_per_layer: list[float]  # mean kept tokens per KV head, per layer, after prefill
    live_tokens: list[int]  # hidden-state tokens entering each layer of the pass that built the cache
    passes: list[Pass]
    selection_layer: int | None
    peak_mem_bytes: int | None = None
    kept_positions: list[int] | None = None
    # the original positions each layer's KV heads hold when decoding starts ([kv_heads, S], PADDING for none)
    cache_positions: list[torch.Tensor] = field(default_factory=list, repr=False)
    # TPOT's two parts: the first decode step, which makes the decode's buffers (the cache's room to
    # grow, a static copy), and the mean of the steps after it; None where there is no such step
    first_step_s: float | None = None
    later_steps_s: float | None = None


def run_once(
    runner: Runner, method: Method, input_ids: torch.Tensor, budget: Budget, max_new_tokens: int
) -> MethodRun:
    """One timed run: the method's prefill, then greedy decoding from its cache."""
    kept = runner.kept_static_uses()
    peak = PeakMemory(runner.device)
    timeline = Timeline(runner.device)
    timeline.mark()
    with torch.inference_mode():
        run = method.prefill_for_decoding(runner, input_ids, budget)
        kv_bytes = run.result.cache.nbytes()
        kv_tokens = [sum(heads) / len(heads) for heads in run.result.cache.kept_tokens_per_layer()]
        if runner.cuda_graphs and not runner.replays(run.decode_hooks):
            warnings.warn(
                f"method '{method.name}' acts at every decode step, which a CUDA graph cannot replay: "
                "it decodes eagerly",
                stacklevel=2,
            )
        cache_positions = list(run.result.cache.positions)  # decoding replaces the tensors, never edits them
        tokens = greedy_continue(
            runner, run.result, max_new_tokens, run.decode_hooks, on_token=lambda token: timeline.mark()
        )
    timeline.finish()
    reused_bytes = runner.reused_static_bytes(kept)  # the target's decode, and a self-draft's lookahead
    steps = len(tokens) - 1
    ttft = timeline.seconds(0, 1)
    e2e = timeline.seconds(0, len(timeline.marks) - 1)
    return MethodRun(
        method=method.name,
        params=method.resolved(runner.num_layers, runner.layer_types),
        budget=budget.label,
        prompt_length=int(input_ids.numel()),
        tokens=tokens,
        ttft_s=ttft,
        tpot_s=(e2e - ttft) / steps if steps else None,
        e2e_s=e2e,
        kv_bytes=kv_bytes,
        kv_tokens_per_layer=kv_tokens,
        live_tokens=run.live_tokens,
        passes=run.passes,
        selection_layer=run.selection_layer,
        # buffers allocated by an earlier run of this shape serve this one: they count as its own
        # (an upper bound when the run's peak came before decoding began)
        peak_mem_bytes=None if peak.bytes() is None else peak.bytes() + reused_bytes,
        kept_positions=None if run.kept_positions is None else run.kept_positions.tolist(),
        cache_positions=cache_positions,
        first_step_s=timeline.seconds(1, 2) if steps >= 1 else None,
        later_steps_s=timeline.seconds(2, steps + 1) / (steps - 1) if steps >= 2 else None,
    )


def warm_up(
    runner: Runner,
    method: Method,
    input_ids: torch.Tensor,
    budget: Budget,
    max_new_tokens: int,
    *,
    tokenizer,
    runs: int,
) -> int | None:
    """The method's untimed preparation and ``runs`` warm-up runs; on CPU the first tracks peak memory (returned)."""
    method.prepare(runner, input_ids, tokenizer=tokenizer)
    peak = None
    for index in range(runs):
        if index == 0 and runner.device.type != "cuda":
            with TensorMemoryTracker() as tracker:
                run_once(runner, method, input_ids, budget, max_new_tokens)
            peak = tracker.peak
        else:
            run_once(runner, method, input_ids, budget, max_new_tokens)
    return peak


@dataclass
class Measured:
    """Repeated timed runs of one method on one prompt, reduced to medians."""

    runs: list[MethodRun]
    warmup_peak_bytes: int | None = None
    warmup_runs: int = 0  # untimed runs before the first timed one: with none, it carries one-time costs

    @property
    def run(self) -> MethodRun:
        """The last run, with median times and the warm-up's peak memory on CPU."""
        run = dataclasses.replace(self.runs[-1])
        for quantity in ("ttft_s", "e2e_s", "tpot_s", "first_step_s", "later_steps_s"):
            if getattr(run, quantity) is not None:  # over the runs that decoded as far as the last one
                times = [getattr(each, quantity) for each in self.runs if getattr(each, quantity) is not None]
                setattr(run, quantity, float(np.median(times)))
        if self.warmup_peak_bytes is not None:
            run.peak_mem_bytes = self.warmup_peak_bytes
        return run

    def ratio_to(self, reference: Measured, quantity: str) -> float | None:
        """Median over rounds of this run's ``quantity`` over the reference's in the same round (paired, so noise cancels)."""
        ratios = paired_ratios(
            [getattr(run, quantity) for run in self.runs], [getattr(run, quantity) for run in reference.runs]
        )
        return float(np.median(ratios)) if ratios else None


def measure_interleaved(
    runner: Runner,
    entries: list[tuple[Method, Budget]],
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    tokenizer,
    warmup_runs: int,
    repeats: int,
    on_run=lambda method, budget: None,
) -> list[Measured]:
    """Warm every (method, budget) up, then ``repeats`` rounds that time each once, in turn.

    Interleaving the rounds means a burst of load from elsewhere hits every method alike,
    and ``Measured.ratio_to`` compares runs of the same round. Every other round runs the
    entries in reverse (``counterbalanced``), so what running first, or right after a given
    method, does to a run (the allocator's state, the caches) falls on each method alike.
    On a CPU the methods' compiled sort is made ready first: a cost of the process, not of a method.
    """
    if runner.device.type == "cpu":
        load_compiled()
    measured = []
    for method, budget in entries:
        on_run(method, budget)
        peak = warm_up(
            runner, method, input_ids, budget, max_new_tokens, tokenizer=tokenizer, runs=warmup_runs
        )
        measured.append(Measured([], peak, warmup_runs))
    for round_index in range(repeats):
        for (method, budget), result in counterbalanced(list(zip(entries, measured, strict=True)), round_index):
            on_run(method, budget)
            result.runs.append(run_once(runner, method, input_ids, budget, max_new_tokens))
    return measured


def measure(
    runner: Runner,
    method: Method,
    input_ids: torch.Tensor,
    budget: Budget,
    max_new_tokens: int,
    *,
    tokenizer,
    warmup_runs: int = 1,
    repeats: int = 1,
) -> MethodRun:
    """One method on one prompt: preparation, warm-up, ``repeats`` timed runs, median times."""
    (result,) = measure_interleaved(
        runner,
        [(method, budget)],
        input_ids,
        max_new_tokens,
        tokenizer=tokenizer,
        warmup_runs=warmup_runs,
        repeats=repeats,
    )
    return result.run


@dataclass
class CostModel:
    """Per-layer cost a·n + b·n·m (n queries, m keys), in seconds (see module docstring)."""

    linear: float  # a: seconds per token per layer
    quadratic: float  # b: seconds per query-key pair per layer
    ffn_share: float  # the share of a the FFN spends (``ffns_timed``); the rest is attention's side
    head_layers: float  # the LM head's cost for one token, in decoder layers (``head_layers``)
    samples: list[tuple[int, float]] = field(default_factory=list)  # (tokens, full prefill seconds)

    @classmethod
    def from_record(cls, recorded: dict | None) -> CostModel | None:
        """The model a record holds (``dataclasses.asdict`` of one, as a cache file or a resumed run's
        journal keeps it); None for no record, or an older rankkit's without the FFN and LM-head shares.
        ``DamagedCacheFile`` names a value no fit gives: every ideal ratio is priced from them."""
        names = [each.name for each in dataclasses.fields(cls)]
        if recorded is None or (isinstance(recorded, dict) and not set(names) <= recorded.keys()):
            return None
        problem = _cost_record_problem(recorded)
        if problem is not None:
            raise DamagedCacheFile(problem)
        return cls(**{name: recorded[name] for name in names} | {"samples": [tuple(pair) for pair in recorded["samples"]]})

    def covers(self, tokens: int) -> bool:
        """Whether the fit was timed on prompts long enough to price one of ``tokens``: a fit on short
        prompts cannot see attention's n² grow (it may even find b = 0). Its longest sample within
        10% of ``tokens`` is enough (a synthetic prompt fitted to a length comes out a little short)."""
        return max(length for length, _ in self.samples) >= 0.9 * tokens

    def layer_cost(self, queries: int, keys: int, ffn_queries: int | None = None) -> float:
        """a·n + b·n·m, the FFN's share of a·n charged for ``ffn_queries`` tokens instead (None: n)."""
        ffn_queries = queries if ffn_queries is None else ffn_queries
        per_token = self.linear * ((1 - self.ffn_share) * queries + self.ffn_share * ffn_queries)
        return per_token + self.quadratic * queries * keys

    def cost(self, passes: list[Pass]) -> float:
        return sum(self.layer_cost(*layer) for run in passes for layer in run.layers())

    def prefills_seconds(self, num_layers: int, tokens: int, squared_tokens: int) -> float:
        """Full prefills whose lengths n sum to ``tokens`` and their squares to ``squared_tokens``:
        L·(a·Σn + b·Σn²)."""
        return num_layers * (self.linear * tokens + self.quadratic * squared_tokens)

    def ideal_ratio(
        self, passes: list[Pass], prompt_length: int, num_layers: int, decode_step_s: float | None = None
    ) -> float:
        """The passes' cost over a full prefill's.

        ``decode_step_s``: one of full's decode steps (its TPOT, measured beside it), which runs
        the L layers and the LM head (``head_layers`` layers' worth) for one token. A ``LOOKAHEAD``
        pass (a draft's decode steps) is charged a share of it for each layer it ran and each LM
        head (``Pass.heads``): a step reads every weight to compute one token, which a prefill's
        per-token cost a·1 leaves out. None: those layers cost a·1 + b·1·m, each head a·head_layers.
        """
        lookahead = [run for run in passes if run.label == LOOKAHEAD]
        heads_in_layers = self.head_layers * sum(run.heads for run in lookahead)
        if decode_step_s is None:
            spent = self.cost(passes) + self.linear * heads_in_layers
        else:
            layers = sum(len(run.queries) for run in lookahead) + heads_in_layers
            others = [run for run in passes if run.label != LOOKAHEAD]
            spent = self.cost(others) + layers * decode_step_s / (num_layers + self.head_layers)
        return spent / (num_layers * self.layer_cost(prompt_length, prompt_length))

    @classmethod
    def fit(
        cls, samples: list[tuple[int, float]], num_layers: int, ffn_seconds: float, head_layers: float
    ) -> CostModel:
        """Least squares of t/L = a·n + b·n² over (n, t) samples, with a, b >= 0; the FFN's share of a
        is ``ffn_seconds`` (an FFN's time per token) over a, capped at 1 (1 where a is 0)."""
        n = np.array([tokens for tokens, _ in samples], dtype=np.float64)
        per_layer = np.array([seconds for _, seconds in samples], dtype=np.float64) / num_layers
        design = np.stack([n, n**2], axis=1)
        (linear, quadratic), *_ = np.linalg.lstsq(design, per_layer, rcond=None)
        if quadratic < 0:  # noise on short prompts: attention too cheap to see, all cost is linear
            linear, quadratic = float(per_layer.sum() / n.sum()), 0.0
        elif linear < 0:
            linear, quadratic = 0.0, float((per_layer * n**2).sum() / (n**4).sum())
        linear, quadratic = float(linear), float(quadratic)
        ffn_share = min(1.0, ffn_seconds / linear) if linear > 0 else 1.0
        return cls(linear, quadratic, ffn_share, head_layers, list(samples))


def calibrate(
    runner: Runner, input_ids: torch.Tensor, fractions=(1.0, 0.5, 0.25), repeats: int = 3
) -> CostModel:
    """Fit the cost model from full prefills of prefixes of ``input_ids``, and the FFN's share of a
    from the FFNs' own time in the longest of them (``ffns_timed``).

    The lengths, and the FFNs, are timed in interleaved rounds and each keeps its fastest time: on a
    shared machine the fastest run is the one least disturbed by other work.
    """
    ids = input_ids.reshape(-1)
    prefixes = [ids[: max(1, int(ids.numel() * fraction))] for fraction in fractions]
    longest = max(int(prefix.numel()) for prefix in prefixes)
    runner.prefill(ids)  # warm-up
    timed: list[tuple[torch.Tensor, list[float]]] = [(prefix, []) for prefix in prefixes]
    in_ffns = []
    for _ in range(repeats):
        for prefix, seconds in timed:
            # every prefix with the FFNs' marks, so the samples are alike; they cost no more than noise
            with ffns_timed(runner) as ffns, timed_block(runner.device) as block:
                runner.prefill(prefix)
            seconds.append(block.seconds)
            if prefix.numel() == longest:
                in_ffns.append(ffns.seconds)
    samples = [(int(prefix.numel()), min(seconds)) for prefix, seconds in timed]
    ffn_seconds = min(in_ffns) / (runner.num_layers * longest)
    return CostModel.fit(samples, runner.num_layers, ffn_seconds=ffn_seconds, head_layers=head_layers(runner))


@contextmanager
def ffns_timed(runner: Runner) -> Iterator[Measurement]:
    """While the block runs, marks around every layer's FFN call on the FFN's own device (on CUDA,
    events read once at the end); after it, the yielded ``seconds`` are all the FFNs' time. The FFN's
    share of a is its time, not its FLOPs: on the default model on a CPU the FFNs are 0.75 of a
    layer's per-token FLOPs but about 0.6 of a. The marks cost nothing measurable: a 2k-token
    prefill with them read 0.990 of one without (8 alternated rounds)."""
    timelines, handles = [], []
    for layer in runner.body.layers:
        timeline = Timeline(next(layer.mlp.parameters()).device)
        timelines.append(timeline)
        handles += [
            layer.mlp.register_forward_pre_hook(lambda module, args, timeline=timeline: timeline.mark()),
            layer.mlp.register_forward_hook(lambda module, args, output, timeline=timeline: timeline.mark()),
        ]
    spent = Measurement()
    try:
        yield spent
    finally:
        for handle in handles:
            handle.remove()
    for timeline in timelines:
        timeline.finish()
    spent.seconds = sum(timeline.seconds(0, 1) for timeline in timelines)


def _cost_record_problem(recorded) -> str | None:
    """What makes a recorded cost model one no ``calibrate`` gives, or None."""
    if not isinstance(recorded, dict):
        return "not a JSON object"
    for name in ("linear", "quadratic", "ffn_share", "head_layers"):
        value = recorded[name]
        if not (is_number(value, int | float) and math.isfinite(value) and value >= 0):
            return f"its {name} is {json.dumps(value)}, not a number >= 0"
    if recorded["ffn_share"] > 1:
        return f"its ffn_share is {recorded['ffn_share']}, above 1"
    if recorded["linear"] == recorded["quadratic"] == 0:
        return "it prices a prefill at 0 s"
    samples = recorded["samples"]
    if not isinstance(samples, list) or not samples or not all(_is_sample(pair) for pair in samples):
        return "its samples are not [tokens, seconds] pairs of positive numbers"
    return None


def _is_sample(pair) -> bool:
    """A calibration sample: a prompt's length and its full prefill's seconds."""
    if not isinstance(pair, list) or len(pair) != 2:
        return False
    tokens, seconds = pair
    return is_number(tokens, int) and tokens > 0 and is_number(seconds, int | float) and math.isfinite(seconds) and seconds > 0


def head_layers(runner: Runner) -> float:
    """The LM head's FLOPs for one token, in decoder layers' worth (``CostModel.head_layers``). Counted
    on a one-token prefill, whose attention over one key adds next to nothing; an MoE block counts
    the experts the token runs, not all of them."""
    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten._grouped_mm: _grouped_mm_flops})
    spent = {"layers": 0, "head": 0}
    handles = _count_flops_inside(runner.model.lm_head, counter, spent, "head")
    for layer in runner.body.layers:
        handles += _count_flops_inside(layer, counter, spent, "layers")
    try:
        with counter:
            runner.prefill(torch.zeros(1, dtype=torch.long))
    finally:
        for handle in handles:
            handle.remove()
    return spent["head"] * runner.num_layers / spent["layers"]


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape, **kwargs) -> int:
    """FLOPs of ``aten._grouped_mm`` (MoE blocks' expert products), which FlopCounterMode does not
    count by itself: two per multiply-add, each output entry summing over the shared dimension."""
    if len(a_shape) == len(b_shape) == 2:  # the groups split the shared dimension between them
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * math.prod(out_shape) * a_shape[-1]


def _count_flops_inside(module: torch.nn.Module, counter: FlopCounterMode, spent: dict, part: str) -> list:
    """Hooks adding the FLOPs ``counter`` counts during each call of ``module`` to ``spent[part]``."""
    started = []

    def before(module, args):
        started.append(counter.get_total_flops())

    def after(module, args, output):
        spent[part] += counter.get_total_flops() - started.pop()

    return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]


def cached_calibration(runner: Runner, input_ids: torch.Tensor, weights_hash: str) -> CostModel:
    """``calibrate`` (two lengths, one round) once per model weights, device and torch thread count.

    The fit is remembered in ``$RANKKIT_CACHE/calibration`` and reused for every later prompt
    it covers (``CostModel.covers``): a and b describe the model on the machine, not the prompt,
    but a longer prompt is timed anew and its fit replaces the cached one.
    """
    cost_model = cached_cost_model(weights_hash, runner.device)
    if cost_model is None or not cost_model.covers(input_ids.numel()):
        cost_model = calibrate(runner, input_ids, fractions=(1.0, 0.25), repeats=1)
        write_atomically(
            calibration_path(weights_hash, runner.device), json.dumps(dataclasses.asdict(cost_model))
        )
    return cost_model


def cached_cost_model(weights_hash: str, device: torch.device) -> CostModel | None:
    """The fit ``cached_calibration`` remembered for these weights, this device and the current torch
    thread count, or None where none was made (or an older rankkit made one without the FFN and LM-head shares);
    nothing loads or runs. A damaged one is None too, with a warning: the next calibration replaces it."""
    path = calibration_path(weights_hash, device)
    try:
        return CostModel.from_record(read_cache_json(path))
    except DamagedCacheFile as damage:
        warnings.warn(f"{path} is damaged ({damage}): not used; the next calibration replaces it", stacklevel=2)
        return None


def calibration_path(weights_hash: str, device: torch.device) -> Path:
    """Where the fit for these weights, this device and the current torch thread count is remembered."""
    key = f"{weights_hash[:16]}-{device.type}{device.index if device.index is not None else ''}"
    # "-timed-ffn": the FFN's share is timed since 2026-11-30; a fit cached with its FLOP share is not reused
    return cache_root() / "calibration" / f"{key}-{torch.get_num_threads()}threads-timed-ffn.json"
