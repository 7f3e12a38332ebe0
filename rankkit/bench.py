"""Run methods end to end over a dataset and keep every measurement: the accuracy vs TTFT grid.

For each example every (method, budget), ``full`` first, is prepared (the oracle's
offline ranking) and warmed up (untimed; on CPU that run also tracks peak memory), then
timed in ``repeats`` interleaved rounds, so machine noise hits all methods alike: times
are medians over rounds and ratios to ``full`` are medians of the ratios within a round
(see ``rankkit.methods.measure``).

One row per (example, method, budget) holds the measurements, the answer and its
score, the ratios to ``full`` on the same example, the ideal TTFT ratio from the
calibrated cost model, and example meta (task, prompt length, needle depth, the share
of evidence tokens a shared selection kept) for accuracy-vs-TTFT plots and needle
heatmaps. ``summary`` reduces it to one row per method and budget (CLAA Table 1 /
Fig. 4 analogue).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import polars as pl
import torch

from rankkit.cache import PADDING
from rankkit.data import Example
from rankkit.data import score as score_answer
from rankkit.errors import RankkitError
from rankkit.methods import Budget, Method, make
from rankkit.methods.measure import CostModel, Measured, calibrate, measure_interleaved
from rankkit.prompting import Prompt
from rankkit.runner import Runner

FULL = "full"


@dataclass
class BenchSettings:
    max_new_tokens: int = 32
    warmup_runs: int = 1
    repeats: int = 1


def evidence_token_positions(prompt: Prompt, example: Example) -> set[int]:
    positions: set[int] = set()
    for start, end in example.evidence:
        first, last = prompt.context_token_span(start, end)
        positions.update(range(first, last))
    return positions


def run_row(
    measured: Measured,
    *,
    tokenizer,
    example: Example | None,
    prompt: Prompt,
    budget: Budget,
    cost_model: CostModel,
    num_layers: int,
    reference: Measured | None,
) -> dict:
    """One tidy row: measurements, answer, score, paired ratios to ``reference`` (full) and example meta."""
    run = measured.run
    answer = tokenizer.decode(run.tokens, skip_special_tokens=True)
    evidence = evidence_token_positions(prompt, example) if example is not None else set()
    kept_evidence = None
    if evidence and run.kept_positions is not None:
        kept_evidence = len(evidence & set(run.kept_positions)) / len(evidence)
    meta = example.meta if example is not None else {}
    return {
        "example_id": example.id if example is not None else "prompt",
        "task": example.task if example is not None else "prompt",
        "length": run.prompt_length,
        "depth_percent": meta.get("depth_percent"),
        "method": run.method,
        "keep": budget.keep,
        "budget": budget.label,
        "budget_tokens": budget.resolve(run.prompt_length),
        "params": json.dumps(run.params, sort_keys=True),
        "ttft_s": run.ttft_s,
        "tpot_s": run.tpot_s,
        "e2e_s": run.e2e_s,
        "kv_bytes": run.kv_bytes,
        "peak_mem_bytes": run.peak_mem_bytes,
        "ideal_ratio": cost_model.ideal_ratio(run.passes, run.prompt_length, num_layers),
        "ttft_ratio": measured.ratio_to(reference, "ttft_s") if reference else None,
        "tpot_ratio": measured.ratio_to(reference, "tpot_s") if reference else None,
        "kv_ratio": run.kv_bytes / reference.run.kv_bytes if reference else None,
        "ttft_min_s": min(each.ttft_s for each in measured.runs),
        "repeats": len(measured.runs),
        "answer": answer,
        "score": score_answer(example, answer) if example is not None and example.answers else None,
        "new_tokens": len(run.tokens),
        "selection_layer": run.selection_layer,
        "evidence_kept": kept_evidence,
        "live_tokens": run.live_tokens,
        "kv_tokens_per_layer": run.kv_tokens_per_layer,
    }


def compare_on_prompt(
    runner: Runner,
    tokenizer,
    prompt: Prompt,
    example: Example | None,
    entries: list[tuple[Method, Budget]],
    cost_model: CostModel,
    settings: BenchSettings,
    on_run: Callable[[str], None] = lambda description: None,
) -> list[dict]:
    """Every (method, budget) of ``entries`` on one prompt, interleaved; ratios are to the first entry."""
    name = example.id if example is not None else "prompt"
    measured = measure_interleaved(
        runner,
        entries,
        prompt.input_ids,
        settings.max_new_tokens,
        tokenizer=tokenizer,
        warmup_runs=settings.warmup_runs,
        repeats=settings.repeats,
        on_run=lambda method, budget: on_run(f"{name} {method.name} {budget.label}"),
    )
    common = dict(tokenizer=tokenizer, example=example, prompt=prompt, cost_model=cost_model)
    return [
        run_row(result, budget=budget, num_layers=runner.num_layers, reference=measured[0], **common)
        for (_, budget), result in zip(entries, measured, strict=True)
    ]


def kept_positions_by_layer(
    runner: Runner, method: Method, input_ids: torch.Tensor, budget: Budget, layers: list[int]
) -> dict[int, list[list[int]]]:
    """The original positions each KV head of ``layers`` holds in its cache after the method's prefill.

    One more, untimed, prefill of a prepared method. It answers for every method alike:
    the tokens a shared selection kept, or a KV-only method's per-head choice.
    """
    for layer in layers:
        if not 0 <= layer < runner.num_layers:
            raise RankkitError(f"layer {layer} is out of range: the model has layers 0-{runner.num_layers - 1}")
    with torch.inference_mode():
        cache = method.prefill(runner, input_ids, budget).result.cache
    return {
        layer: [[position for position in head if position != PADDING] for head in cache.positions[layer].tolist()]
        for layer in layers
    }


def grid(methods: list[Method], budgets: list[Budget]) -> list[tuple[Method, Budget]]:
    """``full`` (the reference) once, then every (budget, method) but full."""
    full = [(make(FULL), Budget.from_keep(1.0))]
    return full + [(method, budget) for budget in budgets for method in methods if method.name != FULL]


def run_bench(
    runner: Runner,
    tokenizer,
    examples: list[Example],
    methods: list[Method],
    budgets: list[Budget],
    settings: BenchSettings,
    *,
    prompt_for: Callable[[Example], Prompt],
    on_run: Callable[[str], None] = lambda description: None,
) -> pl.DataFrame:
    """The grid over ``examples``; the cost model is calibrated once, on the first prompt."""
    prompts = [prompt_for(example) for example in examples]
    on_run("calibrating the cost model (full prefills of prefixes of the first prompt)")
    with torch.inference_mode():
        cost_model = calibrate(runner, prompts[0].input_ids)
    entries = grid(methods, budgets)
    rows = []
    for example, prompt in zip(examples, prompts, strict=True):
        rows += compare_on_prompt(runner, tokenizer, prompt, example, entries, cost_model, settings, on_run)
    frame = pl.DataFrame(rows, infer_schema_length=None)
    return frame.with_columns(
        pl.lit(cost_model.linear).alias("cost_linear"), pl.lit(cost_model.quadratic).alias("cost_quadratic")
    )


def summary(frame: pl.DataFrame) -> pl.DataFrame:
    """Per method and budget: mean score, TTFT/TPOT/KV ratios to full and the ideal ratio.

    Ratios are means over examples of each example's paired median ratio.
    """
    return (
        frame.group_by("method", "budget", maintain_order=True)
        .agg(
            pl.len().alias("examples"),
            pl.col("score").mean().alias("accuracy"),
            pl.col("ttft_ratio").mean(),
            pl.col("ideal_ratio").mean(),
            pl.col("tpot_ratio").mean(),
            pl.col("kv_ratio").mean(),
            pl.col("ttft_s").mean(),
            pl.col("tpot_s").mean(),
            pl.col("kv_bytes").mean(),
            pl.col("peak_mem_bytes").mean(),
        )
        .with_columns((pl.col("ttft_ratio") / pl.col("ideal_ratio")).alias("measured_over_ideal"))
    )
