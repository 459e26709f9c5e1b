"""A recorder and other processes. A forked child (multiprocessing's "fork", `datasets.map(num_proc=N)`, a
DataLoader worker) inherits the recorder with its open recording directory and its lock: two processes writing
one manifest would replace each other's generations, so a child's call on a recorder with `spill_dir` is
refused before it runs. An in-memory recorder records the child's calls in the child's own memory, readable
there (the parent's recorder never sees them). Neither a recorder nor a model with one attached pickles, so
a spawned process is never handed one. docs/integrations.md#processes shows one recorder per worker."""

from __future__ import annotations

import os
from pathlib import Path

_ONE_PER_WORKER = ("Create the Recorder inside each worker, each with its own directory, and read them back as one: "
                   "e.g. in `datasets.map(fn, num_proc=N, with_rank=True)`, `Recorder(model, spill_dir=f'runs/x/"
                   "rank-{rank}', append=True)` in `fn`, then `open_recording('runs/x')` (docs/integrations.md#processes).")


def check_process(spill_dir: Path | None, opened_by: int) -> None:
    """Refuse to write `spill_dir` (None: an in-memory recorder, never refused) from any process but
    `opened_by`, the one that opened it.

    Raises:
        RuntimeError: this process is not `opened_by` (a fork of it), saying what to do instead.
    """
    if spill_dir is not None and os.getpid() != opened_by:
        raise RuntimeError(
            f"this Recorder writes to `spill_dir` {str(spill_dir)!r}, opened by process {opened_by}; this is process "
            f"{os.getpid()}, a fork of it (multiprocessing, `datasets.map(num_proc=N)`, a DataLoader worker). Two "
            "processes writing one recording would overwrite each other's generations, so nothing was run. "
            + _ONE_PER_WORKER)


def not_pickled(what: str) -> TypeError:
    """The error of pickling or copying `what` (a recorder, or a model with one attached)."""
    return TypeError(
        f"{what} cannot be pickled or copied: a Recorder holds the model's hooks, its recording and (with "
        "`spill_dir`) a directory only its own process may write. Close the Recorder first (`rec.close()`) to "
        "copy, save or send the model (`save_pretrained` and `state_dict()` work as they are). To record in "
        "other processes (multiprocessing's spawn, `datasets.map(num_proc=N)`, DataLoader workers), create a "
        "Recorder inside each worker, each with its own `spill_dir` (docs/integrations.md#processes).")
