"""Operators each method's prefill launches beyond full's, and a capture's beyond the runner's, on a model.

Where a prefill is launch-bound (a small model on a GPU: docs/benchmarks.md, "GPU") its host time
is these operators, whatever their arithmetic, so this count is what a method adds there. It is
the same on any device: this runs on the CPU in seconds, on ``random:smollm2-135m`` (the default
model's architecture, random weights) unless told otherwise. The selections' descending sort is
counted as CUDA runs it (torch's sort; on the CPU rankkit sorts in numpy, outside the count).

    python3 tools/launches.py [--model SPEC] [--length N] [--keep K] [METHOD ...]   # default: every method
"""

from __future__ import annotations

import argparse
import warnings

import torch

from rankkit import models
from rankkit.measure import launches_of
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
    args = parser.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random weights: timing only, which a count is
        loaded = models.load(args.model, device="cpu", dtype=torch.float32)
    with torch.inference_mode(), sorting_as_on_cuda():
        count(Runner(loaded.model), loaded.tokenizer, args)


def count(runner: Runner, tokenizer, args) -> None:
    """Print each method's operators beyond full's prefill, and a capture's."""
    ids = torch.randint(0, runner.config.vocab_size, (args.length,), generator=torch.Generator().manual_seed(0))
    full = launches_of(lambda: runner.prefill(ids))
    print(f"{args.model}, {runner.num_layers} layers, {args.length} tokens, keep {args.keep}")
    print(f"{'full':14s} {full:6d} operators per prefill ({full / runner.num_layers:.1f} per layer)")
    for name in args.methods:
        method = make(name)
        method.prepare(runner, ids, tokenizer=tokenizer)
        launched = launches_of(lambda method=method: method.prefill(runner, ids, Budget.from_keep(args.keep)))
        extra = launched - full
        print(f"{name:14s} {launched:6d}  beyond full {extra:6d} ({extra / runner.num_layers:.1f} per layer)")

    def capture() -> None:
        recorder = ProbeRecorder(parse_probes("all"))
        runner.prefill(ids, hooks=[recorder])
        recorder.scores()

    extra = launches_of(capture) - full
    print(f"{'capture, all':14s} beyond the runner's {extra:6d} ({extra / runner.num_layers:.1f} per layer)")


if __name__ == "__main__":
    main()
