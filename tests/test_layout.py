"""The package's layout: imports run one way, along the data's path, and no module imports itself round.

The leaves (`errors`, `codecs/`, `_compat`...) use nothing above them; `store/` uses the leaves; `capture/`
(inside `generate()`) and `read/` (reading a recording) use `store/` and never each other; `answers/` only
read; the recorder joins capture, store and read; `jobs/`, `rescoring/` and `cli/` sit on top. Checked from
the source's import statements, including those inside functions and under `TYPE_CHECKING`.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

from .helpers import ROOT

PACKAGE = ROOT / "transformers_offload"

# Each folder or top-level module -> the folders and modules of the package it may import: the data's path,
# from the leaves (errors, codecs, the compatibility layer) through the stores to capture and reading, then the
# answers, the recorder, the second pipelines and the command line. Whatever is not listed is refused.
LEAVES = ("errors", "_compat", "_interrupts", "_lazy", "_version", "demo_model", "distill")
ALLOWED = {
    **{leaf: set() for leaf in LEAVES},
    "codecs": {"_lazy"},
    "store": {"errors", "codecs", "_compat", "_interrupts", "_lazy"},
    "capture": {"errors", "codecs", "store", "_compat", "_interrupts", "_lazy", "_version"},
    "read": {"errors", "codecs", "store", "_lazy"},
    "answers": {"errors", "codecs", "store", "read", "demo_model", "_lazy"},
    "rl": {"errors", "codecs", "read"},
    "trainers": {"errors", "recorder", "rl", "_compat"},
    "recorder": {"errors", "codecs", "store", "capture", "read", "_compat", "_version"},
    "jobs": {"errors", "store", "read", "recorder"},
    "rescoring": {"errors", "store", "capture", "read", "recorder", "jobs", "_compat"},  # capture: PEFT's unwrap
    "cli": {"errors", "store", "read", "answers", "jobs", "rescoring", "demo_model"},
    "__main__": {"cli"},
}
TOP_LEVEL = {"__init__", "__main__", "recorder", *LEAVES}  # the top level holds only these modules


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
    owner = _owner(path)
    if owner == "__init__":  # the package's face re-exports the public names of every folder
        return
    allowed = ALLOWED[owner] | {owner}
    wrong = sorted(name for name in _imported(path) if name.split(".")[0] not in allowed)
    assert not wrong, f"{path.relative_to(PACKAGE)} imports {wrong}, against the layout's direction"


def test_every_folder_and_top_level_module_has_a_place() -> None:
    owners = {_owner(path) for path in _modules()}
    folders = {path.name for path in PACKAGE.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    assert owners - {"__init__"} <= set(ALLOWED), f"not placed in the layout: {sorted(owners - set(ALLOWED) - {'__init__'})}"
    assert owners - folders <= TOP_LEVEL, f"top-level modules beside the entry point: {sorted(owners - folders - TOP_LEVEL)}"


def test_the_checker_sees_relative_imports() -> None:
    # The checker itself, on real modules: the recorder uses all three folders; a reader module
    # reaches `errors` with `..`, a capture module its sibling with `.` and `_compat` with `..`.
    assert {"capture.hooks", "store.memory.MemoryStore", "read.generation.Generation"} <= _imported(PACKAGE / "recorder.py")
    assert "errors.RecordingError" in _imported(PACKAGE / "read" / "reader.py")
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


def _package_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of the package (dotted, `cli.main`; a folder's `__init__` as the folder) -> the package's
    modules it imports, each import resolved to the longest dotted prefix that is a module."""
    def dotted(path: Path) -> str:
        parts = path.relative_to(package).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {dotted(path): path for path in package.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imported(path, package):
            parts = imported.split(".")
            prefix = next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in modules), None)
            if prefix is not None and prefix != name:
                targets.add(prefix)
        graph[name] = targets
    return graph


def test_the_package_has_no_import_circle() -> None:
    order = list(graphlib.TopologicalSorter(_package_graph()).static_order())
    assert {"errors", "recorder", "cli.main", "store.manifest", "capture.hooks"} <= set(order)


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


TESTS = PACKAGE.parent / "tests"


def test_the_tests_mirror_the_package_and_import_no_test_module():
    # tests/<folder>/ for each folder of the package they test (and `integrations`, the libraries users call
    # generate() from); a test module imports the shared `helpers` (and its fixtures come from `conftest`),
    # never another test module.
    folders = {path.name for path in TESTS.iterdir() if (path / "__init__.py").exists()
               and path.name not in ("conformance", "golden", "scripts", "integrations")}
    package = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()}
    assert folders and folders <= package, f"test folders the package does not have: {sorted(folders - package)}"
    wrong = []
    for path in sorted(TESTS.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                names = [node.module or "", *(alias.name for alias in node.names)]
                if any(name.split(".")[-1].startswith(("test_", "conftest")) for name in names):
                    wrong.append(f"{path.relative_to(TESTS)}:{node.lineno}")
    assert not wrong, f"test modules importing test modules or conftest: {wrong}"



# -- state by owner: a class's attributes are set, and its private names read, in its own module only ------
def _owned_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """The attribute names a module's classes set on `self` (or declare in their body), and their private
    names (attributes and methods starting with one `_`)."""
    attributes: set[str] = set()
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                attributes.add(node.attr)
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                attributes.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                attributes.add(node.target.id)
            elif isinstance(node, ast.Assign):
                attributes.update(t.id for t in node.targets if isinstance(t, ast.Name))
    private = {name for name in attributes if name.startswith("_") and not name.startswith("__")}
    return attributes, private


# Names that hold other libraries' objects where the package sets their attributes (checked by name, so an
# attribute name one of the package's classes also owns would look like theirs).
FOREIGN = {
    "arguments": "argparse's Namespace (cli/jobs.py)",
    "ctx": "a torch.autograd.Function's context (distill.py, rl/head.py)",
    "plain": "a transformers model (demo_model.py)",
}


def _reached_into(path: Path, others_attributes: set[str], others_private: set[str], own: set[str],
                  package: Path = PACKAGE) -> list[str]:
    """Where `path` sets an attribute that only another module's classes own, or reads a private name only
    another module's classes define, on an object other than `self`, `cls` or `super()`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Attribute) or node.attr in own:
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in ("self", "cls", *FOREIGN):
            continue
        if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
            continue
        setting = isinstance(node.ctx, ast.Store) and node.attr in others_attributes
        reading = isinstance(node.ctx, ast.Load) and node.attr in others_private
        if setting or reading:
            found.append(f"{path.relative_to(package)}:{node.lineno}: {ast.unparse(node)}"
                         + (" set" if setting else " read"))
    return found


def test_no_module_sets_another_modules_attributes_or_reads_its_private_names() -> None:
    # One call's state is held by its owners (issue 54): a class's attributes change through its own methods,
    # and its private names stay in its module. Checked by name: an attribute name that some class of the
    # module itself owns is the module's own.
    owned = {path: _owned_names(ast.parse(path.read_text(), filename=str(path))) for path in _modules()}
    assert len(owned) >= 100 and sum(len(names) for names, _ in owned.values()) >= 800, "checked too little"
    wrong = []
    for path, (own, own_private) in owned.items():
        others = set().union(*(names for other, (names, _) in owned.items() if other != path))
        others_private = set().union(*(private for other, (_, private) in owned.items() if other != path))
        wrong += _reached_into(path, others, others_private, own | own_private)
    assert not wrong, "modules reaching into another module's objects:\n" + "\n".join(wrong)


def test_the_ownership_check_sees_a_set_and_a_private_read(tmp_path: Path) -> None:
    owner = tmp_path / "owner.py"
    owner.write_text("class Call:\n    def __init__(self):\n        self.step = 0\n        self._until = 0\n")
    other = tmp_path / "other.py"
    other.write_text("def f(c, tokenizer):\n    c.step = 1\n    tokenizer.padding_side = 'left'\n    return c._until\n")
    names, private = _owned_names(ast.parse(owner.read_text()))
    assert names == {"__init__", "step", "_until"} and private == {"_until"}
    assert _reached_into(other, names, private, set(), package=tmp_path) == [
        "other.py:2: c.step set", "other.py:4: c._until read"]


def test_no_module_names_another_modules_class_as_any() -> None:
    # steps.py once typed the capture it belonged to as `Capture = Any` (issue 54): an alias of `Any` at module
    # level hides what a module uses of another's objects; a Protocol says it.
    aliases = []
    assert len(_modules()) >= 100, "checked too little"
    for path in _modules():
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id == "Any":
                aliases.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    assert not aliases, "module-level aliases of Any:\n" + "\n".join(aliases)


# -- one generation record: the manifest's keys are spelled in store/header.py only ---------------------------
# Keys of other formats that these modules read, which happen to share a manifest key's name.
OTHER_FORMATS = {
    ("store/ledger.py", "index"): "the ledger's own lines",
    ("store/ledger.py", "writer"): "the ledger's own lines",
    ("store/open_files.py", "shape"): "a safetensors file's header",
    ("store/open_files.py", "dtype"): "a safetensors file's header",
    ("store/shard_reader.py", "sequences"): "the sequences file's tensor name in its safetensors header",
    ("read/reader.py", "file"): "describe()'s damaged_files entries",
}


def _manifest_keys() -> set[str]:
    from transformers_offload.store import header

    return ({*header.ENTRY_FIELDS, *header.NULLABLE_FIELDS, *header.OnceEntry.KEYS, "writer", "layers", "loop",
             "nested_calls", "adapters", "sample_ids", "sample_metadata", "dense"}
            | {key for owner in (header.StreamEntry, header.ShardEntry, header.OnceEntry) for key, _ in owner.FIELDS})


def _spelled_keys(path: Path, keys: set[str]) -> list[tuple[int, str]]:
    """Where `path` reads or writes one of `keys` by its string: `x["key"]`, `x.get("key")`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            key = node.slice.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop")
              and node.args and isinstance(node.args[0], ast.Constant)):
            key = node.args[0].value
        if isinstance(key, str) and key in keys:
            found.append((node.lineno, key))
    return found


def test_only_the_header_module_spells_a_manifest_key() -> None:
    # Issue 54: a generation's entry was built by hand in spill.py, patched in shard_writer.py, checked key by key
    # in manifest.py and read key by key by the readers. `store/header.py` (GenerationHeader, ManifestEntry,
    # StreamEntry, ShardEntry, OnceEntry) is now the one place; the modules that handle recordings go through it.
    keys = _manifest_keys()
    assert {"num_steps", "streams", "shards", "encoding", "first_step", "sample_ids"} <= keys
    checked, wrong = 0, []
    for path in _modules():
        relative = str(path.relative_to(PACKAGE))
        if relative.split("/")[0] not in ("store", "read") or relative == "store/header.py":
            continue
        checked += 1
        wrong += [f"{relative}:{line}: {key!r}" for line, key in _spelled_keys(path, keys)
                  if (relative, key) not in OTHER_FORMATS]
    assert checked >= 25, f"checked {checked} modules"
    assert not wrong, "manifest keys spelled outside store/header.py:\n" + "\n".join(wrong)
