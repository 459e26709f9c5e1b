"""What a store hands back when a generation ends, as plain data: its header, how it ended, and the
source its steps are read from. The stores never build a `Generation` themselves (`read.generation`
does, from this), so imports run one way: `read` uses `store`, not the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from .._lazy import torch  # imported when first used: reading a manifest needs no torch (`inspect`, `verify`)
from .header import GenerationHeader


class StepSource(Protocol):
    """Where a generation's per-step tensors are read from."""

    streams: tuple[str, ...]
    once_streams: tuple[str, ...]  # recorded once per generation (an encoder's outputs)

    def read(self, name: str, steps: range, rows: Any, *, numpy: bool = False) -> tuple[Any, ...]:
        """Steps `steps` of stream `name`, each indexed by `rows` (None: every row, else an int, a slice or
        an int64 NumPy array): tensors, or with `numpy`, where the source can, NumPy arrays."""
        ...

    def read_once(self, name: str) -> torch.Tensor:
        """Once-per-generation stream `name` (mapped from disk: indexing it reads only what it picks)."""
        ...


@dataclass(frozen=True)
class TransferStats:
    """How one recorded call moved its data, measured in this process.

    Attributes:
        waits (`int`): times the transfer had to wait: `generate()` for a ring slot still being
            copied or drained, or (with `spill_dir`) the drain for a shard buffer the writer still held.
        bytes_written (`int`): bytes of shard files written (0 without `spill_dir`).
        write_seconds (`float`): seconds the writer thread spent writing, fsyncing and renaming shards
            and rewriting the manifest.
    """

    waits: int
    bytes_written: int
    write_seconds: float


@dataclass(frozen=True)
class StoredGeneration:
    """One generation as a store holds it.

    Attributes:
        header (`GenerationHeader`): what the call was.
        num_steps (`int`): the steps recorded.
        complete (`bool`), error (`str | None`): whether the call ended normally; else why not.
        sequences: what `generate()` returned (a CPU tensor), None, or a function that reads it from disk.
        transfer (`TransferStats | None`): how the recording process moved the data; None when read back.
        source (`StepSource`): where its per-step tensors are read from.
    """

    header: GenerationHeader
    num_steps: int
    complete: bool
    error: str | None
    sequences: Any
    transfer: TransferStats | None
    source: StepSource
