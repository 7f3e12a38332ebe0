"""Every method's offline face on a store: the captured arrays it reads, its kept sets and rankings.

``method_from_spec("claa:aggregation_window=8")`` builds a method with its own parameters
(the ``--probes`` syntax); ``captured(record, method, store)`` hands it one example's stored
arrays after checking the store recorded them with the settings the method ranks by;
``select_store`` is ``rankkit select``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from rankkit.checks import warn_budgets, warn_timing_only_store
from rankkit.errors import RankkitError
from rankkit.methods import REGISTRY, Budget, Captured, Method, default_capture_probes, make
from rankkit.methods.selection import DRAFT_ARRAY, DRAFT_GROUP, DRAFT_SCORES, ORACLE_SCORES
from rankkit.values import check_number


def parse_method_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``NAME`` or ``NAME:PARAM=VALUE,...`` as (name, parameters): one method, as ``--method`` takes it."""
    from rankkit.probes import parse_named

    named = parse_named(spec, "method")
    if len(named) != 1:
        raise RankkitError(f"name one method, not {spec!r}; e.g. --method claa:aggregation_window=8")
    return named[0]


def method_from_spec(
    spec: str, layer: int | None = None, options: Mapping[str, tuple[str, Any]] | None = None
) -> Method:
    """The method ``NAME`` or ``NAME:PARAM=VALUE,...`` with ``layer`` as its selection layer (``--layer``)
    and the run's ``options`` set: {option: (the parameter it sets, its value, None where not given)},
    e.g. {"--draft": ("draft_model", "layers:4")}; an option contradicting the spec is refused."""
    name, params = parse_method_spec(spec)
    method = make(name, **params)
    set_by_options = {}
    for option, (parameter, value) in (options or {}).items():
        if value is not None:
            _refuse_contradiction(name, params, option, parameter, value)
            set_by_options[parameter] = value
    if set_by_options:
        method = make(name, **{**params, **set_by_options})
    if layer is None:
        return method
    if method.selection_parameter is not None:
        _refuse_contradiction(name, params, "--layer", method.selection_parameter, layer)
    return method.with_layer(layer)


def _refuse_contradiction(name: str, params: Mapping[str, Any], option: str, parameter: str, value: Any) -> None:
    """Refuses ``option`` setting ``parameter`` to ``value`` where the method spec (``name`` with its
    ``params``) gives it another value: neither may silently win (an equal value passes)."""
    if parameter in params and params[parameter] != value:
        raise RankkitError(
            f"{option} {value} contradicts {name}:{parameter}={params[parameter]}; give one of them"
        )


def split_names(spec: str) -> list[str]:
    """``"window:w=32,kernel=7,claa:aggregation_window=8"`` as one entry per probe (its store key) or
    method (``NAME:PARAM=VALUE,...``), in order."""
    from rankkit import probes

    entries = []
    for name, params in probes.parse_named(spec, "probe or method"):
        if name in REGISTRY or name not in probes.REGISTRY:
            given = ",".join(f"{key}={probes.format_parameter(value)}" for key, value in params.items())
            entries.append(name + (f":{given}" if params else ""))
        else:
            entries.append(probes.make(name, **params).key)
    return entries


def is_method(name: str) -> bool:
    return name.partition(":")[0] in REGISTRY


def single_layer_methods(names: Iterable[str]) -> dict[str, str]:
    """Registered methods among ``names`` that select at one layer by one probe's head sum (fastkv,
    gemfilter), each with its probe's key: the single-layer heuristics CLAA is compared with."""
    from rankkit.methods.selection import FixedLayer, PolicyMethod

    found = {}
    for name in names:
        if name not in REGISTRY or not issubclass(REGISTRY[name], PolicyMethod) or name == "oracle":
            continue
        method = make(name).bind(_ANY_DEPTH)
        if isinstance(method.policy(_ANY_DEPTH, 1), FixedLayer):
            found[name] = method.probe().key
    return found


_ANY_DEPTH = 32  # a policy's kind does not depend on the depth


def missing_inputs(method: Method, record, store_meta: Mapping[str, Any]) -> str | None:
    """Why ``record`` lacks what ``method`` ranks by, naming the command that adds it; None if it has it."""
    recorded = store_meta.get("probes") or {}
    for key in method.captured_inputs():
        if key == ORACLE_SCORES:
            if not record.has_oracle:
                return f"method '{method.name}' ranks by the oracle: run `rankkit oracle STORE` first"
            made, wanted = record.attrs.get("oracle_params"), method.oracle_settings()
            if made != wanted:
                return (
                    f"example {record.id!r} holds an oracle made with {made}, but method '{method.name}' "
                    f"ranks by one made with {wanted}; remake it with `rankkit oracle STORE --redo "
                    f"--max-new-tokens {wanted['max_new_tokens']} --kernel {wanted['kernel']}` "
                    "(generated answer, raw logits)"
                )
        elif key == DRAFT_SCORES:
            if DRAFT_GROUP not in record.groups:
                return (
                    f"method '{method.name}' ranks by a draft model's lookahead scores: "
                    "capture them with `rankkit capture --draft SPEC ...`"
                )
            drafted = store_meta.get("draft") or {}
            wanted = method.draft_settings(record.score_shape(record.probes[0])[0])
            made = {key: drafted.get(key) for key in wanted}
            if drafted and made != wanted:
                held, asked = method.drafted_as(made), method.drafted_as(wanted)
                return (
                    f"the store's draft scores were made with {held.partition(':')[2]}, but method '{method.name}' "
                    f"ranks with {asked.partition(':')[2]}; rank with {held} (what the store holds), or capture "
                    "the draft asked for"
                )
        elif key not in record.probes:
            default = any(probe.key == key for probe in default_capture_probes())
            return (
                f"method '{method.name}' ranks by probe {key!r}, which example {record.id!r} lacks: "
                f"capture it with `rankkit capture --probes {key} ...`"
                + (" (the default capture records it)" if default else "")
            )
        elif key in recorded and recorded[key] != method.probe().params():
            return (
                f"probe {key!r} was recorded with {recorded[key]}, but method '{method.name}' "
                f"ranks with {method.probe().params()}; recapture with `rankkit capture --probes {key}`"
            )
    return None


def check_inputs(methods: Iterable[Method], records, store_meta: Mapping[str, Any]) -> None:
    """Refuse, with the fix, when any example lacks what any of ``methods`` ranks by."""
    for method in methods:
        for record in records:
            problem = missing_inputs(method, record, store_meta)
            if problem:
                raise RankkitError(problem)


def recorded_model(store_meta: Mapping[str, Any]) -> dict[str, Any]:
    """What a store recorded of the model's layout (capture's ``run_meta``), as ``Captured``'s fields:
    ``kv_heads`` and ``query_heads``, and ``layer_types`` and ``sliding_window`` for models with local layers only
    (absent: every layer global)."""
    model = store_meta.get("model") or {}
    layout = {key: model[key] for key in ("layer_types", "sliding_window") if key in model}
    for field, key in (("kv_heads", "kv_heads"), ("query_heads", "num_attention_heads")):
        if key in store_meta:
            layout[field] = store_meta[key]
    return layout


def captured(record, method: Method, layout: Mapping[str, Any] | None = None) -> Captured:
    """The arrays of one example ``method`` ranks by, as torch tensors on the CPU; ``layout``
    from ``recorded_model``."""
    arrays: dict[str, torch.Tensor] = {}
    for key in method.captured_inputs():
        if key == ORACLE_SCORES:
            values = record.oracle
        elif key == DRAFT_SCORES:
            values = record.group(DRAFT_GROUP)[DRAFT_ARRAY]
        else:
            values = record.scores(key)
        values = np.asarray(values, dtype=np.float32)
        # a shared read-only array (``ReadOnce``'s) is copied: a method may write into its tensor
        arrays[key] = torch.from_numpy(values if values.flags.writeable else values.copy())
    num_layers = record.score_shape(record.probes[0])[0]
    return Captured(arrays, num_layers, record.num_tokens, **(layout or {}))


def select_store(
    path: str | os.PathLike,
    method: str,
    *,
    keep: float | None = None,
    budget: int | None = None,
    layer: int | None = None,
) -> list[dict[str, Any]]:
    """Per example, the original positions ``method`` (a spec, ``claa:aggregation_window=8``) keeps at
    its selection layer under the keep rate ``keep`` (``--keep``) or the token count ``budget``
    (``--budget``), one of them, from the store alone: ``{"example_id", "method", "layer",
    "budget_tokens", "kept_tokens", "selected_positions"}``; positions are a list, or a list per KV
    head for per-head (KV-only) methods, which report the layer ``layer`` names. ``budget_tokens`` is
    the budget as bench's rows count it (``Method.kept_tokens``), ``kept_tokens`` the positions kept
    (the most any head keeps), fewer where a local layer sees fewer keys or heads share a budget."""
    from rankkit import stores

    if layer is not None:
        check_number(layer, "--layer", whole=True)
    spec = method
    chosen = Budget.one_of(keep, budget)
    method = method_from_spec(spec)
    (label,) = split_names(spec)  # named with its parameters, as compare names it
    shared_layer = layer if method.selection_parameter is None else None
    if shared_layer is None and layer is not None:
        method = method_from_spec(spec, layer)
    store = stores.open(path)
    warn_timing_only_store(store.meta, store.path)
    store.warn_skipped()
    records = list(store.examples())
    if not records:
        raise RankkitError(f"store {path} has no complete example; capture into it first")
    check_inputs([method], records, store.meta)
    warn_budgets([chosen], [method], [record.num_tokens for record in records])
    rows = []
    for record in records:
        example = captured(record, method, recorded_model(store.meta))
        selection = method.select_offline(example, chosen, layer=shared_layer)
        if shared_layer is not None and not selection.per_head:
            where = "before any layer" if selection.layer is None else f"at layer {selection.layer} here"
            raise RankkitError(
                f"method '{label}' keeps one set for every head, selected {where} by its own rule: drop --layer"
            )
        rows.append(
            {
                "example_id": record.id,
                "method": label,
                "layer": selection.layer,
                "budget_tokens": method.kept_tokens(chosen, record.num_tokens),  # as bench's: raised to what it always keeps
                "kept_tokens": selection.size,
                "selected_positions": selection.as_lists(),
            }
        )
    return rows
