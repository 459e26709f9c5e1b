"""The `"sparse"` encoding (lossless): per row only the entries that are not -inf. Encoded on the device
inside the step (`Sparse`), decoded from its flat int32 record (`SparseRecord`)."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy

from .._lazy import torch
from .dtypes import TorchDtypes, dtype_name
from .workspace import ChunkBuffers

SPARSE_DTYPES = TorchDtypes("float32", "float16", "bfloat16", "float64")  # index = the dtype code


SPARSE_HEADER = 3


SPARSE_MAX_VOCAB = 2**24  # a record claiming more tokens is refused (a damaged record must not allocate GBs)


NEGATIVE_INFINITY = float("-inf")


def sparse_dense(header: Sequence[int]) -> tuple[str, list[int]]:
    """What a record decodes to, from its header `[rows, vocab, code]`: the dtype name and `[rows, vocab]` (the
    manifest's `dense` part of the stream)."""
    rows, vocab, code = header
    return dtype_name(SPARSE_DTYPES[code]), [rows, vocab]


class SparseRecord:
    """One step's sparse record, parsed and checked (nothing decoded yet).

    Raises:
        ValueError: the record is not a consistent sparse record (damaged data).
    """

    def __init__(self, record: torch.Tensor) -> None:
        if record.dtype != torch.int32 or record.dim() != 1 or record.numel() < SPARSE_HEADER:
            raise ValueError(f"a sparse record is a flat int32 tensor of at least {SPARSE_HEADER} values, got "
                             f"{list(record.shape)} {record.dtype}")
        rows, vocab, code = (int(v) for v in record[:SPARSE_HEADER])
        if (rows < 0 or not 1 <= vocab <= SPARSE_MAX_VOCAB or not 0 <= code < len(SPARSE_DTYPES)
                or record.numel() < SPARSE_HEADER + rows):
            raise ValueError(f"a sparse record's header [{rows}, {vocab}, {code}] is not valid")
        self.rows, self.vocab, self.dtype = rows, vocab, SPARSE_DTYPES[code]
        self.header = [rows, vocab, code]
        self._words = 2 if self.dtype == torch.float64 else 1
        counts = record[SPARSE_HEADER : SPARSE_HEADER + rows].to(torch.int64)
        if bool(((counts < -1) | (counts > vocab)).any()):
            raise ValueError("a sparse record's row counts are out of range")
        lengths = torch.where(counts < 0, self._words * vocab, (1 + self._words) * counts)
        offsets = torch.zeros(rows + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        if SPARSE_HEADER + rows + int(offsets[-1]) != record.numel():
            raise ValueError("a sparse record's row counts do not add up to its length")
        self._counts = counts
        self._payload = record[SPARSE_HEADER + rows :]
        self._starts = offsets[:-1]
        ids = self._payload.index_select(0, ranges(self._starts, counts.clamp(min=0)))
        low, high = torch.aminmax(ids) if ids.numel() else (0, 0)
        if not 0 <= int(low) <= int(high) < vocab:
            raise ValueError("a sparse record holds a token id outside the vocabulary")
        self._ids = ids  # every row's stored ids, in row order (what `_parts` of every row takes)

    def _values(self, words: torch.Tensor) -> torch.Tensor:
        """Value words as floats (a view: `words` must be the caller's own copy)."""
        return words.view(torch.float64 if self._words == 2 else torch.float32)

    def row(self, r: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Row `r`'s token ids (int64, ascending; None for a row stored whole) and values (float32, or
        float64 for a float64 stream)."""
        start, count = int(self._starts[r]), int(self._counts[r])
        if count < 0:
            return None, self._values(self._payload[start : start + self._words * self.vocab].clone())
        ids = self._payload[start : start + count].to(torch.int64)
        return ids, self._values(self._payload[start + count : start + (1 + self._words) * count].clone())

    def _parts(self, rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Rows `rows` split in two, without a loop over rows: `whole` `(n,)` bool (the rows stored whole),
        `counts` `(n,)` int64 (the entries of each row stored sparse, 0 for a whole one), those entries' `ids`
        (int32, in row order) and `values` (wide), and the whole rows' `(n_whole, vocab)` wide values (or None)."""
        every = isinstance(rows, range) and rows == range(self.rows)
        if every:
            counts, starts = self._counts, self._starts
        else:
            picked = torch.as_tensor(rows, dtype=torch.int64).reshape(-1)
            counts, starts = self._counts[picked], self._starts[picked]
        whole = counts < 0
        n = counts.clamp(min=0)
        ids = self._ids if every else self._payload.index_select(0, ranges(starts, n))
        values = self._values(self._payload.index_select(0, ranges(starts + n, self._words * n)))
        dense = None
        if bool(whole.any()):
            at = starts[whole]
            dense = self._values(self._payload[ranges(at, torch.full_like(at, self._words * self.vocab))]).view(-1, self.vocab)
        return whole, n, ids, values, dense

    def dense(self, rows: Sequence[int]) -> torch.Tensor:
        """Rows `rows` as the dense `(len(rows), vocab)` tensor in the recorded dtype: the kept entries
        over -inf (lossless: `torch.equal` to what was recorded)."""
        whole, counts, ids, values, dense = self._parts(rows)
        wide = torch.float64 if self._words == 2 else torch.float32
        out = torch.full((whole.numel(), self.vocab), NEGATIVE_INFINITY, dtype=wide)
        out[torch.repeat_interleave(torch.arange(whole.numel()), counts, output_size=ids.numel()), ids.long()] = values
        if dense is not None:
            out[whole] = dense
        return out.to(self.dtype)

    def entries(self, rows: Sequence[int]) -> dict[str, torch.Tensor]:
        """Rows `rows` without densifying: `indices` int64 `(n,)` (token ids, ascending within a row),
        `values` `(n,)` in the recorded dtype, and `offsets` int64 `(len(rows) + 1,)`: row i's entries are
        `[offsets[i], offsets[i + 1])`. Entries equal to -inf are left out."""
        whole, counts, ids, values, dense = self._parts(rows)
        ids = ids.to(torch.int64)
        if dense is None:
            offsets = torch.zeros(whole.numel() + 1, dtype=torch.int64)
            torch.cumsum(counts, 0, out=offsets[1:])
        else:  # the rows stored whole: their entries that are not -inf, each row's in its place
            found = (dense != NEGATIVE_INFINITY).nonzero()
            whole_counts = torch.bincount(found[:, 0], minlength=dense.shape[0])
            every = counts.clone()
            every[whole] = whole_counts
            offsets = torch.zeros(whole.numel() + 1, dtype=torch.int64)
            torch.cumsum(every, 0, out=offsets[1:])
            at_sparse, at_whole = ranges(offsets[:-1], counts), ranges(offsets[:-1][whole], whole_counts)
            ids, sparse_ids = torch.empty(int(offsets[-1]), dtype=torch.int64), ids
            ids[at_sparse], ids[at_whole] = sparse_ids, found[:, 1]
            values, sparse_values = torch.empty(int(offsets[-1]), dtype=values.dtype), values
            values[at_sparse], values[at_whole] = sparse_values, dense[found[:, 0], found[:, 1]]
        return {"indices": ids, "values": values.to(self.dtype), "offsets": offsets}


def ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """`torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])` without a loop: int64 `(sum(lengths),)`.
    `starts`, `lengths`: `(k,)` int64 CPU tensors, lengths at least 0 (numpy's `repeat` is several times torch's
    `repeat_interleave` on the host)."""
    global _COUNTING
    first, count = starts.numpy(), lengths.numpy()
    out = numpy.repeat(first - (numpy.cumsum(count) - count), count)
    if out.size > _COUNTING.size:  # 0, 1, 2 ... kept between calls (read only; replaced, never written)
        _COUNTING = numpy.arange(max(out.size, 2 * _COUNTING.size), dtype=numpy.int64)
    out += _COUNTING[: out.size]
    return torch.from_numpy(out)


_COUNTING = numpy.arange(0, dtype=numpy.int64)


def sparse_entries(dense: torch.Tensor) -> dict[str, torch.Tensor]:
    """`SparseRecord.entries` of a dense `(rows, vocab)` host tensor (a stream recorded dense)."""
    keep = dense != NEGATIVE_INFINITY
    counts = keep.sum(-1)
    offsets = torch.zeros(dense.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    return {"indices": keep.nonzero()[:, 1], "values": dense[keep], "offsets": offsets}


SPARSE_CAPACITY = 256  # entries per row the device part keeps; a row with more is copied whole


class Sparse:
    """The `"sparse"` encoding (lossless), in two parts so that the step never waits for the device.

    `on_device` runs where the tensor is (on CUDA, on the side stream, over the slot's staging copy)
    and keeps a fixed `(rows, 1 + (1 + w) C)` int32 record per step, C = `capacity` (at most the
    vocabulary), w = `value_words(dtype)`: per row its count of entries that are not -inf, then the
    ids of up to C of them (ascending) and their bit patterns. `on_host` runs once that record is on
    the host (on CUDA, in the drainer thread) and packs the step's flat record
    (`SparseRecord`). A row with more than C entries, or whose entries would take as much
    room as the row, is taken whole from `fetch`; it is then stored whole only in the second case,
    else sparse, from the fetched row.
    """

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = SPARSE_CAPACITY if capacity is None else capacity
        self.buffers = ChunkBuffers()  # on_cpu's (rows, vocab) work, made at the first step

    def on_device(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `(rows, vocab)` -> `(rows, 1 + (1 + w) C)` int32 on `x`'s device; no host synchronisation."""
        x = x.detach()
        rows, vocab = x.shape
        width = min(self.capacity, vocab)
        values = x if x.dtype == torch.float64 else x.float()
        counts = (values != float("-inf")).sum(-1)
        # torch.topk ranks NaN and +inf above every number and -inf below: a row's first `counts`
        # (up to `width`) are exactly its entries that are not -inf.
        top, ids = torch.topk(values, width, dim=-1)
        kept = torch.arange(width, device=x.device) < counts[:, None]
        order = torch.where(kept, ids, vocab).sort(dim=-1)
        words = top.gather(-1, order.indices).view(torch.int32)  # (rows, w * width)
        return torch.cat([counts.to(torch.int32)[:, None], order.values.to(torch.int32), words], dim=-1)

    def on_host(self, fixed: torch.Tensor, *, vocab: int, dtype: torch.dtype,
                fetch: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The step's flat int32 record from `on_device`'s host copy; `fetch(rows)` returns those rows of
        the step's tensor, whole, on the host (a `(n, vocab)` tensor of `dtype`)."""
        w = value_words(dtype)
        rows, width = fixed.shape[0], (fixed.shape[1] - 1) // (1 + w)
        counts = fixed[:, 0].to(torch.int64)
        fetched = (counts > width) | ((1 + w) * counts >= w * vocab)
        header = torch.tensor([rows, vocab, SPARSE_DTYPES.index(dtype)], dtype=torch.int32)
        if not bool(fetched.any()):
            kept = torch.arange(width)[None, :] < counts[:, None]
            entries = fixed[:, 1:][torch.cat([kept, kept.repeat_interleave(w, dim=-1)], dim=-1)]  # per row: ids, values
            return torch.cat([header, counts.to(torch.int32), entries])
        taken = fetched.nonzero().flatten()
        rows_of = dict(zip(taken.tolist(), fetch(taken)))
        marks, parts = counts.to(torch.int32).clone(), []
        for r in range(rows):
            row = rows_of.get(r)
            if row is None:
                n = int(counts[r])
                parts += [fixed[r, 1 : 1 + n], fixed[r, 1 + width : 1 + width + w * n]]
            else:  # whole, or more entries than the device part keeps: from the row itself
                marks[r] = _row_parts(row, parts)
        return torch.cat([header, marks, *parts])

    def on_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """The step's flat record of a CPU tensor at once, the same as `on_host(on_device(x), ...)` (the
        host may look at the counts: there is no device to wait for)."""
        x = x.detach()
        rows, vocab = x.shape
        w = value_words(x.dtype)
        # isneginf then not: a third of `ne`'s time into a bool tensor (the same mask, NaN kept).
        keep = torch.isneginf(x, out=self.buffers.take("keep", x.shape, torch.bool, x.device)).logical_not_()
        # Counted as 0.0 / 1.0 floats (exact below 2**24, 2**53 in float64): summing the bool tensor
        # would make an int64 copy of it, 8 bytes an entry, every step.
        tally = torch.float32 if vocab <= 2**24 else torch.float64
        counts = torch.ne(x, float("-inf"), out=self.buffers.take("count", x.shape, tally, x.device)).sum(-1).long()
        whole = (1 + w) * counts >= w * vocab
        header = torch.tensor([rows, vocab, SPARSE_DTYPES.index(x.dtype)], dtype=torch.int32)
        marks = torch.where(whole, -1, counts).to(torch.int32)
        if bool(whole.all()):
            return torch.cat([header, marks, _words(x)])
        if not bool(whole.any()):
            # Per row its ids, then its values: every kept entry keyed by its row, ids before values.
            found = _nonzero(keep)
            row = found[:, 0]
            items = torch.cat([found[:, 1].to(torch.int32), _words(x[row, found[:, 1]])])
            keys = torch.cat([2 * row, (2 * row + 1).repeat_interleave(w)])
            return torch.cat([header, marks, items[keys.sort(stable=True).indices]])
        parts: list[torch.Tensor] = []
        for r in range(rows):
            _row_parts(x[r], parts, keep[r])
        return torch.cat([header, marks, *parts])


def _nonzero(mask: torch.Tensor) -> torch.Tensor:
    """`mask.nonzero()` of a contiguous `(rows, vocab)` bool host tensor with few True entries, in a
    fifth of its time where `vocab` is a multiple of 8: the words of 8 entries that hold one first,
    then the entries of those words."""
    rows, vocab = mask.shape
    if vocab % 8 or not mask.is_contiguous() or mask.storage_offset() % 8:
        return mask.nonzero()
    words = mask.view(torch.int64).nonzero()  # (n, 2): row, word
    inner = mask.view(rows, vocab // 8, 8)[words[:, 0], words[:, 1]].nonzero()  # (m, 2): found word, entry
    word = words[inner[:, 0]]
    return torch.stack([word[:, 0], word[:, 1] * 8 + inner[:, 1]], dim=1)


def value_words(dtype: torch.dtype) -> int:
    """int32 words per value in a sparse record: 2 for float64, else 1 (float16 and bfloat16 widen to
    float32 exactly)."""
    return 2 if dtype == torch.float64 else 1


def _row_parts(row: torch.Tensor, parts: list[torch.Tensor], keep: torch.Tensor | None = None) -> int:
    """Append one dense host row to a record's `parts`, whole or as its ids and values, whichever is
    smaller; returns its mark (its count of entries, or -1 for whole). `keep`: `row != -inf`, if known."""
    w, vocab = value_words(row.dtype), row.shape[-1]
    ids = (row != float("-inf") if keep is None else keep).nonzero().flatten()
    if (1 + w) * ids.numel() >= w * vocab:
        parts.append(_words(row))
        return -1
    parts += [ids.to(torch.int32), _words(row[ids])]
    return ids.numel()


def _words(values: torch.Tensor) -> torch.Tensor:
    wide = values if values.dtype == torch.float64 else values.float()
    return wide.contiguous().view(torch.int32).reshape(-1)
