"""Capture end to end on a tiny model folder: store contents, resume, kill-and-rerun, sharding, the oracle."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import run_on_two_gloo_ranks, tiny_model

from rankkit import stores
from rankkit.capture import OracleOptions, add_oracle, capture
from rankkit.stores.writer import lock_file

DATA = "niah:n=4,length=256"


def _capture_cli(folder, out, *extra, data=DATA):
    return [
        sys.executable,
        "-m",
        "rankkit.cli",
        "capture",
        "--model",
        str(folder),
        "--data",
        data,
        "--out",
        str(out),
        "--device",
        "cpu",
        *extra,
    ]


def _same_store(left, right, exact=True):
    """Equal stores; ``exact=False`` allows float noise from another thread count (sharded runs)."""
    same = np.array_equal if exact else (lambda x, y: np.allclose(x, y, rtol=1e-5, atol=1e-7))
    a, b = stores.open(left), stores.open(right)
    assert a.example_ids() == b.example_ids()
    for example_id in a.example_ids():
        x, y = a.example(example_id), b.example(example_id)
        assert np.array_equal(x.tokens, y.tokens)
        assert x.probes == y.probes
        for probe in x.probes:
            assert same(x.scores(probe), y.scores(probe)), (example_id, probe)
        assert (x.oracle is None) == (y.oracle is None)
        if x.oracle is not None:
            assert same(x.oracle, y.oracle)
            assert same(x.oracle_layers, y.oracle_layers)
        assert x.attrs["spans"] == y.attrs["spans"]


@pytest.fixture(scope="module")
def reference_store(tiny_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run.zarr"
    summary = capture(
        model=str(tiny_folder), data=DATA, out=out, device="cpu", oracle=OracleOptions(max_new_tokens=4)
    )
    assert (summary.written, summary.captures, summary.oracles) == (4, 4, 4)
    assert summary.accuracy["n_examples"] == 4
    return out


def test_store_holds_every_probe_at_every_layer_with_spans(reference_store):
    store = stores.open(reference_store)
    assert len(store) == 4
    assert set(store.meta["probes"]) == {
        "window",
        "window:w=32",  # ASL and SnapKV rank by the window at W=32: a default capture records it too
        "last_token_raw",
        "lava",
        "token_units",
        "last_token_heads",
    }
    assert store.meta["probes"]["window:w=32"]["window_size"] == 32
    assert store.meta["num_layers"] == 3 and store.meta["kv_heads"] == 2
    record = store.example(store.example_ids()[0])
    for probe in record.probes:
        scores = record.scores(probe)
        heads = store.meta["num_attention_heads"] if probe == "last_token_heads" else 2  # per query head
        assert scores.shape == (3, heads, record.num_tokens) and np.isfinite(scores).all()
    assert 240 <= record.num_tokens <= 256
    ((start, end),) = record.attrs["spans"]["evidence_tokens"]
    needle_text = "".join(record.attrs["token_text"][start:end])
    assert "sandwich" in needle_text and "Dolores Park" in needle_text
    assert record.oracle.shape == (record.num_tokens,)
    assert record.oracle_layers.shape == (3, record.num_tokens)
    assert record.attrs["oracle_params"]["max_new_tokens"] == 4


def test_each_examples_attrs_hold_what_it_asks_and_where_its_parts_are(reference_store, default_tokenizer):
    """What a reader of the store has without the model, against the data spec's own examples: the task,
    question, answers and metric as the data gave them, one text per token, and spans whose characters
    are the context and the question of the prompt, and whose tokens read them and the needle."""
    import json

    from rankkit.data import METRICS, load_examples
    from rankkit.prompting import example_prompt

    store = stores.open(reference_store)
    examples = {example.id: example for example in load_examples(DATA, default_tokenizer)}
    assert sorted(store.example_ids()) == sorted(examples)
    for example_id, example in examples.items():
        record = store.example(example_id)
        attrs, tokens, text = record.attrs, record.tokens.tolist(), example_prompt(default_tokenizer, example).text
        assert {key: attrs[key] for key in ("task", "question", "answers", "answer_prefix", "metric", "meta")} == {
            "task": example.task,
            "question": example.question,
            "answers": list(example.answers),
            "answer_prefix": example.answer_prefix,
            "metric": example.metric,
            "meta": json.loads(json.dumps(example.meta)),
        }
        assert attrs["num_tokens"] == len(tokens) == record.num_tokens
        assert attrs["token_text"] == [default_tokenizer.decode([token]) for token in tokens]
        spans = attrs["spans"]
        assert set(spans) == {"context_chars", "question_chars", "context_tokens", "question_tokens",
                              "evidence_chars", "evidence_tokens"}  # fmt: skip
        assert text[slice(*spans["context_chars"])] == example.context
        assert text[slice(*spans["question_chars"])] == example.question
        assert spans["evidence_chars"] == [list(span) for span in example.evidence] != []
        read = {name: default_tokenizer.decode(tokens[slice(*spans[name])]) for name in ("context_tokens", "question_tokens")}
        assert example.context.strip() in read["context_tokens"] and example.question.strip() in read["question_tokens"]
        assert spans["context_tokens"][1] <= spans["question_tokens"][0]
        for (start, end), (first, last) in zip(example.evidence, spans["evidence_tokens"], strict=True):
            assert spans["context_tokens"][0] <= first < last <= spans["context_tokens"][1]
            assert example.context[start:end].strip() in default_tokenizer.decode(tokens[first:last])
        # the oracle ranked by the model's own answer, which is scored by the example's metric
        assert attrs["oracle_params"]["answer"] == "generated" and attrs["prediction"] == attrs["oracle_answer"]
        assert attrs["correct"] == float(METRICS[example.metric](attrs["prediction"], example.answers))


def test_capture_prefills_each_example_once_and_a_reference_oracle_decodes_from_that_prefill(
    tiny_folder, tmp_path, monkeypatch
):
    """The oracle's decode continues the capture's prefill (a second would cost as much again); an
    oracle of the reference answer records that answer, and no prediction to score."""
    from rankkit.prompting import reference_answer
    from rankkit.runner import Runner

    prefills = []
    real = Runner.prefill
    monkeypatch.setattr(Runner, "prefill", lambda self, *args, **kwargs: prefills.append(1) or real(self, *args, **kwargs))
    out = tmp_path / "reference.zarr"
    options = OracleOptions(answer="reference", max_new_tokens=4)
    summary = capture(model=str(tiny_folder), data="niah:n=2,length=256", out=out, device="cpu", oracle=options)
    assert len(prefills) == summary.captures == summary.oracles == 2
    store = stores.open(out)
    for example_id in store.example_ids():
        attrs = store.example(example_id).attrs
        assert attrs["oracle_params"] == options.params()
        assert attrs["oracle_answer"] == reference_answer(attrs["answers"], attrs["answer_prefix"]) != ""
        assert not {"prediction", "correct"} & set(attrs)


def test_a_runs_metadata_names_its_model_tokenizer_probes_and_data(reference_store, tiny_folder, default_tokenizer):
    """What a resumed capture must match, and what every figure read from the store is labelled with."""
    from types import SimpleNamespace

    from transformers import Llama4TextConfig

    from rankkit.capture import run_meta
    from rankkit.models import LoadedModel
    from rankkit.probes import parse_probes

    meta = stores.open(reference_store).meta
    assert {key: meta["model"][key] for key in ("id", "family", "dtype")} == {
        "id": str(tiny_folder), "family": "llama", "dtype": "float32"
    }  # fmt: skip
    assert re.fullmatch("[0-9a-f]{64}", meta["model"]["weights_hash"])  # the weights' sha256
    assert not {"layer_types", "sliding_window"} & set(meta["model"]) and "timing_only" not in meta  # every layer global
    assert (meta["num_layers"], meta["num_attention_heads"], meta["kv_heads"]) == (3, 4, 2)
    assert meta["tokenizer"] == {"class": type(default_tokenizer).__name__, "vocab_size": len(default_tokenizer)}
    assert meta["dataset"] == DATA
    # a model with local layers records them and their window; random weights are marked timing only
    hybrid = tiny_model("gemma2")
    loaded = LoadedModel(hybrid.to(torch.bfloat16), default_tokenizer, "random:gemma2", "0" * 64, torch.device("cpu"), True)
    made = run_meta(loaded, parse_probes("window"), DATA)
    assert made["model"]["layer_types"] == list(hybrid.config.layer_types) and "sliding_attention" in made["model"]["layer_types"]
    assert made["model"]["sliding_window"] == hybrid.config.sliding_window > 0
    assert (made["model"]["family"], made["model"]["dtype"], made["timing_only"]) == ("gemma2", "bfloat16", True)
    assert made["probes"] == {"window": parse_probes("window")[0].params()}
    # Llama 4's chunked layers: local, with no sliding window to record
    chunked = SimpleNamespace(config=Llama4TextConfig(num_hidden_layers=4), dtype=torch.bfloat16)
    made = run_meta(LoadedModel(chunked, default_tokenizer, "llama4", "0" * 64, torch.device("cpu")), [], DATA)
    assert made["model"]["layer_types"][0] == "chunked_attention" and made["model"]["sliding_window"] is None


def test_rerun_skips_complete_examples(reference_store, tiny_folder):
    summary = capture(
        model=str(tiny_folder),
        data=DATA,
        out=reference_store,
        device="cpu",
        oracle=OracleOptions(max_new_tokens=4),
    )
    assert (summary.skipped, summary.written) == (4, 0)
    assert summary.tokens_per_second is None  # nothing timed: no figure
    # the oracle's score is the store's, over all four held examples (a resume counted only new ones)
    store = stores.open(reference_store)
    stored = [store.example(example_id).attrs["correct"] for example_id in store.example_ids()]
    assert summary.accuracy["n_examples"] == 4 and summary.accuracy["accuracy"] == pytest.approx(np.mean(stored))


@pytest.mark.processes
def test_killed_capture_then_rerun_equals_an_uninterrupted_run(reference_store, tiny_folder, tmp_path):
    out = tmp_path / "killed.zarr"
    victim = subprocess.Popen(
        _capture_cli(tiny_folder, out, "--oracle", "--max-new-tokens", "4"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and victim.poll() is None:
        if out.exists() and len(list((out / "examples").glob("*"))) >= 2:
            break
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    rerun = subprocess.run(
        _capture_cli(tiny_folder, out, "--oracle", "--max-new-tokens", "4"), capture_output=True, text=True
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    _same_store(out, reference_store)


def test_oracle_added_later_equals_capture_with_oracle(reference_store, tiny_folder, tmp_path):
    from rankkit.errors import RankkitError
    from rankkit.progress import SKIPPED, Progress

    out, events = tmp_path / "later.zarr", []
    capture(model=str(tiny_folder), data=DATA, out=out, device="cpu")
    ids = stores.open(out).example_ids()
    assert not stores.open(out).example(ids[0]).has_oracle
    with pytest.raises(RankkitError) as refused:
        add_oracle(out, options={"kernal": 3}, model=str(tiny_folder), device="cpu")
    assert str(refused.value) == "options has no setting kernal; its settings are answer, softmax, kernel, max_new_tokens"
    # a dict of the settings, as capture's oracle takes it (an AttributeError on .params once); without
    # --model, the model the store names
    summary = add_oracle(out, options={"max_new_tokens": 4}, device="cpu", progress=events.append)
    assert (summary.written, summary.oracles, summary.total, summary.complete_before, summary.outdated_before) == (4, 4, 4, 0, 0)
    assert events == [Progress("written", number, 4, example_id) for number, example_id in enumerate(ids, start=1)]
    assert summary.out == str(out) and not summary.timing_only and 0 < summary.seconds < 600
    assert [path.name for path in out.glob(".writer-*.lock")] == [lock_file(out, 0).name]  # the capture's, rank 0
    _same_store(out, reference_store)
    events.clear()
    again = add_oracle(out, options={"max_new_tokens": 4}, device="cpu", progress=events.append)
    assert (again.skipped, again.written, again.complete_before) == (4, 0, 4)
    assert events == [Progress(SKIPPED, number, 4, example_id) for number, example_id in enumerate(ids, start=1)]


def test_a_reference_oracle_of_an_example_without_answers_is_refused_by_name_before_the_weights_load(
    tiny_folder, tmp_path, monkeypatch
):
    """capture --oracle --answer reference wrote the examples before the first without answers, then
    stopped at its oracle with "answer='reference' needs examples with answers", naming neither."""
    from rankkit import models
    from rankkit.data import Example, export_jsonl
    from rankkit.errors import RankkitError

    answered = Example("a", "jsonl", "Some context.", "What?", ("x",))
    data = tmp_path / "d.jsonl"
    export_jsonl([answered, Example("b", "jsonl", "More context.", "What?", ())], data)
    refusal = (
        "example 'b' has no answers, and --answer reference follows its first; add answers to it, leave it "
        "out, or pass --answer generated"
    )
    out = tmp_path / "run.zarr"
    capture(model=str(tiny_folder), data=str(data), out=out, device="cpu", probes="window")
    monkeypatch.setattr(models, "load", lambda *args, **kwargs: pytest.fail("the weights loaded"))
    with pytest.raises(RankkitError, match=re.escape(refusal)):
        capture(model=str(tiny_folder), data=str(data), out=tmp_path / "new.zarr", oracle=OracleOptions(answer="reference"))
    assert not (tmp_path / "new.zarr").exists()
    with pytest.raises(RankkitError, match=re.escape(refusal)):
        add_oracle(out, options={"answer": "reference"}, model=str(tiny_folder), device="cpu")
    assert not any(record.has_oracle for record in stores.open(out).examples())


def test_add_oracle_loads_the_default_model_by_its_name_and_refuses_other_weights(tiny_folder, tmp_path, monkeypatch):
    """A store of the default model names its hub id, which a machine without a hub cannot load: the
    oracle loads it as ``default``, the embedded model. Weights other than the store's are refused."""
    from transformers import AutoModelForCausalLM

    from rankkit import model_cache, models
    from rankkit.errors import RankkitError

    out = tmp_path / "run.zarr"
    capture(model=str(tiny_folder), data="niah:n=1,length=256", out=out, device="cpu", probes="window")
    other = tmp_path / "other-weights"
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(models.load_config(str(tiny_folder))).save_pretrained(other)
    shutil.copy(tiny_folder / "tokenizer.json", other)
    with pytest.raises(RankkitError) as refused:  # not known before it loads: refused once loaded
        add_oracle(out, options={"max_new_tokens": 2}, model=str(other), device="cpu")
    assert str(refused.value) == (
        f"the store was captured with other weights than '{other}' has now; pass --model with the original model"
    )
    asked, real_load = [], models.load
    monkeypatch.setattr(model_cache, "DEFAULT_MODEL_NAME", str(tiny_folder))  # the store's model is the default
    monkeypatch.setattr(models, "known_weights_hash", lambda spec, device: asked.append(spec))
    monkeypatch.setattr(models, "load", lambda spec, **kwargs: asked.append(spec) or real_load(str(tiny_folder), **kwargs))
    assert add_oracle(out, options={"max_new_tokens": 2}, device="cpu").oracles == 1
    assert asked == ["default", "default"]


@pytest.mark.processes
def test_two_ranks_on_gloo_shard_into_one_store(reference_store, tiny_folder, tmp_path):
    out = tmp_path / "sharded.zarr"
    done = run_on_two_gloo_ranks(
        29533, "capture", "--model", tiny_folder, "--data", DATA, "--out", out,
        "--device", "cpu", "--oracle", "--max-new-tokens", 4,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    _same_store(out, reference_store, exact=False)


@pytest.mark.processes
def test_bad_input_is_one_line_and_exit_2(tiny_folder, tmp_path):
    done = subprocess.run(
        _capture_cli(tiny_folder, tmp_path / "x.zarr", data="haystack:n=2"), capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("rankkit: error: unknown data kind 'haystack'")
    assert not (tmp_path / "x.zarr").exists()


def test_capture_with_a_draft_stores_its_lookahead_scores_and_a_resume_with_another_refuses(
    tiny_folder, tmp_path
):
    from rankkit import models
    from rankkit.errors import RankkitError
    from rankkit.methods import make
    from rankkit.runner import Runner

    out = tmp_path / "draft.zarr"
    capture(model=str(tiny_folder), data="niah:n=1,length=256", out=out, device="cpu", draft="layers:2")
    # complete with its draft's scores: a rerun has nothing to do
    assert capture(model=str(tiny_folder), data="niah:n=1,length=256", out=out, device="cpu", draft="layers:2").skipped == 1
    store = stores.open(out)
    example = store.example(store.example_ids()[0])
    stored = example.group("draft_scores")["lookahead"]
    runner = Runner(models.load(str(tiny_folder), device="cpu").model)
    expected, _ = make("specprefill", draft_model="layers:2").draft_scores(
        runner, torch.from_numpy(example.tokens)
    )
    assert stored.shape == (8, example.tokens.shape[0]) and np.array_equal(stored, expected.numpy())
    with pytest.raises(RankkitError):
        capture(model=str(tiny_folder), data="niah:n=1,length=256", out=out, device="cpu", draft="layers:1")
    # offline, SpecPrefill ranks only by the draft the store holds: another draft or lookahead gave the
    # store's selection under its own label
    from rankkit.eval.compare import compare_store
    from rankkit.eval.offline import select_store
    from rankkit.methods import Budget

    budget = Budget.from_keep(0.1)
    (row,) = select_store(out, "specprefill:draft_model=layers:2", **budget.keywords)
    mean_over_lookahead = stored.mean(axis=0)  # Eq. 3 of [k, T] scores; the last token always kept
    length = len(mean_over_lookahead)
    top = np.argsort(-mean_over_lookahead[:-1], kind="stable")[: -(-length // 10) - 1]
    assert row["selected_positions"] == sorted([*top.tolist(), length - 1])
    for other, made in (("specprefill", "draft_model=layers:1,lookahead=8"), ("specprefill:draft_model=layers:2,lookahead=4", "draft_model=layers:2,lookahead=4")):
        with pytest.raises(RankkitError, match=f"^the store's draft scores were made with draft_model=layers:2,lookahead=8, but method 'specprefill' ranks with {made}; rank with specprefill:draft_model=layers:2,lookahead=8"):
            select_store(out, other, **budget.keywords)
    assert "specprefill:draft_model=layers:2,lookahead=8" in compare_store(out, oracle=False, workers=1).summary["method"].to_list()
    assert select_store(out, "specprefill:draft_model=layers:2,kernel_size=3", **budget.keywords)  # pooled offline: any kernel


def test_oracle_settings_are_part_of_the_store_identity(reference_store, tiny_folder, tmp_path):
    from rankkit.errors import RankkitError

    made = "holds oracles made with answer=generated, softmax=False, kernel=7, max_new_tokens=4"
    with pytest.raises(RankkitError, match=f"{made} .*; rerun with --max-new-tokens 4, or recompute every"):
        capture(
            model=str(tiny_folder),
            data=DATA,
            out=reference_store,
            device="cpu",
            oracle=OracleOptions(max_new_tokens=8),
        )
    # the fix names the options that give the store's settings, only those that differ
    for other, fix in (
        (OracleOptions(kernel=3, max_new_tokens=4), "--kernel 7"),
        (OracleOptions(softmax=True, max_new_tokens=4), "--no-softmax"),
        (OracleOptions(answer="reference", softmax=True), "--answer generated --no-softmax --max-new-tokens 4"),
    ):
        with pytest.raises(RankkitError, match=f"{made} .*; rerun with {fix}, or recompute every oracle with "
                           f"`rankkit oracle {reference_store} --redo`"):  # fmt: skip
            add_oracle(reference_store, options=other, model=str(tiny_folder), device="cpu")
    redone = tmp_path / "redone.zarr"
    shutil.copytree(reference_store, redone)
    add_oracle(redone, options=OracleOptions(kernel=3, max_new_tokens=4), model=str(tiny_folder), redo=True)
    kernels = {record.attrs["oracle_params"]["kernel"] for record in stores.open(redone).examples()}
    assert kernels == {3}
    with pytest.raises(RankkitError, match="kernel=3, max_new_tokens=4"):
        add_oracle(redone, options=OracleOptions(max_new_tokens=4), model=str(tiny_folder), device="cpu")


def test_an_oracle_unflagged_midway_through_its_redo_holds_no_setting_and_is_redone(reference_store, tiny_folder, tmp_path):
    """A crash while an oracle is rewritten leaves it unflagged, its attrs still naming the settings of
    the redo: those are not settings the store holds, and adding oracles redoes that one alone."""
    import zarr

    from rankkit.capture import check_oracle_settings
    from rankkit.stores.schema import example_path, update_attributes

    crashed = tmp_path / "crashed.zarr"
    shutil.copytree(reference_store, crashed)
    options = OracleOptions(max_new_tokens=4)  # the reference store's
    first = stores.open(crashed).example_ids()[0]
    group = zarr.open_group(crashed / example_path(first), mode="r+")
    update_attributes(group, {"oracle_complete": False, "oracle_params": OracleOptions(kernel=3).params()})
    check_oracle_settings(crashed, options)  # only the flagged oracles' settings count
    summary = add_oracle(crashed, options=options, model=str(tiny_folder), device="cpu")
    assert summary.oracles == 1 and summary.complete_before == 3
    records = stores.open(crashed).examples()
    assert all(record.has_oracle and record.attrs["oracle_params"] == options.params() for record in records)


def test_an_interrupted_redo_resumes_redoing_only_the_oracles_of_the_old_settings(
    reference_store, tiny_folder, tmp_path, monkeypatch
):
    from rankkit.errors import Interrupted, RankkitError
    from rankkit.stores.writer import StoreWriter

    redone = tmp_path / "redone.zarr"
    shutil.copytree(reference_store, redone)
    new = OracleOptions(max_new_tokens=2)
    real = StoreWriter.add_oracle

    def interrupt_after_the_first(self, example_id, **kwargs):
        if sum(record.attrs["oracle_params"] == new.params() for record in stores.open(self.path).examples()):
            raise KeyboardInterrupt
        return real(self, example_id, **kwargs)

    monkeypatch.setattr(StoreWriter, "add_oracle", interrupt_after_the_first)
    with pytest.raises(Interrupted) as interrupted:
        add_oracle(redone, options=new, model=str(tiny_folder), device="cpu", redo=True)
    assert str(interrupted.value) == (
        "interrupted: kept 0 captures and 1 oracles written by this run (0 examples were complete before, "
        f"4 with oracles of other settings to redo) in {redone}; rerun the same command to resume"
    )
    monkeypatch.setattr(StoreWriter, "add_oracle", real)
    first, second = stores.open(redone).example_ids()[:2]  # redone first, and one the redo had not reached
    with pytest.raises(RankkitError) as refused:
        add_oracle(redone, options=new, model=str(tiny_folder), device="cpu")
    assert str(refused.value) == (
        f"{redone} holds oracles made with 2 settings (answer=generated, softmax=False, kernel=7, max_new_tokens=2 "
        f"(example {first!r}); answer=generated, softmax=False, kernel=7, max_new_tokens=4 (example {second!r})), "
        f"as an interrupted --redo leaves it; finish it with `rankkit oracle {redone} --redo` and the settings it was given"
    )
    resumed = add_oracle(redone, options=new, model=str(tiny_folder), device="cpu", redo=True)
    assert (resumed.written, resumed.skipped) == (3, 1)
    settings = [record.attrs["oracle_params"]["max_new_tokens"] for record in stores.open(redone).examples()]
    assert settings == [2, 2, 2, 2]
    again = add_oracle(redone, options=new, model=str(tiny_folder), device="cpu", redo=True)
    assert (again.written, again.skipped) == (0, 4)


def _complete_examples(out) -> int:
    """Examples a capture still writing to ``out`` has completed (``example_state``, which never raises)."""
    from stores.schema import EXAMPLES, example_state

    examples = out / EXAMPLES
    if not examples.is_dir():
        return 0
    return sum(example_state(entry)[0] == "complete" for entry in examples.iterdir() if entry.is_dir())


@pytest.mark.processes
def test_sigint_stops_a_capture_keeping_whole_examples_and_the_rerun_completes(tiny_folder, tmp_path):
    out = tmp_path / "interrupted.zarr"
    command = _capture_cli(tiny_folder, out, data="niah:n=40,length=256")
    victim = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and victim.poll() is None:
        if _complete_examples(out) >= 1:  # as the store itself says, not by its directories
            break
        time.sleep(0.01)
    victim.send_signal(signal.SIGINT)
    stderr = victim.communicate(timeout=120)[1]
    assert victim.returncode == 130, stderr
    kept = len(stores.open(out).example_ids())
    said = re.fullmatch(
        rf"rankkit: interrupted: kept (\d+) captures and 0 oracles written by this run \(0 examples were "
        rf"complete before\) in {out}; "
        "rerun the same command to resume",
        stderr.strip().splitlines()[-1],
    )
    assert said is not None, stderr
    assert 1 <= kept < 40 and int(said[1]) in (kept - 1, kept)  # the signal may fall between write and count
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    assert len(stores.open(out).example_ids()) == 40


@pytest.mark.processes
def test_capture_cli_threads_runs_on_one_thread_and_writes_the_same_scores(
    tiny_folder, reference_store, tmp_path
):
    out = tmp_path / "one-thread.zarr"
    extra = ("--threads", "1", "--oracle", "--max-new-tokens", "4")
    subprocess.run(_capture_cli(tiny_folder, out, *extra), check=True, capture_output=True, timeout=600)
    _same_store(out, reference_store, exact=False)


def test_score_arrays_record_where_their_scores_are_pooled(reference_store):
    record = next(iter(stores.open(reference_store).examples()))
    window = record.score_layout("window")
    assert (window["pooling"], window["kernel_size"], window["unpooled_last"]) == ("avg", 7, 8)
    lava = record.score_layout("lava")
    assert (lava["pooling"], lava["kernel_size"], lava["unpooled_last"]) == ("max", 7, 32)
    raw = record.score_layout("last_token_raw")  # GemFilter pools its whole row, the last token too
    assert (raw["pooling"], raw["kernel_size"], raw["unpooled_last"]) == ("avg_padded", 5, 0)
    assert record.score_layout("last_token_heads") == {} and record.score_layout("token_units") == {}


def test_a_capture_resumed_after_its_jsonl_file_changed_is_refused(tiny_folder, tmp_path):
    """The store is keyed by the spec and the file's content: resuming into it after the lines
    changed mixed two datasets' examples in one store."""
    from transformers import AutoTokenizer

    from rankkit.data import export_spec
    from rankkit.errors import RankkitError

    tokenizer = AutoTokenizer.from_pretrained(tiny_folder)
    data, out = tmp_path / "mine.jsonl", tmp_path / "run.zarr"
    export_spec("niah:n=2,length=128", tokenizer, data)
    capture(model=str(tiny_folder), data=str(data), out=out, device="cpu", limit=1)
    export_spec("niah:n=2,length=128,seed=1", tokenizer, data, overwrite=True)
    with pytest.raises(RankkitError, match=r"holds a different run \(data_sha256: "):
        capture(model=str(tiny_folder), data=str(data), out=out, device="cpu")
    assert stores.open(out).example_ids() and len(stores.open(out)) == 1


def test_oracle_settings_without_an_oracle_are_refused_by_their_options_and_the_defaults_pass():
    from rankkit.capture import requested_oracle
    from rankkit.errors import RankkitError

    chosen = OracleOptions(softmax=True, kernel=9)
    assert requested_oracle(True, chosen) is chosen
    assert requested_oracle(False, OracleOptions()) is None
    for options, given in (
        (chosen, "--softmax --kernel 9 set"),
        (OracleOptions(answer="reference"), "--answer reference sets"),
        (OracleOptions(softmax=False, max_new_tokens=4), "--max-new-tokens 4 sets"),  # a default is not named
    ):
        with pytest.raises(RankkitError) as refused:
            requested_oracle(False, options)
        assert str(refused.value) == f"{given} how the oracle is made, and no oracle is made: add --oracle, or drop them"


def test_what_an_interrupted_capture_kept_names_oracles_to_redo_only_when_it_had_some():
    from rankkit.capture import CaptureSummary

    summary = CaptureSummary(out="store.zarr", captures=2, oracles=1, complete_before=3)
    assert summary.kept() == (
        "interrupted: kept 2 captures and 1 oracles written by this run (3 examples were complete before) "
        "in store.zarr; rerun the same command to resume"
    )
    summary.outdated_before = 4
    assert "(3 examples were complete before, 4 with oracles of other settings to redo) in store.zarr" in summary.kept()


def test_a_stores_size_is_one_score_per_layer_kv_head_probe_and_token():
    """What a capture checks the disk for before it writes (float32 scores by default, float16 on request)."""
    from types import SimpleNamespace

    from rankkit.capture import store_bytes

    config = SimpleNamespace(num_hidden_layers=30, num_key_value_heads=3)  # the default model's shape
    assert store_bytes(config, 6, 1000, "float16") == 30 * 3 * 6 * 1000 * 2 == 1_080_000
    assert store_bytes(config, 6, 1000, "float32") == 2_160_000
    assert store_bytes(config, 1, 7, "float16") == 30 * 3 * 7 * 2


def test_a_captures_summary_books_written_and_skipped_examples_their_tokens_and_scores():
    """What the summary prints and the accuracy interval resamples (by the example's cluster), and the
    progress a front end draws: a resumed example is ``skipped``, taking no time."""
    from rankkit.capture import CaptureSummary
    from rankkit.progress import SKIPPED, Progress

    events = []
    summary = CaptureSummary(out="store.zarr", total=3)
    for example_id, tokens, attrs in (
        ("a", 100, {"meta": {"cluster": "needle-1"}, "correct": 1.0}),
        ("b", None, {"meta": {}, "correct": 0.0}),  # found complete: skipped, its stored score still counts
        ("c", 50, {"meta": None}),  # no score: random weights, or an oracle without an answer
    ):
        summary.examples += 1
        summary.count(events.append, example_id, tokens, attrs)
    assert (summary.written, summary.skipped, summary.tokens) == (2, 1, 150)
    assert summary.scored == [
        {"example_id": "a", "cluster": "needle-1", "accuracy": 1.0},
        {"example_id": "b", "cluster": None, "accuracy": 0.0},
    ]
    assert events == [Progress("written", 1, 3, "a"), Progress(SKIPPED, 2, 3, "b"), Progress("written", 3, 3, "c")]


def test_the_python_apis_oracle_argument_takes_options_a_dict_of_them_true_or_none():
    from rankkit.capture import _oracle_options
    from rankkit.errors import RankkitError

    chosen = OracleOptions(kernel=3)
    assert _oracle_options(True) == OracleOptions() and _oracle_options(chosen) is chosen
    assert _oracle_options(False) is None and _oracle_options(None) is None
    assert _oracle_options({"kernel": 3, "softmax": True}) == OracleOptions(kernel=3, softmax=True)
    with pytest.raises(RankkitError) as refused:
        _oracle_options({"kernal": 3, "depth": 1}, "options")
    assert str(refused.value) == "options has no setting kernal, depth; its settings are answer, softmax, kernel, max_new_tokens"
    with pytest.raises(RankkitError) as refused:
        _oracle_options("yes")
    assert str(refused.value) == (
        "oracle takes OracleOptions(...), a dict of its settings, True for its defaults, or None, not 'yes'"
    )


def test_an_oracles_answer_is_scored_against_the_examples_answers_and_a_reference_follows_its_prefix(tiny_folder):
    """The generated answer counts as correct exactly when the example's metric says so (a random model's
    answer is wrong for any real question, so the test makes its own answer the gold one); the reference
    answer is the first gold answer, after the prompt's answer prefix with its space."""
    from rankkit import models
    from rankkit.capture import oracle_for
    from rankkit.runner import Runner

    loaded = models.load(str(tiny_folder), device="cpu")
    runner, tokenizer, ids = Runner(loaded.model), loaded.tokenizer, torch.arange(3, 40)
    options = OracleOptions(max_new_tokens=4)
    _, wrong = oracle_for(runner, tokenizer, ids, {"answers": ["Dolores Park"], "metric": "string_match_all"}, options, None, scored=True)
    assert wrong["correct"] == 0.0 and wrong["prediction"] == wrong["oracle_answer"] != ""
    own = {"answers": [wrong["prediction"].strip()], "metric": "string_match_all"}
    _, right = oracle_for(runner, tokenizer, ids, own, options, None, scored=True)
    assert right["correct"] == 1.0 and right["prediction"] == wrong["prediction"]
    _, unscored = oracle_for(runner, tokenizer, ids, own, options, None, scored=False)
    assert "correct" not in unscored and unscored["prediction"] == wrong["prediction"]
    softmax = OracleOptions(softmax=True, max_new_tokens=4)  # made and recorded as asked
    assert oracle_for(runner, tokenizer, ids, own, softmax, None, scored=True)[1]["oracle_params"] == softmax.params()
    reference = OracleOptions(answer="reference", max_new_tokens=4)
    no_answers = {"answers": [], "metric": "string_match_all"}  # the generated answer needs no gold one
    assert oracle_for(runner, tokenizer, ids, no_answers, options, None, scored=False)[1]["prediction"] == wrong["prediction"]
    for prefix, expected in (("Answer:", " Paris"), ("", "Paris"), (None, "Paris")):  # None: a store from before prefixes
        attrs = {"answers": ["Paris", "Lyon"], "metric": "string_match_all"} | ({} if prefix is None else {"answer_prefix": prefix})
        _, made = oracle_for(runner, tokenizer, ids, attrs, reference, None, scored=True)
        assert made["oracle_answer"] == expected and made["oracle_params"] == reference.params()
        assert not {"prediction", "correct"} & set(made)


def test_float16_scores_are_recorded_as_the_stores_and_float32_ones_as_the_default(tiny_folder, tmp_path):
    """``--score-dtype float16`` halves a store: the store says so (a resume must match it) and holds the
    float32 capture's scores rounded; a float32 store names no dtype, as stores made before the option."""
    half, whole = tmp_path / "half.zarr", tmp_path / "whole.zarr"
    for out, score_dtype in ((half, "float16"), (whole, "float32")):
        capture(model=str(tiny_folder), data="niah:n=1,length=256", out=out, device="cpu", score_dtype=score_dtype)
    store, full = stores.open(half), stores.open(whole)
    assert store.meta["score_dtype"] == "float16" and "score_dtype" not in full.meta
    (example_id,) = store.example_ids()
    for probe in store.example(example_id).probes:
        expected = full.example(example_id).scores(probe).astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(store.example(example_id).scores(probe), expected)


def test_a_prompt_longer_than_the_model_is_refused_before_it_loads_unless_allowed(tiny_folder, tmp_path, monkeypatch):
    from rankkit import models
    from rankkit.errors import RankkitError

    class Loading(Exception):
        pass

    def load(*args, **kwargs):
        raise Loading

    monkeypatch.setattr(models, "load", load)
    with pytest.raises(RankkitError) as refused:
        capture(model=str(tiny_folder), data="niah:n=1,length=600", out=tmp_path / "long.zarr", device="cpu")
    assert str(refused.value) == (
        "'niah:n=1,length=600' has 600 tokens, more than the model's 512 positions; shorten it, or pass "
        "--allow-overlength to run it anyway"
    )
    assert not (tmp_path / "long.zarr").exists()
    with pytest.warns(UserWarning, match="more than the model's 512 positions; running it anyway"), pytest.raises(Loading):
        capture(model=str(tiny_folder), data="niah:n=1,length=600", out=tmp_path / "long.zarr", device="cpu", allow_overlength=True)


def test_an_unreadable_example_holds_no_oracle_setting(reference_store, tmp_path):
    """A resumed capture redoes an example whose metadata is damaged, so its oracle's settings (unknown)
    cannot refuse the run."""
    from rankkit.capture import check_oracle_settings
    from rankkit.errors import RankkitError
    from rankkit.stores.schema import example_path

    damaged = tmp_path / "damaged.zarr"
    shutil.copytree(reference_store, damaged)
    first = stores.open(damaged).example_ids()[0]
    (damaged / example_path(first) / "zarr.json").write_text("{ not json")
    check_oracle_settings(damaged, OracleOptions(max_new_tokens=4))
    with pytest.raises(RankkitError, match="holds oracles made with answer=generated, softmax=False, kernel=7, max_new_tokens=4 "):
        check_oracle_settings(damaged, OracleOptions(max_new_tokens=2))  # the readable ones still count


def test_a_capture_books_each_example_as_it_goes_and_a_rerun_skips_what_the_store_holds(tiny_folder, tmp_path):
    """The progress a front end draws (one event per example, counted against the run's total), what
    the summary says, and a rerun of a capture without an oracle: its examples are complete without one."""
    from rankkit.progress import SKIPPED, Progress

    out, events = tmp_path / "plain.zarr", []
    summary = capture(model=str(tiny_folder), data="niah:n=2,length=256", out=out, device="cpu", progress=events.append)
    ids = stores.open(out).example_ids()
    assert events == [Progress("written", 1, 2, ids[0]), Progress("written", 2, 2, ids[1])]
    assert (summary.examples, summary.total, summary.captures, summary.oracles, summary.complete_before) == (2, 2, 2, 0, 0)
    assert summary.out == str(out) and not summary.timing_only and 0 < summary.seconds < 600
    events.clear()
    again = capture(model=str(tiny_folder), data="niah:n=2,length=256", out=out, device="cpu", progress=events.append)
    assert events == [Progress(SKIPPED, 1, 2, ids[0]), Progress(SKIPPED, 2, 2, ids[1])]
    assert (again.skipped, again.written, again.captures, again.complete_before) == (2, 0, 0, 2)
    # the store's writer lock is its rank's (torchrun ranks write one store, each under its own lock)
    assert [path.name for path in out.glob(".writer-*.lock")] == [lock_file(out, 0).name]


def test_a_signal_whose_keyboard_interrupt_was_dropped_stops_capture_and_add_oracle_at_the_next_example(
    tiny_folder, tmp_path, monkeypatch
):
    """Python drops a KeyboardInterrupt raised in a finaliser (CI saw a Ctrl-C'd capture run to its end,
    exit 0): the signal noted, each loop stops before its next example, saying what it kept."""
    from rankkit import interrupts
    from rankkit.errors import Interrupted

    def dropped_after_first(event):
        if event.done == 1:
            monkeypatch.setattr(interrupts, "_noted", [signal.SIGINT])  # what the handler notes

    out = tmp_path / "stopped.zarr"
    with pytest.raises(Interrupted, match=r"^interrupted: kept 1 captures and 0 oracles written by this run"):
        capture(model=str(tiny_folder), data="niah:n=3,length=256", out=out, device="cpu", progress=dropped_after_first)
    assert len(stores.open(out).example_ids()) == 1
    capture(model=str(tiny_folder), data="niah:n=3,length=256", out=out, device="cpu")
    with pytest.raises(Interrupted, match=r"^interrupted: kept 0 captures and 1 oracles written by this run"):
        add_oracle(out, options={"max_new_tokens": 2}, device="cpu", progress=dropped_after_first)
    assert [stores.open(out).example(each).has_oracle for each in stores.open(out).example_ids()] == [True, False, False]


def test_overwrite_replaces_a_store_of_another_run_that_a_resume_refuses(tiny_folder, tmp_path):
    from rankkit.errors import RankkitError

    out = tmp_path / "run.zarr"
    capture(model=str(tiny_folder), data="niah:n=1,length=256", out=out, device="cpu", probes="window")
    with pytest.raises(RankkitError, match="holds a different run .*; rerun with --overwrite to replace it"):
        capture(model=str(tiny_folder), data="niah:n=1,length=256", out=out, device="cpu", probes="last_token_raw")
    assert set(stores.open(out).meta["probes"]) == {"window"}
    summary = capture(
        model=str(tiny_folder), data="niah:n=1,length=256", out=out, device="cpu", probes="last_token_raw", overwrite=True
    )
    assert summary.written == 1 and set(stores.open(out).meta["probes"]) == {"last_token_raw"}


def test_a_new_store_needs_the_space_its_scores_take_and_a_resume_needs_none(tiny_folder, tmp_path, monkeypatch):
    """Refused before any work: one score per layer, KV head, probe and token at the asked dtype."""
    from types import SimpleNamespace

    from rankkit import outputs
    from rankkit.capture import store_bytes
    from rankkit.errors import RankkitError
    from rankkit.models import load_config

    held = tmp_path / "held.zarr"
    run = dict(model=str(tiny_folder), data="niah:n=1,length=256", device="cpu", probes="window", score_dtype="float16")
    capture(out=held, **run)
    (record,) = stores.open(held).examples()
    needed = store_bytes(load_config(str(tiny_folder)), 1, record.num_tokens, "float16")
    assert needed == record.num_tokens * 3 * 2 * 2 > 1000
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda path: SimpleNamespace(free=needed - 1))
    with pytest.raises(RankkitError) as refused:
        capture(out=tmp_path / "new.zarr", **run)
    assert str(refused.value) == (
        f"{tmp_path} needs about {outputs._size(needed)} but {tmp_path} has {outputs._size(needed - 1)} free; "
        "free some space or choose another --out"
    )
    assert not (tmp_path / "new.zarr").exists()
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda path: SimpleNamespace(free=0))
    assert capture(out=held, **run).skipped == 1  # its scores are written: nothing more to hold


def test_a_device_map_reaches_the_load_of_capture_and_of_add_oracle(tiny_folder, tmp_path):
    """A map that leaves a module without a device is refused by the load (transformers would put it on
    the CPU without a word), so the refusal shows that the map was handed on."""
    from rankkit.errors import RankkitError

    missing_a_layer = {name: "cpu" for name in ("model.embed_tokens", "model.norm", "lm_head", "model.layers.0", "model.layers.1")}
    out = tmp_path / "run.zarr"
    with pytest.raises(RankkitError, match="^--device-map gives no device to model.layers.2.self_attn.q_proj.weight"):
        capture(model=str(tiny_folder), data="niah:n=1,length=256", out=out, device="cpu", device_map=missing_a_layer)
    capture(model=str(tiny_folder), data="niah:n=1,length=256", out=out, device="cpu", probes="window")
    with pytest.raises(RankkitError, match="^--device-map gives no device to model.layers.2.self_attn.q_proj.weight"):
        add_oracle(out, model=str(tiny_folder), device="cpu", device_map=missing_a_layer)


def test_a_draft_that_cannot_draft_for_the_model_is_refused_before_its_weights_load(tiny_folder, no_model_load):
    from rankkit.errors import RankkitError

    with pytest.raises(RankkitError) as refused:
        capture(model=str(tiny_folder), data="niah:n=1,length=256", out=no_model_load / "s.zarr", device="cpu", draft="layers:4")
    assert str(refused.value) == "draft 'layers:4' needs a layer count in 1..3: use e.g. --draft layers:1"
    assert not (no_model_load / "s.zarr").exists()


def test_an_interrupted_capture_says_what_it_kept(tiny_folder, tmp_path, monkeypatch):
    """Ctrl-C between examples: the first is whole in the store, and the one line says so."""
    from rankkit.errors import Interrupted
    from rankkit.runner import Runner

    out, real, prefills = tmp_path / "cut.zarr", Runner.prefill, []

    def interrupt_the_second(self, *args, **kwargs):
        prefills.append(1)
        if len(prefills) == 2:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Runner, "prefill", interrupt_the_second)
    with pytest.raises(Interrupted) as interrupted:
        capture(model=str(tiny_folder), data="niah:n=2,length=256", out=out, device="cpu", probes="window")
    assert str(interrupted.value) == (
        f"interrupted: kept 1 captures and 0 oracles written by this run (0 examples were complete before) in {out}; "
        "rerun the same command to resume"
    )
    assert [record.has_oracle for record in stores.open(out).examples()] == [False]


def test_a_capture_with_an_oracle_adds_oracles_to_the_examples_a_plain_one_wrote(tiny_folder, tmp_path, reference_store):
    """Examples held whole without an oracle are not captured again: each gets its oracle from a
    prefill of its own, the same oracle as the reference store's capture made."""
    out = tmp_path / "plain-then-oracle.zarr"
    capture(model=str(tiny_folder), data=DATA, out=out, device="cpu")
    summary = capture(model=str(tiny_folder), data=DATA, out=out, device="cpu", oracle=OracleOptions(max_new_tokens=4))
    assert (summary.captures, summary.oracles, summary.complete_before) == (0, 4, 0)
    _same_store(out, reference_store)
