"""A job's settings kept beside its recording, so that a resumed `record` or `score` runs like with like.

The command line writes them to `out/.job.json` (`layout.JOB_SETTINGS`: not part of the recording, as
`.writers` is not) when it starts on a new `out`; run again on the same `out`, it compares its own settings
with them before the model loads and refuses, naming each difference, a resume whose settings differ (a
recording whose generations were made under different settings is a silent analysis error), unless the run
allows it (`--allow-other-settings`: then each generation's header keeps its own generation settings, as
always). Another model, or another command's `out`, is refused whatever is allowed: a recording holds one model's
generations. A recording made without the file (by the Python API, or before it existed) is resumed unchecked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..store import layout as _layout
from ..store.files import write_atomically
from ..store.location import local_directory
from .record import recorded_samples


def check(out: str | Path, command: str, settings: dict[str, Any], *, allow_other: bool = False) -> None:
    """Compare `settings` (JSON data, by name) with those `out` was recorded with by `command`, and keep them
    in `out` where it holds no generation yet.

    Raises:
        ValueError: `out` holds generations recorded with other settings (or by another command), unless
            `allow_other`; the message names each difference and what to do.
        RecordingError: as `record.recorded_samples` (a damaged recording in `out`).
    """
    out = local_directory(out, "`--out`")
    path = out / _layout.JOB_SETTINGS
    wanted = {"command": command, **json.loads(json.dumps(settings))}  # as the file holds them (tuples as lists)
    has_generations = (out / _layout.MANIFEST).is_file() or bool(_layout.rank_directories(out))
    if path.is_file() and has_generations and recorded_samples(out):
        kept = json.loads(path.read_text(encoding="utf-8"))
        if kept.get("command") != command:
            raise ValueError(f"`--out` {str(out)!r} was begun by `{kept.get('command')}`, not `{command}`: pick another "
                             "`--out`.")
        if kept.get("model") != wanted.get("model"):  # a recording holds one model's generations, whatever is allowed
            raise ValueError(f"`--out` {str(out)!r} holds generations of the model in {kept.get('model')!r}, not "
                             f"{wanted.get('model')!r}: a recording holds one model's generations; pick another `--out`.")
        differences = [f"{name} {kept.get(name)!r} (now {wanted.get(name)!r})"
                       for name in sorted(set(kept) | set(wanted)) if kept.get(name) != wanted.get(name)]
        if differences and not allow_other:
            raise ValueError(
                f"`--out` {str(out)!r} holds generations recorded with other settings: {'; '.join(differences)}. "
                "Resume with the same settings, pick another `--out`, or pass `--allow-other-settings` to add "
                "generations made otherwise (each generation's header keeps its own generation settings).")
        return
    if has_generations and not path.is_file():
        return  # made without the file: nothing to compare with
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(wanted, indent=1, sort_keys=True) + "\n"
    write_atomically(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))
