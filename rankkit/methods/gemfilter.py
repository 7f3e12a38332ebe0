"""GemFilter (Shi et al. 2024) as CLAA Appendix D.1 Listing 1 writes it: two passes.

Probe ``last_token_raw`` (CLAA Eq. 1: the last query's raw logits summed over heads) x
``FixedLayer(r)`` x two-pass mode: the first pass runs layers 0..r on every token and
stops; the top tokens (the last token always among them) are re-prefilled through all
layers at their original positions, so every layer's cache holds exactly them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from rankkit.methods.base import Method, make_probe, register, scale_layer
from rankkit.methods.selection import FixedLayer, SelectionHook, two_pass

REFERENCE_ROUTING_LAYER = 15  # CLAA Table 4 (GemFilter's own paper uses 13-15 for Llama-3.1-8B)


@register
@dataclass
class GemFilter(Method):
    name: ClassVar[str] = "gemfilter"
    routing_layer: int | None = None  # r; default 15 of 32 scaled to the model's depth
    kernel_size: int = 1  # GemFilter does not pool; CLAA's comparison pools with 7

    def layer(self, num_layers: int) -> int:
        return (
            self.routing_layer
            if self.routing_layer is not None
            else scale_layer(REFERENCE_ROUTING_LAYER, num_layers)
        )

    def resolved(self, num_layers):
        return {"routing_layer": self.layer(num_layers), "kernel_size": self.kernel_size}

    def with_layer(self, layer):
        return replace(self, routing_layer=layer)

    def prefill(self, runner, input_ids, budget):
        keep = budget.resolve(int(input_ids.numel()), always_kept=1)
        hook = SelectionHook(
            make_probe("last_token_raw", kernel_size=self.kernel_size),
            FixedLayer(self.layer(runner.num_layers)),
            keep,
            window=1,
        )
        return two_pass(runner, input_ids, hook)
