"""One writer per sample: the samples each running `record` process is recording, visible to every later
`record` of the same `out`, whatever its rank, world size or sub-directory.

Every `record` run claims the samples it is about to record before it records any: under an exclusive
`flock` on `out/.writers` (held for the moment it takes to decide), it

1. finds the live claims in that directory: one JSON file per running writer, each kept locked
   (`flock`) by its writer for as long as it records; a file nobody holds is what a stopped writer
   left, and is removed;
2. only then reads which samples the recording already holds complete (so a writer that finished in
   between is counted as finished, never as still pending);
3. refuses, with `BlockingIOError` naming the process that holds them, when a live claim holds a
   sample it would record; else writes its own claim and locks it.

The claim is released (its file removed, and the directory with the last one) when the writer is done,
and by the operating system when the process dies, whatever killed it. Ranks of one launch never
conflict: their shares of the prompts are disjoint (`parallel.share`). Claims need a file system whose
`flock` is seen by every writer (a local disk; NFS v4 across machines); without `flock` (Windows)
nothing is claimed.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shlex
import socket
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from ..store.files import open_temporary
from ..store.layout import WRITERS

_SHOWN = 5  # sample ids named in a refusal


@contextlib.contextmanager
def claim(out: Path, pending: Callable[[], list[str]], *, rank: int, world_size: int,
          target: Path) -> Iterator[list[str]]:
    """Claim the samples this process will record into `out`, for the duration of the `with` block.

    Args:
        out (`pathlib.Path`): the recording directory (created if missing).
        pending (`Callable[[], list[str]]`): the ids (as text) of the samples this process would record;
            called once, under the directory's lock, after the live claims are read.
        rank, world_size (`int`): this process's rank and world size, target (`pathlib.Path`): where it
            writes; shown to a later writer that it blocks.

    Yields:
        `list[str]`: what `pending()` returned, now this process's.

    Raises:
        BlockingIOError: a running process claims some of these samples; the message names it (pid,
            host, rank, directory, command line) and the samples, and says to wait for it or stop it.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: no flock, no claims
        yield pending()
        return
    directory = out / WRITERS
    mine: tuple[int, Path] | None = None
    with _locked(directory, fcntl):
        holders = _live_claims(directory, fcntl)
        samples = pending()
        wanted = set(samples)
        for holder in holders:
            taken = [sample for sample in holder.get("samples", ()) if sample in wanted]
            if taken:
                raise BlockingIOError(_refusal(out, taken, holder))
        if samples:
            mine = _write_claim(directory, fcntl, {
                "pid": os.getpid(), "host": socket.gethostname(), "rank": rank, "world_size": world_size,
                "target": str(target), "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "command": shlex.join(getattr(sys, "orig_argv", sys.argv)), "samples": samples,
            })
    try:
        yield samples
    finally:
        if mine is not None:
            _release(directory, mine, fcntl)


@contextlib.contextmanager
def _locked(directory: Path, fcntl: Any) -> Iterator[None]:
    """Hold `directory`'s exclusive flock (creating it if missing), waiting for it; a directory that
    the writer before removed while this one waited is created again. Removed on the way out when it
    holds no claim."""
    while True:
        directory.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(directory, os.O_RDONLY)
        except FileNotFoundError:  # removed between mkdir and open
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = os.fstat(fd)
            try:
                now = os.stat(directory)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                break  # still the directory at that path: held
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):  # left only while it holds claims (fails while it does)
            directory.rmdir()
        os.close(fd)  # releases the flock


def _live_claims(directory: Path, fcntl: Any) -> list[dict[str, Any]]:
    """The claims of running writers; a claim file nobody holds (its writer stopped) is removed."""
    live = []
    for path in sorted(directory.glob("claim-*.json")):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # its writer holds it
                live.append(json.loads(path.read_text(encoding="utf-8")))
            else:
                path.unlink(missing_ok=True)  # left by a writer that stopped
        finally:
            os.close(fd)
    return live


def _write_claim(directory: Path, fcntl: Any, content: dict[str, Any]) -> tuple[int, Path]:
    fd, name = open_temporary(directory, "claim-", ".json")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held until `_release` (or the process ends)
        os.write(fd, json.dumps(content).encode("utf-8"))
    except BaseException:
        os.close(fd)
        Path(name).unlink(missing_ok=True)
        raise
    return fd, Path(name)


def _release(directory: Path, mine: tuple[int, Path], fcntl: Any) -> None:
    fd, path = mine
    with _locked(directory, fcntl):
        path.unlink(missing_ok=True)
        os.close(fd)


def _refusal(out: Path, taken: list[str], holder: dict[str, Any]) -> str:
    shown = ", ".join(taken[:_SHOWN]) + (f" and {len(taken) - _SHOWN} more" if len(taken) > _SHOWN else "")
    return (
        f"`out` {str(out)!r}: {len(taken)} of the samples this run would record ({shown}) are being recorded "
        f"by another process: pid {holder.get('pid')} on host {holder.get('host')!r}, rank {holder.get('rank')} "
        f"of {holder.get('world_size')}, writing {holder.get('target')!r} since {holder.get('since')} "
        f"(command: {holder.get('command')}). Wait for it to finish (or stop it), then run this again: it "
        "records only what is still missing."
    )
