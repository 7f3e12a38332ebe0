"""An experiment file: the grid ``rankkit sweep`` runs, read from TOML into checked dataclasses.

docs/sweeps.md shows every field with an example. ``read_experiment`` checks what the file
alone decides (unknown fields, types, stage names, data specs, probes, budgets, oracle
settings) and raises ``RankkitError`` with one line naming the field and an example of it;
``rankkit.sweep`` checks what needs the model's config or the stores (layers, prompt
lengths, method names against the probes) before any weights load.

Options left out keep the default of the library call (and the command) they mirror, so
``[compare] span`` is ``compare_store``'s ``span`` and ``rankkit compare --span``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import tomllib
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankkit import defaults, outputs
from rankkit.bench import BenchSettings, MethodOptions
from rankkit.capture import OracleOptions, capture_probes
from rankkit.checks import first_repeated
from rankkit.data import format_spec, parse_spec, read_spec
from rankkit.errors import RankkitError
from rankkit.methods import Budget
from rankkit.methods.base import distinct_budgets
from rankkit.stores import check_score_dtype

# The order stages run in whatever order the file lists them: the model stages first (every
# rank takes its share of the examples), then those reading the stores (rank 0 alone).
STAGES = ("capture", "oracle", "bench", "diffusion", "compare", "variance", "dashboard")
MODEL_STAGES = ("capture", "oracle", "bench", "diffusion")
# The most units of work a sweep takes on unless told (``--max-units``): an example through one
# model stage, or one unit of a stage reading the stores. Past it a grid is a typo, not a plan.
MAX_UNITS = 100_000
_CELL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=-]{0,99}")  # a file name with room for its suffixes


@dataclass(frozen=True)
class Kind:
    """What a field's value may be, and how it is stored once read."""

    description: str
    accepts: Callable[[Any], bool]
    convert: Callable[[Any], Any] = lambda value: value


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return _is_integer(value) or isinstance(value, float)


def _is_string(value: Any) -> bool:
    return isinstance(value, str)


def _list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, list) and all(check(item) for item in value)


def _one_or_list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: check(value) or _list_of(check)(value)


def _as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, list) else (value,)


STRING = Kind("a string", _is_string)
INTEGER = Kind("an integer", _is_integer)
BOOLEAN = Kind("true or false", lambda value: isinstance(value, bool))
NUMBER = Kind("a number", _is_number)
STRINGS = Kind("a list of strings", _list_of(_is_string), tuple)
# a comma-separated string as the command line takes it, or its parts as a list
NAMES = Kind(
    "a string or a list of strings",
    _one_or_list_of(_is_string),
    lambda value: value if isinstance(value, str) else ",".join(value),
)
INTEGERS = Kind("an integer or a list of integers", _one_or_list_of(_is_integer), _as_tuple)
NUMBERS = Kind(
    "a number or a list of numbers",
    _one_or_list_of(_is_number),
    lambda value: tuple(float(item) for item in _as_tuple(value)),
)


@dataclass(frozen=True)
class Field:
    kind: Kind
    example: str  # one line of TOML, as docs/sweeps.md shows it
    minimum: int | None = None


TOP_FIELDS = {
    "name": Field(STRING, 'name = "rankings"'),
    "description": Field(STRING, 'description = "CLAA Fig. 2 on five tasks"'),
    "stages": Field(STRINGS, 'stages = ["capture", "oracle", "compare", "variance"]'),
    "probes": Field(NAMES, 'probes = ["window", "window:w=32", "last_token_raw"]'),
    "methods": Field(STRINGS, 'methods = ["full", "claa", "fastkv"]'),
    "keep": Field(NUMBERS, "keep = [0.1, 0.2, 0.4]"),
    "budget": Field(INTEGERS, "budget = [512, 1024]", minimum=1),
    "layers": Field(INTEGERS, "layers = [12, 14]", minimum=0),
}
DATA_FIELDS = {
    "spec": Field(STRING, 'spec = "niah:n=50,length=2048"'),
    "name": Field(STRING, 'name = "niah"'),
    "kind": Field(STRING, 'kind = "ruler"'),
    "tasks": Field(STRINGS, 'tasks = ["niah_single_2", "vt"]'),
    "lengths": Field(INTEGERS, "lengths = [2048, 4096]", minimum=1),
    "n": Field(INTEGER, "n = 50", minimum=1),
    "depths": Field(NUMBERS, "depths = [10, 50, 90]"),
    "seed": Field(INTEGER, "seed = 1", minimum=0),
}
TABLE_FIELDS = {
    "model": {
        "name": Field(STRING, 'name = "default"'),
        "device": Field(STRING, 'device = "cpu"'),
        "device_map": Field(STRING, 'device_map = "auto"'),
        "allow_overlength": Field(BOOLEAN, "allow_overlength = true"),
    },
    "capture": {
        "draft": Field(STRING, 'draft = "layers:8"'),
        "score_dtype": Field(STRING, 'score_dtype = "float16"'),
    },
    "oracle": {
        "answer": Field(STRING, 'answer = "reference"'),
        "softmax": Field(BOOLEAN, "softmax = true"),
        "kernel": Field(INTEGER, "kernel = 7"),  # their ranges: OracleOptions's own check
        "max_new_tokens": Field(INTEGER, "max_new_tokens = 32"),
    },
    "compare": {
        "methods": Field(NAMES, 'methods = ["window:w=32", "claa", "claa:aggregation_window=8"]'),
        "span": Field(STRING, 'span = "context"'),
        "oracle": Field(BOOLEAN, "oracle = false"),
        "pairs": Field(STRINGS, 'pairs = ["claa:fastkv", "claa:gemfilter"]'),
        "needle_keep": Field(NUMBER, "needle_keep = 0.1"),
    },
    "variance": {
        "method": Field(STRING, 'method = "asl:window_size=32"'),
        "min_layer": Field(INTEGER, "min_layer = 10", minimum=0),
        "observed_layers": Field(INTEGER, "observed_layers = 8", minimum=1),
        "thresholds": Field(NUMBERS, "thresholds = [0.2, 0.3, 0.4]"),
    },
    "bench": {
        "methods": Field(STRINGS, 'methods = ["full", "gemfilter", "fastkv", "claa"]'),
        "max_new_tokens": Field(INTEGER, "max_new_tokens = 16", minimum=1),
        "warmup": Field(INTEGER, "warmup = 0", minimum=0),
        "repeats": Field(INTEGER, "repeats = 3", minimum=1),
        "draft": Field(STRING, 'draft = "layers:8"'),
        "mirror": Field(STRING, 'mirror = "claa"'),
        "limit": Field(INTEGER, "limit = 4", minimum=1),
        "cuda_graphs": Field(BOOLEAN, "cuda_graphs = true"),
        "compile_decode": Field(BOOLEAN, "compile_decode = true"),
    },
    "diffusion": {
        "max_new_tokens": Field(INTEGER, "max_new_tokens = 16", minimum=1),
        "limit": Field(INTEGER, "limit = 2", minimum=1),
    },
}


# the stages that read each table's settings (the dashboards draw needle recall at compare's needle keep)
TABLE_READERS = {
    "capture": {"capture"},
    "oracle": {"oracle"},
    "compare": {"compare", "dashboard"},
    "variance": {"variance"},
    "bench": {"bench"},
    "diffusion": {"diffusion"},
}


@dataclass(frozen=True)
class DataCell:
    """One data spec of the grid: its own store, and the rows it adds to every stage's parquet."""

    name: str  # file-safe, unique in the experiment: stores/<name>.zarr
    spec: str
    dataset: str  # niah, the RULER task, or the jsonl file's stem
    length: int | None  # the spec's length=, None for a jsonl file

    def columns(self) -> dict[str, Any]:
        """The columns naming this cell in every stage's parquet."""
        return {"cell": self.name, "dataset": self.dataset, "data_length": self.length, "data": self.spec}


@dataclass(frozen=True)
class ModelSettings:
    name: str = defaults.MODEL
    device: str = defaults.DEVICE
    device_map: str | None = None
    allow_overlength: bool = False


def given_settings(settings: Any) -> dict[str, Any]:
    """A settings table's fields as its library call's keywords, those left out (None) omitted so the
    library's own defaults hold: every field is named as the call's parameter."""
    values = {spec.name: getattr(settings, spec.name) for spec in dataclasses.fields(settings)}
    return {name: value for name, value in values.items() if value is not None}


@dataclass(frozen=True)
class CaptureSettings:
    draft: str | None = None  # SpecPrefill's draft scores are captured only when named
    score_dtype: str = defaults.SCORE_DTYPE


@dataclass(frozen=True)
class CompareSettings:
    """``compare_store``'s options; None leaves the library's default."""

    methods: str | None = None
    span: str | None = None
    oracle: bool | None = None
    pairs: str | None = None
    needle_keep: float | None = None  # None: each unit's keep

    def kwargs(self) -> dict[str, Any]:
        return given_settings(self)


@dataclass(frozen=True)
class VarianceSettings:
    """``variance_store``'s options; None leaves the library's default."""

    method: str | None = None
    min_layer: int | None = None
    observed_layers: int | None = None
    thresholds: tuple[float, ...] | None = None

    def kwargs(self) -> dict[str, Any]:
        return given_settings(self)

    def curve_kwargs(self) -> dict[str, Any]:
        """The settings that draw the curve (``variance.curve_method``'s): the thresholds only read it."""
        return {name: value for name, value in self.kwargs().items() if name != "thresholds"}


@dataclass(frozen=True)
class BenchStage:
    methods: tuple[str, ...] = ()
    settings: BenchSettings = BenchSettings()
    draft: str | None = None
    mirror: str | None = None  # the oracle's own default, fastkv
    limit: int | None = None
    cuda_graphs: bool = False  # ``Setup``'s, for the bench stage alone
    compile_decode: bool = False

    def options(self, layer: int | None) -> MethodOptions:
        return MethodOptions(layer, self.draft, self.mirror)


@dataclass(frozen=True)
class DiffusionSettings:
    max_new_tokens: int | None = None  # None: each example's answer length (``diffusion_probe``)
    limit: int | None = None


@dataclass(frozen=True)
class Experiment:
    name: str
    stages: tuple[str, ...]  # in the order they run (``STAGES``)
    data: tuple[DataCell, ...]
    model: ModelSettings = ModelSettings()
    probes: str = "all"
    budgets: tuple[Budget, ...] = (Budget.from_keep(defaults.KEEP),)
    layers: tuple[int | None, ...] = (None,)  # None: each method's own selection layer
    capture: CaptureSettings = CaptureSettings()
    oracle: OracleOptions = OracleOptions()
    compare: CompareSettings = CompareSettings()
    variance: VarianceSettings = VarianceSettings()
    bench: BenchStage = BenchStage()
    diffusion: DiffusionSettings = DiffusionSettings()
    description: str = ""


def read_experiment(path: str | Path, *, max_units: int = MAX_UNITS) -> tuple[Experiment, str]:
    """The experiment in the TOML file ``path``, checked, and the file's text; a cell of more than
    ``max_units`` examples is refused before any is built."""
    path = Path(path)
    if not path.is_file():
        raise RankkitError(f"no experiment file at {path}; give the path of a TOML file (docs/sweeps.md)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise RankkitError(f"{path} is not UTF-8 (byte {error.start + 1}); save it as UTF-8") from None
    except OSError as error:
        raise RankkitError(outputs.read_failure(path, error)) from None
    return parse_experiment(text, source=str(path), default_name=path.stem, max_units=max_units), text


def parse_experiment(text: str, *, source: str, default_name: str, max_units: int = MAX_UNITS) -> Experiment:
    """The experiment in TOML ``text``; ``source`` names it in errors."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise RankkitError(f"{source} is not valid TOML: {error}") from None
    tables = {name: raw.pop(name) for name in [*TABLE_FIELDS, "data"] if name in raw}
    top = _read(raw, TOP_FIELDS, source)
    given = {
        name: _read(_table(tables, name, source), fields, f"{source} [{name}]")
        for name, fields in TABLE_FIELDS.items()
    }
    stages = _stages(top, source)
    for table, readers in TABLE_READERS.items():
        if table in tables and not readers & set(stages):  # kept while a stage is left out, say
            warnings.warn(
                f"{source} [{table}]: no stage of stages ({', '.join(stages)}) reads it, so its settings "
                f"change nothing; add {' or '.join(sorted(readers))} to stages to use them",
                stacklevel=2,
            )
    if "data" not in tables:
        raise RankkitError(
            f"{source} names no data; add a [[data]] entry, e.g. {DATA_FIELDS['spec'].example}"
        )
    bench = given["bench"]
    methods = top.get("methods", ())
    bench_methods = bench.pop("methods", methods)
    if "bench" in stages and not bench_methods:
        raise RankkitError(
            f"{source} runs the bench stage but names no method; add methods at the top or in [bench], "
            f"e.g. {TABLE_FIELDS['bench']['methods'].example}"
        )
    compare = given["compare"]
    if "methods" not in compare and methods:
        compare["methods"] = ",".join(methods)
    settings = {name: bench.pop(name) for name in ("warmup", "max_new_tokens", "repeats") if name in bench}
    with errors_in(source):
        if "probes" in top:
            capture_probes(top["probes"])  # a bad probe name or setting fails here
    # a table's settings are checked as its library call checks them, named as its fields
    with errors_in(f"{source} [capture]"):
        capture = CaptureSettings(**given["capture"])
        check_score_dtype(capture.score_dtype)
    with errors_in(f"{source} [oracle]"):
        oracle = OracleOptions(**given["oracle"])
    with errors_in(f"{source} [compare]"):
        if compare.get("span") is not None:
            from rankkit.eval.compare import ranked_slice

            ranked_slice(None, compare["span"], 1)
        if "needle_keep" in compare:
            Budget.parse(compare["needle_keep"], "--needle-keep")
    with errors_in(f"{source} [variance]"):
        if "thresholds" in given["variance"]:
            from rankkit.eval.variance import checked_thresholds

            checked_thresholds(given["variance"]["thresholds"])
    return Experiment(
        name=top.get("name", default_name),
        description=top.get("description", ""),
        stages=stages,
        data=_data_cells(tables["data"], source, max_units),
        model=ModelSettings(**given["model"]),
        probes=top.get("probes", "all"),
        budgets=_budgets(top, source),
        layers=top.get("layers", (None,)),
        capture=capture,
        oracle=oracle,
        compare=CompareSettings(
            **{**compare, "pairs": ",".join(compare["pairs"]) if "pairs" in compare else None}
        ),
        variance=VarianceSettings(**given["variance"]),
        bench=BenchStage(methods=tuple(bench_methods), settings=BenchSettings(**settings), **bench),
        diffusion=DiffusionSettings(**given["diffusion"]),
    )


# A library message names the command line's options; in a sweep they are the file's fields.
_OPTION = re.compile(r"--([a-z][a-z-]*)")
_OPTION_FIELDS = {
    "no-oracle": "oracle = false in [compare]",
    "allow-overlength": "allow_overlength = true in [model]",
    "layer": "layers",
    **{option: f"--{option}" for option in ("max-units", "stages", "overwrite", "out")},  # the sweep's own
}


def in_field_names(message: str) -> str:
    """``message`` with each command-line option (``--no-oracle``) named as the experiment field
    that sets it (``oracle = false``)."""
    return _OPTION.sub(lambda found: _OPTION_FIELDS.get(found[1], found[1].replace("-", "_")), message)


@contextmanager
def errors_in(where: str) -> Iterator[None]:
    """Prefix a RankkitError raised inside the block with where in the file it comes from, the
    options it names written as the file's fields."""
    try:
        yield
    except RankkitError as error:
        raise RankkitError(f"{where}: {in_field_names(str(error))}") from None


def _table(tables: dict[str, Any], name: str, source: str) -> dict[str, Any]:
    table = tables.get(name, {})
    if not isinstance(table, dict):
        raise RankkitError(f"{source}: {name} must be a table [{name}], not {_shown(table)}")
    return table


def _read(table: dict[str, Any], fields: dict[str, Field], where: str) -> dict[str, Any]:
    """The values of ``table``, each checked against its field; unknown fields are refused."""
    values = {}
    for key, value in table.items():
        field = fields.get(key)
        if field is None:
            known = [*fields, *(["data", *TABLE_FIELDS] if fields is TOP_FIELDS else [])]
            close = difflib.get_close_matches(key, known, n=1)
            guess = f" (did you mean {close[0]}?)" if close else ""
            raise RankkitError(
                f"{where}: unknown field '{key}'{guess}; the fields there are {', '.join(known)} (docs/sweeps.md)"
            )
        if not field.kind.accepts(value):
            raise RankkitError(
                f"{where}: {key} must be {field.kind.description}, not {_shown(value)}; e.g. {field.example}"
            )
        if value == []:
            raise RankkitError(f"{where}: {key} is an empty list; name at least one, e.g. {field.example}")
        if isinstance(value, list):
            twice = first_repeated(value)
            if twice is not None:
                raise RankkitError(f"{where}: {key} lists {_shown(twice)} twice; name each once")
        if field.minimum is not None and any(item < field.minimum for item in _as_tuple(value)):
            raise RankkitError(
                f"{where}: {key} must be at least {field.minimum}, not {_shown(value)}; e.g. {field.example}"
            )
        values[key] = field.kind.convert(value)
    return values


def _shown(value: Any) -> str:
    """A value as TOML would write it (near enough for a message)."""
    if isinstance(value, dict):
        return "a table"
    return json.dumps(value, default=str)


def _stages(top: dict[str, Any], source: str) -> tuple[str, ...]:
    if not top.get("stages"):
        raise RankkitError(f"{source} names no stage; e.g. {TOP_FIELDS['stages'].example}")
    unknown = [stage for stage in top["stages"] if stage not in STAGES]
    if unknown:
        raise RankkitError(
            f"{source}: unknown stage '{unknown[0]}' in stages; choose from {', '.join(STAGES)}"
        )
    return tuple(stage for stage in STAGES if stage in top["stages"])


def _budgets(top: dict[str, Any], source: str) -> tuple[Budget, ...]:
    if "keep" in top and "budget" in top:
        raise RankkitError(
            f"{source}: give keep (rates, e.g. keep = [0.1]) or budget (token counts), not both"
        )
    with errors_in(source):
        if "budget" in top:
            budgets = tuple(Budget.from_tokens(tokens) for tokens in top["budget"])
        else:
            budgets = tuple(Budget.from_keep(rate) for rate in top.get("keep", (defaults.KEEP,)))
    return tuple(distinct_budgets(budgets, f"{source}: {'budget' if 'budget' in top else 'keep'}"))


def _data_cells(entries: Any, source: str, max_units: int) -> tuple[DataCell, ...]:
    if not isinstance(entries, list) or not entries or not all(isinstance(entry, dict) for entry in entries):
        raise RankkitError(
            f"{source}: write each data entry as a [[data]] table, e.g. {DATA_FIELDS['spec'].example}"
        )
    cells: dict[str, DataCell] = {}
    for number, entry in enumerate(entries, start=1):
        where = f"{source} [[data]] #{number}"
        values = _read(entry, DATA_FIELDS, where)
        with errors_in(where):
            specs = _entry_specs(values)
            if "name" in values and len(specs) > 1:
                raise RankkitError(f"name names one cell but the entry makes {len(specs)}; leave name out")
            for spec in specs:
                declared = declared_examples(spec)
                if declared is not None and declared > max_units:
                    raise RankkitError(
                        f"'{spec}' makes {declared} examples, more than the {max_units} units a sweep takes "
                        "on; lower n, or raise the limit with --max-units"
                    )
                cell = _cell(spec, values.get("name"))
                if cell.name in cells:
                    raise RankkitError(f"a second cell is named '{cell.name}'; give the entry its own name")
                if any(other.spec == spec for other in cells.values()):
                    raise RankkitError(f"'{spec}' is a cell already; name each data spec once")
                cells[cell.name] = cell
    return tuple(cells.values())


def _entry_specs(values: dict[str, Any]) -> list[str]:
    """The data specs of one [[data]] entry: its spec, or the specs its kind and lists expand to."""
    grid = {key: values[key] for key in ("kind", "tasks", "lengths", "n", "depths", "seed") if key in values}
    if "spec" in values:
        if grid:
            raise RankkitError(f"give spec or kind with its lists, not both (drop {', '.join(grid)})")
        return [values["spec"]]
    if "kind" not in grid or "lengths" not in grid:
        raise RankkitError(
            f'give spec (e.g. {DATA_FIELDS["spec"].example}) or kind and lengths (e.g. kind = "niah", '
            f"{DATA_FIELDS['lengths'].example})"
        )
    kind = grid.pop("kind")
    if (kind == "ruler") != ("tasks" in grid):
        raise RankkitError(
            f'tasks go with kind = "ruler" and only there, e.g. {DATA_FIELDS["tasks"].example}'
        )
    tasks, lengths = grid.pop("tasks", (None,)), grid.pop("lengths")
    return [
        format_spec(kind, {**grid, "task": task, "length": length}) for task in tasks for length in lengths
    ]


def declared_examples(spec: str) -> int | None:
    """How many examples ``spec`` makes, read from its text alone (nothing built, no file read):
    ``n``, or the depths listed; None for a jsonl file without ``n``."""
    kind, params = parse_spec(spec)
    if "n" in params and params["n"].isdigit():
        return int(params["n"])
    if "depths" in params:
        return len(params["depths"].split(";"))
    return None if kind == "jsonl" else 1


def _cell(spec: str, name: str | None) -> DataCell:
    data = read_spec(spec)
    dataset = data.task or (Path(data.path).stem if data.kind == "jsonl" else data.kind)
    if name is None:  # an empty name given is refused below, not replaced by this one
        name = dataset if data.length is None else f"{dataset}-{data.length}"
    if not _CELL_NAME.fullmatch(name):
        raise RankkitError(
            f"cell name '{name[:40]}{'...' if len(name) > 40 else ''}' is not a file name; use at most 100 "
            "letters, digits, '_', '-', '.' and '='"
        )
    return DataCell(name=name, spec=spec, dataset=dataset, length=data.length)
