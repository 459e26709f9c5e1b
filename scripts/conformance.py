"""Hugging Face's generation tests as the oracle: run them with a Recorder added to every `generate()`
call (the pytest plugin `tests/conformance/offload_conformance.py`) and write a table per model family:
calls exact / different / refused / crashed / unchecked.

    python scripts/conformance.py --hf-repo PATH          # Hugging Face's tests, from a checkout
    python scripts/conformance.py --hf-repo PATH --families gpt2 whisper
    python scripts/conformance.py --corpus standin        # the stand-in corpus (tests/conformance/)
    python scripts/conformance.py --hf-repo PATH --baseline --update-docs

Hugging Face's tests: the release's source distribution (from the package index, with pip, cached in
.matrix/conformance/) holds only `tests/*_common.py`; the generation tests (`tests/generation/`), the model
tests (`tests/models/FAMILY/`), `utils/test_module` and the root `conftest.py` come from a checkout of the
transformers repository (`--hf-repo`, at the release's tag or a tree laid out as one, such as
../shared/hf-generation-tests/transformers), laid over the source distribution's in a tree built anew for
the run (.matrix/conformance/tree-<release>). The families run are all those the checkout holds
(or `--families`). The stand-in corpus (`tests/conformance/standin_generation.py`) calls `generate()` on
tiny models of 38 families in the modes Hugging Face's `GenerationTesterMixin` exercises.

Writes .matrix/conformance/results-<release>-<corpus>.json (every call) and .md (the table); with
`--update-docs`, the table between the corpus's markers in docs/support.md (`conformance-hf-table`,
`conformance-table` for the stand-in). `--baseline` also runs the tests that failed with the plugin without it
(those that passed need no second run) and lists the tests that fail only with it.

Exits 2 when the run checked less than it was given: a checkout lacking what the tests need, pytest ending
abnormally, a test file that failed to collect, no test run, or a file (a family) that recorded no call.
Exits 1 when a call is `different` or `crashed`, or a test fails only with the plugin; else 0.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import transformers

ROOT = Path(__file__).resolve().parent.parent
PLUGIN_DIR = ROOT / "tests" / "conformance"
CACHE = ROOT / ".matrix" / "conformance"
VERDICTS = ("exact", "different", "refused", "crashed", "unchecked")
# GenerationTesterMixin's tests and the model tests' own generation tests; `GenerationTest`: the classes of
# generation tests that use no mixin (seamless_m4t's SeamlessM4TGenerationTest; most others need the Hub
# and skip offline).
HF_SELECTION = ("generate or greedy or sample or beam or assisted or prompt_lookup or left_padding or past_key_values "
                "or GenerationTest")


def _sdist(release: str) -> Path:
    """The release's source distribution, extracted once into the cache."""
    target = CACHE / f"transformers-{release}"
    if not (target / "PKG-INFO").exists():
        download = CACHE / "downloads"
        download.mkdir(parents=True, exist_ok=True)
        archive = download / f"transformers-{release}.tar.gz"
        if not archive.exists():
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                            f"transformers=={release}", "-d", str(download)], check=True)
        shutil.rmtree(target, ignore_errors=True)
        with tarfile.open(archive) as tar:
            tar.extractall(CACHE, filter="data")
    return target


# The parts of a transformers checkout its model tests need besides the release's `tests/*_common.py`:
# `utils/test_module` (custom classes the common tests import), the root `conftest.py` (markers and
# options), the generation tests, the model tests and their helpers.
CHECKOUT_PARTS = ("conftest.py", "utils", "tests/__init__.py", "tests/generation", "tests/models", "tests/utils",
                  "tests/exporters", "tests/fixtures", "tests/causal_lm_tester.py")
REQUIRED_PARTS = ("utils/test_module", "conftest.py", "tests/generation/test_utils.py", "tests/models")


class TreeError(SystemExit):
    """The tree given cannot run Hugging Face's tests: what is missing (exit status 2)."""

    def __init__(self, message: str) -> None:
        print(f"conformance: {message}", file=sys.stderr)
        super().__init__(2)


def _hf_tests(release: str, repo: Path | None, families: list[str] | None = None) -> tuple[Path, list[str]]:
    """A folder laid out as transformers' repository, built anew for this run: the release's source
    distribution (`tests/*_common.py`, the release's own) with the checkout's other parts laid over it;
    and the model test files of `families` (default: every family the checkout holds)."""
    if repo is None:
        raise TreeError(f"transformers {release}'s source distribution holds only tests/*_common.py, not "
                        "tests/generation/ nor tests/models/: pass --hf-repo with a checkout of the transformers "
                        f"repository (tag v{release}, or a tree laid out as one), or run --corpus standin.")
    repo = repo.resolve()
    missing = [part for part in REQUIRED_PARTS if not (repo / part).exists()]
    if missing:
        raise TreeError(f"{repo} is not a checkout the model tests can run from: it lacks {', '.join(missing)} "
                        "(the model tests import utils/test_module and the generation tests; the root conftest.py "
                        "registers their markers)")
    present = {path.parent.name for path in (repo / "tests" / "models").glob("*/test_modeling_*.py")
               if path.name == f"test_modeling_{path.parent.name}.py"}
    wanted = families if families is not None else sorted(present)
    absent = [family for family in wanted if family not in present]
    if absent:
        raise TreeError(f"{repo} has no model tests for {', '.join(absent)} (tests/models/FAMILY/test_modeling_FAMILY.py)")
    if not wanted:
        raise TreeError(f"{repo} holds no model tests (tests/models/FAMILY/test_modeling_FAMILY.py)")
    sdist = _sdist(release)
    tree = CACHE / f"tree-{release}"
    if tree.exists():
        _make_writable(tree)  # a run stopped before it made its copies writable
        shutil.rmtree(tree)
    shutil.copytree(sdist / "tests", tree / "tests")
    for part in CHECKOUT_PARTS:
        source = repo / part
        if source.is_dir():
            shutil.copytree(source, tree / part, dirs_exist_ok=True)
        elif source.is_file():
            shutil.copy2(source, tree / part)
    for extra in (repo / "tests").glob("*.py"):  # common modules the release does not ship
        if not (tree / "tests" / extra.name).exists():
            shutil.copy2(extra, tree / "tests" / extra.name)
    _make_writable(tree)
    # `tests/test_pipeline_mixin.py` loads `src/transformers/__init__.py` of the checkout: the installed
    # release's package, the one the tests run against.
    (tree / "src").mkdir()
    (tree / "src" / "transformers").symlink_to(Path(transformers.__file__).resolve().parent, target_is_directory=True)
    return tree, [f"tests/models/{family}/test_modeling_{family}.py" for family in wanted]


def _make_writable(tree: Path) -> None:
    """The copy is the run's own: a tree given read-only (CI's shared folder) leaves read-only copies."""
    for path in [tree, *tree.rglob("*")]:
        if not path.is_symlink():
            path.chmod(path.stat().st_mode | (0o700 if path.is_dir() else 0o600))


def _pytest(cwd: Path, files: list[str], out: Path, *, workers: int, selection: str | None, baseline: bool) -> tuple[float, int]:
    """Runs pytest with the plugin; pytest's output goes to `out`/pytest.log. Seconds taken and pytest's
    exit status."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(PLUGIN_DIR), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "pytest", "-p", "offload_conformance", "--conformance-out", str(out), "--durations=30",
               "-q", "-p", "no:cacheprovider", "-p", "no:logging", "-W", "ignore", "--rootdir", str(cwd), *files]
    if cwd == PLUGIN_DIR:
        command += ["-c", os.devnull]  # not the project's pytest settings: the corpus is not its suite
    if baseline:
        command.append("--conformance-baseline")
    if workers > 1:
        command += ["-n", str(workers)]
    if selection:
        command += ["-k", selection]
    start = time.monotonic()
    with open(out / "pytest.log", "w", encoding="utf-8") as log:
        status = subprocess.run(command, cwd=cwd, env=env, check=False, stdout=log, stderr=subprocess.STDOUT).returncode
    return time.monotonic() - start, status


# pytest's exit statuses that mean the tests did not run as asked (1, some tests failed, is read per test).
PYTEST_STATUS = {2: "interrupted", 3: "an internal error", 4: "a usage error", 5: "no test collected"}


def _refusals(out: Path, status: int, files: list[str], calls: list[dict] | None) -> list[str]:
    """Why a run cannot be trusted: pytest did not finish, a file did not collect, no test ran, or (with
    `calls`) a file recorded no call; a pytest-xdist worker crashed. Empty when every file ran and, where
    asked, each recorded calls."""
    problems = []
    log = out / "pytest.log"
    if status in PYTEST_STATUS:
        problems.append(f"pytest ended with status {status} ({PYTEST_STATUS[status]}); see {log}")
    for row in _read(out, "collect"):
        problems.append(f"{row['file']} failed to collect: {row['detail']} (see {log})")
    for row in _read(out, "crashed"):
        problems.append(f"the pytest worker running {row['test']} crashed: {row['detail']}")
    ran = [t for t in _read(out, "tests") if t["when"] == "call"]
    if not ran:
        problems.append(f"no test ran (see {log})")
    if calls is not None:
        recorded = collections.Counter(call["test"].split("::", 1)[0] for call in calls if call.get("test"))
        for file in files:
            if not recorded[file]:
                problems.append(f"{file}: no generate() call was recorded (its tests ran none, or the plugin did not "
                                "see them)")
    return problems


def _read(out: Path, kind: str) -> list[dict]:
    rows = []
    for path in sorted(out.glob(f"{kind}-*.jsonl")):
        rows.extend(json.loads(line) for line in path.read_text().splitlines() if line)
    return rows


def _family_of(call: dict) -> str:
    """The corpus's family (the test id's) where it names one, else the model's `model_type`."""
    test = call.get("test") or ""
    if "[" in test:
        return test.split("[", 1)[1].split("-", 1)[0] if "standin" in test else call["family"]
    if "/models/" in test:
        return test.split("/models/", 1)[1].split("/", 1)[0]
    return call["family"]


def table(calls: list[dict], tests: list[dict], baseline: list[dict] | None) -> tuple[str, dict]:
    """The per-family table and the run's summary. Besides each verdict's count: the calls that used prompt
    lookup, and the tests that ran (passed or failed) without making a single generate() call, listed per
    family in the summary: a test counted as passed that checked nothing of ours is visible there."""
    per_family: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for call in calls:
        per_family[_family_of(call)][call["verdict"]] += 1
        per_family[_family_of(call)]["prompt lookup"] += bool(call.get("prompt_lookup"))
    called = {call.get("test") for call in calls}
    no_call: dict[str, list[str]] = collections.defaultdict(list)
    for test in sorted({t["test"] for t in tests if t["when"] == "call" and t["outcome"] in ("passed", "failed")}):
        if test not in called:
            family = _family_of({"test": test, "family": "?"})
            no_call[family].append(test.split("::")[-1])
            per_family[family]["no call"] += 1
    failed = {t["test"] for t in tests if t["outcome"] == "failed"}
    failed_before = None if baseline is None else {t["test"] for t in baseline if t["outcome"] == "failed"}
    only_with_plugin = sorted(failed - failed_before) if failed_before is not None else None
    for test in only_with_plugin or ():
        per_family[_family_of({"test": test, "family": "?"})]["only with the Recorder"] += 1
    columns = (*VERDICTS, "raises", "prompt lookup", "no call", "only with the Recorder")
    lines = ["| family | calls | exact | different | refused | crashed | unchecked | raises without the Recorder too "
             "| of them prompt lookup | tests that made no call | tests failing only with the Recorder |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    totals = collections.Counter()
    for family in sorted(per_family):
        counts = per_family[family]
        totals.update(counts)
        calls_made = sum(counts[v] for v in (*VERDICTS, "raises"))
        lines.append(f"| {family} | {calls_made} | " + " | ".join(
            str(counts[v]) if v != "only with the Recorder" or baseline is not None else "-" for v in columns) + " |")
    lines.append(f"| **all {len(per_family)} families** | {sum(totals[v] for v in (*VERDICTS, 'raises'))} | " + " | ".join(
        str(totals[v]) if v != "only with the Recorder" or baseline is not None else "-" for v in columns) + " |")
    summary = {"families": len(per_family), "totals": {v: totals[v] for v in (*VERDICTS, "raises") if totals[v]},
               "prompt_lookup_calls": totals["prompt lookup"],
               "tests": len({t["test"] for t in tests}), "tests_failed": sorted(failed),
               "tests_without_a_call": dict(sorted(no_call.items())),
               "tests_failing_without_the_plugin_too": None if failed_before is None else sorted(failed_before),
               "tests_failing_only_with_the_plugin": only_with_plugin}
    return "\n".join(lines), summary


DOC_MARKERS = {"hf": "conformance-hf-table", "standin": "conformance-table"}


def _update_docs(markdown: str, corpus: str) -> None:
    path = ROOT / "docs" / "support.md"
    text = path.read_text()
    start, end = f"<!-- {DOC_MARKERS[corpus]}:start -->", f"<!-- {DOC_MARKERS[corpus]}:end -->"
    if start not in text:
        sys.exit(f"conformance: {path} has no {start} marker")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{markdown}\n{end}{tail}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", choices=("hf", "standin"), default="hf")
    parser.add_argument("--hf-repo", type=Path, help="a checkout of the transformers repository at the release's tag")
    parser.add_argument("--families", nargs="+", metavar="FAMILY",
                        help="Hugging Face's model families to run (default: every family the checkout holds)")
    parser.add_argument("-n", "--workers", type=int, default=2, help="pytest-xdist workers (default 2)")
    parser.add_argument("-k", dest="selection", help="run only the tests pytest's -k selects")
    parser.add_argument("--baseline", action="store_true",
                        help="also run the tests that failed with the plugin without it, to tell which fail only with it")
    parser.add_argument("--update-docs", action="store_true", help="write the table into docs/support.md")
    args = parser.parse_args()

    release = transformers.__version__
    if args.corpus == "hf":
        cwd, files = _hf_tests(release, args.hf_repo, args.families)
        selection = HF_SELECTION if not args.selection else f"({HF_SELECTION}) and ({args.selection})"
    else:
        cwd, files, selection = PLUGIN_DIR, ["standin_generation.py"], args.selection
    name = f"{release}-{args.corpus}"
    out = CACHE / f"run-{name}"
    seconds, status = _pytest(cwd, files, out, workers=args.workers, selection=selection, baseline=False)
    calls, tests = _read(out, "calls"), _read(out, "tests")
    problems = _refusals(out, status, files, calls)
    baseline = None
    if args.baseline:
        # Only the tests that failed with the Recorder run again without it: a test that passed with it needs no
        # baseline to be told apart (the whole corpus again took as long as the first run).
        failed = sorted({t["test"] for t in tests if t["outcome"] == "failed"})
        baseline = []
        if failed:
            base = out.with_name(out.name + "-baseline")
            _, base_status = _pytest(cwd, failed, base, workers=min(args.workers, len(failed)), selection=selection,
                                     baseline=True)
            problems += [f"baseline run: {problem}" for problem in _refusals(base, base_status, failed, None)]
            baseline = _read(base, "tests")
            missing = set(failed) - {t["test"] for t in baseline}
            problems += [f"baseline run: {test} did not run" for test in sorted(missing)]
        print(f"conformance: baseline run without the Recorder: the {len(failed)} test(s) that failed with it")
    markdown, summary = table(calls, tests, baseline)
    summary.update(release=release, corpus=args.corpus, seconds=round(seconds, 1), workers=args.workers,
                   shims=sorted({row["shim"] for row in _read(out, "shims")}), problems=problems)
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE / f"results-{name}.json").write_text(json.dumps({"summary": summary, "calls": calls}, indent=1, default=str))
    (CACHE / f"results-{name}.md").write_text(markdown + "\n")
    print(markdown)
    print(json.dumps(summary, indent=1))
    for call in calls:
        if call["verdict"] in ("different", "crashed", "unchecked"):
            print(f"{call['verdict']}: {call['test']} ({call['model']}, {call.get('modes')}): {call.get('detail')}")
    for problem in problems:
        print(f"conformance: {problem}", file=sys.stderr)
    if problems:
        print(f"conformance: FAILED: {len(problems)} problem(s) above: the run did not check what it was given",
              file=sys.stderr)
        return 2
    if args.update_docs:
        if args.corpus == "hf":
            command = f"python scripts/conformance.py --hf-repo TREE{' --baseline' if args.baseline else ''}"
            what = (f"transformers {release}, Hugging Face's tests ({summary['tests']} tests of {len(files)} families; "
                    f"the harness's shims: {'; '.join(summary['shims']) or 'none'})")
        else:
            command, what = ("python scripts/conformance.py --corpus standin",
                             f"transformers {release}, standin corpus, {summary['tests']} tests")
        _update_docs(markdown + f"\n\n{what}, {round(seconds)} s with {args.workers} workers (`{command}`).", args.corpus)
    bad = summary["totals"].get("different", 0) + summary["totals"].get("crashed", 0)
    return 1 if bad or summary["tests_failing_only_with_the_plugin"] else 0


if __name__ == "__main__":
    sys.exit(main())
