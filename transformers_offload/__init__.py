"""Record what Hugging Face `generate()` computes at every step, moved off the device at once."""

from ._capture import UnsupportedModeError
from ._format import RecordingError
from ._shard_store import SpillError
from .reader import Recording, open_recording
from .recorder import DeviceAccumulationWarning, Recorder
from .recording import Generation, TransferStats

__version__ = "0.1.0"

__all__ = [
    "DeviceAccumulationWarning",
    "Generation",
    "Recorder",
    "Recording",
    "RecordingError",
    "SpillError",
    "TransferStats",
    "UnsupportedModeError",
    "__version__",
    "open_recording",
]
