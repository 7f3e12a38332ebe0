"""Full prefill: every token through every layer, the whole KV cache for decoding (the baseline)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rankkit.methods.base import Method, full_prefill, register


@register
@dataclass
class Full(Method):
    """The reference every ratio is taken against; the budget is ignored."""

    name: ClassVar[str] = "full"

    def prefill(self, runner, input_ids, budget):
        return full_prefill(runner, input_ids)
