"""Record what Hugging Face `generate()` computes at every step, moved off the device at once."""

from .answers.compare import CompareError, Comparison, compare
from .answers.table import to_arrow, to_pandas, write_parquet
from .answers.viewer import write_html  # importing the viewer registers the notebooks' `_repr_html_`
from .answers.kd_table import write_kd_parquet
from .capture.modes import UnsupportedModeError
from .distill import KDCollator, group_sequences, kd_loss
from .read.generation import Generation
from .read.indexing import StreamNotRecorded
from .read.reader import Recording, open_recording
from .recorder import DeviceAccumulationWarning, Recorder, RecordingMismatchWarning
from .rescore import RescoreError, rescore
from .store.format import RecordingError
from .store.shards import SpillError
from .store.stored import TransferStats

__version__ = "0.1.0"

__all__ = [
    "CompareError",
    "Comparison",
    "DeviceAccumulationWarning",
    "KDCollator",
    "Generation",
    "Recorder",
    "Recording",
    "RecordingError",
    "RecordingMismatchWarning",
    "RescoreError",
    "SpillError",
    "StreamNotRecorded",
    "TransferStats",
    "UnsupportedModeError",
    "__version__",
    "compare",
    "group_sequences",
    "kd_loss",
    "open_recording",
    "rescore",
    "to_arrow",
    "to_pandas",
    "write_html",
    "write_kd_parquet",
    "write_parquet",
]
