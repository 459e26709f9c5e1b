"""The spill store's directory: `Spill` owns one recording directory for one recorder. It creates (or,
with `append`, reopens) the directory, locks it, keeps the manifest, and opens one `ShardStore`
(`shard_writer`) per `generate()` call."""

from __future__ import annotations

import errno
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import SpillError
from . import files as _files
from . import layout as _layout
from . import ledger as _ledger
from .header import RECORDING, GenerationHeader, ManifestEntry
from .shard_writer import ShardStore


class Spill:
    """One recorder's recording directory: the manifest and where each generation's shards go.

    The directory is locked (`flock`) while the `Spill` is open, so two processes never write one
    manifest; `close()` releases it.

    Args:
        root (`pathlib.Path`): the directory; created if missing, refused if it holds anything (unless
            `append` and it holds a recording) but `record`'s claims and settings (`layout.WRITERS`,
            `layout.JOB_SETTINGS`).
        shard_bytes (`int | None`): target size of one shard, in bytes (a shard holds at least one step); None:
            per call, `shard_writer.shard_size` of what its steps can take.
        model_info (`dict`): the manifest's `model` entry.
        created_by (`dict`): the manifest's `created_by` entry (package versions).
        append (`bool`): with a recording in `root`, add new generations after its own (never
            touching them); a generation its writer left `"recording"` (the process stopped) is marked
            `"failed"`, its committed steps kept.

    Raises:
        FileExistsError: `root` exists and is not an empty directory (nor, with `append`, a recording).
        RecordingError: with `append`, the recording in `root` is damaged or of another format version.
        ValueError: with `append`, the recording was made by another model (class, vocabulary, or the
            checkpoint it was loaded from: `name_or_path`).
        BlockingIOError: another process has the recording open for writing.
        OSError: the directory or its manifest cannot be written.
    """

    def __init__(self, root: Path, *, shard_bytes: int | None, model_info: dict, created_by: dict,
                 append: bool = False) -> None:
        self.root = root
        self.shard_bytes = shard_bytes
        self._lock: int | None = None
        self._writer = _ledger.Writer()
        if append and (root / _files.MANIFEST).is_file():
            self._lock = _files.lock_directory(root)
            try:
                self.manifest = _reopen(root, model_info)
            except BaseException:
                self.close()
                raise
            return
        if root.exists() and (not root.is_dir() or any(child.name not in (_layout.WRITERS, _layout.JOB_SETTINGS)
                                                       for child in root.iterdir())):
            what = "is not a directory" if not root.is_dir() else "is not empty"
            raise FileExistsError(
                f"`spill_dir` {str(root)!r} {what}: a Recorder writes a new recording into a new or "
                "empty directory. Pick another path (or remove that one)."
            )
        root.mkdir(parents=True, exist_ok=True)
        self.manifest: dict[str, Any] = {
            "format": _layout.FORMAT,
            "format_version": _layout.FORMAT_VERSION,
            "created_by": created_by,
            "model": model_info,
            "generations": [],
            "files": {},  # every file's size and checksum, by name
        }
        try:  # claim the directory: of two recorders racing for it, one gets FileExistsError
            _files.create_manifest(root, self.manifest)
        except FileExistsError:
            raise FileExistsError(
                f"`spill_dir` {str(root)!r} already holds a recording (another Recorder got there "
                "first). Pick another path."
            ) from None
        self._lock = _files.lock_directory(root)

    @property
    def next_index(self) -> int:
        """The index the next generation gets (after those already in the directory)."""
        return len(self.manifest["generations"])

    def close(self) -> None:
        """Release the directory's lock (the recording stays as written). Idempotent."""
        if self._lock is not None:
            _files.unlock_directory(self._lock)
            self._lock = None

    def open_store(self, names: list[str], header: GenerationHeader, max_steps: int = 2**31) -> ShardStore:
        """Add a generation (status `"recording"`) to the manifest, durably, and return its store.

        `max_steps` (the most steps the call can run) caps the shard buffers' size.

        Raises:
            SpillError: the manifest cannot be written (the directory was removed, the disk is full).
        """
        index = len(self.manifest["generations"])
        # this process's writer token (`ledger`): verify finds two writers of one index
        entry = ManifestEntry.opened(replace(header, index=index), writer=self._writer.token)
        try:  # the ledger's line after the manifest lists it: a line never names a generation not added
            _files.write_manifest(self.root, {**self.manifest, "generations": [*self.manifest["generations"], entry.data]})
            _ledger.append(self.root, index, entry.writer)
        except OSError as error:
            raise SpillError(
                error.errno or errno.EIO,
                f"transformers-offload cannot write to `spill_dir` {str(self.root)!r} ({error}); nothing of "
                "this generate() call was run. Check that the directory still exists and has space.",
            ) from error
        self.manifest["generations"].append(entry.data)
        return ShardStore(self, entry, names, max_steps, encodings=header.encodings)


def _same_directory(a: Any, b: Any) -> bool:
    """Whether two `name_or_path` strings name the same local directory from here (`model`, `./model/`,
    `/abs/model`); a Hub id, or a path no longer there, only equals itself."""
    try:
        first, second = Path(a), Path(b)
        return first.is_dir() and second.is_dir() and first.resolve() == second.resolve()
    except (TypeError, OSError):
        return False


def _reopen(root: Path, model_info: dict) -> dict[str, Any]:
    """The manifest of the recording in `root`, to append to: checked, made by the same model, and with
    every generation its writer left `"recording"` marked `"failed"` (durably)."""
    from .manifest import read_manifest

    manifest = read_manifest(root)
    theirs = manifest["model"]
    # The checkpoint too (`name_or_path`, the directory or Hub id it was loaded from): another model of
    # the same architecture would otherwise be appended without a word.
    for key in ("class", "config_class", "vocab_size", "name_or_path"):
        same_directory = key == "name_or_path" and _same_directory(theirs.get(key), model_info.get(key))
        if theirs.get(key) != model_info.get(key) and not same_directory:
            raise ValueError(
                f"`spill_dir` {str(root)!r} holds a recording of another model ({key} {theirs.get(key)!r}, this one "
                f"{model_info.get(key)!r}); append to a recording of the same model, or pick another directory."
            )
    stale = [entry for entry in map(ManifestEntry, manifest["generations"]) if entry.status == RECORDING]
    for entry in stale:
        entry.fail_stopped()
    manifest.setdefault("files", {})
    if stale:
        _files.write_manifest(root, manifest)
    return manifest
