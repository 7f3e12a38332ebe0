"""Oracle-guided prefill (CLAA Sec. 3.2, Appendix D.4 Listing 4): the upper bound a ranking could reach.

The Answer-Informed Oracle (``rankkit.oracle``, CLAA Algorithm 1) ranks the prompt by
the attention of the model's own greedy answer; that ranking is computed offline, in
``prepare``, and is not part of TTFT. The online prefill then mirrors the architecture
of the method it bounds (``mirror``), with the oracle ranking in place of the probe:

- ``gemfilter``: Listing 4's ``oracle_prefill``, one forward pass over the top tokens at
  their original positions (no first pass: the ranking is already known);
- ``fastkv``: layers before l_p compress their cache with the oracle ranking while all
  hidden states go on; at l_p the hidden states are pruned to the top tokens and l_p's
  cache is compressed with the same indices (Sec. 3.2);
- ``claa``: as ``fastkv``, with the first m layers uncompressed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from rankkit.errors import RankkitError
from rankkit.methods.base import Method, register, reprefill_selected, scale_count, scale_layer
from rankkit.methods.claa import REFERENCE_DEFERRED_LAYERS, REFERENCE_PRUNING_LAYER
from rankkit.methods.selection import FixedLayer, SelectionHook, forced_mask, one_pass, top_k_with_forced
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
class Oracle(Method):
    name: ClassVar[str] = "oracle"
    mirror: str = "fastkv"
    pruning_layer: int | None = None  # l_p / TSP for the one-pass mirrors; default 15 of 32 scaled
    deferred_layers: int | None = None  # m for the claa mirror; default 4 of 32 scaled
    window_size: int = 8  # kept by the one-pass mirrors, as FastKV and CLAA keep theirs
    max_new_tokens: int = 32  # N_gen: the oracle answer's length limit
    kernel_size: int = 7  # the oracle's POOL1D
    ranking: torch.Tensor | None = field(default=None, repr=False, compare=False)  # set by ``prepare``

    def __post_init__(self):
        if self.mirror not in MIRRORS:
            raise RankkitError(f"oracle mirror must be one of {', '.join(MIRRORS)}, not '{self.mirror}'")

    def layer(self, num_layers: int) -> int:
        return (
            self.pruning_layer
            if self.pruning_layer is not None
            else scale_layer(REFERENCE_PRUNING_LAYER, num_layers)
        )

    def resolved(self, num_layers):
        params = {
            "mirror": self.mirror,
            "max_new_tokens": self.max_new_tokens,
            "kernel_size": self.kernel_size,
        }
        if self.mirror != "gemfilter":
            params |= {"pruning_layer": self.layer(num_layers), "window_size": self.window_size}
        if self.mirror == "claa":
            params["deferred_layers"] = self._deferred(num_layers)
        return params

    def _deferred(self, num_layers: int) -> int:
        if self.deferred_layers is not None:
            return self.deferred_layers
        return scale_count(REFERENCE_DEFERRED_LAYERS, num_layers, minimum=0)

    def with_layer(self, layer):
        return replace(self, pruning_layer=layer)

    def prepare(self, runner, input_ids, *, tokenizer):
        from rankkit.oracle import answer_informed_oracle

        result = answer_informed_oracle(
            runner,
            input_ids,
            tokenizer=tokenizer,
            max_new_tokens=self.max_new_tokens,
            kernel=self.kernel_size,
        )
        self.ranking = torch.from_numpy(result.scores)

    def prefill(self, runner, input_ids, budget):
        if self.ranking is None or self.ranking.numel() != input_ids.numel():
            raise RankkitError("the oracle method needs its ranking of this prompt: call prepare() first")
        length = int(input_ids.numel())
        if self.mirror == "gemfilter":
            keep = top_k_with_forced(
                self.ranking, budget.resolve(length, always_kept=1), forced_mask(length, 1)
            )
            return reprefill_selected(runner, input_ids, keep, [], None)
        layer = self.layer(runner.num_layers)
        hook = SelectionHook(
            FixedRanking(self.ranking),
            FixedLayer(layer),
            budget.resolve(length, always_kept=self.window_size),
            window=self.window_size,
            compress_from=0 if self.mirror == "fastkv" else self._deferred(runner.num_layers),
        )
        return one_pass(runner, input_ids, hook)
