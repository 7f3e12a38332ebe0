"""What the CPU peak-memory tracker costs the run it watches: every CPU bench's first warm-up per
method and prompt runs under ``TensorMemoryTracker``, so its cost is paid once per grid cell.

Greedy generation of ``--new-tokens`` tokens after a random ``--length``-token prompt on the default
model, untracked and tracked in interleaved rounds (``counterbalanced``); prints the median times,
the median of the rounds' paired ratios (``paired_ratios``, as every rankkit ratio) and the peak.
Usage: ``python tools/tracker_cost.py [--length 1024] [--new-tokens 16] [--rounds 4]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rankkit import models
from rankkit.measure import TensorMemoryTracker, counterbalanced, hold_freed_memory, paired_ratios
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

    def generate() -> None:
        with torch.inference_mode():
            runner.generate(ids, arguments.new_tokens)

    generate()  # warm-up, excluded
    seconds: dict[str, list[float]] = {"untracked": [], "tracked": []}
    for round_index in range(arguments.rounds):
        for side in counterbalanced(list(seconds), round_index):
            started = time.perf_counter()
            if side == "tracked":
                with TensorMemoryTracker() as tracker:
                    generate()
            else:
                generate()
            seconds[side].append(time.perf_counter() - started)
    untracked, tracked = (statistics.median(times) for times in seconds.values())
    ratio = statistics.median(paired_ratios(seconds["tracked"], seconds["untracked"]))
    print(f"untracked {untracked:.3f} s, tracked {tracked:.3f} s: {ratio:.3f}x; peak {tracker.peak} bytes")


if __name__ == "__main__":
    main()
