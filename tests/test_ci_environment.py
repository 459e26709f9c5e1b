"""What CI installs and what the version matrix runs.

- Every package CI installs is locked (scripts/lock/, written by scripts/lock.sh): the .venv's lock pins each
  requirement of the extras scripts/setup.sh installs, at a version inside pyproject.toml's range, and each
  release of scripts/matrix-releases.txt has a lock of its own that pins that release and the entry's other pins.
- The test modules tests/conftest.py lists as release-independent (run once per set of pins on the matrix, not on
  every release) consult no release fact: they import nothing from `_compat`, name no helper that skips or
  branches on the release, and use no fixture that compares with Hugging Face's per-release reference.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from .helpers import RELEASE_INDEPENDENT, ROOT

TESTS = ROOT / "tests"
LOCKS = ROOT / "scripts" / "lock"
# The extras scripts/setup.sh installs into the .venv, and the package stage's (scripts/package.sh).
SETUP_EXTRAS = ("test", "demo", "integrations", "table", "plot")
# Fixtures of tests/conftest.py that record beside Hugging Face's reference for the call, which is taken
# differently before and after 4.40 (`helpers.hf_reference`).
REFERENCE_FIXTURES = frozenset({"recorded"})
# Helpers that adapt to the release without changing what a test asserts: `make_tiny` skips a model the release
# does not have (Llama before 4.28). The check does not follow release facts through them.
ADAPTS_ONLY = frozenset({"make_tiny"})


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"{path.name}: {line!r} is not NAME==VERSION"
            pins[canonicalize_name(name)] = version.strip()
    return pins


def _pyproject() -> dict:
    if sys.version_info < (3, 11):
        pytest.skip("reads pyproject.toml with tomllib (Python 3.11+)")
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_venv_lock_pins_every_requirement_setup_installs_inside_its_range():
    project = _pyproject()
    pins = _pins(LOCKS / "venv.txt")
    requirements = [Requirement(text) for text in project["dependencies"]]
    for extra in SETUP_EXTRAS:
        requirements += [Requirement(text) for text in project["optional-dependencies"][extra]]
    checked = 0
    for requirement in requirements:
        name = canonicalize_name(requirement.name)
        if name == "torch":  # chosen by TORCH_VERSION (a CPU or CUDA build), never locked
            assert name not in pins
            continue
        assert name in pins, f"scripts/lock/venv.txt does not pin {name}: run scripts/lock.sh (see its header)"
        assert requirement.specifier.contains(pins[name], prereleases=True), (name, pins[name], str(requirement))
        checked += 1
    assert checked >= 30
    assert "transformers-offload" not in pins


def _matrix_entries() -> list[list[str]]:
    lines = (ROOT / "scripts" / "matrix-releases.txt").read_text().splitlines()
    return [line.split() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_every_release_of_the_matrix_is_locked_with_its_own_pins():
    entries = _matrix_entries()
    assert len(entries) >= 16
    for release, *extra in entries:
        lock = LOCKS / f"transformers-{release}.txt"
        assert lock.exists(), f"{lock.name} is missing: scripts/matrix.sh refuses an unlocked release of the matrix"
        pins = _pins(lock)
        assert pins["transformers"] == release
        for pin in extra:
            name, _, version = pin.partition("==")
            assert pins[canonicalize_name(name)] == version, (release, pin)
    named = {path.name for path in LOCKS.glob("transformers-*.txt")}
    assert named == {f"transformers-{release}.txt" for release, *_ in entries}, "a lock for a release the matrix dropped"


def _definitions(tree: ast.Module) -> dict[str, set[str]]:
    """Top-level name -> every name and attribute its definition mentions."""
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [target.id for target in node.targets if isinstance(target, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        else:
            continue
        mentioned = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        mentioned |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
        for name in names:
            found[name] = mentioned
    return found


def _feature_checks(tree: ast.Module) -> set[str]:
    """Top-level names defined by asking transformers what it has: `hasattr(transformers, ...)` or
    `hasattr(X(), ...)` with X imported from transformers."""
    from_transformers = {"transformers"} | {alias.asname or alias.name for node in tree.body
                                            if isinstance(node, ast.ImportFrom) and node.module == "transformers"
                                            for alias in node.names}
    found = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for call in ast.walk(node.value):
                if (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "hasattr"
                        and {n.id for n in ast.walk(call.args[0]) if isinstance(n, ast.Name)} & from_transformers):
                    found.update(target.id for target in node.targets if isinstance(target, ast.Name))
    return found


def release_facts() -> set[str]:
    """The helpers (tests/helpers.py) that consult the release: those mentioning `_compat` or the release itself
    (`TRANSFORMERS`, `__version__`, a `hasattr` asked of transformers), and those mentioning one of them, but for
    `ADAPTS_ONLY`."""
    tree = ast.parse((TESTS / "helpers.py").read_text())
    definitions = _definitions(tree)
    facts = {"_compat", "TRANSFORMERS", "__version__"} | _feature_checks(tree)
    grown = True
    while grown:
        grown = False
        for name, mentioned in definitions.items():
            if name not in facts and name not in ADAPTS_ONLY and mentioned & facts:
                facts.add(name)
                grown = True
    return facts


def consulted(source: str, facts: set[str]) -> list[str]:
    """The release facts a test module's source consults: an import from `_compat` or of a fact, a fact named,
    `__version__` read, or a fixture that compares with the per-release reference; `name:line` each."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            names = [alias.name for alias in node.names]
            if (node.module or "").split(".")[-1] == "_compat":
                names.append("_compat")
            found += [f"{name}:{node.lineno}" for name in names if name in facts]
        elif isinstance(node, ast.Name) and node.id in facts:
            found.append(f"{node.id}:{node.lineno}")
        elif isinstance(node, ast.Attribute) and node.attr in facts:
            found.append(f"{node.attr}:{node.lineno}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [f"fixture {a.arg}:{node.lineno}" for a in node.args.args if a.arg in REFERENCE_FIXTURES]
    return sorted(set(found))


def test_release_facts_are_what_the_helpers_branch_on():
    facts = release_facts()
    assert {"TRANSFORMERS", "HF_LOGITS_EXACT", "HAS_LLAMA", "HAS_OUTPUT_LOGITS", "skip_if_refused", "hf_reference",
            "record_with_reference"} <= facts
    assert "make_tiny" not in facts and "assert_steps_equal" not in facts


def test_the_check_sees_every_way_a_module_consults_the_release():
    facts = release_facts()
    source = (
        "from transformers_offload import _compat\n"
        "from transformers_offload._compat import UPCASTS_LOGITS\n"
        "from .helpers import TRANSFORMERS, make_tiny\n"
        "import transformers\n"
        "def test_a(recorded):\n"
        "    if transformers.__version__ < '4.40': pass\n"
        "    helpers.skip_if_refused({})\n"
    )
    assert consulted(source, facts) == ["TRANSFORMERS:3", "__version__:6", "_compat:1", "_compat:2",
                                        "fixture recorded:5", "skip_if_refused:7"]
    assert consulted("from .helpers import make_tiny\ndef test_b(tmp_path, gpt2):\n    make_tiny('gpt2')\n", facts) == []


def test_release_independent_modules_consult_no_release_fact():
    facts = release_facts()
    modules = [path for path in sorted(TESTS.rglob("test_*.py")) if path.stem in RELEASE_INDEPENDENT]
    assert {path.stem for path in modules} == set(RELEASE_INDEPENDENT), "a module conftest lists that does not exist"
    found = {path.relative_to(TESTS).as_posix(): consulted(path.read_text(), facts) for path in modules}
    assert len(found) >= 15
    assert not {name: facts_ for name, facts_ in found.items() if facts_}, (
        "these modules are listed as release-independent in tests/conftest.py (run once per set of pins on the matrix) "
        "but consult the release: take them off the list")

