"""What the CPU peak-memory tracker costs the run it watches: every CPU bench's first warm-up per
method and prompt runs under ``TensorMemoryTracker``, so its cost is paid once per grid cell.

Greedy generation of ``--new-tokens`` tokens after a random ``--length``-token prompt on the default
model, untracked and tracked in interleaved rounds (``overhead.interleaved_times``); prints the median times,
the median of the rounds' paired ratios (``paired_ratios``, as every rankkit ratio) and the peak.
Usage: ``python tools/tracker_cost.py [--length 1024] [--new-tokens 16] [--rounds 4]``.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from rankkit import models
from rankkit.measure import TensorMemoryTracker, hold_freed_memory, paired_ratios
from rankkit.overhead import Sides, interleaved_times
from rankkit.runner import Runner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    arguments = parser.parse_args()
    hold_freed_memory()
    runner = Runner(models.load("default", device="cpu").model)
    ids = torch.randint(0, 1000, (arguments.length,), generator=torch.Generator().manual_seed(0))

    peaks = []

    def generate() -> None:
        runner.generate(ids, arguments.new_tokens)

    def tracked() -> None:
        with TensorMemoryTracker() as tracker:
            generate()
        peaks.append(tracker.peak)

    # the untracked run is the baseline side, the tracked one the side measured against it
    seconds = interleaved_times(Sides(baseline=generate, rankkit=tracked), torch.device("cpu"), arguments.rounds, lambda: None)
    untracked, with_tracker = (statistics.median(seconds[side]) for side in ("baseline", "rankkit"))
    ratio = statistics.median(paired_ratios(seconds["rankkit"], seconds["baseline"]))
    print(f"untracked {untracked:.3f} s, tracked {with_tracker:.3f} s: {ratio:.3f}x; peak {peaks[-1]} bytes")


if __name__ == "__main__":
    main()
