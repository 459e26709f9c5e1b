"""The docs name the package's functions where they walk through its code (docs/how-it-works.md, "One step,
from the tap to the shard"): each name must still exist, so that a rename or a cut hop shows up here."""

from __future__ import annotations

import importlib
import re

from .helpers import ROOT

WALK = ROOT / "docs" / "how-it-works.md"
NAME = re.compile(r"`(transformers_offload(?:\.\w+)+)`")


def _resolve(dotted: str) -> object:
    """The object `dotted` names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(dotted)


def test_every_function_the_walk_names_exists():
    names = NAME.findall(WALK.read_text())
    assert len(names) >= 20, f"the walk names {len(names)} functions: {names}"
    missing = []
    for dotted in names:
        try:
            _resolve(dotted)
        except (ImportError, AttributeError) as error:
            missing.append(f"{dotted}: {error}")
    assert not missing, "docs/how-it-works.md names what the package no longer has:\n" + "\n".join(missing)


def test_the_check_finds_a_name_that_is_gone():
    assert callable(_resolve("transformers_offload.capture.transfer.HostRing.put"))
    for gone in ("transformers_offload.capture.capture.Capture.put_full", "transformers_offload.capture.nowhere.f"):
        try:
            _resolve(gone)
        except (ImportError, AttributeError):
            continue
        raise AssertionError(f"{gone} resolved")
