"""Modules imported when first used, so that reading a recording (`inspect`, `verify`) starts without
torch: `torch` here stands for the module until one of its attributes is read."""

from __future__ import annotations

import importlib
import sys
from typing import Any


class LazyModule:
    """A stand-in for module `name`: reading any attribute imports the module (once) and returns the
    module's attribute. `name` stays out of `sys.modules` until then.

    Example:
        >>> torch = LazyModule("torch")
        >>> torch.zeros(2).shape  # imports torch here
        torch.Size([2])
    """

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        module = sys.modules.get(self._name) or importlib.import_module(self._name)
        return getattr(module, attribute)

    def __repr__(self) -> str:
        state = "imported" if self._name in sys.modules else "not imported yet"
        return f"<lazy module {self._name!r} ({state})>"


torch = LazyModule("torch")
