"""The in-memory store: keeps each drained step as plain CPU tensors, per stream.

A step's tensors are not allocated one by one: each stream packs its steps back to back into large
CPU chunks (`_Chunks`). One allocation per step, interleaved with the model's own (a growing KV cache
reallocated every step), pins the allocator's heap:
`tests/scripts/memory_store_next_to_a_growing_cache.py 1024` (1,024 steps of `(1, 1000)` logits and
scores next to a 30-layer cache grown by `torch.cat`) grew the resident set by 1,562 MiB for 31 MiB
kept that way, and by 62-78 MiB with chunks (runs differ). Chunks grow by doubling from
`CHUNK_BYTES_MIN` up to `CHUNK_BYTES_MAX` (in whole steps: a stream whose steps keep their size
leaves no unused tail), so a stream makes a handful of allocations however long the call runs, and
the pages of a chunk not yet written are not resident.

While the call runs, a step is a view of its chunk. A reader gets each step as a tensor of its own
storage, exactly its bytes, over the same memory (`torch.frombuffer`), made the first time the step is
read: `pickle`, `torch.save` and `copy.deepcopy` then write that step's bytes and nothing else of its
chunk (a view would carry the whole chunk, once per step with `pickle`). A chunk lives as long as any
of its steps. (The steps are not made so while the call runs: the small objects each one needs, made
between the KV cache's reallocations, pinned the heap again: 2.2 GB resident in the same script; nor
when the call ends, where they cost about 40 us a step and stream inside `generate()`.)

On CPU the ring hands each tensor to `keep` as it is put (one copy, straight into its chunk); on CUDA
the drainer hands over a step's host slot to `drain`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..codecs.spec import SAME_AS_LOGITS
from .header import GenerationHeader
from .stored import StoredGeneration, TransferStats

CHUNK_BYTES_MIN = 64 * 2**10
CHUNK_BYTES_MAX = 64 * 2**20
ALIGNMENT = 64  # bytes: where each step starts in its chunk


class _Chunks:
    """One stream's steps, packed into CPU chunks (pageable memory) in the order they come."""

    def __init__(self) -> None:
        self._chunk: torch.Tensor | None = None  # flat, in the stream's dtype
        self._used = 0  # elements of `_chunk` taken
        self.arrays: dict[int, Any] = {}  # every chunk's bytes as a NumPy array, by the chunk's address

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of `tensor` (any shape and dtype, CPU), as a view of the current chunk (or of a new one)."""
        size = tensor.numel()
        if size == 0:
            return torch.empty(tensor.shape, dtype=tensor.dtype)
        itemsize = tensor.element_size()
        room = -(-size * itemsize // ALIGNMENT) * ALIGNMENT // itemsize  # elements, so the next step is aligned
        chunk = self._chunk
        if chunk is None or chunk.dtype != tensor.dtype or chunk.numel() - self._used < size:
            grown = 0 if chunk is None else 2 * chunk.numel() * chunk.element_size()
            target = min(CHUNK_BYTES_MAX, max(CHUNK_BYTES_MIN, grown))
            chunk = self._chunk = torch.empty(max(1, target // (room * itemsize)) * room, dtype=tensor.dtype)
            self.arrays[chunk.data_ptr()] = chunk.view(torch.uint8).numpy()
            self._used = 0
        kept = chunk.as_strided(tensor.shape, _contiguous_strides(tensor.shape), self._used)
        self._used += room
        return kept.copy_(tensor)

    def own_storage(self, kept: torch.Tensor) -> torch.Tensor:
        """`kept` (what `keep` returned) as a tensor whose storage is exactly its bytes, same memory."""
        array = self.arrays.get(kept.untyped_storage().data_ptr())
        if array is None:
            return kept  # an empty step: its own tensor already
        start = kept.storage_offset() * kept.element_size()
        view = array[start : start + kept.numel() * kept.element_size()]
        return torch.frombuffer(view, dtype=kept.dtype).view(kept.shape)


class MemoryStore:
    """Per-stream, per-step CPU tensors of one generation, in step order."""

    failure = None  # nothing to fail: the store never writes

    def __init__(self, names: list[str]) -> None:
        self._names = list(names)
        self._once: set[str] = set()
        self._steps: dict[str, dict[int, torch.Tensor]] = {}
        self._chunks: dict[str, _Chunks] = {}

    def add_once(self, once: list[str]) -> None:
        """More streams recorded at step 0 only (prompt logprobs)."""
        self._once.update(once)

    def add_streams(self, names: list[str], once: list[str], layers: dict[str, Any]) -> None:
        """More streams, before the first drain: per-step `names`, and `once` (recorded at step 0 only,
        the encoder's outputs). `layers` (the selection) reaches the `Generation` through the header."""
        self._names += names
        self._once.update(once)

    def drain(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keep a copy of `tensors` (host slot buffers that the ring reuses) for `step`."""
        for name, tensor in tensors.items():
            self.keep(step, name, tensor)

    def keep(self, step: int, name: str, tensor: torch.Tensor) -> None:
        """Keep a copy of `tensor` (CPU, any shape and dtype) as `step` of stream `name`, at once."""
        steps = self._steps.get(name)
        if steps is None:
            steps = self._steps[name] = {}
        # The last write of a step wins: a step recorded twice keeps its final value, in place
        # when its shape is unchanged (assisted decoding rewrites rejected positions).
        earlier = steps.get(step)
        if earlier is not None and earlier.shape == tensor.shape and earlier.dtype == tensor.dtype:
            earlier.copy_(tensor)
            return
        # Pageable memory, never a clone of the slot (a clone of a pinned slot could stay pinned).
        chunks = self._chunks.get(name)
        if chunks is None:
            chunks = self._chunks[name] = _Chunks()
        steps[step] = chunks.keep(tensor)

    def has(self, name: str, step: int) -> bool:
        """Whether `step` of stream `name` reached the store."""
        return step in self._steps.get(name, {})

    def finish(self, num_steps: int, header: GenerationHeader, sequences: torch.Tensor | None,
               error: BaseException | None, *, ring_waits: int) -> StoredGeneration:
        """The first `num_steps` steps, for a `Generation` (later steps are dropped)."""
        streams = {name: _Steps([self._steps[name][t] for t in range(num_steps)], self._chunks.get(name))
                   for name in self._names}
        if header.encodings.get("scores") == SAME_AS_LOGITS:  # the very logits: the same tensors
            streams = {key: value for name, steps in streams.items()
                       for key, value in ((name, steps), *((("scores", steps),) if name == "logits" else ()))}
        once = {name: self._chunks[name].own_storage(self._steps[name][0])
                for name in self._once if 0 in self._steps.get(name, {})}
        self._steps = {}
        self._chunks = {}
        return StoredGeneration(
            header=header,
            num_steps=num_steps,
            complete=error is None,
            error=None if error is None else repr(error),
            sequences=sequences,
            transfer=TransferStats(waits=ring_waits, bytes_written=0, write_seconds=0.0),
            source=MemorySource(streams, once),
        )


class _Steps:
    """One stream's steps, as views of their chunks; step `t` is made a tensor of its own storage
    (`_Chunks.own_storage`) the first time it is read, and kept so."""

    def __init__(self, kept: list[torch.Tensor], chunks: _Chunks | None) -> None:
        self._kept = kept
        self._chunks = chunks
        self._own = [False] * len(kept)

    def __len__(self) -> int:
        return len(self._kept)

    def __getitem__(self, step: int) -> torch.Tensor:
        if not self._own[step]:
            if self._chunks is not None:
                self._kept[step] = self._chunks.own_storage(self._kept[step])
            self._own[step] = True
        return self._kept[step]


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape` (as `torch.empty(shape).stride()`)."""
    strides, size = [], 1
    for dim in reversed(shape):
        strides.append(size)
        size *= max(dim, 1)
    return tuple(reversed(strides))


class MemorySource:
    """Per-step CPU tensors held in memory."""

    def __init__(self, streams: dict[str, Any], once: dict[str, torch.Tensor] | None = None) -> None:
        self._streams = streams
        self._once = once or {}
        self.streams = tuple(streams)
        self.once_streams = tuple(self._once)

    def read_once(self, name: str) -> torch.Tensor:
        return self._once[name]

    def read(self, name: str, steps: range, rows: Any, *, numpy: bool = False) -> tuple[torch.Tensor, ...]:
        """Steps `steps` of stream `name`, each indexed by `rows`: tensors (held in memory, whatever `numpy` asks)."""
        stored = self._streams[name]
        if rows is None:
            return tuple(stored[t] for t in steps)
        return tuple(stored[t][rows] for t in steps)
