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


def test_every_module_contributing_maps_exists():
    # CONTRIBUTING.md's "Where the code is" names modules by path inside the package (`capture/steps.py`).
    text = (ROOT / "CONTRIBUTING.md").read_text()
    paths = re.findall(r"`((?:capture|store|read|codecs|answers|rescoring|jobs|cli|rl|trainers|_compat)/[\w/]*?\w+\.py)`", text)
    assert len(paths) >= 25, f"CONTRIBUTING.md names {len(paths)} modules"
    missing = [path for path in paths if not (ROOT / "transformers_offload" / path).is_file()]
    assert not missing, f"CONTRIBUTING.md names modules the package does not have: {missing}"
