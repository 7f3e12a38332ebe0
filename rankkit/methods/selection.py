"""Selection machinery every method composes: top-k with forced tokens, layer policies, one hook.

A method = probe x layer policy x selection mode. The probe scores keys per KV head at
a layer; a ``LayerPolicy`` decides at which layer the shared selection happens and from
which (aggregated) scores; ``SelectionHook`` carries out the mode during prefill:

- before the selection layer it can compress each layer's KV cache per head to the
  budget (SnapKV-style, CLAA Eq. 4), from layer ``compress_from`` on;
- at the selection layer it either prunes the hidden states to the selected tokens
  (one-pass: FastKV, CLAA, ASL), or stops the pass (the first pass of a two-pass method:
  GemFilter, ASL-2pass). A one-pass method that compresses per head there keeps that
  layer's own per-head top tokens in its cache, as every layer before it (CLAA Listing
  2 and Listing 5, ASL Alg. 1); otherwise the cache keeps the selected tokens;
- after it, later layers only ever see the kept tokens, so their cache is the selection.

The observation window (the last ``window`` prompt tokens) and sinks are always kept,
except on a local (sliding-window) layer: its cache keeps only keys its last query can
attend to, forced or not, and the budget goes to those (``top_k_seen``).

``PolicyMethod`` is the base of every method built this way. It gives both faces from
the same parts: ``prefill`` runs the hook, and ``select_offline`` replays the policy
over a store's captured scores. The replay sees what the hook sees: before the
selection layer every token goes through every layer (compression only touches the
cache), so the stored full-prompt scores are the scores the policy gets online.

One rule for ranks everywhere: descending score, ties to the earlier token
(``descending_order``); a kept set is the top of that order with the forced tokens
ranked first (``top_k_with_forced``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from rankkit.errors import RankkitError
from rankkit.methods.base import (
    Budget,
    Method,
    MethodPrefill,
    Pass,
    Selection,
    full_prefill,
    reprefill_selected,
)
from rankkit.runner import SLIDING_ATTENTION, AttentionCall, LayerHook, PrefillState
from rankkit.sorting import descending_orders, descending_places


@dataclass
class Captured:
    """What a store holds for one example, as a method's offline face reads it.

    ``arrays`` maps a probe key to its scores [L, kv_heads, T] (and ``DRAFT_SCORES`` to the
    draft's lookahead scores [k, ..., T], ``ORACLE_SCORES`` to the oracle's [T]).
    ``layer_types`` and ``sliding_window`` as the store's model metadata records them
    (None: every layer global); ``kv_heads`` and ``query_heads`` group per-query-head scores
    (None: unrecorded).
    """

    arrays: Mapping[str, torch.Tensor]
    num_layers: int
    num_tokens: int
    layer_types: Sequence[str] | None = None
    sliding_window: int | None = None
    kv_heads: int | None = None
    query_heads: int | None = None

    def unseen(self) -> torch.Tensor | None:
        """Bool [L, T]: True where a local layer's last query could not see the key
        (``AttentionCall.unseen_keys``, as a prefill finds them); None where no layer is local."""
        if self.layer_types is None or self.sliding_window is None:
            return None
        old = torch.arange(self.num_tokens) <= self.num_tokens - 1 - self.sliding_window
        local = torch.tensor([kind == SLIDING_ATTENTION for kind in self.layer_types])
        return local[:, None] & old

    def seen_positions(self, layer: int) -> torch.Tensor:
        """The positions [T'] ``layer``'s last query could see: every one on a global layer, its
        window's on a local one; what full prefill's cache holds there (``Runner.roll_local_layers``)."""
        unseen = self.unseen()
        positions = torch.arange(self.num_tokens)
        return positions if unseen is None else positions[~unseen[layer]]

    def hide_unseen(self, scores: torch.Tensor) -> torch.Tensor:
        """Layer scores [L, ..., T] with NaN where a local layer's last query could not see the key
        (``unseen``), for the per-layer kept sets."""
        unseen = self.unseen()
        if unseen is None:
            return scores
        return scores.masked_fill(_per_layer(unseen, scores).to(scores.device), float("nan"))

    def unseen_last(self, rankings: torch.Tensor) -> torch.Tensor:
        """Layer rankings [L, T] with the keys a local layer could not see at -inf, after every other
        token, forced ones too: no per-head cut keeps them."""
        unseen = self.unseen()
        return rankings if unseen is None else rankings.masked_fill(unseen.to(rankings.device), float("-inf"))

    def get(self, key: str, method: str) -> torch.Tensor:
        if key not in self.arrays:
            raise RankkitError(f"method '{method}' needs captured {key!r}, which this example lacks")
        return self.arrays[key]


def _per_layer(mask: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """A [L, T] mask shaped to broadcast over scores [L, ..., T]."""
    return mask.view(mask.shape[0], *[1] * (scores.dim() - 2), mask.shape[1])


def check_head_layer(method: str, layer: int | None, num_layers: int) -> int:
    """The layer whose per-KV-head kept sets a per-head method reports (``--layer``): refused when
    missing or outside the model, naming the range."""
    layers = f"0..{num_layers - 1}"
    if layer is None:
        raise RankkitError(f"method '{method}' keeps a set per layer and KV head: name the layer with --layer ({layers})")
    if not 0 <= layer < num_layers:
        raise RankkitError(f"--layer {layer} is not a layer of this model ({layers}); give one in that range")
    return layer


DRAFT_SCORES = "draft_scores/lookahead"
DRAFT_GROUP, DRAFT_ARRAY = DRAFT_SCORES.split("/")
ORACLE_SCORES = "oracle"


def forced_mask(length: int, window: int = 0, sinks: int = 0, *, device=None) -> torch.Tensor:
    """Bool [length]: True for the first ``sinks`` and the last ``window`` entries."""
    forced = torch.zeros(length, dtype=torch.bool, device=device)
    forced[: min(sinks, length)] = True
    if window:
        forced[-min(window, length) :] = True
    return forced


def descending_order(scores: torch.Tensor) -> torch.Tensor:
    """Indices along the last axis from the highest score down; tied scores keep token order
    (NaN first, as torch's descending sort puts it)."""
    on_cpu = _on_cpu(scores)
    if on_cpu is not None:
        return torch.from_numpy(descending_orders(on_cpu, nan_first=True))
    return torch.sort(_sortable(scores), descending=True, stable=True).indices  # along the last axis


def descending_ranks(scores: torch.Tensor) -> torch.Tensor:
    """Each entry's place in ``descending_order`` (0 = highest score), int64, same shape as ``scores``."""
    on_cpu = _on_cpu(scores)
    if on_cpu is not None:
        return torch.from_numpy(descending_places(on_cpu, nan_first=True))
    order = descending_order(scores)
    places = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, places)


def _sortable(scores: torch.Tensor) -> torch.Tensor:
    return scores if scores.dtype in (torch.float32, torch.float64) else scores.float()  # exact for scores


_sorting_as_on_cuda = False


@contextmanager
def sorting_as_on_cuda():
    """Rank with torch's sort on a CPU too, as on CUDA: to count the operators a CUDA run launches
    (``rankkit.measure.OperatorLaunches``), which the compiled CPU sort would leave out."""
    global _sorting_as_on_cuda
    before, _sorting_as_on_cuda = _sorting_as_on_cuda, True
    try:
        yield
    finally:
        _sorting_as_on_cuda = before


def _on_cpu(scores: torch.Tensor):
    """The scores as a numpy array when they are on a CPU, for the compiled sort (``rankkit.sorting``):
    torch's stable sort of the same order costs 7x more per row there, and the methods' offline
    faces sort every layer of every example a store holds; None elsewhere, and where torch.compile
    traces (a compiled decode step, which a call out to numpy would break in two)."""
    if scores.device.type != "cpu" or not scores.numel() or _sorting_as_on_cuda or torch.compiler.is_compiling():
        return None
    return _sortable(scores).detach().numpy()


def with_forced(scores: torch.Tensor, forced: torch.Tensor | None) -> torch.Tensor:
    """The scores a method ranks by: forced tokens at +inf, ahead of every other."""
    ranked = scores.float()
    return ranked if forced is None else ranked.masked_fill(forced, float("inf"))


def nan_last(scores: torch.Tensor) -> torch.Tensor:
    """Scores with NaN (a key no query of the scoring could see: outside a local layer's window, in a
    store; outside every window, for the oracle) at -inf, under every key scored, as ``compare``
    ranks them; a sort puts NaN first."""
    return scores.masked_fill(scores.isnan(), -torch.inf)


def top_k_with_forced(scores: torch.Tensor, k: int, forced: torch.Tensor | None = None) -> torch.Tensor:
    """Sorted indices of the ``k`` best entries along the last axis, forced entries always among them.

    ``scores`` is [S] or [heads, S]; the result is [k] or [heads, k]. Ties go to the earlier token.
    """
    length = scores.shape[-1]
    if k >= length:
        return torch.arange(length, device=scores.device).expand(*scores.shape[:-1], length)
    return torch.sort(descending_order(with_forced(scores, forced))[..., :k], dim=-1).values


def top_k_seen(
    scores: torch.Tensor,
    k: int,
    forced: torch.Tensor | None,
    unseen: torch.Tensor | None,
    first_seen: int | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """``top_k_with_forced`` over scores [heads, S] among the keys a layer can attend to.

    Keys in ``unseen`` [heads, S] (outside a local layer's window) are never kept, forced
    or not, and take none of the ``k``: a head keeps its ``k`` best seen keys, or every
    seen key when it sees fewer. Where the host knows the unseen keys are the oldest
    ``first_seen`` (``AttentionCall.first_seen_key``) they are cut off and nothing is read;
    else the mask is read, and the result is one sorted index tensor per head.
    """
    if first_seen is not None:
        seen = slice(first_seen, None)
        kept = top_k_with_forced(scores[..., seen], k, None if forced is None else forced[seen])
        return kept + first_seen if first_seen else kept
    if unseen is None or not bool(unseen.any()):
        return top_k_with_forced(scores, k, forced)
    order = descending_order(with_forced(scores, forced).masked_fill(unseen, float("-inf")))
    seen = (~unseen).sum(dim=-1).clamp(max=k).tolist()
    return [torch.sort(head_order[:count]).values for head_order, count in zip(order, seen, strict=True)]


class LayerPolicy:
    """Where the shared selection happens, and with which per-token scores.

    ``decide`` is called after every prefill layer, with that layer's probe scores
    [kv_heads, S] when ``needs_scores(layer)`` (else None), until it returns scores [S]
    over the live tokens; the hook then selects the top tokens from them. Policies that
    aggregate across layers keep their own history.
    """

    def needs_scores(self, layer: int) -> bool:
        """Whether the probe must score this layer for the policy."""
        raise NotImplementedError

    def decide(self, layer: int, scores: torch.Tensor | None) -> torch.Tensor | None:
        raise NotImplementedError

    def decide_at_once(self, head_sums: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        """What ``replay`` finds, read straight off every layer's scores summed over heads
        ([L, T], ``head_sums``), for a policy whose decision needs no walk through the layers;
        None (the default) when it does. The policy's layers lie within ``head_sums`` (a bound method's
        layers are the model's). An offline face asks this of each of its 30-odd
        candidate layers: a replay per candidate costs more than the metrics of its ranking."""
        return None


def head_sums(layer_scores: torch.Tensor) -> torch.Tensor:
    """Scores [L, kv_heads, T] summed over heads, layer by layer as a policy sums the scores it is
    given, so that ``decide_at_once`` and ``decide`` see the same values to the last bit."""
    return torch.stack([scores.sum(0) for scores in layer_scores])


@dataclass
class FixedLayer(LayerPolicy):
    """Select at one layer from that layer's scores summed over heads (CLAA Eq. 1 for GemFilter, Eq. 2 for FastKV)."""

    layer: int

    def needs_scores(self, layer: int) -> bool:
        return layer == self.layer

    def decide(self, layer, scores):
        return scores.sum(0) if layer == self.layer else None

    def decide_at_once(self, head_sums):
        return self.layer, head_sums[self.layer]


@dataclass
class NeverSelect(LayerPolicy):
    """No shared selection: KV-only methods compress every layer's cache and prune nothing."""

    def needs_scores(self, layer: int) -> bool:
        return False

    def decide(self, layer, scores):
        return None


class SelectionHook(LayerHook):
    """Carries out a selection mode during one prefill (see the module docstring).

    ``probe`` scores every layer the policy or the compression needs. ``keep`` is the
    token budget; ``compress_from`` (None: never) is the first layer whose cache is
    compressed per head before selection; ``stop_at_selection`` ends the pass at the
    selection layer instead of pruning (first pass of a two-pass method).
    """

    def __init__(
        self,
        probe,
        policy: LayerPolicy,
        keep: int,
        *,
        window: int = 0,
        sinks: int = 0,
        compress_from: int | None = None,
        stop_at_selection: bool = False,
    ):
        self.probe = probe
        self.policy = policy
        self.keep = keep
        self.window = window
        self.sinks = sinks
        self.compress_from = compress_from
        self.stop_at_selection = stop_at_selection
        self.scores: torch.Tensor | None = None  # the current layer's probe scores [kv_heads, S]
        self.first_seen: int | None = None  # how many of the current layer's keys, the oldest, it cannot see
        self.unseen: torch.Tensor | None = None  # which, where the host does not know (``first_seen`` None)
        self.kept_positions: torch.Tensor | None = None
        self.selection_layer: int | None = None
        self._forced: tuple[int, torch.Tensor] | None = None  # (live tokens, their forced mask)

    def _compresses(self, layer: int) -> bool:
        return self.compress_from is not None and layer >= self.compress_from

    def _forced_mask(self, live: int, device) -> torch.Tensor:
        """The forced mask of ``live`` tokens, made once for the layers that share their number."""
        if self._forced is None or self._forced[0] != live:
            self._forced = (live, forced_mask(live, self.window, self.sinks, device=device))
        return self._forced[1]

    def on_attention(self, call: AttentionCall) -> None:
        if call.phase != "prefill" or self.kept_positions is not None:
            return
        if self.policy.needs_scores(call.layer) or self._compresses(call.layer):
            self.scores, self.first_seen = self.probe.score(call), call.first_seen_key()
            # the mask only where the host cannot cut the unseen keys off by their count
            self.unseen = call.unseen_keys() if self.first_seen is None else None

    def after_layer(self, layer: int, state: PrefillState) -> None:
        if self.kept_positions is not None:
            return
        scores, self.scores = self.scores, None
        live = state.positions.shape[0]
        shared = self.policy.decide(layer, scores if self.policy.needs_scores(layer) else None)
        if shared is None:
            if self._compresses(layer) and self.keep < live:
                forced = self._forced_mask(live, state.positions.device)
                state.cache.compress(layer, top_k_seen(scores, self.keep, forced, self.unseen, self.first_seen))
            return
        forced = self._forced_mask(live, state.positions.device)
        keep = top_k_with_forced(shared, self.keep, forced)
        self.kept_positions = state.positions[keep]
        self.selection_layer = layer
        if self.stop_at_selection:
            state.stop_here()
        elif self.keep < live:  # keeping everything is a no-op: skip the copies
            if self._compresses(layer):  # CLAA Listings 2 and 5, ASL Alg. 1: the layer's own top-k
                state.cache.compress(layer, top_k_seen(scores, self.keep, forced, self.unseen, self.first_seen))
            else:
                state.cache.compress(layer, keep.expand(state.cache.keys[layer].shape[1], -1))
            state.prune(keep)


def one_pass(runner, input_ids: torch.Tensor, hook: SelectionHook) -> MethodPrefill:
    """Run a one-pass (or KV-only) method's prefill with ``hook``; the cache it leaves is the method's."""
    run = full_prefill(runner, input_ids, hooks=[hook])
    run.kept_positions, run.selection_layer = hook.kept_positions, hook.selection_layer
    return run


def two_pass(runner, input_ids: torch.Tensor, hook: SelectionHook) -> MethodPrefill:
    """A two-pass method's prefill: a first pass that stops at the selection, then the re-prefill."""
    hook.stop_at_selection = True
    first = runner.prefill(input_ids, hooks=[hook], logits_at=None)
    selection = Pass.prefill("selection", first.live_tokens)
    return reprefill_selected(runner, input_ids, hook.kept_positions, [selection], hook.selection_layer)


def replay(policy: LayerPolicy, layer_scores: torch.Tensor) -> tuple[int, torch.Tensor] | None:
    """Feed a policy the stored scores [L, kv_heads, T] layer by layer, as ``SelectionHook`` does
    during a prefill; the layer it selects at and its shared scores [T], or None if it never does."""
    for layer in range(layer_scores.shape[0]):
        shared = policy.decide(layer, layer_scores[layer] if policy.needs_scores(layer) else None)
        if shared is not None:
            return layer, shared
    return None


@dataclass
class PolicyMethod(Method):
    """A method made of probe x layer policy x selection mode (see the module docstring).

    Subclasses give ``probe`` and, when they select, ``policy``; ``forced`` names the tokens
    always kept, ``minimum_keep`` the budget's floor, ``compress_from`` the first layer whose
    cache is compressed per head in a one-pass run. Every method is bound to the model's depth
    (``bind``) before these are asked.
    """

    two_pass: ClassVar[bool] = False

    def probe(self):
        raise NotImplementedError

    def policy(self, num_layers: int, keep: int) -> LayerPolicy:
        return NeverSelect()

    def forced(self, keep: int) -> tuple[int, int]:
        """(window, sinks): how many of the last and of the first prompt tokens are always kept."""
        return 0, 0

    def minimum_keep(self) -> int:
        return sum(self.forced(0))

    def compress_from(self) -> int | None:
        return None

    def _plan(self, num_layers: int, length: int, budget: Budget, layer_types=None):
        bound = self.bind(num_layers, layer_types)
        keep = bound.kept_tokens(budget, length)
        window, sinks = bound.forced(keep)
        return bound, keep, window, sinks

    def prefill(self, runner, input_ids, budget):
        bound, keep, window, sinks = self._plan(
            runner.num_layers, int(input_ids.numel()), budget, runner.layer_types
        )
        hook = SelectionHook(
            bound.probe(),
            bound.policy(runner.num_layers, keep),
            keep,
            window=window,
            sinks=sinks,
            compress_from=None if self.two_pass else bound.compress_from(),
        )
        return (two_pass if self.two_pass else one_pass)(runner, input_ids, hook)

    # -- the offline face ------------------------------------------------------------------

    def captured_inputs(self) -> list[str]:
        return [self.probe().key]

    def captured_scores(self, captured: Captured) -> torch.Tensor:
        """The probe's stored scores [L, kv_heads, T]."""
        return captured.get(self.probe().key, self.name)

    def select_offline(self, captured: Captured, budget: Budget, *, layer: int | None = None) -> Selection:
        """The kept set ``prefill`` builds, from the store. Per-head (KV-only) methods keep a set per
        KV head at every layer: ``layer`` picks which one is reported."""
        scores = self.captured_scores(captured)
        bound, keep, window, sinks = self._plan(
            captured.num_layers, captured.num_tokens, budget, captured.layer_types
        )
        forced = forced_mask(captured.num_tokens, window, sinks, device=scores.device)
        selected = replay(bound.policy(captured.num_layers, keep), scores)
        if selected is not None:
            self._warn_of_unscored(captured, selected[0], keep)
            return Selection(selected[0], top_k_with_forced(nan_last(selected[1]), keep, forced))
        check_head_layer(self.name, layer, captured.num_layers)
        seen_scores = captured.hide_unseen(scores)[layer]  # NaN: keys the layer could not see
        # a budget that covers the prompt too: the cache decoding starts from holds only the keys a
        # local layer saw (``Method.prefill_for_decoding``)
        return Selection(layer, top_k_seen(seen_scores, keep, forced, seen_scores.isnan()))

    def _warn_of_unscored(self, captured: Captured, layer: int, keep: int) -> None:
        """Warn where a shared selection at a local layer keeps more tokens than the store scored there:
        the store has no score for a key the layer's last query could not see, so those are taken
        in token order, where the prefill ranks them by its probe's other queries."""
        unseen = captured.unseen()
        seen = captured.num_tokens if unseen is None else int((~unseen[layer]).sum())
        if keep > seen:
            warnings.warn(
                f"method '{self.name}' selects at layer {layer}, a local layer whose last query saw {seen} of "
                f"the {captured.num_tokens} tokens: the store has no score for the others, so the last "
                f"{keep - seen} kept are the earliest of them, where prefill ranks them by the probe's other "
                f"queries; name a global layer with --layer, or keep at most {seen} tokens",
                stacklevel=3,
            )

    def layer_rankings(self, captured: Captured, budget: Budget) -> dict[int | None, torch.Tensor]:
        """The scores [T] the method ranks by (forced tokens first) at each layer it could select at:
        every layer for a method with a selection layer (``--layer``), the one layer an adaptive
        policy picks, and every layer's head sum for KV-only methods.

        The method is planned once (its budget and forced tokens do not depend on where it
        selects); each candidate layer then replays its own policy over the stored scores, or
        reads its decision off the layers' head sums (``LayerPolicy.decide_at_once``).
        """
        scores = self.captured_scores(captured)
        num_layers, length = captured.num_layers, captured.num_tokens
        bound, keep, window, sinks = self._plan(num_layers, length, budget, captured.layer_types)
        forced = forced_mask(length, window, sinks, device=scores.device)
        selection = bound.selection_parameter
        candidates = (
            [replace(bound, **{selection: layer}) for layer in range(num_layers)] if selection else [bound]
        )
        shared: dict[int | None, torch.Tensor] = {}
        summed = None  # every candidate's head sums, for the policies that decide at once
        for method in candidates:
            policy = method.policy(num_layers, keep)
            selected = None
            if type(policy).decide_at_once is not LayerPolicy.decide_at_once:
                summed = head_sums(scores) if summed is None else summed
                selected = policy.decide_at_once(summed)
            if selected is None:
                selected = replay(policy, scores)
            if selected is None:  # KV-only: each layer cuts its own cache
                return dict(enumerate(captured.unseen_last(with_forced(scores.sum(1), forced)).unbind(0)))
            shared[selected[0]] = selected[1]
        return dict(
            zip(shared, with_forced(torch.stack(list(shared.values())), forced).unbind(0), strict=True)
        )
