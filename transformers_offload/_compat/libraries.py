"""What depends on the installed release of the other libraries the package uses: safetensors' slices and
I/O errors, torchao's config objects (as transformers takes them), and the TRL releases the trainer was
tested on."""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch
import transformers
from packaging.version import Version

_RELEASE = Version(transformers.__version__)

# TorchAoConfig(quant_type=...) taking torchao 0.18's config objects (`Int8WeightOnlyConfig()`): tried on
# 5.x only (`rescoring.quantization`; older releases wanted names such as "int8_weight_only").
TORCHAO_CONFIG_OBJECTS = _RELEASE >= Version("5.0.0")


def read_slice(view: Any, start: int | None, stop: int | None) -> torch.Tensor:
    """`view[start:stop]` of a safetensors slice (`safe_open(...).get_slice(name)`), read from the file.

    safetensors 0.4 indexes torch tensors with a list internally, which torch 2.x warns about; the
    warning is about safetensors' code, not ours, so it is silenced here.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Using a non-tuple sequence for multidimensional indexing", UserWarning)
        return view[start:stop]


def errno_in_message(message: str) -> int | None:
    """The OS error number inside a safetensors I/O error, which carries no `errno` attribute.

    safetensors 0.4 writes `IoError(Os { code: 28, ... })`; newer releases `... (os error 28)`.
    """
    found = re.search(r"os error (\d+)|Os \{ code: (\d+)", message)
    return None if found is None else int(found.group(1) or found.group(2))


# trainers.grpo overrides TRL GRPOTrainer's private methods as these releases have them (its tests ran on these only).
TRL_TESTED = ("1.16",)


def trl_tested(version: str) -> bool:
    return "{0.major}.{0.minor}".format(Version(version)) in TRL_TESTED
