"""The Answer-Informed Oracle: ground-truth token importance from the answer's attention to the prompt.

CLAA Sec. 3.1, Alg. 1 and Appendix D.4 Listing 4 (``get_oracle_ranking``):
prefill the prompt once and keep its keys; generate the answer greedily; score every
prompt token by the raw (pre-softmax) attention logits q·k·scaling of the answer queries
against the prompt keys; take the maximum over layers and heads (MAXAGG), the mean over
answer tokens (MEANAGG), and smooth with 1-D average pooling (POOL1D, kernel 7).

Which queries are "answer queries". Algorithm 1 and Listing 4 differ by one position:
Algorithm 1 stores the last query of ``MODELFORWARD(prompt ⊕ generated)`` before each new
token, i.e. the query that *produces* each answer token (starting with the last prompt
token's); Listing 4 feeds each generated token back (``model.forward(next_token, past_kv)``)
and stores *its* query, and never feeds EOS. We follow Listing 4, the paper's code: the
answer is the greedy tokens up to (not including) EOS, at most ``max_new_tokens`` of them,
and each answer token contributes the query it has when fed back. Every query is thus a
decode-phase query, the prefill serves only the prompt keys, and the last prompt token's
query (a prompt query, which heuristics such as GemFilter already use) is not counted.
Generating N tokens therefore costs one decode step more than plain greedy generation
(which never feeds its last token back).

The scores are reduced on the fly by a decode-phase hook (running max over layers, running
sum over answer tokens), so memory stays O(layers x T) and no query is stored.

The logits are the ones the model computes: soft-capped where the family caps them (Gemma
2/3), and with ``softmax=True`` normalized with the family's attention sinks (GPT-OSS).
A key outside a sliding-window layer's reach from an answer query has no logit there: it
is left out of that layer's mean over answer tokens and out of the maximum over layers,
and a key that no layer could see from any answer query scores NaN (so do the layer
scores of keys a local layer never saw). Pooling averages the neighbours that have a score.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rankkit import defaults
from rankkit.errors import RankkitError
from rankkit.pooling import check_pooling, pool_tokens
from rankkit.runner import AttentionCall, LayerHook, PrefillResult, Runner, greedy_continue
from rankkit.values import check_count, check_flag

ANSWER_MODES = ("generated", "reference")


class EmptyAnswer(RankkitError):
    """An example's answer has no token to rank the prompt by; other examples still have theirs."""


@dataclass
class OracleResult:
    scores: np.ndarray  # float32 [T], pooled
    layer_scores: np.ndarray  # float32 [layers, T]: max over heads, mean over answer tokens, pooled
    answer_tokens: list[int]  # the tokens whose queries were counted (EOS excluded)
    answer_text: str
    params: dict  # answer mode, softmax, kernel, max_new_tokens
    ended_with_eos: bool = False  # a generated answer stopped at EOS rather than at max_new_tokens


class AnswerAttention(LayerHook):
    """Accumulates, for every decode-phase query, its attention logits against the first T keys.

    Per layer: max over query heads -> running sum over answer tokens (``layer_sums``) and
    running max over layers; after the last layer that max joins ``sums`` (MAXAGG over
    layers and heads, summed for MEANAGG). Every sum stays on the device of the keys (all
    heads of a layer in one product), so an answer token's layers read nothing back; the
    caller copies the result to the host once.
    """

    _RESULTS = ("layer_sums", "layer_counts", "sums", "counts", "token_maxima")

    def __init__(
        self, num_layers: int, prompt_length: int, *, softmax: bool = False, per_token_steps: int = 0
    ):
        self.num_layers = num_layers
        self.prompt_length = prompt_length
        self.softmax = softmax
        self.layer_sums = torch.zeros(num_layers, prompt_length)
        self.layer_counts = torch.zeros(num_layers, prompt_length)  # answer queries that saw each key
        self.sums = torch.zeros(prompt_length)
        self.counts = torch.zeros(prompt_length)
        # row s: the max over layers and heads of the query fed back at decode step s (the first
        # ``per_token_steps``); a row indexed on the device, so a graph's replay writes the step's own
        self.token_maxima = torch.zeros(per_token_steps, prompt_length)
        self._step_max: torch.Tensor | None = None

    @property
    def replay_key(self) -> str:
        """Every buffer is fixed for the decode and every step's work device work, so a graph replays it;
        hooks of one key share the buffers' shapes (``replayed_as``)."""
        steps = self.token_maxima.shape[0]
        return f"answer-attention:{self.num_layers}x{self.prompt_length}:softmax={self.softmax}:rows={steps}"

    def replayed_as(self, captured: AnswerAttention) -> None:
        """A kept graph replays ``captured``: its buffers, emptied, are this hook's results from now on."""
        for name in self._RESULTS:
            setattr(self, name, getattr(captured, name).zero_())

    def on_attention(self, call: AttentionCall) -> None:
        if call.phase != "decode":
            return
        head_max = self.head_max(call)  # NaN where this layer cannot see the key
        if self.sums.device != head_max.device:  # the first query: the sums move to the keys' device
            for name in self._RESULTS:
                setattr(self, name, getattr(self, name).to(head_max.device))
        seen = ~head_max.isnan()
        self.layer_sums[call.layer] += head_max.nan_to_num()  # an unseen key adds 0
        self.layer_counts[call.layer] += seen
        # fmax skips NaN, so a key keeps the maximum over the layers that saw it
        self._step_max = head_max if call.layer == 0 else torch.fmax(self._step_max, head_max)
        if call.layer == self.num_layers - 1:
            self.sums += self._step_max.nan_to_num()
            self.counts += ~self._step_max.isnan()
            if self.token_maxima.shape[0]:
                step = (call.query_positions[-1:] - self.prompt_length).to(self.token_maxima.device)
                self.token_maxima.index_copy_(0, step, self._step_max[None])

    @property
    def mean(self) -> torch.Tensor:
        """[T] MEANAGG over the answer queries of the layer maximum; NaN for keys no layer saw."""
        return self.sums / self.counts

    @property
    def layer_mean(self) -> torch.Tensor:
        """[layers, T] mean over the answer queries per layer; NaN where a local layer never saw the key."""
        return self.layer_sums / self.layer_counts

    def head_max(self, call: AttentionCall) -> torch.Tensor:
        """[T] max over query heads of one decode query's capped logits (or softmax) over the prompt keys.

        NaN for prompt keys outside the layer's sliding window.
        """
        kv_heads, groups = call.key.shape[1], call.group_size
        query = call.query[0, :, -1].float().reshape(kv_heads, groups, -1) * call.scaling
        keys = call.key[0, :, : self.prompt_length].float()
        logits = call.cap(torch.matmul(query, keys.transpose(1, 2)))  # [kv_heads, groups, T]
        unseen = None
        if call.sliding_window is not None:
            unseen = (
                call.key_positions[0, : self.prompt_length] <= call.query_positions[-1] - call.sliding_window
            )
            logits = logits.masked_fill(unseen, float("-inf"))
        if self.softmax:  # over the prompt keys, as COMPUTEATTN(Q_gen, K_prompt) sees them
            logits = call.softmax(logits)
        head_max = logits.reshape(kv_heads * groups, -1).amax(dim=0)
        if unseen is not None:
            head_max = head_max.masked_fill(unseen, float("nan"))
        return head_max


def oracle_params(answer: str, softmax: bool, kernel: int, max_new_tokens: int) -> dict:
    """The settings that define an oracle, checked; a store records them with each oracle, and
    oracles made with other settings never mix in one store (``max_new_tokens`` counts only for
    a generated answer)."""
    if answer not in ANSWER_MODES:
        raise RankkitError(f"--answer must be one of {', '.join(ANSWER_MODES)}, got {answer!r}")
    check_flag(softmax, "--softmax")
    check_pooling("avg", kernel, "--kernel")
    check_count(max_new_tokens, "--max-new-tokens")  # checked for any answer, as the command line does
    return {
        "answer": answer,
        "softmax": softmax,
        "kernel": kernel,
        "max_new_tokens": max_new_tokens if answer == "generated" else None,
    }


def fork_prefill(prefill: PrefillResult) -> PrefillResult:
    """The same prefill with a forked cache, so several continuations can start from it."""
    return dataclasses.replace(prefill, cache=prefill.cache.fork())


def teacher_force(runner: Runner, prefill: PrefillResult, tokens: Sequence[int], hooks=()) -> torch.Tensor:
    """Feed ``tokens`` one by one after ``prefill`` (growing its cache); logits after each [len, vocab]."""
    logits = [
        runner.decode_step(int(token), prefill.prompt_length + offset, prefill.cache, hooks)
        for offset, token in enumerate(tokens)
    ]
    return torch.stack(logits) if logits else torch.empty(0, runner.config.vocab_size, device=runner.device)


def tokenize_answer(tokenizer, answer: str) -> list[int]:
    """The answer's token ids as they continue a prompt: no BOS or other special tokens."""
    ids = list(tokenizer(answer, add_special_tokens=False)["input_ids"])
    if not ids:
        raise EmptyAnswer("the reference answer is empty: nothing to rank the prompt by")
    return ids


def _check_full_prefill(prefill: PrefillResult, prompt_length: int) -> None:
    for layer, positions in enumerate(prefill.cache.positions):
        if positions is None or prefill.cache.padded[layer] or positions.shape[1] != prompt_length:
            raise RankkitError(
                f"the oracle needs a full prefill of all {prompt_length} prompt tokens; layer {layer} "
                "was pruned or compressed"
            )


def answer_informed_oracle(
    runner: Runner,
    input_ids: torch.Tensor,
    *,
    tokenizer,
    max_new_tokens: int = defaults.MAX_NEW_TOKENS,
    answer: str = "generated",
    reference_answer: str | None = None,
    softmax: bool = False,
    kernel: int = defaults.ORACLE_KERNEL,
    prefill: PrefillResult | None = None,
) -> OracleResult:
    """CLAA Algorithm 1 / Listing 4 ``get_oracle_ranking`` on one prompt (see the module docstring).

    ``answer="generated"`` ranks by the model's own greedy answer (EOS or
    ``max_new_tokens``); ``answer="reference"`` teacher-forces ``reference_answer``
    (tokenized as is, so include a leading space when it continues an answer prefix)
    and gives the ranking a correct answer induces. ``softmax=True`` scores with the
    softmax of the logits over the prompt keys instead of the raw logits.

    ``prefill`` reuses a full, unpruned prefill of ``input_ids`` (e.g. the capture pass
    that ran the probes); it is forked, never grown, so it stays reusable afterwards.
    """
    params = oracle_params(answer, softmax, kernel, max_new_tokens)
    if answer == "reference" and reference_answer is None:
        raise RankkitError("answer='reference' needs reference_answer")
    prompt_length = int(input_ids.numel())
    if prefill is None:
        prefill = runner.prefill(input_ids)
    _check_full_prefill(prefill, prompt_length)
    prefill = fork_prefill(prefill)
    attention = AnswerAttention(runner.num_layers, prompt_length, softmax=softmax)

    ended_with_eos = False
    if answer == "reference":
        answer_tokens = tokenize_answer(tokenizer, reference_answer)
        teacher_force(runner, prefill, answer_tokens, [attention])
    else:
        generated = greedy_continue(runner, prefill, max_new_tokens, [attention], feed_last=True)
        ended_with_eos = generated[-1] in runner.eos_ids()
        answer_tokens = generated[:-1] if ended_with_eos else generated
        if not answer_tokens:
            raise EmptyAnswer("the model answered with EOS at once: there are no answer tokens to rank by")

    scores = pool_tokens(attention.mean, "avg", kernel)
    layer_scores = pool_tokens(attention.layer_mean, "avg", kernel)
    return OracleResult(
        scores=scores.cpu().numpy().astype(np.float32),
        layer_scores=layer_scores.cpu().numpy().astype(np.float32),
        answer_tokens=answer_tokens,
        answer_text=tokenizer.decode(answer_tokens, skip_special_tokens=True),
        params=params,
        ended_with_eos=ended_with_eos,
    )
