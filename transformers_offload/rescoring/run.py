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

from ..jobs.claims import claim
from ..jobs.parallel import process_rank, share, wait_for_every_rank
from ..jobs.record import recorded_samples, target_directory
from ..read.reader import open_recording
from ..store.layout import MANIFEST, rank_directories
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
    target = target_directory(out, rank, world_size)
    mine = list(share(len(generations), rank, world_size))
    key = {index: [str(sample) for sample in (generations[index].sample_ids or ())] for index in mine}

    def pending() -> list[str]:  # read once the running writers' claims are known (see `claims`)
        done = recorded_samples(out)
        return [sample for index in mine for sample in key[index] if not set(key[index]) <= done]

    start = time.perf_counter()
    with claim(out, pending, rank=rank, world_size=world_size, target=target) as claimed:
        claimed = set(claimed)
        todo = [index for index in mine if not keyed or set(key[index]) & claimed]
        if todo:
            rescore(recording, model, target, mode=mode, streams=streams, encodings=encodings, generations=todo,
                    append=True, chunk_size=chunk_size, progress=progress and rank == 0)
    seconds = time.perf_counter() - start
    wait_for_every_rank()
    return {"rescored": len(todo), "skipped": len(mine) - len(todo),
            "steps": sum(generations[index].num_steps for index in todo), "seconds": round(seconds, 3),
            "rank": rank, "world_size": world_size}
