"""The package as users install it (scripts/package.sh runs both parts):

    python scripts/package_check.py contents DIST/*.whl DIST/*.tar.gz
        every file of the package in the checkout (`git ls-files transformers_offload`: its modules, page
        templates, py.typed) is in the wheel and in the sdist, and the wheel holds nothing else but its
        metadata; exits 1 naming each file missing.

    python scripts/package_check.py commands --checkout ROOT
        run from a folder outside the checkout, with the installed package (refused if it is imported from the
        checkout): every command of the console script on tiny recordings (the checkout's golden ones, copied
        here) and on the real model (`--model smollm2`, the demo extra): inspect, verify, view, export, plot,
        compare --html, record, rescore, score; each must exit 0 and write what it says. Prints one line per
        command and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

PACKAGE = "transformers_offload"


def package_files(checkout: Path) -> list[str]:
    """The package's files as the checkout tracks them (paths relative to the checkout)."""
    listed = subprocess.run(["git", "ls-files", PACKAGE], cwd=checkout, capture_output=True, text=True, check=True)
    files = sorted(line for line in listed.stdout.splitlines() if line)
    if not files:
        sys.exit(f"package_check: git lists no file under {checkout / PACKAGE}")
    return files


def contents(checkout: Path, archives: list[Path]) -> int:
    wanted = package_files(checkout)
    problems = []
    for archive in archives:
        if archive.suffix == ".whl":
            names = set(zipfile.ZipFile(archive).namelist())
            inside = {name for name in names if not name.split("/", 1)[0].endswith(".dist-info")}
            extra = sorted(inside - set(wanted))
            if extra:
                problems.append(f"{archive.name} holds files that are not the package's: {', '.join(extra)}")
        else:
            with tarfile.open(archive) as tar:
                names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
        missing = [name for name in wanted if name not in names]
        for name in missing:
            problems.append(f"{archive.name} lacks {name}")
        print(f"package: {archive.name}: {len(wanted) - len(missing)} of the package's {len(wanted)} files")
    for problem in problems:
        print(f"package: FAILED: {problem}", file=sys.stderr)
    if problems and any("lacks" in problem for problem in problems):
        print("package: a file the package reads at run time goes in [tool.setuptools.package-data] of "
              "pyproject.toml", file=sys.stderr)
    return 1 if problems else 0


PROMPTS = '{"id": "france", "text": "The capital of France is"}\n{"id": "sky", "text": "The sky is blue because"}\n'


def commands(checkout: Path) -> int:
    import transformers_offload

    where = Path(transformers_offload.__file__).resolve()
    if checkout.resolve() in where.parents:
        sys.exit(f"package_check: {PACKAGE} is imported from the checkout ({where}), not from the installed wheel")
    script = shutil.which("transformers-offload")
    if script is None or Path(sys.prefix).resolve() not in Path(script).resolve().parents:
        sys.exit(f"package_check: the console script of this environment ({sys.prefix}) is not on PATH (found {script})")
    here = Path.cwd()
    for name in ("tiny-recording",):
        shutil.copytree(checkout / "tests" / "golden" / name, here / name)
    (here / "prompts.jsonl").write_text(PROMPTS)
    (here / "corpus.txt").write_text((checkout / "README.md").read_text(encoding="utf-8"), encoding="utf-8")
    runs = [  # (arguments, what it must write)
        (["inspect", "tiny-recording"], None),
        (["verify", "tiny-recording"], None),
        (["view", "tiny-recording", "-o", "page.html"], "page.html"),
        (["export", "tiny-recording", "table.parquet"], "table.parquet"),
        (["plot", "tiny-recording", "-o", "plots"], "plots"),
        (["compare", "tiny-recording", "tiny-recording", "--html", "same.html"], "same.html"),
        (["record", "--model", "smollm2", "--prompts", "prompts.jsonl", "--out", "recorded", "--max-new-tokens", "4",
          "--batch-size", "2", "--no-progress"], "recorded/manifest.json"),
        (["rescore", "recorded", "--model", "smollm2", "--out", "rescored", "--no-progress"], "rescored/manifest.json"),
        (["compare", "recorded", "rescored", "--html", "rescored.html", "--tokenizer", "smollm2"], "rescored.html"),
        (["score", "--model", "smollm2", "--text", "corpus.txt", "--out", "scored", "--context", "64",
          "--max-windows", "2", "--no-progress"], "scored/manifest.json"),
        (["verify", "scored"], None),
    ]
    failed = []
    for arguments, writes in runs:
        start = time.monotonic()
        done = subprocess.run([script, *arguments], capture_output=True, text=True, timeout=900)
        took = time.monotonic() - start
        missing = writes is not None and not (here / writes).exists()
        verdict = "ok" if done.returncode == 0 and not missing else f"FAILED (exit {done.returncode})"
        print(f"package: transformers-offload {' '.join(arguments)}: {verdict} in {took:.1f} s")
        if verdict != "ok":
            failed.append(" ".join(arguments))
            print(f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
                  + (f"\n--- it did not write {writes}" if missing else ""))
    print(f"package: {len(runs) - len(failed)} of {len(runs)} commands ran from the installed wheel ({where.parent})")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = parser.add_subparsers(dest="part", required=True)
    listed = parts.add_parser("contents")
    listed.add_argument("archives", nargs="+", type=Path)
    ran = parts.add_parser("commands")
    ran.add_argument("--checkout", type=Path, required=True)
    args = parser.parse_args()
    if args.part == "contents":
        return contents(Path(__file__).resolve().parent.parent, args.archives)
    return commands(args.checkout)


if __name__ == "__main__":
    sys.exit(main())
