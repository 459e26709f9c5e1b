"""The reader: a recording directory opened lazily, its shards memory-mapped with safetensors."""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open

from . import _format
from ._format import RecordingError
from .recording import Generation, Readable, TransferStats, pick

_OPEN_SHARDS = 64  # shard files kept mapped per recording (least recently used are dropped)


def open_recording(path: str | os.PathLike) -> Recording:
    """Open a recording directory written by `Recorder(model, spill_dir=path)`.

    The manifest and every shard's header are checked at once; tensor data is read only when asked
    for, and only the selected steps and rows.

    Args:
        path (`str | os.PathLike`): the recording directory (the `spill_dir` the recorder was given).

    Returns:
        `Recording`: the recording's generations, with the recorder's accessors.

    Raises:
        RecordingError: the directory is missing, not a recording, of an unknown format version,
            damaged (truncated shard, corrupted header, a shape or dtype that disagrees with the
            manifest) or hostile (a manifest naming a file outside the directory). The error's `path`
            names the file.

    Example:
        >>> run = open_recording("run/")  # doctest: +SKIP
        >>> run.logits(steps=slice(0, 4), rows=[0])[0].shape  # doctest: +SKIP
        torch.Size([1, 49152])
    """
    return Recording(Path(path))


class Recording(Readable):
    """A recording directory: its generations, oldest first, read lazily from the shards.

    `logits()`, `scores()`, `tokens()`, `finished()`, `beam_parents()` and `beam_indices()` read one
    generation (default: the latest) with the same contract as the `Recorder`'s (equal tensors); `for
    gen in recording` iterates over the `Generation`s. Returned tensors map the shard files
    copy-on-write; `close()` drops this object's own mappings.

    Attributes:
        path (`pathlib.Path`): the directory.
        format_version (`int`): the format version it was written with.
        created_by (`dict[str, str]`): versions of transformers-offload, transformers, torch,
            safetensors and Python that wrote it.
        model (`dict`): the recorded model's class, `name_or_path`, config class and vocabulary size.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        manifest = _format.read_manifest(path)
        self.format_version: int = manifest["format_version"]
        self.created_by: dict[str, Any] = manifest["created_by"]
        self.model: dict[str, Any] = manifest["model"]
        self._entries: list[dict[str, Any]] = manifest["generations"]
        self._generations = tuple(generation_from_entry(path, entry) for entry in self._entries)

    @property
    def generations(self) -> tuple[Generation, ...]:
        """Every generation of the recording, oldest first (incomplete ones included)."""
        return self._generations

    def generation(self, index: int = -1) -> Generation:
        """One generation by index (default: the latest).

        Raises:
            LookupError: the recording holds no generation, or `index` is out of range.
        """
        return pick(self._generations, index, f"the recording in {str(self.path)!r} holds no generation.")

    def __iter__(self) -> Iterator[Generation]:
        return iter(self._generations)

    def __len__(self) -> int:
        return len(self._generations)

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary: versions, model, and per generation its state, sizes and streams.

        Each stream gives its `dtype`, `encoding`, per-step `shape` and `bytes` (of the readable
        steps); each generation its `file_bytes` on disk (shards and sequences).
        """
        generations = []
        for generation, entry in zip(self._generations, self._entries):
            streams = {}
            encoder = entry.get("encoder") or {}
            for name, stream in [*entry["streams"].items(), *encoder.get("streams", {}).items()]:
                itemsize = _format.dtype_of(stream["dtype"]).itemsize
                if stream["encoding"] == "ragged":
                    elements = generation._source.ragged_elements(name, generation.num_steps)
                elif name in encoder.get("streams", {}):
                    elements = math.prod(stream["shape"])  # once per generation
                else:
                    elements = generation.num_steps * math.prod(stream["shape"])
                streams[name] = {
                    "dtype": stream["dtype"],
                    "encoding": stream["encoding"],
                    "shape": stream["shape"],
                    "bytes": elements * itemsize,
                }
            files = [shard["file"] for shard in entry["shards"]] + [entry["sequences"]] * bool(entry.get("sequences"))
            files += [encoder["file"]] if encoder else []
            generations.append(
                {
                    "index": generation.index,
                    "mode": generation.mode,
                    "status": entry["status"],
                    "complete": generation.complete,
                    "error": generation.error,
                    "num_steps": generation.num_steps,
                    "num_rows": generation.num_rows,
                    "num_beams": generation.num_beams,
                    "prompt_length": generation.prompt_length,
                    "num_shards": len(entry["shards"]),
                    "file_bytes": sum(_size_of(self.path / name) for name in files),
                    "streams": streams,
                }
            )
        return {
            "path": str(self.path),
            "format_version": self.format_version,
            "created_by": self.created_by,
            "model": self.model,
            "generations": generations,
        }

    def close(self) -> None:
        """Drop the shard mappings this object holds (tensors already returned keep theirs)."""
        for generation in self._generations:
            source = generation._source
            if isinstance(source, ShardSource):
                source.close()

    def __enter__(self) -> Recording:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Recording({str(self.path)!r}, {len(self._generations)} generation(s))"


def generation_from_entry(root: Path, entry: dict[str, Any], *, stats: TransferStats | None = None) -> Generation:
    """A `Generation` reading the shards that one manifest entry names (checked here, read lazily)."""
    manifest_path = root / _format.MANIFEST
    source = ShardSource(root, entry)
    sequences = None
    if entry.get("sequences"):
        sequences = _read_sequences(_format.inside(root, entry["sequences"], manifest_path), entry)
    status = entry["status"]
    error = entry.get("error")
    if status == "recording":
        error = (
            "the recording process stopped before this generation ended (killed, or still running): "
            f"{entry['num_steps']} step(s) were committed"
        )
    lengths = entry.get("prompt_lengths")
    return Generation(
        index=entry["index"],
        mode=entry["mode"],
        prompt_length=entry["prompt_length"],
        prompt_lengths=None if lengths is None else tuple(lengths),
        num_rows=entry["num_rows"],
        num_beams=entry["num_beams"],
        num_steps=entry["num_steps"],
        complete=status == "complete",
        error=None if status == "complete" else str(error),
        sequences=sequences,
        pad_token_id=entry.get("pad_token_id"),
        eos_token_id=tuple(entry["eos_token_id"]),
        generation_config=dict(entry["generation_config"]),
        stats=stats,
        layers=entry.get("layers"),
        _source=source,
    )


def _size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as error:
        raise RecordingError(path, f"cannot be read any more ({error.strerror}): was it deleted?") from None


class ShardSource:
    """Reads one generation's steps from its shards; each shard is checked when first opened."""

    def __init__(self, root: Path, entry: dict[str, Any]) -> None:
        self._root = root
        self._index = entry["index"]
        self._stream_info = entry["streams"]
        self.streams = tuple(entry["streams"])
        self._shards = entry["shards"]
        encoder = entry.get("encoder") or {}
        self._encoder_file = encoder.get("file")
        self._encoder_info = encoder.get("streams", {})
        self.once_streams = tuple(self._encoder_info)
        self._mapped: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        for shard in self._shards:  # headers only: the data stays on disk until read
            self._tensors(shard)
        if self._encoder_file is not None:
            self._encoder()
        self.close()

    def read(self, name: str, steps: range, rows: Any) -> tuple[torch.Tensor, ...]:
        if steps.step < 0:
            return tuple(reversed(self.read(name, steps[::-1], rows)))
        ragged = self._stream_info[name]["encoding"] == "ragged"
        values: list[torch.Tensor] = []
        for shard in self._shards:
            first = shard["first_step"]
            wanted = steps[_overlap(steps, range(first, first + shard["num_steps"]))]
            if not len(wanted):
                continue
            tensors = self._tensors(shard)
            if ragged:
                values.extend(_ragged_steps(tensors, name, range(wanted.start - first, wanted[-1] - first + 1, wanted.step), rows))
                continue
            tensor = tensors[name]  # memory-mapped: slicing reads nothing yet
            picked = tensor[wanted.start - first : wanted[-1] - first + 1 : wanted.step]
            if rows is not None:
                picked = picked[:, rows]  # reads the selected rows only
            values.extend(picked.unbind(0))
        return tuple(values)

    def ragged_elements(self, name: str, num_steps: int) -> int:
        """Values of ragged stream `name` in its first `num_steps` steps (reads the shapes only)."""
        total = 0
        for shard in self._shards:
            count = min(shard["num_steps"], num_steps - shard["first_step"])
            if count > 0:
                total += int(self._tensors(shard)[_format.shapes_key(name)][:count].prod(dim=1).sum())
        return total

    def read_once(self, name: str, rows: Any) -> torch.Tensor:
        tensor = self._encoder()[name]
        return tensor if rows is None else tensor[rows]

    def close(self) -> None:
        self._mapped.clear()

    def _encoder(self) -> dict[str, torch.Tensor]:
        name = self._encoder_file
        mapped = self._mapped.get(name)
        if mapped is None:
            path = _format.inside(self._root, name, self._root / _format.MANIFEST)
            mapped = self._mapped[name] = _map_encoder(path, self._index, self._encoder_info)
        return mapped

    def _tensors(self, shard: dict[str, Any]) -> dict[str, torch.Tensor]:
        name = shard["file"]
        mapped = self._mapped.get(name)
        if mapped is not None:
            self._mapped.move_to_end(name)
            return mapped
        path = _format.inside(self._root, name, self._root / _format.MANIFEST)
        mapped = _map_shard(path, self._index, shard, self._stream_info)
        self._mapped[name] = mapped
        if len(self._mapped) > _OPEN_SHARDS:
            self._mapped.popitem(last=False)
        return mapped


def _ragged_steps(tensors: dict[str, torch.Tensor], name: str, local: range, rows: Any) -> list[torch.Tensor]:
    """Steps `local` (indices within the shard) of ragged stream `name`: views of its flat values."""
    shapes = tensors[_format.shapes_key(name)]
    ends = shapes.prod(dim=1).cumsum(0).tolist()
    flat = tensors[name]
    picked = []
    for t in local:
        start = ends[t - 1] if t else 0
        step = flat[start : ends[t]].view(shapes[t].tolist())
        picked.append(step if rows is None else step[rows])
    return picked


def _overlap(steps: range, local: range) -> slice:
    """The slice of `steps` (increasing) whose values fall inside `local`."""
    lo = max(0, -(-(local.start - steps.start) // steps.step))
    hi = max(lo, -(-(local.stop - steps.start) // steps.step))
    return slice(lo, min(hi, len(steps)))


def _map_shard(path: Path, generation: int, shard: dict[str, Any], streams: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Open one shard (memory-mapped, nothing read) and check it against the manifest."""
    raw_metadata, tensors = _map(path, "shard")
    metadata = _format.read_shard_metadata(raw_metadata)
    expected = {"format": _format.FORMAT, "generation": generation, "first_step": shard["first_step"]}
    for key in expected:
        if metadata.get(key) != expected[key]:
            raise RecordingError(
                path,
                f"its metadata says {key}={metadata.get(key)!r}, the manifest expects {expected[key]!r}: "
                "this is not the shard the manifest names.",
            )
    for name, stream in streams.items():
        tensor = tensors.get(name)
        if tensor is None:
            raise RecordingError(path, f"holds no {name!r} tensor, which the manifest lists.")
        if stream["encoding"] == "ragged":
            _check_ragged(path, name, stream, tensor, tensors.get(_format.shapes_key(name)), shard["num_steps"])
            continue
        shape = [shard["num_steps"], *stream["shape"]]
        if list(tensor.shape) != shape or tensor.dtype != _format.dtype_of(stream["dtype"]):
            raise RecordingError(
                path,
                f"tensor {name!r} is {list(tensor.shape)} {_format.dtype_name(tensor.dtype)}, the manifest "
                f"says {shape} {stream['dtype']}.",
            )
    return tensors


def _check_ragged(path: Path, name: str, stream: dict[str, Any], values: torch.Tensor, shapes: torch.Tensor | None,
                  num_steps: int) -> None:
    """A ragged stream's flat values and per-step shapes agree with each other and with the manifest."""
    fixed = stream["shape"]
    problem = None
    if shapes is None or shapes.dtype != torch.int64 or list(shapes.shape) != [num_steps, len(fixed)]:
        problem = f"its {_format.shapes_key(name)!r} tensor is missing or not int64 [{num_steps}, {len(fixed)}]"
    elif values.dim() != 1 or values.dtype != _format.dtype_of(stream["dtype"]):
        problem = f"tensor {name!r} is {list(values.shape)} {_format.dtype_name(values.dtype)}, not flat {stream['dtype']}"
    elif bool((shapes < 0).any()) or any(n is not None and bool((shapes[:, i] != n).any()) for i, n in enumerate(fixed)):
        problem = f"the step shapes of {name!r} disagree with the manifest's {fixed}"
    elif int(shapes.prod(dim=1).sum()) != values.numel():
        problem = f"the step shapes of {name!r} do not add up to its {values.numel()} values"
    if problem:
        raise RecordingError(path, problem + "; the file is damaged or not the one the manifest names.")


def _map_encoder(path: Path, generation: int, streams: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Open a generation's encoder file (memory-mapped) and check it against the manifest."""
    raw_metadata, tensors = _map(path, "encoder file")
    metadata = _format.read_shard_metadata(raw_metadata)
    if metadata.get("format") != _format.FORMAT or metadata.get("generation") != generation:
        raise RecordingError(path, f"its metadata does not name generation {generation}: not the file the manifest names.")
    for name, stream in streams.items():
        tensor = tensors.get(name)
        if tensor is None or list(tensor.shape) != stream["shape"] or tensor.dtype != _format.dtype_of(stream["dtype"]):
            found = "nothing" if tensor is None else f"{list(tensor.shape)} {_format.dtype_name(tensor.dtype)}"
            raise RecordingError(path, f"{name!r} is {found}, the manifest says {stream['shape']} {stream['dtype']}.")
    return tensors


def _map(path: Path, what: str) -> tuple[dict[str, str] | None, dict[str, torch.Tensor]]:
    """A safetensors file's metadata and tensors, memory-mapped (nothing read), or `RecordingError`."""
    if not path.is_file():
        raise RecordingError(path, f"missing: the manifest names this {what} but the file is not there.")
    try:
        with safe_open(str(path), framework="pt") as file:
            return file.metadata(), {name: file.get_tensor(name) for name in file.keys()}
    except (SafetensorError, OSError, RuntimeError) as error:
        raise RecordingError(path, f"not a readable safetensors {what} ({error}); the file is damaged.") from None


def _read_sequences(path: Path, entry: dict[str, Any]) -> torch.Tensor:
    sequences = _map(path, "sequences file")[1].get("sequences")
    if sequences is None:
        raise RecordingError(path, "holds no `sequences` tensor.")
    if sequences.dim() != 2 or sequences.dtype != torch.int64:
        raise RecordingError(path, f"`sequences` must be a 2-D int64 tensor, got {list(sequences.shape)} {sequences.dtype}.")
    returned, length = sequences.shape
    prompts = entry["num_rows"] // entry["num_beams"]
    if length < entry["prompt_length"] or returned < 1 or (prompts and returned % prompts):
        raise RecordingError(
            path,
            f"`sequences` {list(sequences.shape)} disagree with the manifest (prompt length "
            f"{entry['prompt_length']}, {prompts} prompt(s)).",
        )
    return sequences
