#!/usr/bin/env bash
# The package stage of scripts/check.sh: the project as users install it, not as a checkout runs it.
#   1. builds the sdist and, from it, the wheel (python -m build), and checks their metadata (twine check
#      --strict);
#   2. checks that every file of the package in the checkout (modules, page templates, py.typed) is in both
#      (scripts/package_check.py contents);
#   3. installs the wheel with its demo, table and plot extras into a fresh virtual environment outside the
#      checkout (torch 2.13.0 first, as the README says) and, from a folder outside the checkout, runs every
#      command of the console script there: inspect, verify, view, export, plot, compare --html, record,
#      rescore and score (scripts/package_check.py commands), failing on any error.
#
#   bash scripts/package.sh            # PACKAGE_KEEP=1 keeps the work folder (printed) to look into
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
bash scripts/setup.sh   # build and twine (the test extra), and the demo model, cached once
work="$(mktemp -d "${TMPDIR:-/tmp}/transformers-offload-package.XXXXXX")"
if [ "${PACKAGE_KEEP:-0}" != 1 ]; then
    trap 'rm -rf "$work"' EXIT
fi
# What is installed, the build's isolated setuptools included, at the versions of scripts/lock/venv.txt (see
# scripts/setup.sh), unless TRANSFORMERS_OFFLOAD_UNLOCKED=1.
lock=()
build_env=()
if [ "${TRANSFORMERS_OFFLOAD_UNLOCKED:-0}" != 1 ]; then
    lock=(-c "$root/scripts/lock/venv.txt")
    build_env=(PIP_CONSTRAINT="$root/scripts/lock/venv.txt")
fi
echo "package: building the sdist and the wheel into $work/dist"
env "${build_env[@]}" .venv/bin/python -m build --outdir "$work/dist" . >"$work/build.log" 2>&1 \
    || { tail -30 "$work/build.log"; exit 1; }
.venv/bin/python -m twine check --strict "$work"/dist/*
.venv/bin/python scripts/package_check.py contents "$work"/dist/*.whl "$work"/dist/*.tar.gz
echo "package: installing the wheel into a fresh environment, $work/venv"
"${PYTHON:-python3}" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --disable-pip-version-check "torch==${TORCH_VERSION:-2.13.0}"
wheel="$(ls "$work"/dist/*.whl)"
"$work/venv/bin/python" -m pip install --quiet --disable-pip-version-check "${lock[@]}" "$wheel[demo,table,plot]"
mkdir "$work/run"
cd "$work/run"
PATH="$work/venv/bin:$PATH" HF_HUB_OFFLINE=1 "$work/venv/bin/python" "$root/scripts/package_check.py" commands \
    --checkout "$root"
