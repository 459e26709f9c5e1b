"""Modules imported when first used, so that reading a recording (`inspect`, `verify`) starts without
torch: `torch` here stands for the module until one of its attributes is read."""

from __future__ import annotations

import importlib
import sys
from typing import Any


class LazyModule:
    """A stand-in for module `name`: reading any attribute imports the module (once) and returns the
    module's attribute. `name` stays out of `sys.modules` until then. Attributes the module sets after
    the first read are still found (through the module); one it replaces afterwards is not seen.

    Example:
        >>> torch = LazyModule("torch")
        >>> torch.zeros(2).shape  # imports torch here
        torch.Size([2])
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._copied = False

    def __getattr__(self, attribute: str) -> Any:
        # Called only for names not in this object's own dict. The first read after the import copies the
        # module's attributes in, once, so later reads (per-step code in `codecs`) cost a plain lookup; a
        # name the module adds later (a lazily imported submodule) is read through the module.
        module = sys.modules.get(self._name) or importlib.import_module(self._name)
        if not self._copied:
            self._copied = True
            self.__dict__.update((name, value) for name, value in vars(module).items()
                                 if not name.startswith("__") and name not in ("_name", "_copied"))
        return getattr(module, attribute)

    def __repr__(self) -> str:
        state = "imported" if self._name in sys.modules else "not imported yet"
        return f"<lazy module {self._name!r} ({state})>"


torch = LazyModule("torch")
