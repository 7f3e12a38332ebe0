"""Token-scoring probes, registered by name, and the hook that records them during a prefill.

Every probe returns float32 [kv_heads, S] per layer from the post-RoPE Q/K/V the runner
exposes, without an S x S matrix. Importing this package registers all of them, then the
probes other packages declare under the entry point group ``rankkit.probes``.
Like the oracle, the probes score the attention the model computes: capped logits, sinks
in the softmax, and a local layer's sliding window in the mask (see ``attention.py``);
``ProbeRecorder`` stores NaN for keys a local layer cannot see.
"""

from __future__ import annotations

from rankkit.errors import RankkitError
from rankkit.plugins import construct, register_entry_points

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
    "parse_named",
    "parse_probes",
    "register",
]


def make(name: str, **params) -> Probe:
    """The probe registered as ``name``, with ``params`` overriding its paper defaults."""
    if name not in REGISTRY:
        raise RankkitError(f"unknown probe {name!r}; known: {', '.join(sorted(REGISTRY))}")
    return construct(REGISTRY[name], f"probe {name!r}", params)


PROBES_SYNTAX = (
    "comma-separated names, each NAME or NAME:PARAM=VALUE,PARAM=VALUE... "
    "(e.g. window:w=32,kernel=7,last_token_raw; w = window_size, kernel = kernel_size; "
    "a list joined by ';', e.g. sliminfer:pruning_layers=9;19;28), or 'all'"
)


def parse_named(spec: str, what: str = "probe") -> list[tuple[str, dict]]:
    """``"window:w=32,kernel=7,last_token_raw"`` as [(name, params)], in order (see ``PROBES_SYNTAX``).

    An item holding "=" is a parameter of the name before it; any other item is a name. Short
    parameter names (``SHORT_NAMES``) are expanded; values are int, float or text.
    """
    named: list[tuple[str, dict]] = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        name, colon, first = item.partition(":")
        if "=" in name and not colon:
            if not named:
                raise RankkitError(f"parameter {item!r} comes before any {what}; give {PROBES_SYNTAX}")
            _add_parameter(named[-1][1], item, spec)
            continue
        named.append((name.strip(), {}))
        if first:
            _add_parameter(named[-1][1], first, spec)
    if not named:
        raise RankkitError(f"no {what} named; give {PROBES_SYNTAX}")
    return named


def parse_probes(spec: str) -> list[Probe]:
    """Probes from ``"window:w=32,kernel=7,last_token_raw"`` (see ``parse_named``), or ``"all"``
    (every registered probe at its defaults). A setting named twice, in any spelling, is refused as a
    sweep file's list refuses a repeat: the second would be silently dropped from the store."""
    if spec.strip() == "all":
        return [make(name) for name in REGISTRY]
    probes: dict[str, Probe] = {}
    for name, params in parse_named(spec):
        probe = make(name, **params)
        if probe.key in probes:
            raise RankkitError(
                f"{spec!r} names the probe setting {probe.key!r} twice (a parameter at its default is "
                "the plain name); name each probe once"
            )
        probes[probe.key] = probe
    return list(probes.values())


def _add_parameter(params: dict, item: str, spec: str) -> None:
    key, _, text = item.partition("=")
    key, text = key.strip(), text.strip()
    full = {short: name for name, short in SHORT_NAMES.items()}.get(key, key)
    if full in params:  # the last would win, and the run be labelled with a setting it did not use
        raise RankkitError(f"{full} is given twice in {spec!r}; give each parameter once")
    # "," separates the parameters, so a list (of layers) is joined by ";"
    parts = [_value(part.strip()) for part in text.split(";")]
    params[full] = tuple(parts) if ";" in text else parts[0]


def _value(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def format_parameter(value) -> str:
    """A parameter's value as a spec writes it (``parse_named`` reads it back): a list joined by ';'."""
    return ";".join(map(str, value)) if isinstance(value, tuple | list) else str(value)


# Last, so a package's module finds everything above when its import registers its classes.
register_entry_points("rankkit.probes", REGISTRY, register)
