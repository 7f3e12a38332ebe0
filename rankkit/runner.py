"""Layer-by-layer prefill and greedy decode over an HF model's own modules.

The runner walks ``embed_tokens -> layers -> norm -> lm_head`` itself, so it can
prune the hidden states after any layer (the survivors keep their original position
ids for RoPE), compress any layer's KV cache to a per-head index set, and compute
logits only where they are needed. Attention goes through a function registered with
transformers' ``AttentionInterface``: it receives post-RoPE (and post-QK-norm) Q, K, V,
hands them to the hooks, then runs SDPA (flash-attn on CUDA when installed). No model
class is patched; the model's own attention implementation is set back after every
prefill and decode step, so ``model(...)`` and ``model.generate`` behave as before.

Families whose attention adds terms SDPA has no argument for run them exactly as their
eager attention does: Gemma 2/3 soft-cap the scaled logits (``softcap * tanh(x / softcap)``),
GPT-OSS adds one learned sink logit per query head to the softmax denominator. Gemma 3
rotates local and global layers with different RoPE bases (one embedding per layer
type); SmolLM3's NoPE layers skip RoPE inside the attention module itself. Under an
accelerate device map each layer runs on its own device and keeps its cache there.

Shapes: the batch is always 1. ``query`` is [1, q_heads, n, head_dim]; ``key`` and
``value`` are [1, kv_heads, S, head_dim] with S the cached plus new tokens.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
from collections import OrderedDict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from rankkit.cache import KVCache, StaticKVCache
from rankkit.errors import RankkitError

ATTENTION_NAME = "rankkit"
GLOBAL_ATTENTION = "full_attention"  # config.layer_types' name for a layer that sees every earlier key
SLIDING_ATTENTION = "sliding_attention"  # ... and for one that sees only the last ``sliding_window`` keys


# What a family's forward multiplies outside its layers, by model type and config attribute: the
# embeddings (Granite), and the logits, multiplied (Cohere) or divided (Granite). The runner applies
# them in the same operation, so its logits are the model's to the bit.
EMBEDDING_MULTIPLIER = {"granite": "embedding_multiplier"}
LOGITS_MULTIPLIER = {"cohere": "logit_scale", "cohere2": "logit_scale"}
LOGITS_DIVISOR = {"granite": "logits_scaling"}


def _family_term(config, terms: dict[str, str]) -> float | None:
    name = terms.get(config.model_type)
    return None if name is None else getattr(config, name)


def layer_types(config) -> tuple[str, ...] | None:
    """Each layer's attention type as the config names it ("full_attention", "sliding_attention",
    "chunked_attention") when some layer is local, else None (every layer sees the whole prompt).

    A config may name layer types without a window to apply (Qwen2 with ``use_sliding_window``
    off): every layer is then global.
    """
    text = config.get_text_config()
    kinds = getattr(text, "layer_types", None)
    has_window = any(getattr(text, name, None) for name in ("sliding_window", "attention_chunk_size"))
    if not kinds or not has_window or all(kind == GLOBAL_ATTENTION for kind in kinds):
        return None
    return tuple(kinds)


@dataclass
class AttentionCall:
    """What one layer's attention sees: the capture point probes and the oracle read."""

    layer: int
    phase: str  # "prefill" or "decode"
    query: torch.Tensor  # [1, q_heads, n, head_dim], post-RoPE
    key: torch.Tensor  # [1, kv_heads, S, head_dim], post-RoPE, cached + new
    value: torch.Tensor  # [1, kv_heads, S, head_dim]
    query_positions: torch.Tensor  # [n] original positions of the queries
    key_positions: torch.Tensor  # [kv_heads, S] original positions of the keys; -1 marks padding
    scaling: float
    softcap: float | None = None  # Gemma 2/3: logits become softcap * tanh(logits / softcap)
    sinks: torch.Tensor | None = None  # GPT-OSS: [q_heads] sink logits joining the softmax denominator
    sliding_window: int | None = None  # a local layer sees keys with position > query position - window
    sees_every_key: bool = False  # one query that may attend to every key (KVCache.sees_every_key): no mask
    # the keys are positions 0..S-1 in order, as the host knows them (a fresh prefill's before any pruning)
    keys_from_zero: bool = False
    # what several hooks derive from this call, computed once (``probes.attention.share_window``)
    shared: dict = field(default_factory=dict, repr=False, compare=False)
    # what hooks derive from positions that the layers of one forward step share (``per_step``)
    step_shared: dict = field(default_factory=dict, repr=False, compare=False)

    def per_step(self, name: str, sources: tuple[torch.Tensor, ...], params: tuple, make: Callable[[], Any]) -> Any:
        """``make()``, a value derived from ``sources`` (positions) and ``params`` alone, made once for
        the layers of one forward step that read the same ``sources``.

        The layers of a step mostly do (a prefill's fresh keys are its queries, a view of the step's
        positions), so the last value made under ``name`` is kept in ``step_shared`` with its sources
        and made again only where they change (after pruning, a compressed cache, a decode step).
        A kept source is held alive, so memory at its address is still its own; and a cache writes
        positions in place only into a layer's own tensor, before that layer attends, so a kept
        value never outlives the positions it came from.
        """
        if torch.compiler.is_compiling():  # a compiled step fuses what the memo saves, and cannot trace its test
            return make()
        kept = self.step_shared.get(name)
        if kept is not None and kept.params == params and all(map(_same_view, kept.sources, sources)):
            return kept.value
        value = make()
        self.step_shared[name] = _Derived(sources, params, value)
        return value

    @property
    def group_size(self) -> int:
        return self.query.shape[1] // self.key.shape[1]

    def unseen_keys(self) -> torch.Tensor | None:
        """Bool [kv_heads, S]: the keys a local layer's last query cannot attend to (None on a global layer)."""
        if self.sliding_window is None:
            return None
        return self.key_positions <= self.query_positions[-1] - self.sliding_window

    def first_seen_key(self) -> int | None:
        """How many of the oldest keys a local layer's last query cannot see, where the host knows it:
        0 on a global layer, max(0, S - window) where the keys are positions 0..S-1
        (``keys_from_zero``), so a method cuts them off without reading ``unseen_keys``; None where
        only the device knows."""
        if self.sliding_window is None:
            return 0
        return max(0, self.key.shape[2] - self.sliding_window) if self.keys_from_zero else None

    def cap(self, logits: torch.Tensor) -> torch.Tensor:
        """Scaled logits as the model's softmax sees them (soft-capped where the family caps)."""
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap

    def softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Softmax over the last axis of capped logits [kv_heads, group, ..., S], sinks included.

        A sink takes probability mass without being a key, so the probabilities over the
        keys sum to less than one, exactly as in the model's attention.
        """
        if self.sinks is None:
            return logits.softmax(dim=-1)
        sinks = self.sinks.float().reshape(logits.shape[0], logits.shape[1], *[1] * (logits.dim() - 2))
        normalizer = torch.logaddexp(torch.logsumexp(logits, dim=-1, keepdim=True), sinks.to(logits.device))
        return torch.exp(logits - normalizer)


@dataclass
class _Derived:
    sources: tuple[torch.Tensor, ...]
    params: tuple
    value: Any


def _same_view(kept: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether ``other`` reads the very elements ``kept`` does (``kept`` held alive)."""
    return (
        kept.device == other.device
        and kept.dtype == other.dtype
        and kept.data_ptr() == other.data_ptr()
        and kept.shape == other.shape
        and kept.stride() == other.stride()
    )


class LayerHook:
    """Base for everything that watches or steers a run; override what you need."""

    # Names the decode work of a hook a CUDA graph can replay (None: it cannot): at a decode step its
    # ``on_attention`` and ``after_decode_step`` launch device work of shapes fixed for the whole
    # decode and read nothing, whatever the step's position, and steer the cache only through what a
    # ``StaticKVCache`` does too (``evict`` of a layer that holds its size). Hooks of one name do the
    # same work: a graph captured with one replays for the others.
    replay_key: str | None = None
    # The layers after which the hook does host work in a decode step (``after_decode_layer``): a graphed
    # step is captured as one graph per stretch of layers between them, the host work run between
    # their replays.
    decode_breaks: tuple[int, ...] = ()

    def replayed_as(self, captured: LayerHook) -> None:
        """Called when a kept decode replays ``captured`` (a hook of this one's ``replay_key``) in this
        hook's place: a hook whose decode fills tensors takes ``captured``'s as its results."""

    def on_attention(self, call: AttentionCall) -> None:
        """Called inside every layer's attention, before the attention is computed."""

    def after_layer(self, layer: int, state: PrefillState) -> None:
        """Called during prefill after each decoder layer; may prune ``state`` or compress its cache."""

    def after_decode_layer(self, layer: int, cache: KVCache) -> None:
        """Called in a decode step right after each layer of ``decode_breaks``, before the next one, with
        the cache the step decodes over: host work that steers the later layers' entries (SlimInfer's
        Alg. 1), which may read what the step computed so far."""

    def after_decode_step(self, cache: KVCache, position: int) -> None:
        """Called after each decode step, when every layer holds the KV of the token at ``position``.

        May read or steer the cache in Python before the next step (SlimInfer's blocks), which a
        CUDA graph would not replay: a decode with such hooks runs eagerly, unless every hook has a
        ``replay_key`` (TOVA's eviction). A window that only rolls is the cache's own
        (``KVCache.keep_recent_window``), no hook.
        """


@dataclass
class PrefillState:
    """The live tokens between two layers of a prefill."""

    hidden: torch.Tensor  # [1, n, hidden]
    positions: torch.Tensor  # [n] original position ids of the live tokens
    cache: KVCache
    prompt_length: int
    position_embeddings: dict  # layer type (None for one shared RoPE) -> (cos, sin) [1, n, rotary_dim]
    stop: bool = False

    def prune(self, keep: torch.Tensor) -> None:
        """Keep only the live tokens at ascending indices ``keep`` (into the current live set) for later layers."""
        keep = keep.to(self.positions.device)
        self.hidden = self.hidden[:, keep.to(self.hidden.device)]
        self.positions = self.positions[keep]
        self.position_embeddings = {
            kind: (cos[:, keep.to(cos.device)], sin[:, keep.to(sin.device)])
            for kind, (cos, sin) in self.position_embeddings.items()
        }

    def stop_here(self) -> None:
        """End the layer loop after this layer (two-pass methods only need the first layers)."""
        self.stop = True


@dataclass
class PrefillResult:
    logits: torch.Tensor | None  # [vocab] at the last token, [n, vocab] for logits_at="all", or None
    cache: KVCache
    prompt_length: int
    live_tokens: list[int] = field(default_factory=list)  # hidden-state tokens entering each layer
    layers_run: int = 0


@dataclass
class Generation:
    tokens: list[int]
    prefill: PrefillResult


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _rankkit_attention)


def _rankkit_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    # the mask is the cache's (``_Step.attend``); dropout, in kwargs, is a training setting
    step = kwargs.get("rankkit_step")
    if step is None:
        raise RankkitError("rankkit's attention runs only inside Runner.prefill and decode_step")
    output = step.attend(
        module.layer_idx,
        query,
        key,
        value,
        scaling,
        kwargs.get("sliding_window"),
        kwargs.get("softcap"),
        kwargs.get("s_aux"),
    )
    return output, None


def _rotary_kinds(rotary_emb, config, num_layers: int) -> list:
    """Which rotary embedding each layer uses: its layer type when the family has one RoPE per type (Gemma 3)."""
    if "layer_type" in inspect.signature(rotary_emb.forward).parameters:
        return list(config.layer_types[:num_layers])
    return [None] * num_layers


def _flash_attn_func():
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


class _Step:
    """One forward step through all layers: carries positions, cache and hooks to the attention function."""

    def __init__(
        self, runner: Runner, phase: str, positions: torch.Tensor, cache: KVCache, hooks, keys_from_zero: bool
    ):
        self.runner = runner
        self.phase = phase
        self.positions = positions
        self.cache = cache
        self.hooks = hooks
        self.keys_from_zero = keys_from_zero  # AttentionCall.keys_from_zero, until a hook prunes
        self.shared: dict = {}  # AttentionCall.step_shared

    def attend(self, layer, query, key, value, scaling, sliding_window, softcap, sinks):
        key_positions = self.cache.positions[layer]
        positions = self.positions.to(key_positions.device) if self.runner.spread else self.positions
        eager = softcap is not None or sinks is not None  # terms SDPA cannot take
        if self.hooks or eager:  # not for a plain decode step, whose host time is its speed
            call = AttentionCall(
                layer,
                self.phase,
                query,
                key,
                value,
                positions,
                key_positions,
                scaling,
                softcap,
                sinks,
                sliding_window,
                self.cache.sees_every_key(layer, query.shape[2], sliding_window),
                self.keys_from_zero,
                step_shared=self.shared,
            )
            for hook in self.hooks:
                hook.on_attention(call)
        mask = self.cache.attention_mask(layer, positions, sliding_window)
        if eager:
            return eager_attention(call, mask)
        return self.runner.attention(query, key, value, mask, scaling)


# With CUDA graphs a static decode (its buffers and its captured step) is kept per cache shape, so
# methods timed in interleaved rounds each replay their own graph instead of capturing it again;
# the kept ones hold at most this share of the device's memory, the rest is the next prefill's.
STATIC_DECODES_SHARE = 0.25


def check_decode_options(cuda_graphs: bool, compile_decode: bool) -> None:
    """``compile_decode`` compiles the static decode step, which only ``cuda_graphs`` runs."""
    if compile_decode and not cuda_graphs:
        raise RankkitError("--compile-decode compiles the static-cache decode step: add --cuda-graphs")


DECODE_SPLIT = 256  # keys per split of a decode step (a static buffer grows in such steps too)
# From this many keys a masked decode step on CUDA splits them (docs/benchmarks.md, "split-threshold",
# 8 KV heads of 128): SDPA runs a masked step in one block per KV head. Replayed from a CUDA graph,
# where launches cost nothing, the split is faster from about 1.5k keys. An eager step is host-bound:
# the host launches a layer's operators in about a millisecond (an 8B shape, H200 run 4), which hides
# the masked kernel's device time up to about 64k keys (1.27 ms a layer there), while the split's
# launches add to the host's time at any length. An unmasked step (a dynamic cache) is left to SDPA's
# unmasked kernels, faster than its masked one: split at 32k and 64k it took 1.30x model.generate's.
SPLIT_DECODE_FROM = 65536
SPLIT_DECODE_FROM_IN_GRAPHS = 2048


def split_decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """One query per head over a cache, its keys split as flash-decoding splits them.

    ``query`` [1, kv_heads, group, d] (each KV head's query heads folded into the query axis),
    ``key``/``value`` [1, kv_heads, S, d], ``mask`` bool [1, kv_heads or 1, 1, S] (True = attend).
    SDPA's kernels parallelise over heads and query blocks: one block per KV
    head for a decode step, a few of a GPU's SMs reading the whole cache. Here the logits are
    one batched product over every key, the softmax is taken over the whole row, and the values
    are summed per split of ``DECODE_SPLIT`` keys, a batch of KV heads x splits, then over the
    splits (each split's share is already normalised, so the parts just add). Logits come out of
    the product in the model's dtype and the softmax runs in float32, as the families' eager code
    computes them. Returns [1, kv_heads, group, d].
    """
    logits = torch.matmul(query, key.mT).float().mul_(scaling).masked_fill_(~mask, float("-inf"))
    weights = logits.softmax(dim=-1).to(value.dtype)[0]
    kv_heads, group, keys = weights.shape
    whole = keys - keys % DECODE_SPLIT
    splits = whole // DECODE_SPLIT
    split_weights = weights[..., :whole].reshape(kv_heads, group, splits, DECODE_SPLIT).transpose(1, 2)
    split_values = value[0, :, :whole].reshape(kv_heads, splits, DECODE_SPLIT, value.shape[-1])
    out = torch.matmul(split_weights, split_values).float().sum(dim=1)
    if whole < keys:
        out += torch.matmul(weights[..., whole:], value[0, :, whole:]).float()
    return out[None].to(value.dtype)


def eager_attention(call: AttentionCall, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention with the terms SDPA cannot take (soft-capping, sinks), computed as the family's eager code does.

    ``mask`` as from ``KVCache.attention_mask``; None means causal over a fresh prefill
    (or all keys for one query). Returns [1, n, q_heads, head_dim].
    """
    kv_heads, groups, n = call.key.shape[1], call.group_size, call.query.shape[2]
    keys_length = call.key.shape[2]
    query = call.query[0].reshape(kv_heads, groups * n, -1)
    logits = torch.bmm(query, call.key[0].transpose(1, 2)).mul_(call.scaling).view(kv_heads, groups, n, -1)
    logits = call.cap(logits)
    if mask is None and n > 1:
        mask = torch.ones(n, keys_length, dtype=torch.bool, device=logits.device).tril(keys_length - n)
        mask = mask[None, None]
    if mask is not None:  # [1, kv_heads or 1, n, S]
        logits = logits.masked_fill(~mask[0][:, None], float("-inf"))
    weights = call.softmax(logits.float()).to(call.value.dtype)
    output = torch.matmul(weights.view(kv_heads, groups * n, -1), call.value[0])
    return output.view(kv_heads * groups, n, -1).transpose(0, 1)[None].contiguous()


class Runner:
    """Drives one model layer by layer. Build once per model; calls are independent.

    The model's attention implementation is switched to rankkit's only for the duration
    of each prefill and decode step (``_installed``), so a model shared with other code
    keeps behaving as loaded between and after runs.
    """

    def __init__(self, model, *, cuda_graphs: bool = False, compile_decode: bool = False):
        check_decode_options(cuda_graphs, compile_decode)
        _register_attention()
        self.model = model
        self.cuda_graphs = cuda_graphs
        # the static decode step compiled (torch.compile, inductor) before it is captured: the norms,
        # rotary embeddings, casts and cache writes a graph replays as separate kernels are fused
        self.compile_decode = compile_decode
        self._compiled_parts: dict[range, Callable] = {}  # ``static_part``
        # static decodes kept for their graphs, by cache shape, least recently used first
        self._static_decodes: OrderedDict[tuple, _StaticDecode] = OrderedDict()
        self._first_layers: dict[int, Runner] = {}  # ``first_layers``
        # Multimodal checkpoints (Gemma 3) keep the text decoder one level down; text-only use runs it alone.
        self.body = getattr(model.model, "language_model", model.model)
        self.config = self.body.config
        self.device = self.body.embed_tokens.weight.device
        # a device map may put each layer elsewhere: only then do the step's tensors follow the layers
        self._layer_devices = [next(layer.parameters()).device for layer in self.body.layers]
        self.spread = len(set(self._layer_devices)) > 1
        on_cuda = self.device.type == "cuda"
        self._flash = _flash_attn_func() if on_cuda else None
        # the keys from which a masked decode step is split, where SDPA would leave a GPU mostly idle,
        # eagerly and inside a captured graph; None: SDPA's kernels serve (CPU; a test lowers them to 0 there)
        self.split_decode_from = SPLIT_DECODE_FROM if on_cuda else None
        self.split_decode_from_in_graphs = SPLIT_DECODE_FROM_IN_GRAPHS if on_cuda else None
        self._capturing = False
        self._rotary_kinds = _rotary_kinds(self.body.rotary_emb, self.config, self.num_layers)
        self._embedding_multiplier = _family_term(self.config, EMBEDDING_MULTIPLIER)
        self._logits_multiplier = _family_term(self.config, LOGITS_MULTIPLIER)
        self._logits_divisor = _family_term(self.config, LOGITS_DIVISOR)

    def static_part(self, part: range) -> Callable:
        """What a static decode runs for the layers ``part`` of each step (``decode_parts``):
        ``_decode_part``, or its compiled form (made once per runner and part: a cache of another shape
        recompiles it, with dynamic lengths from the second on)."""
        step = functools.partial(self._decode_part, part)
        if not self.compile_decode:
            return step
        if part not in self._compiled_parts:
            self._compiled_parts[part] = functools.partial(_run_outside_dispatch_modes, torch.compile(step))
        return self._compiled_parts[part]

    @contextmanager
    def capturing(self):
        """While a decode step is captured as a CUDA graph: the step's attention is chosen for replay."""
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    @contextmanager
    def _installed(self):
        previous = self.model.config._attn_implementation
        self.model.config._attn_implementation = ATTENTION_NAME
        try:
            yield
        finally:
            self.model.config._attn_implementation = previous

    def first_layers(self, count: int) -> Runner:
        """This model cut after its first ``count`` layers, its final norm and LM head (modules and weights
        shared; made once per count). It compiles its own decode step and keeps its static decodes
        with this runner's, under one share of the device's memory."""
        if count not in self._first_layers:
            cut = copy.copy(self)
            cut.body = copy.copy(self.body)
            cut.body._modules = {**self.body._modules, "layers": self.body.layers[:count]}
            cut._compiled_parts = {}  # this runner's would run every layer
            cut._first_layers = {}
            self._first_layers[count] = cut
        return self._first_layers[count]

    @property
    def num_layers(self) -> int:
        return len(self.body.layers)

    @property
    def layer_types(self) -> tuple[str, ...] | None:
        """Each layer's attention type when the model has local layers, else None (``layer_types``)."""
        return layer_types(self.config)

    def roll_local_layers(self, result: PrefillResult) -> None:
        """Leave each local (sliding-window) layer of ``result``'s cache holding at most its window's
        count of its last entries, rolled in decoding (``KVCache.roll_local_layer``), where the prefill
        left the layer in position order with no padding and no decode rule of its own (a window, a held
        size): full prefill's layers, those a pruned prefill left whole, a per-head cut's.

        Those are the keys the window saw at the prompt's last token where the layer holds every
        prompt position or a per-head cut (which keeps only keys it sees); a pruned prefill's layer
        keeps its last kept tokens, as transformers' sliding-window cache keeps the last ones it is
        given, and masks those older than the window as before. The host knows every count: nothing
        is read.
        """
        kinds = self.layer_types
        window = getattr(self.config.get_text_config(), "sliding_window", None)
        if kinds is None or window is None:
            return
        cache = result.cache
        for layer in range(cache.num_layers):
            rolls = kinds[layer] == SLIDING_ATTENTION and not (
                cache.keys[layer] is None or cache.padded[layer] or layer in cache.windows or layer in cache.held
            )
            if rolls:
                cache.roll_local_layer(layer, window)

    def attention(self, query, key, value, mask, scaling):
        """SDPA over GQA heads; ``mask`` None means plain causal (or all keys for one query).

        Returns [1, n, q_heads, head_dim], the layout the attention modules expect.
        """
        kv_heads, groups = key.shape[1], query.shape[1] // key.shape[1]
        n = query.shape[2]
        causal = mask is None and n > 1
        if self._flash is not None and mask is None and query.dtype in (torch.float16, torch.bfloat16):
            return self._flash(
                query.transpose(1, 2),
                key.transpose(1, 2),
                value.transpose(1, 2),
                softmax_scale=scaling,
                causal=causal,
            )
        if causal and n != key.shape[2]:
            raise ValueError("causal attention over a cache needs an explicit mask")
        if n == 1:
            # One query per head: fold each KV group's query heads into the query axis,
            # so keys and values are read once per KV head and never repeated.
            folded = query.reshape(1, kv_heads, groups, query.shape[-1])
            split_from = self.split_decode_from_in_graphs if self._capturing else self.split_decode_from
            if mask is not None and split_from is not None and key.shape[2] >= split_from:
                out = split_decode_attention(folded, key, value, mask, scaling)
            else:
                out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
            return out.reshape(1, 1, query.shape[1], -1)  # the heads in order: kv_heads x group
        if mask is not None and mask.shape[1] > 1:
            mask = mask.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=groups > 1
        )
        return out.transpose(1, 2).contiguous()

    def _layers(
        self,
        state: PrefillState | None,
        hidden,
        positions,
        cache,
        hooks,
        phase,
        position_embeddings,
        part=None,
        keys_from_zero: bool = False,
    ):
        """Run the layers of ``part`` (default: all); the first layer's step begins the cache's.
        ``keys_from_zero``: a fresh cache and ``positions`` 0..n-1 (``AttentionCall.keys_from_zero``)."""
        part = range(self.num_layers) if part is None else part
        step = _Step(self, phase, positions, cache, hooks, keys_from_zero)
        if part.start == 0:
            cache.begin_step(positions)
        live = []
        position_ids = positions[None]  # made once a step, not per layer: a decode step is host-bound
        for index, layer in enumerate(self.body.layers[part.start : part.stop], part.start):
            live.append(hidden.shape[1])
            rotary = position_embeddings[self._rotary_kinds[index]]  # (cos, sin)
            if self.spread:  # each call, even to the device a tensor is on, costs the host a dispatch
                device = self._layer_devices[index]
                hidden, rotary = hidden.to(device), tuple(half.to(device) for half in rotary)
            hidden = layer(
                hidden,
                attention_mask=None,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
                position_embeddings=rotary,
                rankkit_step=step,
            )
            if state is None:
                continue
            state.hidden = hidden
            for hook in hooks:
                hook.after_layer(index, state)
            hidden, positions, position_embeddings = state.hidden, state.positions, state.position_embeddings
            if positions is not step.positions:  # a hook pruned; comparing values would sync per layer
                step.positions, step.keys_from_zero = positions, False
                position_ids = positions[None]
                cache.begin_step(positions)
            if state.stop:
                break
        return hidden, live

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input [1, n, hidden], scaled where the family scales it (``EMBEDDING_MULTIPLIER``)."""
        hidden = self.body.embed_tokens(input_ids)
        return hidden if self._embedding_multiplier is None else hidden * self._embedding_multiplier

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits, scaled (``LOGITS_MULTIPLIER``, ``LOGITS_DIVISOR``) and soft-capped (Gemma 2/3
        ``final_logit_softcapping``) where the family does."""
        head = self.model.lm_head
        logits = head(self.body.norm(hidden.to(self.body.norm.weight.device)).to(head.weight.device))
        if self._logits_multiplier is not None:
            logits = logits * self._logits_multiplier
        if self._logits_divisor is not None:
            logits = logits / self._logits_divisor
        softcap = getattr(self.config, "final_logit_softcapping", None)
        return logits if softcap is None else torch.tanh(logits / softcap) * softcap

    def _rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict:
        kinds = set(self._rotary_kinds)
        if kinds == {None}:
            return {None: self.body.rotary_emb(hidden, position_ids=positions[None])}
        return {kind: self.body.rotary_emb(hidden, positions[None], kind) for kind in kinds}

    @torch.inference_mode()
    def prefill(
        self,
        input_ids: torch.Tensor,
        *,
        hooks=(),
        positions: torch.Tensor | None = None,
        prompt_length: int | None = None,
        logits_at: str | None = "last",
        cache: KVCache | None = None,
    ) -> PrefillResult:
        """Run the prompt through every layer (or until a hook stops it).

        ``positions`` gives original position ids when re-prefilling a selected subset
        (two-pass methods); by default they are 0..T-1. ``prompt_length`` (where decoding
        continues) is then the whole prompt's, which the caller knows; without it the last
        position is read from the device.
        """
        input_ids = input_ids.reshape(-1).to(self.device)
        keys_from_zero = positions is None and cache is None
        if positions is None:
            positions, prompt_length = torch.arange(input_ids.shape[0], device=self.device), input_ids.shape[0]
        else:
            positions = positions.to(self.device)
            prompt_length = int(positions.max()) + 1 if prompt_length is None else prompt_length
        cache = cache if cache is not None else KVCache(self.num_layers)
        with self._installed():
            hidden = self.embed(input_ids[None])
            embeddings = self._rotary(hidden, positions)
            state = PrefillState(hidden, positions, cache, prompt_length, embeddings)
            hidden, live = self._layers(
                state, hidden, positions, cache, hooks, "prefill", embeddings, keys_from_zero=keys_from_zero
            )
        logits = None
        if logits_at == "last":
            logits = self.logits(hidden[:, -1:])[0, -1]
        elif logits_at == "all":
            logits = self.logits(hidden)[0]
        return PrefillResult(logits, cache, prompt_length, live, len(live))

    @torch.inference_mode()
    def decode_step(self, token: int | torch.Tensor, position: int, cache: KVCache, hooks=()) -> torch.Tensor:
        """One new token at ``position`` (continuing from the prompt length); returns its logits [vocab].

        ``token`` may be a tensor on the device (the greedy loop's argmax), so that feeding it
        back needs no copy from the host. Every hook's ``after_decode_step`` runs once the step
        has passed all layers.
        """
        token_ids = torch.as_tensor(token, device=self.device).reshape(1, 1)
        # an arange is made on the device; a tensor of host values would be copied and wait for it
        positions = torch.arange(position, position + 1, device=self.device)
        logits = self._decode(token_ids, positions, cache, hooks)
        for hook in hooks:
            hook.after_decode_step(cache, position)
        return logits

    def _decode(
        self, token_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, hooks
    ) -> torch.Tensor:
        carried = token_ids
        for part in self.decode_parts(hooks):
            carried = self._decode_part(part, carried, positions, cache, hooks)
            after_decode_part(part, cache, hooks)
        return carried

    def decode_parts(self, hooks) -> list[range]:
        """A decode step's stretches of layers, cut after each layer of the hooks' ``decode_breaks``."""
        cuts = sorted({layer + 1 for hook in hooks for layer in hook.decode_breaks} - {self.num_layers})
        bounds = [0, *cuts, self.num_layers]
        return [range(start, stop) for start, stop in itertools.pairwise(bounds)]

    def _decode_part(
        self, part: range, carried: torch.Tensor, positions: torch.Tensor, cache: KVCache, hooks
    ) -> torch.Tensor:
        """The layers ``part`` of a decode step: from the token ids [1, 1] at the first layer, else from
        the hidden state the part before returned; to the logits [vocab] after the last layer, else to
        the hidden state."""
        hidden = self.embed(carried) if part.start == 0 else carried
        with self._installed():
            hidden, _ = self._layers(
                None, hidden, positions, cache, hooks, "decode", self._rotary(hidden, positions), part
            )
        return self.logits(hidden)[0, -1] if part.stop == self.num_layers else hidden

    @torch.inference_mode()
    def decoder(self, prefill: PrefillResult, steps: int, hooks=()):
        """``step(token, position) -> logits`` continuing ``prefill`` for up to ``steps`` steps.

        With ``cuda_graphs``, the steps run over a ``StaticKVCache`` copied from the prefill's
        cache: captured once as a CUDA graph per cache shape (kept for the next decode of the
        same shape while ``STATIC_DECODES_SHARE`` allows; rolling windows are data in the cache,
        not a shape) and replayed on CUDA, run eagerly elsewhere; the prefill's own cache is then
        left as the prefill made it. Decode hooks read or steer a step in Python, which a graph
        would not replay: with any that ``replays`` refuses, the decode runs eagerly. A static
        decode is kept by its hooks' ``replay_key`` too, and runs the device work of the hooks it was
        made with, the host work (``LayerHook.after_decode_layer``) of the decode's own.
        """
        key = self._static_key(prefill, steps, hooks)
        if key is None:
            return lambda token, position: self.decode_step(token, position, prefill.cache, hooks)
        decode = self._static_decodes.pop(key, None)
        if decode is not None:
            decode.reuse(prefill.cache, hooks)
        else:
            self._make_room(StaticKVCache.buffer_bytes(key.shape))
            decode = _StaticDecode(self, StaticKVCache(prefill.cache, steps), tuple(hooks), key)
        self._static_decodes[key] = decode
        return decode

    @staticmethod
    def replays(hooks) -> bool:
        """Whether a CUDA graph can replay a decode step with ``hooks`` (``LayerHook.replay_key``)."""
        return all(hook.replay_key is not None for hook in hooks)

    def kept_static_uses(self) -> dict[_StaticDecode, int]:
        """The static decodes kept now (a self-draft's too: ``first_layers`` shares them), each with the
        times it was reused: what ``reused_static_bytes`` compares with later."""
        return {decode: decode.reuses for decode in self._static_decodes.values()}

    @staticmethod
    def reused_static_bytes(kept: dict[_StaticDecode, int]) -> int:
        """Bytes of the decodes of ``kept`` (``kept_static_uses``, taken before a run) that the run reused:
        allocated before it, yet its memory all the same."""
        return sum(StaticKVCache.buffer_bytes(decode.key.shape) for decode, reuses in kept.items() if decode.reuses > reuses)

    def _static_key(self, prefill: PrefillResult, steps: int, hooks) -> _StaticKey | None:
        """What a static decode of ``prefill`` is kept and found by; None when the decode runs eagerly."""
        if not self.cuda_graphs or not steps or not self.replays(hooks):
            return None
        return _StaticKey(StaticKVCache.shape_of(prefill.cache, steps), tuple(hook.replay_key for hook in hooks))

    def _make_room(self, needed: int) -> None:
        """Drop the least recently used static decodes until, with ``needed`` more bytes, the kept ones
        hold at most ``STATIC_DECODES_SHARE`` of the device's memory (elsewhere: none but the newest)."""
        share = self._static_decodes_bytes()
        held = sum(StaticKVCache.buffer_bytes(key.shape) for key in self._static_decodes)
        while self._static_decodes and held + needed > share:
            key, _ = self._static_decodes.popitem(last=False)
            held -= StaticKVCache.buffer_bytes(key.shape)

    def _static_decodes_bytes(self) -> float:
        if self.device.type != "cuda":
            return 0  # the steps run eagerly: a kept buffer would buy nothing
        return STATIC_DECODES_SHARE * torch.cuda.get_device_properties(self.device).total_memory

    def eos_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.config.eos_token_id
        if eos is None:
            return set()
        return {eos} if isinstance(eos, int) else set(eos)

    @torch.inference_mode()
    def generate(
        self, input_ids: torch.Tensor, max_new_tokens: int, *, hooks=(), decode_hooks=None
    ) -> Generation:
        """Greedy generation: prefill with ``hooks``, then decode with ``decode_hooks`` (default: the same)."""
        prefill = self.prefill(input_ids, hooks=hooks)
        tokens = greedy_continue(
            self, prefill, max_new_tokens, hooks if decode_hooks is None else decode_hooks
        )
        return Generation(tokens, prefill)


def greedy_continue(
    runner: Runner,
    prefill: PrefillResult,
    max_new_tokens: int,
    hooks=(),
    *,
    on_token=lambda token: None,
    feed_last: bool = False,
    stop_at_eos: bool = True,
) -> list[int]:
    """Greedy tokens after a prefill; stops at EOS (kept in the output) or after ``max_new_tokens``.

    The one greedy loop (bench, oracle and SpecPrefill's lookahead run through it); each
    step is ``Runner.decoder``'s (``decode_step`` with ``hooks``, or a static-cache step);
    ``on_token`` sees each token as soon as it is chosen (timing). ``feed_last`` also feeds
    back the last token unless it is EOS, so hooks see the query of every answer token (the
    oracle and SpecPrefill score with it). ``stop_at_eos`` off decodes ``max_new_tokens``
    whatever comes (timing against ``model.generate(min_new_tokens=...)``). The chosen token
    goes back to the model as a device tensor; reading it for the EOS check is the step's one
    wait for the device, as in ``model.generate``.
    """
    eos = runner.eos_ids() if stop_at_eos else set()
    step = None  # made at the first step: a static cache's copy counts in decoding, not in TTFT
    tokens: list[int] = []
    logits = prefill.logits
    position = prefill.prompt_length
    while len(tokens) < max_new_tokens:
        chosen = torch.argmax(logits)
        token = int(chosen)
        on_token(token)
        tokens.append(token)
        last = token in eos or len(tokens) == max_new_tokens
        if last and (token in eos or not feed_last):
            return tokens
        if step is None:
            step = runner.decoder(prefill, max_new_tokens, hooks)
        logits = step(chosen, position)
        position += 1
        if last:
            break
    return tokens


class _StaticKey(NamedTuple):
    shape: tuple  # StaticKVCache.shape_of
    hooks: tuple[str, ...]  # the decode hooks' replay keys


class _StaticDecode:
    """Decode steps over a ``StaticKVCache`` from fixed input buffers (token, position), with ``hooks``
    whose decode work a graph replays (``LayerHook.replay_key``).

    On CUDA the first step runs eagerly (the warm-up a capture needs, making the same choices
    as the capture, so a compiled step is compiled then), the second is captured as one graph
    per part (``Runner.decode_parts``: one, unless a hook does host work between layers), and
    every later step, of this decode or the next one of the same cache shape, replays them:
    one launch per part and token instead of one per kernel. Elsewhere every step runs the same
    code eagerly, which is what a CPU test compares with the dynamic cache.
    """

    def __init__(self, runner: Runner, cache: StaticKVCache, hooks: tuple, key: _StaticKey):
        self.runner = runner
        self.cache = cache
        self.hooks = hooks  # whose device work the step runs (a graph replays it)
        self.current = hooks  # the decode's own hooks, whose host work runs between the parts
        self.key = key  # what ``Runner`` keeps it by
        self.reuses = 0  # decodes after the first that ran it
        self.token = torch.zeros((1, 1), dtype=torch.long, device=runner.device)
        self.position = torch.zeros(1, dtype=torch.long, device=runner.device)
        self.parts = runner.decode_parts(hooks)
        self.graphed = runner.device.type == "cuda"
        self.warmed = False
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.outputs: list[torch.Tensor] = []  # each part's graph's output: the next one's input, the logits

    @torch.inference_mode()
    def __call__(self, token: torch.Tensor, position: int) -> torch.Tensor:
        self.token.copy_(token.reshape(1, 1))
        self.position.fill_(position)
        if not self.graphed:
            return self._step(position)
        if not self.warmed:
            self.warmed = True
            with self.runner.capturing():
                return self._step(position)
        if not self.graphs:
            self._capture(position)
        for part, graph in zip(self.parts, self.graphs, strict=True):
            graph.replay()
            after_decode_part(part, self.cache, self.current)
        return self.outputs[-1]

    def _capture(self, position: int) -> None:
        """Capture each part as a graph, reading the one before's output (a capture runs nothing). They
        share one memory pool, which graphs replayed in the order they were captured may."""
        carried = self.token
        for index in range(len(self.parts)):
            graph = torch.cuda.CUDAGraph()
            pool = self.graphs[0].pool() if self.graphs else None
            with torch.cuda.graph(graph, pool=pool), self.runner.capturing():
                carried = self._part(index, carried, position)
            self.graphs.append(graph)
            self.outputs.append(carried)

    def reuse(self, cache: KVCache, hooks) -> None:
        """Decode from ``cache`` next, for ``hooks`` of the same replay keys as this decode's: each takes
        over the results of the hook it replays (``LayerHook.replayed_as``)."""
        self.reuses += 1
        self.current = tuple(hooks)
        self.cache.load(cache)
        for hook, captured in zip(hooks, self.hooks, strict=True):
            if hook is not captured:
                hook.replayed_as(captured)

    def _step(self, position: int) -> torch.Tensor:
        carried = self.token
        for index, part in enumerate(self.parts):
            carried = self._part(index, carried, position)
            after_decode_part(part, self.cache, self.current)
        return carried

    def _part(self, index: int, carried: torch.Tensor, position: int) -> torch.Tensor:
        """One part of the step over the static cache; the last ends with the hooks' ``after_decode_step``."""
        part = self.parts[index]
        carried = self.runner.static_part(part)(carried, self.position, self.cache, self.hooks)
        if part.stop == self.runner.num_layers:
            for hook in self.hooks:
                hook.after_decode_step(self.cache, position)
        return carried


def _run_outside_dispatch_modes(compiled: Callable, *args):
    """``compiled(*args)`` with the active Python dispatch modes set aside. torch.compile first called
    under one (CPU peak memory's ``TensorMemoryTracker`` in a bench's first warm-up, an operator count)
    runs the step eagerly and never compiles that code again: every later step ran eagerly. The modes
    miss the compiled step's own temporaries, one token's activations and logits."""
    with _disable_current_modes():
        return compiled(*args)


def after_decode_part(part: range, cache: KVCache, hooks) -> None:
    """The hooks' host work after the last layer of ``part`` (``LayerHook.decode_breaks``)."""
    for hook in hooks:
        if part[-1] in hook.decode_breaks:
            hook.after_decode_layer(part[-1], cache)
