"""Selection machinery every method composes: top-k with forced tokens, layer policies, one hook.

A method = probe x layer policy x selection mode. The probe scores keys per KV head at
a layer; a ``LayerPolicy`` decides at which layer the shared selection happens and from
which (aggregated) scores; ``SelectionHook`` carries out the mode during prefill:

- before the selection layer it can compress each layer's KV cache per head to the
  budget (SnapKV-style, FastKV Eq. 4), from layer ``compress_from`` on;
- at the selection layer it either prunes the hidden states to the selected tokens
  and compresses that layer's cache with the same indices (one-pass: FastKV, CLAA,
  ASL), or stops the pass (the first pass of a two-pass method: GemFilter, ASL-2pass);
- after it, later layers only ever see the kept tokens, so their cache is the selection.

The observation window (the last ``window`` prompt tokens) and sinks are always kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rankkit.methods.base import MethodPrefill, Pass, full_prefill, reprefill_selected
from rankkit.runner import AttentionCall, LayerHook, PrefillState


def forced_mask(length: int, window: int = 0, sinks: int = 0, device=None) -> torch.Tensor:
    """Bool [length]: True for the first ``sinks`` and the last ``window`` entries."""
    forced = torch.zeros(length, dtype=torch.bool, device=device)
    forced[: min(sinks, length)] = True
    if window:
        forced[-min(window, length) :] = True
    return forced


def top_k_with_forced(scores: torch.Tensor, k: int, forced: torch.Tensor | None = None) -> torch.Tensor:
    """Sorted indices of the ``k`` best entries along the last axis, forced entries always among them.

    ``scores`` is [S] or [heads, S]; the result is [k] or [heads, k].
    """
    length = scores.shape[-1]
    if k >= length:
        return torch.arange(length, device=scores.device).expand(*scores.shape[:-1], length)
    ranked = scores.float()
    if forced is not None:
        ranked = ranked.masked_fill(forced, float("inf"))
    return torch.sort(torch.topk(ranked, k, dim=-1).indices, dim=-1).values


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


@dataclass
class FixedLayer(LayerPolicy):
    """Select at one layer from that layer's scores summed over heads (GemFilter Eq. 1, FastKV Eq. 2)."""

    layer: int

    def needs_scores(self, layer: int) -> bool:
        return layer == self.layer

    def decide(self, layer, scores):
        return scores.sum(0) if layer == self.layer else None


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
        self.kept_positions: torch.Tensor | None = None
        self.selection_layer: int | None = None

    def _compresses(self, layer: int) -> bool:
        return self.compress_from is not None and layer >= self.compress_from

    def on_attention(self, call: AttentionCall) -> None:
        if call.phase != "prefill" or self.kept_positions is not None:
            return
        if self.policy.needs_scores(call.layer) or self._compresses(call.layer):
            self.scores = self.probe.score(call)

    def after_layer(self, layer: int, state: PrefillState) -> None:
        if self.kept_positions is not None:
            return
        scores, self.scores = self.scores, None
        live = state.positions.shape[0]
        forced = forced_mask(live, self.window, self.sinks, state.positions.device)
        shared = self.policy.decide(layer, scores if self.policy.needs_scores(layer) else None)
        if shared is None:
            if self._compresses(layer) and self.keep < live:
                state.cache.compress(layer, top_k_with_forced(scores, self.keep, forced))
            return
        keep = top_k_with_forced(shared, self.keep, forced)
        self.kept_positions = state.positions[keep]
        self.selection_layer = layer
        if self.stop_at_selection:
            state.stop_here()
        elif self.keep < live:  # keeping everything is a no-op: skip the copies
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
