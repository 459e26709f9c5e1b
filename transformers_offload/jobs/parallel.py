"""Data parallel recording: which rank of how many processes this one is, and which samples are its own.

Under `torchrun --nproc_per_node N` or `accelerate launch`, every process runs the same `record()`
over the same prompts; each records only its share, a contiguous block of the prompts in file order,
into its own sub-directory of the output (`rank-0`, `rank-1`...), which `open_recording` reads back as
one recording. A share depends only on the number of prompts, the rank and the world size, never on
what is already recorded, so processes that start at different times, or a rerun with another world
size, still give every prompt to exactly one rank.
"""

from __future__ import annotations

import os


def process_rank(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """This process's `(rank, world_size)`.

    Taken from the arguments when given; else from `torch.distributed` once its process group is
    initialised (`accelerate`'s `PartialState()` does that); else from the `RANK` and `WORLD_SIZE`
    environment variables that `torchrun` and `accelerate launch` set; else `(0, 1)`.

    Raises:
        ValueError: only one of `rank` / `world_size` given, a non-integer, `world_size < 1`, or a rank
            outside `0..world_size - 1` (from the arguments or the environment).
    """
    if (rank is None) != (world_size is None):
        raise ValueError("give both `rank` and `world_size`, or neither (they are then found from torchrun's "
                         "environment or torch.distributed).")
    where = "the arguments"
    if rank is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world_size, where = dist.get_rank(), dist.get_world_size(), "torch.distributed"
        elif "WORLD_SIZE" in os.environ or "RANK" in os.environ:
            where = "the environment (RANK, WORLD_SIZE)"
            try:
                rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
            except ValueError:
                raise ValueError(f"RANK={os.environ.get('RANK')!r} and WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} "
                                 "must be integers (as torchrun sets them).") from None
        else:
            return 0, 1
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"`{name}` must be an int, got {value!r}.")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world size {world_size} (from {where}): the rank must be in "
                         f"0..{world_size - 1} and the world size at least 1.")
    return rank, world_size


def share(count: int, rank: int, world_size: int) -> range:
    """The positions of the `count` prompts that `rank` records: a contiguous block; the blocks of all
    ranks cover `range(count)` once, their sizes differ by at most one, whatever `world_size` divides
    (a rank may get none). No prompt is repeated to even them out."""
    return range(rank * count // world_size, (rank + 1) * count // world_size)


def wait_for_every_rank() -> None:
    """`torch.distributed.barrier()` when a process group is initialised, so that no rank reads the
    whole recording before the others have finished; nothing otherwise."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
