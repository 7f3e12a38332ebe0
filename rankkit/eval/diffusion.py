"""The information-diffusion probe: SlimInfer Sec. 3.1 and Fig. 2.

SlimInfer removes the hidden state of the critical prompt token at different layers and
finds the answer survives late removal but not early removal, because by then the
token's information has diffused into other tokens; Fig. 2 (right) shows where in depth
the response attends to that token. This module measures both, per layer l = 0..L:

- the evidence tokens' hidden states are removed from layer l on, i.e. pruned after
  layer l-1 (the other tokens keep their original positions). Layers before l keep the
  evidence's keys and values in the cache, so the decode still reads them there, exactly
  as SlimInfer's truncated attention band. l = 0 drops the evidence at the embeddings
  (it is never seen); l = L removes nothing (the unpruned run);
- ``correct`` / ``score``: the greedy answer of that run (``max_new_tokens``), scored;
- ``answer_logprob``: sum over the reference answer's tokens of log p(token | prompt,
  earlier reference tokens), teacher-forced on top of the pruned cache;
- ``first_token_kl``: KL(P_unpruned || P_pruned) of the first answer token's distribution;
- ``evidence_attention``: in the unpruned run, at layer ``layer``, the share of
  post-softmax attention mass the reference answer's queries put on the evidence tokens,
  averaged over heads and answer tokens (null for l = L, which is no layer). The queries
  are those of the answer tokens fed back, as for the oracle (CLAA Listing 4; see
  ``rankkit.oracle``). In a run pruned at l, attention at layers before l is this same
  value and at layers from l on it is zero, so the unpruned curve says it all.

``diffusion_probe``'s rows also name the ``model`` and its ``weights_hash``: the dashboard draws
them only beside a store of the same weights.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Sequence

import polars as pl
import torch

from rankkit import defaults, models, outputs, prompting
from rankkit.cache import KVCache
from rankkit.checks import (
    check_prompt_lengths,
    check_spec_length,
    check_unique_rows,
    check_value_ranges,
)
from rankkit.data import Example, data_fingerprint, load_examples, read_spec, score, spec_text
from rankkit.data.metrics import string_match_all
from rankkit.errors import RankkitError
from rankkit.interrupts import keep_on_interrupt, stop_if_interrupted
from rankkit.oracle import fork_prefill, teacher_force, tokenize_answer
from rankkit.progress import SKIPPED, Progress, ProgressCallback, ignore
from rankkit.runner import AttentionCall, LayerHook, PrefillResult, PrefillState, Runner, greedy_continue
from rankkit.shards import share
from rankkit.values import check_count

SCHEMA = {
    "example": pl.String,
    "cluster": pl.String,  # examples sharing a haystack or a needle (``Example.meta``): one sample
    "layer": pl.Int64,
    "correct": pl.Boolean,
    "score": pl.Float64,
    "answer_logprob": pl.Float64,
    "first_token_kl": pl.Float64,
    "evidence_attention": pl.Float64,
    "prediction": pl.String,
}


class RemoveAfter(LayerHook):
    """Drops the hidden states of every token outside ``keep`` after prefill layer ``layer``."""

    def __init__(self, layer: int, keep: torch.Tensor):
        self.layer = layer
        self.keep = keep

    def after_layer(self, layer: int, state: PrefillState) -> None:
        if layer == self.layer:
            state.prune(self.keep)


class EvidenceAttention(LayerHook):
    """Per layer, the post-softmax attention mass of each decode query on the evidence, mean over heads.

    ``shares`` [layers] is the mean over the decoded tokens. The softmax runs over the
    keys the query really attends, masked as the runner masks them, with the family's
    soft-capping and sinks (``AttentionCall.cap``/``softmax``).
    """

    def __init__(self, runner: Runner, cache: KVCache, evidence_positions: torch.Tensor):
        self.cache = cache
        self.evidence_positions = evidence_positions.to(runner.device)
        self.seen: list[list[float]] = [[] for _ in range(runner.num_layers)]  # per layer, each step's share

    def on_attention(self, call: AttentionCall) -> None:
        if call.phase != "decode":
            return
        kv_heads, groups = call.key.shape[1], call.group_size
        query = call.query[0, :, -1].float().reshape(kv_heads, groups, -1) * call.scaling
        logits = call.cap(torch.matmul(query, call.key[0].float().transpose(1, 2)))  # [kv_heads, groups, S]
        mask = self.cache.attention_mask(call.layer, call.query_positions, call.sliding_window)
        if mask is not None:  # [1, kv_heads or 1, 1, S]
            logits = logits.masked_fill(~mask[0, :, -1, None, :], float("-inf"))
        on_evidence = torch.isin(call.key_positions, self.evidence_positions)  # [kv_heads, S]
        shares = (call.softmax(logits) * on_evidence[:, None, :]).sum(dim=-1)  # [kv_heads, groups]
        self.seen[call.layer].append(float(shares.mean()))

    @property
    def shares(self) -> list[float]:
        return [sum(steps) / len(steps) for steps in self.seen]


def answer_logprob(prefill_logits: torch.Tensor, forced_logits: torch.Tensor, answer: Sequence[int]) -> float:
    """Sum of log p(answer[i] | ...): row 0 of the predictions is the prefill's, row i the logits after answer[i-1]."""
    predictions = torch.cat([prefill_logits[None], forced_logits])[: len(answer)].cpu()
    logprobs = torch.log_softmax(predictions.double(), dim=-1)
    return float(logprobs[torch.arange(len(answer)), torch.tensor(answer)].sum())


def kl_divergence(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(P_reference || P) of two next-token distributions given as logits [vocab]."""
    reference = torch.log_softmax(reference_logits.double(), dim=-1)
    other = torch.log_softmax(logits.double(), dim=-1)
    # never below 0: rounding left two equal distributions' KL a hair under it, printed "-0.00"
    return max(0.0, float((reference.exp() * (reference - other)).sum()))


def _prefill_without_evidence(
    runner: Runner, ids: torch.Tensor, keep: torch.Tensor, layer: int
) -> PrefillResult:
    """The prompt's prefill with the evidence's hidden states removed from ``layer`` on."""
    if layer == 0:
        return runner.prefill(ids[keep], positions=keep)  # keep holds the last token: decoding goes on after it
    return runner.prefill(ids, hooks=[RemoveAfter(layer - 1, keep)])


def answer_limit(answer: Sequence[int]) -> int:
    """Diffusion's default greedy limit for a reference answer of these tokens: bench's limit
    (``defaults.MAX_NEW_TOKENS``) more than the answer, as a model often restates the question
    first (niah's answer of 3 tokens comes after 9 of restatement, its second fact after 6 more)."""
    return len(answer) + defaults.MAX_NEW_TOKENS


def diffusion_curve(
    runner: Runner,
    tokenizer,
    prompt_ids: torch.Tensor,
    evidence_spans: Sequence[tuple[int, int]],
    reference_answer: str,
    *,
    score_fn: Callable[[str], float] | None = None,
    max_new_tokens: int | None = None,
    layers: Sequence[int] | None = None,
    example_id: str = "example",
    cluster: str | None = None,
) -> pl.DataFrame:
    """One row per layer l (default 0..L) of the probe described in the module docstring, each
    naming ``example_id`` and its ``cluster`` (the examples it shares a haystack or a needle with).

    ``evidence_spans`` are token ranges [start, end) in ``prompt_ids``.
    ``reference_answer`` is tokenized as it continues the prompt (see
    ``rankkit.oracle.tokenize_answer``). ``score_fn(prediction)`` scores the greedy
    answer in [0, 1] (default: the reference answer found in it, case-insensitive);
    ``correct`` means full marks. ``max_new_tokens`` limits the greedy answers (default:
    ``answer_limit``). An unpruned answer that the limit cut short of full marks would make
    every layer's answer score as wrong: at the default limit it is refused, at a limit given
    it is warned of (the caller chose it, e.g. for a model that never answers right).
    """
    ids = prompt_ids.reshape(-1).to(runner.device)
    length = int(ids.numel())
    evidence = torch.zeros(length, dtype=torch.bool, device=runner.device)
    for start, end in evidence_spans:
        evidence[start:end] = True
    if not bool(evidence.any()):
        raise RankkitError(
            f"example {example_id} has no evidence tokens: the diffusion probe removes the evidence"
        )
    if bool(evidence[-1]):
        raise RankkitError(
            f"example {example_id}: the evidence covers the last prompt token, which must stay"
        )
    keep = torch.nonzero(~evidence).reshape(-1)
    answer = tokenize_answer(tokenizer, reference_answer)
    limit = max_new_tokens or answer_limit(answer)
    score_fn = score_fn or (lambda prediction: string_match_all(prediction, (reference_answer,)))
    layers = range(runner.num_layers + 1) if layers is None else layers
    if any(not 0 <= layer <= runner.num_layers for layer in layers):
        raise RankkitError(f"layers must lie in 0..{runner.num_layers}, got {list(layers)}")

    unpruned = runner.prefill(ids)
    # Every answer token is fed back here, the last one too: its query counts for the attention.
    forced = fork_prefill(unpruned)
    attention = EvidenceAttention(runner, forced.cache, torch.nonzero(evidence).reshape(-1))
    unpruned_forced_logits = teacher_force(runner, forced, answer, [attention])
    evidence_shares = attention.shares
    unpruned_answer = greedy_continue(runner, fork_prefill(unpruned), limit)
    unpruned_prediction = tokenizer.decode(unpruned_answer, skip_special_tokens=True)
    cut = len(unpruned_answer) == limit and unpruned_answer[-1] not in runner.eos_ids()
    if cut and float(score_fn(unpruned_prediction)) < 1.0:
        message = (
            f"example {example_id}: the answer on the whole prompt was cut at {limit} new tokens "
            f"short of full marks ({unpruned_prediction!r})"
        )
        if max_new_tokens is None:
            raise RankkitError(f"{message}; give a larger --max-new-tokens")
        warnings.warn(f"{message}; every layer scores it as wrong", stacklevel=2)

    rows = []
    for layer in layers:
        if layer == runner.num_layers:
            run, forced_logits = unpruned, unpruned_forced_logits
            prediction = unpruned_prediction
        else:
            run = _prefill_without_evidence(runner, ids, keep, layer)
            # the logits after the last answer token predict nothing the log-prob needs
            forced_logits = teacher_force(runner, fork_prefill(run), answer[:-1])
            generated = greedy_continue(runner, fork_prefill(run), limit)
            prediction = tokenizer.decode(generated, skip_special_tokens=True)
        prediction_score = float(score_fn(prediction))
        rows.append(
            {
                "example": example_id,
                "cluster": cluster,
                "layer": layer,
                "correct": prediction_score >= 1.0,
                "score": prediction_score,
                "answer_logprob": answer_logprob(run.logits, forced_logits, answer),
                "first_token_kl": kl_divergence(unpruned.logits, run.logits),
                "evidence_attention": evidence_shares[layer] if layer < runner.num_layers else None,
                "prediction": prediction,
            }
        )
    return pl.DataFrame(rows, schema=SCHEMA)


def example_diffusion(
    runner: Runner,
    tokenizer,
    example: Example,
    *,
    max_new_tokens: int | None = None,
    layers: Sequence[int] | None = None,
) -> pl.DataFrame:
    """``diffusion_curve`` of a dataset example: its prompt, evidence spans, first answer and metric."""
    prompt = prompting.example_prompt(tokenizer, example)
    spans = [prompt.context_token_span(start, end) for start, end in example.evidence]
    answer = prompting.reference_answer(example.answers, example.answer_prefix)
    return diffusion_curve(
        runner,
        tokenizer,
        prompt.input_ids,
        spans,
        answer,
        score_fn=lambda prediction: score(example, prediction),
        max_new_tokens=max_new_tokens,
        layers=layers,
        example_id=example.id,
        cluster=example.meta.get("cluster"),
    )


def refuse_timing_only_model(model: str) -> None:
    """The probe asks whether the answer survives; random weights (``random:<shape>``) have none to keep."""
    if models.timing_only(model):
        raise RankkitError(
            f"the diffusion probe measures answers, and {model} has random weights (timing only): "
            "give a real model, e.g. --model default"
        )


def diffusion_probe(
    data: str | os.PathLike,
    *,
    model: str = defaults.MODEL,
    limit: int | None = None,
    device: str = defaults.DEVICE,
    max_new_tokens: int | None = None,
    out: str | os.PathLike | None = None,
    overwrite: bool = False,
    allow_overlength: bool = False,
    progress: ProgressCallback = ignore,
    shard: tuple[int, int] = (0, 1),
    threads: int | None = None,
) -> pl.DataFrame:
    """The probe over the examples of a data spec (e.g. ``niah:n=4,length=1024``), one frame for all.

    With ``out`` the frame is written there atomically (an existing file only with
    ``overwrite``) and each example's rows are kept as they finish (``outputs.Journal``):
    SIGINT or SIGTERM stops with ``Interrupted`` naming what was kept, and the same call
    again resumes, skipping finished examples. ``progress`` gets an event per example.
    ``shard`` = (rank, world) probes only that rank's ``rankkit.shards.share`` of the examples.
    ``threads`` sets torch's CPU threads for the process (``models.use_threads``).
    """
    models.use_threads(threads)
    data = spec_text(data)
    refuse_timing_only_model(model)
    for count, option in ((limit, "--limit"), (max_new_tokens, "--max-new-tokens")):
        if count is not None:
            check_count(count, option)
    config = models.load_config(model)
    check_spec_length(data, config, allow_overlength=allow_overlength)
    if out is not None:
        outputs.claim([out], overwrite=overwrite, inputs=[read_spec(data).path])
    identity = {
        "command": "diffusion",
        "data": data,
        **data_fingerprint(data),
        "model": model,
        "limit": limit,
        "max_new_tokens": max_new_tokens,
    }
    if shard != (0, 1):  # a share is its own run; whole runs keep the identity they always had
        identity["shard"] = list(shard)
    loaded = models.load(model, device=device)
    examples = load_examples(data, loaded.tokenizer)[:limit]
    check_prompt_lengths(loaded.tokenizer, examples, config, allow_overlength=allow_overlength)
    answers = ((example.id, example.answers) for example in examples)
    prompting.check_answered(answers, "the diffusion probe", f"add answers to it in {data}, or leave it out")
    examples = share(examples, *shard)
    runner = Runner(loaded.model)
    with outputs.Journal(out, identity, overwrite=overwrite) as journal:
        with keep_on_interrupt(journal.kept):
            for done, example in enumerate(examples, start=1):
                stop_if_interrupted()
                finished = journal.done(example.id)
                if not finished:
                    frame = example_diffusion(runner, loaded.tokenizer, example, max_new_tokens=max_new_tokens)
                    journal.record(example.id, frame.to_dicts())
                progress(Progress(SKIPPED if finished else "probed", done, len(examples), example.id))
        # the model that answered, so no reader draws these rows beside another model's store
        frame = pl.DataFrame(journal.rows, schema=SCHEMA).with_columns(
            model=pl.lit(loaded.model_id), weights_hash=pl.lit(loaded.weights_hash)
        )
        journal.finish(frame)
    return frame


ROUNDING = 1e-6  # a KL, share or log-probability computed in float may step this far past its bound


def check_diffusion_values(frame: pl.DataFrame, what: str, num_layers: int) -> None:
    """Refuse a probe's rows (``what``, of a model with ``num_layers``) holding a value the probe never
    writes: a layer outside 0..L (L removes nothing), a score outside [0, 1], a positive log-probability,
    a negative KL, an attention share outside [0, 1]."""
    check_value_ranges(
        frame,
        (
            ("layer", 0, num_layers, False),
            ("score", 0.0, 1.0, False),
            ("answer_logprob", -math.inf, ROUNDING, False),
            ("first_token_kl", -ROUNDING, math.inf, False),
            ("evidence_attention", 0.0, 1.0 + ROUNDING, False),
        ),
        what,
        f"rankkit diffusion on this store's {num_layers}-layer model",
    )
    check_unique_rows(frame, ("example", "layer"), what, "rankkit diffusion")


DIFFUSION_MEANS = ("correct", "score", "answer_logprob", "first_token_kl", "evidence_attention")


def layer_summary(frame: pl.DataFrame) -> pl.DataFrame:
    """Per layer over the examples: the share correct (full marks), mean score, answer log-prob,
    first-token KL and evidence attention, each mean with its 95% interval (``rankkit.eval.stats.mean_intervals``:
    Wilson for the share correct, bootstrap otherwise, resampling clusters where examples share a haystack
    or a needle), and ``n_examples`` (and ``n_clusters``)."""
    from rankkit.eval.stats import cluster_column, mean_intervals

    summary = mean_intervals(  # which reads correct's booleans as 0/1: its mean is the share right
        frame.sort("layer", maintain_order=True),
        ["layer"],
        [name for name in DIFFUSION_MEANS if name in frame.columns],  # a frame may hold only some
        example="example",
        cluster=cluster_column(frame),  # none in frames written before the probe kept clusters
        scores=["correct", "score"],
    )
    return summary
