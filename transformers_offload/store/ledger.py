"""A recording's ledger (`layout.LEDGER`): one line per generation a writer added, appended after the
manifest listing it was written, never rewritten. The manifest is replaced whole at every write, so of
two processes writing one directory at once (a forked child that shares its parent's recorder, a file
system without `flock`) the last manifest wins and the other's generations vanish from it, consistently:
every file it names is intact. The ledger keeps each writer's lines (`O_APPEND`: one `write` per line),
so `verify` finds such a clash afterwards: one index added by two writers, or an index the manifest no
longer lists.

A writer is one `Spill` in one process: a forked child's copy of its parent's `Spill` is another writer.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from pathlib import Path
from typing import Any

from ..errors import RecordingError
from .header import ManifestEntry
from .layout import LEDGER


class Writer:
    """The identity a `Spill` writes under: a random id, renewed in a process forked from the one that
    made it (`token` is read per generation, so the child's lines and manifest entries name the child)."""

    def __init__(self) -> None:
        self._pid = -1
        self._token = ""

    @property
    def token(self) -> str:
        if self._pid != os.getpid():
            self._pid, self._token = os.getpid(), uuid.uuid4().hex
        return self._token


def append(root: Path, index: int, writer: str) -> None:
    """Add the line saying `writer` added generation `index` (after the manifest lists it), durably.

    Raises:
        OSError: the ledger cannot be written (the caller's manifest already lists the generation).
    """
    line = json.dumps({"index": index, "writer": writer, "pid": os.getpid(), "host": socket.gethostname()})
    fd = os.open(root / LEDGER, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def check(root: Path, entries: list[dict[str, Any]]) -> tuple[int, list[RecordingError]]:
    """Compare `root`'s ledger with its manifest's generation `entries`: the ledger lines checked, and at
    most one `RecordingError` (naming the ledger), listing each generation index that two writers added,
    or that a writer added and the manifest no longer lists. A recording without a ledger (written before
    it existed) checks 0 lines; a last line cut short (the disk filled while it was written) is not counted."""
    path = root / LEDGER
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return 0, []
    except OSError as error:
        return 0, [RecordingError(path, f"cannot be read ({error.strerror})")]
    lines = text.split("\n")
    added: dict[int, list[dict[str, Any]]] = {}
    checked = 0
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            record = json.loads(line)
            index, writer = record["index"], record["writer"]
            if not isinstance(index, int) or index < 0 or not isinstance(writer, str):
                raise TypeError(index)
        except (ValueError, KeyError, TypeError):
            if number == len(lines):  # no newline after it: cut short while written
                continue
            return checked, [RecordingError(path, f"line {number} is not a ledger line: {line[:80]!r}")]
        checked += 1
        added.setdefault(index, []).append({**record, "writer": writer})
    found = []
    for index, records in sorted(added.items()):
        writers = {record["writer"]: record for record in records}
        listed = ManifestEntry(entries[index]).writer if index < len(entries) else None
        listed = listed if isinstance(listed, str) else None  # a manifest made before the ledger names none
        if len(writers) > 1:
            who = ", ".join(f"pid {record.get('pid')} on {record.get('host')}" for record in writers.values())
            found.append(f"generation {index} was added by {len(writers)} writers ({who}): the manifest keeps "
                         "one's, the others' are lost")
        elif index >= len(entries) or (listed is not None and listed not in writers):
            record = records[0]
            where = "not in the manifest" if index >= len(entries) else "listed in the manifest as another writer's"
            found.append(f"generation {index}, added by pid {record.get('pid')} on {record.get('host')}, is {where}: "
                         "another process replaced the manifest, and that generation is lost")
    if not found:
        return checked, []
    listed = "".join(f"\n  {each}" for each in found)
    return checked, [RecordingError(path, (
        f"shows that two processes wrote this recording at once ({len(found)} generation index(es)); every file "
        "the manifest names may still be intact, but generations are missing from it. Record with one Recorder "
        f"per process, each in its own directory (docs/integrations.md#processes):{listed}"))]
