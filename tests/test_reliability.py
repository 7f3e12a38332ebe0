"""Careless and hostile use: bad options refused before the model loads, outputs that are never
lost or overwritten by surprise, interrupts that keep finished work, and one oracle per store.

Each case of "what a careless user tried" is here with its exact input; the model is the
tiny random Llama of ``tiny_folder`` (3 layers, 512 positions) unless the case needs more.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
import torch
from typer.testing import CliRunner

import rankkit.models
from rankkit import outputs
from rankkit.cli import commands  # noqa: F401  (registers every command)
from rankkit.cli.app import app
from rankkit.errors import RankkitError

TIMING_COLUMNS = (
    "ttft_s",
    "tpot_s",
    "first_step_s",
    "later_steps_s",
    "e2e_s",
    "ttft_ratio",
    "tpot_ratio",
    "ideal_ratio",
    "ttft_min_s",
    "cost_linear",
    "cost_quadratic",
    "cost_ffn_share",
    "bandwidth_bytes_per_s",
    "tpot_bound_s",
    "tpot_over_bound",
)


def refused(args: list[str], cwd: Path) -> str:
    """The one-line RankkitError a command raises; the folder it ran in stays empty."""
    before = sorted(cwd.iterdir())
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, RankkitError), result.output
    assert sorted(cwd.iterdir()) == before  # a rejected command leaves nothing behind
    return str(result.exception)


@pytest.mark.parametrize("method", ["claa", "fastkv", "oracle", "gemfilter"])
@pytest.mark.parametrize("layer", ["99", "-1"])
@pytest.mark.parametrize("command", ["prefill", "bench"])
def test_a_layer_outside_the_model_is_refused_before_it_loads(
    no_model_load, tiny_folder, command, method, layer
):
    method_option = ["--method", method] if command == "prefill" else ["--methods", f"full,{method}"]
    message = refused(
        [command, *method_option, "--keep", "0.2", "--data", "niah:n=1,length=200", "--layer", layer,
         "--model", str(tiny_folder)],
        no_model_load,
    )  # fmt: skip
    assert message == (
        f"--layer {layer} is not a layer of this model (3 layers, 0..2) for method '{method}'; "
        "give a layer in that range or leave --layer out"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["prefill", "--method", "snapkv", "--keep", "0.2", "--layer", "1"],
         "method snapkv has no selection layer; leave --layer out"),
        (["bench", "--methods", "full,snapkv", "--keep", "0.2", "--layer", "1"],
         "method snapkv has no selection layer; leave --layer out"),
        (["bench", "--methods", ",", "--keep", "0.2"],
         "--methods ',' names nothing; give comma-separated names"),
        (["bench", "--methods", "full,claa", "--keep", "1.5"], "keep rate 1.5 is outside (0, 1]"),
        (["bench", "--methods", "full,nope", "--keep", "0.2"], "unknown method 'nope'"),
        # rows are labelled by method and budget: two settings or two rates under one label were one's numbers
        (["bench", "--methods", "full,claa,claa:aggregation_window=2", "--keep", "0.2"],
         "claa is named twice (claa, claa:aggregation_window=2): rows are labelled by method"),
        (["bench", "--methods", "full,claa", "--keep", "0.1,0.1000000000000001"],
         "--keep: two budgets both read keep=0.1; name each once"),
        (["bench", "--methods", "full,claa", "--budget", "64,64"], "--budget: two budgets both read budget=64"),
        (["bench", "--methods", "full,claa", "--keep", "0.1,0.10000001"],
         "--keep: two budgets both read keep=0.1 (keep=0.1 and keep=0.10000001); name each once"),
        (["prefill", "--method", "claa:aggregation_window=2", "--keep", "0.2", "--compare", "claa"],
         "claa is named twice (claa, claa:aggregation_window=2): rows are labelled by method, so one setting's "
         "numbers would stand for both; run prefill once for each setting"),  # prefill has no --out
        (["prefill", "--method", "claa"], "give exactly one of --keep (e.g. 0.1) or --budget (e.g. 2048)"),
        (["prefill", "--method", "claa", "--keep", "0.2", "--json", "--kept-layers", "0,3"],
         "--kept-layers 3 is not a layer of this model (0..2); list layers in that range"),
        (["bench", "--methods", "full,specprefill", "--keep", "0.2", "--draft", "layers:0"],
         "draft 'layers:0' needs a layer count in 1..3: use e.g. --draft layers:1"),
        (["bench", "--methods", "specprefill", "--keep", "0.2", "--draft", "layers:4"],
         "draft 'layers:4' needs a layer count in 1..3"),
        (["prefill", "--method", "claa", "--keep", "0.2", "--json", "--kept-layers", ""],
         "--kept-layers '' names nothing; give comma-separated names"),  # was dropped: no layer listed
        (["prefill", "--method", "claa", "--keep", "0.2", "--json", "--kept-layers", "1,1"],
         "--kept-layers names layer 1 twice; name each layer once"),
        (["prefill", "--method", "claa", "--keep", "0.2", "--cuda-graphs", "--compile-decode"],
         "--cuda-graphs compiles and captures the decode step in the first run, which would then be timed: add --warmup 1"),
        (["bench", "--methods", "full,claa", "--keep", "0.2", "--cuda-graphs", "--warmup", "0"],
         "--cuda-graphs captures the decode step in the first run, which would then be timed: add --warmup 1"),
    ],
)  # fmt: skip
def test_bad_method_and_budget_options_are_refused_before_the_model_loads(
    no_model_load, tiny_folder, args, message
):
    text = refused([*args, "--data", "niah:n=1,length=200", "--model", str(tiny_folder)], no_model_load)
    assert message is None or text.startswith(message)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda folder: _budget(keep=2.0), "keep rate 2.0 is outside (0, 1]"),
        (lambda folder: _budget(tokens=0), "budget 0 is not a positive token count"),
        (lambda folder: _budget(keep=0.1, tokens=8), "a budget is exactly one of --keep"),
        (lambda folder: _settings(repeats=0), "--repeats must be a whole number >= 1, got 0"),
        (lambda folder: _settings(warmup=-1), "--warmup must be a whole number >= 0, got -1"),
        (lambda folder: _settings(max_new_tokens=2.5), "--max-new-tokens must be a whole number >= 1, got 2.5"),
        (lambda folder: _bench(folder, limit=-1), "--limit must be a whole number >= 1, got -1"),
        (lambda folder: _capture(folder, limit=0), "--limit must be a whole number >= 1, got 0"),
        (lambda folder: _diffusion(folder, limit=-1), "--limit must be a whole number >= 1, got -1"),
        (lambda folder: _diffusion(folder, max_new_tokens=0), "--max-new-tokens must be a whole number >= 1"),
        # an AttributeError after the model loaded, and an empty store left behind
        (lambda folder: _capture(folder, oracle="yes"), "oracle takes OracleOptions(...), a dict of its settings, True for its defaults, or None, not 'yes'"),
        (lambda folder: _bench(folder, keep=[1.5]), "keep rate 1.5 is outside (0, 1]: use e.g. --keep 0.1, or --budget"),
        # a rate and a count each by its own name, as on the command line: budget=0.5 kept half
        (lambda folder: _bench(folder, keep=None, budget=0.5), "budget 0.5 is not a positive token count"),
        (lambda folder: _bench(folder, keep=64), "keep rate 64 is outside (0, 1]"),
        (lambda folder: _bench(folder, budget=64), "give exactly one of --keep (e.g. 0.1) or --budget"),
        (lambda folder: _bench(folder, keep=[]), "--keep names no budget; a keep rate; give e.g. --keep 0.1"),
        (lambda folder: _bench(folder, keep=[0.1, 0.1]), "--keep: two budgets both read keep=0.1; name each once"),
        (lambda folder: _prefill(folder, method="claa", keep=[0.1, 0.2]), "prefill runs one budget: give one --keep or --budget"),
        (lambda folder: _prefill(folder, keep=0.5), "full keeps every token: drop --keep/--budget"),
        # an IndexError after the store was made; "yes" written into the store's oracle_params
        (lambda folder: _capture(folder, oracle=_oracle(max_new_tokens=0)), "--max-new-tokens must be a whole number >= 1, got 0"),
        (lambda folder: _capture(folder, oracle={"softmax": "yes"}), "--softmax must be True or False, not str 'yes'"),
        (lambda folder: _capture(folder, oracle={"max_tokens": 4}), "oracle has no setting max_tokens; its settings are answer, softmax"),
        (lambda folder: _add_oracle(folder, options={"max_new_tokens": 0}), "--max-new-tokens must be a whole number >= 1, got 0"),
        (lambda folder: _add_oracle(folder, options=None), "add_oracle adds an oracle: give options=OracleOptions(...)"),
        # ran the last example
        (lambda folder: _prefill(folder, example=-1), "--example must be a whole number >= 0, got -1"),
    ],
)  # fmt: skip
def test_the_python_api_refuses_what_the_command_line_refuses(no_model_load, tiny_folder, call, message):
    """Budget(keep=2.0) kept 200% (clamped silently), repeats=0 ended in an IndexError, limit=-1
    dropped the last example: the options' ranges hold however they are given."""
    before = sorted(no_model_load.iterdir())
    with pytest.raises(RankkitError, match=re.escape(message)):
        call(tiny_folder)
    assert sorted(no_model_load.iterdir()) == before


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: _method_spec("claa:aggregation_window=2,aggregation_window=3"),
         "aggregation_window is given twice in 'claa:aggregation_window=2,aggregation_window=3'"),
        (lambda: _probes("window:w=32,window_size=8"), "window_size is given twice in 'window:w=32,window_size=8'"),
        (lambda: _pairs("claa:fastkv,claa:gemfilter,claa:fastkv"), "--pairs names claa:fastkv twice"),
        (lambda: _lengths([512, 1024, 512]), "--lengths names 512 twice"),
    ],
)  # fmt: skip
def test_a_setting_named_twice_is_refused(call, message):
    """The last of two values won, and the run was labelled with one it did not use; a pair or a
    length named twice gave its rows twice."""
    with pytest.raises(RankkitError, match=re.escape(message)):
        call()


def test_a_list_parameter_is_written_with_semicolons_and_reads_back_from_its_label():
    """sliminfer's pruning_layers could not be set from a spec: "," separates the parameters."""
    from rankkit.eval.offline import method_from_spec, split_names

    (label,) = split_names("sliminfer:pruning_layers=1;2,block_size=8")
    assert label == "sliminfer:pruning_layers=1;2,block_size=8"
    method = method_from_spec(label)
    assert (method.pruning_layers, method.block_size) == ((1, 2), 8)
    with pytest.raises(RankkitError, match=r"pruning_layers=\(1, 'x'\) is not an integer"):
        method_from_spec("sliminfer:pruning_layers=1;x")
    # select kept 315 tokens at layer 9 of "9;9;9", prefill 123: one layer cannot prune three times
    with pytest.raises(RankkitError, match=r"pruning_layers=\(9, 2, 9\) names layer 9 twice; name each layer once$"):
        method_from_spec("sliminfer:pruning_layers=9;2;9")


def _method_spec(spec):
    from rankkit.eval.offline import parse_method_spec

    return parse_method_spec(spec)


def _probes(spec):
    from rankkit.probes import parse_probes

    return parse_probes(spec)


def _pairs(spec):
    from rankkit.eval.compare import parse_pairs

    return parse_pairs(spec, ["claa", "fastkv", "gemfilter"])


def _lengths(lengths):
    from rankkit.checks import check_token_counts

    return check_token_counts(lengths)


def _budget(**given):
    from rankkit.methods import Budget

    return Budget(**given)


def _settings(**given):
    from rankkit.bench import BenchSettings

    return BenchSettings(**given)


def _bench(folder, **given):
    from rankkit.bench import Setup, bench

    given = {"methods": ["full"], "keep": [0.5], **given}
    return bench(data="niah:n=2,length=200", setup=Setup(str(folder)), **given)


def test_the_python_api_takes_a_budget_as_its_number_methods_as_the_command_line_names_them_and_true_for_the_oracle(
    tiny_folder, tmp_path
):
    """A notebook passes 0.1 and oracle=True: each ended in an AttributeError."""
    from rankkit import stores
    from rankkit.bench import BenchSettings, Setup, bench, prefill
    from rankkit.capture import OracleOptions, capture

    setup, settings = Setup(str(tiny_folder), device="cpu"), BenchSettings(max_new_tokens=2, warmup=0)
    rows = bench("full,claa", "niah:n=1,length=200", keep=0.5, setup=setup, settings=settings)
    length = rows["length"][0]  # the prompt fitted to 200 tokens
    assert rows.select("method", "budget", "budget_tokens").rows() == [
        ("full", "keep=1", length), ("claa", "keep=0.5", -(-length // 2))
    ]  # fmt: skip
    (row,) = prefill("claa", budget=64, data="niah:n=1,length=200", setup=setup, settings=settings)
    assert (row["budget"], row["budget_tokens"]) == ("budget=64", 64)
    capture(model=str(tiny_folder), data="niah:n=1,length=200", probes="window", out=tmp_path / "run.zarr",
            oracle=True, device="cpu")  # fmt: skip
    (record,) = stores.open(tmp_path / "run.zarr").examples()
    assert record.has_oracle and record.attrs["oracle_params"]["kernel"] == OracleOptions().kernel


def _oracle(**given):
    from rankkit.capture import OracleOptions

    return OracleOptions(**given)


def _add_oracle(folder, **given):
    from rankkit.capture import add_oracle

    return add_oracle("run.zarr", model=str(folder), **given)


def _prefill(folder, **given):
    from rankkit.bench import Setup, prefill

    given = {"method": "full", **given}
    return prefill(data="niah:n=2,length=200", setup=Setup(str(folder)), **given)


def _capture(folder, **given):
    from rankkit.capture import capture

    return capture(model=str(folder), data="niah:n=2,length=200", out="run.zarr", **given)


def _diffusion(folder, **given):
    from rankkit.eval.diffusion import diffusion_probe

    return diffusion_probe("niah:n=2,length=200", model=str(folder), **given)


def test_prefill_layer_is_for_its_method_and_a_compare_reference_without_one_is_no_refusal(
    no_model_load, tiny_folder
):
    """--layer 1 with --method claa --compare snapkv was refused as if it were snapkv's."""
    common = ["--keep", "0.2", "--layer", "1", "--data", "niah:n=1,length=200", "--model", str(tiny_folder)]
    with pytest.warns(UserWarning, match="--layer 1 sets claa; snapkv takes no layer"):
        result = CliRunner().invoke(app, ["prefill", "--method", "claa", "--compare", "snapkv", *common])
    assert "the model was loaded before the options were checked" in str(result.exception)  # checks passed
    assert refused(["prefill", "--method", "snapkv", "--compare", "claa", *common], no_model_load) == (
        "method snapkv has no selection layer; leave --layer out (it sets claa, fastkv, gemfilter and oracle)"
    )


@pytest.mark.parametrize("scenario", ["runner", "analysis"])
def test_an_overhead_refusal_prints_nothing_on_stdout(no_model_load, scenario):
    """Its progress bar was drawn on stdout and left a blank line there before the error."""
    result = CliRunner().invoke(app, ["overhead", scenario, "--lengths", "0"])
    assert isinstance(result.exception, RankkitError) and "--lengths takes positive token counts" in str(result.exception)
    assert result.stdout == ""


def test_a_bare_prefill_names_everything_it_lacks_at_once(no_model_load, tiny_folder):
    model = ["--model", str(tiny_folder)]
    assert refused(["prefill", "--method", "claa", *model], no_model_load) == (
        "give either --data SPEC or --context-file FILE with --question, "
        "and exactly one of --keep (e.g. 0.1) or --budget (e.g. 2048)"
    )
    assert refused(["prefill", "--method", "full", *model], no_model_load) == (
        "give either --data SPEC or --context-file FILE with --question"  # full keeps everything
    )


def test_prefill_refuses_what_its_prompt_or_method_would_ignore(no_model_load, tiny_folder, tmp_path):
    """A question beside --data, an example beside a context file and a budget for full were each
    dropped without a word: the run answered another question, or reported budget keep=1."""
    context = tmp_path / "context.txt"
    context.write_text("The sky is green.")
    data = ["--data", "niah:n=2,length=200", "--model", str(tiny_folder)]
    own = ["--context-file", str(context), "--question", "What colour is the sky?", "--model", str(tiny_folder)]
    for command, message in (
        (["--method", "claa", "--keep", "0.2", *data, "--question", "Why?"],
         "--question goes with --context-file; an example of --data brings its own: drop --question"),
        (["--method", "claa", "--keep", "0.2", *own, "--example", "1"],
         "--example picks an example of --data; with --context-file drop it"),
        (["--method", "full", "--keep", "0.1", *data],
         "full keeps every token: drop --keep/--budget (or name the method they are for, with --compare full)"),
    ):  # fmt: skip
        assert refused(["prefill", *command], no_model_load) == message


def test_the_python_api_takes_a_context_file_as_the_cli_does(no_model_load, tiny_folder):
    """--context-file was the command line's alone: prefill and answer took the text only."""
    from rankkit.bench import Setup, prefill
    from rankkit.demo import answer

    empty = no_model_load / "empty.txt"
    empty.write_text("  \n")
    setup = Setup(model=str(tiny_folder), device="cpu")
    for call in (
        lambda **given: prefill("claa", keep=0.2, question="Why?", setup=setup, **given),
        lambda context="", **given: answer(str(tiny_folder), context, "Why?", device="cpu", **given),
    ):
        with pytest.raises(RankkitError) as refusal:
            call(context="The sky is green.", context_file=empty)
        assert str(refusal.value) == (
            "give the context as text (context=) or as a file (context_file=, --context-file), not both"
        )
        with pytest.raises(RankkitError) as refusal:
            call(context_file=empty)  # read as --context-file reads it, before any model loads
        assert str(refusal.value) == f"--context-file {empty} is empty; give a file holding the context"


def test_an_example_past_the_data_names_the_ones_there(tiny_folder):
    from rankkit.bench import Setup, prefill

    setup = Setup(model=str(tiny_folder), device="cpu")
    for count, choices in [(1, "--example 0"), (3, "--example 0..2")]:
        spec = f"niah:n={count},length=200"
        with pytest.raises(RankkitError) as refusal:
            prefill("claa", keep=0.2, data=spec, example=5, setup=setup)
        assert str(refusal.value) == f"--example 5 is past the {count} example(s) of {spec}; give {choices}"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("niah:length=20000", "'niah:length=20000' has 20000 tokens, more than the model's 512 positions; "
         "shorten it, or pass --allow-overlength to run it anyway"),
        ("niah:length=abc", "length must be an integer >= 1, got 'abc' in 'niah:length=abc'"),
        ("ruler:task=nope,length=300", "unknown RULER task 'nope'"),
        ("niah:length=300,colour=red", "niah does not take 'colour'"),
    ],
)  # fmt: skip
def test_spec_values_and_lengths_are_checked_before_the_model_loads(
    no_model_load, tiny_folder, data, message
):
    for command in (["bench", "--methods", "full,claa"], ["prefill", "--method", "claa"]):
        text = refused(
            [*command, "--keep", "0.2", "--data", data, "--model", str(tiny_folder)], no_model_load
        )
        assert text.startswith(message)
    capture = ["capture", "--data", data, "--model", str(tiny_folder), "--out", "store.zarr"]
    assert refused(capture, no_model_load).startswith(message)


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (None, "--device-map 'missing.json' is neither a strategy nor a file; give one of auto, "),
        ("{not json", "--device-map missing.json: not readable JSON"),
        ("[1, 2]", "--device-map missing.json: expected a non-empty JSON object"),
        ('{"model.layers.0": [0]}', "--device-map missing.json: module 'model.layers.0' maps to [0]; a device is"),
        ('{"lm_head": "cuda:5"}', "--device-map missing.json: module 'lm_head' maps to \"cuda:5\", but "),
        ('{"lm_head": "disk"}', "--device-map missing.json: module 'lm_head' maps to \"disk\", which is not a device"),
        ('{"lm_head": "meta"}', "--device-map missing.json: module 'lm_head' maps to \"meta\"; a device is \"cpu\""),
        ('{"lm_head": -1}', "--device-map missing.json: module 'lm_head' maps to -1, which is not a device"),
    ],
)
def test_a_bad_device_map_is_refused_before_the_model_loads(no_model_load, tiny_folder, layout, message):
    if layout is not None:
        (no_model_load / "missing.json").write_text(layout)
    common = ["--keep", "0.2", "--data", "niah:n=1,length=200", "--model", str(tiny_folder)]
    for command in (
        ["bench", "--methods", "full,claa", *common],
        ["prefill", "--method", "claa", *common],
        ["capture", "--data", "niah:n=1,length=200", "--model", str(tiny_folder), "--out", "s.zarr"],
    ):
        assert refused([*command, "--device-map", "missing.json"], no_model_load).startswith(message)  # fmt: skip


def test_a_device_map_that_misnames_or_misses_a_module_is_refused_before_the_weights_load(tmp_path, tiny_folder):
    """transformers loads such a map onto the CPU without a word: a typo would run a GPU user's model there."""
    outline = "model.embed_tokens, model.layers.0 to model.layers.2, model.norm, model.rotary_emb, lm_head"
    whole = {name: "cpu" for name in ("model.embed_tokens", "model.norm", "lm_head")} | {
        f"model.layers.{index}": "cpu" for index in range(3)
    }
    cases = [
        (whole | {"model.layerz.0": "cpu"}, f"--device-map names 'model.layerz.0', which is not a module of {tiny_folder}; its modules are {outline}"),
        ({key: value for key, value in whole.items() if key != "model.layers.2"}, "--device-map gives no device to model.layers.2.self_attn.q_proj.weight and 8 more parameters; "
         f"map every module of {tiny_folder}: {outline}"),
    ]  # fmt: skip
    for layout, message in cases:
        with pytest.raises(RankkitError) as refused:
            rankkit.models.load(str(tiny_folder), device="cpu", device_map=layout)
        assert str(refused.value) == message
    rankkit.models.check_layout({"model": "cpu", "lm_head": "cpu"}, rankkit.models.load_config(str(tiny_folder)), "x")
    rankkit.models.check_layout({"": "cpu"}, rankkit.models.load_config(str(tiny_folder)), "x")


def test_more_threads_than_cores_is_refused_before_the_model_loads(no_model_load, tiny_folder):
    """--threads 1000 on two cores ran, its threads taking turns on them, and timed that."""
    cores = len(os.sched_getaffinity(0))
    message = f"--threads {cores + 1}: this process may run on {cores} CPU cores; give 1 to {cores}"
    common = ["--model", str(tiny_folder), "--data", "niah:n=1,length=200", "--threads", str(cores + 1)]
    for command in (
        ["prefill", "--method", "claa", "--keep", "0.2", *common],
        ["bench", "--methods", "full", "--keep", "0.2", *common],
        ["capture", "--out", "s.zarr", *common],
        ["diffusion", *common],
        ["generate", *common],
        ["oracle", "s.zarr", "--model", str(tiny_folder), "--threads", str(cores + 1)],
        ["overhead", "runner", "--lengths", "64", "--model", str(tiny_folder), "--threads", str(cores + 1)],
    ):
        assert refused(command, no_model_load) == message
    assert not (no_model_load / "s.zarr").exists()
    # the Python API takes the same option under the same name, refused alike
    from rankkit.capture import add_oracle, capture
    from rankkit.demo import answer
    from rankkit.eval.diffusion import diffusion_probe
    from rankkit.overhead import run_overhead
    from rankkit.sweep import sweep

    model, data, threads = str(tiny_folder), "niah:n=1,length=200", cores + 1
    for call in (
        lambda: capture(model=model, data=data, out=no_model_load / "s.zarr", threads=threads),
        lambda: add_oracle(no_model_load / "s.zarr", model=model, threads=threads),
        lambda: diffusion_probe(data, model=model, threads=threads),
        lambda: answer(model, "", "", data=data, threads=threads),
        lambda: run_overhead("runner", [64], model_spec=model, threads=threads),
        lambda: sweep(no_model_load / "experiment.toml", no_model_load / "sweep", threads=threads),
    ):
        with pytest.raises(RankkitError) as refusal:
            call()
        assert str(refusal.value) == message
    assert not (no_model_load / "s.zarr").exists()


def test_a_gpu_index_past_the_last_is_refused_naming_the_ones_there(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for count, named in ((1, "1 GPU (cuda:0)"), (2, "2 GPUs (cuda:0 to cuda:1)")):
        monkeypatch.setattr(torch.cuda, "device_count", lambda count=count: count)
        with pytest.raises(RankkitError) as refused:
            rankkit.models.resolve_device("cuda:3")
        assert str(refused.value) == f"device 'cuda:3' asked for but this machine has {named}: use --device cpu or auto"
    assert rankkit.models.device_problem(torch.device("cuda:1")) is None


def test_prefill_through_a_device_map_file_gives_the_answer_of_a_plain_load(tmp_path, tiny_folder):
    """The explicit per-layer map a multi-GPU user writes, here with every module on the CPU."""
    layout = {name: "cpu" for name in ("model.embed_tokens", "model.rotary_emb", "model.norm", "lm_head")}
    layout |= {f"model.layers.{index}": "cpu" for index in range(3)}
    map_file = tmp_path / "layout.json"
    map_file.write_text(json.dumps(layout))
    runs = []
    for device_map in (None, str(map_file)):
        result = CliRunner().invoke(
            app,
            ["prefill", "--method", "claa", "--keep", "0.5", "--data", "niah:n=1,length=200",
             "--model", str(tiny_folder), "--device", "cpu", "--max-new-tokens", "3", "--repeats", "1",
             "--warmup", "0", "--json", *(["--device-map", device_map] if device_map else [])],
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        runs.append(json.loads(result.output))
    same = ("answer", "selection_layer", "selected_positions", "kv_bytes")
    assert [{key: run[key] for key in same} for run in runs][0] == {key: runs[1][key] for key in same}
    assert runs[0]["selected_positions"] and runs[0]["kv_bytes"] > 0


def test_oracle_answer_is_checked_before_the_model_loads(no_model_load, tiny_folder):
    capture = ["capture", "--data", "niah:length=200", "--model", str(tiny_folder), "--out", "store.zarr"]
    message = refused([*capture, "--oracle", "--answer", "gold"], no_model_load)
    assert message == "--answer must be one of generated, reference, got 'gold'"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["--answer", "gold"], "--answer must be one of generated, reference, got 'gold'"),
        (["--kernel", "4"], "--kernel must be a positive odd integer (length-preserving pooling), not 4"),
        (["--softmax", "--kernel", "9"], "--softmax --kernel 9 set how the oracle is made, and no oracle is made: "
         "add --oracle, or drop them"),
        (["--answer", "reference"], "--answer reference sets how the oracle is made, and no oracle is made: "
         "add --oracle, or drop them"),
    ],
)  # fmt: skip
def test_oracle_settings_without_oracle_are_refused_before_the_model_loads(
    no_model_load, tiny_folder, settings, message
):
    """Without --oracle these were never read: a typo'd --answer passed, and the store was captured
    without the oracle they describe."""
    capture = ["capture", "--data", "niah:length=200", "--model", str(tiny_folder), "--out", "store.zarr"]
    assert refused([*capture, *settings], no_model_load) == message


def test_a_store_inside_another_store_is_refused_before_the_model_loads(no_model_load, tiny_folder):
    """--out inside a capture store got a second store written among the first's examples."""
    from rankkit import stores

    stores.create(no_model_load / "s.zarr", {"model": "a"})
    capture = ["capture", "--data", "niah:length=200", "--model", str(tiny_folder), "--probes", "window"]
    message = refused([*capture, "--out", "s.zarr/inner.zarr"], no_model_load)
    assert message == f"--out s.zarr/inner.zarr is inside the rankkit store {no_model_load / 's.zarr'}; choose a path outside it"
    assert not (no_model_load / "s.zarr" / "inner.zarr").exists()


def test_a_jsonl_prompt_past_the_model_positions_is_refused_unless_forced(tmp_path, tiny_folder):
    data = tmp_path / "long.jsonl"
    long_line = {"id": "long", "context": "word " * 600, "question": "Which word?", "answers": ["word"]}
    data.write_text(json.dumps(long_line) + "\n")
    args = ["bench", "--methods", "full", "--keep", "1", "--data", str(data), "--model", str(tiny_folder)]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "rows.parquet")])
    assert isinstance(result.exception, RankkitError)
    assert str(result.exception).startswith("the prompt of example 'long' has 6")
    assert "more than the model's 512 positions" in str(result.exception)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["long.jsonl"]


def test_a_budget_larger_than_the_prompt_warns_that_it_keeps_everything(tmp_path, tiny_folder):
    from rankkit.bench import BenchSettings, Setup, bench

    with pytest.warns(
        UserWarning, match=r"--budget 5000 is larger than the prompt \(\d+ tokens\); it keeps all of it \(in 1 of 1 prompts\)$"
    ):
        frame = bench(
            ["full", "claa"],
            "niah:n=1,length=200",
            budget=5000,
            settings=BenchSettings(max_new_tokens=1, warmup=0),
            setup=Setup(model=str(tiny_folder), device="cpu"),
        )
    assert frame.filter(pl.col("method") == "claa")["kv_ratio"].to_list() == [1.0]


@pytest.mark.parametrize(("warmup", "repeats"), [(1, 1), (0, 3)])
def test_bench_progress_counts_calibration_warmups_and_repeats_and_ends_at_its_total(
    tiny_folder, warmup, repeats
):
    from rankkit.bench import BenchSettings, Setup, bench

    events = []
    bench(
        ["full", "claa", "fastkv"],
        "niah:n=2,length=200",
        keep=[0.5, 0.25],
        settings=BenchSettings(max_new_tokens=1, warmup=warmup, repeats=repeats),
        setup=Setup(model=str(tiny_folder), device="cpu"),
        progress=events.append,
    )
    entries = 1 + 2 * 2  # full once, then claa and fastkv at each budget
    total = 1 + 2 * entries * (1 + repeats)  # calibration, then per example a preparation and the repeats
    assert {event.total for event in events} == {total}
    assert [event.done for event in events] == sorted(event.done for event in events)
    assert events[-1].done == total and all(event.done <= total for event in events)
    stages = [event.stage for event in events]
    first = "warm-up" if warmup else "preparing"  # without warm-up runs, progress does not claim one
    assert stages.count(first) == 2 * entries and stages.count("timed") == 2 * entries * repeats
    assert set(stages) == {"calibrating", first, "timed", "done"}


# --- safe outputs ---


def test_claim_refuses_an_existing_file_a_directory_and_the_command_inputs(tmp_path):
    store = tmp_path / "capture.zarr"
    store.mkdir()
    (store / "zarr.json").write_text("{}")
    existing = tmp_path / "report.html"
    existing.write_text("old")
    with pytest.raises(RankkitError, match="report.html already exists; pass --overwrite to replace it"):
        outputs.claim([existing])
    with pytest.raises(RankkitError, match="report.html was not written by rankkit, and --overwrite replaces only"):
        outputs.claim([existing], overwrite=True)
    outputs.write_text(f"<html>{outputs.GENERATOR_TAG}", existing)
    assert outputs.claim([existing], overwrite=True) == [existing]
    with pytest.raises(RankkitError, match=f"--out {tmp_path} is a directory; give a file path inside it"):
        outputs.claim([tmp_path], overwrite=True)
    with pytest.raises(RankkitError, match="zarr.json is one of this command's inputs"):
        outputs.claim([store / "zarr.json"], overwrite=True, inputs=[store])
    with pytest.raises(RankkitError, match="is one of this command's inputs"):
        outputs.claim([store], overwrite=True, inputs=[store])


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_partial(tmp_path):
    target = tmp_path / "rows.parquet"
    target.write_text("old")

    def half_then_fail(partial: Path) -> None:
        partial.write_text("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(RankkitError) as failed:
        outputs.write_atomic(target, half_then_fail)
    assert str(failed.value) == (
        f"cannot write {target} (No space left on device); the old file, if any, is unchanged"
    )
    assert target.read_text() == "old" and sorted(tmp_path.iterdir()) == [target]
    outputs.write_text("new", target)
    assert target.read_text() == "new" and sorted(tmp_path.iterdir()) == [target]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["dashboard", "store.zarr", "--out", "store.zarr/zarr.json"], "is one of this command's inputs"),
        (["dashboard", "store.zarr", "--out", "reports"], "--out reports is a directory"),
        (["dashboard", "store.zarr", "--out", "old.html"], "old.html already exists; pass --overwrite"),
        (["compare", "store.zarr", "--out", "old.parquet"], "old.parquet already exists"),
        (["compare", "store.zarr", "--out", "c.parquet"], "c.summary.parquet already exists"),
        (["compare", "store.zarr", "--out", "store.zarr/c.parquet"], "is one of this command's inputs"),
        (["variance", "store.zarr", "--out", "old.parquet"], "old.parquet already exists"),
        (
            ["bench", "--methods", "full", "--keep", "1", "--data", "old.jsonl", "--out", "old.parquet"],
            "old.parquet already exists",
        ),
        (
            ["data", "export", "old.jsonl", "--out", "old.jsonl", "--overwrite"],
            "is one of this command's inputs",
        ),
        (["data", "export", "old.jsonl", "--out", "old.html"], "old.html already exists"),
        (["diffusion", "--data", "old.jsonl", "--out", "old.parquet"], "old.parquet already exists"),
        (
            ["diffusion", "--data", "old.jsonl", "--out", "old.jsonl", "--overwrite"],
            "is one of this command's inputs",
        ),
        (
            [
                "bench",
                "--methods",
                "full",
                "--keep",
                "1",
                "--data",
                "old.jsonl",
                "--out",
                "old.jsonl",
                "--overwrite",
            ],
            "is one of this command's inputs",
        ),
    ],
)
def test_outputs_are_never_overwritten_or_written_into_an_input_unless_asked(no_model_load, args, message):
    folder = no_model_load
    (folder / "store.zarr").mkdir()
    (folder / "store.zarr" / "zarr.json").write_text("{}")
    (folder / "reports").mkdir()
    for name in ("old.html", "old.parquet", "c.summary.parquet", "old.jsonl"):
        (folder / name).write_text("old")
    assert message in refused(args, folder)
    assert all((folder / name).read_text() == "old" for name in ("old.html", "old.parquet", "old.jsonl"))


# --- interrupts and resume ---


def test_an_interrupt_inside_deferred_interrupts_is_raised_at_its_end():
    import os

    from rankkit.interrupts import deferred_interrupts

    reached = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # where an undeferred signal would have been raised
            reached.append("end of block")
    assert reached == ["end of block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


BENCH = dict(methods="full,claa,fastkv", keep="0.5", data="niah:n=4,length=200", max_new_tokens=2, repeats=15)


def _bench_command(tiny_folder: Path, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "rankkit.cli", "bench", "--methods", BENCH["methods"], "--keep", BENCH["keep"],
        "--data", BENCH["data"], "--model", str(tiny_folder), "--max-new-tokens", str(BENCH["max_new_tokens"]),
        "--warmup", "0", "--repeats", str(BENCH["repeats"]), "--threads", "1", "--device", "cpu",
        "--out", str(out),
    ]  # fmt: skip


def _interrupt_bench(tiny_folder: Path, out: Path, signum: int) -> tuple[int, str, int]:
    """Start the bench, send ``signum`` once an example is kept; (exit status, last stderr line, kept)."""
    journal = out.with_name(f".{out.name}.unfinished.jsonl")

    def kept() -> int:
        lines = journal.read_text().splitlines() if journal.is_file() else []
        return sum('"key"' in line for line in lines)

    victim = subprocess.Popen(
        _bench_command(tiny_folder, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 300
    while kept() < 1 and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    victim.send_signal(signum)
    stderr = victim.communicate(timeout=120)[1]
    return victim.returncode, stderr.strip().splitlines()[-1], kept()


def test_sigterm_stops_a_bench_saying_what_it_kept(tmp_path, tiny_folder):
    out = tmp_path / "rows.parquet"
    status, last_line, kept = _interrupt_bench(tiny_folder, out, signal.SIGTERM)
    assert status == 130 and 1 <= kept < 4 and not out.exists()
    journal = tmp_path / ".rows.parquet.unfinished.jsonl"
    assert last_line == (
        f"rankkit: interrupted: kept {kept} finished ({kept * 3} rows) in {journal}; "
        "rerun the same command to resume"
    )


def test_an_interrupted_bench_resumes_to_the_rows_of_an_uninterrupted_run(tmp_path, tiny_folder):
    from rankkit.bench import BenchSettings, Setup, bench

    out = tmp_path / "rows.parquet"
    status, last_line, kept = _interrupt_bench(tiny_folder, out, signal.SIGINT)
    assert status == 130 and last_line.startswith(f"rankkit: interrupted: kept {kept} finished")
    journal = [json.loads(line) for line in (tmp_path / ".rows.parquet.unfinished.jsonl").read_text().splitlines()]
    (noted,) = [entry["note"]["bandwidth"] for entry in journal if "bandwidth" in entry.get("note", {})]
    resumed = subprocess.run(_bench_command(tiny_folder, out), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert out.is_file() and sorted(path.name for path in tmp_path.iterdir()) == ["rows.parquet"]
    uninterrupted = bench(
        BENCH["methods"],
        BENCH["data"],
        keep=BENCH["keep"],
        settings=BenchSettings(
            max_new_tokens=BENCH["max_new_tokens"], warmup=0, repeats=BENCH["repeats"]
        ),
        setup=Setup(model=str(tiny_folder), device="cpu", threads=1),
    )
    rows = pl.read_parquet(out)
    assert rows.height == 4 * 3
    assert rows.drop(TIMING_COLUMNS).equals(uninterrupted.drop(TIMING_COLUMNS))
    # the resumed rows' decode bound is at the bandwidth the first process measured, as is the cost model
    assert rows["bandwidth_bytes_per_s"].unique().to_list() == [noted["bytes_per_s"]]


def test_an_interrupt_while_a_unit_is_written_counts_it_as_kept(tmp_path, monkeypatch):
    """A signal right after a unit's line reaches the journal: the line is kept (a rerun skips the
    unit), so the one-line report counts it; it said one fewer when the signal fell in between."""
    from rankkit.errors import Interrupted
    from rankkit.interrupts import keep_on_interrupt

    journal = outputs.Journal(tmp_path / "rows.parquet", {"methods": ["full"]})
    append = journal._append

    def append_then_interrupt(entry):
        append(entry)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(journal, "_append", append_then_interrupt)
    with pytest.raises(Interrupted, match=r"kept 1 finished \(1 rows\)"), keep_on_interrupt(journal.kept):
        journal.record("e0", [{"score": 1.0}])
    journal.close()
    assert outputs.Journal(tmp_path / "rows.parquet", {"methods": ["full"]}).done("e0")


def test_an_interrupt_inside_nested_blocks_says_what_the_outermost_kept():
    """A sweep interrupted in its bench stage said only what the bench's journal kept, not the
    sweep's finished units of each stage."""
    from rankkit.errors import Interrupted
    from rankkit.interrupts import keep_on_interrupt

    with pytest.raises(Interrupted, match="^kept capture 2, bench 0$"), keep_on_interrupt(lambda: "kept capture 2, bench 0"):
        with keep_on_interrupt(lambda: "kept 0 finished (0 rows)"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the signal arrives at the next bytecode; never waited out


class SignalledWhileCollected:
    """Raises SIGINT from its finaliser: the handler's KeyboardInterrupt is raised inside ``__del__``,
    where Python prints it ("Exception ignored in ...") and drops it, as in a weakref callback that
    the garbage collector runs (a capture on CI went on to its end, exit 0, that way)."""

    def __del__(self):
        signal.raise_signal(signal.SIGINT)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_signal_whose_keyboard_interrupt_was_dropped_stops_the_loop_at_its_next_item():
    from rankkit.errors import Interrupted
    from rankkit.interrupts import keep_on_interrupt, stop_if_interrupted

    items = []
    with pytest.raises(Interrupted, match="^kept 1$"), keep_on_interrupt(lambda: f"kept {len(items)}"):
        for item in range(3):
            stop_if_interrupted()
            items.append(item)
            SignalledWhileCollected()  # collected at once: the signal arrives inside its __del__
    assert items == [0]
    with pytest.raises(Interrupted, match="^kept all$"), keep_on_interrupt(lambda: "kept all"):
        SignalledWhileCollected()  # no item left to stop before: the block ends interrupted
    with keep_on_interrupt(lambda: "never said"):  # what was noted went with its Interrupted
        stop_if_interrupted()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_a_journal_of_other_settings_is_refused_naming_them_and_overwrite_discards_it(tmp_path):
    """The refusal said only "other settings", which the user then had to find in the journal's first line."""
    out = tmp_path / "rows.parquet"
    with outputs.Journal(out, {"methods": ["full", "claa"], "keep": [0.1]}) as first:
        first.record("e0", [{"method": "full", "score": 1.0}])
    refusal = (
        "rows.parquet has an unfinished run with other settings (keep: [0.1] there, [0.2] now; methods: "
        "['full', 'claa'] there, ['full', 'fastkv'] now); rerun with those settings to resume it"
    )
    with pytest.raises(RankkitError, match=re.escape(refusal)):
        outputs.Journal(out, {"methods": ["full", "fastkv"], "keep": [0.2]})
    with outputs.Journal(out, {"methods": ["full", "claa"], "keep": [0.1]}) as resumed:
        assert resumed.done("e0") and resumed.rows == [{"method": "full", "score": 1.0}]
    assert outputs.Journal(out, {"methods": ["full", "fastkv"]}, overwrite=True).rows == []


def test_an_owned_journal_resumes_its_settings_starts_anew_on_others_and_writes_over_its_output(tmp_path):
    """The demo's bench: its folder is its own and its command has no --overwrite to name."""
    out = tmp_path / "rows.parquet"
    outputs.write_parquet(pl.DataFrame({"score": [0.0]}), out)  # an earlier run's output
    with outputs.Journal(out, {"methods": ["full"]}, owned=True) as first:
        first.record("e0", [{"score": 1.0}])
    with outputs.Journal(out, {"methods": ["full"]}, owned=True) as resumed:
        assert resumed.rows == [{"score": 1.0}]
        resumed.record("e1", [{"score": 0.5}])
    with outputs.Journal(out, {"methods": ["claa"]}, owned=True) as other:
        assert other.rows == []
        other.record("e0", [{"score": 0.25}])
        other.finish(pl.DataFrame(other.rows))
    assert pl.read_parquet(out)["score"].to_list() == [0.25] and not outputs.journal_path(out).exists()


@pytest.mark.parametrize(
    "edit",
    [
        lambda entry: entry["rows"][0].update(score=5.0),  # a score no bench gives, printed as measured
        lambda entry: entry.update(key="bogus"),  # an example the data does not hold, counted in n
        lambda entry: entry.pop("digest"),
    ],
)
def test_a_journal_line_changed_after_it_was_written_is_refused_and_overwrite_discards_it(tmp_path, edit):
    out = tmp_path / "rows.parquet"
    with outputs.Journal(out, {"methods": ["full"]}) as first:
        first.record("e0", [{"score": 1.0, "ratio": float("nan")}])
        first.record("e1", [{"score": 0.0, "ratio": 0.5}])
    with outputs.Journal(out, {"methods": ["full"]}) as unchanged:  # as written, it resumes
        assert unchanged.done("e0") and unchanged.done("e1")
    lines = first.path.read_text().splitlines()
    changed = json.loads(lines[2])
    edit(changed)
    first.path.write_text("\n".join([*lines[:2], json.dumps(changed), *lines[3:]]) + "\n")
    message = f"^line 3 of {re.escape(str(first.path))} was changed after rankkit wrote it; pass --overwrite"
    with pytest.raises(RankkitError, match=message):
        outputs.Journal(out, {"methods": ["full"]})
    assert outputs.Journal(out, {"methods": ["full"]}, overwrite=True).rows == []


def test_a_journal_line_cut_short_by_a_kill_is_redone_and_later_lines_survive(tmp_path):
    out = tmp_path / "rows.parquet"
    with outputs.Journal(out, {"methods": ["full"]}) as first:
        first.record("e0", [{"score": 1.0}])
    with first.path.open("a") as journal:
        journal.write('{"key": "e1", "rows": [{"sco')
    with outputs.Journal(out, {"methods": ["full"]}) as second:
        assert second.done("e0") and not second.done("e1")
        second.record("e1", [{"score": 0.5}])
    assert outputs.Journal(out, {"methods": ["full"]}).rows == [{"score": 1.0}, {"score": 0.5}]


def test_a_second_run_making_the_same_output_is_refused_while_the_first_runs(tmp_path):
    """Two runs appending to one journal would each write the output over the other's."""
    out = tmp_path / "rows.parquet"
    with outputs.Journal(out, {"methods": ["full"]}) as first:
        first.record("e0", [{"score": 1.0}])
        for overwrite in (False, True):
            with pytest.raises(RankkitError) as refused:
                outputs.Journal(out, {"methods": ["full"]}, overwrite=overwrite)
            assert str(refused.value) == (
                f"another rankkit run is making {out} (.rows.parquet.unfinished.jsonl is locked); wait for "
                "it to finish, then rerun to resume, or choose another --out"
            )
        first.record("e1", [{"score": 0.5}])
    with outputs.Journal(out, {"methods": ["full"]}) as resumed:
        assert resumed.rows == [{"score": 1.0}, {"score": 0.5}]
        resumed.finish(pl.DataFrame(resumed.rows))
    assert not outputs.journal_path(out).exists() and pl.read_parquet(out)["score"].to_list() == [1.0, 0.5]


def test_a_filesystem_without_locks_lets_a_run_through_with_a_warning(tmp_path, monkeypatch):
    from rankkit import stores

    def no_locks(handle, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(outputs.fcntl, "flock", no_locks)
    with pytest.warns(UserWarning, match=f"^{tmp_path} cannot lock files \\(No locks available\\): a second run"):
        with outputs.Journal(tmp_path / "rows.parquet", {"methods": ["full"]}) as journal:
            journal.record("e0", [{"score": 1.0}])
    with pytest.warns(UserWarning, match="cannot lock files"):
        stores.create(tmp_path / "s.zarr", {"model": "a"})

    def broken(handle, operation):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(outputs.fcntl, "flock", broken)
    with pytest.raises(RankkitError, match=r"^cannot lock .*rows.parquet.unfinished.jsonl \(Input/output error\); choose"):
        outputs.Journal(tmp_path / "rows.parquet", {"methods": ["full"]})


def test_an_empty_journal_left_by_a_kill_before_its_first_line_starts_afresh(tmp_path):
    out = tmp_path / "rows.parquet"
    outputs.journal_path(out).write_text("")
    with outputs.Journal(out, {"methods": ["full"]}) as journal:
        assert journal.rows == []
    (line,) = outputs.journal_path(out).read_text().splitlines()
    assert json.loads(line)["identity"] == {"methods": ["full"]}


# --- outputs that survive a bad disk, stores with one writer -----------------------------------


def test_overwrite_replaces_only_a_file_rankkit_wrote(tmp_path):
    """compare --out e.parquet --overwrite replaced a user's e.per_head.parquet, a file they never named."""
    import polars as pl

    from rankkit.data import Example, export_jsonl

    frame = pl.DataFrame({"score": [1.0]})
    ours = [outputs.write_parquet(frame, tmp_path / "bench.parquet"), outputs.write_text(f"<html>{outputs.GENERATOR_TAG}", tmp_path / "page.html")]
    export_jsonl([Example(id="e0", task="niah", context="hay", question="q?", answers=("a",))], tmp_path / "data.jsonl")
    ours.append(tmp_path / "data.jsonl")
    assert outputs.claim(ours, overwrite=True) == ours
    frame.write_parquet(tmp_path / "theirs.parquet")  # a parquet file, not rankkit's
    (tmp_path / "notes.parquet").write_text("my notes")
    (tmp_path / "page2.html").write_text("<html><head><title>mine</title></head></html>")
    (tmp_path / "lines.jsonl").write_text('{"id": "x"}\n')
    for name in ("theirs.parquet", "notes.parquet", "page2.html", "lines.jsonl"):
        message = f"^{re.escape(str(tmp_path / name))} was not written by rankkit, and --overwrite replaces only what"
        with pytest.raises(RankkitError, match=message):
            outputs.claim([tmp_path / name], overwrite=True)


@pytest.mark.parametrize("links", [True, False])
def test_a_file_that_reached_the_output_after_its_claim_is_replaced_only_with_overwrite(tmp_path, monkeypatch, links):
    """Where the filesystem has no hard links, the same rule holds through a check before the rename."""
    if not links:
        monkeypatch.setattr(os, "link", lambda *_: (_ for _ in ()).throw(OSError(errno.EPERM, "no links")))
    out = tmp_path / "out.parquet"
    assert outputs.claim([out]) == [out]
    out.write_text("another run's")
    with pytest.raises(RankkitError, match=f"^{out} was written by another run while this one worked; pass --overwrite"):
        outputs.write_parquet(pl.DataFrame({"a": [1]}), out, overwrite=False)
    assert out.read_text() == "another run's" and list(tmp_path.iterdir()) == [out]
    outputs.write_parquet(pl.DataFrame({"a": [2]}), tmp_path / "new.parquet", overwrite=False)
    outputs.write_parquet(pl.DataFrame({"a": [3]}), out, overwrite=True)
    assert [pl.read_parquet(tmp_path / name)["a"].item() for name in ("new.parquet", "out.parquet")] == [2, 3]


def test_a_folder_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(RankkitError) as refused:
        outputs.claim([blocker / "sub" / "out.parquet"])
    assert str(refused.value) == (
        f"cannot write into {blocker / 'sub'}: {blocker} is a file, not a folder; choose another --out"
    )
    with pytest.raises(RankkitError, match=rf"^{tmp_path} needs about 4096.0 GiB but {tmp_path} has "):
        outputs.claim([tmp_path / "out.parquet"], needed_bytes=2**42)
    with pytest.raises(
        RankkitError, match="^--out '' names no file; give a file path, e.g. --out runs/out.parquet$"
    ):
        outputs.claim([""])

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(outputs.tempfile, "TemporaryFile", read_only)
    with pytest.raises(RankkitError) as refused:
        outputs.claim([tmp_path / "new" / "out.parquet"])
    assert str(refused.value) == (
        f"cannot write into {tmp_path / 'new'}: {tmp_path} is not writable (Read-only file system); "
        "choose another --out"
    )
    assert sorted(tmp_path.iterdir()) == [blocker]


def test_a_failed_write_keeps_the_finished_rows_in_the_journal_to_resume(tmp_path):
    out = tmp_path / "bench.parquet"
    journal = outputs.Journal(out, {"methods": ["full"]}, overwrite=True)
    journal.record("ex-1", [{"example": "ex-1", "accuracy": 1.0}])
    out.mkdir()  # the rename into place fails, as on a full or read-only disk
    with pytest.raises(RankkitError) as failed:
        journal.finish(pl.DataFrame(journal.rows))
    journal.close()
    assert str(failed.value) == (
        f"cannot write {out} (Is a directory); the old file, if any, is unchanged; the 1 finished units are "
        f"kept in {outputs.journal_path(out)}: make room and rerun the same command to write it without "
        "recomputing them"
    )
    out.rmdir()
    resumed = outputs.Journal(out, {"methods": ["full"]})
    assert resumed.done("ex-1") and resumed.rows == [{"example": "ex-1", "accuracy": 1.0}]


def test_a_file_that_reached_a_journals_output_meanwhile_is_kept_and_the_rows_too(tmp_path):
    out = tmp_path / "bench.parquet"
    with outputs.Journal(out, {"methods": ["full"]}) as journal:
        journal.record("ex-1", [{"example": "ex-1", "accuracy": 1.0}])
        out.write_text("another run's")
        with pytest.raises(RankkitError) as refused:
            journal.finish(pl.DataFrame(journal.rows))
    assert str(refused.value) == (
        f"{out} was written by another run while this one worked; the 1 finished units are kept in "
        f"{outputs.journal_path(out)}: move {out} away and rerun the same command to write it without "
        "recomputing them"
    )
    assert out.read_text() == "another run's"
    out.unlink()
    with outputs.Journal(out, {"methods": ["full"]}) as resumed:
        assert resumed.done("ex-1")
        resumed.finish(pl.DataFrame(resumed.rows))
    assert pl.read_parquet(out)["accuracy"].to_list() == [1.0] and not outputs.journal_path(out).exists()
    with outputs.Journal(out, {"methods": ["full"]}, overwrite=True) as again:  # as after a claim with --overwrite
        again.record("ex-1", [{"example": "ex-1", "accuracy": 0.0}])
        again.finish(pl.DataFrame(again.rows))
    assert pl.read_parquet(out)["accuracy"].to_list() == [0.0]


def test_a_second_writer_of_a_store_is_refused_in_one_line(tmp_path):
    from rankkit import stores

    path = tmp_path / "run.zarr"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         f"from rankkit import stores; stores.create({str(path)!r}, {{'model': 'm'}}); print('ready', flush=True); "
         "import time; time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(RankkitError) as refused:
            stores.create(path, {"model": "m"})
        assert str(refused.value) == (
            f"another process is writing {path} (.writer-0.lock is locked); wait for it to finish, then "
            "rerun to resume, or choose another --out"
        )
    finally:
        holder.kill()
        holder.wait()
    stores.create(path, {"model": "m"})  # the lock ends with its process


def test_store_messages_speak_of_options_not_python(tmp_path):
    from rankkit import stores

    path = tmp_path / "run.zarr"
    stores.create(path, {"model": "a"})
    with pytest.raises(RankkitError) as refused:
        stores.create(path, {"model": "b"})
    assert str(refused.value) == (
        f"store {path} holds a different run (model: 'a' in the store, 'b' now); rerun with --overwrite to "
        "replace it, or choose another --out"
    )
    foreign = tmp_path / "foreign.zarr"
    foreign.mkdir()
    (foreign / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {}}')
    with pytest.raises(
        RankkitError, match="foreign.zarr exists and is not a rankkit store; refusing to delete it"
    ):
        stores.create(foreign, {"model": "a"}, overwrite=True)
    assert (foreign / "zarr.json").is_file()


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([], "data.jsonl holds no example; give a file with one JSON object per line"),
        (
            [{"id": "", "context": "a b c", "question": "q?", "answers": ["x"]}],
            "data.jsonl:1: names in a store must be non-empty strings, got ''; give each example an id",
        ),
        (
            [{"id": "x" * 300, "context": "a b c", "question": "q?", "answers": ["x"]}],
            "data.jsonl:1: name 'xxxx",
        ),
    ],
)
def test_a_refused_capture_writes_nothing(no_model_load, tiny_folder, rows, message):
    _jsonl(no_model_load / "data.jsonl", rows)
    said = refused(
        ["capture", "--model", str(tiny_folder), "--data", "data.jsonl", "--out", "s.zarr"], no_model_load
    )
    assert said.startswith(message)


@pytest.mark.parametrize(("content", "message"), [(b"caf\xe9\n", "not UTF-8 (byte 4)"), (b" \n", "is empty")])
def test_a_context_file_is_read_like_jsonl(no_model_load, content, message):
    (no_model_load / "essay.txt").write_bytes(content)
    said = refused(["generate", "--context-file", "essay.txt", "--question", "q?"], no_model_load)
    assert message in said and said.startswith(
        ("essay.txt:1: not UTF-8", "--context-file essay.txt is empty")
    )


def _unreadable(monkeypatch, name: str) -> None:
    """Opening a file called ``name`` fails as an unreadable file does (chmod 000 for anyone but
    root, an I/O error); every other file opens."""
    real_open = Path.open

    def refusing_open(self, *args, **kwargs):
        if self.name == name:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refusing_open)


@pytest.mark.parametrize(
    ("args", "name"),
    [
        (["generate", "--context-file", "essay.txt", "--question", "q?"], "essay.txt"),
        (["capture", "--data", "data.jsonl", "--out", "s.zarr"], "data.jsonl"),
        (["bench", "--methods", "full,claa", "--keep", "0.5", "--data", "data.jsonl"], "data.jsonl"),
        (["data", "export", "data.jsonl", "--out", "copy.jsonl"], "data.jsonl"),
    ],
)
def test_an_input_file_that_cannot_be_read_is_one_line(no_model_load, tiny_folder, monkeypatch, args, name):
    """A context or data file rankkit may not read (its permissions, an I/O error) ended the command
    in an OSError traceback."""
    row = {"id": "a", "context": "a b c", "question": "q?", "answers": ["x"]}
    (no_model_load / name).write_text(json.dumps(row) + "\n", encoding="utf-8")
    _unreadable(monkeypatch, name)
    said = refused([*args, "--model", str(tiny_folder)], no_model_load)
    assert said == f"cannot read {name} (Permission denied); check that it is a readable file, or give another"


def test_compare_out_that_names_no_file_is_one_line(no_model_load):
    said = refused(["compare", "missing.zarr", "--out", ""], no_model_load)
    assert (
        said == "--out '.' names no file; give a file path, e.g. --out runs/out.parquet"
    )  # typer's Path('')


def test_an_example_without_answer_tokens_gets_no_oracle_and_the_others_do(
    tmp_path, tiny_folder, monkeypatch
):
    import rankkit.capture
    from rankkit import stores
    from rankkit.capture import OracleOptions, capture
    from rankkit.oracle import EmptyAnswer

    data = _jsonl(
        tmp_path / "data.jsonl",
        [
            {"id": "blank", "context": "the sky is blue", "question": "colour?", "answers": [""]},
            {"id": "sky", "context": "the sky is blue", "question": "colour?", "answers": ["blue"]},
        ],
    )
    out = tmp_path / "s.zarr"
    with pytest.warns(UserWarning) as warned:
        summary = capture(
            model=str(tiny_folder), data=str(data), out=out, device="cpu",
            oracle=OracleOptions(answer="reference", max_new_tokens=2),
        )  # fmt: skip
    assert [str(each.message) for each in warned if each.category is UserWarning] == [
        "example 'blank' has no oracle: the reference answer is empty: nothing to rank the prompt by"
    ]
    assert summary.without_answer == ["blank"] and (summary.captures, summary.oracles) == (2, 1)
    assert [record.has_oracle for record in stores.open(out).examples()] == [False, True]

    real = rankkit.capture.answer_informed_oracle

    def eos_for_the_first(*args, **kwargs):
        if not calls:
            calls.append(1)
            raise EmptyAnswer("the model answered with EOS at once: there are no answer tokens to rank by")
        return real(*args, **kwargs)

    calls: list[int] = []
    monkeypatch.setattr(rankkit.capture, "answer_informed_oracle", eos_for_the_first)
    with pytest.warns(
        UserWarning,
        match="example 'blank' has no oracle: the model answered with EOS at once: "
        "there are no answer tokens to rank by; --answer reference ranks by the gold answer instead",
    ):
        generated = capture(
            model=str(tiny_folder), data=str(data), out=tmp_path / "g.zarr", device="cpu",
            oracle=OracleOptions(max_new_tokens=2),
        )  # fmt: skip
    assert generated.without_answer == ["blank"] and generated.oracles == 1


def test_the_interrupt_line_of_a_capture_counts_each_stage():
    from rankkit.capture import CaptureSummary

    summary = CaptureSummary(out="s.zarr", complete_before=1, captures=3, oracles=2)
    assert summary.kept() == (
        "interrupted: kept 3 captures and 2 oracles written by this run (1 examples were complete before) "
        "in s.zarr; rerun the same command to resume"
    )


def test_a_full_disk_during_a_capture_is_one_line_and_keeps_what_was_written(
    tmp_path, tiny_folder, monkeypatch
):
    from rankkit import stores
    from rankkit.capture import capture
    from rankkit.stores.writer import StoreWriter

    real = StoreWriter.write_example

    def full_on_the_second(self, example_id, **kwargs):
        if len(stores.open(self.path).example_ids()) == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path / "examples" / example_id))
        return real(self, example_id, **kwargs)

    monkeypatch.setattr(StoreWriter, "write_example", full_on_the_second)
    out = tmp_path / "s.zarr"
    with pytest.raises(RankkitError) as failed:
        capture(model=str(tiny_folder), data="niah:n=2,length=128", out=out, device="cpu")
    assert str(failed.value) == (
        f"cannot write {out / 'examples'}/niah-128-s0-001 (No space left on device); kept 1 captures and 0 oracles "
        f"written by this run (0 examples were complete before) in {out}; rerun the same command to resume"
    )
    assert stores.open(out).example_ids() == ["niah-128-s0-000"]


def test_a_data_spec_given_as_a_path_is_its_file(tiny_folder, tmp_path, default_tokenizer):
    """capture(data=Path("ex.jsonl")) and bench(..., Path("ex.jsonl")) ended in an AttributeError
    ('PosixPath' object has no attribute 'strip'); the store and the journal record the spec's text."""
    from rankkit import stores
    from rankkit.bench import BenchSettings, Setup, bench
    from rankkit.capture import capture
    from rankkit.data import export_spec, read_spec

    examples = tmp_path / "ex.jsonl"
    assert export_spec("niah:n=1,length=200", default_tokenizer, examples) == 1
    assert read_spec(examples).path == str(examples)
    capture(model=str(tiny_folder), data=examples, probes="window", out=tmp_path / "run.zarr", device="cpu")
    store = stores.open(tmp_path / "run.zarr")
    assert store.meta["dataset"] == str(examples) and len(store.example_ids()) == 1
    settings = BenchSettings(max_new_tokens=1, warmup=0, repeats=1)
    rows = bench("full", examples, keep=0.5, setup=Setup(str(tiny_folder), device="cpu"), settings=settings,
                 out=tmp_path / "bench.parquet")  # fmt: skip
    assert rows["example_id"].to_list() == store.example_ids()
    with pytest.raises(RankkitError, match=r"a data spec is a string or a path, not int 3; use niah:"):
        read_spec(3)


def test_a_list_parameter_takes_a_list_one_value_or_the_command_lines_comma_separated_text():
    from rankkit.values import as_list, int_or_float

    assert as_list("0.1, 0.2,2048", "--keep", int_or_float) == [0.1, 0.2, 2048]
    assert as_list(0.1, "--keep", int_or_float) == [0.1]  # 'float' object is not iterable once
    assert as_list((0, 15), "--kept-layers", int) == [0, 15]
    assert as_list("capture,oracle", "--stages") == ["capture", "oracle"]  # read one letter at a time once
    assert as_list("niah-512-s0-000", "--explore") == ["niah-512-s0-000"]
    with pytest.raises(RankkitError, match=re.escape("--kept-layers 'x' is not a whole number; give e.g. --kept-layers 0,15")):
        as_list("0,x", "--kept-layers", int)
    with pytest.raises(RankkitError, match=re.escape("--stages ' , ' names nothing")):
        as_list(" , ", "--stages")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        # the text the command line reads as a number, refused naming its type: a raw TypeError
        # ('<=' not supported) or a message calling it out of range before
        (lambda folder: _budget(keep="0.1"), "--keep takes a number, not str '0.1'"),
        (lambda folder: _parse_budget("0.1"), "--keep takes a number, not str '0.1'"),
        (lambda folder: _method_options(layer="3"), "--layer takes a whole number, not str '3'"),
        (lambda folder: _prefill(folder, kept_layers=["0"]), "--kept-layers takes a whole number, not str '0'"),
        (lambda folder: _compare("missing.zarr", layer="3"), "--layer takes a whole number, not str '3'"),
        (lambda folder: _select("missing.zarr", "snapkv", keep=0.1, layer="3"), "--layer takes a whole number, not str '3'"),
        # an empty list compared every method, as --methods "" is refused
        (lambda folder: _compare("missing.zarr", methods=[]), "--methods names nothing; give e.g. --methods window"),
        (lambda folder: _variance("missing.zarr", thresholds=["0.1"]), "thresholds takes a number, not str '0.1'"),
        (lambda folder: _setup(folder, threads="1").load(), "--threads must be a whole number >= 1, got '1'"),
        (lambda folder: _capture(folder, threads="1"), "--threads must be a whole number >= 1, got '1'"),
        (lambda folder: _add_oracle(folder, threads="1"), "--threads must be a whole number >= 1, got '1'"),
        (lambda folder: _diffusion(folder, threads="1"), "--threads must be a whole number >= 1, got '1'"),
        (lambda folder: _sweep("missing.toml", threads="1"), "--threads must be a whole number >= 1, got '1'"),
        # comma-separated text read as the command line reads it, not letter by letter
        (lambda folder: _bench(folder, keep="0.5,x"), "--keep 'x' is not a keep rate; give e.g. --keep 0.1"),
        (lambda folder: _prefill(folder, kept_layers="0,15"), "--kept-layers 15 is not a layer of this model (0..2)"),
        (lambda folder: _variance("missing.zarr", thresholds="0.1,x"), "thresholds 'x' is not a number"),
        (lambda folder: _variance("missing.zarr", thresholds=[]), "--thresholds names nothing; give e.g. --thresholds 0.2"),
    ],
)  # fmt: skip
def test_a_parameter_of_the_wrong_type_is_refused_naming_it(no_model_load, tiny_folder, call, message):
    before = sorted(no_model_load.iterdir())
    with pytest.raises(RankkitError, match=re.escape(message)):
        call(tiny_folder)
    assert sorted(no_model_load.iterdir()) == before


def _parse_budget(value):
    from rankkit.methods import Budget

    return Budget.parse(value)


def _method_options(**given):
    from rankkit.bench import MethodOptions

    return MethodOptions(**given)


def _setup(folder, **given):
    from rankkit.bench import Setup

    return Setup(str(folder), **given)


def _select(path, method, **given):
    from rankkit.eval.offline import select_store

    return select_store(path, method, **given)


def _compare(path, **given):
    from rankkit.eval.compare import compare_store

    return compare_store(path, **given)


def _variance(path, **given):
    from rankkit.eval.variance import variance_store

    return variance_store(path, **given)


def _sweep(path, **given):
    from rankkit.sweep import sweep

    return sweep(path, "out", **given)
