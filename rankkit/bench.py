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

import dataclasses
import itertools
import json
import math
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace

import polars as pl
import torch

from rankkit import defaults, models, outputs
from rankkit.cache import PADDING
from rankkit.checks import (
    TIMING_ONLY,
    check_layer,
    check_length,
    check_prompt_lengths,
    check_spec_length,
    check_unique_rows,
    check_value_ranges,
    first_repeated,
    warn_budgets,
)
from rankkit.data import Example, context_text, data_fingerprint, load_examples, read_spec, spec_text
from rankkit.data import score as score_answer
from rankkit.errors import RankkitError
from rankkit.eval.offline import method_from_spec, parse_method_spec, split_names
from rankkit.interrupts import keep_on_interrupt, stop_if_interrupted
from rankkit.measure import Bandwidth, decode_step_bytes, memory_bandwidth
from rankkit.methods import Budget, Method, check_parameters, given_budgets, make
from rankkit.methods.base import ONE_BUDGET, distinct_labels
from rankkit.methods.measure import (
    CostModel,
    Measured,
    MethodRun,
    cached_calibration,
    calibrate,
    measure_interleaved,
)
from rankkit.methods.specprefill import check_drafts
from rankkit.progress import SKIPPED, Progress, ProgressCallback, ignore
from rankkit.prompting import Prompt, build_prompt
from rankkit.runner import Runner, check_decode_options
from rankkit.shards import share
from rankkit.values import as_list, check_count, check_number

FULL = "full"
COST_MODEL = "cost_model"  # the journal notes a resumed bench reuses
BANDWIDTH = "bandwidth"


FIRST_RUNS_TIMED = "These times are of first runs (--warmup 0), one-time costs included: add --warmup 1 to compare them."


def first_runs_timed(warmups: Iterable[int | None]) -> bool:
    """Whether any of these runs' times (their ``warmup`` counts) is of a first run, with no warm-up
    before it, and so carries one-time costs (the allocator, kernels made for new shapes)."""
    return any(count == 0 for count in warmups)


@dataclass(frozen=True)
class BenchSettings:
    max_new_tokens: int = defaults.MAX_NEW_TOKENS
    warmup: int = defaults.WARMUP  # on CPU the first warm-up measures peak memory; with none it stays empty
    repeats: int = defaults.REPEATS

    def __post_init__(self):
        check_count(self.max_new_tokens, "--max-new-tokens")
        check_count(self.warmup, "--warmup", minimum=0)
        check_count(self.repeats, "--repeats")


def evidence_token_positions(prompt: Prompt, example: Example) -> set[int]:
    positions: set[int] = set()
    for start, end in example.evidence:
        first, last = prompt.context_token_span(start, end)
        positions.update(range(first, last))
    return positions


def evidence_kept(run: MethodRun, evidence: set[int]) -> float:
    """The share of the ``evidence`` token positions a run kept: of its shared selection (prompt
    pruning), else of each KV head's cache when decoding starts, averaged over heads and layers
    (KV-only methods; full keeps all of it)."""
    if run.kept_positions is not None:
        return len(evidence & set(run.kept_positions)) / len(evidence)
    wanted = torch.tensor(sorted(evidence))
    shares = [
        torch.isin(positions, wanted.to(positions.device)).sum(dim=1).double().mean() / len(evidence)
        for positions in run.cache_positions
    ]
    return float(torch.stack(shares).mean())


def run_row(
    measured: Measured,
    *,
    method: Method,
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
    kept_evidence = evidence_kept(run, evidence) if evidence else None
    meta = example.meta if example is not None else {}
    return {
        "example_id": example.id if example is not None else "prompt",
        "task": example.task if example is not None else "prompt",
        "length": run.prompt_length,
        "depth_percent": meta.get("depth_percent"),
        "cluster": meta.get("cluster"),  # examples sharing a haystack or a needle (niah, ruler, jsonl)
        "method": run.method,
        "keep": budget.keep,
        "budget": budget.label,
        "budget_tokens": method.kept_tokens(budget, run.prompt_length),  # raised to what it always keeps
        "params": json.dumps(run.params, sort_keys=True),
        "ttft_s": run.ttft_s,
        "tpot_s": run.tpot_s,
        "first_step_s": run.first_step_s,
        "later_steps_s": run.later_steps_s,
        "e2e_s": run.e2e_s,
        "kv_bytes": run.kv_bytes,
        "peak_mem_bytes": run.peak_mem_bytes,
        "ideal_ratio": cost_model.ideal_ratio(
            run.passes,
            run.prompt_length,
            num_layers,
            decode_step_s=reference.run.tpot_s if reference else None,  # prices a draft's lookahead
        ),
        "ttft_ratio": measured.ratio_to(reference, "ttft_s") if reference else None,
        "tpot_ratio": measured.ratio_to(reference, "tpot_s") if reference else None,
        "kv_ratio": run.kv_bytes / reference.run.kv_bytes if reference else None,
        "ttft_min_s": min(each.ttft_s for each in measured.runs),
        "warmup": measured.warmup_runs,
        "repeats": len(measured.runs),
        "answer": answer,
        "score": score_answer(example, answer) if example is not None and example.answers else None,
        "new_tokens": len(run.tokens),
        "selection_layer": run.selection_layer,
        "selected_positions": run.kept_positions,  # as `rankkit select` reports them
        "evidence_kept": kept_evidence,
        "live_tokens": run.live_tokens,
        "kv_tokens_per_layer": run.kv_tokens_per_layer,
    }


def steps_per_prompt(entries: list[tuple[Method, Budget]], settings: BenchSettings) -> int:
    """Progress steps ``compare_on_prompt`` reports: per entry one preparation (with ``warmup``
    untimed runs, as ``measure_interleaved`` does them) and ``repeats`` timed runs."""
    return len(entries) * (1 + settings.repeats)


def compare_on_prompt(
    runner: Runner,
    tokenizer,
    prompt: Prompt,
    example: Example | None,
    entries: list[tuple[Method, Budget]],
    cost_model: CostModel,
    settings: BenchSettings,
    on_step: Callable[[str, str], None] = lambda stage, detail: None,
) -> list[dict]:
    """Every (method, budget) of ``entries`` on one prompt, interleaved; ratios are to the first entry.

    ``on_step(stage, detail)`` is called as each of the ``steps_per_prompt`` steps starts:
    stage "warm-up" (or "preparing" without warm-up runs) for the first one of each entry, then "timed".
    """
    name = example.id if example is not None else "prompt"
    started = itertools.count()
    first_stage = "warm-up" if settings.warmup else "preparing"

    def on_run(method: Method, budget: Budget) -> None:
        stage = first_stage if next(started) < len(entries) else "timed"
        on_step(stage, f"{name} {method.name} {budget.label}")

    measured = measure_interleaved(
        runner,
        entries,
        prompt.input_ids,
        settings.max_new_tokens,
        tokenizer=tokenizer,
        warmup_runs=settings.warmup,
        repeats=settings.repeats,
        on_run=on_run,
    )
    common = dict(tokenizer=tokenizer, example=example, prompt=prompt, cost_model=cost_model)
    return [
        run_row(result, method=method, budget=budget, num_layers=runner.num_layers, reference=measured[0], **common)
        for (method, budget), result in zip(entries, measured, strict=True)
    ]


MODEL_COLUMNS = ("model", "weights_hash")  # which model measured a bench's rows


SCORES = ("score", "evidence_kept")  # what a timing-only run leaves missing: they need real weights


def with_model(frame: pl.DataFrame, loaded: models.LoadedModel) -> pl.DataFrame:
    """``frame``'s rows with the model that measured them, so no reader can take them for another's,
    and whether it was timing only (``random:<shape>``: its scores are then missing, not wrong)."""
    frame = frame.with_columns(
        model=pl.lit(loaded.model_id),
        weights_hash=pl.lit(loaded.weights_hash),
        timing_only=pl.lit(loaded.timing_only),
    )
    if loaded.timing_only:
        frame = frame.with_columns(pl.lit(None, dtype=pl.Float64).alias(column) for column in SCORES)
    return frame


def is_timing_only(frame: pl.DataFrame) -> bool:
    """Whether a bench's rows (or their ``summary``) were measured with random weights (a bench
    written before the column was kept is not)."""
    return "timing_only" in frame.columns and bool(frame["timing_only"].any())


def refuse_timing_only_bench(frame: pl.DataFrame, what: str) -> None:
    """Refuse to show a timing-only bench's accuracy or evidence as if they meant something."""
    if is_timing_only(frame):
        raise RankkitError(
            f"{what} was measured with {frame['model'][0]}, {TIMING_ONLY}: bench a real model to report them"
        )


# What a bench writes in each column it is read back by: (column, lowest, highest, whether the lowest
# itself is out). A value outside was edited or damaged since, and is refused before it makes a figure.
BENCH_VALUE_RANGES = (
    ("keep", 0.0, 1.0, True),
    ("score", 0.0, 1.0, False),
    ("evidence_kept", 0.0, 1.0, False),
    ("ttft_s", 0.0, math.inf, True),
    ("tpot_s", 0.0, math.inf, True),
    ("ttft_ratio", 0.0, math.inf, True),
    ("tpot_ratio", 0.0, math.inf, True),
    ("ideal_ratio", 0.0, math.inf, True),
    ("kv_ratio", 0.0, math.inf, False),
    ("kv_bytes", 0.0, math.inf, False),
    ("peak_mem_bytes", 0.0, math.inf, False),
)


def check_bench_values(frame: pl.DataFrame, what: str) -> None:
    """Refuse a bench holding a value no bench writes (``BENCH_VALUE_RANGES``; missing values pass), or
    rows of several models, or two rows of one example, method and budget, or a row whose budget
    columns are not one budget's."""
    check_value_ranges(frame, BENCH_VALUE_RANGES, what, "rankkit bench")
    measured_by(frame, what)
    check_unique_rows(frame, ("example_id", "method", "budget"), what, "rankkit bench")
    _check_budget_columns(frame, what)


def _check_budget_columns(frame: pl.DataFrame, what: str) -> None:
    """A row's ``budget`` label, ``keep`` and ``budget_tokens`` say one budget: the label's keep rate, and
    between what it resolves to and the prompt (a method raises it to what it always keeps). A keep
    edited from 0.1 to 0.3 would be joined to the store's selection at 0.3 beside what ran at 0.1."""
    columns = ("budget", "keep", "budget_tokens", "length", "example_id", "method")
    if not set(columns) <= set(frame.columns):
        return
    for label, keep, tokens, length, example_id, method in frame.select(columns).unique().iter_rows():
        kind, _, value = (label or "").partition("=")
        try:
            budget = Budget.parse(float(value) if kind == "keep" else int(value))
            labelled = budget.label == label and (keep is None) == (budget.keep is None)
            fits = labelled and (keep is None or Budget.from_keep(keep).label == label)
            fits = fits and (tokens is None or length is None or budget.resolve(length) <= tokens <= length)
        except (RankkitError, ValueError):
            fits = False
        if not fits:
            raise RankkitError(
                f"{what} holds budget {label}, keep {keep} and {tokens} of {length} tokens (example {example_id}, "
                f"method {method}): not one budget, as rankkit bench writes them; run it again, or pass the file it wrote"
            )


def short_hash(weights_hash: str) -> str:
    """A weights hash as messages and labels show it."""
    return weights_hash[:12]


def measured_by(frame: pl.DataFrame, what: str) -> tuple[str | None, str | None]:
    """The (model, weights hash) that measured a bench ``frame``; (None, None) for a bench written
    before benches recorded their model. A bench holding rows of several weights is refused."""
    if "weights_hash" not in frame.columns:
        return None, None
    hashes = frame["weights_hash"].drop_nulls().unique(maintain_order=True).to_list()
    if len(hashes) > 1:
        raise RankkitError(
            f"{what} holds rows of {len(hashes)} models (weights {', '.join(map(short_hash, hashes))}); "
            "pass one file per model"
        )
    if not hashes:
        return None, None
    names = frame["model"].unique(maintain_order=True).to_list() if "model" in frame.columns else []
    if len(names) > 1 or frame["weights_hash"].null_count():  # every row is written with both
        shown = ", ".join(map(str, names))
        raise RankkitError(
            f"{what} names the model of its rows in {len(names)} ways ({shown}) for weights "
            f"{short_hash(hashes[0])}: its rows were edited; run the bench again"
        )
    return (str(names[0]) if names else None), hashes[0]


def is_model_of(frame: pl.DataFrame, model: dict, what: str, against: str) -> bool:
    """Whether a bench ``frame`` was measured with ``model``'s weights (a store's ``meta["model"]``).

    A bench written before it recorded its model cannot be checked and counts as ``model``'s,
    with a warning; so does any bench beside a store without a hash (one not written by capture).
    """
    expected = model.get("weights_hash")
    if not expected:
        warnings.warn(
            f"{against} records no model weights hash (not written by rankkit capture), so {what} "
            "is shown as its own unchecked",
            stacklevel=2,
        )
        return True
    _, weights_hash = measured_by(frame, what)
    if weights_hash is None:
        warnings.warn(
            f"{what} does not say which model measured it (written before rankkit recorded it); "
            f"it is shown as {against}'s",
            stacklevel=2,
        )
        return True
    return weights_hash == expected


def check_same_model(frame: pl.DataFrame, model: dict, what: str, against: str) -> None:
    """Refuse a bench ``frame`` measured with other weights than ``model`` (``is_model_of``)."""
    if not is_model_of(frame, model, what, against):
        name, weights_hash = measured_by(frame, what)
        raise RankkitError(
            f"{what} was measured with model {name} (weights {short_hash(weights_hash)}), {against} with "
            f"{model.get('id')} (weights {short_hash(model['weights_hash'])}); pass one of {against}'s model"
        )


def kept_positions_by_layer(
    runner: Runner, method: Method, input_ids: torch.Tensor, budget: Budget, layers: list[int]
) -> dict[int, list[list[int]]]:
    """The original positions each KV head of ``layers`` holds in the cache decoding starts from
    (``Method.prefill_for_decoding``).

    One more, untimed, prefill of a prepared method. It answers for every method alike:
    the tokens a shared selection kept, or a KV-only method's per-head choice.
    """
    for layer in layers:
        if not 0 <= layer < runner.num_layers:
            raise RankkitError(
                f"layer {layer} is out of range: the model has layers 0-{runner.num_layers - 1}"
            )
    with torch.inference_mode():
        cache = method.prefill_for_decoding(runner, input_ids, budget).result.cache
    return {
        layer: [
            [position for position in head if position != PADDING] for head in cache.positions[layer].tolist()
        ]
        for layer in layers
    }


def grid(methods: list[Method], budgets: list[Budget]) -> list[tuple[Method, Budget]]:
    """``full`` (the reference) once, then every (budget, method) but full."""
    full = [(make(FULL), Budget.from_keep(1.0))]
    return full + [(method, budget) for budget in budgets for method in methods if method.name != FULL]


@dataclass(frozen=True)
class MethodOptions:
    """The options that shape every method of a run: ``--layer``, SpecPrefill's draft, the oracle's mirror."""

    layer: int | None = None
    draft: str | None = None  # SpecPrefill's own default: layers:⌈L/4⌉
    mirror: str | None = None  # the oracle's own default: fastkv

    def __post_init__(self):
        if self.layer is not None:
            check_number(self.layer, "--layer", whole=True)

    def build(self, names: list[str], num_layers: int, *, strict: bool) -> list[Method]:
        """The methods ``names`` (``NAME`` or ``NAME:PARAM=VALUE,...``) with these options, ``layer``
        checked against the model's depth.

        ``strict`` (prefill) refuses ``layer`` when the method it studies, named last (after its
        ``--compare`` reference), has no selection layer; otherwise, as in a grid (bench), the
        layer is set on the methods that have one and the rest are warned of. ``full`` selects
        nothing, so the layer never concerns it. Two settings of one method are refused either way.
        """
        if not names:
            raise RankkitError("no method given; name them comma-separated, e.g. --methods full,claa,fastkv")
        options = {"specprefill": {"--draft": ("draft_model", self.draft)}, "oracle": {"--mirror": ("mirror", self.mirror)}}
        named = {parse_method_spec(spec)[0] for spec in names}
        for method_name, method_options in options.items():
            ((option, (_, value)),) = method_options.items()
            if value is not None and method_name not in named:
                raise RankkitError(
                    f"{option} sets {method_name}'s {option[2:]}, and no {method_name} is among the methods: "
                    f"drop {option}, or add {method_name}"
                )
        methods = [method_from_spec(spec, options=options.get(parse_method_spec(spec)[0])) for spec in names]
        for method in methods:
            check_parameters(method, num_layers)
        # bench writes rows, prefill prints them: each command's own way to run the settings apart
        fix = "run prefill once for each setting" if strict else "run each setting with its own --out"
        distinct_labels([method.name for method in methods], names, fix)
        if self.layer is None:
            return methods
        layered = [method for method in methods if method.selection_parameter is not None]
        others = [method.name for method in methods if method not in layered and method.name != FULL]
        studied = methods[-1].name
        refused = [studied] if strict and studied in others else [] if layered else others
        if refused:
            raise RankkitError(
                f"method {', '.join(refused)} has no selection layer; leave --layer out "
                "(it sets claa, fastkv, gemfilter and oracle)"
            )
        if others:
            warnings.warn(
                f"--layer {self.layer} sets {', '.join(m.name for m in layered)}; "
                f"{', '.join(others)} take{'s' if len(others) == 1 else ''} no layer",
                stacklevel=2,
            )
        for method in layered:
            check_layer(self.layer, num_layers, method.name)
        return [
            method_from_spec(spec, self.layer, options.get(method.name)) if method in layered else method
            for spec, method in zip(names, methods, strict=True)
        ]


@dataclass(frozen=True)
class Setup:
    """Where and on what a run executes; ``allow_overlength`` runs prompts past the model's positions,
    ``device_map`` spreads the model over devices (``models.parse_device_map``), ``cuda_graphs``
    decodes over a static cache and ``compile_decode`` compiles its step (``Runner``)."""

    model: str = defaults.MODEL
    device: str = defaults.DEVICE
    threads: int | None = None
    allow_overlength: bool = False
    device_map: str | None = None
    cuda_graphs: bool = False  # decode over a static cache, as CUDA graphs on CUDA (``Runner``)
    compile_decode: bool = False

    def __post_init__(self):
        models.parse_device_map(self.device_map)  # a bad map fails before anything loads
        if self.cuda_graphs and self.device_map is not None:
            raise RankkitError("--cuda-graphs decodes on one device; drop --device-map or --cuda-graphs")
        check_decode_options(self.cuda_graphs, self.compile_decode)

    @property
    def warmups_needed(self) -> int:
        """Untimed runs a timed one needs before it: with ``cuda_graphs`` the first run of each cache shape
        builds the static buffers and captures the step as a graph (on an H100 that added a quarter to
        an 8B model's TPOT) and with ``compile_decode`` compiles it first (minutes)."""
        return int(self.cuda_graphs)

    def check_timing(self, settings: BenchSettings) -> None:
        """Refuse timed runs that would time the decode's making (``warmups_needed``)."""
        if settings.warmup < self.warmups_needed:
            made = "compiles and captures" if self.compile_decode else "captures"
            raise RankkitError(
                f"--cuda-graphs {made} the decode step in the first run, which would then be timed: add --warmup 1"
            )

    def config(self):
        """The model's config, read without its weights."""
        return models.load_config(self.model)

    def load(self) -> tuple[models.LoadedModel, Runner]:
        models.use_threads(self.threads)
        loaded = models.load(self.model, device=self.device, device_map=self.device_map)
        return loaded, Runner(loaded.model, cuda_graphs=self.cuda_graphs, compile_decode=self.compile_decode)


def _scored_examples(data: str, loaded: models.LoadedModel) -> list[Example]:
    """The examples of ``data``; a timing-only model's without their answers, so its meaningless
    answers get no score (missing, not wrong)."""
    examples = load_examples(data, loaded.tokenizer)
    return [replace(example, answers=()) for example in examples] if loaded.timing_only else examples


def _checked_prompts(
    tokenizer, examples: list[Example], config, setup: Setup, budgets, methods: Sequence[Method]
) -> list[Prompt]:
    prompts = check_prompt_lengths(tokenizer, examples, config, allow_overlength=setup.allow_overlength)
    warn_budgets(budgets, _pruning(methods), [prompt.num_tokens for prompt in prompts])
    return prompts


def _pruning(methods: Sequence[Method]) -> list[Method]:
    """``methods`` but full, which keeps everything whatever the budget."""
    return [method for method in methods if method.name != FULL]


def prefill(
    method: str,
    *,
    keep: float | None = None,
    budget: int | None = None,
    data: str | os.PathLike | None = None,
    example: int = 0,
    context: str | None = None,
    context_file: str | os.PathLike | None = None,
    question: str | None = None,
    compare: str | None = None,
    kept_layers: Sequence[int] | str = (),
    options: MethodOptions = MethodOptions(),
    settings: BenchSettings = BenchSettings(),
    setup: Setup = Setup(),
) -> list[dict]:
    """One method end to end on one prompt (``data``'s example, or ``question`` after the context:
    the text ``context`` or the file ``context_file``, as ``--context-file`` reads it), keeping the
    share ``keep`` of the prompt or ``budget`` tokens (``full`` takes neither).

    Returns one ``run_row`` per method: ``method`` first, then ``compare`` with the ratios
    of ``method`` to it. With ``kept_layers`` the method's row also holds
    ``kept_positions_by_layer``; they are a list or the ``--kept-layers`` text ("0,15"). ``example``
    counts from 0. Every option is checked before the model loads.
    """
    check_count(example, "--example", minimum=0)
    context = context_text(context, context_file)
    data = None if data is None else spec_text(data)
    kept_layers = as_list(kept_layers, "--kept-layers", int)
    for layer in kept_layers:
        check_number(layer, "--kept-layers", whole=True)
    budgets = given_budgets(keep, budget, required=False)
    if len(budgets) > 1:
        raise RankkitError("prefill runs one budget: give one --keep or --budget (bench runs several)")
    runs_full = method.partition(":")[0] == FULL
    missing = []  # said together, so a bare `rankkit prefill --method claa` is one try, not two
    if (data is None) == (context is None):
        missing.append("either --data SPEC or --context-file FILE with --question")
    if not budgets and not runs_full:
        missing.append(ONE_BUDGET)
    if missing:
        raise RankkitError("give " + ", and ".join(missing))
    if context is not None and not question:
        raise RankkitError("--context-file needs --question")
    if data is not None and question is not None:
        raise RankkitError("--question goes with --context-file; an example of --data brings its own: drop --question")
    if context is not None and example != 0:
        raise RankkitError("--example picks an example of --data; with --context-file drop it")
    if budgets and runs_full:
        raise RankkitError(
            "full keeps every token: drop --keep/--budget (or name the method they are for, "
            "with --compare full)"
        )
    (budget,) = budgets or [Budget.from_keep(1.0)]
    setup.check_timing(settings)
    config = setup.config()
    if data is not None:
        check_spec_length(data, config, allow_overlength=setup.allow_overlength)
    names = [method] if compare is None else [compare, method]  # the reference goes first
    chosen = options.build(names, config.num_hidden_layers, strict=True)
    check_drafts(chosen, setup.model, config)
    twice = first_repeated(kept_layers)
    if twice is not None:
        raise RankkitError(f"--kept-layers names layer {twice} twice; name each layer once")
    for layer in kept_layers:
        if not 0 <= layer < config.num_hidden_layers:
            raise RankkitError(
                f"--kept-layers {layer} is not a layer of this model (0..{config.num_hidden_layers - 1}); "
                "list layers in that range"
            )
    loaded, runner = setup.load()
    if data is not None:
        examples = _scored_examples(data, loaded)
        if example >= len(examples):
            count, last = len(examples), len(examples) - 1
            choices = "--example 0" if count == 1 else f"--example 0..{last}"
            raise RankkitError(f"--example {example} is past the {count} example(s) of {data}; give {choices}")
        picked = examples[example]
        (prompt,) = _checked_prompts(loaded.tokenizer, [picked], config, setup, [budget], chosen)
    else:
        picked, prompt = None, build_prompt(loaded.tokenizer, context, question)
        check_length(prompt.num_tokens, config, "the prompt", allow_overlength=setup.allow_overlength)
        warn_budgets([budget], _pruning(chosen), [prompt.num_tokens])
    # full keeps everything whatever the budget
    entries = [(each, Budget.from_keep(1.0) if each.name == FULL else budget) for each in chosen]
    with torch.inference_mode():
        cost_model = cached_calibration(runner, prompt.input_ids, loaded.weights_hash)
    rows = compare_on_prompt(runner, loaded.tokenizer, prompt, picked, entries, cost_model, settings)
    for row in rows:
        row["timing_only"] = loaded.timing_only
        if loaded.timing_only:
            row |= dict.fromkeys(SCORES)
    if compare is None:
        rows[0] |= dict.fromkeys(RATIOS)
    if kept_layers:
        chosen_method, chosen_budget = entries[-1]
        kept = kept_positions_by_layer(
            runner, chosen_method, prompt.input_ids, chosen_budget, list(kept_layers)
        )
        rows[-1]["kept_positions_by_layer"] = {str(layer): heads for layer, heads in kept.items()}
    return rows[::-1]


PREFILL_JSON_KEYS = (
    "example_id",
    "method",
    "keep",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "kv_bytes",
    "peak_mem_bytes",
    "ideal_ratio",
    "answer",
    "score",
    "selection_layer",
    "selected_positions",
)
RATIOS = ("ttft_ratio", "tpot_ratio", "kv_ratio")


def prefill_json(rows: list[dict]) -> dict:
    """The JSON form of ``prefill``'s rows: the method's measurements, budget and prompt length,
    and with a comparison its ratios and the compared method's measurements under ``compare``."""
    method = rows[0]
    result = {key: method[key] for key in PREFILL_JSON_KEYS} | {
        "budget": method["budget"],
        "length": method["length"],
        "warmup": method["warmup"],  # 0: first runs timed (``FIRST_RUNS_TIMED``)
        "timing_only": method.get("timing_only", False),
    }
    if len(rows) > 1:
        result |= {key: method[key] for key in RATIOS}
        result["compare"] = {key: rows[1][key] for key in PREFILL_JSON_KEYS}
    if "kept_positions_by_layer" in method:
        result["kept_positions_by_layer"] = method["kept_positions_by_layer"]
    return result


def bench(
    methods: str | Sequence[str],
    data: str | os.PathLike,
    *,
    keep: Sequence[float] | float | str | None = None,
    budget: Sequence[int] | int | str | None = None,
    limit: int | None = None,
    out: str | os.PathLike | None = None,
    overwrite: bool = False,
    options: MethodOptions = MethodOptions(),
    settings: BenchSettings = BenchSettings(),
    setup: Setup = Setup(),
    progress: ProgressCallback = ignore,
    shard: tuple[int, int] = (0, 1),
) -> pl.DataFrame:
    """The methods x budgets grid over the examples of ``data``: one row per (example, method, budget).
    ``methods`` as a list or as ``--methods`` writes them; the budgets are the keep rates ``keep`` or
    the token counts ``budget``, each a list, one value, or the comma-separated text ("0.1,0.2").

    Every option is checked before the model loads. With ``out`` each example's rows are
    kept as soon as they are measured (``outputs.Journal``): SIGINT or SIGTERM stops with
    ``Interrupted`` naming what was kept, and the same call again resumes, skipping finished
    examples and reusing the first run's cost model, so its output equals an uninterrupted
    run's but for timings. The frame is written to ``out`` atomically at the end.

    ``shard`` = (rank, world) runs only that rank's ``rankkit.shards.share`` of the examples
    (every prompt is still checked), calibrating its own cost model on its first prompt;
    ``rankkit.shards.interleave`` of the ranks' rows by example restores the order.
    """
    data = spec_text(data)
    if limit is not None:
        check_count(limit, "--limit")
    methods = split_names(methods) if isinstance(methods, str) else list(methods)
    budgets = given_budgets(keep, budget)
    setup.check_timing(settings)
    config = setup.config()
    check_spec_length(data, config, allow_overlength=setup.allow_overlength)
    chosen = options.build(methods, config.num_hidden_layers, strict=False)
    check_drafts(chosen, setup.model, config)
    if out is not None:
        outputs.claim([out], overwrite=overwrite, inputs=[read_spec(data).path])
    identity = {
        "command": "bench",
        "methods": methods,
        "budgets": [budget.label for budget in budgets],
        "data": data,
        **data_fingerprint(data),
        "limit": limit,
        "model": setup.model,
        "options": asdict(options),
        "settings": asdict(settings),
    }
    if shard != (0, 1):  # a share is its own run; whole runs keep the identity they always had
        identity["shard"] = list(shard)
    loaded, runner = setup.load()
    examples = _scored_examples(data, loaded)[:limit]
    if not examples:
        raise RankkitError(f"{data} has no examples")
    prompts = _checked_prompts(loaded.tokenizer, examples, config, setup, budgets, chosen)
    examples, prompts = (share(items, *shard) for items in (examples, prompts))
    if not examples:
        raise RankkitError(f"rank {shard[0]} of {shard[1]} has no example of {data}; run fewer ranks")
    by_id = {example.id: prompt for example, prompt in zip(examples, prompts, strict=True)}
    with outputs.Journal(out, identity, overwrite=overwrite) as journal:
        return bench_into(
            journal,
            runner,
            loaded,
            examples,
            chosen,
            budgets,
            settings,
            prompt_for=lambda example: by_id[example.id],
            progress=progress,
        )


def bench_into(
    journal: outputs.Journal,
    runner: Runner,
    loaded: models.LoadedModel,
    examples: list[Example],
    methods: list[Method],
    budgets: list[Budget],
    settings: BenchSettings,
    *,
    prompt_for: Callable[[Example], Prompt],
    progress: ProgressCallback = ignore,
) -> pl.DataFrame:
    """``run_bench`` keeping each finished example in ``journal``: SIGINT or SIGTERM stops it with
    ``Interrupted`` naming what was kept; at the end the model's columns are added and
    ``journal.finish`` writes the frame."""
    with keep_on_interrupt(journal.kept):
        frame = run_bench(
            runner,
            loaded.tokenizer,
            examples,
            methods,
            budgets,
            settings,
            prompt_for=prompt_for,
            journal=journal,
            progress=progress,
        )
    frame = with_model(frame, loaded)
    journal.finish(frame)
    return frame


def run_bench(
    runner: Runner,
    tokenizer,
    examples: list[Example],
    methods: list[Method],
    budgets: list[Budget],
    settings: BenchSettings,
    *,
    prompt_for: Callable[[Example], Prompt],
    journal: outputs.Journal | None = None,
    progress: ProgressCallback = ignore,
) -> pl.DataFrame:
    """The grid over ``examples``; the cost model is calibrated once, on the first prompt.

    Each example's rows go to ``journal`` as they finish; examples it already holds are
    skipped and the cost model it noted is reused (a resumed run).
    """
    journal = journal or outputs.Journal(None, {})
    prompts = [prompt_for(example) for example in examples]
    entries = grid(methods, budgets)
    per_example = steps_per_prompt(entries, settings)
    cost_model = CostModel.from_record(journal.notes.get(COST_MODEL))
    calibrating = int(cost_model is None)
    total = calibrating + len(examples) * per_example
    if cost_model is None:
        progress(Progress("calibrating", 0, total, "full prefills of prefixes of the first prompt"))
        with torch.inference_mode():
            cost_model = calibrate(runner, prompts[0].input_ids)
        journal.note(COST_MODEL, dataclasses.asdict(cost_model))
    if BANDWIDTH not in journal.notes:
        journal.note(BANDWIDTH, dataclasses.asdict(memory_bandwidth(runner.device)))
    bandwidth = Bandwidth(**journal.notes[BANDWIDTH])
    for index, (example, prompt) in enumerate(zip(examples, prompts, strict=True)):
        stop_if_interrupted()
        done = calibrating + index * per_example
        if journal.done(example.id):
            progress(Progress(SKIPPED, done + per_example, total, f"{example.id} (finished before)"))
            continue

        def on_step(stage: str, detail: str, steps=itertools.count(done)) -> None:
            progress(Progress(stage, next(steps), total, detail))

        rows = compare_on_prompt(runner, tokenizer, prompt, example, entries, cost_model, settings, on_step)
        journal.record(example.id, rows)
        progress(Progress("done", done + per_example, total, example.id))
    frame = pl.DataFrame(journal.rows, infer_schema_length=None)
    # a step reads the weights and the KV the prefill left; the tokens it adds are a rounding error
    bound = (decode_step_bytes(runner.model, 0) + pl.col("kv_bytes")) / bandwidth.bytes_per_s
    return frame.with_columns(
        pl.lit(cost_model.linear).alias("cost_linear"),
        pl.lit(cost_model.quadratic).alias("cost_quadratic"),
        pl.lit(cost_model.ffn_share).alias("cost_ffn_share"),
        pl.lit(cost_model.head_layers).alias("cost_head_layers"),
        pl.lit(bandwidth.bytes_per_s).alias("bandwidth_bytes_per_s"),
        pl.lit(bandwidth.source).alias("bandwidth_source"),
        bound.alias("tpot_bound_s"),
        (pl.col("tpot_s") / bound).alias("tpot_over_bound"),
    )


# each with its 95% interval over examples
SUMMARY_METRICS = (
    "accuracy",
    "ttft_ratio",
    "ideal_ratio",
    "measured_over_ideal",
    "tpot_ratio",
    "tpot_over_bound",
    "kv_ratio",
    "ttft_s",
    "tpot_s",
    "first_step_s",
    "later_steps_s",
    "kv_bytes",
    "peak_mem_bytes",
)
_LATER_COLUMNS = ("first_step_s", "later_steps_s", "tpot_over_bound")  # benches before them lack them
SUMMARY_INPUTS = (  # the grid's columns ``summary`` reads
    "example_id",
    "method",
    "budget",
    "keep",
    "score",
    "ttft_ratio",
    "tpot_ratio",
    "kv_ratio",
    "ideal_ratio",
    "ttft_s",
    "tpot_s",
    "kv_bytes",
    "peak_mem_bytes",
)


def summary(frame: pl.DataFrame) -> pl.DataFrame:
    """Per method and budget: the mean keep rate, and each of ``SUMMARY_METRICS`` as its mean over
    examples with its 95% interval (``<metric>_ci_low``/``_ci_high``: Wilson for 0/1 scores,
    bootstrap otherwise, resampling clusters where examples share one; ``rankkit.eval.stats``),
    with ``n_examples`` (and ``n_clusters`` where the rows name clusters): the score
    (``accuracy``), TTFT/TPOT/KV ratios to full, the ideal ratio and measured over ideal, TPOT
    over the time to read what a step must (``tpot_over_bound``: the weights and the method's KV
    at the device's memory bandwidth), times (TPOT's first decode step and the mean of the later
    ones besides) and bytes.

    Ratios are means over examples of each example's paired median ratio; measured over ideal
    is each example's TTFT ratio over its ideal ratio.
    """
    # a sweep's bench holds each example once per layer setting: a mean mixing them is refused below
    check_unique_rows(frame, ("example_id", "method", "budget", "layer_setting"), "the bench frame", "rankkit bench")
    scored = frame.with_columns(
        (pl.col("ttft_ratio") / pl.col("ideal_ratio")).alias("measured_over_ideal"),
        # a bench written before these columns were kept has none
        *(pl.lit(None, pl.Float64).alias(column) for column in _LATER_COLUMNS if column not in frame.columns),
    )
    keeps = scored.group_by("method", "budget", maintain_order=True).agg(pl.col("keep").mean())
    intervals = example_means(scored, ["method", "budget"], SUMMARY_METRICS)
    table = intervals.join(keeps, on=["method", "budget"], maintain_order="left")
    return table.with_columns(pl.lit(True).alias("timing_only")) if is_timing_only(frame) else table


def example_means(frame: pl.DataFrame, by: Sequence[str], metrics: Sequence[str]) -> pl.DataFrame:
    """Per group of ``by`` (``budget`` among them: a mean over budgets is none of theirs), each of
    ``metrics`` of bench rows ``frame`` averaged over examples with its 95% interval and n, resampling
    clusters where the rows name them (then with ``n_clusters``); ``accuracy`` (the score) and the
    evidence kept are scores, with Wilson's interval for a right/wrong one or a collapsed bootstrap
    (``scores_among``). The one rule of every mean over a bench's examples."""
    from rankkit.eval.stats import cluster_column, mean_intervals, scores_among

    scored = frame.with_columns(pl.col("score").cast(pl.Float64).alias("accuracy"))
    return mean_intervals(
        scored, by, metrics, example="example_id", cluster=cluster_column(frame), scores=scores_among(metrics)
    )
