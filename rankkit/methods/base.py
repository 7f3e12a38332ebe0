"""What every method shares: the budget, the result of a method's prefill, and the registry.

A method is a small dataclass with paper-named parameters. Layer parameters are
declared once with ``depth_field``: they default to ``None``, meaning "the paper's value
for 32-layer Llama-3.1-8B, scaled to this model's depth", and ``Method.bind`` fills them
in for a given depth (on a hybrid model, a layer the method selects at moves to the nearest
global layer, ``on_global_layers``). A method has two faces: ``prefill`` runs its selection for real
and returns the cache that decoding continues from (decoding and timing are generic,
``rankkit.methods.measure``), and ``select_offline`` computes the same selection from a
store's captured scores (``rankkit.methods.selection`` holds the one rule both use).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from numbers import Integral, Real
from typing import ClassVar

import torch

from rankkit.checks import first_repeated
from rankkit.errors import RankkitError
from rankkit.plugins import construct
from rankkit.runner import GLOBAL_ATTENTION, LayerHook, PrefillResult, Runner
from rankkit.values import as_list, check_number

REFERENCE_LAYERS = 32  # the papers' defaults are given for 32-layer Llama-3.1-8B


def scale_layer(reference_index: int, num_layers: int) -> int:
    """A layer index given for a 32-layer model, at the same relative depth of ``num_layers``."""
    return min(num_layers - 1, max(0, round(reference_index * num_layers / REFERENCE_LAYERS)))


def scale_count(reference_count: int, num_layers: int, minimum: int = 1) -> int:
    """A number of layers given for a 32-layer model, scaled to ``num_layers`` (at least ``minimum``)."""
    return max(minimum, round(reference_count * num_layers / REFERENCE_LAYERS))


def on_global_layers(layers: int | tuple[int, ...], layer_types: Sequence[str] | None):
    """Each layer moved to the nearest global (full-attention) layer of a hybrid model.

    A sliding-window layer cannot see keys older than its window, so it cannot rank the
    whole prompt. Ties go to the earlier layer (it prunes no later than the paper's depth).
    ``layer_types`` as the HF config names them; None or no global layer leaves ``layers`` as given.
    """
    global_layers = [index for index, kind in enumerate(layer_types or ()) if kind == GLOBAL_ATTENTION]
    if not global_layers:
        return layers

    def nearest(layer: int) -> int:
        return min(global_layers, key=lambda index: (abs(index - layer), index))

    if isinstance(layers, int):
        return nearest(layers)
    return tuple(sorted({nearest(layer) for layer in layers}))


AT_DEPTH = "at_depth"  # field metadata: the parameter's value for a model of the given depth
SELECTION = "selection_layer"  # field metadata: the parameter ``--layer`` sets
SELECTS = "selects"  # field metadata: layers the method selects tokens at (defaults on global layers)


BOUNDS = "bounds"  # field metadata: the values the parameter accepts (``Bounds``)


@dataclass(frozen=True)
class Bounds:
    """The values a numeric method parameter accepts, declared once on its field.

    ``low <= value <= high`` (strictly where ``open_low`` / ``open_high``), an integer when
    ``integer``; NaN and text never pass. ``depth_high`` makes the upper end the model's
    depth plus it (a layer index: -1, a number of layers: 0), checked once the depth is
    known. ``each``: the value is a sequence of such numbers (a list of layers).
    ``reference`` names where the paper states the parameter, for the refusal.
    """

    low: float
    high: float = math.inf
    integer: bool = True
    open_low: bool = False
    open_high: bool = False
    depth_high: int | None = None
    each: bool = False
    reference: str = ""

    def problem(self, value, num_layers: int | None) -> str | None:
        """Why ``value`` is refused, or None; without ``num_layers`` a depth-bound end is not checked."""
        if self.each:
            if not isinstance(value, tuple | list) or not value:
                return "is not a list of layers"
            problems = (self.problem_of_one(each, num_layers) for each in value)
            problem = next((problem for problem in problems if problem is not None), None)
            twice = first_repeated(value)
            if problem is None and twice is not None:  # a layer cannot act twice: the faces diverged on it
                return f"names layer {twice} twice; name each layer once"
            return problem
        return self.problem_of_one(value, num_layers)

    def problem_of_one(self, value, num_layers: int | None) -> str | None:
        kind = "an integer" if self.integer else "a number"
        allowed = int if self.integer else int | float
        if isinstance(value, bool) or not isinstance(value, allowed) or math.isnan(value):
            return f"is not {kind}"
        high = self.high if self.depth_high is None or num_layers is None else num_layers + self.depth_high
        below = value < self.low or (self.open_low and value == self.low)
        # an unbounded end is printed open, "[0, inf)": inf itself is no setting (tau=inf selects like any huge tau, unseen)
        above = value > high or ((self.open_high or math.isinf(high)) and value == high)
        if not (below or above):
            return None
        if self.depth_high is not None and num_layers is None:  # the model's depth L is not known yet
            high_text, right = ("L" if self.depth_high == 0 else f"L{self.depth_high:+d}"), "]"
        elif math.isinf(high):
            high_text, right = "inf", ")"
        else:
            high_text, right = f"{high:g}", ")" if self.open_high else "]"
        left = "(" if self.open_low else "["
        where = f" ({self.reference})" if self.reference else ""
        return f"is outside {left}{self.low:g}, {high_text}{right}{where}"


def bounded(default: float, low: float, high: float = math.inf, **bounds):
    """A numeric parameter with its default and the values it accepts (``Bounds``; integer when
    ``default`` is an int)."""
    integer = isinstance(default, int)
    return field(default=default, metadata={BOUNDS: Bounds(low, high, integer=integer, **bounds)})


def declared_bounds(method: type[Method], name: str) -> Bounds:
    """The ``Bounds`` declared on ``method``'s parameter ``name``: for a value that is not passed
    as that parameter yet must take the same values (``rankkit variance --thresholds``, asl's tau)."""
    return next(spec.metadata[BOUNDS] for spec in fields(method) if spec.name == name)


LAYER = Bounds(0, depth_high=-1)  # a layer index of the model
LAYERS = Bounds(0, depth_high=-1, each=True)  # a list of layer indices


def depth_field(
    at_depth: Callable[[int], int],
    *,
    selection: bool = False,
    selects: bool = False,
    bounds: Bounds | None = None,
):
    """A layer parameter whose default depends on the model's depth: ``at_depth(num_layers)``.

    ``selection`` marks the layer a method selects at, the one ``--layer`` sets; it and
    ``selects`` (other layers the method selects tokens at) default to global layers.
    ``bounds``: the values it accepts (``LAYER``, ``LAYERS``; None for a non-number).
    """
    metadata = {AT_DEPTH: at_depth, SELECTION: selection, SELECTS: selection or selects}
    return field(default=None, metadata=metadata | ({} if bounds is None else {BOUNDS: bounds}))


def paper_layer(reference_index: int, *, selection: bool = False):
    """A layer index the paper gives for 32 layers, scaled to the model's depth (``scale_layer``)."""
    return depth_field(functools.partial(scale_layer, reference_index), selection=selection, bounds=LAYER)


def paper_count(reference_count: int, minimum: int = 1):
    """A number of layers the paper gives for 32 layers, scaled to the model's depth (``scale_count``):
    from ``minimum`` to the model's depth."""
    return depth_field(
        functools.partial(scale_count, reference_count, minimum=minimum), bounds=Bounds(minimum, depth_high=0)
    )


def check_parameters(method: Method, num_layers: int | None = None) -> None:
    """Refuse a parameter outside its declared ``Bounds`` (the depth-bound ones once ``num_layers`` is known).

    The one check of every method's values: ``make`` runs it on construction, ``Method.bind``
    once the depth is known, so the CLI, the Python API and sweeps refuse alike.
    """
    for name in method.unread_parameters():
        if getattr(method, name) != next(spec.default for spec in fields(method) if spec.name == name):
            raise RankkitError(f"method '{method.name}': {method.unread_reason()} reads no {name}; drop it")
    for spec in fields(method):
        value = getattr(method, spec.name)
        if BOUNDS not in spec.metadata or value is None:
            continue
        problem = spec.metadata[BOUNDS].problem(value, num_layers)
        if problem is not None:
            hint = "; pick a layer with --layer" if spec.metadata.get(SELECTION) else ""
            raise RankkitError(f"method '{method.name}': {spec.name}={value!r} {problem}{hint}")


# what a command that needs a budget asks for when it has none, or two
ONE_BUDGET = "exactly one of --keep (e.g. 0.1) or --budget (e.g. 2048)"


@dataclass(frozen=True)
class Budget:
    """How many prompt tokens a method keeps: a keep rate or an absolute count.

    Tokens a method must always keep (its observation window, sinks) count inside the
    budget; a budget smaller than them is raised to them.
    """

    keep: float | None = None
    tokens: int | None = None

    def __post_init__(self):
        if (self.keep is None) == (self.tokens is None):
            raise RankkitError(f"a budget is {ONE_BUDGET}, got keep={self.keep!r}, tokens={self.tokens!r}")
        for value, option in ((self.keep, "--keep"), (self.tokens, "--budget")):
            if value is not None:  # the text "0.1" is no rate outside (0, 1]: say what it is
                check_number(value, option)
        if self.keep is not None and not (is_number(self.keep, Real) and 0 < self.keep <= 1):
            raise RankkitError(
                f"keep rate {_shown(self.keep)} is outside (0, 1]: use e.g. --keep 0.1, or --budget for a token count"
            )
        if self.tokens is not None and not (is_number(self.tokens, Integral) and self.tokens >= 1):
            raise RankkitError(f"budget {_shown(self.tokens)} is not a positive token count: use e.g. --budget 2048")

    @classmethod
    def from_keep(cls, keep: float) -> Budget:
        return cls(keep=keep)

    @classmethod
    def from_tokens(cls, tokens: int) -> Budget:
        return cls(tokens=tokens)

    @classmethod
    def one_of(cls, keep: float | None, tokens: int | None, default: Budget | None = None) -> Budget:
        """The budget of ``--keep`` (a rate) or of ``--budget`` (tokens), exactly one of them given, or
        ``default`` where there is one and neither is given."""
        if keep is None and tokens is None and default is not None:
            return default
        if (keep is None) == (tokens is None):
            raise RankkitError(f"give {ONE_BUDGET}")
        return cls.from_keep(keep) if keep is not None else cls.from_tokens(tokens)

    @classmethod
    def parse(cls, value: Budget | float | int, option: str = "--keep") -> Budget:
        """A keep rate (a float in (0, 1]) or a token count (an int), or a Budget as it is; a refusal
        names ``option``."""
        if isinstance(value, Budget):
            return value
        check_number(value, option)
        if isinstance(value, float) and 0 < value <= 1:
            return cls.from_keep(value)
        if is_number(value, int) and value >= 1:
            return cls.from_tokens(value)
        raise RankkitError(
            f"{option} {_shown(value)} is neither a keep rate in (0, 1] nor a positive token count; "
            "give e.g. 0.1 or 2048"
        )

    def resolve(self, prompt_length: int, always_kept: int = 0) -> int:
        """The number of tokens kept: ceil(keep x T) or the count, at least ``always_kept`` and 1, at most T.

        Rounding up keeps at least the asked share; every kept-set size in rankkit comes from here.
        """
        wanted = self.tokens if self.tokens is not None else math.ceil(self.keep * prompt_length)
        return min(prompt_length, max(wanted, always_kept, 1))

    @property
    def label(self) -> str:
        # 15 significant digits: exact for any rate written by hand, so no two rates share a label
        return f"keep={self.keep:.15g}" if self.tokens is None else f"budget={self.tokens}"

    @property
    def number(self) -> float | int:
        """The keep rate (a float, even for ``keep=1``) or the token count (an int): the budget as
        ``parse`` reads it back, and as compare's ``keep`` and ``needle_keep`` columns hold it."""
        return float(self.keep) if self.tokens is None else self.tokens

    @property
    def keywords(self) -> dict[str, float | int | None]:
        """The budget as ``compare_store`` and ``variance_store`` take it: ``keep=`` (``--keep``) or
        ``budget=`` (``--budget``)."""
        return {"keep": self.keep, "budget": self.tokens}

    @property
    def share(self) -> str:
        """How a caption's prose says the budget: a share of the prompt ("10%") or a count ("64 tokens")."""
        return f"{self.keep * 100:g}%" if self.tokens is None else f"{self.tokens} tokens"

    @property
    def printed(self) -> str:
        """How tables and figures print the budget (a keep rate to 6 significant digits, ``:g``)."""
        return f"keep={self.keep:g}" if self.tokens is None else self.label


def is_number(value, kind: type) -> bool:
    """Whether ``value`` is of the numeric ``kind``, a bool not counted (Python's True is an int)."""
    return isinstance(value, kind) and not isinstance(value, bool)


def _shown(value) -> str:
    """A number as typed (1.5, not np.float64(1.5)); anything else quoted, so "0.1" reads as text."""
    return str(value) if is_number(value, Real) else repr(value)


def distinct_budgets(budgets: Sequence[Budget], where: str) -> list[Budget]:
    """``budgets``, refused where two read alike (``keep=0.1`` twice, or 0.1 and 0.10000001, which
    tables and figures both print as keep 0.1): one budget's rows could not be told from the other's."""
    same = first_repeated([budget.printed for budget in budgets])
    if same is not None:
        labels = [budget.label for budget in budgets if budget.printed == same]
        alike = "" if labels[0] == labels[1] else f" ({labels[0]} and {labels[1]})"
        raise RankkitError(f"{where}: two budgets both read {same}{alike}; name each once")
    return list(budgets)


def distinct_labels(labels: Sequence[str], specs: Sequence[str], fix: str) -> None:
    """Refuse two of ``specs`` (as given) whose rows would carry one label (``labels``, in step):
    one setting's numbers would stand for both. ``fix`` says how to run them apart."""
    twice = first_repeated(labels)
    if twice is not None:
        given = ", ".join(spec for spec, label in zip(specs, labels, strict=True) if label == twice)
        raise RankkitError(
            f"{twice} is named twice ({given}): rows are labelled by method, so one setting's numbers "
            f"would stand for both; {fix}"
        )


def budget_keywords(budgets: Sequence[Budget]) -> dict[str, list]:
    """``budgets``, all keep rates or all token counts, as the keywords ``bench`` and ``compare_keeps``
    take them (``given_budgets``): ``keep=[...]`` or ``budget=[...]``."""
    rates = [each.keep for each in budgets if each.tokens is None]
    counts = [each.tokens for each in budgets if each.tokens is not None]
    if rates and counts:
        raise RankkitError(f"{ONE_BUDGET}, not both: give keep rates or token counts")
    return {"budget": counts} if counts else {"keep": rates}


# how a budget option's text is read, and what a refusal of it suggests
_BUDGET_NUMBERS = {
    "--keep": (float, "a keep rate; give e.g. --keep 0.1"),
    "--budget": (int, "a token count; give e.g. --budget 2048, or --keep 0.1 for a share of the prompt"),
}


def given_budgets(keep=None, budget=None, *, required: bool = True) -> list[Budget]:
    """The budgets of ``keep=`` (keep rates, ``--keep``) or ``budget=`` (token counts, ``--budget``),
    each a list, one value, or the command line's comma-separated text; at most one of the two, and
    one of them where ``required``. Every command and function that takes budgets reads them here."""
    if keep is not None and budget is not None or (required and keep is None and budget is None):
        raise RankkitError(f"give {ONE_BUDGET}")
    option, values = ("--keep", keep) if keep is not None else ("--budget", budget)
    if values is None:
        return []
    kind, fix = _BUDGET_NUMBERS[option]
    numbers = as_list(values, option, kind, fix)
    if not numbers:
        raise RankkitError(f"{option} names no budget; {fix}")
    build = Budget.from_keep if option == "--keep" else Budget.from_tokens
    return distinct_budgets([build(number) for number in numbers], option)


LOOKAHEAD = "lookahead"  # the label of a draft's decode steps (SpecPrefill), one query per layer


@dataclass
class Pass:
    """One walk through a model's layers: how many queries and keys each executed layer saw.

    ``keys`` differs from ``queries`` only for decode steps (one query over a cache);
    ``ffn_queries`` from ``queries`` only where a layer's FFN ran on fewer tokens than its
    attention (SlimInfer prunes between the two).
    """

    label: str  # "main", "selection", "draft", "lookahead"
    queries: list[int]
    keys: list[int]
    ffn_queries: list[int] | None = None  # None: each layer's FFN ran on its queries
    heads: int = 0  # tokens its LM head ran on as decode steps do (a draft's lookahead)

    @classmethod
    def prefill(cls, label: str, live_tokens: list[int]) -> Pass:
        return cls(label, list(live_tokens), list(live_tokens))

    def layers(self) -> list[tuple[int, int, int]]:
        """(queries, keys, FFN queries) of each executed layer."""
        ffn_queries = self.queries if self.ffn_queries is None else self.ffn_queries
        return list(zip(self.queries, self.keys, ffn_queries, strict=True))


@dataclass
class MethodPrefill:
    """A method's prefill: the cache and first logits decoding starts from, and what it cost."""

    result: PrefillResult
    passes: list[Pass]
    kept_positions: torch.Tensor | None = None  # original positions of the tokens a shared selection kept
    selection_layer: int | None = None
    decode_hooks: list[LayerHook] = field(default_factory=list)

    @property
    def live_tokens(self) -> list[int]:
        """Tokens entering each layer in the pass that built the cache."""
        return self.result.live_tokens


@dataclass
class Selection:
    """The tokens a method keeps at its selection layer, as original prompt positions (sorted).

    ``positions`` is [k] for a shared selection, [kv_heads, k] for per-head (KV-only) methods,
    or a list of [k_h] per KV head when heads keep different counts (LAVa);
    ``layer`` is None for methods that select before any layer of the model (a draft's ranking).
    """

    layer: int | None
    positions: torch.Tensor | list[torch.Tensor]

    def as_lists(self) -> list[int] | list[list[int]]:
        if isinstance(self.positions, list):
            return [head.tolist() for head in self.positions]
        return self.positions.tolist()

    @property
    def per_head(self) -> bool:
        """True for a set per KV head (KV-only methods), False for one set every head shares."""
        return isinstance(self.positions, list) or self.positions.dim() == 2

    @property
    def size(self) -> int:
        """Tokens kept (per KV head, the most any head keeps)."""
        if isinstance(self.positions, list):
            return max(head.numel() for head in self.positions)
        return int(self.positions.shape[-1])


@dataclass
class Method:
    """Base of every method; subclasses set ``name`` and implement ``prefill``.

    The offline face: ``captured_inputs`` names the store arrays the method ranks by (probe
    keys, or ``DRAFT_SCORES`` / ``ORACLE_SCORES``) and ``select_offline`` / ``layer_rankings``
    compute its kept set and rankings from them. Methods without one raise.
    """

    name: ClassVar[str] = ""
    # A method whose offline face is this other one's (they differ only in how they prefill).
    ranks_like: ClassVar[type[Method] | None] = None

    def unread_parameters(self) -> tuple[str, ...]:
        """Parameters this configuration of the method never reads (the oracle's gemfilter mirror has
        no layer): ``bind`` leaves them unset, and a value other than the default is refused
        (``check_parameters``), since it would change nothing."""
        return ()

    def unread_reason(self) -> str:
        """What makes ``unread_parameters`` unread, as a refusal names it."""
        return ""

    def minimum_keep(self) -> int:
        """The fewest prompt tokens the method keeps whatever the budget (what it always keeps:
        a window, sinks, a block); a smaller budget is raised to it."""
        return 1

    def kept_tokens(self, budget: Budget, prompt_length: int) -> int:
        """How many of ``prompt_length`` tokens ``budget`` keeps (per KV head, for a method keeping a
        set per head): the one count the method's prefill, its offline face and every report use."""
        return budget.resolve(prompt_length, self.minimum_keep())

    def offline_key(self) -> tuple:
        """Equal for two methods whose ``layer_rankings`` and ``select_offline`` are the same
        computation, so a caller can rank once for both: the same class (or ``ranks_like``)
        with the same parameters."""
        return (self.ranks_like or type(self), tuple(getattr(self, spec.name) for spec in fields(self)))

    def prepare(self, runner: Runner, input_ids: torch.Tensor, *, tokenizer) -> None:
        """Untimed work on a prompt before its runs (the oracle's offline ranking); most methods need none."""

    def prefill(self, runner: Runner, input_ids: torch.Tensor, budget: Budget) -> MethodPrefill:
        raise NotImplementedError

    def prefill_for_decoding(self, runner: Runner, input_ids: torch.Tensor, budget: Budget) -> MethodPrefill:
        """``prefill``, each local layer then left holding only the keys its window saw, rolled in
        decoding (``Runner.roll_local_layers``), as transformers' sliding-window cache holds them: the
        cache a decode starts from, whose bytes a run reports."""
        run = self.prefill(runner, input_ids, budget)
        runner.roll_local_layers(run.result)
        return run

    def bind(self, num_layers: int, layer_types: Sequence[str] | None = None):
        """This method with every depth-dependent parameter left ``None`` set for a ``num_layers``-deep model.

        ``layer_types`` (``Runner.layer_types``, a store's ``model.layer_types``; None: every
        layer global) moves the default layers the method selects at to global layers; a
        value set explicitly (``--layer``) is kept as given.
        """
        filled = {}
        unread = self.unread_parameters()
        for spec in fields(self):
            if AT_DEPTH in spec.metadata and getattr(self, spec.name) is None and spec.name not in unread:
                value = spec.metadata[AT_DEPTH](num_layers)
                filled[spec.name] = on_global_layers(value, layer_types) if spec.metadata[SELECTS] else value
        bound = replace(self, **filled)
        check_parameters(bound, num_layers)
        return bound

    def resolved(self, num_layers: int, layer_types: Sequence[str] | None = None) -> dict:
        """The parameters with depth-scaled defaults filled in, as a run records them (state such as
        a precomputed ranking, declared with ``repr=False``, is not a parameter)."""
        bound = self.bind(num_layers, layer_types)
        return {spec.name: getattr(bound, spec.name) for spec in fields(bound) if spec.repr}

    @property
    def selection_parameter(self) -> str | None:
        """The name of the parameter holding the selection layer, or None (also where this
        configuration selects at no layer: ``unread_parameters``)."""
        name = next((spec.name for spec in fields(self) if spec.metadata.get(SELECTION)), None)
        return None if name in self.unread_parameters() else name

    def with_layer(self, layer: int) -> Method:
        """This method with its selection layer set (``--layer``); methods without one refuse."""
        if self.selection_parameter is None:
            raise RankkitError(f"method '{self.name}' has no selection layer to set; drop --layer")
        return replace(self, **{self.selection_parameter: layer})

    def captured_inputs(self) -> list[str]:
        """The store arrays ``select_offline`` reads: probe keys, ``DRAFT_SCORES`` or ``ORACLE_SCORES``."""
        raise RankkitError(f"method '{self.name}' has no offline face: it ranks nothing a store captures")

    def select_offline(self, captured, budget: Budget, *, layer: int | None = None) -> Selection:
        """The tokens ``prefill`` would keep, from the captured arrays ``captured_inputs`` names
        (a ``rankkit.methods.selection.Captured``); ``layer`` picks a per-head method's layer."""
        raise RankkitError(f"method '{self.name}' has no offline face: it ranks nothing a store captures")

    def layer_rankings(self, captured, budget: Budget) -> dict[int | None, torch.Tensor]:
        """The method's token scores [T] (forced tokens at +inf) at each layer it could select at."""
        raise RankkitError(f"method '{self.name}' has no offline face: it ranks nothing a store captures")


REGISTRY: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    REGISTRY[cls.name] = cls
    return cls


def make(name: str, **params) -> Method:
    """A method by registry name with its parameters overridden by ``params``."""
    if name not in REGISTRY:
        raise RankkitError(f"unknown method '{name}'; known: {', '.join(sorted(REGISTRY))}")
    method = construct(REGISTRY[name], f"method '{name}'", params)
    check_parameters(method)
    return method


def make_probe(name: str, **params):
    """A probe from ``rankkit.probes`` (imported late: methods load without the probes package)."""
    from rankkit import probes

    return probes.make(name, **params)


def full_prefill(runner: Runner, input_ids: torch.Tensor, hooks=()) -> MethodPrefill:
    result = runner.prefill(input_ids, hooks=hooks)
    return MethodPrefill(result, [Pass.prefill("main", result.live_tokens)])


def reprefill_selected(
    runner: Runner,
    input_ids: torch.Tensor,
    kept_positions: torch.Tensor,
    selection_passes: list[Pass],
    selection_layer: int | None,
) -> MethodPrefill:
    """The second pass of a two-pass method: only the kept tokens, at their original positions.

    ``selection_passes`` are the passes that found the selection (they count in the method's cost).
    """
    kept_positions = torch.sort(kept_positions.to(input_ids.device)).values
    result = runner.prefill(
        input_ids.reshape(-1)[kept_positions], positions=kept_positions, prompt_length=int(input_ids.numel())
    )
    return MethodPrefill(
        result,
        [*selection_passes, Pass.prefill("main", result.live_tokens)],
        kept_positions=kept_positions,
        selection_layer=selection_layer,
    )
