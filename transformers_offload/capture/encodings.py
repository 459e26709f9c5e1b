"""Encodings of the `(rows, vocab)` streams, applied on the device inside the step, before the copy.

`Recorder(..., encodings={"scores": "sparse"})`: `"dense"` (the tensor as generate() computed it; the
default, but for the Recorder's own choices: `sampling_masks`), `"sparse"` (lossless: per row only
the entries that are not -inf; see `Sparse`), `"native"` (lossless: in the model's dtype; see
`Native`), and the top-k and sampled encodings `"topk:K"`, `"topk:K:qB"` and `"sample:N@T"`
(`capture.packed_encodings`). `check` checks the Recorder's choice. Nothing here waits for the device.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..store.format import ENCODED_STREAMS, NATIVE, SPARSE, SPARSE_DTYPES, sample_spec, topk_width
from .workspace import ChunkBuffers

SPARSE_CAPACITY = 256  # entries per row the device part keeps; a row with more is copied whole


def check(encodings: Any, streams: tuple[str, ...], vocab_size: int | None) -> dict[str, str]:
    """The Recorder's `encodings`, checked: stream name -> encoding, without the dense ones.

    Raises:
        TypeError: not a dict of str to str.
        ValueError: a stream that cannot be encoded or is not recorded, an unknown encoding, or a K
            larger than the vocabulary.
    """
    if encodings is None:
        return {}
    if not isinstance(encodings, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in encodings.items()):
        raise TypeError(f"`encodings` must be a dict of stream name to encoding (e.g. {{'scores': 'topk:20'}}), got {encodings!r}.")
    chosen = {}
    for stream, encoding in encodings.items():
        if stream not in ENCODED_STREAMS:
            raise ValueError(f"`encodings` names {stream!r}; only {ENCODED_STREAMS} can be encoded.")
        if stream not in streams:
            raise ValueError(f"`encodings` encodes {stream!r}, which `streams` does not record: add it to `streams`.")
        if encoding == "dense":
            continue
        if encoding in (SPARSE, NATIVE):
            chosen[stream] = encoding
            continue
        k = topk_width(encoding)
        if k is None and sample_spec(encoding) is not None:
            chosen[stream] = encoding
            continue
        if k is None:
            hint = " K must be at least 1." if encoding.startswith("topk:") else ""
            hint += " N must be at least 1 and T above 0." if encoding.startswith("sample:") else ""
            raise ValueError(
                f"`encodings[{stream!r}]` is {encoding!r}; the encodings are \"dense\", \"sparse\", \"native\", \"topk:K\", "
                f"\"topk:K:qB\" and \"sample:N@T\" (K and N positive ints written in digits, B 2 to 8 bits, T a "
                f"positive temperature such as 0.7, e.g. \"topk:20\", \"topk:128:q5\", \"sample:64@1.0\").{hint}"
            )
        if isinstance(vocab_size, int) and k > vocab_size:
            raise ValueError(f"`encodings[{stream!r}]` keeps the top {k} of a vocabulary of {vocab_size}; choose K <= {vocab_size}.")
        chosen[stream] = encoding
    return chosen


def sampling_masks(generation_config: Any, vocab_size: int | None = None) -> bool:
    """Whether generate() samples through a warper that sets entries of the scores to -inf: top-k
    (below `vocab_size`, when known), top-p, min-p (above 0), typical, epsilon, eta or top-h, under the
    conditions on which transformers (4.36 to 5.x) builds each. Such a call's processed scores hold
    few finite entries per row (about 4 under top_p 0.9, 50 under top_k 50): the Recorder then stores
    them `"sparse"` by default."""
    if not getattr(generation_config, "do_sample", False):
        return False
    top_k, top_p, min_p, typical_p, epsilon, eta, top_h = (  # min_p and top_h: newer releases only
        getattr(generation_config, name, None)
        for name in ("top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h")
    )
    return bool(
        (top_k is not None and top_k != 0 and (not isinstance(vocab_size, int) or top_k < vocab_size))
        or (top_p is not None and top_p < 1.0) or (min_p is not None and min_p > 0.0)
        or (typical_p is not None and typical_p < 1.0) or (epsilon is not None and 0.0 < epsilon < 1.0)
        or (eta is not None and 0.0 < eta < 1.0) or top_h is not None
    )


class Sparse:
    """The `"sparse"` encoding (lossless), in two parts so that the step never waits for the device.

    `on_device` runs where the tensor is (on CUDA, on the side stream, over the slot's staging copy)
    and keeps a fixed `(rows, 1 + (1 + w) C)` int32 record per step, C = `capacity` (at most the
    vocabulary), w = `value_words(dtype)`: per row its count of entries that are not -inf, then the
    ids of up to C of them (ascending) and their bit patterns. `on_host` runs once that record is on
    the host (on CUDA, in the drainer thread) and packs the step's flat record
    (`store.format.SparseRecord`). A row with more than C entries, or whose entries would take as much
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


class Native:
    """The native encoding (lossless): a step of float32 logits or scores of a bfloat16/float16 model
    (transformers upcasts them from 4.45) stored in the model's dtype when every value converts back
    bit for bit, else as it is (`store.format` describes the record; a step already in the model's
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
