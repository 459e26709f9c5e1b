"""The recording format on disk: the names of its files, streams and dtypes, and the error a reader
raises (`manifest` checks a manifest, `files` writes the files durably and checksums them).

A recording is one directory: a JSON manifest (`manifest.json`) and safetensors files beside it. The
docs/format.md is the specification; this module and `manifest` are its single
implementation, shared by the writer (`shards`) and the reader (`read.reader`). Nothing here unpickles
anything.
"""

from __future__ import annotations

import json
import operator
import re
import shlex
from pathlib import Path
from typing import Any, Sequence

import numpy

from .._lazy import torch  # imported when first used: reading a manifest needs no torch (`inspect`, `verify`)

FORMAT = "transformers-offload"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# Where the `record` processes writing a recording (or a data-parallel run's directory) keep their claims
# on its samples (`claims`): present only while one writes; not part of the recording.
WRITERS = ".writers"
# How a stream's values are laid out in a shard: "dense", one `(steps, *shape)` tensor; "ragged", for
# per-layer streams whose shape changes from step to step, the steps' values concatenated flat in step
# order (`name`) and their shapes (`name.shapes`, int64 `(steps, ndim)`), with no padding.
ENCODINGS = ("dense", "ragged")  # and, for logits and scores, "sparse" and "topk:K" (below)
STATUSES = ("recording", "complete", "failed")
BEAM_MODES = ("beam_search", "beam_sample", "group_beam_search")  # whose generations carry `beam_parents`

# Per-layer streams, one per recorded layer, named `KIND.LAYER` (`attentions.3`): KIND is the name of
# the `generate()` output they mirror, LAYER the index into that output's per-step tuple (hidden states
# count the embeddings as entry 0). Encoder kinds are recorded once per generation, the others per step.
STEP_LAYER_KINDS = ("attentions", "hidden_states", "decoder_attentions", "cross_attentions", "decoder_hidden_states")
ENCODER_KINDS = ("encoder_attentions", "encoder_hidden_states")
LAYER_KINDS = STEP_LAYER_KINDS + ENCODER_KINDS
ATTENTION_KINDS = ("attentions", "decoder_attentions", "cross_attentions", "encoder_attentions")
GROWING_KINDS = ("attentions", "decoder_attentions")  # self-attention: one more key per step


def layer_stream(kind: str, layer: int) -> str:
    """The stream name of one layer of `kind`: `layer_stream("attentions", 3) == "attentions.3"`."""
    return f"{kind}.{layer}"


def split_layer_stream(name: str) -> tuple[str, int] | None:
    """`"attentions.3"` -> `("attentions", 3)`; None for a name that is not a per-layer stream."""
    kind, _, layer = name.rpartition(".")
    if kind in LAYER_KINDS and layer.isdigit() and layer == str(int(layer)):
        return kind, int(layer)
    return None


def ragged_shape(name: str, shape: tuple[int, ...]) -> list[int | None]:
    """The manifest's per-step `shape` of ragged stream `name`, given one step's shape: None where it
    changes from step to step (attentions `(rows, heads, queries, keys)`, hidden states
    `(rows, positions, hidden_size)`)."""
    kind, _ = split_layer_stream(name)
    if kind in ATTENTION_KINDS:
        return [shape[0], shape[1], None, None]
    return [shape[0], None, shape[2]]


def shapes_key(name: str) -> str:
    """The shard tensor that holds ragged stream `name`'s per-step shapes."""
    return name + ".shapes"


# The dtypes a recording holds, by the name the manifest uses, and their size in bytes (read without
# torch: `inspect` and `verify` need no torch dtype; `dtype_of` gives one).
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "bool": 1}


class RecordingError(ValueError):
    """A recording directory cannot be read: missing, damaged, hostile, or of an unknown format.

    Attributes:
        path (`pathlib.Path`): the file (or directory) that is wrong; the recording directory when
            `verify` found several files damaged.
        problem (`str`): what is wrong with it (the message without the path).
        damaged (`tuple[RecordingError, ...]`): one error per damaged file, each naming its file in
            `path` and saying what is wrong in `problem`: several when `verify` found several files
            damaged, else one (this error, or the same without the advice a read adds to it).
    """

    def __init__(self, path: Path | str, problem: str, *, damaged: tuple[RecordingError, ...] = ()) -> None:
        self.path = Path(path)
        self.problem = problem
        self.damaged = tuple(damaged) or (self,)
        super().__init__(f"{self.path}: {problem}")


def verify_command(root: Path | str) -> str:
    """The shell command that checks every file of recording `root`, ready to paste."""
    return f"python -m transformers_offload verify {shlex.quote(str(root))}"


def damaged_files(root: Path, damaged: list[RecordingError], checked: int) -> RecordingError:
    """One error for every damaged file `verify` found among the `checked` files of `root`: the file's
    own error when there is one, else one naming `root` that lists each (`damaged` holds them)."""
    if len(damaged) == 1:
        return damaged[0]
    listed = "".join(f"\n  {error}" for error in damaged)
    return RecordingError(
        root, f"{len(damaged)} of its {checked} file(s) are damaged (reading a step they hold raises; the "
        f"other steps read as before):{listed}", damaged=tuple(damaged),
    )

# The same dtypes as safetensors names them in a file's header (`get_slice(name).get_dtype()`).
SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
                      "I64": "int64", "I32": "int32", "BOOL": "bool"}


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> `"float32"`, the name the manifest uses."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype | None:
    """`"float32"` -> `torch.float32` (imports torch); None for a name a recording cannot hold."""
    return getattr(torch, name) if name in DTYPE_BYTES else None


class TorchDtypes:
    """torch dtypes by code (their position), named without importing torch until one is asked for.

    Attributes:
        names (`tuple[str, ...]`): the dtypes' manifest names, by code.
    """

    def __init__(self, *names: str) -> None:
        self.names = names

    def __getitem__(self, code: int) -> torch.dtype:
        return getattr(torch, self.names[code])

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Any:
        return (getattr(torch, name) for name in self.names)

    def index(self, dtype: torch.dtype) -> int:
        """The code of `dtype`; `ValueError` when it has none."""
        return self.names.index(dtype_name(dtype))


RANK_DIRECTORY = re.compile(r"rank-(0|[1-9][0-9]{0,5})")  # a data-parallel rank's recording, inside the run's


def rank_directory(rank: int) -> str:
    """The sub-directory data-parallel rank `rank` records into (`rank-0`, `rank-1`...)."""
    return f"rank-{rank}"


def rank_directories(root: Path) -> list[tuple[int, Path]]:
    """The rank sub-directories of `root` that hold a manifest, by rank (a rank killed before its first
    manifest left none: it recorded nothing)."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = RANK_DIRECTORY.fullmatch(child.name)
        if match and (child / MANIFEST).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def shard_name(generation: int, shard: int) -> str:
    return f"g{generation:04d}-s{shard:05d}.safetensors"


def sequences_name(generation: int) -> str:
    return f"g{generation:04d}-sequences.safetensors"


def encoder_name(generation: int) -> str:
    return f"g{generation:04d}-encoder.safetensors"


def prompt_name(generation: int) -> str:
    return f"g{generation:04d}-prompt.safetensors"


# Recorded once per call with `prompt_logprobs` (in the generation's `encoder` entry, a file of their
# own): per prompt and position p, the prompt's token p + 1, its logprob and rank, and the top-k.
PROMPT_STREAMS = ("prompt_tokens", "prompt_logprobs", "prompt_ranks", "prompt_top_tokens", "prompt_top_logprobs")


def shard_metadata(generation: int, first_step: int) -> dict[str, str]:
    """The safetensors `__metadata__` of a shard: lets the reader check that a file is the one named.

    One key holding sorted JSON: safetensors stores `__metadata__` as a hash map, so several keys would
    come out in a different order in each process, and shards would not be reproducible byte for byte.
    """
    fields = {"format": FORMAT, "format_version": FORMAT_VERSION, "generation": generation, "first_step": first_step}
    return {FORMAT: json.dumps(fields, sort_keys=True)}


def read_shard_metadata(metadata: dict[str, str] | None) -> dict[str, Any]:
    """The fields `shard_metadata` wrote, or {} when they are missing or unreadable."""
    try:
        fields = json.loads((metadata or {}).get(FORMAT, "{}"))
    except json.JSONDecodeError:
        return {}
    return fields if isinstance(fields, dict) else {}


# -- per-token statistics (`streams=("stats",)`): one `(rows, 9)` float32 record per step (float64 ---
# above a 2**24-token vocabulary, and in recordings made before 2026-12-02) ---------------------------
STATS_STREAM = "stats"
STATS_COLUMNS = (
    "token",
    "logprob_raw",
    "logprob_processed",
    "rank_raw",
    "rank_processed",
    "entropy_raw",
    "entropy_processed",
    "logsumexp_raw",
    "support_processed",
)
STATS_INTEGER_COLUMNS = ("token", "rank_raw", "rank_processed", "support_processed")


def stats_columns(record: Any) -> dict[str, Any]:
    """A stored `(rows, 9)` float32 or float64 stats record (a tensor, or a NumPy array: the same values)
    as `(rows,)` columns of its kind, int64 or float32: exact, since the recorder writes float32 only where
    every integer column is below 2**24."""
    return {
        name: _cast(record[..., i], "int64" if name in STATS_INTEGER_COLUMNS else "float32")
        for i, name in enumerate(STATS_COLUMNS)
    }


def _cast(value: Any, dtype: str) -> Any:
    """`value` (a tensor or a NumPy array) in `dtype` (a name both spell alike): the same conversion."""
    return value.astype(dtype) if isinstance(value, numpy.ndarray) else value.to(getattr(torch, dtype))


# -- top-k and sampled encodings of logits or scores (`encodings={"scores": "topk:K"}`...) -----------
# Recorded since 2027-01: one flat int32 record per step, stored like a sparse one (`store.packed` has
# the layouts): `"topk:K"` (the K largest values bit for bit, their ids in as few bytes as the vocabulary
# needs), `"topk:K:qB"` (lossy: ids Elias-Fano coded, log-probabilities quantised to B bits) and
# `"sample:N"` / `"sample:N@T"` (N tokens drawn from softmax(x / T), with their values). Recordings made
# before hold `"topk:K"` as one `(rows, 2K + 2)` float64 tensor per step (`topk_columns`): K values,
# their K indices, the row's logsumexp, the mass outside the K; the manifest's stream dtype (float64 or
# int32) says which.
ENCODED_STREAMS = ("logits", "scores")
TOPK_ENCODING = re.compile(r"topk:([1-9][0-9]{0,8})(?::q([2-8]))?")
SAMPLE_ENCODING = re.compile(r"sample:([1-9][0-9]{0,8})(?:@((?:0|[1-9][0-9]{0,5})(?:\.[0-9]{1,6})?))?")


def topk_width(encoding: str) -> int | None:
    """K of a `"topk:K"` or `"topk:K:qB"` encoding name, else None."""
    found = TOPK_ENCODING.fullmatch(encoding)
    return int(found.group(1)) if found else None


def topk_bits(encoding: str) -> int | None:
    """B of a lossy `"topk:K:qB"` encoding name (bits per log-probability), else None."""
    found = TOPK_ENCODING.fullmatch(encoding)
    return int(found.group(2)) if found and found.group(2) else None


def sample_spec(encoding: str) -> tuple[int, float] | None:
    """`(N, T)` of a `"sample:N"` (T = 1.0) or `"sample:N@T"` encoding name, else None (also for T = 0)."""
    found = SAMPLE_ENCODING.fullmatch(encoding)
    if not found:
        return None
    temperature = float(found.group(2) or 1.0)
    return (int(found.group(1)), temperature) if temperature > 0 else None


def is_packed(encoding: str) -> bool:
    """Whether `encoding` is one of the top-k or sampled encodings (`store.packed` records)."""
    return topk_width(encoding) is not None or sample_spec(encoding) is not None


def topk_columns(record: Any, k: int) -> dict[str, Any]:
    """A `(rows, 2K + 2)` float64 top-k record (recordings made before the packed records; a tensor, or a
    NumPy array) as columns of its kind:
    `values` float32 `(rows, K)`, `indices` int64 `(rows, K)`, `logsumexp` and `mass_outside` float32
    `(rows,)` (exact: float64 holds them), and `logprobs`, float32 `(rows, K)`: `values - logsumexp[:, None]`."""
    values = _cast(record[..., :k], "float32")
    logsumexp = _cast(record[..., 2 * k], "float32")
    return {
        "values": values,
        "indices": _cast(record[..., k : 2 * k], "int64"),
        "logsumexp": logsumexp,
        "mass_outside": _cast(record[..., 2 * k + 1], "float32"),
        "logprobs": values - logsumexp[..., None],
    }


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
SPARSE_DTYPES = TorchDtypes("float32", "float16", "bfloat16", "float64")  # index = the dtype code
SPARSE_HEADER = 3
SPARSE_MAX_VOCAB = 2**24  # a record claiming more tokens is refused (a damaged record must not allocate GBs)
# -- native encoding of logits or scores (`encodings={"logits": "native"}`), lossless -----------------
# One flat int32 record per step, stored like a sparse one: a header `[rows, vocab, dense code, stored
# code]` (codes index SPARSE_DTYPES: the dtype the stream decodes to, and the one its values are stored
# in), then the `rows x vocab` values' bit patterns, packed two 16-bit values per int32 word (the last
# half-word 0 when their count is odd) or one float32 value per word. A step is stored in the model's
# bfloat16/float16 only when every value of it converts back to the float32 tensor bit for bit; else
# in the dense dtype itself.
NATIVE = "native"
NATIVE_HEADER = 4
RECORD_ENCODINGS = (SPARSE, NATIVE)  # one flat int32 record per step, headed [rows, vocab, dense code, ...]
FLAT_ENCODINGS = ("ragged", SPARSE, NATIVE)  # stored flat, the steps' shapes beside them


def stored_as_records(stream: dict[str, Any]) -> bool:
    """Whether a manifest stream entry holds one flat int32 record per step (sparse, native, or a top-k
    or sampled encoding recorded since the packed records; an older top-k stream is float64)."""
    encoding = stream.get("encoding", "")
    return encoding in RECORD_ENCODINGS or (is_packed(encoding) and stream.get("dtype") == "int32")


def stored_flat(stream: dict[str, Any]) -> bool:
    """Whether a manifest stream entry is stored flat, its steps' shapes beside it (`NAME.shapes`)."""
    return stream.get("encoding") in FLAT_ENCODINGS or stored_as_records(stream)
NEGATIVE_INFINITY = float("-inf")


def sparse_dense(header: Sequence[int]) -> dict[str, Any]:
    """The manifest's `dense` entry of a sparse stream, from a record's header `[rows, vocab, code]`."""
    rows, vocab, code = header
    return {"dtype": dtype_name(SPARSE_DTYPES[code]), "shape": [rows, vocab]}


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
        self._counts = counts.tolist()
        self._payload = record[SPARSE_HEADER + rows :]
        self._starts = offsets.tolist()
        ids = [self._payload[start : start + n] for start, n in zip(self._starts, self._counts) if n > 0]
        if ids:
            every = torch.cat(ids)
            if bool((every < 0).any()) or bool((every >= vocab).any()):
                raise ValueError("a sparse record holds a token id outside the vocabulary")

    def _values(self, words: torch.Tensor) -> torch.Tensor:
        return words.clone().view(torch.float64 if self._words == 2 else torch.float32)

    def row(self, r: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Row `r`'s token ids (int64, ascending; None for a row stored whole) and values (float32, or
        float64 for a float64 stream)."""
        start, count = self._starts[r], self._counts[r]
        if count < 0:
            return None, self._values(self._payload[start : start + self._words * self.vocab])
        ids = self._payload[start : start + count].to(torch.int64)
        return ids, self._values(self._payload[start + count : start + (1 + self._words) * count])

    def dense(self, rows: Sequence[int]) -> torch.Tensor:
        """Rows `rows` as the dense `(len(rows), vocab)` tensor in the recorded dtype: the kept entries
        over -inf (lossless: `torch.equal` to what was recorded)."""
        wide = torch.float64 if self._words == 2 else torch.float32
        out = torch.full((len(rows), self.vocab), NEGATIVE_INFINITY, dtype=wide)
        for i, r in enumerate(rows):
            ids, values = self.row(r)
            if ids is None:
                out[i] = values
            else:
                out[i, ids] = values
        return out.to(self.dtype)

    def entries(self, rows: Sequence[int]) -> dict[str, torch.Tensor]:
        """Rows `rows` without densifying: `indices` int64 `(n,)` (token ids, ascending within a row),
        `values` `(n,)` in the recorded dtype, and `offsets` int64 `(len(rows) + 1,)`: row i's entries are
        `[offsets[i], offsets[i + 1])`. Entries equal to -inf are left out."""
        ids_parts, value_parts, offsets = [], [], [0]
        for r in rows:
            ids, values = self.row(r)
            if ids is None:
                ids = (values != NEGATIVE_INFINITY).nonzero().flatten()
                values = values[ids]
            ids_parts.append(ids)
            value_parts.append(values)
            offsets.append(offsets[-1] + ids.numel())
        return {
            "indices": torch.cat(ids_parts) if ids_parts else torch.zeros(0, dtype=torch.int64),
            "values": (torch.cat(value_parts) if value_parts else torch.zeros(0)).to(self.dtype),
            "offsets": torch.tensor(offsets, dtype=torch.int64),
        }


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
        halves = self._payload.clone().view(torch.int16 if self.stored.itemsize == 2 else self.stored)
        values = (halves[:count].view(self.stored) if self.stored.itemsize == 2 else halves).reshape(self.rows, self.vocab)
        if rows is not None:
            values = values[list(rows)]
        return values.to(self.dtype)


def native_dense(record: torch.Tensor, rows: Sequence[int] | None = None) -> torch.Tensor:
    """One step's native record decoded (`NativeRecord(record).dense(rows)`).

    Raises:
        ValueError: the record is not a consistent native record (damaged data).
    """
    return NativeRecord(record).dense(rows)


def sparse_entries(dense: torch.Tensor) -> dict[str, torch.Tensor]:
    """`SparseRecord.entries` of a dense `(rows, vocab)` host tensor (a stream recorded dense)."""
    keep = dense != NEGATIVE_INFINITY
    counts = keep.sum(-1)
    offsets = torch.zeros(dense.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    return {"indices": keep.nonzero()[:, 1], "values": dense[keep], "offsets": offsets}


# -- layer and head indices, as `layers` and `heads` name them ------------------------------------
def indices(value: Any, name: str) -> tuple[int, ...] | None:
    """`value` (None, or a sequence of integers: Python or NumPy ints, negative ones allowed) as a tuple.

    Raises:
        TypeError: not a sequence of integers (a string, a float, a bool...).
        ValueError: an empty sequence.
    """
    if value is None:
        return None
    wrong = TypeError(f"`{name}` must be a sequence of int indices (e.g. `[-1]`), got {value!r}.")
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise wrong
    items = list(value)
    if any(isinstance(i, bool) for i in items):
        raise wrong
    try:
        found = tuple(operator.index(i) for i in items)
    except TypeError:
        raise wrong from None
    if not found:
        raise ValueError(f"`{name}` is empty; pass None to keep them all.")
    return found


def resolve(chosen: Sequence[int] | None, count: int, what: str) -> tuple[int, ...]:
    """`chosen` (negative indices count from the end) as sorted, distinct indices into `count` entries.

    Raises:
        IndexError: an index is out of range, naming `what` and the count.
    """
    if chosen is None:
        return tuple(range(count))
    wrong = [i for i in chosen if not -count <= i < count]
    if wrong:
        raise IndexError(f"{what} {wrong} out of range: this model has {count} (valid: {-count} to {count - 1}).")
    return tuple(sorted({i % count for i in chosen}))
