"""The encodings' names and the encoding strings users write (`"sparse"`, `"native"`, `"topk:K"`,
`"topk:K:qB"`, `"sample:N@T"`): parsing them, checking a Recorder's choice, and how each is stored."""

from __future__ import annotations

import re
from typing import Any

# How a stream's values are laid out in a shard: "dense", one `(steps, *shape)` tensor; "ragged", for
# per-layer streams whose shape changes from step to step, the steps' values concatenated flat in step
# order (`name`) and their shapes (`name.shapes`, int64 `(steps, ndim)`), with no padding.
ENCODINGS = ("dense", "ragged")  # and, for logits and scores, "sparse" and "topk:K" (below)


# -- top-k and sampled encodings of logits or scores (`encodings={"scores": "topk:K"}`...) -----------
# A stream of dtype int32 holds one flat int32 record per step, stored like a sparse one (`packed` has the
# layouts): `"topk:K"` (the K largest values bit for bit, their ids in as few bytes as the vocabulary
# needs), `"topk:K:qB"` (lossy: ids Elias-Fano coded, log-probabilities quantised to B bits) and
# `"sample:N"` / `"sample:N@T"` (N tokens drawn from softmax(x / T), with their values) and `"topk:K+tail:N"`
# (the K largest values bit for bit and N tokens drawn from the rest, with their values: the tail's
# sample from which `compare` estimates a KL without the one-bucket bound's bias). A `"topk:K"` stream
# of dtype float64 holds one `(rows, 2K + 2)` tensor per step (`packed.topk_columns`): K values, their K
# indices, the row's logsumexp, the mass outside the K.
ENCODED_STREAMS = ("logits", "scores")
TOPK_ENCODING = re.compile(r"topk:([1-9][0-9]{0,8})(?::q([2-8])|\+tail:([1-9][0-9]{0,8}))?")
SAMPLE_ENCODING = re.compile(r"sample:([1-9][0-9]{0,8})(?:@((?:0|[1-9][0-9]{0,5})(?:\.[0-9]{1,6})?))?")


def topk_width(encoding: str) -> int | None:
    """K of a `"topk:K"` or `"topk:K:qB"` encoding name, else None."""
    found = TOPK_ENCODING.fullmatch(encoding)
    return int(found.group(1)) if found else None


def topk_bits(encoding: str) -> int | None:
    """B of a lossy `"topk:K:qB"` encoding name (bits per log-probability), else None."""
    found = TOPK_ENCODING.fullmatch(encoding)
    return int(found.group(2)) if found and found.group(2) else None


def topk_tail(encoding: str) -> int | None:
    """N of a `"topk:K+tail:N"` encoding name (tokens drawn from outside the K), else None."""
    found = TOPK_ENCODING.fullmatch(encoding)
    return int(found.group(3)) if found and found.group(3) else None


def sample_spec(encoding: str) -> tuple[int, float] | None:
    """`(N, T)` of a `"sample:N"` (T = 1.0) or `"sample:N@T"` encoding name, else None (also for T = 0)."""
    found = SAMPLE_ENCODING.fullmatch(encoding)
    if not found:
        return None
    temperature = float(found.group(2) or 1.0)
    return (int(found.group(1)), temperature) if temperature > 0 else None


def is_packed(encoding: str) -> bool:
    """Whether `encoding` is one of the top-k or sampled encodings (`packed` records)."""
    return topk_width(encoding) is not None or sample_spec(encoding) is not None


# -- sparse encoding of logits or scores (`encodings={"scores": "sparse"}`), lossless ----------------
# One flat int32 record per step, stored like a ragged stream (the steps' records concatenated, their
# lengths in `NAME.shapes`): a header `[rows, vocab, dtype code]`, then per row its count of entries
# (or -1: the row is stored whole), then per row in order either `count` token ids (ascending) and
# `count` values, or `vocab` values. A value is w int32 words, its bit pattern: float32 (w = 1; float16
# and bfloat16 values widen to float32 exactly) or float64 (w = 2). Every entry that is not -inf is
# kept, so the dense tensor is the record's entries over a fill of -inf, bit for bit. The manifest's
# stream entry names the dense dtype and per-step shape (`dense`); every record's header must agree.
SPARSE = "sparse"


# `scores` stored once with the logits: a call whose processed scores are its raw logits, the very tensor
# (greedy or sampling with no processor or warper), records `scores` with this encoding and no data of
# its own; its steps are the `logits` stream's.
SAME_AS_LOGITS = "same_as_logits"


def read_encodings(encodings: dict[str, str]) -> dict[str, str]:
    """A generation's `encodings` as its readers see them: the streams not stored dense, with their
    encoding; `scores` stored as the logits read as the logits do (dense: left out)."""
    found = {name: encoding for name, encoding in encodings.items() if encoding not in (*ENCODINGS, SAME_AS_LOGITS)}
    if encodings.get("scores") == SAME_AS_LOGITS and "logits" in found:
        found["scores"] = found["logits"]
    return found


# -- native encoding of logits or scores (`encodings={"logits": "native"}`), lossless -----------------
# One flat int32 record per step, stored like a sparse one: a header `[rows, vocab, dense code, stored
# code]` (codes index SPARSE_DTYPES: the dtype the stream decodes to, and the one its values are stored
# in), then the `rows x vocab` values' bit patterns, packed two 16-bit values per int32 word (the last
# half-word 0 when their count is odd) or one float32 value per word. A step is stored in the model's
# bfloat16/float16 only when every value of it converts back to the float32 tensor bit for bit; else
# in the dense dtype itself.
NATIVE = "native"


RECORD_ENCODINGS = (SPARSE, NATIVE)  # one flat int32 record per step, headed [rows, vocab, dense code, ...]


FLAT_ENCODINGS = ("ragged", SPARSE, NATIVE)  # stored flat, the steps' shapes beside them


def stored_as_records(encoding: str, dtype: str) -> bool:
    """Whether a stream stored with `encoding` as `dtype` holds one flat int32 record per step (sparse, native, or
    a top-k or sampled encoding of dtype int32; a `"topk:K"` stream of dtype float64 holds tensors)."""
    return encoding in RECORD_ENCODINGS or (is_packed(encoding) and dtype == "int32")


def stored_flat(encoding: str, dtype: str) -> bool:
    """Whether a stream stored with `encoding` as `dtype` is stored flat, its steps' shapes beside it (`NAME.shapes`)."""
    return encoding in FLAT_ENCODINGS or stored_as_records(encoding, dtype)


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
        raise TypeError(f"`encodings` must be a dict of stream name to encoding (e.g. {{'scores': 'topk:20'}}), "
                        f"got {encodings!r}.")
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
            hint = (" K and N must be at least 1." if "+tail:" in encoding else " K must be at least 1."
                    ) if encoding.startswith("topk:") else ""
            hint += " N must be at least 1 and T above 0." if encoding.startswith("sample:") else ""
            raise ValueError(
                f"`encodings[{stream!r}]` is {encoding!r}; the encodings are \"dense\", \"sparse\", \"native\", \"topk:K\", "
                f"\"topk:K:qB\", \"topk:K+tail:N\" and \"sample:N@T\" (K and N positive ints written in digits, B 2 "
                f"to 8 bits, T a positive temperature such as 0.7, e.g. \"topk:20\", \"topk:128:q5\", \"topk:32+tail:48\", "
                f"\"sample:64@1.0\").{hint}"
            )
        if isinstance(vocab_size, int) and k > vocab_size:
            raise ValueError(f"`encodings[{stream!r}]` keeps the top {k} of a vocabulary of {vocab_size}; "
                             f"choose K <= {vocab_size}.")
        chosen[stream] = encoding
    return chosen
