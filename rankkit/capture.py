"""Capture: data x model x probes (x oracle) -> one zarr store, resumable and shardable.

Every example gets one prefill through the runner with a ``ProbeRecorder`` on it; with
``oracle=True`` the same prefill is reused for the Answer-Informed Oracle's decode. An
example is written whole, its ``complete`` flag last, so a killed run resumes where it
stopped and never trusts half an example. Under ``torchrun`` each rank takes every
WORLD_SIZE-th example and writes into the same store.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rankkit import models, stores
from rankkit.data import METRICS, Example, load_examples, parse_spec
from rankkit.errors import RankkitError
from rankkit.oracle import answer_informed_oracle
from rankkit.probes import ProbeRecorder, parse_probes
from rankkit.prompting import Prompt, example_prompt, reference_answer
from rankkit.runner import Runner


@dataclass(frozen=True)
class OracleOptions:
    """How the Answer-Informed Oracle is run; recorded with every example's oracle."""

    answer: str = "generated"
    softmax: bool = False
    kernel: int = 7
    max_new_tokens: int = 32


@dataclass
class CaptureSummary:
    out: str
    examples: int = 0
    written: int = 0
    skipped: int = 0
    tokens: int = 0
    seconds: float = 0.0
    correct: list[float] = field(default_factory=list)

    def count(self, progress, tokens: int | None, oracle_attrs: dict | None = None) -> None:
        """Book one example: written (``tokens`` given) or skipped (None), then report progress."""
        if tokens is None:
            self.skipped += 1
        else:
            self.written += 1
            self.tokens += tokens
        if oracle_attrs and "correct" in oracle_attrs:
            self.correct.append(oracle_attrs["correct"])
        if progress:
            progress("skipped" if tokens is None else "written", self.examples, tokens or 0)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def accuracy(self) -> float | None:
        return float(np.mean(self.correct)) if self.correct else None


def shard() -> tuple[int, int]:
    """(rank, world size) under torchrun / accelerate launch, else (0, 1)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def run_meta(loaded: models.LoadedModel, probes, data_spec: str) -> dict:
    """What defines a capture run; a resumed run must match it exactly."""
    config = loaded.model.config
    return {
        "model": {
            "id": loaded.model_id,
            "weights_hash": loaded.weights_hash,
            "family": config.model_type,
            "dtype": str(loaded.model.dtype).removeprefix("torch."),
        },
        "num_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "tokenizer": {"class": type(loaded.tokenizer).__name__, "vocab_size": len(loaded.tokenizer)},
        "probes": {probe.name: probe.params() for probe in probes},
        "dataset": data_spec,
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
    writer, runner: Runner, tokenizer, example_id: str, ids, attrs: dict, options, prefill=None
) -> dict:
    """Compute one example's oracle and add it to the store; returns the attrs written with it."""
    result, oracle_attrs = oracle_for(runner, tokenizer, ids, attrs, options, prefill)
    writer.add_oracle(example_id, oracle=result.scores, oracle_layers=result.layer_scores, attrs=oracle_attrs)
    return oracle_attrs


def oracle_for(
    runner: Runner, tokenizer, ids: torch.Tensor, attrs: dict, options: OracleOptions, prefill=None
):
    """The oracle of one example and the attrs recording its answer, correctness and options."""
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
        oracle_attrs["correct"] = float(metric(result.answer_text, tuple(attrs["answers"])))
    return result, oracle_attrs


def capture(
    *,
    model: str = "default",
    data: str = "niah:n=8,length=2048",
    probes: str = "all",
    out: str | os.PathLike = "runs/capture.zarr",
    limit: int | None = None,
    device: str = "auto",
    overwrite: bool = False,
    oracle: OracleOptions | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> CaptureSummary:
    """Capture every probe at every layer for each example of ``data`` into the store ``out``.

    ``progress(kind, done_examples, tokens)`` is called after each example (kind is
    "written" or "skipped"), so a front end can draw a bar.
    """
    import time

    rank, world = shard()
    if world > 1 and torch.cuda.is_available() and device == "auto":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
    probe_list = parse_probes(probes)
    parse_spec(data)  # a bad spec fails before minutes of model loading
    loaded = models.load(model, device=device)
    examples = load_examples(data, loaded.tokenizer)[:limit]
    writer = stores.create(out, run_meta(loaded, probe_list, data), overwrite=overwrite and rank == 0)
    runner = Runner(loaded.model)
    summary = CaptureSummary(out=str(Path(out)))
    started = time.perf_counter()
    for index, example in enumerate(examples):
        if index % world != rank:
            continue
        summary.examples += 1
        if writer.is_complete(example.id) and (oracle is None or writer.has_oracle(example.id)):
            summary.count(progress, None)
            continue
        prompt = example_prompt(loaded.tokenizer, example)
        ids = prompt.input_ids.to(loaded.device)
        attrs = example_attrs(loaded.tokenizer, example, prompt)
        prefill = oracle_attrs = None
        if not writer.is_complete(example.id):
            recorder = ProbeRecorder(probe_list)
            prefill = runner.prefill(ids, hooks=[recorder])
            writer.write_example(
                example.id,
                attrs=attrs,
                tokens=prompt.input_ids.numpy(),
                scores=recorder.scores(),
                score_attrs={probe.name: probe.layout() for probe in probe_list},
            )
        if oracle is not None:
            oracle_attrs = write_oracle(
                writer, runner, loaded.tokenizer, example.id, ids, attrs, oracle, prefill
            )
        summary.count(progress, prompt.num_tokens, oracle_attrs)
    summary.seconds = time.perf_counter() - started
    _wait_for_other_ranks(world)
    return summary


def add_oracle(
    store_path: str | os.PathLike,
    *,
    options: OracleOptions = OracleOptions(),
    model: str | None = None,
    device: str = "auto",
    redo: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
) -> CaptureSummary:
    """Add the Answer-Informed Oracle to every complete example of a store captured earlier.

    The model is the store's own (its weights hash must match) unless ``model`` names
    the folder or hub id it was captured from.
    """
    import time

    store = stores.open(store_path)
    meta = store.meta
    spec = model or ("default" if meta["model"]["id"] == models.DEFAULT_MODEL_NAME else meta["model"]["id"])
    loaded = models.load(spec, device=device)
    if loaded.weights_hash != meta["model"]["weights_hash"]:
        raise RankkitError(
            f"the store was captured with other weights than '{spec}' has now; pass --model with the original model"
        )
    writer = stores.create(store_path, meta)  # reopens: the store's own metadata always matches
    runner = Runner(loaded.model)
    summary = CaptureSummary(out=str(store_path))
    started = time.perf_counter()
    for record in store.examples():
        summary.examples += 1
        if record.has_oracle and not redo:
            summary.count(progress, None)
            continue
        ids = torch.from_numpy(record.tokens.astype(np.int64)).to(loaded.device)
        oracle_attrs = write_oracle(writer, runner, loaded.tokenizer, record.id, ids, record.attrs, options)
        summary.count(progress, record.num_tokens, oracle_attrs)
    summary.seconds = time.perf_counter() - started
    return summary


def _wait_for_other_ranks(world: int) -> None:
    """Under torchrun, return only when every rank has written its share."""
    if world == 1:
        return
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    dist.barrier()
    dist.destroy_process_group()
