"""SAGE-KV Sec. 2 Steps 1-3, Appendix A.2: KV-only after a full prefill.

Probe ``last_token_heads`` (the last prompt token's softmax attention, max over the
query heads of each KV group) x no selection layer x KV-only mode: every layer's cache
is cut into sink tokens, evicted candidates, recent tokens and the last token; per KV
head the candidates with the highest scores are kept (Step 2) and concatenated with the
sinks, the recent tokens and the last token (Step 3).

Budget split for a budget of B tokens (Appendix A.2): sink window B/4; k = B/(2G) per
query head with G query heads per KV head, so G*k = B/2 candidates per KV head (the
group max stands for the union of the heads' top-k); the recent window takes the rest
(B - B/4 - G*k - 1) and the last token 1. Compressing after each layer's attention is
the same as compressing after the prefill: a prefill never reads an earlier layer's cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rankkit.methods.base import Method, make_probe, register
from rankkit.methods.selection import NeverSelect, SelectionHook, one_pass


@dataclass
class SageSplit:
    sinks: int
    per_query_head: int  # k
    recent: int  # recent tokens, the last token included


def sage_split(budget: int, group_size: int) -> SageSplit:
    sinks = budget // 4
    per_query_head = budget // (2 * group_size)
    return SageSplit(sinks, per_query_head, max(1, budget - sinks - group_size * per_query_head))


@register
@dataclass
class SageKV(Method):
    name: ClassVar[str] = "sage-kv"

    def prefill(self, runner, input_ids, budget):
        config = runner.config
        group_size = config.num_attention_heads // config.num_key_value_heads
        keep = budget.resolve(int(input_ids.numel()), always_kept=2)
        split = sage_split(keep, group_size)
        hook = SelectionHook(
            make_probe("last_token_heads"),
            NeverSelect(),
            keep,
            window=split.recent,
            sinks=split.sinks,
            compress_from=0,
        )
        return one_pass(runner, input_ids, hook)
