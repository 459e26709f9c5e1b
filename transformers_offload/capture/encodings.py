"""Encodings of the `(rows, vocab)` streams, applied on the device inside the step, before the copy.

`Recorder(..., encodings={"scores": "sparse"})`: `"dense"` (the default: the tensor as generate()
computed it), `"sparse"` (lossless: per row only the entries that are not -inf; see `Sparse`) and
`"topk:K"`, lossy by the user's choice: per row the K largest values
and their indices, the logsumexp over the whole vocabulary (so the kept tokens' logprobs are exact
differences) and the probability mass outside the K. It stores one `(rows, 2K + 2)` float64 record per
step, whose columns are exactly these torch expressions of the step's tensor `x` (`out.logits[t]` or
`out.scores[t]`):

    values, indices = torch.topk(x, K, dim=-1)                       # columns 0..K-1, K..2K-1
    logsumexp       = torch.logsumexp(x, -1)                           # column 2K
    mass_outside    = torch.exp(torch.logsumexp(x.scatter(-1, indices, -inf), -1) - logsumexp)   # 2K+1

each `.float()` (float64 holds float32 values and the indices exactly). Nothing here waits for the
device: `torch.topk` and `scatter` run where the tensor is.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..store.format import ENCODED_STREAMS, SPARSE, SPARSE_DTYPES, topk_width

SPARSE_CAPACITY = 256  # entries per row the device part keeps; a row with more is copied whole



def check(encodings: Any, streams: tuple[str, ...], vocab_size: int | None,
          dtype: torch.dtype | None = None) -> dict[str, str]:
    """The Recorder's `encodings`, checked: stream name -> encoding, without the dense ones.

    Raises:
        TypeError: not a dict of str to str.
        ValueError: a stream that cannot be encoded or is not recorded, an unknown encoding, a K
            larger than the vocabulary, or `"sparse"` for a model in float64 (`dtype`).
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
        if encoding == SPARSE:
            if dtype is not None and dtype not in SPARSE_DTYPES:
                raise ValueError(
                    f"`encodings[{stream!r}]` is \"sparse\", which keeps float32, float16 and bfloat16 values; this "
                    f"model computes in {dtype}. Record {stream!r} dense (drop it from `encodings`)."
                )
            chosen[stream] = encoding
            continue
        k = topk_width(encoding)
        if k is None:
            raise ValueError(
                f"`encodings[{stream!r}]` is {encoding!r}; this release knows \"dense\", \"sparse\" and \"topk:K\" (K "
                "a positive int, e.g. \"topk:20\"). The \"native\" encoding is not available yet."
            )
        if isinstance(vocab_size, int) and k > vocab_size:
            raise ValueError(f"`encodings[{stream!r}]` keeps the top {k} of a vocabulary of {vocab_size}; choose K <= {vocab_size}.")
        chosen[stream] = encoding
    return chosen


def encode(encoding: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` `(rows, vocab)` as stored under `encoding` (a `"topk:K"`): a `(rows, 2K + 2)` float64
    record on the tensor's device."""
    k = topk_width(encoding)
    x = tensor.detach()
    values, indices = torch.topk(x, k, dim=-1)
    logsumexp = torch.logsumexp(x, -1)
    mass_outside = torch.exp(torch.logsumexp(x.scatter(-1, indices, float("-inf")), -1) - logsumexp)
    return torch.cat(
        [values.float().double(), indices.double(), logsumexp.float().double()[:, None],
         mass_outside.float().double()[:, None]],
        dim=-1,
    )


class Sparse:
    """The `"sparse"` encoding (lossless), in two parts so that the step never waits for the device.

    `on_device` runs where the tensor is (on CUDA, on the side stream, over the slot's staging copy)
    and keeps a fixed `(rows, 1 + 2C)` int32 record per step, C = `capacity` (at most the vocabulary):
    per row its count of entries that are not -inf, then the ids of up to C of them (ascending) and
    their float32 bit patterns. `on_host` runs once that record is on the host (on CUDA, in the
    drainer thread) and packs the step's flat record (`store.format.SparseRecord`), taking a row whole
    from `fetch` when it has more than C entries or when its entries would take as much room as the row.
    """

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = SPARSE_CAPACITY if capacity is None else capacity

    def on_device(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `(rows, vocab)` -> `(rows, 1 + 2C)` int32 on `x`'s device; no host synchronisation."""
        x = x.detach()
        rows, vocab = x.shape
        width = min(self.capacity, vocab)
        values = x.float()
        counts = (values != float("-inf")).sum(-1)
        # torch.topk ranks NaN and +inf above every number and -inf below: a row's first `counts`
        # (up to `width`) are exactly its entries that are not -inf.
        top, ids = torch.topk(values, width, dim=-1)
        kept = torch.arange(width, device=x.device) < counts[:, None]
        order = torch.where(kept, ids, vocab).sort(dim=-1)
        words = top.gather(-1, order.indices).view(torch.int32)
        return torch.cat([counts.to(torch.int32)[:, None], order.values.to(torch.int32), words], dim=-1)

    def on_host(self, fixed: torch.Tensor, *, vocab: int, dtype: torch.dtype,
                fetch: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The step's flat int32 record from `on_device`'s host copy; `fetch(rows)` returns those rows of
        the step's tensor, whole, on the host (a `(n, vocab)` tensor of `dtype`)."""
        rows, width = fixed.shape[0], (fixed.shape[1] - 1) // 2
        counts = fixed[:, 0].to(torch.int64)
        whole = (counts > width) | (2 * counts >= vocab)
        header = torch.tensor([rows, vocab, SPARSE_DTYPES.index(dtype)], dtype=torch.int32)
        marks = torch.where(whole, -1, counts).to(torch.int32)
        if not bool(whole.any()):
            kept = torch.arange(width)[None, :] < counts[:, None]
            entries = fixed[:, 1:][torch.cat([kept, kept], dim=-1)]  # per row its ids, then its values
            return torch.cat([header, marks, entries])
        taken = whole.nonzero().flatten()
        full = dict(zip(taken.tolist(), fetch(taken).float().view(torch.int32)))
        parts = [header, marks]
        for r in range(rows):
            if r in full:
                parts.append(full[r])
            else:
                n = int(counts[r])
                parts += [fixed[r, 1 : 1 + n], fixed[r, 1 + width : 1 + width + n]]
        return torch.cat(parts)
