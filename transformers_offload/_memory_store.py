"""The in-memory store: keeps each drained step as plain CPU tensors, per stream."""

from __future__ import annotations

from typing import Any

import torch

from .recording import Generation, MemorySource, TransferStats


class MemoryStore:
    """Per-stream, per-step CPU tensors of one generation, in step order."""

    failure = None  # nothing to fail: the store never writes

    def __init__(self, names: list[str]) -> None:
        self._names = list(names)
        self._once: set[str] = set()
        self._steps: dict[str, dict[int, torch.Tensor]] = {}

    def add_streams(self, names: list[str], once: list[str], layers: dict[str, Any]) -> None:
        """More streams, before the first drain: per-step `names`, and `once` (recorded at step 0 only,
        the encoder's outputs). `layers` (the selection) reaches the `Generation` through the header."""
        self._names += names
        self._once.update(once)

    def drain(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keep a copy of `tensors` (host slot buffers that the ring reuses) for `step`."""
        for name, tensor in tensors.items():
            # The last write of a step wins: a step recorded twice keeps its final value.
            # Plain pageable memory: a clone of a pinned slot could stay pinned.
            kept = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)
            self._steps.setdefault(name, {})[step] = kept

    def has(self, name: str, step: int) -> bool:
        """Whether `step` of stream `name` reached the store."""
        return step in self._steps.get(name, {})

    def finish(self, num_steps: int, header: dict[str, Any], sequences: torch.Tensor | None,
               error: BaseException | None, *, ring_waits: int) -> Generation:
        """The first `num_steps` steps as a `Generation` (later steps are dropped)."""
        streams = {
            name: tuple(self._steps.get(name, {})[t] for t in range(num_steps)) for name in self._names
        }
        once = {name: self._steps[name][0] for name in self._once if 0 in self._steps.get(name, {})}
        self._steps.clear()
        return Generation(
            **header,
            num_steps=num_steps,
            complete=error is None,
            error=None if error is None else repr(error),
            sequences=sequences,
            stats=TransferStats(waits=ring_waits, bytes_written=0, write_seconds=0.0),
            _source=MemorySource(streams, once),
        )
