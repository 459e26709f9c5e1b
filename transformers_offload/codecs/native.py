"""The `"native"` encoding (lossless): float32 logits or scores of a bfloat16/float16 model stored in the
model's dtype where every value converts back bit for bit. Encoded inside the step (`Native`), decoded from
its flat int32 record (`NativeRecord`)."""

from __future__ import annotations

from typing import Callable, Sequence

from .._lazy import torch
from .sparse import SPARSE_DTYPES, SPARSE_MAX_VOCAB
from .workspace import ChunkBuffers

NATIVE_HEADER = 4


class NativeRecord:
    """One step's native record, parsed and checked (nothing decoded yet).

    Raises:
        ValueError: the record is not a consistent native record (damaged data).
    """

    def __init__(self, record: torch.Tensor) -> None:
        if record.dtype != torch.int32 or record.dim() != 1 or record.numel() < NATIVE_HEADER:
            raise ValueError(f"a native record is a flat int32 tensor of at least {NATIVE_HEADER} values, got "
                             f"{list(record.shape)} {record.dtype}")
        rows, vocab, dense_code, stored_code = (int(v) for v in record[:NATIVE_HEADER])
        codes = range(len(SPARSE_DTYPES))
        if rows < 0 or not 1 <= vocab <= SPARSE_MAX_VOCAB or dense_code not in codes or stored_code not in codes:
            raise ValueError(f"a native record's header [{rows}, {vocab}, {dense_code}, {stored_code}] is not valid")
        self.rows, self.vocab = rows, vocab
        self.dtype, self.stored = SPARSE_DTYPES[dense_code], SPARSE_DTYPES[stored_code]
        words = (rows * vocab * self.stored.itemsize + 3) // 4
        self._payload = record[NATIVE_HEADER:]
        if self._payload.numel() != words:
            raise ValueError(f"a native record of {rows * vocab} {self.stored} values holds "
                             f"{self._payload.numel()} words, not {words}")

    def dense(self, rows: Sequence[int] | None = None) -> torch.Tensor:
        """Rows `rows` (default all) as the dense `(len(rows), vocab)` tensor in the recorded dtype, bit
        for bit what was recorded."""
        count = self.rows * self.vocab
        halves = self._payload.view(torch.int16 if self.stored.itemsize == 2 else self.stored)
        values = (halves[:count].view(self.stored) if self.stored.itemsize == 2 else halves).reshape(self.rows, self.vocab)
        if rows is not None and list(rows) != list(range(self.rows)):  # every row in order: no gather
            return values[list(rows)].to(self.dtype)  # indexing copies
        return values.to(self.dtype) if self.stored != self.dtype else values.clone()  # not a view of the record


def native_dense(record: torch.Tensor, rows: Sequence[int] | None = None) -> torch.Tensor:
    """One step's native record decoded (`NativeRecord(record).dense(rows)`).

    Raises:
        ValueError: the record is not a consistent native record (damaged data).
    """
    return NativeRecord(record).dense(rows)


class Native:
    """The native encoding (lossless): a step of float32 logits or scores of a bfloat16/float16 model
    (transformers upcasts them from 4.45) stored in the model's dtype when every value converts back
    bit for bit, else as it is (`NativeRecord` describes the record; a step already in the model's
    dtype, or a float32 model's, is stored as it is).

    On CUDA, `on_device` runs on the side stream over the step's staging copy and gives a flat int16
    tensor, `[all values round-trip (0/1), the model-dtype values' bits...]`; `on_host`, once that is on
    the host (in the drainer thread), packs the record, fetching the step whole from the staging copy
    when a value did not round-trip. Nothing waits for the device in the step.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype  # the model's
        self.buffers = ChunkBuffers()  # on_cpu's narrowed and widened copies, made at the first step

    def _narrow(self, dtype: torch.dtype) -> torch.dtype | None:
        """The dtype a step of `dtype` may be stored in, or None when it is stored as it is."""
        if dtype == torch.float32 and self.dtype in (torch.bfloat16, torch.float16):
            return self.dtype
        return None

    def on_device(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach()
        narrow = self._narrow(x.dtype)
        if narrow is None:
            flag = torch.ones(1, dtype=torch.int16, device=x.device)
            return torch.cat([flag, x.contiguous().reshape(-1).view(torch.int16)])
        small = x.to(narrow)
        same = (small.to(x.dtype).view(torch.int32) == x.view(torch.int32)).all()
        return torch.cat([same.to(torch.int16).reshape(1), small.reshape(-1).view(torch.int16)])

    def on_host(self, fixed: torch.Tensor, *, vocab: int, dtype: torch.dtype,
                fetch: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        narrow = self._narrow(dtype)
        rows = (fixed.numel() - 1) * 2 // (dtype.itemsize * vocab) if narrow is None else (fixed.numel() - 1) // vocab
        if narrow is None:
            return _native_record(fixed[1:], rows, vocab, dtype, dtype)
        if bool(fixed[0]):
            return _native_record(fixed[1:], rows, vocab, dtype, narrow)
        whole = fetch(torch.arange(rows))  # a value that does not round-trip: the step as it is
        return _native_record(whole.contiguous().reshape(-1).view(torch.int16), rows, vocab, dtype, dtype)

    def on_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """The step's record of a CPU tensor at once (the host may look at the values)."""
        x = x.detach()
        rows, vocab = x.shape
        narrow = self._narrow(x.dtype)
        if narrow is not None:
            # x.to(narrow) and its .to(x.dtype), as copies into buffers made once (the same conversions).
            small = self.buffers.take("narrow", x.shape, narrow, x.device).copy_(x)
            wide = self.buffers.take("wide", x.shape, x.dtype, x.device).copy_(small)
            if torch.equal(wide.view(torch.int32), x.view(torch.int32)):
                return _native_record(small.reshape(-1).view(torch.int16), rows, vocab, x.dtype, narrow)
        return _native_record(x.contiguous().reshape(-1).view(torch.int16), rows, vocab, x.dtype, x.dtype)


def _native_record(halves: torch.Tensor, rows: int, vocab: int, dense: torch.dtype, stored: torch.dtype) -> torch.Tensor:
    """A native record: its header and the values' bits (`halves`, int16, on the host), two per word."""
    if halves.numel() % 2:
        halves = torch.cat([halves, halves.new_zeros(1)])
    header = torch.tensor([rows, vocab, SPARSE_DTYPES.index(dense), SPARSE_DTYPES.index(stored)], dtype=torch.int32)
    return torch.cat([header, halves.contiguous().view(torch.int32)])
