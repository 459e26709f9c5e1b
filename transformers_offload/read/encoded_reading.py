"""Reading `logits` and `scores` recorded with an encoding (`Recorder(..., encodings=...)`).

`EncodedReading` gives `Generation` what `logits()` / `scores()` read through (dense tensors back from
`"sparse"` records; a pointer to `topk()` for `"topk:K"`) and the `topk()`, `sampled_targets()` and
`sparse()` accessors;
`read.readable` the same accessors on `Recorder` and `Recording` (one generation, default the latest).
The records' layouts are the `codecs`'.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy

from ..codecs.native import NativeRecord
from ..codecs.packed import PackedRecord, topk_columns
from ..codecs.sparse import SparseRecord, sparse_entries
from ..codecs.spec import ENCODED_STREAMS, NATIVE, SPARSE, sample_spec, topk_width
from ..errors import RecordingError
from .indexing import Rows, Steps, as_framework, check_framework, row_index, step_range

_RECORDS = {SPARSE: SparseRecord, NATIVE: NativeRecord}  # encodings stored as one record per step


class EncodedReading:
    """The encoded-stream accessors of `Generation` (which provides `encodings`, `streams`,
    `num_rows`, `num_steps` and `_get`)."""

    def topk(self, stream: str = "scores", *, steps: Steps = None, rows: Rows = None,
             framework: str = "pt") -> tuple[dict[str, Any], ...]:
        """The top-k record of `stream` (`"logits"` or `"scores"`) per step, where the Recorder's
        `encodings` asked for `"topk:K"`.

        A tuple with one dict per selected step (on CPU, fewer rows with `rows=`): `values` float32
        `(num_rows, K)`, the K largest entries of `out.logits[t]` / `out.scores[t]` in decreasing order,
        and `indices` int64 `(num_rows, K)`, their token ids (`torch.topk(x, K, dim=-1)`, ties as torch
        breaks them); `logsumexp` float32 `(num_rows,)` over the whole vocabulary
        (`torch.logsumexp(x, -1)`); `mass_outside` float32 `(num_rows,)`, the probability outside the K
        (`exp(logsumexp of the rest - logsumexp)`); and `logprobs` float32 `(num_rows, K)`,
        `values - logsumexp[:, None]`. Each equals its expression on the device the step ran on; under
        `"topk:K:qB"` (lossy) the values are quantised (docs/recording.md gives the errors) and entries
        of equal code come in token id order. The same keys for recordings made before the packed records.
        Under `"topk:K+tail:N"` also `tail_indices` int64 `(num_rows, N)`, N ids drawn with replacement from
        the distribution over the ids outside the K (ascending, repeats kept; uniform where those are all
        -inf and `mass_outside` is 0), `tail_values` float32 `(num_rows, N)`, `x[tail_indices]` bit for bit,
        and `tail_logprobs`, `tail_values - logsumexp[:, None]`: what `compare` estimates the tail's
        divergence from (docs/compare.md).

        Raises:
            ValueError: `stream` is not `"logits"` or `"scores"`, or was recorded dense (read it with
                `logits()` / `scores()`).
            KeyError: the recording has no such stream.
        """
        if stream not in ENCODED_STREAMS:
            raise ValueError(f"`stream` must be one of {ENCODED_STREAMS}, got {stream!r}.")
        k = topk_width(self.encodings.get(stream, ""))
        if k is None and stream in self.streams:
            raise ValueError(
                f"{stream!r} was recorded {self.encodings.get(stream, 'dense')}, not as top-k: read it with `{stream}()`."
            )
        return self._packed_columns(stream, steps, rows, framework, k)

    def sampled_targets(self, stream: str = "scores", *, steps: Steps = None, rows: Rows = None,
                        framework: str = "pt") -> tuple[dict[str, Any], ...]:
        """The N tokens sampled per row and step from `stream` (`"logits"` or `"scores"`), where the
        Recorder's `encodings` asked for `"sample:N@T"`: distillation targets whose losses are unbiased.

        A tuple with one dict per selected step (on CPU, fewer rows with `rows=`): `indices` int64
        `(num_rows, N)`, the N draws of `torch.multinomial(softmax(x.float() / T), N, replacement=True)`
        sorted ascending (repeats kept); `counts` int64 `(num_rows, N)`, at each id's first position the
        number of times it was drawn, 0 at its repeats (each row sums to N); `values` float32
        `(num_rows, N)`, `x[indices]` bit for bit; `logsumexp` float32 `(num_rows,)`,
        `torch.logsumexp(x.float() / T, -1)`; and `logprobs` float32 `(num_rows, N)`, `values / T -
        logsumexp[:, None]`, the teacher's log-probabilities at temperature T. For any f,
        `(counts / N * f(indices)).sum(-1)` is an unbiased estimate of `E_p[f]` (docs/recording.md).

        Raises:
            ValueError: `stream` is not `"logits"` or `"scores"`, or was not recorded `"sample:N@T"`.
            KeyError: the recording has no such stream.
        """
        if stream not in ENCODED_STREAMS:
            raise ValueError(f"`stream` must be one of {ENCODED_STREAMS}, got {stream!r}.")
        if sample_spec(self.encodings.get(stream, "")) is None and stream in self.streams:
            raise ValueError(
                f"{stream!r} was recorded {self.encodings.get(stream, 'dense')}, not as \"sample:N@T\": record it with "
                f"`encodings={{{stream!r}: 'sample:64'}}` to read sampled targets."
            )
        return self._packed_columns(stream, steps, rows, framework, None)

    def _packed_columns(self, stream: str, steps: Steps, rows: Rows, framework: str, k: int | None) -> tuple[dict[str, Any], ...]:
        check_framework(framework)
        records = self._get(stream, steps, None, framework)  # NumPy's arrays: no torch where none is needed
        index = row_index(rows, self.num_rows)
        encoding = self.encodings.get(stream, "")
        found = []
        for t, record in zip(step_range(steps, self.num_steps), records):
            if str(record.dtype).endswith("float64"):  # recorded before the packed records (NumPy reads them)
                columns = topk_columns(record, k)
            else:
                try:
                    parsed = PackedRecord(as_framework(record, stream, "pt"), encoding)  # decoded by torch
                    columns = parsed.columns()
                except ValueError as error:
                    raise RecordingError(f"{stream} step {t}", f"{error}; the recording is damaged.") from None
                if parsed.rows != self.num_rows:
                    raise RecordingError(f"{stream} step {t}", f"the record holds {parsed.rows} rows, the generation "
                                         f"{self.num_rows}; the recording is damaged.")
            found.append({name: as_framework(value if index is None else value[index], name, framework)
                          for name, value in columns.items()})
        return tuple(found)

    def sparse(self, stream: str = "scores", *, steps: Steps = None, rows: Rows = None,
               framework: str = "pt") -> tuple[dict[str, Any], ...]:
        """The entries of `stream` (`"logits"` or `"scores"`) that are not -inf, per step, without
        densifying: what `encodings={"scores": "sparse"}` stores (a stream recorded dense gives the
        same, computed from its dense steps).

        A tuple with one dict per selected step, on CPU: `indices` int64 `(n,)`, token ids (ascending
        within a row), `values` `(n,)` in the stream's dtype, and `offsets` int64 `(len(rows) + 1,)`:
        row i's entries are `indices[offsets[i]:offsets[i + 1]]` (rows as `rows=` picks them; an int
        `rows` gives one row). Scattered over a fill of -inf they give `scores()` (`out.scores[t]`) bit
        for bit. `rows=`, `steps=` and `framework=` as in `logits()`.

        Raises:
            ValueError: `stream` is not `"logits"` or `"scores"`, or was recorded as top-k.
            KeyError: the recording has no such stream.
        """
        if stream not in ENCODED_STREAMS:
            raise ValueError(f"`stream` must be one of {ENCODED_STREAMS}, got {stream!r}.")
        check_framework(framework)
        encoding = self.encodings.get(stream)
        if encoding == SPARSE:
            records, picked, _ = self._step_records(stream, steps, rows, SparseRecord)
            steps_entries = [record.entries(picked) for record in records]
        else:
            dense = self._get_full(stream, steps, rows, "pt")
            steps_entries = [sparse_entries(step.reshape(-1, step.shape[-1])) for step in dense]
        return tuple({name: as_framework(value, stream, framework) for name, value in entries.items()}
                     for entries in steps_entries)

    def _get_full(self, name: str, steps: Steps, rows: Rows, framework: str) -> tuple[Any, ...]:
        encoding = self.encodings.get(name)
        if encoding in _RECORDS:
            check_framework(framework)
            records, picked, one_row = self._step_records(name, steps, rows, _RECORDS[encoding])
            dense = [record.dense(picked) for record in records]
            return tuple(as_framework(step[0] if one_row else step, name, framework) for step in dense)
        if encoding is not None:
            reader = "sampled_targets" if sample_spec(encoding) is not None else "topk"
            raise ValueError(
                f"{name!r} was recorded as {encoding!r} (the Recorder's `encodings`), which keeps only part of "
                f"each step: read it with `{reader}({name!r})`."
            )
        return self._get(name, steps, rows, framework)

    def _step_records(self, name: str, steps: Steps, rows: Rows, parse: type) -> tuple[list[Any], Sequence[int], bool]:
        """Each selected step's record of `name` parsed (`SparseRecord` or `NativeRecord`), the rows
        `rows` picks (the same in every step), and whether `rows` is an int (the row axis dropped)."""
        index = row_index(rows, self.num_rows)
        picked = range(self.num_rows) if index is None else numpy.arange(self.num_rows)[index].reshape(-1).tolist()
        found = []
        for t, record in zip(step_range(steps, self.num_steps), self._get(name, steps, None, "pt")):
            try:
                parsed = parse(record)
            except ValueError as error:
                raise RecordingError(f"{name} step {t}", f"{error}; the recording is damaged.") from None
            if parsed.rows != self.num_rows:
                raise RecordingError(f"{name} step {t}", f"the record holds {parsed.rows} rows, the generation "
                                     f"{self.num_rows}; the recording is damaged.")
            found.append(parsed)
        return found, picked, isinstance(index, int)
