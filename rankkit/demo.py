"""The demo job: what `make demo` runs on the embedded default model.

A small version of the whole workflow, sized to finish in a few minutes on two CPU
cores: capture every probe with the oracle on needle-in-a-haystack prompts, compare the
rankings to the oracle layer by layer, draw ASL's rank-variance curves, run a few
methods end to end against full prefill, and write the dashboard of it all.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from rich.console import Console

from rankkit import defaults, models, outputs
from rankkit.errors import RankkitError
from rankkit.prompting import build_prompt, example_prompt
from rankkit.runner import Runner

DEMO_DATA = "niah:n=4,length=1024"
DEMO_METHODS = ("full", "gemfilter", "fastkv", "claa", "snapkv")
DEMO_KEEP = 0.2
DEMO_BENCHED = 2  # the first examples of DEMO_DATA, run end to end


def answer(
    model_spec: str,
    context: str,
    question: str,
    *,
    data: str | None = None,
    context_file: str | os.PathLike | None = None,
    max_new_tokens: int = defaults.MAX_NEW_TOKENS,
    device: str = defaults.DEVICE,
    threads: int | None = None,
) -> dict:
    """Greedy answer through the runner, with the prompt's size: to (context, question), the context
    given as text or as ``context_file`` (``--context-file``), or, given a data spec ``data``, to its
    first example (then the context and ``question`` must be empty). ``threads`` sets torch's CPU
    threads for the process (``models.use_threads``)."""
    from rankkit.data import context_text, load_examples

    models.use_threads(threads)
    context = context_text(context, context_file) or ""
    if data is not None and (context or question):
        raise RankkitError("give either a data spec (--data) or --context-file/--question, not both")
    if data is None and not question:
        raise RankkitError("give --question (with --context-file), or a data spec, e.g. --data niah:length=1024")
    loaded = models.load(model_spec, device=device)
    if data is None:
        prompt = build_prompt(loaded.tokenizer, context, question)
    else:
        prompt = example_prompt(loaded.tokenizer, load_examples(data, loaded.tokenizer)[0])
    generation = Runner(loaded.model).generate(prompt.input_ids, max_new_tokens)
    text = loaded.tokenizer.decode(generation.tokens, skip_special_tokens=True).strip()
    return {"model": loaded.model_id, "prompt_tokens": prompt.num_tokens, "answer": text}


def counted_examples(count: int) -> str:
    return f"{count} example{'' if count == 1 else 's'}"


def captured_line(captured) -> str:
    """What the demo's capture did (a ``CaptureSummary``): a rerun finds its examples in the store
    already and captures none, so it has no speed or oracle score of its own to print."""
    said = []
    if captured.written:
        said.append(f"captured {counted_examples(captured.written)} ({captured.tokens_per_second:,.0f} tok/s)")
    from rankkit.eval.stats import row_with_interval

    accuracy = captured.accuracy
    if accuracy is not None:
        said.append(
            f"the oracle's answers scored {row_with_interval(accuracy, 'accuracy')} "
            f"(mean of {accuracy['n_examples']}, 95% interval)"
        )
    if captured.skipped:
        said.append(f"{counted_examples(captured.skipped)} held from an earlier run, not captured again")
    return "; ".join(said)


DEMO_MARKER = ".rankkit-demo"  # in a folder the demo wrote: its rerun may rewrite the demo's files there


def claim_folder(out: Path, written: dict[str, Path]) -> None:
    """Make ``out`` the demo's before any work. A rerun rewrites what an earlier demo wrote there
    (its store resumes); a file or folder of the demo's names that no demo made is refused, so the
    demo never writes over a user's file."""
    from rankkit.eval import compare, variance

    outputs.check_writable(out)
    outputs.check_outside_stores(out, itself=True)
    paths = [
        *(value for name, value in written.items() if name not in ("compare", "variance")),
        *compare.output_paths(written["compare"]),
        *variance.output_paths(written["variance"]),
    ]
    if not (out / DEMO_MARKER).is_file():
        for path in paths:
            if path.exists():
                raise RankkitError(
                    f"{path} is in the way: the demo writes there but did not make it; move it away, "
                    "or choose another --out"
                )
    out.mkdir(parents=True, exist_ok=True)
    outputs.write_text("written by `rankkit demo`: a rerun rewrites the demo's files here\n", out / DEMO_MARKER)


def run_demo(out: Path, *, device: str = "auto", console: Console | None = None) -> dict[str, Path]:
    """Run the workflow into ``out``; returns what it wrote, by name."""
    from rankkit.bench import BenchSettings, bench_into, summary
    from rankkit.capture import OracleOptions, capture
    from rankkit.data import load_examples
    from rankkit.eval.compare import compare_store, summary_table
    from rankkit.eval.stats import interval_columns
    from rankkit.eval.variance import variance_store
    from rankkit.methods import Budget, make
    from rankkit.report import write_dashboard
    from rankkit.tables import frame_table

    console = console or Console()
    written = {
        "store": out / "niah.zarr",
        "compare": out / "compare.parquet",
        "variance": out / "variance.parquet",
        "bench": out / "bench.parquet",
        "dashboard": out / "report.html",
    }
    models.resolve_device(device)  # a bad --device is refused before the folder is claimed
    claim_folder(out, written)

    with console.status(f"capture: every probe at every layer + oracle, {DEMO_DATA}"):
        captured = capture(
            data=DEMO_DATA, out=written["store"], device=device, oracle=OracleOptions(max_new_tokens=16)
        )
    console.print(captured_line(captured))

    with console.status("compare against the oracle, ASL variance curves"):
        comparison = compare_store(written["store"])
        # the folder is the demo's (claim_folder): a rerun rewrites what an earlier one wrote
        comparison.write(written["compare"], overwrite=True)
        variance_store(written["store"]).write(written["variance"], overwrite=True)
    console.print(frame_table(summary_table(comparison.summary), "rankings vs the oracle"))

    loaded = models.load("default", device=device)
    examples = load_examples(DEMO_DATA, loaded.tokenizer)[:DEMO_BENCHED]
    settings = BenchSettings(max_new_tokens=16, warmup=1, repeats=1)
    identity = {
        "command": "demo",
        "data": DEMO_DATA,
        "examples": DEMO_BENCHED,
        "methods": list(DEMO_METHODS),
        "keep": DEMO_KEEP,
        "settings": dataclasses.asdict(settings),
        "weights": loaded.weights_hash,
    }
    # an interrupted demo's rerun resumes its bench; a finished one's reruns it
    with (
        console.status(f"bench: {', '.join(DEMO_METHODS)} at keep {DEMO_KEEP}"),
        outputs.Journal(written["bench"], identity, owned=True) as journal,
    ):
        held = sum(journal.done(example.id) for example in examples)
        frame = bench_into(
            journal,
            Runner(loaded.model),
            loaded,
            examples,
            [make(name) for name in DEMO_METHODS],
            [Budget.from_keep(DEMO_KEEP)],
            settings,
            prompt_for=lambda example: example_prompt(loaded.tokenizer, example),
        )
    per_method = summary(frame).select(
        "method",
        *(
            column
            for metric in ("accuracy", "ttft_ratio", "ideal_ratio", "kv_ratio")
            for column in (metric, *interval_columns(metric))
        ),
        "n_examples",
    )
    if held:
        console.print(f"bench: {counted_examples(held)} held from an interrupted run, not run again")
    console.print(
        frame_table(per_method, f"end to end at keep {DEMO_KEEP}: means [95% interval] over n examples")
    )

    with console.status("dashboard"):
        write_dashboard(written["store"], written["dashboard"], bench=frame, overwrite=True)
    return written
