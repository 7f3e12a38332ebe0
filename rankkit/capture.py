"""Capture: data x model x probes (x oracle) -> one zarr store, resumable and shardable.

Every example gets one prefill through the runner with a ``ProbeRecorder`` on it; with
``oracle=True`` the same prefill is reused for the Answer-Informed Oracle's decode. An
example is written whole, its ``complete`` flag last, so a killed run resumes where it
stopped and never trusts half an example. Under ``torchrun`` each rank takes every
WORLD_SIZE-th example and writes into the same store (``rankkit.shards``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import polars as pl
import torch

from rankkit import defaults, model_cache, models, outputs, stores
from rankkit.checks import check_prompt_lengths, check_spec_length
from rankkit.data import METRICS, Example, data_fingerprint, load_examples, spec_text
from rankkit.errors import RankkitError
from rankkit.interrupts import keep_on_interrupt, stop_if_interrupted
from rankkit.methods.selection import DRAFT_ARRAY, DRAFT_GROUP
from rankkit.oracle import EmptyAnswer, answer_informed_oracle, oracle_params
from rankkit.probes import ProbeRecorder, parse_probes
from rankkit.progress import SKIPPED, Progress, ProgressCallback, ignore
from rankkit.prompting import Prompt, check_answered, example_prompt, reference_answer
from rankkit.runner import PrefillResult, Runner, layer_types
from rankkit.shards import rank_device, shard, share, share_size, wait_for_other_ranks
from rankkit.values import check_count


@dataclass(frozen=True)
class OracleOptions:
    """How the Answer-Informed Oracle is run; recorded with every example's oracle."""

    answer: str = defaults.ORACLE_ANSWER
    softmax: bool = False
    kernel: int = defaults.ORACLE_KERNEL
    max_new_tokens: int = defaults.MAX_NEW_TOKENS

    def __post_init__(self) -> None:
        self.params()  # bad settings fail here, before any model loads

    def params(self) -> dict:
        """What the store records with each oracle: its identity (``oracle_params``)."""
        return oracle_params(self.answer, self.softmax, self.kernel, self.max_new_tokens)


def check_oracle_settings(store_path, options: OracleOptions) -> None:
    """Refuse to add oracles made with ``options`` to a store holding oracles made otherwise."""
    wanted = options.params()
    held: dict[str, tuple[dict, str]] = {}  # each setting the store's oracles were made with: an example
    for record in stores.open(store_path).examples(skip_unreadable=True):  # a resumed capture redoes those
        made = record.attrs.get("oracle_params") if record.has_oracle else None
        if made is not None:
            held.setdefault(outputs.json_digest(made), (made, record.id))
    others = [(made, example_id) for made, example_id in held.values() if made != wanted]
    if not others:
        return
    redo = f"`rankkit oracle {store_path} --redo`"
    if len(held) > 1:  # what a --redo interrupted midway leaves: only finishing it makes one setting
        shown = "; ".join(f"{_as_settings(made)} (example {example_id!r})" for made, example_id in held.values())
        raise RankkitError(
            f"{store_path} holds oracles made with {len(held)} settings ({shown}), as an interrupted --redo "
            f"leaves it; finish it with {redo} and the settings it was given"
        )
    ((made, example_id),) = others
    differing = {key: value for key, value in made.items() if value != wanted.get(key)}
    raise RankkitError(
        f"{store_path} holds oracles made with {_as_settings(made)} (example {example_id!r}); rerun with "
        f"{_as_options(differing)}, or recompute every oracle with {redo} and the new settings"
    )


def _as_settings(made: dict) -> str:
    return ", ".join(f"{key}={value}" for key, value in made.items() if value is not None)


def _as_options(settings: dict) -> str:
    """Oracle settings as the options of `capture --oracle` and `oracle` that give them."""
    options = []
    for key, value in settings.items():
        flag = key.replace("_", "-")
        if isinstance(value, bool):
            options.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None:
            options.append(f"--{flag} {value}")
    return " ".join(options)


@dataclass
class CaptureSummary:
    out: str
    examples: int = 0
    written: int = 0
    skipped: int = 0
    complete_before: int = 0  # examples of this run with nothing left to do when it started
    outdated_before: int = 0  # examples whose oracle, made with other settings, this run redoes
    tokens: int = 0
    seconds: float = 0.0
    # every example this run went through whose oracle answer is scored, now or by an earlier run:
    # {"example_id", "cluster", "accuracy"}
    scored: list[dict] = field(default_factory=list)
    total: int | None = None  # the examples this run goes through
    captures: int = 0  # captures this run wrote, each whole, as it wrote them
    oracles: int = 0  # oracles this run wrote
    without_answer: list[str] = field(default_factory=list)  # examples whose oracle had no answer to rank by
    timing_only: bool = False  # random weights: the oracle's answers get no score

    def count(
        self,
        progress: ProgressCallback,
        example_id: str,
        tokens: int | None,
        attrs: dict,
    ) -> None:
        """Book one example, written (``tokens`` given) or skipped (None), with its stored ``attrs``
        (its oracle's score among them), then report progress."""
        if tokens is None:
            self.skipped += 1
        else:
            self.written += 1
            self.tokens += tokens
        if "correct" in attrs:
            cluster = (attrs.get("meta") or {}).get("cluster")
            self.scored.append({"example_id": example_id, "cluster": cluster, "accuracy": attrs["correct"]})
        stage = SKIPPED if tokens is None else "written"
        progress(Progress(stage, self.examples, self.total, example_id))

    def kept(self) -> str:
        """What an interrupted run kept, per stage: every capture and oracle written whole (the store
        never holds half of one)."""
        outdated = f", {self.outdated_before} with oracles of other settings to redo" if self.outdated_before else ""
        return (
            f"interrupted: kept {self.captures} captures and {self.oracles} oracles written by this run "
            f"({self.complete_before} examples were complete before{outdated}) in {self.out}; "
            "rerun the same command to resume"
        )

    @contextmanager
    def kept_on_write_failure(self) -> Iterator[None]:
        """A write into the store that fails (a full disk) is one line saying why and what was kept."""
        try:
            yield
        except OSError as error:
            raise RankkitError(
                f"{outputs.write_failure(error.filename or self.out, error)}; {self.kept().removeprefix('interrupted: ')}"
            ) from None

    @property
    def tokens_per_second(self) -> float | None:
        """This run's speed; None when it wrote nothing (a rerun of a finished store): nothing was timed."""
        return self.tokens / self.seconds if self.tokens and self.seconds else None

    @property
    def accuracy(self) -> dict | None:
        """The oracle answers' mean score over the examples this run went through, its 95% interval
        and n (``rankkit.eval.stats.mean_intervals``: Wilson for right/wrong, resampling the
        examples that share a haystack or needle); None when none is scored."""
        from rankkit.eval.stats import CLUSTER, EXAMPLE_ID, cluster_column, mean_intervals

        if not self.scored:
            return None
        frame = pl.DataFrame(self.scored, schema={EXAMPLE_ID: pl.String, CLUSTER: pl.String, "accuracy": pl.Float64})
        summary = mean_intervals(
            frame.with_columns(pl.lit("all").alias("examples")),
            ["examples"],
            ["accuracy"],
            cluster=cluster_column(frame),
            scores=["accuracy"],
        )
        return summary.drop("examples").row(0, named=True)


def run_meta(loaded: models.LoadedModel, probes, data_spec: str) -> dict:
    """What defines a capture run; a resumed run must match it exactly.

    ``model.layer_types`` and ``model.sliding_window`` are recorded only for models with
    local layers (stores without them, older ones included, are all-global), so the offline
    faces pick the selection layers and per-layer kept sets prefill picks.
    """
    config = loaded.model.config
    model = {
        "id": loaded.model_id,
        "weights_hash": loaded.weights_hash,
        "family": config.model_type,
        "dtype": str(loaded.model.dtype).removeprefix("torch."),
    }
    kinds = layer_types(config)
    if kinds is not None:
        model["layer_types"] = list(kinds)
        model["sliding_window"] = getattr(config.get_text_config(), "sliding_window", None)
    timing = {"timing_only": True} if loaded.timing_only else {}  # absent: real weights (and older stores)
    return {
        "model": model,
        **timing,
        "num_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "tokenizer": {"class": type(loaded.tokenizer).__name__, "vocab_size": len(loaded.tokenizer)},
        "probes": {probe.key: probe.params() for probe in probes},
        "dataset": data_spec,
        **data_fingerprint(data_spec),
    }


def example_attrs(tokenizer, example: Example, prompt: Prompt) -> dict:
    """Everything a reader needs without the model: task, answers, spans, token texts."""
    ids = prompt.input_ids.tolist()
    return {
        "task": example.task,
        "question": example.question,
        "answers": list(example.answers),
        "answer_prefix": example.answer_prefix,
        "metric": example.metric,
        "meta": example.meta,
        "num_tokens": len(ids),
        "token_text": tokenizer.batch_decode([[token] for token in ids]),
        "spans": {
            "context_chars": list(prompt.context_chars),
            "question_chars": list(prompt.question_chars),
            "context_tokens": list(prompt.context_tokens),
            "question_tokens": list(prompt.question_tokens),
            "evidence_chars": [list(span) for span in example.evidence],
            "evidence_tokens": [list(prompt.context_token_span(*span)) for span in example.evidence],
        },
    }


def write_oracle(
    writer, runner: Runner, tokenizer, example_id: str, ids, attrs: dict, options, summary, prefill=None
) -> None:
    """Compute one example's oracle and add it to the store.

    An example without answer tokens to rank by gets no oracle, is warned of and noted in
    ``summary.without_answer``, and the run goes on (rerunning retries it)."""
    try:
        result, oracle_attrs = oracle_for(
            runner, tokenizer, ids, attrs, options, prefill, scored=not summary.timing_only
        )
    except EmptyAnswer as error:
        summary.without_answer.append(example_id)
        hint = (
            "; --answer reference ranks by the gold answer instead" if options.answer == "generated" else ""
        )
        warnings.warn(f"example {example_id!r} has no oracle: {error}{hint}", stacklevel=2)
        return
    writer.add_oracle(example_id, oracle=result.scores, oracle_layers=result.layer_scores, attrs=oracle_attrs)
    summary.oracles += 1


def oracle_for(
    runner: Runner,
    tokenizer,
    ids: torch.Tensor,
    attrs: dict,
    options: OracleOptions,
    prefill: PrefillResult | None,
    *,
    scored: bool,
):
    """The oracle of one example and the attrs recording its answer, correctness (unless not
    ``scored``: random weights' answers mean nothing) and options; ``prefill``, the example's full
    prefill where the capture made one, is continued instead of made again."""
    result = answer_informed_oracle(
        runner,
        ids,
        tokenizer=tokenizer,
        max_new_tokens=options.max_new_tokens,
        answer=options.answer,
        reference_answer=(
            reference_answer(attrs["answers"], attrs.get("answer_prefix", ""))
            if options.answer == "reference"
            else None
        ),
        softmax=options.softmax,
        kernel=options.kernel,
        prefill=prefill,
    )
    metric = METRICS[attrs["metric"]]
    oracle_attrs = {"oracle_params": result.params, "oracle_answer": result.answer_text}
    if options.answer == "generated":
        oracle_attrs["prediction"] = result.answer_text
        if scored:
            oracle_attrs["correct"] = float(metric(result.answer_text, tuple(attrs["answers"])))
    return result, oracle_attrs


def capture_probes(probes: str) -> list:
    """The probes ``capture(probes=...)`` records: those named, or for "all" the default capture's
    (``default_capture_probes``)."""
    if probes.strip() == "all":
        from rankkit.methods import default_capture_probes

        return default_capture_probes()
    return parse_probes(probes)


def requested_oracle(oracle: bool, options: OracleOptions) -> OracleOptions | None:
    """The oracle ``capture --oracle`` makes with ``options`` (checked when they were made), or, without
    ``--oracle``, none: then settings other than the defaults are refused, since the store would be
    captured without the oracle they describe and a typo'd value (``--answer gold``) pass unseen."""
    if oracle:
        return options
    default = asdict(OracleOptions())
    given = {key: value for key, value in asdict(options).items() if value != default[key]}
    if given:
        raise RankkitError(
            f"{_as_options(given)} set{'s' if len(given) == 1 else ''} how the oracle is made, and no oracle "
            "is made: add --oracle, or drop them"
        )
    return None


def _oracle_options(oracle, option: str = "oracle") -> OracleOptions | None:
    """``capture``'s ``oracle`` and ``add_oracle``'s ``options``: OracleOptions, a dict of its
    fields, True for the defaults, or None (False) for none."""
    if oracle is True:
        return OracleOptions()
    if oracle is False:
        return None
    if oracle is None or isinstance(oracle, OracleOptions):
        return oracle
    if isinstance(oracle, dict):
        known = [setting.name for setting in fields(OracleOptions)]
        unknown = [str(key) for key in oracle if key not in known]
        if unknown:
            raise RankkitError(f"{option} has no setting {', '.join(unknown)}; its settings are {', '.join(known)}")
        return OracleOptions(**oracle)
    raise RankkitError(
        f"{option} takes OracleOptions(...), a dict of its settings, True for its defaults, or None, not {oracle!r}"
    )


def capture(
    *,
    model: str = defaults.MODEL,
    data: str | os.PathLike = defaults.CAPTURE_DATA,
    probes: str = "all",
    out: str | os.PathLike = defaults.CAPTURE_OUT,
    limit: int | None = None,
    device: str = defaults.DEVICE,
    overwrite: bool = False,
    oracle: OracleOptions | bool | None = None,
    draft: str | None = None,
    progress: ProgressCallback = ignore,
    allow_overlength: bool = False,
    score_dtype: str = defaults.SCORE_DTYPE,
    device_map: str | None = None,
    threads: int | None = None,
) -> CaptureSummary:
    """Capture every probe at every layer for each example of ``data`` into the store ``out``.

    ``draft`` (a SpecPrefill draft spec, e.g. ``layers:8``) also stores the draft's
    lookahead scores (CLAA Eq. 3 before aggregation) in the example's ``draft_scores`` group.

    ``progress`` gets a ``Progress`` event after each example (stage "written" or
    "skipped"; the total is this rank's share of the examples). A prompt longer than the
    model's positions is refused before any compute unless ``allow_overlength``.
    ``score_dtype`` "float16" stores the scores at half the size (see docs/benchmarks.md
    for what it changes in the metrics). ``device_map`` spreads the model over devices
    (``models.parse_device_map``). ``threads`` sets torch's CPU threads for the process (``models.use_threads``).
    """
    import time

    models.use_threads(threads)
    data = spec_text(data)
    oracle = _oracle_options(oracle)
    if limit is not None:
        check_count(limit, "--limit")
    rank, world = shard()
    device = rank_device(device)
    probe_list = capture_probes(probes)
    stores.check_score_dtype(score_dtype)
    # float32 stays implicit, so stores captured before the option existed still resume
    stored_as = {} if score_dtype == "float32" else {stores.SCORE_DTYPE_KEY: score_dtype}
    # a bad spec, example, length, device, device map or output fails before the weights load
    config = models.load_config(model)
    check_spec_length(data, config, allow_overlength=allow_overlength)
    if draft is not None:
        from rankkit.methods import make
        from rankkit.methods.specprefill import check_drafts

        check_drafts([make("specprefill", draft_model=draft)], model, config)
    device_map = models.parse_device_map(device_map)
    models.resolve_device(device)
    tokenizer = models.load_tokenizer(model)
    examples = load_examples(data, tokenizer)[:limit]
    prompts = check_prompt_lengths(tokenizer, examples, config, allow_overlength=allow_overlength)
    if oracle is not None and oracle.answer == "reference":
        check_answered(((example.id, example.answers) for example in examples), *_REFERENCE_FOLLOWER)
    tokens = sum(prompt.num_tokens for prompt in prompts)
    # a store being resumed holds some of it already: only a new one is held to the estimate
    needed = 0 if Path(out).exists() else store_bytes(config, len(probe_list), tokens, score_dtype)
    outputs.check_outside_stores(out)
    outputs.check_writable(Path(out).parent, needed)
    loaded = models.load(model, device=device, device_map=device_map)
    runner = Runner(loaded.model)
    drafter = None if draft is None else specprefill_for(draft, runner)
    meta = {**run_meta(loaded, probe_list, data), **stored_as}
    if drafter is not None:  # part of the run's identity: a resume with another draft refuses
        meta["draft"] = drafter.resolved(runner.num_layers)
    writer = stores.create(out, meta, overwrite=overwrite and rank == 0, rank=rank)
    if oracle is not None:
        check_oracle_settings(out, oracle)
    summary = CaptureSummary(
        out=str(Path(out)), total=share_size(len(examples), rank, world), timing_only=loaded.timing_only
    )

    def complete(example_id: str) -> bool:
        return (
            writer.is_complete(example_id)
            and (oracle is None or writer.has_oracle(example_id))
            and (drafter is None or writer.has_group(example_id, DRAFT_GROUP))
        )

    examples = share(examples, rank, world)
    summary.complete_before = sum(complete(example.id) for example in examples)
    started = time.perf_counter()
    with keep_on_interrupt(summary.kept), summary.kept_on_write_failure():
        for example in examples:
            stop_if_interrupted()
            summary.examples += 1
            if complete(example.id):
                summary.count(progress, example.id, None, writer.example_attrs(example.id))
                continue
            prompt = example_prompt(loaded.tokenizer, example)
            ids = prompt.input_ids.to(loaded.device)
            attrs = example_attrs(loaded.tokenizer, example, prompt)
            prefill = None
            if not writer.is_complete(example.id):
                recorder = ProbeRecorder(probe_list)
                prefill = runner.prefill(ids, hooks=[recorder])
                writer.write_example(
                    example.id,
                    attrs=attrs,
                    tokens=prompt.input_ids.numpy(),
                    scores=recorder.scores(),
                    score_attrs={probe.key: probe.layout() for probe in probe_list},
                )
                summary.captures += 1
            if oracle is not None and not writer.has_oracle(example.id):
                write_oracle(writer, runner, loaded.tokenizer, example.id, ids, attrs, oracle, summary, prefill)
            if drafter is not None and not writer.has_group(example.id, DRAFT_GROUP):
                write_draft_scores(writer, runner, drafter, example.id, ids)
            summary.count(progress, example.id, prompt.num_tokens, writer.example_attrs(example.id))
    summary.seconds = time.perf_counter() - started
    wait_for_other_ranks(world)
    return summary


def store_bytes(config, probe_count: int, tokens: int, score_dtype: str) -> int:
    """About the bytes a store of ``tokens`` prompt tokens takes: each probe's scores, one value per
    layer, KV head and token (they barely compress, docs/benchmarks.md)."""
    per_token = config.num_hidden_layers * config.num_key_value_heads * probe_count
    return tokens * per_token * np.dtype(score_dtype).itemsize


def specprefill_for(draft: str, runner: Runner):
    """The SpecPrefill method drafting with ``draft`` for ``runner``, its draft checked before any example."""
    from rankkit.methods import make
    from rankkit.methods.specprefill import draft_runner

    method = make("specprefill", draft_model=draft)
    draft_runner(method.draft_model, runner)  # given, so no depth of the target's fills it in
    return method


def write_draft_scores(writer, runner: Runner, method, example_id: str, ids: torch.Tensor) -> None:
    """Add one example's lookahead scores [k, T] (``draft_scores/lookahead``), with the draft's settings."""
    lookahead, _ = method.draft_scores(runner, ids)
    writer.add_arrays(
        example_id, DRAFT_GROUP, {DRAFT_ARRAY: lookahead.cpu().numpy()}, method.resolved(runner.num_layers)
    )


# who follows an example's first answer, and the fixes where one has none
_REFERENCE_FOLLOWER = ("--answer reference", "add answers to it, leave it out, or pass --answer generated")


def add_oracle(
    store_path: str | os.PathLike,
    *,
    options: OracleOptions | dict | bool = OracleOptions(),
    model: str | None = None,
    device: str = "auto",
    redo: bool = False,
    progress: ProgressCallback = ignore,
    device_map: str | None = None,
    threads: int | None = None,
) -> CaptureSummary:
    """Add the Answer-Informed Oracle to every complete example of a store captured earlier.

    The model is the store's own (its weights hash must match) unless ``model`` names
    the folder or hub id it was captured from. Under ``torchrun`` each rank takes its
    ``share`` of the examples, as ``capture`` does. ``options`` takes what ``capture``'s ``oracle``
    does (OracleOptions, a dict of its settings, True for the defaults). ``threads`` sets torch's CPU threads for the process (``models.use_threads``).
    """
    import time

    models.use_threads(threads)
    options = _oracle_options(options, "options")
    if options is None:
        raise RankkitError("add_oracle adds an oracle: give options=OracleOptions(...), a dict of its settings, or True")
    rank, world = shard()
    store = stores.open(store_path)
    meta = store.meta
    records = share(list(store.examples()), rank, world)
    if options.answer == "reference":  # before the weights load
        check_answered(((record.id, record.attrs.get("answers")) for record in records), *_REFERENCE_FOLLOWER)
    spec = model or ("default" if meta["model"]["id"] == model_cache.DEFAULT_MODEL_NAME else meta["model"]["id"])
    other_weights = (
        f"the store was captured with other weights than '{spec}' has now; pass --model with the original model"
    )
    # known without loading for a random shape or a folder hashed before: refused before any weight loads
    known = models.known_weights_hash(spec, models.resolve_device(rank_device(device)))
    if known not in (None, meta["model"]["weights_hash"]):
        raise RankkitError(other_weights)
    loaded = models.load(spec, device=rank_device(device), device_map=device_map)
    if loaded.weights_hash != meta["model"]["weights_hash"]:
        raise RankkitError(other_weights)
    if not redo:
        check_oracle_settings(store_path, options)
    writer = stores.create(store_path, meta, rank=rank)  # reopens: the store's own metadata always matches
    runner = Runner(loaded.model)
    summary = CaptureSummary(out=str(store_path), total=len(records), timing_only=loaded.timing_only)
    # --redo replaces the oracles made with other settings only, so an interrupted one resumes
    wanted = options.params()
    outdated = {record.id for record in records if record.has_oracle and record.attrs.get("oracle_params") != wanted}
    done = {record.id for record in records if record.has_oracle and (record.id not in outdated or not redo)}
    summary.complete_before = len(done)
    summary.outdated_before = len(outdated) if redo else 0
    started = time.perf_counter()
    with keep_on_interrupt(summary.kept), summary.kept_on_write_failure():
        for record in records:
            stop_if_interrupted()
            summary.examples += 1
            if record.id in done:
                summary.count(progress, record.id, None, record.attrs)
                continue
            ids = torch.from_numpy(record.tokens.astype(np.int64)).to(loaded.device)
            write_oracle(writer, runner, loaded.tokenizer, record.id, ids, record.attrs, options, summary)
            summary.count(progress, record.id, record.num_tokens, writer.example_attrs(record.id))
    summary.seconds = time.perf_counter() - started
    wait_for_other_ranks(world)
    return summary
