"""Record what Hugging Face `generate()` computes at every step, moved off the device at once."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

# Each public name and the module that defines it, imported when the name is first used (PEP 562), so
# that reading a recording (`open_recording`, the `inspect` and `verify` commands) imports neither torch
# nor transformers; `Recorder` and `rescore` import them.
_EXPORTS = {
    "CompareError": ".errors",
    "Comparison": ".answers.compare",
    "compare": ".answers.compare",
    "to_arrow": ".answers.table",
    "to_pandas": ".answers.table",
    "write_parquet": ".answers.table",
    "write_html": ".answers.viewer",
    "UnsupportedModeError": ".errors",
    "Generation": ".read.generation",
    "StreamNotRecorded": ".errors",
    "Recording": ".read.reader",
    "open_recording": ".read.reader",
    "DeviceAccumulationWarning": ".errors",
    "Recorder": ".recorder",
    "RecordedGRPOTrainer": ".trainers.grpo",
    "RecordingMismatchWarning": ".errors",
    "UnrecordedCallWarning": ".errors",
    "RescoreError": ".errors",
    "rescore": ".rescoring.decode",
    "score": ".rescoring.corpus",
    "KDCollator": ".distill",
    "group_sequences": ".distill",
    "kd_loss": ".distill",
    "write_kd_parquet": ".answers.kd_table",
    "RecordingError": ".errors",
    "SpillError": ".errors",
    "TransferStats": ".store.stored",
    "KeptSets": ".rl.kept",
    "kept_sets": ".rl.kept",
    "replay_logprobs": ".rl.replay",
    "replay_logprobs_from_hidden": ".rl.head",
    "sampler_logprobs": ".rl.sampler",
}

__all__ = sorted([*_EXPORTS, "__version__"])

from .answers import viewer as _viewer  # noqa: E402  registers the notebooks' `_repr_html_` (imports no torch)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from .answers.compare import Comparison, compare
    from .answers.kd_table import write_kd_parquet
    from .answers.table import to_arrow, to_pandas, write_parquet
    from .answers.viewer import write_html
    from .distill import KDCollator, group_sequences, kd_loss
    from .errors import (
        CompareError,
        DeviceAccumulationWarning,
        RecordingError,
        RecordingMismatchWarning,
        RescoreError,
        SpillError,
        StreamNotRecorded,
        UnrecordedCallWarning,
        UnsupportedModeError,
    )
    from .read.generation import Generation
    from .read.reader import Recording, open_recording
    from .recorder import Recorder
    from .rescoring.corpus import score
    from .rescoring.decode import rescore
    from .rl.head import replay_logprobs_from_hidden
    from .rl.kept import KeptSets, kept_sets
    from .rl.replay import replay_logprobs
    from .rl.sampler import sampler_logprobs
    from .store.stored import TransferStats
