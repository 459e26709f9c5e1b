"""A recording's files on disk: written durably (under a temporary name, fsynced, renamed), the
manifest created whole, and every file's checksum computed when it is written and checked on demand.
The names are `layout`'s, the manifest's checks `manifest`'s."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import zlib
from pathlib import Path
from typing import Any, Callable

import google_crc32c
import numpy

from ..errors import RecordingError
from .layout import MANIFEST


def created_mode() -> int:
    """The mode a file the user creates gets: 0666 less the process's umask (0644 under umask 022;
    directories are made with `mkdir`, which applies the umask itself). `tempfile.mkstemp`, which the atomic writes start
    from, creates 0600;
    the file is given this mode before it is renamed into place, so a colleague can read a recording.

    The umask is read from `/proc/self/status` where Linux gives it (4.7 and newer), else by setting and
    restoring it (which another thread creating a file at that instant would see). A file system that
    refuses the mode change keeps the mode it gives."""
    return 0o666 & ~_umask()


def _umask() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def open_temporary(directory: Path, prefix: str, suffix: str) -> tuple[int, Path]:
    """`tempfile.mkstemp` in `directory`, given the mode of a file the user creates (`created_mode`)."""
    fd, name = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=suffix)
    _give_created_mode(fd)
    return fd, Path(name)


def _give_created_mode(fd: int) -> None:
    """Best effort: a file system that refuses a mode change (FAT, some network mounts) keeps its own."""
    with contextlib.suppress(OSError, AttributeError, NotImplementedError):  # no os.fchmod on Windows before 3.13
        os.fchmod(fd, created_mode())


def write_atomically(path: Path, write: Callable[[Path], None], *, checksum: bool = False,
                     drop_cache: bool = False, contents: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write `path` so that it is either absent/old or complete: `write(temporary)`, fsync, rename.

    The temporary file is `path`'s name with a unique middle part and `.tmp`, next to it, with the
    mode of a file the user creates (`created_mode`: 0644 under umask 022).

    Returns the manifest's record of the file: `{"bytes": size}`, and with `checksum` also
    `"checksum"`, computed from what the file holds before it is renamed (`file_checksum`), while
    the fsync runs (both wait outside the GIL: the checksum costs about nothing where the disk is
    the bottleneck). The temporary file is removed when `write` fails (a full disk...), and the
    error is raised.

    `drop_cache`: once the file is durable, tell the kernel its pages are not needed
    (`posix_fadvise(POSIX_FADV_DONTNEED)`, where the platform has it): a recording's shards are written
    to be read later, and dropping each one's clean pages lets the next file reuse them instead of taking
    fresh memory for the page cache, which costs the writer thread several times the write itself
    (bench/README.md, "Spilling at batch 8"). A later read comes from the disk.

    `contents`, for a safetensors file: each tensor's bytes as `write` wrote them (a uint8 NumPy array
    by name). The checksum is then computed from them and the file's header (`safetensors_checksum`)
    instead of reading the whole file back; the file is read where they do not match its header.
    """
    fd, temporary = open_temporary(path.parent, path.name + ".", ".tmp")
    os.close(fd)
    try:
        write(temporary)
        with open(temporary, "rb+") as file:
            _give_created_mode(file.fileno())  # `write` may have made the file anew (safetensors does)
            record = {"bytes": os.fstat(file.fileno()).st_size}
            if checksum:
                record["checksum"] = _while_fsync(
                    file.fileno(), lambda: (contents is not None and safetensors_checksum(file, contents)) or file_checksum(file)
                )
            else:
                os.fsync(file.fileno())
            if drop_cache and _FADVISE is not None:
                _FADVISE(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return record


_FADVISE = getattr(os, "posix_fadvise", None)  # POSIX; absent on Windows and macOS


def _while_fsync(fd: int, work: Callable[[], Any]) -> Any:
    """`os.fsync(fd)` in a helper thread while `work()` runs in this one; `work`'s result, or the
    first error of either."""
    failure: list[BaseException] = []

    def sync() -> None:
        try:
            os.fsync(fd)
        except BaseException as error:  # noqa: BLE001 - raised in the calling thread
            failure.append(error)

    thread = threading.Thread(target=sync, name="transformers-offload-fsync", daemon=True)
    thread.start()
    try:
        result = work()
    finally:
        thread.join()
    if failure:
        raise failure[0]
    return result


# -- checksums ---------------------------------------------------------------------------------------
# Every file a recording names carries `"checksum": "ALGORITHM:HEX"` in the manifest's `files` map:
# CRC-32C (Castagnoli, the checksum of ext4, Btrfs, iSCSI and Google Cloud Storage), computed by
# `google-crc32c` with the CPU's CRC instruction (about 20 GB/s on one core of this project's machines,
# so it costs the writer little beside the disk). It detects every error burst of up to 32 bits (so
# any flipped byte) and other damage with probability 1 - 2**-32. Where google-crc32c has no compiled
# extension (a platform without its wheel), zlib's CRC-32 ("crc32", 4 GB/s) is written instead; the
# reader checks both and refuses other algorithms by name.
CHECKSUM_ALGORITHM = "crc32c" if google_crc32c.implementation == "c" else "crc32"
_CHECKSUMS: dict[str, Callable[[Any], int]] = {"crc32c": google_crc32c.value, "crc32": zlib.crc32}
_EXTEND: dict[str, Callable[[int, Any], int]] = {"crc32c": google_crc32c.extend, "crc32": lambda crc, data: zlib.crc32(data, crc)}
_CHECKSUM_BLOCK = 8 * 2**20  # bytes read at a time
_blocks = threading.local()  # per thread (a recording's writer), its checksum block


def _checksum_block(size: int) -> memoryview:
    """A `size`-byte view of this thread's checksum block, made once (and again larger when a larger
    file comes): a shard's checksum then allocates nothing, so a writer thread's heap does not grow by
    a freed block per shard with the C library's default allocator settings."""
    block = getattr(_blocks, "block", None)
    if block is None or len(block) < size:
        block = _blocks.block = bytearray(size)
    return memoryview(block)[:size]


def file_checksum(file: Any, algorithm: str = CHECKSUM_ALGORITHM) -> str:
    """`"ALGORITHM:XXXXXXXX"` of every byte of `file` (an open binary file), read from its start in
    blocks of at most 8 MiB (a map of the whole file would count the file in the process's resident
    set: a shard's size more at the writer's peak)."""
    size = os.fstat(file.fileno()).st_size
    block = _checksum_block(min(size, _CHECKSUM_BLOCK) or 1)
    view = numpy.frombuffer(block, dtype=numpy.uint8)  # google-crc32c takes arrays, not bytearrays
    crc = _CHECKSUMS[algorithm](b"")
    file.seek(0)
    while count := file.readinto(block):
        crc = _EXTEND[algorithm](crc, view[:count])
    return f"{algorithm}:{crc:08x}"


def safetensors_checksum(file: Any, contents: dict[str, Any], algorithm: str = CHECKSUM_ALGORITHM) -> str | None:
    """`file_checksum(file)` of a safetensors file (an open binary file) just written from `contents`
    (each tensor's bytes, a uint8 NumPy array by name), computed from its header, read from the file,
    and those arrays in the order of their offsets: a shard is not read back. None where the header
    does not name exactly `contents`, back to back, to the end of the file (then read the file)."""
    size = os.fstat(file.fileno()).st_size
    file.seek(0)
    length = file.read(8)
    if len(length) != 8 or not 8 + int.from_bytes(length, "little") <= size:
        return None
    text = file.read(int.from_bytes(length, "little"))
    try:
        spans = sorted((info["data_offsets"], name) for name, info in json.loads(text).items() if name != "__metadata__")
    except (ValueError, TypeError, KeyError):
        return None
    crc = _EXTEND[algorithm](_CHECKSUMS[algorithm](length), text)
    end = 0
    for (begin, stop), name in spans:
        data = contents.get(name)
        if data is None or begin != end or stop - begin != data.nbytes:
            return None
        crc = _EXTEND[algorithm](crc, data)
        end = stop
    if len(spans) != len(contents) or 8 + len(text) + end != size:
        return None
    return f"{algorithm}:{crc:08x}"


def verify_file(path: Path, record: dict[str, Any]) -> None:
    """Read all of `path` and compare it with its manifest `record`; `RecordingError` naming the file
    when its size or checksum differs (a damaged file) or its algorithm is unknown."""
    algorithm = record["checksum"].partition(":")[0]
    if algorithm not in _CHECKSUMS:
        raise RecordingError(
            path, f"its checksum uses {algorithm!r}, which this transformers-offload cannot check "
            f"(it checks {sorted(_CHECKSUMS)}); upgrade transformers-offload.",
        )
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            found = file_checksum(file, algorithm) if size == record["bytes"] else None
    except FileNotFoundError:
        raise RecordingError(path, "missing: the manifest names this file but it is not there.") from None
    except OSError as error:
        raise RecordingError(path, f"cannot be read ({error.strerror}).") from None
    if size != record["bytes"]:
        raise RecordingError(path, f"holds {size} bytes, the manifest says {record['bytes']}: the file is damaged.")
    if found != record["checksum"]:
        raise RecordingError(
            path, f"its checksum is {found}, the manifest says {record['checksum']}: the file is damaged."
        )


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    text = _manifest_text(manifest)
    write_atomically(root / MANIFEST, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def create_manifest(root: Path, manifest: dict[str, Any]) -> None:
    """Write `root`'s first manifest, refused if one exists: of two writers racing for a directory,
    one gets `FileExistsError`. The file is complete from the moment it exists (written aside, then
    hard-linked into place), so a reader watching the directory never sees it empty or half written.
    Where the file system has no hard links, it is created empty first and then replaced.
    """
    path = root / MANIFEST
    text = _manifest_text(manifest)
    fd, temporary = open_temporary(root, MANIFEST + ".", ".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(temporary, path)
        except FileExistsError:
            raise
        except OSError:  # no hard links here (some network and FAT file systems)
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    _fsync_directory(root)


def _manifest_text(manifest: dict[str, Any]) -> str:
    return json.dumps(manifest, indent=1, sort_keys=False) + "\n"


def _fsync_directory(directory: Path) -> None:
    # Makes the rename itself durable. Not every platform can open a directory (Windows): skip there.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def lock_directory(root: Path) -> int | None:
    """Take `root`'s exclusive lock (`flock` on the directory itself: no file is added); returns the
    descriptor that holds it, None where the platform has no `flock`.

    Raises:
        BlockingIOError: another process holds it (it is writing this recording).
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        return None
    fd = os.open(root, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise BlockingIOError(
            f"{str(root)!r} is being written by another Recorder (its directory lock is held); wait for it "
            "to finish, or record into another directory."
        ) from None
    return fd


def unlock_directory(fd: int | None) -> None:
    """Release a lock `lock_directory` took."""
    if fd is not None:
        os.close(fd)  # closing the descriptor releases its flock
