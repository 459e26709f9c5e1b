"""The host buffers a shard is packed in before it is written: the steps of one shard, per stream."""

from __future__ import annotations

import torch


class ShardBuffer:
    """Host tensors for the steps `[first_step, first_step + capacity)`: `(capacity, *shape)` per dense
    stream; per ragged stream, a flat buffer of the steps' values in step order and their shapes; per
    sparse stream, each step's record (a step written again replaces its record)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.flat: dict[str, torch.Tensor] = {}  # ragged streams, kept (and grown) across shards
        self.used: dict[str, int] = {}
        self.shapes: dict[str, list[tuple[int, ...]]] = {}
        self.records: dict[str, dict[int, torch.Tensor]] = {}  # sparse streams: step -> its flat record
        self.index = 0
        self.first_step = 0
        self.capacity = 0
        self.filled: dict[str, set[int]] = {}

    def reset(self, index: int, capacity: int) -> None:
        self.index = index
        self.capacity = capacity
        self.first_step = index * capacity
        self.filled = {}
        self.used = {}
        self.shapes = {}
        self.records = {}

    def put_ragged(self, name: str, step: int, tensor: torch.Tensor, size_hint: int) -> None:
        """Append `step` (the next one of this shard) of ragged stream `name`; `size_hint`: the values
        a shard is expected to hold, to allocate the flat buffer once."""
        shapes = self.shapes.setdefault(name, [])
        used, size = self.used.get(name, 0), tensor.numel()
        flat = self.flat.get(name)
        if step != self.first_step + len(shapes) or (used and flat.dtype != tensor.dtype):
            raise RuntimeError(
                f"transformers-offload: step {step} of stream {name!r} arrived out of order or in another "
                "dtype; please report this with your transformers version."
            )
        if flat is None or flat.dtype != tensor.dtype or flat.numel() < used + size:
            grown = torch.empty(max(used + size, size_hint, 0 if flat is None else 2 * flat.numel()), dtype=tensor.dtype)
            if used:
                grown[:used].copy_(flat[:used])
            flat = self.flat[name] = grown
        flat[used : used + size].copy_(tensor.reshape(-1))
        self.used[name] = used + size
        shapes.append(tuple(tensor.shape))
        self.filled.setdefault(name, set()).add(step)

    def ragged(self, name: str, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `count` steps of ragged stream `name`: flat values and `(count, ndim)` int64 shapes."""
        shapes = torch.tensor(self.shapes.get(name, [])[:count], dtype=torch.int64)
        return self.flat[name][: int(shapes.prod(dim=1).sum())], shapes

    def put_record(self, name: str, step: int, tensor: torch.Tensor) -> None:
        """Keep a copy of `step`'s flat record of sparse stream `name` (the last write of a step wins:
        assisted decoding rewrites rejected positions)."""
        self.records.setdefault(name, {})[step] = tensor.clone()
        self.filled.setdefault(name, set()).add(step)

    def records_of(self, name: str, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `count` steps of sparse stream `name`: their records concatenated and `(count, 1)`
        int64 lengths (the layout of a ragged stream)."""
        records = [self.records[name][self.first_step + t] for t in range(count)]
        lengths = torch.tensor([[record.numel()] for record in records], dtype=torch.int64).reshape(count, 1)
        return torch.cat(records) if records else torch.zeros(0, dtype=torch.int32), lengths

    def put(self, name: str, step: int, tensor: torch.Tensor) -> None:
        buffer = self.tensors.get(name)
        if buffer is None or buffer.shape[1:] != tensor.shape or buffer.dtype != tensor.dtype:
            if self.filled.get(name):
                raise RuntimeError(
                    f"transformers-offload: stream {name!r} changed shape or dtype within a shard "
                    f"(now {tuple(tensor.shape)} {tensor.dtype}); please report this."
                )
            buffer = torch.empty((self.capacity, *tensor.shape), dtype=tensor.dtype)
            self.tensors[name] = buffer
        buffer[step - self.first_step].copy_(tensor)
        self.filled.setdefault(name, set()).add(step)

    def full(self, names: list[str]) -> bool:
        return all(len(self.filled.get(name, ())) == self.capacity for name in names)
