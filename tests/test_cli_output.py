"""What the command line prints where a person reads it later: logs, pipes, help, version, warnings."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import warnings

import polars as pl
import pytest
from rich.console import Console

import rankkit
from rankkit.progress import Progress

RANKKIT = [sys.executable, "-c", "from rankkit.cli import main; main()"]


def _rankkit(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([*RANKKIT, *arguments], capture_output=True, text=True, timeout=120)


def test_ctrl_c_once_a_command_has_finished_leaves_its_status_and_prints_nothing():
    """Arriving while the interpreter ended (the worker pool's finalizers, torch's teardown), it printed
    a traceback below a finished compare's output, or killed it silently with status 130."""
    ends_interrupted = "import atexit, signal; atexit.register(signal.raise_signal, signal.SIGINT); "
    result = subprocess.run(
        [sys.executable, "-c", ends_interrupted + RANKKIT[-1], "--version"], capture_output=True, text=True, timeout=120
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, f"rankkit {rankkit.__version__}\n", "")


def test_ctrl_c_while_a_command_prints_its_results_is_an_interrupt_not_an_abort(monkeypatch, capfd):
    """typer turns a KeyboardInterrupt outside the library's interruptible work into status 130 and
    prints nothing: the command ended without a word, as if it had finished."""
    import signal

    from rankkit import model_cache
    from rankkit.cli import main

    def interrupted_while_printing():
        raise KeyboardInterrupt

    monkeypatch.setattr(model_cache, "cached_models", interrupted_while_printing)
    monkeypatch.setattr(sys, "argv", ["rankkit", "models"])
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as exited:
            main()
    finally:  # main ignores both signals as it exits: the test process must not
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert exited.value.code == 130
    assert capfd.readouterr().err.strip() == "rankkit: interrupted; every file written so far is whole"


def test_sigterm_while_a_command_prints_its_results_is_an_interrupt_too():
    """Outside the library's interruptible work (dashboard, demo, compare printing) SIGTERM ended the
    process at once with no line (status -15), leaving any write's staging file behind."""
    terminated_while_printing = (
        "import os, signal, sys; from rankkit import model_cache; "
        "model_cache.cached_models = lambda: os.kill(os.getpid(), signal.SIGTERM); "
        "sys.argv = ['rankkit', 'models']; from rankkit.cli import main; main()"
    )
    result = subprocess.run(
        [sys.executable, "-c", terminated_while_printing], capture_output=True, text=True, timeout=120
    )
    assert (result.returncode, result.stderr.strip()) == (130, "rankkit: interrupted; every file written so far is whole")


def test_progress_off_a_terminal_is_one_line_per_finished_step_with_counts_and_eta():
    from rankkit.cli.progress import ProgressLines

    sink = io.StringIO()
    times = iter([100.0, 100.0, 100.0, 130.0, 160.0, 161.0])
    show = ProgressLines("bench", Console(file=sink, width=40), clock=lambda: next(times))
    show(Progress("calibrating", 0, 4, "full prefills"))
    show(Progress("preparing", 0, 4, "ex0 full keep=1"))  # the same count again: no line
    show(Progress("timed", 1, 4, "ex0 full keep=1"))
    show(Progress("timed", 3, 4, "ex0 claa keep=0.1"))
    show(Progress("done", 4, 4, "ex0"))
    assert sink.getvalue().splitlines() == [
        "bench 0/4 0% 0:00 elapsed: calibrating full prefills",
        "bench 1/4 25% 0:30 elapsed, ETA 1:30: timed ex0 full keep=1",
        "bench 3/4 75% 1:00 elapsed, ETA 0:20: timed ex0 claa keep=0.1",
        "bench 4/4 100% 1:01 elapsed, ETA 0:00: done ex0",
    ]


def test_a_resumed_run_extrapolates_only_the_steps_it_ran():
    from rankkit.cli.progress import ProgressLines

    sink = io.StringIO()
    times = iter([0.0, 2.0, 12.0])
    show = ProgressLines("capture", Console(file=sink), with_stage=False, clock=lambda: next(times))
    show(Progress("skipped", 6, 10, "ex5"))
    show(Progress("written", 7, 10, "ex6"))
    assert sink.getvalue().splitlines() == [
        "capture 6/10 60% 0:02 elapsed: ex5",
        "capture 7/10 70% 0:12 elapsed, ETA 0:30: ex6",
    ]


def test_a_table_printed_to_a_pipe_cuts_and_wraps_no_cell(monkeypatch):
    from rankkit.cli.app import output
    from rankkit.tables import frame_table

    sink = io.StringIO()
    monkeypatch.setattr(sys, "stdout", sink)
    frame = pl.DataFrame(
        {
            "method": ["claa:aggregation_window=8"],
            "budget": ["keep=0.1"],
            **{f"a_long_column_name_{index}": [index + 0.123456] for index in range(12)},
        }
    )
    output().print(frame_table(frame, "wide"))
    lines = sink.getvalue().splitlines()
    assert "…" not in sink.getvalue()
    row = next(line for line in lines if line.startswith("claa"))
    assert row.split() == ["claa:aggregation_window=8", "keep=0.1", *(f"{index + 0.123456:.3f}" for index in range(12))]


def test_route_warnings_silences_library_deprecations_and_holds_rankkit_warnings_until_work_starts(capsys):
    from rankkit.cli import release_warnings, route_warnings
    from rankkit.cli.progress import ProgressLines

    with warnings.catch_warnings():
        route_warnings()
        warnings.warn("`past_key_values` is deprecated", FutureWarning, stacklevel=1)
        warnings.warn("old API", DeprecationWarning, stacklevel=1)
        warnings.warn("budget 9000 keeps everything", UserWarning, stacklevel=1)
        assert capsys.readouterr().err == ""  # a refusal now would be the one line
        ProgressLines("bench", Console(file=io.StringIO()))(Progress("timed", 0, 2, "ex0"))
        assert capsys.readouterr().err == "rankkit: warning: budget 9000 keeps everything\n"
        warnings.warn("layer 40 is past the last", UserWarning, stacklevel=1)
        assert capsys.readouterr().err == "rankkit: warning: layer 40 is past the last\n"  # the work has started
        warnings.resetwarnings()  # what any library's filter change does: Python would show it again
        warnings.warn("layer 40 is past the last", UserWarning, stacklevel=1)
        assert capsys.readouterr().err == ""  # once a command
        release_warnings()
    assert capsys.readouterr().err == ""


def test_version_and_help_without_type_tags():
    from rankkit import __version__

    version = _rankkit("--version")
    assert (version.returncode, version.stdout) == (0, f"rankkit {__version__}\n")
    for command in (["--help"], ["capture", "--help"], ["bench", "--help"], ["store", "info", "--help"]):
        shown = _rankkit(*command)
        assert shown.returncode == 0, shown.stderr
        for tag in ("<str>", "<bool>", "<int>", "<float>", "<path>  Write"):
            assert tag not in shown.stdout, (command, tag)


@pytest.mark.parametrize(
    ("arguments", "line"),
    [
        (["nosuch"], "rankkit: error: no such command 'nosuch'; see 'rankkit --help'"),
        (
            ["generate", "--max-new-tokens", "0"],
            "rankkit: error: invalid value for '--max-new-tokens': Input should be greater than or equal to 1;"
            " see 'rankkit generate --help'",
        ),
        (["data", "export", "niah:length=512"], "rankkit: error: missing option '--out'; see 'rankkit data export --help'"),
        (["store", "info"], "rankkit: error: missing argument 'path'; see 'rankkit store info --help'"),
        (  # click took the last value silently: the table said keep 0.3 of a command that named 0.1 too
            ["compare", "x.zarr", "--keep", "0.1", "--keep", "0.3"],
            "rankkit: error: --keep is given twice; give it once; see 'rankkit compare --help'",
        ),
        (["bench", "--overwrite", "--overwrite"], "rankkit: error: --overwrite is given twice; give it once; see 'rankkit bench --help'"),
    ],
)
def test_a_usage_error_is_one_line_naming_the_help_and_exit_2(arguments, line):
    refused = _rankkit(*arguments)
    assert (refused.returncode, refused.stdout, refused.stderr) == (2, "", line + "\n")


@pytest.mark.parametrize(
    ("arguments", "parameter"),
    [
        (["demo", "--out", ""], "--out"),
        (["capture", "--data", "niah:n=1,length=128", "--out", ""], "--out"),
        (["data", "export", "niah:n=1,length=256", "--out", " "], "--out"),
        (["store", "info", ""], "path"),
        (["dashboard", "--bench", "", "s.zarr"], "--bench"),
        (["prefill", "--context-file", "", "--question", "q", "--keep", "0.1"], "--context-file"),
    ],
)
def test_an_empty_path_is_refused_naming_its_parameter(tmp_path, arguments, parameter):
    """'' reads as '.', the current folder: `--out "$OUT"` with OUT unset wrote the demo's files there,
    and a refusal named '.', which was never typed."""
    refused = subprocess.run([*RANKKIT, *arguments], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    command = " ".join(arguments[: 2 if arguments[0] in ("data", "store") else 1])
    given = arguments[arguments.index(parameter) + 1] if parameter.startswith("--") else ""
    assert (refused.returncode, refused.stderr) == (
        2,
        f"rankkit: error: invalid value for '{parameter}': {given!r} names no path; give one; "
        f"see 'rankkit {command} --help'\n",
    )
    assert list(tmp_path.iterdir()) == []


def test_a_command_group_without_a_command_shows_its_help_and_exit_2():
    shown = _rankkit("data")
    assert shown.returncode == 2 and "export" in shown.stdout and shown.stderr == ""


def test_the_command_list_gives_each_summary_as_one_paragraph():
    """A docstring's line breaks stay out of ``rankkit --help``'s list: on a terminal wide enough,
    each command's summary is one line, whole."""
    shown = subprocess.run(
        [*RANKKIT, "--help"], capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "400"}
    )
    rows = [line.strip("│ ") for line in shown.stdout.splitlines() if line.startswith("│ ")]
    listed = dict(row.split(maxsplit=1) for row in rows if not row.startswith("-"))
    assert listed["compare"].startswith("Spearman") and listed["compare"].endswith("between methods."), listed
    assert listed["overhead"].endswith("on a synthetic store of --examples x --lengths."), listed
    from rankkit.cli import commands  # noqa: F401
    from rankkit.cli.app import command

    assert set(listed) == set(command().commands), listed  # no summary goes on over a second line


def test_capture_help_says_no_draft_is_recorded_without_draft():
    from rankkit.cli import commands  # noqa: F401
    from rankkit.cli.app import command

    (draft,) = [param for param in command().commands["capture"].params if param.name == "draft"]
    assert draft.help.endswith("Without it no draft is recorded.") and "Default" not in draft.help


def test_the_oracle_kernel_help_says_it_is_odd():
    from rankkit.cli import commands  # noqa: F401
    from rankkit.cli.app import command

    for name in ("capture", "oracle"):  # [x>=1] alone would offer 4, which is refused
        (kernel,) = [param for param in command().commands[name].params if param.name == "kernel"]
        assert kernel.help.endswith("an odd width (the pooling keeps the length).")


def _leaf_commands(group, path=()):
    for name, each in group.commands.items():
        if hasattr(each, "commands"):
            yield from _leaf_commands(each, (*path, name))
        else:
            yield " ".join((*path, name)), each


def test_help_and_refusals_name_only_options_the_command_takes():
    """dashboard's --needle-keep help named --budget before the dashboard took it; its refusal of
    --keep 0 names it now that it does."""
    import re

    from rankkit.cli import commands  # noqa: F401
    from rankkit.cli.app import command
    from rankkit.errors import RankkitError
    from rankkit.report import write_dashboard

    # --cuda-graphs' help says bench and prefill need --warmup; overhead shares the option, not the need
    elsewhere = {("overhead", "--warmup")}
    for name, each in _leaf_commands(command()):
        own = {option for param in each.params for option in [*param.opts, *param.secondary_opts]}
        for param in each.params:
            for option in re.findall(r"--[a-z][a-z-]*", getattr(param, "help", None) or ""):
                assert option in own or (name, option) in elsewhere, (name, param.name, option)
    with pytest.raises(RankkitError) as refused:
        write_dashboard("missing.zarr", "page.html", keep=0)
    assert str(refused.value) == "keep rate 0 is outside (0, 1]: use e.g. --keep 0.1, or --budget for a token count"
    assert "--budget" in {option for name, each in _leaf_commands(command()) if name == "dashboard" for param in each.params for option in param.opts}


def test_compare_and_select_help_list_every_built_in_method_they_take():
    """compare --help left out pyramidkv, adakv and tova, which it takes: the list is one constant,
    written out (the help imports no method), held here to the registry's methods with an offline face."""
    from rankkit.cli.options import OFFLINE_METHODS
    from rankkit.errors import RankkitError
    from rankkit.methods import REGISTRY

    def ranks_a_store(cls) -> bool:
        try:
            cls().captured_inputs()
        except RankkitError:  # full: no offline face
            return False
        return True

    built_in = {name for name, cls in REGISTRY.items() if cls.__module__.startswith("rankkit.methods.")}
    assert set(OFFLINE_METHODS.split(", ")) == {name for name in built_in if ranks_a_store(REGISTRY[name])}


def test_store_info_says_where_a_cut_value_is_whole():
    from rankkit.cli.store_cmd import _compact

    config = {"hidden_size": 576, "name": "x" * 100}
    assert _compact("short") == "short"
    cut = _compact(config)
    assert cut.endswith(" … (whole with --json)")
    assert len(cut) == 80 + len(" … (whole with --json)")
    assert _compact(config, whole=True) == json.dumps(config, separators=(",", ":"))  # a log cuts no cell


def test_generate_answers_the_first_example_of_a_data_spec(tiny_folder, tmp_path):
    from rankkit.demo import answer
    from rankkit.errors import RankkitError

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(RankkitError, match=r"empty.jsonl holds no example; give a file with one JSON object"):
        answer(str(tiny_folder), "", "", data=str(empty))

    result = answer(str(tiny_folder), "", "", data="niah:length=256", max_new_tokens=2, device="cpu")
    assert (result["model"], result["prompt_tokens"]) == (str(tiny_folder), 254)  # niah fits at most 256
    with pytest.raises(RankkitError, match=r"^give either a data spec \(--data\) or --context-file/--question, not both$"):
        answer(str(tiny_folder), "text", "question?", data="niah:length=256")
    with pytest.raises(RankkitError, match=r"^give --question"):
        answer(str(tiny_folder), "", "")


def test_rows_as_csv_keep_every_value_whole_and_json_what_the_command_prints():
    from rankkit.tables import rows_text

    rows = [
        {"method": "window:w=32", "spearman": 0.123456789, "positions": [0, 1, 5]},
        {"method": "claa, pooled", "spearman": None, "n": 3, "meta": {"k": 1}},
    ]
    assert rows_text(rows, "csv") == (
        "method,spearman,positions,n,meta\n"
        "window:w=32,0.123456789,\"[0,1,5]\",,\n"
        "\"claa, pooled\",,,3,\"{\"\"k\"\":1}\""
    )
    assert rows_text([], "csv") == ""
    assert json.loads(rows_text(rows, "json")) == rows
    assert json.loads(rows_text(rows, "json", whole={"summary": rows})) == {"summary": rows}
    with pytest.raises(ValueError, match="not 'table'"):
        rows_text(rows, "table")


def test_a_figure_that_is_not_a_number_is_missing_in_json_and_csv():
    """NaN is not JSON: Python writes it, and jq, JavaScript and most parsers refuse the whole
    output. Every command's JSON writes an undefined figure as null, and CSV as an empty field."""
    from rankkit.tables import json_text, rows_text

    rows = [{"method": "asl", "spearman": float("nan"), "curve": [0.5, float("inf"), None], "deep": {"x": (float("-inf"),)}}]
    expected = [{"method": "asl", "spearman": None, "curve": [0.5, None, None], "deep": {"x": [None]}}]
    assert json.loads(json_text(rows, indent=2), parse_constant=pytest.fail) == expected
    assert json.loads(rows_text(rows, "json"), parse_constant=pytest.fail) == expected
    assert rows_text(rows, "csv") == 'method,spearman,curve,deep\nasl,,"[0.5,null,null]","{""x"":[null]}"'


def test_nested_keys_flatten_to_dotted_key_value_rows():
    from rankkit.tables import flat_rows

    summary = {"path": "a.zarr", "examples": {"complete": 3, "incomplete": 0}, "groups": {}, "p": {"w": {"n": 2}}}
    assert flat_rows(summary) == [
        {"key": "path", "value": "a.zarr"},
        {"key": "examples.complete", "value": 3},
        {"key": "examples.incomplete", "value": 0},
        {"key": "groups", "value": {}},
        {"key": "p.w.n", "value": 2},
    ]


def test_format_is_one_of_three_and_json_is_its_alias():
    from rankkit.cli.options import output_format
    from rankkit.errors import RankkitError

    assert [output_format(name) for name in ("table", "csv", "json")] == ["table", "csv", "json"]
    assert output_format("table", as_json=True) == output_format("json", as_json=True) == "json"
    with pytest.raises(RankkitError, match=r"^--json is --format json: give it or --format csv, not both$"):
        output_format("csv", as_json=True)
    with pytest.raises(RankkitError, match=r"^--format 'xml': give one of table, csv, json$"):
        output_format("xml")


def test_every_table_command_takes_format():
    """And every command that takes --json: capture, oracle and generate named --format json in their
    help without taking it."""
    from rankkit.cli import commands  # noqa: F401
    from rankkit.cli.app import command

    root = command()
    tables = [root.commands[name] for name in ("compare", "variance", "bench", "prefill", "select", "diffusion", "models")]
    tables.append(root.commands["store"].commands["info"])
    pending = [root]
    while pending:
        current = pending.pop()
        pending.extend(getattr(current, "commands", {}).values())
        if any("--json" in param.opts for param in current.params):
            tables.append(current)
    assert {"capture", "oracle", "generate"} <= {each.name for each in tables}
    for table_command in tables:
        assert "--format" in [option for param in table_command.params for option in param.opts], table_command.name


def test_prefill_compare_as_csv_is_one_line_per_method_with_its_json_numbers(tiny_folder):
    import csv

    from typer.testing import CliRunner

    from rankkit.cli import commands  # noqa: F401
    from rankkit.cli.app import app

    run = ["prefill", "--method", "claa", "--keep", "0.5", "--compare", "full", "--data", "niah:n=1,length=200",
           "--model", str(tiny_folder), "--device", "cpu", "--max-new-tokens", "3", "--repeats", "1", "--warmup", "0"]  # fmt: skip
    as_json = json.loads(CliRunner().invoke(app, [*run, "--json"]).stdout)
    as_csv = CliRunner().invoke(app, [*run, "--format", "csv"])
    assert as_csv.exit_code == 0, as_csv.output
    claa, full = csv.DictReader(io.StringIO(as_csv.stdout))
    assert (claa["method"], full["method"]) == ("claa", "full")
    assert claa["answer"] == as_json["answer"] and full["answer"] == as_json["compare"]["answer"]
    assert int(claa["kv_bytes"]) == as_json["kv_bytes"] and int(full["kv_bytes"]) == as_json["compare"]["kv_bytes"]
    assert json.loads(claa["selected_positions"]) == as_json["selected_positions"]
    assert float(claa["kv_ratio"]) == as_json["kv_ratio"]
    table = CliRunner().invoke(app, run).stdout
    (kept,) = [line for line in table.splitlines() if "tokens kept" in line]
    claa_kept = f"{len(as_json['selected_positions'])} at layer {as_json['selection_layer']}"
    assert [cell.strip() for cell in kept.split("│")[2:4]] == [claa_kept, "-"]  # full keeps all, prunes nowhere
    drafted = CliRunner().invoke(app, ["prefill", "--method", "specprefill", *run[3:5], *run[7:]])  # no --compare
    assert drafted.exit_code == 0, drafted.output
    (kept,) = [line for line in drafted.stdout.splitlines() if "tokens kept" in line]
    assert re.fullmatch(r"\d+ before layer 0", kept.split("│")[2].strip())  # its draft chooses; it read "at layer None"


def test_every_command_that_writes_a_file_takes_overwrite():
    """A command with --out refuses to write over an existing file unless --overwrite is given; one
    without the option either overwrote silently (report did) or could never replace its output.
    The demo owns its folder instead (rankkit.demo.claim_folder)."""
    import typer.main

    from rankkit.cli import commands  # noqa: F401
    from rankkit.cli.app import app

    def leaves(command, name=""):
        if hasattr(command, "commands"):
            for child_name, child in command.commands.items():
                yield from leaves(child, f"{name} {child_name}".strip())
        else:
            yield name, {option for parameter in command.params for option in getattr(parameter, "opts", [])}

    writing = {name: options for name, options in leaves(typer.main.get_command(app)) if "--out" in options}
    assert {"capture", "compare", "bench", "report", "sweep", "data export"} <= set(writing)
    assert [name for name, options in writing.items() if "--overwrite" not in options] == ["demo"]
