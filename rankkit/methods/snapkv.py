"""SnapKV (Li et al. 2024), KV-only: every layer keeps its per-head top tokens after prefill.

Probe ``window`` (W=32, avg pooled with kernel 7: the settings ASL Appendix C.2 uses for
SnapKV) x no selection layer x KV-only mode: all tokens go through every layer; after
each layer's attention its cache is compressed per KV head to the budget, the
observation window always kept. Prefill compute is unchanged; decode reads a small cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rankkit.methods.base import Method, make_probe, register
from rankkit.methods.selection import NeverSelect, SelectionHook, one_pass


@register
@dataclass
class SnapKV(Method):
    name: ClassVar[str] = "snapkv"
    window_size: int = 32
    kernel_size: int = 7

    def prefill(self, runner, input_ids, budget):
        keep = budget.resolve(int(input_ids.numel()), always_kept=self.window_size)
        probe = make_probe("window", window_size=self.window_size, kernel_size=self.kernel_size)
        hook = SelectionHook(probe, NeverSelect(), keep, window=self.window_size, compress_from=0)
        return one_pass(runner, input_ids, hook)
