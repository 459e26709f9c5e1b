"""Rescoring a whole recording directory, resumably and over data-parallel ranks, as `record` records one.

`rescore_recording(source, model, out, ...)` is what `python -m transformers_offload rescore` runs. Each
generation of the source is one unit of work, keyed by its sample ids: a run on an `out` that already
holds some complete rescored generations rescores only the others, and refuses to start while another
process is still rescoring any of them (`claims`). Under `torchrun` or `accelerate launch` each process
rescores its share of the generations (`parallel.share`, by position in the source, which
`open_recording` orders by sample id) into `out/rank-R`. A source whose generations carry no sample ids
(recorded without `Recorder.set_samples`) is rescored by one process into a new `out`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..jobs.parallel import process_rank
from ..jobs.record import run_share
from ..read.reader import open_recording
from ..store.layout import MANIFEST, rank_directories
from ..store.location import local_directory
from .decode import rescore


def rescore_recording(source: Any, model: Any, out: Any, *, mode: str = "decode", streams: tuple[str, ...] = ("logits",),
                      encodings: dict[str, str] | None = None, chunk_size: int = 512, progress: bool = True,
                      rank: int | None = None, world_size: int | None = None) -> dict[str, Any]:
    """Rescore every generation of the recording at `source` with `model` into `out` (see `rescore`),
    resuming where an earlier run stopped.

    Args:
        source (`str | os.PathLike`): the recording directory (one process's or a `record` run's ranks).
        model: the model to rescore with. out (`str | os.PathLike`): the rescored recording's directory.
        mode, streams, encodings, chunk_size: as `rescore`'s.
        progress (`bool`): show a progress bar (tqdm) over generations.
        rank, world_size (`int`, *optional*): as `record`'s (default: from torchrun's environment).

    Returns:
        `dict`: `rescored` (generations rescored now), `skipped` (already complete in `out`), `steps`
        (steps rescored now), `seconds`, `rank`, `world_size`.

    Raises:
        ValueError: as `rescore`; a source without sample ids rescored by several ranks or into an `out`
            that holds generations already.
        RecordingError: `source` or `out` is damaged. BlockingIOError: another process is rescoring some of
            these generations into `out`.
    """
    out = local_directory(out, "`out`")
    rank, world_size = process_rank(rank, world_size)
    recording = open_recording(source)
    generations = list(recording.generations)
    keyed = all(gen.sample_ids for gen in generations)
    out = Path(out)
    if not keyed and (world_size > 1 or (out / MANIFEST).is_file() or rank_directories(out)):
        raise ValueError(
            f"the generations of {str(source)!r} carry no sample ids (recorded without `Recorder.set_samples`), so a "
            "rescore cannot tell which of them another run or rank did: rescore it with one process into a new "
            "`--out` (or record with `record`, which names every sample)."
        )
    key = [[str(sample) for sample in (generation.sample_ids or ())] for generation in generations]
    start = time.perf_counter()
    mine, todo = run_share(out, key, rank=rank, world_size=world_size, work=lambda target, todo: rescore(
        recording, model, target, mode=mode, streams=streams, encodings=encodings, generations=todo, append=True,
        chunk_size=chunk_size, progress=progress and rank == 0))
    seconds = time.perf_counter() - start
    return {"rescored": len(todo), "skipped": len(mine) - len(todo),
            "steps": sum(generations[index].num_steps for index in todo), "seconds": round(seconds, 3),
            "rank": rank, "world_size": world_size}
