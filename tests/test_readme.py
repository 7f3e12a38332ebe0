"""The README as a user follows it: its tour's lines and its Python snippets run as written."""

from __future__ import annotations

import pytest
from readme import blocks

TOUR = "A five-minute tour"


def test_the_tour_is_small_enough_for_five_minutes_and_writes_only_under_runs_tour():
    """`make tour` runs these lines; here what keeps them short: at most 2 examples of 1,024 tokens
    (diffusion, a generation per layer, one of 512),
    no timing repeats, and every output under runs/tour/ (which `make tour` starts anew)."""
    tour, *_ = blocks(TOUR, "bash")
    lines = [line.split("#")[0].split() for line in tour.splitlines()]
    assert lines[0] == ["source", ".venv/bin/activate"]
    commands = [line for line in lines[1:] if line]
    assert [line[:2] for line in commands] == [
        ["rankkit", "generate"], ["rankkit", "capture"], ["rankkit", "store"], ["rankkit", "store"],
        ["rankkit", "compare"], ["rankkit", "select"], ["rankkit", "variance"], ["rankkit", "prefill"],
        ["rankkit", "bench"], ["rankkit", "report"], ["rankkit", "diffusion"], ["rankkit", "dashboard"],
    ]  # fmt: skip
    for line in commands:
        for option, value in zip(line, line[1:], strict=False):
            if option == "--data":
                allowed = ["niah:length=1024", "niah:n=1,length=512" if line[1] == "diffusion" else "niah:n=2,length=1024"]
                assert value in allowed, line
            if option in ("--out", "--bench", "--diffusion") or value.endswith(".zarr"):
                assert value.startswith("runs/tour/"), line
        assert "--repeats" not in line and "--warmup" not in line, line


@pytest.mark.integration
def test_the_python_snippets_run_as_written(tmp_path, monkeypatch, default_model, capsys):
    first, second = blocks(TOUR, "python")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    namespace: dict = {}
    exec(compile(first, "README.md (first snippet)", "exec"), namespace)
    assert namespace["prompt"].num_tokens <= 1024 and namespace["example"].task == "niah"
    exec(compile(second, "README.md (second snippet)", "exec"), namespace)
    assert (tmp_path / "runs" / "bench.parquet").exists()
    summary = namespace["rows"]
    assert sorted(set(summary["method"])) == ["claa", "fastkv", "full"] and summary.height == 2 * 3
    assert (namespace["claa"]["method"], namespace["full"]["method"]) == ("claa", "full")
    assert namespace["claa"]["selection_layer"] == 12
    assert capsys.readouterr().out.strip()


@pytest.mark.integration
def test_the_methods_guides_snippet_runs_as_written(default_model):
    """docs/methods.md's "Using them" used an `input_ids` it never made."""
    from pathlib import Path

    guide = Path(__file__).resolve().parent.parent / "docs" / "methods.md"
    (snippet,) = blocks("Using them", "python", readme=guide)
    namespace: dict = {}
    exec(compile(snippet, "docs/methods.md (Using them)", "exec"), namespace)
    run = namespace["run"]
    assert run.selection_layer == 15 and run.ttft_s > 0
    assert "7214" in namespace["loaded"].tokenizer.decode(run.tokens)
