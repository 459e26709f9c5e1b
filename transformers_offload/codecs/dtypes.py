"""The dtypes a recording holds: their names in the manifest and in safetensors headers, their sizes,
and torch dtypes by code, named without importing torch until one is asked for."""

from __future__ import annotations

from typing import Any

import numpy

from .._lazy import torch

# The dtypes a recording holds, by the name the manifest uses, and their size in bytes (read without
# torch: `inspect` and `verify` need no torch dtype; `dtype_of` gives one).
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "bool": 1}


# The same dtypes as safetensors names them in a file's header (`get_slice(name).get_dtype()`).
SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
                      "I64": "int64", "I32": "int32", "BOOL": "bool"}


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> `"float32"`, the name the manifest uses."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype | None:
    """`"float32"` -> `torch.float32` (imports torch); None for a name a recording cannot hold."""
    return getattr(torch, name) if name in DTYPE_BYTES else None


class TorchDtypes:
    """torch dtypes by code (their position), named without importing torch until one is asked for.

    Attributes:
        names (`tuple[str, ...]`): the dtypes' manifest names, by code.
    """

    def __init__(self, *names: str) -> None:
        self.names = names

    def __getitem__(self, code: int) -> torch.dtype:
        return getattr(torch, self.names[code])

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Any:
        return (getattr(torch, name) for name in self.names)

    def index(self, dtype: torch.dtype) -> int:
        """The code of `dtype`; `ValueError` when it has none."""
        return self.names.index(dtype_name(dtype))


def cast(value: Any, dtype: str) -> Any:
    """`value` (a tensor or a NumPy array) in `dtype` (a name both spell alike): the same conversion."""
    return value.astype(dtype) if isinstance(value, numpy.ndarray) else value.to(getattr(torch, dtype))
