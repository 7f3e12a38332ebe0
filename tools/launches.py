"""Operators each method launches beyond full's, per prefill and per decode step, and a capture's
beyond the runner's, on a model.

Where a prefill or an eager decode step is launch-bound (a small model's prefill, an 8B model's
decode step on a GPU: docs/benchmarks.md, "GPU") its host time is these operators, whatever their
arithmetic, so this count is what a method adds there. It is the same on any device: this runs on
the CPU in a minute or two, on ``random:smollm2-135m`` (the default model's architecture, random
weights) unless told otherwise. The selections' descending sort is counted as CUDA runs it (torch's
sort; on the CPU rankkit sorts in numpy, outside the count). A decode step is counted after a few
steps (rolling windows full), eagerly, and with ``--cuda-graphs`` over the static cache, whose step
a CUDA graph captures (a method that decodes eagerly there says so).

    python3 tools/launches.py [--model SPEC] [--length N] [--keep K] [--cuda-graphs] [METHOD ...]
"""

from __future__ import annotations

import argparse
import warnings

import torch

from rankkit import models
from rankkit.measure import OperatorLaunches, launches_of
from rankkit.methods import REGISTRY, Budget, make
from rankkit.methods.selection import sorting_as_on_cuda
from rankkit.probes import ProbeRecorder, parse_probes
from rankkit.runner import Runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("methods", nargs="*", default=sorted(REGISTRY))
    parser.add_argument("--model", default="random:smollm2-135m")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--keep", type=float, default=0.1)
    parser.add_argument("--cuda-graphs", action="store_true", help="count the static cache's decode step")
    args = parser.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random weights: timing only, which a count is
        loaded = models.load(args.model, device="cpu", dtype=torch.float32)
    with torch.inference_mode(), sorting_as_on_cuda():
        count(Runner(loaded.model, cuda_graphs=args.cuda_graphs), loaded.tokenizer, args)


WARM_STEPS = 4  # decode steps before the count: the rolling windows fill and start to roll
COUNTED_STEPS = 8


def decode_launches(runner: Runner, run, prompt_length: int) -> float:
    """Operators per decode step after ``run``'s prefill (``WARM_STEPS`` first), the greedy argmax excluded."""
    step = runner.decoder(run.result, WARM_STEPS + COUNTED_STEPS, run.decode_hooks)
    token = torch.argmax(run.result.logits)
    for position in range(prompt_length, prompt_length + WARM_STEPS):
        token = torch.argmax(step(token, position))
    counted = prompt_length + WARM_STEPS
    with OperatorLaunches() as launches:
        for position in range(counted, counted + COUNTED_STEPS):
            token = torch.argmax(step(token, position))
    return (launches.count - COUNTED_STEPS) / COUNTED_STEPS  # one argmax a step


def count(runner: Runner, tokenizer, args) -> None:
    """Print each method's operators beyond full's, per prefill and per decode step, and a capture's."""
    ids = torch.randint(0, runner.config.vocab_size, (args.length,), generator=torch.Generator().manual_seed(0))
    full_method, whole = make("full"), Budget.from_keep(1.0)
    full = launches_of(lambda: full_method.prefill_for_decoding(runner, ids, whole))  # a local layer's roll too
    full_step = decode_launches(runner, full_method.prefill_for_decoding(runner, ids, whole), args.length)
    layers = runner.num_layers
    budget = Budget.from_keep(args.keep)
    decoding = "static-cache (graphed)" if runner.cuda_graphs else "eager"
    print(f"{args.model}, {layers} layers, {args.length} tokens, keep {args.keep}; decode steps {decoding}")
    print(f"{'full':14s} prefill {full:6d} ({full / layers:.1f} per layer); step {full_step:7.1f} ({full_step / layers:.1f} per layer)")
    for name in args.methods:
        method = make(name)
        method.prepare(runner, ids, tokenizer=tokenizer)
        extra = launches_of(lambda method=method: method.prefill_for_decoding(runner, ids, budget)) - full
        run = method.prefill_for_decoding(runner, ids, budget)
        eager = runner.cuda_graphs and not runner.replays(run.decode_hooks)
        step_extra = decode_launches(runner, run, args.length) - full_step
        print(
            f"{name:14s} prefill beyond full {extra:6d} ({extra / layers:.1f} per layer); "
            f"step beyond full {step_extra:7.1f} ({step_extra / layers:.1f} per layer)" + (", eagerly" if eager else "")
        )

    def capture() -> None:
        recorder = ProbeRecorder(parse_probes("all"))
        runner.prefill(ids, hooks=[recorder])
        recorder.scores()

    extra = launches_of(capture) - launches_of(lambda: runner.prefill(ids))
    print(f"{'capture, all':14s} beyond the runner's {extra:6d} ({extra / runner.num_layers:.1f} per layer)")


if __name__ == "__main__":
    main()
