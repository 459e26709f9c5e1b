"""A data-parallel recording read as one: every rank's sub-directory (`rank-0`, `rank-1`...) merged,
its generations ordered by sample id.

Each rank's directory is opened by the function it is handed (`read.reader` hands `Recording`), so
this module never imports the reader, which dispatches to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

from ..errors import RecordingError, damaged_files
from ..store.layout import rank_directories
from .generation import Generation
from .readable import Readable


class RankPart(Protocol):
    """What `RankedRecording` needs of one rank's recording (`read.reader.Recording` is one)."""

    path: Path
    format_version: int
    created_by: dict[str, Any]
    model: dict[str, Any]

    @property
    def generations(self) -> Sequence[Generation]: ...

    def describe(self) -> dict[str, Any]: ...

    def _check_files(self) -> tuple[int, int, list[RecordingError]]: ...

    def _check_ledger(self) -> tuple[int, list[RecordingError]]: ...

    def close(self) -> None: ...


class RankedRecording(Readable):
    """The recordings of several data-parallel ranks (`record` under torchrun or accelerate), as one.

    Its generations are every rank's, ordered by their first (smallest) sample id in natural order
    (ints by value; strings with their digits compared as numbers, so "q4" comes before "q10"), then by
    rank and position (ints before strings; a generation without sample ids last), and numbered again from 0 in
    that order; each reads from its own rank's shards. The accessors, `samples()`, the per-token table
    and the viewer take it as they take a `Recording`.

    Attributes:
        path (`pathlib.Path`): the run's directory, which holds the rank sub-directories.
        ranks (`tuple[int, ...]`): the ranks found (those that wrote a manifest).
        parts (`tuple[Recording, ...]`): each rank's recording (`open_part(directory)`), in rank order.
        format_version, created_by, model: as `Recording`'s (of rank `ranks[0]`; every rank recorded
            the same model).
        generation_ranks (`tuple[int, ...]`): the rank behind each generation, in order.

    Args:
        path (`pathlib.Path`): the run's directory.
        open_part (`Callable[[Path], RankPart]`): opens one rank's directory (`open_recording` passes
            `Recording`).

    Raises:
        RecordingError: no rank sub-directory holds a manifest, a rank's recording cannot be opened, or
            the ranks recorded different models.
    """

    def __init__(self, path: Path, open_part: Callable[[Path], RankPart]) -> None:
        self.path = path
        found = rank_directories(path)
        if not found:
            raise RecordingError(path, "holds no rank sub-directory with a manifest.")
        self.ranks = tuple(rank for rank, _ in found)
        parts: list[RankPart] = []
        try:
            for _, directory in found:
                parts.append(open_part(directory))
        except BaseException:
            for part in parts:
                part.close()
            raise
        self.parts = tuple(parts)
        first = self.parts[0]
        for part in self.parts[1:]:
            if part.model != first.model:
                self.close()
                raise RecordingError(part.path, f"recorded another model ({part.model}) than {first.path.name} "
                                                f"({first.model}): the ranks of one recording share their model.")
        self.format_version, self.created_by, self.model = first.format_version, first.created_by, first.model
        order = sorted(
            ((rank, generation) for rank, part in zip(self.ranks, self.parts) for generation in part.generations),
            key=lambda item: (_first_sample(item[1]), item[0], item[1].index),
        )
        self._order = tuple((rank, generation.index) for rank, generation in order)
        self.generation_ranks = tuple(rank for rank, _ in order)
        self._generations = tuple(dataclasses.replace(generation, header=dataclasses.replace(generation.header, index=index))
                                  for index, (_, generation) in enumerate(order))

    def _none_recorded(self) -> str:
        return f"no rank of the recording in {str(self.path)!r} holds a generation."

    @contextlib.contextmanager
    def in_order(self) -> Iterator[None]:
        """`Recording.in_order()` on every rank's recording."""
        with contextlib.ExitStack() as stack:
            for part in self.parts:
                if hasattr(part, "in_order"):
                    stack.enter_context(part.in_order())
            yield

    def describe(self) -> dict[str, Any]:
        """`Recording.describe()` over every rank: `ranks`, and the generations in sample order, each with
        its `rank` and its `rank_index` (its index in that rank's own recording)."""
        described = {rank: part.describe() for rank, part in zip(self.ranks, self.parts)}
        generations = []
        for index, (rank, own) in enumerate(self._order):
            entry = dict(described[rank]["generations"][own])
            entry.update(index=index, rank=rank, rank_index=own)
            generations.append(entry)
        first = described[self.ranks[0]]
        return {**first, "path": str(self.path), "ranks": list(self.ranks),
                "checksums": all(summary["checksums"] for summary in described.values()), "generations": generations}

    def verify(self) -> dict[str, int]:
        """`Recording.verify()` on every rank: every file of every rank checked, `{"files", "bytes"}`
        summed over them.

        Raises:
            RecordingError: as `Recording.verify()`: one damaged file's own error (naming the rank's
                file), or with several, one naming the run's directory whose `damaged` lists each.
        """
        files = size = lines = 0
        damaged: list[RecordingError] = []
        for part in self.parts:
            checked, read, found = part._check_files()  # noqa: SLF001 - the rank's own verify, not raising
            ledgered, clashed = part._check_ledger()  # noqa: SLF001
            files, size, lines = files + checked, size + read, lines + ledgered
            damaged.extend(found + clashed)
        if damaged:
            raise damaged_files(self.path, damaged, files)
        return {"files": files, "bytes": size, "ledger": lines}

    def close(self) -> None:
        """Drop every rank's shard mappings."""
        for part in self.parts:
            part.close()

    def __enter__(self) -> RankedRecording:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RankedRecording({str(self.path)!r}, {len(self.ranks)} rank(s), {len(self._generations)} generation(s))"


def _first_sample(generation: Generation) -> tuple:
    """Sort key of a generation: its smallest sample id in natural order (ints by value; strings with
    their runs of digits compared as numbers, so "q4" before "q10"), ints first; last without ids."""
    ids = generation.sample_ids
    if not ids:
        return (2, ())
    return min((0, (sample,)) if isinstance(sample, int) else (1, _natural(str(sample))) for sample in ids)


def _natural(text: str) -> tuple:
    """`text` split into digit runs (as ints) and the rest, for natural order: "q10" -> ("q", 10)."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.findall(r"\d+|\D+", text))
