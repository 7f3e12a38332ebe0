"""A plain eager decode step's host time against transformers' own step, on a model whose arithmetic
is negligible: what an 8B model's eager decode step on a GPU is made of, measured on a CPU.

On a GPU an 8B model's eager step is host-bound: the host dispatching each layer's operators takes
longer than the device running them (docs/benchmarks.md, "GPU"). Here the same dispatches are timed
on Llama's architecture at 32 layers of width 64 (random weights), where each operator's arithmetic
is a few hundred multiply-adds. Each round prefills the prompt in both, then alternates one step of
rankkit's runner with one of ``model(...)`` over transformers' DynamicCache, so drift in the host's
speed reaches both alike; a round's ratio is the ratio of its two medians. Also printed: the operators
each step dispatches a layer, views included (each one costs the host its dispatch).

    python3 tools/decode_host_time.py [--layers 32] [--prompt 512] [--steps 100] [--rounds 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rankkit.eval.stats import median_interval
from rankkit.overhead import plain_decodes, step_dispatches
from rankkit.runner import Runner


def narrow_model(layers: int):
    config = AutoConfig.for_model(
        "llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def one_round(runner: Runner, prompt: torch.Tensor, steps: int) -> tuple[list[float], list[float]]:
    """Seconds of each of ``steps`` decode steps, rankkit's and transformers', alternating."""
    decodes = plain_decodes(runner, prompt, steps)
    theirs = ours = decodes.first_token
    rankkit, transformers = [], []
    for position in range(len(prompt), len(prompt) + steps):
        start = time.perf_counter()
        ours = torch.argmax(decodes.ours(ours, position))
        middle = time.perf_counter()
        theirs = torch.argmax(decodes.theirs(theirs))
        rankkit.append(middle - start)
        transformers.append(time.perf_counter() - middle)
    return rankkit, transformers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the host's dispatching, not the arithmetic spread over threads
    runner = Runner(narrow_model(args.layers))
    prompt = torch.randint(0, 256, (args.prompt,), generator=torch.Generator().manual_seed(0))
    ratios, rankkit_medians, transformers_medians = [], [], []
    with torch.inference_mode():
        one_round(runner, prompt, 5)  # warm-up
        for _ in range(args.rounds):
            rankkit, transformers = one_round(runner, prompt, args.steps)
            rankkit_medians.append(statistics.median(rankkit))
            transformers_medians.append(statistics.median(transformers))
            ratios.append(rankkit_medians[-1] / transformers_medians[-1])
        ours, theirs = step_dispatches(runner, prompt)
    low, high = median_interval(ratios)
    interval = f" [{low:.3f}, {high:.3f}]" if low is not None else ""
    print(f"Llama, {args.layers} layers of width 64, {args.prompt}-token prompt, {args.rounds} rounds of {args.steps} steps")
    print(f"rankkit's step {statistics.median(rankkit_medians) * 1e3:.3f} ms, transformers' {statistics.median(transformers_medians) * 1e3:.3f} ms")
    print(f"ratio {statistics.median(ratios):.4f}{interval} (median of the rounds' ratios, 95% interval)")
    print(f"operators a step dispatches, views included: rankkit {ours} ({ours / args.layers:.1f} a layer), transformers {theirs} ({theirs / args.layers:.1f} a layer)")


if __name__ == "__main__":
    main()
