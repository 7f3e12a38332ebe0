"""`rankkit report`: a store's offline comparison and a bench of the same prompts, joined on example_id."""

from __future__ import annotations

import json
import re

import numpy as np
import polars as pl
import pytest
import torch
from conftest import tiny_model
from test_bench import DigitTokenizer

from rankkit import stores
from rankkit.bench import BenchSettings, run_bench
from rankkit.data import Example
from rankkit.eval.stats import wilson_interval
from rankkit.methods import Budget, make
from rankkit.probes import ProbeRecorder
from rankkit.prompting import Prompt
from rankkit.report.joined import join_store_and_bench
from rankkit.runner import Runner

TOKENS = 320
EVIDENCE = (200, 208)  # in a block SlimInfer's first pruning layer may keep, far from the window
WEIGHTS = "a" * 64
PROMPT_PRUNING = ["gemfilter", "fastkv", "claa", "asl", "sliminfer"]


def _example(index: int) -> tuple[Example, Prompt]:
    ids = torch.randint(0, 97, (TOKENS,), generator=torch.Generator().manual_seed(index))
    text = "x" * TOKENS  # one character per token
    context = TOKENS - 8
    example = Example(
        id=f"e{index}", task="toy", context=text[:context], question=text[context:], answers=("1",),
        evidence=(EVIDENCE,),
    )  # fmt: skip
    return example, Prompt(text, ids, [(i, i + 1) for i in range(TOKENS)], (0, context), (context, TOKENS))


@pytest.fixture(scope="module")
def store_and_bench(tmp_path_factory):
    """A store captured by the tiny model on two prompts (an oracle of random scores) and a bench
    of every prompt-pruning method on the same prompts at keep 0.1 and 0.3."""
    folder = tmp_path_factory.mktemp("joined")
    runner = Runner(tiny_model("llama"))
    pairs = [_example(index) for index in range(2)]
    methods = [make("full"), *(make(name) for name in PROMPT_PRUNING)]
    probes = list({method.probe().key: method.probe() for method in methods[1:]}.values())
    config = runner.config
    writer = stores.create(
        folder / "run.zarr",
        {"model": {"id": "tiny", "weights_hash": WEIGHTS}, "kv_heads": config.num_key_value_heads,
         "num_attention_heads": config.num_attention_heads},
    )  # fmt: skip
    rng = np.random.default_rng(0)
    for example, prompt in pairs:
        recorder = ProbeRecorder(probes)
        runner.prefill(prompt.input_ids, hooks=[recorder])
        spans = {"context_tokens": [0, TOKENS - 8], "evidence_tokens": [list(EVIDENCE)]}
        writer.write_example(
            example.id, attrs={"task": "toy", "spans": spans}, tokens=prompt.input_ids.numpy(),
            scores=recorder.scores(),
        )  # fmt: skip
        oracle = rng.random(TOKENS).astype(np.float32)
        writer.add_oracle(
            example.id, oracle=oracle, oracle_layers=np.tile(oracle, (runner.num_layers, 1)), attrs={}
        )
    by_id = {example.id: prompt for example, prompt in pairs}
    frame = run_bench(
        runner, DigitTokenizer(), [example for example, _ in pairs], methods,
        [Budget.from_keep(0.1), Budget.from_keep(0.3)], BenchSettings(max_new_tokens=2, warmup=0),
        prompt_for=lambda example: by_id[example.id],
    )  # fmt: skip
    frame = frame.with_columns(model=pl.lit("tiny"), weights_hash=pl.lit(WEIGHTS))
    frame.write_parquet(folder / "bench.parquet")
    return folder / "run.zarr", folder / "bench.parquet", frame


def test_offline_and_online_evidence_kept_agree_for_every_prompt_pruning_method(store_and_bench):
    store, bench, frame = store_and_bench
    joined = join_store_and_bench(store, bench)
    rows = joined.per_example.filter(pl.col("method").is_in(PROMPT_PRUNING))
    assert rows.height == len(PROMPT_PRUNING) * 2 * 2  # methods x keeps x examples
    assert rows["evidence_kept_offline"].to_list() == rows["evidence_kept"].to_list()
    assert rows["evidence_kept"].min() == 0.0 and rows["evidence_kept"].max() == 1.0  # not one value for all
    # the issue's case: SlimInfer keeps e1's needle block (4x the budget at its first pruning layer,
    # whole blocks) though the needle is outside its ranking's top 10%
    sliminfer = rows.filter(
        (pl.col("example_id") == "e1") & (pl.col("method") == "sliminfer") & (pl.col("keep") == 0.1)
    )
    assert sliminfer.select("needle_recall", "evidence_kept_offline", "evidence_kept").row(0) == (
        0.0,
        1.0,
        1.0,
    )
    online = frame.filter(pl.col("method") != "full").select("example_id", "method", "keep", "score")
    assert rows.join(online, on=["example_id", "method", "keep"])["accuracy"].to_list() == [
        float(score) for score in rows.join(online, on=["example_id", "method", "keep"])["score"]
    ]


def test_summary_means_each_face_per_method_and_keep_with_n(store_and_bench, cli):
    store, bench, _ = store_and_bench
    joined = join_store_and_bench(store, bench)
    collapsed = set()
    for row in joined.summary.filter(pl.col("method").is_in(PROMPT_PRUNING)).to_dicts():
        each = joined.per_example.filter(
            (pl.col("method") == row["method"]) & (pl.col("keep") == row["keep"])
        )
        assert row["n_examples"] == 2
        for metric in ("spearman", "needle_recall", "evidence_kept_offline", "evidence_kept", "accuracy"):
            assert row[metric] == pytest.approx(each[metric].mean()), (row["method"], metric)
            assert row[f"{metric}_ci_low"] <= row[metric] <= row[f"{metric}_ci_high"]
        # a share the same on both examples is Wilson's over them; it read "0.00 [0.00, 0.00]"
        for metric in ("needle_recall", "evidence_kept_offline", "evidence_kept"):
            if each[metric].n_unique() == 1 and each[metric][0] in (0.0, 1.0):
                interval = (row[f"{metric}_ci_low"], row[f"{metric}_ci_high"])
                assert interval == pytest.approx(wilson_interval(2 * each[metric][0], 2)), (row["method"], metric)
                collapsed.add(metric)
    assert collapsed == {"needle_recall", "evidence_kept_offline", "evidence_kept"}  # each case is met
    result = cli("report", store, "--bench", bench, "--json", "--out", store.parent / "joined.parquet")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == json.loads(json.dumps(joined.summary.to_dicts()))
    assert pl.read_parquet(store.parent / "joined.parquet").equals(joined.per_example)


def test_report_prints_a_table_and_never_writes_over_a_file_or_its_inputs(store_and_bench, cli):
    """The terminal gets the table every other command prints (intervals merged, a legend line per
    column), not a frame's repr; --out is refused over an existing file without --overwrite, and
    always over the store or the bench it reads."""
    store, bench, _ = store_and_bench
    kept = bench.read_bytes()
    shown = cli("report", store, "--bench", bench)
    assert shown.exit_code == 0, shown.output
    assert "ev on: share of the evidence tokens the end-to-end run keeps" in shown.stdout
    assert "shape:" not in shown.stdout and "evidence_kept_offline" not in shown.stdout
    csv_text = cli("report", store, "--bench", bench, "--format", "csv").stdout
    assert csv_text.splitlines()[0].startswith("method,keep,spearman,spearman_ci_low,spearman_ci_high,")

    refused = cli("report", store, "--bench", bench, "--out", bench, "--overwrite")
    assert "is one of this command's inputs" in str(refused.exception)
    assert bench.read_bytes() == kept
    joined = store.parent / "report.parquet"
    assert cli("report", store, "--bench", bench, "--out", joined).exit_code == 0
    refused = cli("report", store, "--bench", bench, "--out", joined)
    assert "already exists; pass --overwrite to replace it" in str(refused.exception)
    assert cli("report", store, "--bench", bench, "--out", joined, "--overwrite").exit_code == 0
    assert pl.read_parquet(joined).height > 0
    joined.write_bytes(b"a user's file")  # --overwrite replaces only what rankkit wrote
    refused = cli("report", store, "--bench", bench, "--out", joined, "--overwrite")
    assert "was not written by rankkit, and --overwrite replaces only what rankkit wrote" in str(refused.exception)
    assert joined.read_bytes() == b"a user's file"


def test_a_bench_of_other_examples_or_another_model_is_refused(store_and_bench, cli, tmp_path):
    import subprocess
    import sys

    from rankkit.errors import RankkitError

    store, _, frame = store_and_bench
    other_examples, other_model = tmp_path / "examples.parquet", tmp_path / "model.parquet"
    frame.with_columns(("x" + pl.col("example_id")).alias("example_id")).write_parquet(other_examples)
    frame.with_columns(model=pl.lit("other"), weights_hash=pl.lit("b" * 64)).write_parquet(other_model)
    result = cli("report", store, "--bench", other_examples)
    assert isinstance(result.exception, RankkitError)
    assert "has no rows at a keep rate for the examples of store" in str(result.exception)
    refused = subprocess.run(
        [sys.executable, "-m", "rankkit.cli", "report", str(store), "--bench", str(other_model)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert refused.returncode == 2 and refused.stdout == ""
    assert (
        refused.stderr.count("\n") == 1
        and "was measured with model other (weights bbbbbbbbbbbb)" in refused.stderr
    )


def _with_claa_pruning_layer(params: str, method: str) -> str:
    return json.dumps({**json.loads(params), "pruning_layer": 0}) if method == "claa" else params


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # the same id, another example: niah:n=3 and niah:n=6 both name niah-512-s0-001
        (pl.col("length") + 2, f"ran another example named 'e0' ({TOKENS + 2} tokens, needle depth None) than the store holds ({TOKENS} tokens"),
        # the offline face is each method at its defaults
        (
            pl.struct("params", "method").map_elements(
                lambda row: _with_claa_pruning_layer(row["params"], row["method"]), return_dtype=pl.String
            ),
            "ran claa with pruning_layer=0; report joins each method at its defaults",
        ),
    ],
)
def test_a_bench_of_other_examples_under_the_same_ids_or_other_settings_is_refused(store_and_bench, tmp_path, change, message):
    from rankkit.errors import RankkitError

    store, _, frame = store_and_bench
    column = "length" if "tokens" in message else "params"
    changed = tmp_path / "changed.parquet"
    longer = (pl.col("keep") * (pl.col("length") + 2)).ceil().cast(pl.Int64)  # the other example's budgets
    budgets = [pl.max_horizontal("budget_tokens", longer).alias("budget_tokens")] if column == "length" else []
    frame.with_columns(change.alias(column), *budgets).write_parquet(changed)
    with pytest.raises(RankkitError, match=re.escape(message)):
        join_store_and_bench(store, changed)
    if column == "length":  # the dashboard drew it, the refusal as its report panel's text, exit 0
        from rankkit.report import write_dashboard

        with pytest.raises(RankkitError, match=re.escape(f"bench changed {message}")):
            write_dashboard(store, tmp_path / "page.html", bench=changed, workers=1)
        assert not (tmp_path / "page.html").exists()


def test_a_store_without_an_oracle_is_refused_with_the_command_that_adds_it(store_and_bench, tmp_path):
    """It said "(or pass --no-oracle)", an option report does not have."""
    from rankkit.errors import RankkitError

    store, bench, _ = store_and_bench
    bare = tmp_path / "bare.zarr"
    _without_oracle(store, bare, ["e0", "e1"])
    assert not any(record.has_oracle for record in stores.open(bare).examples())
    with pytest.raises(RankkitError, match=f"^store {re.escape(str(bare))} has no oracle; run `rankkit oracle {re.escape(str(bare))}` first$"):
        join_store_and_bench(bare, bench)


def _without_oracle(store, copy, example_ids) -> None:
    """``store`` copied to ``copy`` with the oracles of ``example_ids`` taken out as a reset leaves them."""
    import shutil

    shutil.copytree(store, copy)
    for example_id in example_ids:
        example = copy / "examples" / example_id
        attrs = json.loads((example / "zarr.json").read_text())
        for key in [key for key in attrs.get("attributes", {}) if key.startswith("oracle")]:
            del attrs["attributes"][key]
        (example / "zarr.json").write_text(json.dumps(attrs))
        (example / "oracle.zip").unlink(missing_ok=True)


def test_each_row_is_of_the_examples_with_an_oracle_and_a_bench_example_the_store_lacks_is_named(
    store_and_bench, tmp_path
):
    """With e1's oracle gone, ρ and needle recall were e0's alone while evidence kept online and the
    accuracy were means over both, under one n of 2; a bench example the store lacks left silently."""
    store, bench, frame = store_and_bench
    _without_oracle(store, tmp_path / "half.zarr", ["e1"])
    extra = tmp_path / "extra.parquet"
    pl.concat([frame, frame.filter(pl.col("example_id") == "e0").with_columns(example_id=pl.lit("e9"))]).write_parquet(extra)
    with pytest.warns(UserWarning) as given:
        joined = join_store_and_bench(tmp_path / "half.zarr", extra)
    messages = [str(warning.message) for warning in given]
    assert f"left out 1 example(s) of bench {extra} that store {tmp_path / 'half.zarr'} does not hold" in messages
    assert any(message.startswith("left out 1 example(s) without an oracle") for message in messages)
    assert joined.per_example["example_id"].unique().to_list() == ["e0"]
    e0 = join_store_and_bench(store, bench).per_example.filter(pl.col("example_id") == "e0")
    assert joined.per_example.sort("method", "keep").equals(e0.sort("method", "keep"))
    assert set(joined.summary["n_examples"]) == {1}


@pytest.fixture
def cli():
    from typer.testing import CliRunner

    from rankkit.cli import dashboard_cmd, report_cmd  # noqa: F401  (registers the commands)
    from rankkit.cli.app import app

    runner = CliRunner()
    return lambda *args: runner.invoke(app, [str(arg) for arg in args], env={"COLUMNS": "200"})


def _table_values(page: str, panel: str) -> list[dict]:
    """The rows of a dashboard panel's table, each cell as its full value (``data-value``; NaN as None)."""
    import re

    section = page.split(f'id="panel-{panel}"')[1].split("</section>")[0]
    head = re.findall(r"<th>(.*?)</th>", section)
    rows = []
    for row in re.findall(r"<tr>(.*?)</tr>", section.split("<tbody>")[1]):
        cells = re.findall(r'<td(?: data-value="([^"]*)")?>(.*?)</td>', row)
        values = [(None if value == "NaN" else json.loads(value)) if value else text for value, text in cells]
        rows.append(dict(zip(head, values, strict=True)))
    return rows


def test_the_dashboards_report_panel_holds_the_report_commands_numbers(store_and_bench, cli, tmp_path):
    from rankkit.errors import RankkitError
    from rankkit.report import write_dashboard

    store, bench, _ = store_and_bench
    result = cli("report", store, "--bench", bench, "--json")
    assert result.exit_code == 0, result.output
    expected = json.loads(result.stdout)
    page = write_dashboard(store, tmp_path / "report.html", bench=bench, workers=1).read_text()
    assert _table_values(page, "report") == expected
    assert {row["method"] for row in expected} >= set(PROMPT_PRUNING) and len(expected) > 10
    from browser import find_chromium, open_in_chromium

    if find_chromium() is not None:  # the page reports the panel as a table of those rows
        status = open_in_chromium(tmp_path / "report.html").status
        assert status["errors"] == [] and status["panels"]["report"] == {"table_rows": len(expected)}
    # beside a second run of the same model the panel names each row's run, numbers unchanged
    again = tmp_path / "again.parquet"
    pl.read_parquet(bench).write_parquet(again)
    page = write_dashboard(store, tmp_path / "two.html", bench=[bench, again], workers=1).read_text()
    labelled = _table_values(page, "report")
    for run in ("bench", "again"):
        mine = [row for row in labelled if row["method"].endswith(f" ({run}, tiny {WEIGHTS[:12]})")]
        assert [{**row, "method": row["method"].split(" (")[0]} for row in mine] == expected
    # the same bench twice: every joined row was there twice
    with pytest.raises(RankkitError, match=f"^--bench names {re.escape(str(bench))} twice; give each bench once$"):
        write_dashboard(store, tmp_path / "twice.html", bench=[bench, bench.parent / ".." / bench.parent.name / bench.name])


@pytest.mark.parametrize(
    ("column", "value", "bounds"),
    [("keep", 5.0, "(0, 1]"), ("ttft_s", -1.0, "(0, inf)"), ("score", 1.5, "[0, 1]"), ("kv_bytes", -8.0, "[0, inf)")],
)
def test_a_bench_holding_a_value_no_bench_writes_is_refused_by_report_and_dashboard(
    store_and_bench, cli, tmp_path, column, value, bounds
):
    """An edited or damaged bench made figures with exit 0 (the dashboard drew keep 5.0 and negative
    times; report blamed a --keep it was never given)."""
    from rankkit.errors import RankkitError

    store, _, frame = store_and_bench
    damaged = tmp_path / "damaged.parquet"
    first = pl.int_range(pl.len()) == 0
    frame.with_columns(pl.when(first).then(value).otherwise(pl.col(column)).alias(column)).write_parquet(damaged)
    refusal = f"bench {damaged} holds {column} {value} (example "
    for args in (["report", store, "--bench", damaged], ["dashboard", store, "--bench", damaged, "--out", tmp_path / "p.html"]):
        result = cli(*args)
        assert isinstance(result.exception, RankkitError), result.output
        message = str(result.exception)
        assert message.startswith(refusal) and f"outside {bounds}: not as rankkit bench wrote it" in message
    assert not (tmp_path / "p.html").exists()


@pytest.mark.parametrize(
    ("label", "keep"),
    [
        ("keep=0.1", 0.3),  # the row ran at 0.1: "ev off" would be the store's selection at 0.3 beside it
        ("keep=0.2", 0.2),  # its tokens are not 0.2 of the prompt
        ("keep=0.1x", 0.1),
    ],
)
def test_a_bench_row_whose_budget_columns_disagree_is_refused(store_and_bench, cli, tmp_path, label, keep):
    from rankkit.errors import RankkitError

    store, _, frame = store_and_bench
    edited = tmp_path / "edited.parquet"
    row = (pl.col("method") == "claa") & (pl.col("keep") == 0.1) & (pl.col("example_id") == "e0")
    tokens = frame.filter(row)["budget_tokens"].item()
    frame.with_columns(
        pl.when(row).then(pl.lit(label)).otherwise("budget").alias("budget"),
        pl.when(row).then(pl.lit(keep)).otherwise("keep").alias("keep"),
    ).write_parquet(edited)
    result = cli("report", store, "--bench", edited)
    assert isinstance(result.exception, RankkitError), result.output
    assert str(result.exception) == (
        f"bench {edited} holds budget {label}, keep {keep} and {tokens} of {TOKENS} tokens (example e0, method claa): "
        "not one budget, as rankkit bench writes them; run it again, or pass the file it wrote"
    )


@pytest.mark.parametrize(
    ("column", "value", "bounds"),
    [("layer", 100, "[0, 3]"), ("score", 7.0, "[0, 1]"), ("answer_logprob", 19.0, "(-inf, 1e-06]"), ("first_token_kl", -0.5, "[-1e-06, inf)")],
)
def test_a_diffusion_frame_holding_a_value_the_probe_never_writes_is_refused(store_and_bench, tmp_path, column, value, bounds):
    """Layers past the store's model, positive log-probabilities or scores of 7 were drawn as curves."""
    from rankkit.errors import RankkitError
    from rankkit.report import write_dashboard

    store, _, _ = store_and_bench
    rows = pl.DataFrame(
        {"example": ["e0", "e0", "e0"], "layer": [0, 1, 2], "correct": [False, True, True], "score": [0.0, 1.0, 1.0],
         "answer_logprob": [-3.0, -0.5, -0.4], "first_token_kl": [0.2, 0.01, 0.0], "evidence_attention": [0.1, 0.2, None]}
    )  # fmt: skip
    write_dashboard(store, tmp_path / "fine.html", diffusion=rows)  # layers 0..3 of the 3-layer model
    damaged = rows.with_columns(pl.when(pl.col("layer") == 1).then(value).otherwise(pl.col(column)).alias(column))
    with pytest.raises(RankkitError, match=rf"^the diffusion frame holds {column} {value} \(example e0\), outside {re.escape(bounds)}: "):
        write_dashboard(store, tmp_path / "damaged.html", diffusion=damaged)
    assert not (tmp_path / "damaged.html").exists()


def test_a_bench_or_diffusion_joined_with_an_edited_copy_of_itself_is_refused(store_and_bench, cli, tmp_path):
    """A bench concatenated with a copy whose scores read 1.0 reported accuracy 1.00 where the bench
    measured 0.00: each figure took one of the two rows of an example, method and budget."""
    from rankkit.errors import RankkitError
    from rankkit.report import write_dashboard

    store, _, frame = store_and_bench
    doubled = tmp_path / "doubled.parquet"
    pl.concat([frame, frame.with_columns(score=pl.lit(1.0))]).write_parquet(doubled)
    first = frame.row(0, named=True)
    refusal = (
        f"bench {doubled} holds more than one row of example_id {first['example_id']}, method {first['method']}, "
        f"budget {first['budget']} ({2 * frame.height} rows share a key); rankkit bench writes one each"
    )
    for args in (["report", store, "--bench", doubled], ["dashboard", store, "--bench", doubled, "--out", tmp_path / "p.html"]):
        result = cli(*args)
        assert isinstance(result.exception, RankkitError), result.output
        assert str(result.exception).startswith(refusal)
    assert not (tmp_path / "p.html").exists()
    rows = pl.DataFrame({"example": ["e0", "e0"], "layer": [0, 3], "correct": [False, True]})
    with pytest.raises(RankkitError, match=r"^the diffusion frame holds more than one row of example e0, layer 3 \(2 rows"):
        write_dashboard(store, tmp_path / "d.html", diffusion=pl.concat([rows, rows.tail(1)]))


def test_a_diffusion_of_another_model_is_refused_beside_the_store(store_and_bench, tmp_path):
    from rankkit.errors import RankkitError
    from rankkit.report import write_dashboard

    store, _, _ = store_and_bench
    rows = pl.DataFrame({"example": ["e0", "e0"], "layer": [0, 3], "correct": [False, True]})
    other = rows.with_columns(model=pl.lit("other"), weights_hash=pl.lit("b" * 64))
    with pytest.raises(RankkitError, match=r"^the diffusion frame was measured with model other \(weights bbbbbbbbbbbb\)"):
        write_dashboard(store, tmp_path / "other.html", diffusion=other)
    write_dashboard(store, tmp_path / "own.html", diffusion=rows.with_columns(weights_hash=pl.lit(WEIGHTS)))
    with pytest.warns(UserWarning, match="the diffusion frame does not say which model measured it"):
        write_dashboard(store, tmp_path / "older.html", diffusion=rows)
