"""Reading one generation's shards: each file opened, and its header checked, when something it holds is
first read (never at open: a damaged file hides nothing else), data read on demand.

Dense streams are memory-mapped by safetensors (`get_tensor`), so slicing a step or a row reads only
those bytes. A ragged stream (per-layer attentions, hidden states) is read through `get_slice`, one
span of steps at a time: safetensors copies small tensors whole on `get_tensor`, which would read a
whole shard to return one step.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator

import numpy

from .._lazy import torch  # imported when first used: reading a manifest needs no torch (`inspect`, `verify`)
from safetensors import SafetensorError, safe_open

from . import format as _format
from . import manifest as _manifest
from .format import RecordingError
from .stored import StoredGeneration, TransferStats

# Files a recording keeps open for reading (`OpenFiles`), the least recently used dropped first: at most
# this many, and at most this many bytes of them besides the newest. An open file keeps the pages read from
# it mapped, counted in the process's resident set: 64 shards of 64 MiB would hold 4 GiB of each recording
# read through (`compare` reads two); reopening a shard costs a header read.
_OPEN_FILES = 64
_OPEN_BYTES = 512 << 20


class OpenFiles:
    """The files of one recording open for reading, shared by its generations' `ShardSource`s, by name:
    the least recently used is dropped beyond `_OPEN_FILES` files or `_OPEN_BYTES` bytes (sizes on disk)
    besides the newest. Tensors already returned keep their mapping."""

    def __init__(self) -> None:
        self._open: OrderedDict[str, _Shard] = OrderedDict()
        self._bytes = 0

    def get(self, name: str, opener: Any) -> _Shard:
        """File `name`, opened by `opener()` unless it is open."""
        opened = self._open.get(name)
        if opened is not None:
            self._open.move_to_end(name)
            return opened
        opened = self._open[name] = opener()
        self._bytes += opened.size
        while len(self._open) > 1 and (len(self._open) > _OPEN_FILES or self._bytes - opened.size > _OPEN_BYTES):
            self._bytes -= self._open.popitem(last=False)[1].size
        return opened

    def drop(self, name: str) -> None:
        """Close file `name` if it is open."""
        dropped = self._open.pop(name, None)
        if dropped is not None:
            self._bytes -= dropped.size


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
        self._index = entry["index"]
        self._stream_info = entry["streams"]
        self.streams = tuple(entry["streams"])
        self._shards = entry["shards"]
        encoder = entry.get("encoder") or {}
        self._encoder_file = encoder.get("file")
        self._encoder_info = encoder.get("streams", {})
        self.once_streams = tuple(self._encoder_info)
        self._sequences_file = entry.get("sequences") or None
        self._open = OpenFiles() if files is None else files  # shared by a recording's generations
        self._damaged: dict[str, RecordingError] = {}  # file name -> what `verify` found wrong with it

    @property
    def files(self) -> list[str]:
        """Every file this generation names: its shards, sequences and encoder outputs."""
        return _manifest.files_of(self._entry)

    def read(self, name: str, steps: range, rows: Any, *, numpy: bool = False) -> tuple[Any, ...]:
        """Steps `steps` of stream `name`, each indexed by `rows` (None: every row): tensors, or with
        `numpy` NumPy arrays read without torch (where NumPy holds the dtype: a bfloat16 stream still
        gives tensors)."""
        with self._naming_verify():
            return self._read(name, steps, rows, numpy)

    def _read(self, name: str, steps: range, rows: Any, numpy: bool = False) -> tuple[Any, ...]:
        if self._stream_info[name]["encoding"] == _format.SAME_AS_LOGITS:
            name = "logits"  # stored once: the scores were the logits
        if steps.step < 0:
            return tuple(reversed(self._read(name, steps[::-1], rows, numpy)))
        ragged = _format.stored_flat(self._stream_info[name])
        numpy = numpy and self._stream_info[name]["dtype"] in _NUMPY_DTYPES.values()
        values: list[Any] = []
        for shard in self._shards:
            first = shard["first_step"]
            wanted = steps[_overlap(steps, range(first, first + shard["num_steps"]))]
            if not len(wanted):
                continue
            local = range(wanted.start - first, wanted[-1] - first + 1, wanted.step)
            if ragged:
                opened = self._shard(shard)
                picked = opened.ragged(name, local, rows, numpy)
                if _format.stored_as_records(self._stream_info[name]):
                    _check_sparse_headers(opened.path, name, picked, self._stream_info[name]["dense"])
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
                count = min(shard["num_steps"], num_steps - shard["first_step"])
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
        path = _manifest.inside(self._root, name, self._root / _format.MANIFEST)
        if name == self._sequences_file:
            _read_sequences(path, self._entry, read=False)
        elif name == self._encoder_file:
            _open_encoder(path, self._index, self._encoder_info)
        else:
            shard = next(shard for shard in self._shards if shard["file"] == name)
            opened = _open_shard(path, self._index, shard, self._stream_info)
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
                error.path, f"{error.problem} Check every file with `{_format.verify_command(self._root)}`; "
                "steps held by intact files read as before.", damaged=(error,),
            ) from None

    def _path(self, name: str) -> Path:
        found = self._damaged.get(name)
        if found is not None:
            raise RecordingError(found.path, f"{found.problem} (found by `verify`)")
        return _manifest.inside(self._root, name, self._root / _format.MANIFEST)

    def _encoder(self) -> _Shard:
        return self._get(self._encoder_file, lambda path: _open_encoder(path, self._index, self._encoder_info))

    def _shard(self, shard: dict[str, Any]) -> _Shard:
        return self._get(shard["file"], lambda path: _open_shard(path, self._index, shard, self._stream_info))

    def _get(self, name: str, opener: Any) -> _Shard:
        return self._open.get(name, lambda: opener(self._path(name)))


class _Shard:
    """One open safetensors file of a recording."""

    def __init__(self, path: Path, handle: Any, ragged: dict[str, dict[str, Any]]) -> None:
        self.path = path
        self.size = _read(path, lambda: path.stat().st_size)  # bytes on disk
        self._handle = handle  # NumPy's view (`open_file`): headers and step shapes, without torch
        self._tensors: Any = None  # torch's, opened when a tensor is first read
        self._ragged = ragged  # name -> its manifest entry
        self.ragged_streams = tuple(ragged)
        self._dense: dict[str, torch.Tensor] = {}
        self._arrays: dict[str, Any] = {}
        self._shapes: dict[str, tuple[torch.Tensor, list[int]]] = {}

    def dense(self, name: str) -> torch.Tensor:
        tensor = self._dense.get(name)
        if tensor is None:
            tensor = self._dense[name] = _read(self.path, lambda: self._torch().get_tensor(name))
        return tensor

    def array(self, name: str) -> Any:
        """Dense tensor `name` as a NumPy array mapped from the file (copy-on-write, like the tensors):
        slicing it reads only what it picks, and no torch is imported."""
        found = self._arrays.get(name)
        if found is None:
            found = self._arrays[name] = _read(self.path, lambda: _mapped(self.path, name))
        return found

    def _torch(self) -> Any:
        if self._tensors is None:
            self._tensors = _read(self.path, lambda: safe_open(str(self.path), framework="pt"))
        return self._tensors

    def ends(self, name: str) -> list[int]:
        """Cumulative value counts of ragged stream `name`'s steps (its step shapes read and checked once)."""
        return self._shapes_of(name)[1]

    def ragged(self, name: str, local: range, rows: Any, numpy: bool = False) -> list[Any]:
        """Steps `local` (within the shard) of ragged stream `name`: one read of the span they cover (with
        `numpy`, NumPy arrays where NumPy holds the dtype)."""
        shapes, ends = self._shapes_of(name)
        start = ends[local.start - 1] if local.start else 0
        stop = ends[local[-1]]
        if numpy or self._ragged[name]["dtype"] == "int32":  # sparse, native, packed records: no transformers
            span = _read(self.path, lambda: self._handle.get_slice(name)[start:stop])
            if not numpy:
                span = torch.from_numpy(span)
        else:
            from .. import _compat  # imports transformers (safetensors 0.4's warning silenced there)

            span = _read(self.path, lambda: _compat.read_slice(self._torch().get_slice(name), start, stop))
        picked = []
        for t in local:
            begin = (ends[t - 1] if t else 0) - start
            step = span[begin : ends[t] - start].reshape(shapes[t].tolist())
            picked.append(step if rows is None else step[rows])
        return picked

    def _shapes_of(self, name: str) -> tuple[torch.Tensor, list[int]]:
        found = self._shapes.get(name)
        if found is None:
            key = _format.shapes_key(name)
            shapes = _read(self.path, lambda: self._handle.get_slice(key)[:])  # a NumPy array
            fixed = self._ragged[name]["shape"]
            ends = list(itertools.accumulate(math.prod(shape) for shape in shapes.tolist()))  # exact: no int64 wrap
            total = self._handle.get_slice(name).get_shape()[0]
            if bool((shapes < 0).any()) or any(n is not None and bool((shapes[:, i] != n).any()) for i, n in enumerate(fixed)):
                raise RecordingError(self.path, f"the step shapes of {name!r} disagree with the manifest's {fixed}.")
            if (ends[-1] if ends else 0) != total:
                raise RecordingError(self.path, f"the step shapes of {name!r} do not add up to its {total} values; the file is damaged.")
            found = self._shapes[name] = (shapes, ends)
        return found


def _check_sparse_headers(path: Path, name: str, records: list[torch.Tensor], dense: dict[str, Any]) -> None:
    """Every sparse record decodes to the manifest's `dense` dtype and shape."""
    expected = [*dense["shape"], _format.SPARSE_DTYPES.index(_format.dtype_of(dense["dtype"]))]
    for record in records:
        if record[: _format.SPARSE_HEADER].tolist() != expected:
            raise RecordingError(
                path, f"a record of {name!r} says [rows, vocab, dtype code] {record[: _format.SPARSE_HEADER].tolist()}, "
                f"the manifest {expected}; the file is damaged.",
            )


def _read(path: Path, read: Any) -> Any:
    try:
        return read()
    except (SafetensorError, OSError, RuntimeError) as error:
        raise RecordingError(path, f"cannot be read ({error}); the file is damaged.") from None


def _overlap(steps: range, local: range) -> slice:
    """The slice of `steps` (increasing) whose values fall inside `local`."""
    lo = max(0, -(-(local.start - steps.start) // steps.step))
    hi = max(lo, -(-(local.stop - steps.start) // steps.step))
    return slice(lo, min(hi, len(steps)))


def _open_shard(path: Path, generation: int, shard: dict[str, Any], streams: dict[str, Any]) -> _Shard:
    """Open one shard (nothing read but its header) and check it against the manifest."""
    handle, metadata, header = open_file(path, "shard")
    fields = _format.read_shard_metadata(metadata)
    expected = {"format": _format.FORMAT, "generation": generation, "first_step": shard["first_step"]}
    for key in expected:
        if fields.get(key) != expected[key]:
            raise RecordingError(
                path,
                f"its metadata says {key}={fields.get(key)!r}, the manifest expects {expected[key]!r}: "
                "this is not the shard the manifest names.",
            )
    ragged = {}
    for name, stream in streams.items():
        if stream["encoding"] == _format.SAME_AS_LOGITS:
            continue  # no tensor of its own
        if name not in header:
            raise RecordingError(path, f"holds no {name!r} tensor, which the manifest lists.")
        if _format.stored_flat(stream):
            _expect(path, header, name, None, stream["dtype"], flat=True)
            _expect(path, header, _format.shapes_key(name), [shard["num_steps"], len(stream["shape"])], "int64")
            ragged[name] = stream
        else:
            _expect(path, header, name, [shard["num_steps"], *stream["shape"]], stream["dtype"])
    return _Shard(path, handle, ragged)


def _open_encoder(path: Path, generation: int, streams: dict[str, Any]) -> _Shard:
    """Open a generation's encoder file and check it against the manifest."""
    handle, metadata, header = open_file(path, "encoder file")
    fields = _format.read_shard_metadata(metadata)
    if fields.get("format") != _format.FORMAT or fields.get("generation") != generation:
        raise RecordingError(path, f"its metadata does not name generation {generation}: not the file the manifest names.")
    for name, stream in streams.items():
        _expect(path, header, name, stream["shape"], stream["dtype"])
    return _Shard(path, handle, {})


def _expect(path: Path, header: dict[str, tuple[list[int], str]], name: str, shape: list[int] | None, dtype: str,
            *, flat: bool = False) -> None:
    found = header.get(name)
    wrong = found is None or found[1] != dtype or (len(found[0]) != 1 if flat else found[0] != shape)
    if wrong:
        what = "nothing" if found is None else f"{found[0]} {found[1]}"
        wanted = f"flat {dtype}" if flat else f"{shape} {dtype}"
        raise RecordingError(path, f"tensor {name!r} is {what}, the manifest says {wanted}.")


def open_file(path: Path, what: str) -> tuple[Any, dict[str, str] | None, dict[str, tuple[list[int], str]]]:
    """A safetensors file opened (nothing read but its header): the handle (NumPy's: it reads no torch
    tensor, `safe_open(path, framework="pt")` does), its metadata, and each tensor's shape and dtype name;
    or `RecordingError`."""
    try:
        found, regular = path.exists(), path.is_file()
    except OSError as error:
        raise RecordingError(path, f"cannot be looked up ({error.strerror}).") from None
    if not regular:
        state = "is not a regular file" if found else "is not there"
        raise RecordingError(path, f"missing: the manifest names this {what} but the file {state}.")
    try:
        handle = safe_open(str(path), framework="numpy")
        header = {}
        for name in handle.keys():
            view = handle.get_slice(name)
            header[name] = (list(view.get_shape()), _format.SAFETENSORS_DTYPES.get(view.get_dtype(), view.get_dtype()))
        return handle, handle.metadata(), header
    except (SafetensorError, OSError, RuntimeError) as error:
        raise RecordingError(path, f"not a readable safetensors {what} ({error}); the file is damaged.") from None


def stored_generation(root: Path, entry: dict[str, Any], *, stats: TransferStats | None = None,
                      files: OpenFiles | None = None) -> StoredGeneration:
    """One manifest entry's generation: its fields, and its files (each checked and read when first
    asked for; `sequences` is then a function that reads them), kept open in `files` (the recording's
    generations share one; default: its own)."""
    source = ShardSource(root, entry, files)
    status = entry["status"]
    error = entry.get("error")
    if status == "recording":
        error = (
            "the recording process stopped before this generation ended (killed, or still running): "
            f"{entry['num_steps']} step(s) were committed"
        )
    lengths = entry.get("prompt_lengths")
    fields = dict(
        index=entry["index"],
        mode=entry["mode"],
        prompt_length=entry["prompt_length"],
        prompt_lengths=None if lengths is None else tuple(lengths),
        num_rows=entry["num_rows"],
        num_beams=entry["num_beams"],
        num_steps=entry["num_steps"],
        complete=status == "complete",
        error=None if status == "complete" else str(error),
        sequences=source.sequences if entry.get("sequences") else None,  # read when first asked for
        pad_token_id=entry.get("pad_token_id"),
        eos_token_id=tuple(entry["eos_token_id"]),
        generation_config=dict(entry["generation_config"]),
        stats=stats,
        layers=entry.get("layers"),
        encodings=_format.read_encodings({name: stream["encoding"] for name, stream in entry["streams"].items()}),
        sample_ids=None if entry.get("sample_ids") is None else tuple(entry["sample_ids"]),
        sample_metadata=None if entry.get("sample_metadata") is None else tuple(entry["sample_metadata"]),
        loop=entry.get("loop"),
        nested_calls=entry.get("nested_calls", 0),
    )
    return StoredGeneration(fields, source)


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
    prompts = entry["num_rows"] // entry["num_beams"]
    if length < entry["prompt_length"] or returned < 1 or (prompts and returned % prompts):
        raise RecordingError(
            path,
            f"`sequences` {shape} disagree with the manifest (prompt length "
            f"{entry['prompt_length']}, {prompts} prompt(s)).",
        )
    if not read:
        return None
    return _read(path, lambda: handle.get_tensor("sequences"))


# safetensors' dtype names NumPy holds (bfloat16 is not among them: such streams read through torch).
_NUMPY_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64", "I32": "int32",
                 "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def _mapped(path: Path, name: str) -> Any:
    """Tensor `name` of safetensors file `path` as a copy-on-write `numpy.memmap` (the format: an 8-byte
    little-endian header length, the JSON header with each tensor's dtype, shape and byte offsets, then
    the data)."""
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(length))
    info = header[name]
    begin, end = info["data_offsets"]
    shape = tuple(info["shape"])
    dtype = numpy.dtype(_NUMPY_DTYPES[info["dtype"]])
    if end == begin:  # nothing to map
        return numpy.zeros(shape, dtype)
    return numpy.memmap(path, dtype=dtype, mode="c", offset=8 + length + begin, shape=shape)
