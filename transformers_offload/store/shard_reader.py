"""Reading one generation's shards: each file opened, and its header checked, when something it holds is
first read (never at open: a damaged file hides nothing else), data read on demand.

Dense streams are memory-mapped by safetensors (`get_tensor`), so slicing a step or a row reads only
those bytes. A ragged stream (per-layer attentions, hidden states) is read through `get_slice`, one
span of steps at a time: safetensors copies small tensors whole on `get_tensor`, which would read a
whole shard to return one step.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

from .._lazy import torch  # imported when first used: reading a manifest needs no torch (`inspect`, `verify`)
from ..codecs.dtypes import dtype_of
from ..codecs.sparse import SPARSE_DTYPES, SPARSE_HEADER
from ..codecs.spec import SAME_AS_LOGITS
from ..errors import RecordingError, verify_command
from . import layout as _layout
from . import manifest as _manifest
from .header import COMPLETE, RECORDING, GenerationHeader, ManifestEntry, ShardEntry, StreamEntry
from .open_files import NUMPY_DTYPES, OpenFiles, Shard, open_encoder, open_file, open_shard, read_guarded
from .stored import StoredGeneration, TransferStats


class ShardSource:
    """Reads one generation's steps from its shards (and its encoder and sequences files), lazily: a
    file is opened, and its header checked against the manifest, when something it holds is first read.

    A missing or damaged file raises `RecordingError` naming it and the `verify` command when it is
    read, never before: the generation's other files, and the recording's other generations, read as
    before. A file `verify` found damaged (`mark`) raises that finding when read.
    """

    def __init__(self, root: Path, entry: dict[str, Any], files: OpenFiles | None = None) -> None:
        self._root = root
        self._entry = entry
        written = ManifestEntry(entry)
        self._index = written.index
        self._stream_info = written.streams
        self.streams = tuple(written.streams)
        self._shards = written.shards
        once = written.once
        self._encoder_file = None if once is None else once.file
        self._encoder_info = {} if once is None else once.streams
        self.once_streams = tuple(self._encoder_info)
        self._sequences_file = written.sequences or None
        self._open = OpenFiles() if files is None else files  # shared by a recording's generations
        self._damaged: dict[str, RecordingError] = {}  # file name -> what `verify` found wrong with it

    @property
    def files(self) -> list[str]:
        """Every file this generation names: its shards, sequences and encoder outputs."""
        return _layout.files_of(self._entry)

    def read(self, name: str, steps: range, rows: Any, *, numpy: bool = False) -> tuple[Any, ...]:
        """Steps `steps` of stream `name`, each indexed by `rows` (None: every row): tensors, or with
        `numpy` NumPy arrays read without torch (where NumPy holds the dtype: a bfloat16 stream still
        gives tensors)."""
        with self._naming_verify():
            return self.read_guarded(name, steps, rows, numpy)

    def read_guarded(self, name: str, steps: range, rows: Any, numpy: bool = False) -> tuple[Any, ...]:
        stream = self._stream_info[name]
        if stream.encoding == SAME_AS_LOGITS:
            name = "logits"  # stored once: the scores were the logits
        if steps.step < 0:
            return tuple(reversed(self.read_guarded(name, steps[::-1], rows, numpy)))
        stream = self._stream_info[name]
        ragged = stream.flat
        numpy = numpy and stream.dtype in NUMPY_DTYPES.values()
        values: list[Any] = []
        for shard in self._shards:
            first = shard.first_step
            wanted = steps[_overlap(steps, range(first, first + shard.num_steps))]
            if not len(wanted):
                continue
            local = range(wanted.start - first, wanted[-1] - first + 1, wanted.step)
            if ragged:
                opened = self._shard(shard)
                picked = opened.ragged(name, local, rows, numpy)
                if stream.as_records:
                    _check_sparse_headers(opened.path, name, picked, stream)
                values.extend(picked)
                continue
            opened = self._shard(shard)
            whole = opened.array(name) if numpy else opened.dense(name)
            picked = whole[local.start : local.stop : local.step]  # mapped: reads nothing yet
            if rows is not None:
                picked = picked[:, rows]  # reads the selected rows only
            values.extend(list(picked) if numpy else picked.unbind(0))
        return tuple(values)

    def ragged_elements(self, name: str, num_steps: int) -> int:
        """Values of ragged stream `name` in its first `num_steps` steps (reads the shapes only)."""
        total = 0
        with self._naming_verify():
            for shard in self._shards:
                count = min(shard.num_steps, num_steps - shard.first_step)
                if count > 0:
                    total += self._shard(shard).ends(name)[count - 1]
        return total

    def read_once(self, name: str) -> torch.Tensor:
        with self._naming_verify():
            return self._encoder().dense(name)

    def sequences(self) -> Any:
        """What `generate()` returned as sequences, read from their file as an int64 NumPy array (None: the
        generation names none)."""
        if self._sequences_file is None:
            return None
        with self._naming_verify():
            return _read_sequences(self._path(self._sequences_file), self._entry)

    def check(self, name: str) -> None:
        """Every check a read makes of file `name` (one of `files`), made now: its header against the
        manifest, each ragged stream's step shapes, the sequences' shape; `RecordingError` naming it."""
        path = _manifest.inside(self._root, name, self._root / _layout.MANIFEST)
        if name == self._sequences_file:
            _read_sequences(path, self._entry, read=False)
        elif name == self._encoder_file:
            open_encoder(path, self._index, self._encoder_info)
        else:
            shard = next(shard for shard in self._shards if shard.file == name)
            opened = open_shard(path, self._index, shard, self._stream_info)
            for stream in opened.ragged_streams:
                opened.ends(stream)

    def mark(self, name: str, damage: RecordingError | None) -> None:
        """Note what `verify` found of file `name`: reading it raises `damage` from now on (None: intact)."""
        self._open.drop(name)
        if damage is None:
            self._damaged.pop(name, None)
        else:
            self._damaged[name] = damage

    def close(self) -> None:
        """Drop the open files (tensors already returned keep their own memory or mapping)."""
        for name in self.files:
            self._open.drop(name)

    @contextlib.contextmanager
    def _naming_verify(self) -> Iterator[None]:
        """A `RecordingError` raised inside also names the command that checks every file."""
        try:
            yield
        except RecordingError as error:
            raise RecordingError(
                error.path, f"{error.problem} Check every file with `{verify_command(self._root)}`; "
                "steps held by intact files read as before.", damaged=(error,),
            ) from None

    def _path(self, name: str) -> Path:
        found = self._damaged.get(name)
        if found is not None:
            raise RecordingError(found.path, f"{found.problem} (found by `verify`)")
        return _manifest.inside(self._root, name, self._root / _layout.MANIFEST)

    def _encoder(self) -> Shard:
        return self._get(self._encoder_file, lambda path: open_encoder(path, self._index, self._encoder_info))

    def _shard(self, shard: ShardEntry) -> Shard:
        return self._get(shard.file, lambda path: open_shard(path, self._index, shard, self._stream_info))

    def _get(self, name: str, opener: Any) -> Shard:
        return self._open.get(name, lambda: opener(self._path(name)))


def _check_sparse_headers(path: Path, name: str, records: list[torch.Tensor], stream: StreamEntry) -> None:
    """Every sparse record decodes to the manifest's `dense` dtype and shape."""
    expected = [*stream.dense_shape, SPARSE_DTYPES.index(dtype_of(stream.dense_dtype))]
    for record in records:
        if record[: SPARSE_HEADER].tolist() != expected:
            raise RecordingError(
                path, f"a record of {name!r} says [rows, vocab, dtype code] {record[: SPARSE_HEADER].tolist()}, "
                f"the manifest {expected}; the file is damaged.",
            )


def _overlap(steps: range, local: range) -> slice:
    """The slice of `steps` (increasing) whose values fall inside `local`."""
    lo = max(0, -(-(local.start - steps.start) // steps.step))
    hi = max(lo, -(-(local.stop - steps.start) // steps.step))
    return slice(lo, min(hi, len(steps)))


def stored_generation(root: Path, entry: dict[str, Any], *, transfer: TransferStats | None = None,
                      files: OpenFiles | None = None) -> StoredGeneration:
    """One manifest entry's generation: its fields, and its files (each checked and read when first
    asked for; `sequences` is then a function that reads them), kept open in `files` (the recording's
    generations share one; default: its own)."""
    source = ShardSource(root, entry, files)
    written = ManifestEntry(entry)
    complete = written.status == COMPLETE
    error = written.stopped("killed, or still running") if written.status == RECORDING else written.error
    return StoredGeneration(
        header=GenerationHeader.from_manifest(entry),
        num_steps=written.num_steps,
        complete=complete,
        error=None if complete else str(error),
        sequences=source.sequences if written.sequences else None,  # read when first asked for
        transfer=transfer,
        source=source,
    )


def _read_sequences(path: Path, entry: dict[str, Any], *, read: bool = True) -> Any:
    """The sequences file's int64 `(sequences, length)` NumPy array (read without torch), its header checked
    against the manifest first (`read=False`: only checked)."""
    handle, _, header = open_file(path, "sequences file")
    if "sequences" not in header:
        raise RecordingError(path, "holds no `sequences` tensor.")
    shape, dtype = header["sequences"]
    if len(shape) != 2 or dtype != "int64":
        raise RecordingError(path, f"`sequences` must be a 2-D int64 tensor, got {shape} {dtype}.")
    returned, length = shape
    written = GenerationHeader.from_manifest(entry)
    prompts = written.num_rows // written.num_beams
    if length < written.prompt_length or returned < 1 or (prompts and returned % prompts):
        raise RecordingError(
            path,
            f"`sequences` {shape} disagree with the manifest (prompt length "
            f"{written.prompt_length}, {prompts} prompt(s)).",
        )
    if not read:
        return None
    return read_guarded(path, lambda: handle.get_tensor("sequences"))


