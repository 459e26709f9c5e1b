"""Which steps and rows an accessor reads: the `steps=`, `rows=` and `framework=` arguments, checked."""

from __future__ import annotations

import operator
from typing import Any, Sequence, Union

import numpy

from .._lazy import torch  # imported when first used: reading a manifest needs no torch (`inspect`, `verify`)

FRAMEWORKS = ("pt", "np")
Rows = Union[int, slice, Sequence[int], "torch.Tensor", None]
Steps = Union[int, slice, range, None]


def step_range(steps: Steps, num_steps: int) -> range:
    """`steps` as a range of recorded steps: None (all), an int (that one step; negative counts from
    the end), a slice or a range."""
    if steps is None:
        return range(num_steps)
    if not isinstance(steps, (slice, range, bool)) and hasattr(steps, "__index__"):
        step = operator.index(steps)
        if not -num_steps <= step < num_steps:
            raise IndexError(f"`steps` {step} is out of range for {num_steps} recorded steps.")
        step %= num_steps
        return range(step, step + 1)
    if isinstance(steps, slice):
        return range(num_steps)[steps]
    if isinstance(steps, range):
        if len(steps) and not (0 <= min(steps[0], steps[-1]) and max(steps[0], steps[-1]) < num_steps):
            raise IndexError(f"`steps` {steps} reaches outside the {num_steps} recorded steps.")
        return steps
    raise TypeError(
        f"`steps` must be an int, a slice or a range of steps (e.g. `3` or `slice(0, 10)`), got {steps!r}."
    )


def row_index(rows: Rows, num_rows: int) -> Any:
    """`rows` as an index into the row axis: None, an int (drops the axis), a slice, or row indices (an
    int64 NumPy array, which indexes a torch tensor as well: picking rows needs no torch)."""
    if rows is None:
        return None
    if isinstance(rows, slice):
        return rows if (rows.step or 1) > 0 else numpy.arange(num_rows)[rows].copy()  # torch takes no negative stride
    wrong = TypeError(
        f"`rows` must be an int, a slice, a sequence of row indices or a boolean mask of {num_rows} rows, "
        f"got {rows!r}."
    )
    if isinstance(rows, bool):
        raise wrong
    if not isinstance(rows, (list, tuple, range)) and not hasattr(rows, "__array__"):
        try:
            row = operator.index(rows)  # int, NumPy integer
        except TypeError:
            raise wrong from None
        if not -num_rows <= row < num_rows:
            raise IndexError(f"`rows` {row} is out of range for {num_rows} rows.")
        return row
    try:
        index = numpy.asarray(rows)  # a list, a range, a NumPy array, a CPU tensor
    except (TypeError, ValueError, RuntimeError):
        raise wrong from None
    if index.ndim == 0 and index.dtype.kind in "iu":
        return row_index(int(index), num_rows)
    if index.size == 0:
        return numpy.zeros(0, dtype=numpy.int64)
    if index.dtype == numpy.bool_:
        if index.shape != (num_rows,):
            raise IndexError(f"a boolean `rows` mask must have {num_rows} entries, got shape {tuple(index.shape)}.")
        return index.nonzero()[0].astype(numpy.int64)
    if index.dtype.kind not in "iu" or index.ndim != 1:
        raise wrong
    index = index.astype(numpy.int64)
    if int(index.min()) < -num_rows or int(index.max()) >= num_rows:
        raise IndexError(f"`rows` {index.tolist()} reaches outside the {num_rows} rows.")
    return index


def check_framework(framework: str) -> str:
    if framework not in FRAMEWORKS:
        raise ValueError(f"`framework` must be 'pt' (torch) or 'np' (NumPy), got {framework!r}.")
    return framework


def as_framework(value: Any, name: str, framework: str) -> Any:
    """`value` (a tensor, or a NumPy array as a recording directory reads it without torch) as the caller
    asked: a tensor (`"pt"`, sharing the array's memory), or a NumPy array (`"np"`).

    Raises:
        TypeError: `"np"` for a bfloat16 tensor (NumPy has no bfloat16).
    """
    if isinstance(value, numpy.ndarray):
        return value if framework == "np" else torch.from_numpy(value)
    if framework != "np":
        return value
    if value.dtype == torch.bfloat16:
        raise TypeError(
            f"NumPy has no bfloat16: {name!r} was recorded in torch.bfloat16. Use `framework='pt'` and "
            "convert with `.float().numpy()`."
        )
    return value.numpy()
