"""Every public error and warning of the package, in one place (each is also exported from
`transformers_offload`). Imports nothing of the package."""

from __future__ import annotations

import shlex
from pathlib import Path


class RecordingError(ValueError):
    """A recording directory cannot be read: missing, damaged, hostile, or of an unknown format.

    Attributes:
        path (`pathlib.Path`): the file (or directory) that is wrong; the recording directory when
            `verify` found several files damaged.
        problem (`str`): what is wrong with it (the message without the path).
        damaged (`tuple[RecordingError, ...]`): one error per damaged file, each naming its file in
            `path` and saying what is wrong in `problem`: several when `verify` found several files
            damaged, else one (this error, or the same without the advice a read adds to it).
    """

    def __init__(self, path: Path | str, problem: str, *, damaged: tuple[RecordingError, ...] = ()) -> None:
        self.path = Path(path)
        self.problem = problem
        self.damaged = tuple(damaged) or (self,)
        super().__init__(f"{self.path}: {problem}")


def verify_command(root: Path | str) -> str:
    """The shell command that checks every file of recording `root`, ready to paste."""
    return f"python -m transformers_offload verify {shlex.quote(str(root))}"


def damaged_files(root: Path, damaged: list[RecordingError], checked: int) -> RecordingError:
    """One error for every damaged file `verify` found among the `checked` files of `root`: the file's
    own error when there is one, else one naming `root` that lists each (`damaged` holds them)."""
    if len(damaged) == 1:
        return damaged[0]
    listed = "".join(f"\n  {error}" for error in damaged)
    return RecordingError(
        root, f"{len(damaged)} of its {checked} file(s) are damaged (reading a step they hold raises; the "
        f"other steps read as before):{listed}", damaged=tuple(damaged),
    )


class SpillError(OSError):
    """Writing the recording to `spill_dir` failed (a full disk, a removed directory...).

    Every shard committed before the failure stays on disk and readable with `open_recording`.
    """


class UnsupportedModeError(ValueError):
    """`generate()` was asked for a decoding mode the recorder cannot record exactly (yet)."""


class StreamNotRecorded(KeyError):
    """A `KeyError` for a stream (or layer) the recording does not hold; its message reads as written
    (a plain `KeyError` prints its message quoted, with escaped quotes)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class RescoreError(RuntimeError):
    """A replay did not follow the recording (another step count, other tokens): the rescored
    generation is not the original's. The message names the generation and the first difference."""


class CompareError(ValueError):
    """The two recordings do not line up (other generations, samples, rows, steps, tokens or
    vocabulary): their distributions cannot be paired token by token. The message says what differs."""


class RecordingMismatchWarning(UserWarning):
    """What a `generate()` call recorded disagrees with what the call computed or returned (its decoding
    loop ran more than once, a step's processors never ran, the returned sequences are not the recorded
    tokens): the generation is marked incomplete (`complete=False`) with the disagreement as its `error`."""

    @classmethod
    def about(cls, index: int, mismatch: str) -> RecordingMismatchWarning:
        """The warning for generation `index`, incomplete because of `mismatch`."""
        return cls(f"transformers-offload: generation {index} of this Recorder is marked incomplete: {mismatch}. "
                   "Its recorded steps stay readable; they may not be what this call returned (docs/support.md "
                   "lists the paths recorded exactly).")


class DeviceAccumulationWarning(UserWarning):
    """`generate()` was also asked to return per-step outputs (scores, logits, attentions, hidden
    states), which it keeps on the device until it returns."""

    @classmethod
    def about(cls, flags: list[str]) -> DeviceAccumulationWarning:
        """The warning for a call that ran with generate()'s own per-step outputs `flags` on."""
        named = ", ".join(f"`{flag}`" for flag in flags)
        return cls(f"this generate() call ran with `return_dict_in_generate=True` and {named} (from its arguments, "
                   "the model's generation_config, or the model's own generate(): Whisper asks for them with "
                   "`logprob_threshold` or `return_token_timestamps`), so generate() also kept those outputs of every "
                   "step on the device until it returned. The Recorder records what its `streams` name without "
                   "them: drop those options where they are yours to keep device memory flat.")


class UnrecordedCallWarning(UserWarning):
    """A Recorder closed having recorded nothing, while its model's `generate()` ran without it in
    `logits_processor`: a recorder only records the calls it is handed (`logits_processor=[rec]`)."""
