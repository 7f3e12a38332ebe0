"""The method: the probe, where it acts, and what it always keeps.

It imports no probe: rankkit loads methods before probes, so ``make_probe`` asks for it by name.
"""

from dataclasses import dataclass
from typing import ClassVar

from rankkit.methods.base import make_probe
from rankkit.methods.selection import PolicyMethod


@dataclass
class KNorm(PolicyMethod):
    """KV-only: after each layer's attention, every KV head's cache keeps its budget of smallest-norm
    keys and the last ``window_size`` tokens; every token still goes through every layer."""

    name: ClassVar[str] = "knorm"
    window_size: int = 1  # the last token, whose logits the answer starts from

    def probe(self):
        return make_probe("key_norm")

    def forced(self, keep):
        return self.window_size, 0  # (last tokens, first tokens) always kept

    def compress_from(self):
        return 0  # the first layer whose cache is compressed
