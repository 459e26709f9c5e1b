"""Encodings of the `(rows, vocab)` streams, applied on the device inside the step, before the copy.

`Recorder(..., encodings={"scores": "topk:20"})`. Today: `"dense"` (the default: the tensor as
generate() computed it) and `"topk:K"`, lossy by the user's choice: per row the K largest values
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

from typing import Any

import torch

from ..store.format import ENCODED_STREAMS, topk_width



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
        k = topk_width(encoding)
        if k is None:
            raise ValueError(
                f"`encodings[{stream!r}]` is {encoding!r}; this release knows \"dense\" and \"topk:K\" (K a positive "
                "int, e.g. \"topk:20\"). The lossless compact encodings (\"sparse\", \"native\") are not available yet."
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
