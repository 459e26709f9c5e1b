"""Hugging Face's generation tests as the oracle: run them with a Recorder added to every `generate()`
call (the pytest plugin `tests/conformance/offload_conformance.py`) and write a table per model family:
calls exact / different / refused / crashed / unchecked.

    python scripts/conformance.py                         # the installed release, Hugging Face's tests
    python scripts/conformance.py --hf-repo PATH          # ... with the repository's tests at that release
    python scripts/conformance.py --corpus standin        # the stand-in corpus (tests/conformance/)
    python scripts/conformance.py --corpus standin --baseline --update-docs

Hugging Face's tests: the release's source distribution (from the package index, with pip, cached in
.matrix/conformance/) holds only `tests/*_common.py`; the generation tests (`tests/generation/`) and the
model tests (`tests/models/FAMILY/`) come from a checkout of the transformers repository at the release's
tag (`--hf-repo`), laid over the source distribution's. Without them the script says so and exits 2.
The stand-in corpus (`tests/conformance/standin_generation.py`) calls `generate()` on tiny models of 38
families in the modes Hugging Face's `GenerationTesterMixin` exercises.

Writes .matrix/conformance/results-<release>-<corpus>.json (every call) and .md (the table); with
`--update-docs`, the table between the `conformance-table` markers of docs/support.md. `--baseline` also
runs the tests without the plugin and lists the tests that fail only with it. Exits 1 when a call is
`different` or `crashed`, or a test fails only with the plugin.
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

ROOT = Path(__file__).resolve().parent.parent
PLUGIN_DIR = ROOT / "tests" / "conformance"
CACHE = ROOT / ".matrix" / "conformance"
VERDICTS = ("exact", "different", "refused", "crashed", "unchecked")
# Hugging Face's families, one of each kind at least (decoder-only, encoder-decoder, vision-language, speech).
HF_FAMILIES = (
    "gpt2 llama mistral mixtral qwen2 qwen3 qwen2_moe gemma gemma2 phi phi3 opt bloom falcon gpt_neo gpt_neox "
    "gptj codegen olmo olmo2 stablelm starcoder2 granite cohere biogpt xglm t5 bart mbart pegasus marian "
    "blenderbot llava paligemma blip_2 instructblip whisper speech_to_text"
).split()
# GenerationTesterMixin's tests and the model tests' own generation tests.
HF_SELECTION = "generate or greedy or sample or beam or assisted or prompt_lookup or left_padding or past_key_values"


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


def _hf_tests(release: str, repo: Path | None) -> tuple[Path, list[str]]:
    """A folder laid out as transformers' repository (its `tests/`), and the test files to run."""
    tree = _sdist(release)
    if repo is not None:
        for part in ("tests/generation", "tests/models", "tests/utils", "tests/exporters", "tests/fixtures"):
            if (repo / part).exists():
                shutil.copytree(repo / part, tree / part, dirs_exist_ok=True)
        for extra in (repo / "tests").glob("*.py"):
            if not (tree / "tests" / extra.name).exists():
                shutil.copy2(extra, tree / "tests" / extra.name)
    if not (tree / "tests" / "generation" / "test_utils.py").exists():
        print(f"conformance: transformers {release}'s source distribution holds only tests/*_common.py, not "
              "tests/generation/ nor tests/models/: pass --hf-repo with a checkout of the transformers "
              f"repository at tag v{release}, or run --corpus standin.", file=sys.stderr)
        raise SystemExit(2)
    files = [f"tests/models/{family}/test_modeling_{family}.py" for family in HF_FAMILIES
             if (tree / "tests" / "models" / family / f"test_modeling_{family}.py").exists()]
    return tree, files


def _pytest(cwd: Path, files: list[str], out: Path, *, workers: int, selection: str | None, baseline: bool) -> float:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(PLUGIN_DIR), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "pytest", "-p", "offload_conformance", "--conformance-out", str(out),
               "-q", "-p", "no:cacheprovider", "-W", "ignore", "--rootdir", str(cwd), *files]
    if cwd == PLUGIN_DIR:
        command += ["-c", os.devnull]  # not the project's pytest settings: the corpus is not its suite
    if baseline:
        command.append("--conformance-baseline")
    if workers > 1:
        command += ["-n", str(workers)]
    if selection:
        command += ["-k", selection]
    start = time.monotonic()
    subprocess.run(command, cwd=cwd, env=env, check=False, stdout=subprocess.DEVNULL)
    return time.monotonic() - start


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
    per_family: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for call in calls:
        per_family[_family_of(call)][call["verdict"]] += 1
    failed = {t["test"] for t in tests if t["outcome"] == "failed"}
    failed_before = None if baseline is None else {t["test"] for t in baseline if t["outcome"] == "failed"}
    only_with_plugin = sorted(failed - failed_before) if failed_before is not None else None
    lines = ["| family | calls | exact | different | refused | crashed | unchecked | raises without the Recorder too |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    totals = collections.Counter()
    for family in sorted(per_family):
        counts = per_family[family]
        totals.update(counts)
        lines.append(f"| {family} | {sum(counts.values())} | " + " | ".join(str(counts[v]) for v in (*VERDICTS, "raises")) + " |")
    lines.append(f"| **all {len(per_family)} families** | {sum(totals.values())} | "
                 + " | ".join(str(totals[v]) for v in (*VERDICTS, "raises")) + " |")
    summary = {"families": len(per_family), "totals": dict(totals),
               "tests": len({t["test"] for t in tests}), "tests_failed": sorted(failed),
               "tests_failing_only_with_the_plugin": only_with_plugin}
    return "\n".join(lines), summary


def _update_docs(markdown: str) -> None:
    path = ROOT / "docs" / "support.md"
    text = path.read_text()
    start, end = "<!-- conformance-table:start -->", "<!-- conformance-table:end -->"
    if start not in text:
        sys.exit(f"conformance: {path} has no {start} marker")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{markdown}\n{end}{tail}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", choices=("hf", "standin"), default="hf")
    parser.add_argument("--hf-repo", type=Path, help="a checkout of the transformers repository at the release's tag")
    parser.add_argument("-n", "--workers", type=int, default=2, help="pytest-xdist workers (default 2)")
    parser.add_argument("-k", dest="selection", help="run only the tests pytest's -k selects")
    parser.add_argument("--baseline", action="store_true", help="also run without the plugin, to compare test outcomes")
    parser.add_argument("--update-docs", action="store_true", help="write the table into docs/support.md")
    args = parser.parse_args()
    import transformers

    release = transformers.__version__
    if args.corpus == "hf":
        cwd, files = _hf_tests(release, args.hf_repo)
        selection = HF_SELECTION if not args.selection else f"({HF_SELECTION}) and ({args.selection})"
    else:
        cwd, files, selection = PLUGIN_DIR, ["standin_generation.py"], args.selection
    name = f"{release}-{args.corpus}"
    out = CACHE / f"run-{name}"
    seconds = _pytest(cwd, files, out, workers=args.workers, selection=selection, baseline=False)
    baseline = None
    if args.baseline:
        _pytest(cwd, files, out.with_name(out.name + "-baseline"), workers=args.workers, selection=selection, baseline=True)
        baseline = _read(out.with_name(out.name + "-baseline"), "tests")
    calls, tests = _read(out, "calls"), _read(out, "tests")
    markdown, summary = table(calls, tests, baseline)
    summary.update(release=release, corpus=args.corpus, seconds=round(seconds, 1), workers=args.workers)
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE / f"results-{name}.json").write_text(json.dumps({"summary": summary, "calls": calls}, indent=1, default=str))
    (CACHE / f"results-{name}.md").write_text(markdown + "\n")
    print(markdown)
    print(json.dumps(summary, indent=1))
    for call in calls:
        if call["verdict"] in ("different", "crashed", "unchecked"):
            print(f"{call['verdict']}: {call['test']} ({call['model']}, {call.get('modes')}): {call.get('detail')}")
    if args.update_docs:
        _update_docs(markdown + f"\n\ntransformers {release}, {args.corpus} corpus, {summary['tests']} tests, "
                     f"{round(seconds)} s with {args.workers} workers (`python scripts/conformance.py --corpus {args.corpus}`).")
    bad = summary["totals"].get("different", 0) + summary["totals"].get("crashed", 0)
    return 1 if bad or summary["tests_failing_only_with_the_plugin"] else 0


if __name__ == "__main__":
    sys.exit(main())
