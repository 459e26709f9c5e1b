"""A recording's safetensors files opened for reading: each opened when something it holds is first read,
its safetensors header checked against the manifest then, its tensors mapped lazily (copy-on-write), and
at most a bounded number kept open (`OpenFiles`)."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator

import numpy
from safetensors import SafetensorError, safe_open

from .._lazy import torch  # imported when first used: reading a manifest needs no torch (`inspect`, `verify`)
from ..codecs.dtypes import SAFETENSORS_DTYPES
from ..codecs.spec import SAME_AS_LOGITS
from ..errors import RecordingError
from . import layout as _layout
from .header import ShardEntry, StreamEntry

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
        self._open: OrderedDict[str, Shard] = OrderedDict()
        self._bytes = 0
        self._budget = _OPEN_BYTES  # bytes kept open besides the newest file

    def get(self, name: str, opener: Any) -> Shard:
        """File `name`, opened by `opener()` unless it is open."""
        opened = self._open.get(name)
        if opened is not None:
            self._open.move_to_end(name)
            return opened
        opened = self._open[name] = opener()
        self._bytes += opened.size
        self._trim()
        return opened

    def _trim(self) -> None:
        while len(self._open) > 1 and (len(self._open) > _OPEN_FILES or
                                       self._bytes - next(reversed(self._open.values())).size > self._budget):
            self._bytes -= self._open.popitem(last=False)[1].size

    @contextlib.contextmanager
    def in_order(self) -> Iterator[None]:
        """Within the block, only the newest file stays open (and mapped): for reading once, in order,
        whose passed pages are then let go, so the resident set holds one file whatever the length."""
        saved, self._budget = self._budget, 0
        try:
            self._trim()
            yield
        finally:
            self._budget = saved

    def drop(self, name: str) -> None:
        """Close file `name` if it is open."""
        dropped = self._open.pop(name, None)
        if dropped is not None:
            self._bytes -= dropped.size


class Shard:
    """One open safetensors file of a recording."""

    def __init__(self, path: Path, handle: Any, ragged: dict[str, StreamEntry]) -> None:
        self.path = path
        self.size = read_guarded(path, lambda: path.stat().st_size)  # bytes on disk
        self._handle = handle  # NumPy's view (`open_file`): headers and step shapes, without torch
        self._tensors: Any = None  # torch's, opened when a tensor is first read
        self._ragged = ragged  # name -> its manifest entry (the ragged streams: stored flat)
        self.ragged_streams = tuple(ragged)
        self._dense: dict[str, torch.Tensor] = {}
        self._arrays: dict[str, Any] = {}
        self._shapes: dict[str, tuple[torch.Tensor, list[int]]] = {}

    def dense(self, name: str) -> torch.Tensor:
        tensor = self._dense.get(name)
        if tensor is None:
            tensor = self._dense[name] = read_guarded(self.path, lambda: self._torch().get_tensor(name))
        return tensor

    def array(self, name: str) -> Any:
        """Dense tensor `name` as a NumPy array mapped from the file (copy-on-write, like the tensors):
        slicing it reads only what it picks, and no torch is imported."""
        found = self._arrays.get(name)
        if found is None:
            found = self._arrays[name] = read_guarded(self.path, lambda: _mapped(self.path, name))
        return found

    def _torch(self) -> Any:
        if self._tensors is None:
            self._tensors = read_guarded(self.path, lambda: safe_open(str(self.path), framework="pt"))
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
        if numpy or self._ragged[name].dtype == "int32":  # sparse, native, packed records: no transformers
            span = self.array(name)[start:stop]  # mapped: the records are read where they lie
            if not numpy:
                span = torch.from_numpy(span)
        else:
            from .. import _compat  # imports transformers (safetensors 0.4's warning silenced there)

            span = read_guarded(self.path, lambda: _compat.read_slice(self._torch().get_slice(name), start, stop))
        picked = []
        for t in local:
            begin = (ends[t - 1] if t else 0) - start
            step = span[begin : ends[t] - start].reshape(shapes[t].tolist())
            picked.append(step if rows is None else step[rows])
        return picked

    def _shapes_of(self, name: str) -> tuple[torch.Tensor, list[int]]:
        found = self._shapes.get(name)
        if found is None:
            key = _layout.shapes_key(name)
            shapes = read_guarded(self.path, lambda: self._handle.get_slice(key)[:])  # a NumPy array
            fixed = self._ragged[name].shape
            ends = list(itertools.accumulate(math.prod(shape) for shape in shapes.tolist()))  # exact: no int64 wrap
            total = self._handle.get_slice(name).get_shape()[0]
            if bool((shapes < 0).any()) or any(n is not None and bool((shapes[:, i] != n).any()) for i, n in enumerate(fixed)):
                raise RecordingError(self.path, f"the step shapes of {name!r} disagree with the manifest's {fixed}.")
            if (ends[-1] if ends else 0) != total:
                raise RecordingError(self.path, f"the step shapes of {name!r} do not add up to its {total} values; "
                                                "the file is damaged.")
            found = self._shapes[name] = (shapes, ends)
        return found


def open_shard(path: Path, generation: int, shard: ShardEntry, streams: dict[str, StreamEntry]) -> Shard:
    """Open one shard (nothing read but its header) and check it against the manifest."""
    handle, metadata, header = open_file(path, "shard")
    fields = _layout.read_shard_metadata(metadata)
    expected = {"format": _layout.FORMAT, "generation": generation, "first_step": shard.first_step}
    for key in expected:
        if fields.get(key) != expected[key]:
            raise RecordingError(
                path,
                f"its metadata says {key}={fields.get(key)!r}, the manifest expects {expected[key]!r}: "
                "this is not the shard the manifest names.",
            )
    ragged = {}
    for name, stream in streams.items():
        if stream.encoding == SAME_AS_LOGITS:
            continue  # no tensor of its own
        if name not in header:
            raise RecordingError(path, f"holds no {name!r} tensor, which the manifest lists.")
        if stream.flat:
            _expect(path, header, name, None, stream.dtype, flat=True)
            _expect(path, header, _layout.shapes_key(name), [shard.num_steps, len(stream.shape)], "int64")
            ragged[name] = stream
        else:
            _expect(path, header, name, [shard.num_steps, *stream.shape], stream.dtype)
    return Shard(path, handle, ragged)


def open_encoder(path: Path, generation: int, streams: dict[str, StreamEntry]) -> Shard:
    """Open a generation's encoder file and check it against the manifest."""
    handle, metadata, header = open_file(path, "encoder file")
    fields = _layout.read_shard_metadata(metadata)
    if fields.get("format") != _layout.FORMAT or fields.get("generation") != generation:
        raise RecordingError(path, f"its metadata does not name generation {generation}: not the file the manifest names.")
    for name, stream in streams.items():
        _expect(path, header, name, stream.shape, stream.dtype)
    return Shard(path, handle, {})


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
            header[name] = (list(view.get_shape()), SAFETENSORS_DTYPES.get(view.get_dtype(), view.get_dtype()))
        return handle, handle.metadata(), header
    except (SafetensorError, OSError, RuntimeError) as error:
        raise RecordingError(path, f"not a readable safetensors {what} ({error}); the file is damaged.") from None


# safetensors' dtype names NumPy holds (bfloat16 is not among them: such streams read through torch).
NUMPY_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64", "I32": "int32",
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
    dtype = numpy.dtype(NUMPY_DTYPES[info["dtype"]])
    if end == begin:  # nothing to map
        return numpy.zeros(shape, dtype)
    return numpy.memmap(path, dtype=dtype, mode="c", offset=8 + length + begin, shape=shape)


def read_guarded(path: Path, read: Any) -> Any:
    try:
        return read()
    except (SafetensorError, OSError, RuntimeError) as error:
        raise RecordingError(path, f"cannot be read ({error}); the file is damaged.") from None
