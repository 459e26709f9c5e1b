"""The in-memory store: keeps each drained step as plain CPU tensors, per stream.

A step's tensors are not allocated one by one: each stream packs its steps back to back into large
flat CPU chunks (`_Chunks`), and a step is a view of its chunk. One allocation per step, interleaved
with the model's own (a growing KV cache reallocated every step), pins the allocator's heap:
`tests/scripts/memory_store_next_to_a_growing_cache.py 1024` (1,024 steps of `(1, 1000)` logits and
scores next to a 30-layer cache grown by `torch.cat`) grew the resident set by 1,562 MiB for 31 MiB
kept that way, and by 62 MiB with chunks. Chunks grow by doubling from `CHUNK_BYTES_MIN` up
to `CHUNK_BYTES_MAX` (or one step, if larger), so a stream makes a handful of allocations however
long the call runs, and the pages of a chunk not yet written are not resident.
"""

from __future__ import annotations

from typing import Any

import torch

from .recording import Generation, MemorySource, TransferStats

CHUNK_BYTES_MIN = 64 * 2**10
CHUNK_BYTES_MAX = 64 * 2**20


class _Chunks:
    """One stream's steps, packed into flat CPU chunks (pageable memory) in the order they come."""

    def __init__(self) -> None:
        self._chunk: torch.Tensor | None = None
        self._used = 0  # elements of `_chunk` taken

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of `tensor` (any shape, CPU), as a view of the current chunk (or of a new one)."""
        size = tensor.numel()
        chunk = self._chunk
        if chunk is None or chunk.dtype != tensor.dtype or chunk.numel() - self._used < size:
            grown = 0 if chunk is None else 2 * chunk.numel() * chunk.element_size()
            target = min(CHUNK_BYTES_MAX, max(CHUNK_BYTES_MIN, grown))
            chunk = self._chunk = torch.empty(max(size, target // tensor.element_size()), dtype=tensor.dtype)
            self._used = 0
        kept = chunk[self._used : self._used + size].view(tensor.shape)
        self._used += size
        return kept.copy_(tensor)

    def trim(self, steps: dict[int, torch.Tensor]) -> None:
        """Move the steps of the last chunk into one of their exact size (the rest of that chunk, up to
        `CHUNK_BYTES_MAX`, would otherwise go along with them into `torch.save` or `pickle`)."""
        chunk, self._chunk = self._chunk, None
        if chunk is None or self._used == chunk.numel():
            return
        exact = chunk[: self._used].clone()
        pointer = chunk.untyped_storage().data_ptr()
        for step, tensor in steps.items():
            if tensor.untyped_storage().data_ptr() == pointer:
                start = tensor.storage_offset()
                steps[step] = exact[start : start + tensor.numel()].view(tensor.shape)


class MemoryStore:
    """Per-stream, per-step CPU tensors of one generation, in step order."""

    failure = None  # nothing to fail: the store never writes

    def __init__(self, names: list[str]) -> None:
        self._names = list(names)
        self._once: set[str] = set()
        self._steps: dict[str, dict[int, torch.Tensor]] = {}
        self._chunks: dict[str, _Chunks] = {}

    def add_streams(self, names: list[str], once: list[str], layers: dict[str, Any]) -> None:
        """More streams, before the first drain: per-step `names`, and `once` (recorded at step 0 only,
        the encoder's outputs). `layers` (the selection) reaches the `Generation` through the header."""
        self._names += names
        self._once.update(once)

    def drain(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keep a copy of `tensors` (host slot buffers that the ring reuses) for `step`."""
        for name, tensor in tensors.items():
            steps = self._steps.setdefault(name, {})
            # The last write of a step wins: a step recorded twice keeps its final value, in place
            # when its shape is unchanged (assisted decoding rewrites rejected positions).
            earlier = steps.get(step)
            if earlier is not None and earlier.shape == tensor.shape and earlier.dtype == tensor.dtype:
                earlier.copy_(tensor)
                continue
            # Pageable memory, never a clone of the slot (a clone of a pinned slot could stay pinned).
            steps[step] = self._chunks.setdefault(name, _Chunks()).keep(tensor)

    def has(self, name: str, step: int) -> bool:
        """Whether `step` of stream `name` reached the store."""
        return step in self._steps.get(name, {})

    def finish(self, num_steps: int, header: dict[str, Any], sequences: torch.Tensor | None,
               error: BaseException | None, *, ring_waits: int) -> Generation:
        """The first `num_steps` steps as a `Generation` (later steps are dropped)."""
        for name, chunks in self._chunks.items():
            chunks.trim(self._steps[name])
        streams = {
            name: tuple(self._steps.get(name, {})[t] for t in range(num_steps)) for name in self._names
        }
        once = {name: self._steps[name][0] for name in self._once if 0 in self._steps.get(name, {})}
        self._steps.clear()
        self._chunks.clear()
        return Generation(
            **header,
            num_steps=num_steps,
            complete=error is None,
            error=None if error is None else repr(error),
            sequences=sequences,
            stats=TransferStats(waits=ring_waits, bytes_written=0, write_seconds=0.0),
            _source=MemorySource(streams, once),
        )
