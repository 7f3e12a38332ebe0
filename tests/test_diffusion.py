"""The information-diffusion probe against a slow layer loop over prompt ⊕ answer, and on a real needle."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings

import polars as pl
import pytest
import torch
from conftest import tiny_model
from test_oracle import FILLER, QUESTION, CharTokenizer, passkey_prompt, record_queries_and_keys

from rankkit.data import Example
from rankkit.errors import RankkitError
from rankkit.eval.diffusion import (
    DIFFUSION_MEANS,
    ROUNDING,
    SCHEMA,
    check_diffusion_values,
    diffusion_curve,
    example_diffusion,
    kl_divergence,
    layer_summary,
)
from rankkit.eval.stats import interval_columns, wilson_interval
from rankkit.runner import Runner, greedy_continue

EVIDENCE = [(10, 14), (20, 22)]
ANSWER = "ab!c"


def evidence_mask(length: int) -> torch.Tensor:
    mask = torch.zeros(length, dtype=torch.bool)
    for start, end in EVIDENCE:
        mask[start:end] = True
    return mask


def slow_logits(model, ids: torch.Tensor, answer: list[int], removed_from: int) -> torch.Tensor:
    """Logits over prompt ⊕ answer from a plain layer loop, the evidence dropped before layer ``removed_from``."""
    body = model.model
    sequence = torch.cat([ids, torch.tensor(answer)])
    keep = torch.nonzero(~evidence_mask(sequence.shape[0])).reshape(-1)
    with torch.inference_mode():
        hidden = body.embed_tokens(sequence[None])
        positions = torch.arange(sequence.shape[0])
        for index, decoder in enumerate(body.layers):
            if index == removed_from:
                hidden, positions = hidden[:, keep], positions[keep]
            n = hidden.shape[1]
            hidden = decoder(
                hidden,
                attention_mask=torch.full((n, n), float("-inf")).triu(1)[None, None],
                position_ids=positions[None],
                position_embeddings=body.rotary_emb(hidden, positions[None]),
            )
        return model.lm_head(body.norm(hidden))[0]


def slow_row(model, ids, answer, removed_from):
    """answer log-prob and first-token log-distribution of one removal layer, the slow way."""
    logits = slow_logits(model, ids, answer, removed_from)[-len(answer) - 1 : -1].double()
    logprobs = torch.log_softmax(logits, dim=-1)
    return float(logprobs[torch.arange(len(answer)), torch.tensor(answer)].sum()), logprobs[0]


def slow_evidence_attention(model, ids, answer) -> list[float]:
    """Per layer: softmax attention of each answer token's query (fed back) on the evidence, mean over heads and tokens."""
    recorded = record_queries_and_keys(model, torch.cat([ids, torch.tensor(answer)]))
    scaling = model.model.layers[0].self_attn.scaling
    length, total = ids.shape[0], ids.shape[0] + len(answer)
    on_evidence = evidence_mask(total).double()
    shares = []
    for query, key, _module in recorded:
        keys = key.repeat_interleave(query.shape[0] // key.shape[0], dim=0)
        logits = query @ keys.transpose(1, 2) * scaling  # [heads, total, total]
        logits = logits.masked_fill(torch.ones(total, total, dtype=torch.bool).triu(1), float("-inf"))
        weights = logits.softmax(dim=-1)[:, length:]  # the answer tokens' rows
        shares.append(float((weights @ on_evidence).mean()))
    return shares


@pytest.mark.parametrize("family_name", ["llama", "qwen3"])
def test_curve_equals_a_slow_layer_loop(family_name, random_ids):
    tokenizer = CharTokenizer()
    answer = tokenizer(ANSWER)["input_ids"]
    model = tiny_model(family_name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # answers cut at the limit with full marks: nothing to warn of
        frame = diffusion_curve(
            Runner(model),
            tokenizer,
            random_ids,
            EVIDENCE,
            ANSWER,
            score_fn=lambda prediction: 1.0,
            max_new_tokens=5,
            cluster="haystack-0",
        )
    assert frame.columns == [
        "example",
        "cluster",
        "layer",
        "correct",
        "score",
        "answer_logprob",
        "first_token_kl",
        "evidence_attention",
        "prediction",
    ]
    assert frame["layer"].to_list() == [0, 1, 2, 3]
    assert frame.select("example", "cluster", "score", "correct").unique().rows() == [("example", "haystack-0", 1.0, True)]

    reference = tiny_model(family_name)
    _, unpruned_first = slow_row(reference, random_ids, answer, removed_from=3)
    for row in frame.iter_rows(named=True):
        logprob, first = slow_row(reference, random_ids, answer, removed_from=row["layer"])
        kl = float((unpruned_first.exp() * (unpruned_first - first)).sum())
        assert row["answer_logprob"] == pytest.approx(logprob, abs=1e-4)
        assert row["first_token_kl"] == pytest.approx(kl, abs=1e-5)
    last = frame.row(3, named=True)
    assert last["first_token_kl"] == 0.0 and last["evidence_attention"] is None
    expected_shares = slow_evidence_attention(reference, random_ids, answer)
    assert frame["evidence_attention"].to_list()[:3] == pytest.approx(expected_shares, abs=1e-5)


def test_a_sliding_window_layer_puts_no_attention_on_evidence_outside_its_window(random_ids):
    """gemma2's local layers see the last 8 keys: the answer's queries (positions 40 on) cannot reach
    the evidence (10..21) there, so its share is 0 exactly; the global layer reads it."""
    runner = Runner(tiny_model("gemma2"))
    frame = diffusion_curve(
        runner, CharTokenizer(), random_ids, EVIDENCE, ANSWER, score_fn=lambda prediction: 1.0, max_new_tokens=5
    )
    local, full, local_again, _ = frame["evidence_attention"].to_list()
    assert (local, local_again) == (0.0, 0.0) and full > 0.05


def test_removal_at_the_embeddings_is_a_prefill_without_the_evidence(random_ids):
    """l = 0: the same as prefilling only the other tokens at their original positions."""
    runner = Runner(tiny_model("qwen2"))
    keep = torch.nonzero(~evidence_mask(40)).reshape(-1)
    expected = greedy_continue(runner, runner.prefill(random_ids[keep], positions=keep), 6)
    unpruned = greedy_continue(runner, runner.prefill(random_ids), 6)
    tokenizer = CharTokenizer()
    target = tokenizer.decode(unpruned)
    frame = diffusion_curve(
        runner,
        tokenizer,
        random_ids,
        EVIDENCE,
        ANSWER,
        score_fn=lambda prediction: float(prediction == target),
        max_new_tokens=6,
        layers=[0, 3],
        example_id="probe",
    )
    assert frame["prediction"].to_list() == [tokenizer.decode(expected), target]
    assert frame["correct"].to_list() == [expected == unpruned, True]
    assert frame["example"].unique().to_list() == ["probe"]


def test_bad_evidence_and_layers_are_refused(random_ids):
    runner = Runner(tiny_model("llama"))
    tokenizer = CharTokenizer()
    with pytest.raises(RankkitError, match="no evidence"):
        diffusion_curve(runner, tokenizer, random_ids, [(5, 5)], ANSWER)
    for span in ((30, 40), (39, 40)):
        with pytest.raises(RankkitError, match="last prompt token"):
            diffusion_curve(runner, tokenizer, random_ids, [span], ANSWER)
    with pytest.raises(RankkitError, match="layers"):
        diffusion_curve(runner, tokenizer, random_ids, EVIDENCE, ANSWER, layers=[4])


def test_an_unpruned_answer_cut_short_by_the_limit_is_refused(random_ids):
    """A random model never says "ab!c": with the answer cut at the limit, every layer would score 0;
    refused at the default limit, warned of at one given."""
    runner = Runner(tiny_model("llama"))
    tokenizer = CharTokenizer()
    unpruned = tokenizer.decode(greedy_continue(runner, runner.prefill(random_ids), 36))
    with pytest.raises(RankkitError) as refused:  # default: the answer's 4 tokens + 32
        diffusion_curve(runner, tokenizer, random_ids, EVIDENCE, ANSWER, example_id="probe")
    assert str(refused.value) == (
        f"example probe: the answer on the whole prompt was cut at 36 new tokens short of full marks "
        f"({unpruned!r}); give a larger --max-new-tokens"
    )
    with pytest.warns(
        UserWarning, match="cut at 7 new tokens short of full marks .*; every layer scores it as wrong"
    ):
        diffusion_curve(runner, tokenizer, random_ids, EVIDENCE, ANSWER, max_new_tokens=7, layers=[3])


def test_layer_summary_averages_over_examples_with_intervals_resampling_clusters():
    frame = pl.DataFrame(
        {
            "example": ["a", "a", "b", "b", "c", "c"],
            "cluster": ["x", "x", "x", "x", "y", "y"],
            "layer": [0, 1, 0, 1, 0, 1],
            "correct": [False, True, True, True, True, True],
            "score": [0.5, 1.0, 1.0, 1.0, 1.0, 1.0],
            "answer_logprob": [-4.0, -1.0, -2.0, -1.0, -3.0, -1.0],
            "first_token_kl": [2.0, 0.0, 1.0, 0.0, 3.0, 0.0],
            "evidence_attention": [0.5, None, 0.3, None, 0.4, None],
        }
    )
    summary = layer_summary(frame)
    means = summary.select("layer", *DIFFUSION_MEANS, "n_examples", "n_clusters").to_dicts()
    assert means == [
        {"layer": 0, "correct": 2 / 3, "score": 2.5 / 3, "answer_logprob": -3.0, "first_token_kl": 2.0,
         "evidence_attention": pytest.approx(0.4), "n_examples": 3, "n_clusters": 2},
        {"layer": 1, "correct": 1.0, "score": 1.0, "answer_logprob": -1.0, "first_token_kl": 0.0,
         "evidence_attention": None, "n_examples": 3, "n_clusters": 2},
    ]  # fmt: skip
    # the bootstrap resamples the two clusters, whose log-prob means are both -3 and KL means 1.5 and 3
    def interval(summary, metric):
        row = summary.row(0, named=True)
        return tuple(row[column] for column in interval_columns(metric))

    assert interval(summary, "answer_logprob") == (-3.0, -3.0)
    assert interval(summary, "first_token_kl") == (1.5, 3.0)
    assert summary.row(1, named=True)["evidence_attention_ci_low"] is None
    # every answer right at layer 1: Wilson's interval over the two clusters, not the bootstrap's [1, 1]
    row = summary.row(1, named=True)
    assert (row["correct_ci_low"], row["correct_ci_high"]) == pytest.approx(wilson_interval(2, 2))
    assert (row["score_ci_low"], row["score_ci_high"]) == pytest.approx(wilson_interval(2, 2))  # full marks
    # without clusters (a frame from before the probe kept them) every example is its own sample
    alone = layer_summary(frame.drop("cluster"))
    assert "n_clusters" not in alone.columns and interval(alone, "answer_logprob") == (-4.0, -2.0)
    assert interval(alone, "correct") == pytest.approx(wilson_interval(2, 3))  # 2 of 3 right: a count


@pytest.mark.parametrize(
    ("column", "past"),
    [("layer", -1), ("layer", 4), ("score", -0.01), ("score", 1.01), ("answer_logprob", 2 * ROUNDING),
     ("first_token_kl", -2 * ROUNDING), ("evidence_attention", -0.01), ("evidence_attention", 1 + 2 * ROUNDING)],
)  # fmt: skip
def test_probe_rows_on_a_bound_pass_and_past_it_are_refused(column, past):
    """The bounds are the probe's own: layers 0..L of the store's model, scores and attention shares in
    [0, 1], log-probabilities at most 0 and KLs at least 0, each with a float's rounding to spare."""
    on_bounds = pl.DataFrame(
        {"example": ["e0", "e0"], "layer": [0, 3], "score": [0.0, 1.0], "answer_logprob": [ROUNDING, -40.0],
         "first_token_kl": [-ROUNDING, 9.0], "evidence_attention": [0.0, 1 + ROUNDING]}
    )  # fmt: skip
    check_diffusion_values(on_bounds, "the frame", 3)
    damaged = on_bounds.with_columns(pl.Series(column, [past, on_bounds[column][1]]))
    with pytest.raises(RankkitError, match=rf"^the frame holds {column} .* not as rankkit diffusion on this store's 3-layer model"):
        check_diffusion_values(damaged, "the frame", 3)
    with pytest.raises(RankkitError, match="^the frame holds more than one row of example e0, layer 0 .* rankkit diffusion writes"):
        check_diffusion_values(pl.concat([on_bounds, on_bounds.head(1)]), "the frame", 3)


def test_a_dataset_example_hands_the_probe_its_evidence_answer_metric_and_cluster(default_tokenizer, monkeypatch):
    """example_diffusion's side of the default-model test, without the model: the evidence's tokens,
    the answer as the prompt continues it after a prefix (with its space), the example's metric."""
    import rankkit.eval.diffusion as diffusion

    needle = "The pass key is 68247. Remember it."
    example = Example(
        id="passkey", task="niah", context=FILLER + needle + " " + FILLER, question=QUESTION, answers=("68247",),
        answer_prefix="The pass key is", evidence=((len(FILLER), len(FILLER) + len(needle)),),
        meta={"cluster": "haystack-0"},
    )  # fmt: skip
    calls = []
    monkeypatch.setattr(diffusion, "diffusion_curve", lambda *args, **options: calls.append((args, options)))
    example_diffusion("runner", default_tokenizer, example, max_new_tokens=8, layers=[1])
    ((runner, tokenizer, ids, spans, answer), options) = calls[0]
    assert (runner, tokenizer, answer) == ("runner", default_tokenizer, " 68247")
    ((start, end),) = spans
    assert default_tokenizer.decode(ids.reshape(-1)[start:end]).strip() == needle
    score = options.pop("score_fn")
    assert (score("it is 68247"), score("it is 6824")) == (1.0, 0.0)
    assert options == {"max_new_tokens": 8, "layers": [1], "example_id": "passkey", "cluster": "haystack-0"}


def test_cli_prints_the_layer_table_and_writes_the_frame(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import rankkit.eval.diffusion
    from rankkit.cli import commands  # noqa: F401  (registers every command, `diffusion` among them)
    from rankkit.cli.app import app

    frame = pl.DataFrame(
        {
            "example": ["a", "a"],
            "cluster": [None, None],
            "layer": [0, 1],
            "correct": [False, True],
            "score": [0.0, 1.0],
            "answer_logprob": [-9.0, -0.5],
            "first_token_kl": [2.0, 0.0],
            "evidence_attention": [0.25, None],
            "prediction": ["12", "68247"],
        },
        schema=SCHEMA,
    )
    calls = []

    def fake_probe(data, **options):
        calls.append((data, options.pop("progress") is not None, options))
        return frame

    monkeypatch.setattr(rankkit.eval.diffusion, "diffusion_probe", fake_probe)
    out = tmp_path / "curve.parquet"
    args = ["diffusion", "--data", "niah:n=1,length=512", "--limit", "1", "--out", str(out), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert calls == [
        (
            "niah:n=1,length=512",
            True,
            {
                "model": "default",
                "limit": 1,
                "device": "auto",
                "max_new_tokens": None,
                "out": out,
                "overwrite": False,
                "allow_overlength": False,
                "threads": None,  # the library sets them, as --threads names them
            },
        )
    ]
    assert json.loads(result.stdout)[0] == layer_summary(frame).to_dicts()[0]
    as_csv = CliRunner().invoke(app, ["diffusion", "--data", "niah:n=1,length=512", "--format", "csv"])
    rows = layer_summary(frame).to_dicts()
    assert as_csv.stdout.splitlines() == [
        ",".join(rows[0]),
        *(",".join("" if value is None else str(value) for value in row.values()) for row in rows),
    ]
    table = CliRunner().invoke(app, ["diffusion", "--data", "niah:n=1,length=512"])
    assert table.exit_code == 0 and "Evidence removed from layer l on" in table.stdout
    assert "KL 1st token" in table.stdout


# --- the default model on a passkey ---------------------------------------------------------------

# The curve measured on this example with SmolLM2-135M-Instruct (every layer, 12 new tokens):
# removed from l <= 18: wrong, answer log-prob -14 to -18, first-digit KL 2.1-2.5 nats;
# l = 19..23: log-prob -3.7 .. -1.9, KL 1.6 .. 0.8, still wrong; l >= 24: right, log-prob
# -0.45, KL < 4e-4. The answer's attention on the needle peaks at layers 14, 17 and 18
# (0.25, 0.39, 0.23), elsewhere mostly below 0.1: read in the middle, diffused after.
PROBED_LAYERS = [0, 12, 17, 19, 24, 30]


@pytest.mark.integration
def test_default_model_needle_survives_late_removal_only(default_model):
    model, tokenizer = default_model
    prompt, needle, _ = passkey_prompt(tokenizer, "68247", 14, 0.2, answer_prefix="The pass key is ")
    frame = diffusion_curve(
        Runner(model), tokenizer, prompt.input_ids, [needle], "68247", max_new_tokens=12, layers=PROBED_LAYERS
    )
    rows = {row["layer"]: row for row in frame.iter_rows(named=True)}
    assert rows[30]["correct"] and rows[30]["first_token_kl"] == 0.0
    assert rows[24]["correct"] and rows[24]["first_token_kl"] < 0.01
    assert not any(rows[layer]["correct"] for layer in (0, 12, 17))  # removed before the answer read it
    assert rows[0]["answer_logprob"] < rows[19]["answer_logprob"] - 5.0 < rows[30]["answer_logprob"] - 5.0
    assert rows[0]["first_token_kl"] > 1.0
    read = {layer: row["evidence_attention"] for layer, row in rows.items() if layer < 30}
    assert max(read, key=read.get) == 17 and read[17] > 0.2


@pytest.mark.integration
def test_default_model_niah_is_right_unpruned_at_the_default_answer_limit(default_model):
    """16 new tokens cut niah's answer (accuracy 0 at every layer); the default is its length + 32."""
    from rankkit.data import load_examples

    model, tokenizer = default_model
    (example,) = load_examples("niah:n=1,length=512", tokenizer)
    frame = example_diffusion(Runner(model), tokenizer, example, layers=[30])
    assert frame["correct"].to_list() == [True]
    # the examples it shares a haystack or needle with are one sample of layer_summary's intervals
    assert frame["cluster"].to_list() == [example.meta["cluster"]] and example.meta["cluster"]


@pytest.mark.integration
def test_default_model_dataset_example_keeps_its_answer_unpruned(default_model):
    """The Example path: evidence char spans, the metric, the answer continued after the prefix."""
    model, tokenizer = default_model
    needle = "The pass key is 68247. Remember it."
    context = FILLER * 3 + needle + " " + FILLER * 11
    example = Example(
        id="passkey",
        task="niah",
        context=context,
        question=QUESTION,
        answers=("68247",),
        answer_prefix="The pass key is",
        evidence=((len(FILLER) * 3, len(FILLER) * 3 + len(needle)),),
    )
    frame = example_diffusion(Runner(model), tokenizer, example, max_new_tokens=8, layers=[30])
    row = frame.row(0, named=True)
    assert row["example"] == "passkey" and row["correct"] and row["score"] == 1.0
    assert row["answer_logprob"] > -2.0


def test_the_kl_of_distributions_a_rounding_apart_is_never_below_zero():
    """Logits one float step apart in one entry summed to -6e-16, and a layer's KL printed "-0.00".
    Which way the rounding goes depends on the CPU's summation (one CI machine's came to +9e-16), so
    several such pairs are summed and each KL must lie in [0, 1e-12)."""
    for seed in range(8):
        logits = torch.randn(49152, generator=torch.Generator().manual_seed(seed)) * 3
        nudged = logits.clone()
        nudged[7] = torch.nextafter(nudged[7], torch.tensor(1e9))
        assert 0.0 <= kl_divergence(logits, nudged) < 1e-12, seed
    assert kl_divergence(logits, logits + torch.linspace(0, 1, 49152)) > 0.01  # a real difference is kept


def test_an_example_without_answers_is_refused_by_name_before_any_is_probed(tiny_folder, tmp_path):
    """It was refused when its turn came, as "answer='reference' needs examples with answers", an option
    diffusion does not have, naming neither the example nor the fix."""
    from rankkit.data import export_jsonl
    from rankkit.eval import diffusion

    answered = Example("a", "jsonl", "Some context.", "What?", ("x",))
    data = tmp_path / "d.jsonl"
    export_jsonl([answered, dataclasses.replace(answered, id="b", answers=())], data)
    with pytest.raises(RankkitError, match=rf"^example 'b' has no answers, and the diffusion probe follows its first; add answers to it in {re.escape(str(data))}"):
        diffusion.diffusion_probe(str(data), model=str(tiny_folder), out=tmp_path / "d.parquet")
    assert not (tmp_path / "d.parquet").exists() and not list(tmp_path.glob(".d.parquet*"))


def test_the_probe_refuses_bad_options_before_it_loads_the_model(tiny_folder, monkeypatch, tmp_path):
    import rankkit.eval.diffusion as diffusion
    from rankkit import outputs

    class Loaded(Exception):
        """The checks passed: the probe went on to load the model."""

    def load(*args, **options):
        raise Loaded

    monkeypatch.setattr(diffusion.models, "load", load)
    model, data = str(tiny_folder), "niah:n=1,length=128"
    with pytest.raises(RankkitError, match="^--threads 999: "):
        diffusion.diffusion_probe(data, model=model, threads=999)
    with pytest.raises(RankkitError, match="^the diffusion probe measures answers, and random:tiny has random weights"):
        diffusion.diffusion_probe(data, model="random:tiny")
    for option, name in (("limit", "--limit"), ("max_new_tokens", "--max-new-tokens")):
        with pytest.raises(RankkitError, match=f"^{name} "):
            diffusion.diffusion_probe(data, model=model, **{option: 0})
    with pytest.raises(RankkitError, match="length=100000"):  # past the model's positions, unless allowed
        diffusion.diffusion_probe("niah:n=1,length=100000", model=model)
    with pytest.raises(Loaded):
        diffusion.diffusion_probe("niah:n=1,length=100000", model=model, allow_overlength=True)
    out = outputs.write_parquet(pl.DataFrame({"example": ["e0"]}), tmp_path / "d.parquet")
    with pytest.raises(RankkitError, match="d.parquet already exists; pass --overwrite"):
        diffusion.diffusion_probe(data, model=model, out=out)
    with pytest.raises(Loaded):
        diffusion.diffusion_probe(data, model=model, out=out, overwrite=True)


def test_a_resumed_probe_reports_the_examples_it_found_finished_as_skipped(tiny_folder, tmp_path, monkeypatch):
    """They were reported as probed, so the ETA counted them as work done in no time."""

    import rankkit.eval.diffusion as diffusion
    from rankkit import models
    from rankkit.data import data_fingerprint
    from rankkit.errors import Interrupted
    from rankkit.outputs import journal_path
    from rankkit.progress import SKIPPED

    real, calls = diffusion.example_diffusion, []

    def interrupted_on_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(diffusion, "example_diffusion", interrupted_on_the_second)
    run = dict(model=str(tiny_folder), out=tmp_path / "d.parquet", max_new_tokens=2, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a random model's answers are cut short of full marks
        with pytest.raises(Interrupted):
            diffusion.diffusion_probe("niah:n=3,length=128", **run)
        # the settings a rerun must match to resume, as the journal's first line keeps them
        identity = {"command": "diffusion", "data": "niah:n=3,length=128", **data_fingerprint("niah:n=3,length=128"),
                    "model": str(tiny_folder), "limit": None, "max_new_tokens": 2}  # fmt: skip
        kept = journal_path(run["out"]).read_text(encoding="utf-8").splitlines()[0]
        assert json.loads(kept)["identity"] == json.loads(json.dumps(identity))
        events = []
        frame = diffusion.diffusion_probe("niah:n=3,length=128", progress=events.append, **run)
    assert [(event.stage, event.done, event.total) for event in events] == [
        (SKIPPED, 1, 3), ("probed", 2, 3), ("probed", 3, 3)
    ]
    assert [event.detail for event in events] == frame["example"].unique(maintain_order=True).to_list()
    assert frame["example"].n_unique() == 3
    # the model that answered, for the dashboard to draw them beside its stores only
    loaded = models.load(str(tiny_folder), device="cpu")
    assert frame.select("model", "weights_hash").unique().rows() == [(loaded.model_id, loaded.weights_hash)]
