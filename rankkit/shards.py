"""Work shared by the processes of a ``torchrun`` launch (one or several nodes).

``torchrun`` sets RANK and WORLD_SIZE in every process it starts. A process takes every
WORLD_SIZE-th example from its RANK on (``share``), so the shares are even and every rank
knows its own without talking to the others; ``interleave`` puts shares back in the
original order. Ranks meet at a barrier (``wait_for_other_ranks``) over gloo on CPU or
NCCL on CUDA.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TypeVar

Item = TypeVar("Item")
BARRIER_TIMEOUT = timedelta(hours=24)


def shard() -> tuple[int, int]:
    """(rank, world size) under torchrun / accelerate launch, else (0, 1)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def rank_device(device: str) -> str:
    """The device this rank runs on: with several ranks on a CUDA machine, "auto" picks the rank's
    own GPU (LOCAL_RANK) instead of every rank crowding the first."""
    import torch

    rank, world = shard()
    if world > 1 and device == "auto" and torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
    return device


def share(items: Sequence[Item], rank: int, world: int) -> list[Item]:
    """The items rank ``rank`` of ``world`` takes: every ``world``-th from index ``rank`` on."""
    return list(items[rank::world])


def share_size(count: int, rank: int, world: int) -> int:
    """How many of ``count`` items ``share`` gives rank ``rank``."""
    return len(range(rank, count, world))


def interleave(shares: Sequence[Sequence[Item]]) -> list[Item]:
    """The items in their original order, from every rank's ``share`` (rank 0's first)."""
    merged = []
    for index in range(max((len(each) for each in shares), default=0)):
        merged += [each[index] for each in shares if index < len(each)]
    return merged


def _backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def wait_for_other_ranks(world: int) -> None:
    """Under torchrun, return only when every rank has got here.

    Inside ``process_group`` the group stays open for later barriers; otherwise one is
    opened for this barrier and closed after it.
    """
    if world == 1:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        return
    dist.init_process_group(_backend())
    dist.barrier()
    dist.destroy_process_group()


@contextmanager
def process_group(world: int) -> Iterator[None]:
    """Keep one process group open while the block runs, for several ``wait_for_other_ranks``."""
    if world == 1:
        yield
        return
    import torch.distributed as dist

    # A rank with a small share (or none) of a stage waits at the next barrier for the slowest,
    # which may take hours; the default 30 minutes would end the run.
    dist.init_process_group(_backend(), timeout=BARRIER_TIMEOUT)
    try:
        yield
    finally:
        dist.destroy_process_group()
