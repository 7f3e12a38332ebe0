"""SnapKV (Li et al. 2024), KV-only: every layer keeps its per-head top tokens after prefill.

Probe ``window`` (W=32, avg pooled with kernel 7: the settings ASL Appendix C.2 uses for
SnapKV) x no selection layer x KV-only mode: all tokens go through every layer; after
each layer's attention its cache is compressed per KV head to the budget, the
observation window always kept. Prefill compute is unchanged; decode reads a small cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rankkit.methods.base import bounded, make_probe, register
from rankkit.methods.selection import PolicyMethod


@register
@dataclass
class SnapKV(PolicyMethod):
    name: ClassVar[str] = "snapkv"
    window_size: int = bounded(32, 1)
    kernel_size: int = bounded(7, 1)

    def probe(self):
        return make_probe("window", window_size=self.window_size, kernel_size=self.kernel_size)

    def forced(self, keep):
        return self.window_size, 0

    def compress_from(self):
        return 0
