"""Oracle-guided prefill (CLAA Sec. 3.2, Appendix D.4 Listing 4): the upper bound a ranking could reach.

The Answer-Informed Oracle (``rankkit.oracle``, CLAA Algorithm 1) ranks the prompt by
the attention of the model's own greedy answer; that ranking is computed offline, in
``prepare``, and is not part of TTFT. The online prefill then mirrors the architecture
of the method it bounds (``mirror``), with the oracle ranking in place of the probe:

- ``gemfilter``: Listing 4's ``oracle_prefill``, one forward pass over the top tokens at
  their original positions (no first pass: the ranking is already known, so it selects at no
  layer, and ``pruning_layer``, ``deferred_layers`` and ``window_size`` are refused);
- ``fastkv``: layers before l_p compress their cache with the oracle ranking while all
  hidden states go on; at l_p the hidden states are pruned to the top tokens and l_p's
  cache is compressed with the same indices (Sec. 3.2);
- ``claa``: as ``fastkv``, with the first m layers uncompressed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from rankkit import defaults
from rankkit.errors import RankkitError
from rankkit.methods.base import (
    Budget,
    Selection,
    bounded,
    paper_count,
    paper_layer,
    register,
    reprefill_selected,
)
from rankkit.methods.selection import (
    ORACLE_SCORES,
    Captured,
    FixedLayer,
    PolicyMethod,
    forced_mask,
    nan_last,
    top_k_with_forced,
    with_forced,
)
from rankkit.runner import AttentionCall

MIRRORS = ("gemfilter", "fastkv", "claa")


class FixedRanking:
    """A probe that scores every key by a precomputed per-position ranking, the same for every head."""

    def __init__(self, scores: torch.Tensor):
        self.scores = scores

    def score(self, call: AttentionCall) -> torch.Tensor:
        return self.scores.to(call.key.device)[call.key_positions]


@register
@dataclass
class Oracle(PolicyMethod):
    name: ClassVar[str] = "oracle"
    mirror: str = defaults.ORACLE_MIRROR
    pruning_layer: int | None = paper_layer(15, selection=True)  # l_p / TSP of the one-pass mirrors
    deferred_layers: int | None = paper_count(4, minimum=0)  # m of the claa mirror
    window_size: int = bounded(8, 1)  # kept by the one-pass mirrors, as FastKV and CLAA keep theirs
    max_new_tokens: int = bounded(32, 1)  # N_gen: the oracle answer's length limit
    kernel_size: int = bounded(7, 1)  # the oracle's POOL1D
    ranking: torch.Tensor | None = field(default=None, repr=False, compare=False)  # set by ``prepare``

    def __post_init__(self):
        if self.mirror not in MIRRORS:
            raise RankkitError(f"oracle mirror must be one of {', '.join(MIRRORS)}, not '{self.mirror}'")

    def unread_parameters(self) -> tuple[str, ...]:
        """The gemfilter mirror ranks before any layer and keeps only the last token forced; only
        the claa mirror defers compression."""
        if self.mirror == "gemfilter":
            return ("pruning_layer", "deferred_layers", "window_size")
        return () if self.mirror == "claa" else ("deferred_layers",)

    def unread_reason(self) -> str:
        return f"mirror={self.mirror}"

    def oracle_settings(self) -> dict:
        """The identity of the oracle this method ranks by (``rankkit.oracle.oracle_params``): the greedy
        answer's raw logits, N_gen and the POOL1D kernel; a store's oracle must match it."""
        from rankkit.oracle import oracle_params

        return oracle_params("generated", False, self.kernel_size, self.max_new_tokens)

    def prepare(self, runner, input_ids, *, tokenizer):
        from rankkit.oracle import answer_informed_oracle

        result = answer_informed_oracle(
            runner,
            input_ids,
            tokenizer=tokenizer,
            max_new_tokens=self.max_new_tokens,
            kernel=self.kernel_size,
        )
        self.ranking = nan_last(torch.from_numpy(result.scores))

    def probe(self):
        return FixedRanking(self.ranking)

    def policy(self, num_layers, keep):
        return FixedLayer(self.pruning_layer)

    def forced(self, keep):
        return (1, 0) if self.mirror == "gemfilter" else (self.window_size, 0)

    def compress_from(self):
        return self.deferred_layers if self.mirror == "claa" else 0

    def prefill(self, runner, input_ids, budget):
        if self.ranking is None or self.ranking.numel() != input_ids.numel():
            raise RankkitError("the oracle method needs its ranking of this prompt: call prepare() first")
        if self.mirror != "gemfilter":
            return super().prefill(runner, input_ids, budget)
        return reprefill_selected(runner, input_ids, self._top_tokens(self.ranking, budget), [], None)

    def _top_tokens(self, ranking: torch.Tensor, budget: Budget) -> torch.Tensor:
        """The gemfilter mirror's kept positions: the ranking's top tokens, the last one forced."""
        length = ranking.numel()
        keep = self.kept_tokens(budget, length)
        return top_k_with_forced(ranking, keep, self._forced_mask(length, keep))

    def _forced_mask(self, length: int, keep: int) -> torch.Tensor:
        """The tokens ``forced`` keeps whatever the ranking (Listing 4's mirror: the last one)."""
        return forced_mask(length, *self.forced(keep))

    def captured_inputs(self):
        return [ORACLE_SCORES]

    def select_offline(self, captured: Captured, budget: Budget, *, layer=None) -> Selection:
        if self.mirror != "gemfilter":
            return super().select_offline(captured, budget, layer=layer)
        return Selection(None, self._top_tokens(self._stored_ranking(captured), budget))

    def layer_rankings(self, captured: Captured, budget: Budget) -> dict[int | None, torch.Tensor]:
        if self.mirror != "gemfilter":
            return super().layer_rankings(captured, budget)
        length = captured.num_tokens
        forced = self._forced_mask(length, self.kept_tokens(budget, length))
        return {None: with_forced(self._stored_ranking(captured), forced)}

    def captured_scores(self, captured: Captured) -> torch.Tensor:
        return self._stored_ranking(captured).expand(captured.num_layers, 1, -1)

    def _stored_ranking(self, captured: Captured) -> torch.Tensor:
        """The store's oracle scores [T], ranked as ``prepare`` ranks the ones it computes."""
        return nan_last(captured.get(ORACLE_SCORES, self.name))
