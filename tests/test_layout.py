"""The package's layout: imports between its folders run one way, along the data's path.

`capture/` (inside `generate()`) and `read/` (reading a recording) both use `store/`; `store/` uses
neither, nor the recorder; `_compat` and `_interrupts` use nothing of the package. Inside `read/` the
modules import one another one way too, with no circle. Checked from the source's import statements,
including those inside functions and under `TYPE_CHECKING`.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "transformers_offload"

# Folder (or top-level module) -> what it must never import.
FORBIDDEN = {
    "capture": ("read", "answers", "recorder", "record", "parallel", "claims", "cli"),
    "store": ("capture", "read", "answers", "recorder", "record", "parallel", "claims", "cli"),
    "read": ("capture", "answers", "recorder", "record", "parallel", "claims", "cli"),
    "answers": ("capture", "recorder", "record", "parallel", "claims", "cli"),
    "parallel": ("capture", "store", "read", "answers", "recorder", "record", "claims", "cli"),
    "claims": ("capture", "read", "answers", "recorder", "record", "parallel", "cli"),  # store.format only
    "_compat": ("capture", "store", "read", "answers", "recorder", "record", "parallel", "claims", "cli",
                "_interrupts"),
    "_interrupts": ("capture", "store", "read", "answers", "recorder", "record", "parallel", "claims", "cli",
                    "_compat"),
}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _imported(path: Path, package: Path = PACKAGE) -> set[str]:
    """Dotted names inside the package that `path` imports (`capture.hooks`, `store.format`, `_compat`...)."""
    folder = list(path.relative_to(package).parts[:-1])
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            module = (node.module or "").split(".") if node.module else []
            if node.level:
                base = folder[: len(folder) - (node.level - 1)]
            elif module[:1] == ["transformers_offload"]:
                base, module = [], module[1:]
            else:
                continue
            found.update(".".join(base + module + [alias.name]) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".", 1)[1] for alias in node.names
                         if alias.name.startswith("transformers_offload."))
    return found


def _owner(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_one_way(path: Path) -> None:
    rules = FORBIDDEN.get(_owner(path), ())
    wrong = sorted(name for name in _imported(path) if name.split(".")[0] in rules)
    assert not wrong, f"{path.relative_to(PACKAGE)} imports {wrong}, against the layout's direction"


def test_the_checker_sees_relative_imports() -> None:
    # The checker itself, on real modules: the recorder uses all three folders; a reader module
    # reaches `store` with `..`, a capture module its sibling with `.` and `_compat` with `..`.
    assert {"capture.hooks", "store.memory.MemoryStore", "read.generation.Generation"} <= _imported(PACKAGE / "recorder.py")
    assert "store.format.RecordingError" in _imported(PACKAGE / "read" / "reader.py")
    assert {"capture.layers", "_compat"} <= _imported(PACKAGE / "capture" / "capture.py")


def _read_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of `package`'s `read/` -> the modules of `read/` it imports (any import statement, anywhere)."""
    modules = {path.stem: path for path in (package / "read").glob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = {imported.split(".")[1] for imported in _imported(path, package) if imported.startswith("read.")}
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def test_read_imports_have_no_circle() -> None:
    # `TopologicalSorter` raises `CycleError` naming the circle's modules when there is one.
    order = list(graphlib.TopologicalSorter(_read_graph()).static_order())
    assert {"generation", "layer_reading", "reader", "ranks", "readable"} <= set(order)


def test_the_circle_check_sees_type_checking_and_function_imports(tmp_path: Path) -> None:
    # A circle made only of an import under `if TYPE_CHECKING:` and one inside a function is found.
    (tmp_path / "read").mkdir()
    (tmp_path / "read" / "low.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .high import High\n"
    )
    (tmp_path / "read" / "high.py").write_text("def high():\n    from . import low\n")
    (tmp_path / "read" / "side.py").write_text("from ..store import format\n")
    assert _read_graph(tmp_path) == {"low": {"high"}, "high": {"low"}, "side": set()}
    with pytest.raises(graphlib.CycleError):
        list(graphlib.TopologicalSorter(_read_graph(tmp_path)).static_order())
