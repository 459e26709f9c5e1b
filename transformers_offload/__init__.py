"""Record what Hugging Face `generate()` computes at every step, moved off the device at once."""

from ._capture import UnsupportedModeError
from .recorder import DeviceAccumulationWarning, Recorder
from .recording import Generation

__version__ = "0.1.0"

__all__ = ["DeviceAccumulationWarning", "Generation", "Recorder", "UnsupportedModeError", "__version__"]
