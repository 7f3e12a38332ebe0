"""GemFilter (Shi et al. 2024) as CLAA Appendix D.1 Listing 1 writes it: two passes.

Probe ``last_token_raw`` (CLAA Eq. 1: the last query's raw logits summed over heads, then
average-pooled with kernel 5 as GemFilter's reference code pools them before its top-k) x
``FixedLayer(r)`` x two-pass mode: the first pass runs layers 0..r on every token and
stops; the top tokens (the last token always among them) are re-prefilled through all
layers at their original positions, so every layer's cache holds exactly them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rankkit.methods.base import bounded, make_probe, paper_layer, register
from rankkit.methods.selection import FixedLayer, PolicyMethod


@register
@dataclass
class GemFilter(PolicyMethod):
    name: ClassVar[str] = "gemfilter"
    two_pass: ClassVar[bool] = True
    # r: layer 15 of 32, CLAA Table 4 (GemFilter's own paper uses 13-15 for Llama-3.1-8B)
    routing_layer: int | None = paper_layer(15, selection=True)
    # GemFilter's reference code: average pooling, kernel 5, zero padding counted; CLAA's comparison pools with 7
    kernel_size: int = bounded(5, 1)

    def probe(self):
        return make_probe("last_token_raw", kernel_size=self.kernel_size)

    def policy(self, num_layers, keep):
        return FixedLayer(self.routing_layer)

    def forced(self, keep):
        return 1, 0  # the last token produces the logits
