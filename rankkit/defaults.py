"""Defaults that the library and the command line share, each defined here once.

The module imports nothing heavy, so ``rankkit --help`` shows them without loading torch.
"""

import os

MODEL = "default"  # the embedded SmolLM2-135M-Instruct
DEVICE = "auto"
MAX_NEW_TOKENS = 32  # greedy answer length limit of prefill, bench and the oracle
ORACLE_ANSWER = "generated"
ORACLE_KERNEL = 7  # CLAA Alg. 1's 1-D average pooling
WARMUP = 0  # untimed runs before the timed ones: accuracy-only runs need none; timing runs ask for them
REPEATS = 1
OVERHEAD_REPEATS = 6  # the fewest interleaved repeats that give a median ratio a 95% interval
ORACLE_MIRROR = "fastkv"
CAPTURE_DATA = "niah:n=8,length=2048"
CAPTURE_OUT = "runs/capture.zarr"
VARIANCE_METHOD = "asl"
VARIANCE_THRESHOLDS = (0.2, 0.3, 0.4, 0.5, 0.6)  # ASL Sec. 5.5 sweeps tau over these; 0.3 is its default
SCORE_DTYPE = "float32"  # capture --score-dtype; float16 halves a store
KEEP = 0.1  # the keep rate compare, variance and a sweep rank under where no --keep or --budget is given


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity, where the system has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
