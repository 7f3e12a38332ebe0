"""Token-scoring probes, registered by name, and the hook that records them during a prefill.

Every probe returns float32 [kv_heads, S] per layer from the post-RoPE Q/K/V the runner
exposes, without an S x S matrix. Importing this package registers all of them.
Like the oracle, the probes rank by full causal attention logits and ignore a model's
sliding window (see ``attention.py``).
"""

from __future__ import annotations

from rankkit.errors import RankkitError

from .base import REGISTRY, SHORT_NAMES, Probe, register
from .last_token_heads import LastTokenHeadsProbe
from .last_token_raw import LastTokenRawProbe
from .lava import LavaProbe
from .recorder import ProbeRecorder
from .token_units import TokenUnitsProbe
from .window import WindowProbe

__all__ = [
    "REGISTRY",
    "LastTokenHeadsProbe",
    "LastTokenRawProbe",
    "LavaProbe",
    "Probe",
    "ProbeRecorder",
    "TokenUnitsProbe",
    "WindowProbe",
    "make",
    "parse_probes",
    "register",
]


def make(name: str, **params) -> Probe:
    """The probe registered as ``name``, with ``params`` overriding its paper defaults."""
    if name not in REGISTRY:
        raise RankkitError(f"unknown probe {name!r}; known: {', '.join(sorted(REGISTRY))}")
    try:
        return REGISTRY[name](**params)
    except TypeError as error:  # an unknown parameter name
        raise RankkitError(f"probe {name!r}: {error}") from error


PROBES_SYNTAX = (
    "comma-separated probes, each NAME or NAME:PARAM=VALUE,PARAM=VALUE... "
    "(e.g. window:w=32,kernel=7,last_token_raw; w = window_size, kernel = kernel_size), or 'all'"
)


def parse_probes(spec: str) -> list[Probe]:
    """Probes from ``"window:w=32,kernel=7,last_token_raw"`` (see ``PROBES_SYNTAX``), or ``"all"``
    (every registered probe at its defaults).

    An item holding "=" is a parameter of the probe before it; any other item names a probe.
    """
    if spec.strip() == "all":
        return [make(name) for name in REGISTRY]
    named: list[tuple[str, dict]] = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        name, colon, first = item.partition(":")
        if "=" in name and not colon:
            if not named:
                raise RankkitError(f"parameter {item!r} comes before any probe; give {PROBES_SYNTAX}")
            _add_parameter(named[-1][1], item)
            continue
        named.append((name.strip(), {}))
        if first:
            _add_parameter(named[-1][1], first)
    if not named:
        raise RankkitError(f"no probe named; give {PROBES_SYNTAX}")
    probes = {}
    for name, params in named:
        probe = make(name, **params)
        probes.setdefault(probe.key, probe)
    return list(probes.values())


def _add_parameter(params: dict, item: str) -> None:
    key, _, text = item.partition("=")
    key = key.strip()
    full = {short: name for name, short in SHORT_NAMES.items()}.get(key, key)
    try:
        params[full] = int(text)
    except ValueError:
        params[full] = text.strip()
