#!/usr/bin/env bash
# Writes the lock files of scripts/lock/ from the environments this checkout holds now: what CI installs,
# package by package, at the versions the project tested.
#
#   scripts/lock/venv.txt                 the project's .venv (scripts/setup.sh), the package stage's fresh
#                                         environment and its build (scripts/package.sh)
#   scripts/lock/transformers-X.txt       each release of the version matrix (scripts/matrix.sh)
#
# scripts/setup.sh, matrix.sh and package.sh install with these as pip constraints (`pip install -c`), so a
# new release of a dependency (PEFT, TRL, ruff, datasets...) changes nothing in CI until the locks are
# written again on purpose. torch is not in them: it is chosen by TORCH_VERSION (a CPU or CUDA build), as
# the README says. To try the newest releases the pyproject.toml ranges allow, and then lock them:
#
#   rm -rf .venv .matrix
#   TRANSFORMERS_OFFLOAD_UNLOCKED=1 bash scripts/check.sh     # installs unconstrained; all six stages
#   bash scripts/lock.sh                                      # writes what was installed, if it passed
#   git diff scripts/lock/                                    # the releases that moved: say so in the commit
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    echo "lock: no .venv here: run scripts/setup.sh (or scripts/check.sh) first" >&2
    exit 2
fi
mkdir -p scripts/lock
header() {
    echo "# Written by scripts/lock.sh from $1 (pip constraints; torch is chosen by TORCH_VERSION). Change it on purpose:"
    echo "# see scripts/lock.sh."
}
# --all: pip and setuptools too (setuptools is what the package stage's isolated build installs).
{ header ".venv"; .venv/bin/python -m pip freeze --all --exclude-editable --disable-pip-version-check \
    | grep -v -i -E '^(torch|transformers-offload)==' | LC_ALL=C sort -f; } >scripts/lock/venv.txt
echo "lock: scripts/lock/venv.txt ($(grep -c -v '^#' scripts/lock/venv.txt) packages)"
mapfile -t entries < <(grep -v '^\s*#' scripts/matrix-releases.txt | grep -v '^\s*$')
for entry in "${entries[@]}"; do
    read -r release _ <<<"$entry"
    target=".matrix/transformers-$release"
    if [ ! -f "$target/.installed" ]; then  # written by scripts/matrix.sh once the release imports
        echo "lock: $target is not installed: run scripts/matrix.sh first" >&2
        exit 2
    fi
    { header "$target"; .venv/bin/python -m pip list --path "$target" --format freeze --disable-pip-version-check \
        | LC_ALL=C sort -f; } >"scripts/lock/transformers-$release.txt"
    echo "lock: scripts/lock/transformers-$release.txt ($(grep -c -v '^#' "scripts/lock/transformers-$release.txt") packages)"
done
