"""What a recorder refuses before anything runs, each with what to do instead.

Of a `generate()` call (`Recorder.check_call`): sample ids named for another batch size, prompt logprobs over a
cache filled before the call, and `custom_generate`, whose loop the recorder cannot see into.

Of another process: a forked child (multiprocessing's "fork", `datasets.map(num_proc=N)`, a DataLoader worker)
inherits the recorder with its open recording directory and its lock: two processes writing one manifest would
replace each other's generations, so a child's call on a recorder with `spill_dir` is refused before it runs.
An in-memory recorder records the child's calls in the child's own memory, readable there (the parent's
recorder never sees them). Neither a recorder nor a model with one attached pickles, so a spawned process is
never handed one. docs/integrations.md#processes shows one recorder per worker.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import UnsupportedModeError
from ..store.header import Samples
from . import prompt_logprobs as _prompt_logprobs


# -- a call --------------------------------------------------------------------------------------------------
def samples_mismatch(samples: Samples | None, attention_mask: Any, inputs: Any) -> str | None:
    """Why the ids `set_samples` named do not fit this call's batch (None: they fit, or none were named)."""
    if samples is None:
        return None
    batch = next((int(t.shape[0]) for t in (attention_mask, inputs) if t is not None and t.dim() >= 1), None)
    if batch is None or batch == len(samples.ids):
        return None
    return (f"`set_samples` named {len(samples.ids)} prompt(s), but this generate() call has a batch of "
            f"{batch}; nothing was run. Call `set_samples` again with one id per prompt.")


def refuse(*, prompt_scoring: Any, past_key_values: Any, custom_generate: Any) -> None:
    """Raise where the call cannot be recorded as asked.

    Raises:
        ValueError: prompt logprobs asked (`prompt_scoring`) over a `past_key_values` already holding tokens.
        UnsupportedModeError: a `custom_generate` replaces transformers' decoding loop.
    """
    cached = _prompt_logprobs.cache_length(past_key_values) if prompt_scoring is not None else 0
    if cached:
        raise ValueError(
            f"`prompt_logprobs` scores the prompt from the call's own prefill, but this call was given a "
            f"`past_key_values` already holding {cached} token(s), whose forward ran before it; nothing was run. "
            "Score the whole prompt in one call (without the cache), or record this one without `prompt_logprobs`."
        )
    if custom_generate is not None:
        raise UnsupportedModeError(
            "`custom_generate` replaces transformers' decoding loop, which the Recorder cannot see "
            "into; remove the Recorder from `logits_processor` or drop `custom_generate`."
        )


# -- another process -----------------------------------------------------------------------------------------
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
