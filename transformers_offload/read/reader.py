"""The reader: a recording directory opened lazily, its shards memory-mapped with safetensors."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any

from ..codecs.dtypes import DTYPE_BYTES
from ..codecs.spec import RECORD_ENCODINGS, SAME_AS_LOGITS, is_packed
from ..errors import RecordingError, damaged_files
from ..store import files as _files
from ..store import layout as _layout
from ..store import ledger as _ledger
from ..store import manifest as _manifest
from ..store.header import ManifestEntry
from ..store.location import local_directory
from ..store.open_files import OpenFiles
from ..store.shard_reader import ShardSource, stored_generation
from .generation import generation_of
from .ranks import RankedRecording
from .readable import Readable


def open_recording(path: str | os.PathLike, *, verify: bool = False) -> Recording | RankedRecording:
    """Open a recording directory written by `Recorder(model, spill_dir=path)`, or the directory of a
    data-parallel `record` run, whose ranks it reads as one recording (`read.ranks.RankedRecording`).

    The manifest is read and checked at once; each shard is opened, and its header checked against the
    manifest, when a step it holds is first read, and only the selected steps and rows are read. A
    missing or damaged shard (or sequences or encoder file) hides nothing else: every other step reads
    as before, and reading what the damaged file holds raises `RecordingError` naming it and the
    command that checks every file (`python -m transformers_offload verify PATH`). With `verify=True`
    every byte of every file is read once first and checked against the checksum the recorder wrote
    (`Recording.verify()`).

    Args:
        path (`str | os.PathLike`): the recording directory (the `spill_dir` the recorder was given).
        verify (`bool`, *optional*, defaults to False): check every file's size and CRC-32C against
            the manifest before returning (reads the whole recording: about the disk's read speed).

    Returns:
        `Recording`: the recording's generations, with the recorder's accessors; for a directory with no
        manifest of its own but rank sub-directories (`rank-0`, `rank-1`...), a `RankedRecording` with
        the same accessors over every rank's generations, ordered by sample id.

    Raises:
        RecordingError: the directory is missing, not a recording, of an unknown format version, or its
            manifest is damaged or hostile (not JSON, a field of the wrong type, a file name leading
            outside the directory): without it there is nothing to read. With `verify`, also any file
            missing or damaged (a size, checksum or header that differs from the manifest; every such
            file is listed, in the error's `damaged`), or a recording written before checksums (it
            carries none to check: open it without `verify`). The error's `path` names the file (the
            directory when `verify` found several). A damaged shard raises when it is read, not here.

    Example:
        >>> run = open_recording("run/")  # doctest: +SKIP
        >>> run.logits(steps=slice(0, 4), rows=[0])[0].shape  # doctest: +SKIP
        torch.Size([1, 49152])
    """
    root = local_directory(path, "the recording")
    if not (root / _layout.MANIFEST).exists() and _layout.rank_directories(root):
        recording: Recording | RankedRecording = RankedRecording(root, Recording)  # each rank a Recording
    else:
        recording = Recording(root)
    if verify:
        recording.verify()
    return recording


class Recording(Readable):
    """A recording directory: its generations, oldest first, read lazily from the shards.

    `logits()`, `scores()`, `tokens()`, `finished()`, `beam_parents()` and `beam_indices()` read one
    generation (default: the latest) with the same contract as the `Recorder`'s (equal tensors); `for
    gen in recording` iterates over the `Generation`s. Returned tensors map the shard files
    copy-on-write; `close()` drops this object's own mappings. Reading a step held by a missing or
    damaged file raises `RecordingError` naming the file; `verify()` lists every damaged file.

    Attributes:
        path (`pathlib.Path`): the directory.
        format_version (`int`): the format version it was written with.
        created_by (`dict[str, str]`): versions of transformers-offload, transformers, torch,
            safetensors and Python that wrote it.
        model (`dict`): the recorded model's class, `name_or_path`, config class and vocabulary size.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        manifest = _manifest.read_manifest(path)
        self.format_version: int = manifest["format_version"]
        self.created_by: dict[str, Any] = manifest["created_by"]
        self.model: dict[str, Any] = manifest["model"]
        self._entries: list[dict[str, Any]] = manifest["generations"]
        self._file_records: dict[str, dict[str, Any]] | None = manifest.get("files")
        self._files = OpenFiles()  # one bound on the open shards (and their mapped pages) for all generations
        self._generations = tuple(generation_of(stored_generation(path, entry, files=self._files))
                                  for entry in self._entries)

    def in_order(self) -> contextlib.AbstractContextManager[None]:
        """A context in which the recording keeps only the shard it last read from open (and mapped),
        instead of up to 512 MiB of them: for one pass over its steps in order (`compare` takes it), whose
        resident memory then holds one shard (64 MiB by default) however long the recording."""
        return self._files.in_order()

    def _none_recorded(self) -> str:
        return f"the recording in {str(self.path)!r} holds no generation."

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary: versions, model, whether its files carry checksums, and per generation
        its state, sizes and streams.

        Each stream gives its `dtype`, `encoding`, per-step `shape` (`once`: true for a stream recorded once per call:
        encoder outputs, prompt logprobs) and `bytes` (of the readable
        steps); a stream whose readers give back dense tensors (`"sparse"`, `"native"`, and scores stored once
        with such logits) gives those tensors' `dtype` and `shape`, and its records' own dtype as
        `stored_dtype`; an encoded one (`"sparse"`, `"native"`, `"topk:K"`) also `dense_bytes`, what the same steps would take as
        float32 `(rows, vocab_size)` tensors (`scores` stored once with the logits, `"same_as_logits"`, take
        0 bytes of their own); each generation its `file_bytes` on disk (shards and
        sequences), its `prompt_lengths` (non-padding tokens per prompt; None without an attention
        mask), its `sample_ids` (from `Recorder.set_samples`, or None), its `generation_config` (the settings that differ
        from the defaults,
        `GenerationConfig.to_diff_dict()`) and its `damaged_files`: `{"file", "error"}` for each file seen damaged
        without reading its data (missing, of another size than written, or with a header a ragged
        stream's `bytes` could not be read from: those are then None; `verify()` reads every byte).
        """
        generations = []
        for generation, entry in zip(self._generations, self._entries):
            streams = {}
            damaged = self._damaged_at_a_glance(_layout.files_of(entry))
            written = ManifestEntry(entry)
            once = {} if written.once is None else written.once.streams
            for name, stream in [*written.streams.items(), *once.items()]:
                itemsize = DTYPE_BYTES[stream.dtype]
                if stream.encoding == SAME_AS_LOGITS:
                    elements = 0  # stored once, as the logits
                elif stream.flat:
                    try:  # reads each shard's step shapes
                        elements = generation.source.ragged_elements(name, generation.num_steps)
                    except RecordingError as error:
                        elements = None  # unknown: a shard is damaged
                        if all(d["file"] != error.path.name for d in damaged):
                            damaged.append({"file": error.path.name, "error": error.damaged[0].problem})
                elif name in once:
                    elements = math.prod(stream.shape)  # once per generation
                else:
                    elements = generation.num_steps * math.prod(stream.shape)
                streams[name] = {
                    "dtype": stream.dtype,
                    "encoding": stream.encoding,
                    "shape": stream.shape,
                    "bytes": None if elements is None else elements * itemsize,
                }
                if stream.dense:  # records read back as dense tensors: those tensors' dtype and shape
                    streams[name].update(dtype=stream.dense_dtype, shape=stream.dense_shape, stored_dtype=stream.dtype)
                if name in once:
                    streams[name]["once"] = True  # recorded once per call, not per step
                vocab = self.model.get("vocab_size")
                encoded = stream.encoding in RECORD_ENCODINGS or is_packed(stream.encoding)
                if encoded and isinstance(vocab, int):
                    # What the same steps take dense, in float32 (`out.logits`' dtype from 4.45).
                    streams[name]["dense_bytes"] = generation.num_steps * generation.num_rows * vocab * 4
            files = _layout.files_of(entry)
            generations.append(
                {
                    "index": generation.index,
                    "mode": generation.mode,
                    "status": written.status,
                    "complete": generation.complete,
                    "error": generation.error,
                    "num_steps": generation.num_steps,
                    "num_rows": generation.num_rows,
                    "num_beams": generation.num_beams,
                    "prompt_length": generation.prompt_length,
                    "prompt_lengths": list(generation.prompt_lengths) if generation.prompt_lengths else None,
                    "sample_ids": None if generation.sample_ids is None else list(generation.sample_ids),
                    "generation_config": generation.generation_config,
                    **({"adapters": generation.adapters} if generation.adapters is not None else {}),
                    "num_shards": len(written.shards),
                    "file_bytes": sum(_size_of(self.path / name) for name in files),
                    "damaged_files": damaged,
                    "streams": streams,
                }
            )
        return {
            "path": str(self.path),
            "format_version": self.format_version,
            "created_by": self.created_by,
            "model": self.model,
            "checksums": self._file_records is not None,
            "generations": generations,
        }

    def _damaged_at_a_glance(self, names: list[str]) -> list[dict[str, str]]:
        """Files seen damaged without reading them: missing, or of another size than the recorder wrote."""
        found = []
        for name in names:
            try:
                size = (self.path / name).stat().st_size
            except OSError as error:
                found.append({"file": name, "error": f"cannot be found ({error.strerror})"})
                continue
            written = (self._file_records or {}).get(name, {}).get("bytes")
            if written is not None and size != written:
                found.append({"file": name, "error": f"holds {size} bytes, {written} were written"})
        return found

    def verify(self) -> dict[str, int]:
        """Check every file the manifest names (shards, sequences, encoder outputs): read every byte and
        compare its size and CRC-32C with those the recorder noted when it wrote the file, and check its
        header against the manifest as a read would. Every file is checked, whatever the others hold.
        Then the ledger (`ledger.jsonl`, one line per generation a writer added): a generation index two
        processes added, or one the manifest no longer lists, means two wrote the directory at once and
        generations were lost, though every file the manifest names is intact.

        Reading a step held by a file found damaged raises that finding from then on, also where the
        damage lies in tensor data, which a plain read does not check.

        Returns:
            `dict`: `{"files": files checked, "bytes": bytes read, "ledger": ledger lines checked}` (0
            lines for a recording made before the ledger), when every file is intact and no clash is found.

        Raises:
            RecordingError: a file is missing or damaged: its size, checksum or header differs from the
                manifest (the error's `path` names the file); with several, one error whose `path` is the
                directory and whose message lists each, its `damaged` holding each file's own error. Also
                when the recording carries no checksum for a file (recordings written before checksums
                were added carry none; they read as before without `verify`). Also (naming the ledger)
                when the ledger shows two writers clashed.

        Example:
            >>> open_recording("run/").verify()  # doctest: +SKIP
            {'files': 3, 'bytes': 1210816, 'ledger': 1}
        """
        checked, size, damaged = self._check_files()
        lines, clashed = self._check_ledger()
        if damaged or clashed:
            raise damaged_files(self.path, damaged + clashed, checked)
        return {"files": checked, "bytes": size, "ledger": lines}

    def _check_files(self) -> tuple[int, int, list[RecordingError]]:
        """`verify()`'s work without raising (`RankedRecording.verify` sums it over ranks): the files
        checked, the bytes read, and one `RecordingError` per damaged file (first, where the recording
        lacks checksums, one saying so)."""
        names = [name for entry in self._entries for name in _layout.files_of(entry)]
        records = self._file_records or {}
        damaged: list[RecordingError] = []
        missing = [name for name in names if name not in records]
        if missing:
            written = self.created_by.get("transformers_offload", "?")
            damaged.append(RecordingError(
                self.path / (missing[0] if self._file_records is not None else _layout.MANIFEST),
                f"carries no checksum for {len(missing)} of its {len(names)} file(s) (written by "
                f"transformers-offload {written}, before checksums), so it cannot be verified; it reads "
                "as before without `verify`.",
            ))
        size = 0
        for generation in self._generations:
            source = generation.source
            assert isinstance(source, ShardSource)  # a directory's generations read from its shards
            for name in source.files:
                try:
                    path = _manifest.inside(self.path, name, self.path / _layout.MANIFEST)  # opens nothing outside
                    if name in records:
                        _files.verify_file(path, records[name])
                        size += records[name]["bytes"]
                    source.check(name)
                except RecordingError as error:
                    damaged.append(error)
                    source.mark(name, error)
                else:
                    source.mark(name, None)
        return len(names), size, damaged

    def _check_ledger(self) -> tuple[int, list[RecordingError]]:
        """The ledger lines checked, and the error naming any generation two writers added (`store.ledger`)."""
        return _ledger.check(self.path, self._entries)

    def close(self) -> None:
        """Drop the shard mappings this object holds (tensors already returned keep theirs)."""
        for generation in self._generations:
            source = generation.source
            if isinstance(source, ShardSource):
                source.close()

    def __enter__(self) -> Recording:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Recording({str(self.path)!r}, {len(self._generations)} generation(s))"


def _size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0  # a missing file: `missing_files` names it
