#!/usr/bin/env bash
# Runs the test suite against other transformers releases, each in its own environment.
#
#   bash scripts/matrix.sh                 # every release in scripts/matrix-releases.txt
#   bash scripts/matrix.sh 4.41.2 4.51.3   # any other releases, on demand
#
# Each release is installed once, with what it pins (tokenizers, huggingface-hub...), into
# .matrix/transformers-VERSION with `pip install --target`, and put first on PYTHONPATH over the
# project's .venv, whose torch and test tools stay; without byte-compiling it (`--no-compile`: 10 s a
# release instead of 25 here, Python compiles only what the tests import). Results (JUnit XML) go to
# .matrix/results/.
# Extra pytest arguments: MATRIX_PYTEST_ARGS="-k greedy". Every release runs even after one fails (to
# install or its tests); exits non-zero if any failed.
# Tests marked release_independent (tests/conftest.py) run only on the first entry of each set of other pins.
# One torch thread per test process, as many releases at once as there are cores (MATRIX_LANES; below).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
on_demand=0
if [ "$#" -gt 0 ]; then
    entries=("$@")
    on_demand=1
else
    mapfile -t entries < <(grep -v '^\s*#' scripts/matrix-releases.txt | grep -v '^\s*$')
fi
mkdir -p .matrix/results .matrix/status
# Installs RELEASE [EXTRA...] (one entry) into .matrix/transformers-RELEASE unless it is there already;
# non-zero when the release did not install.
# At the versions of scripts/lock/transformers-RELEASE.txt (pip constraints, written by scripts/lock.sh), unless
# TRANSFORMERS_OFFLOAD_UNLOCKED=1 (the newest releases that transformers RELEASE allows). A release of
# matrix-releases.txt without a lock fails; one named on the command line runs unlocked, saying so.
install() {
    local entry="$1" release extra target lock=() stamp
    read -r release extra <<<"$entry"
    target=".matrix/transformers-$release"
    if [ "${TRANSFORMERS_OFFLOAD_UNLOCKED:-0}" = 1 ]; then
        :
    elif [ -f "scripts/lock/transformers-$release.txt" ]; then
        lock=(-c "scripts/lock/transformers-$release.txt")
    elif [ "$on_demand" = 1 ]; then
        echo "matrix: no scripts/lock/transformers-$release.txt: the newest releases that transformers $release allows"
    else
        echo "matrix: scripts/lock/transformers-$release.txt is missing: a release of matrix-releases.txt is locked" \
            "(run it with TRANSFORMERS_OFFLOAD_UNLOCKED=1, then scripts/lock.sh)" >&2
        return 1
    fi
    stamp="$entry (hub-kernels)${lock[*]:+ $(sha256sum "${lock[1]}" | cut -c1-16)}"
    if [ "$(cat "$target/.installed" 2>/dev/null)" = "$stamp" ]; then
        return 0
    fi
    rm -rf "$target"
    # With its `hub-kernels` extra: transformers 5.25 requires `kernels`, so the project's .venv has the
    # newest, and releases from 4.53 import it when it is there, and fail on one newer than theirs
    # (4.53.3 on its huggingface-hub, 5.0.0 on its API). Each release gets the `kernels` it declares, in
    # its own directory, over the .venv's; a release without the extra gets a warning from pip.
    # shellcheck disable=SC2086  # $extra: further requirements, one word each
    .venv/bin/python -m pip install --quiet --no-compile --disable-pip-version-check --target "$target" \
        "${lock[@]}" "transformers[hub-kernels]==$release" $extra 2>&1 | grep -v "^WARNING: Location" || true
    .venv/bin/python -c "import sys; sys.path.insert(0, '$target'); import transformers; assert transformers.__version__ == '$release'" \
        || return 1
    echo "$stamp" >"$target/.installed"
}
# Every release is installed first, all at once (pip's time is the network's and the disk's more than
# the CPU's: one after the other they took 45 s a release on CI's machines, 8 of its minutes), each
# saying what it did in .matrix/install-RELEASE.log; then their tests run, `lanes` releases at a time.
declare -A installs=()
for entry in "${entries[@]}"; do
    read -r release extra <<<"$entry"
    rm -f ".matrix/results/$release.xml"  # no earlier run's results for the support table if this one fails
    rm -f ".matrix/status/install-$release" ".matrix/status/tests-$release"
    { install "$entry" >".matrix/install-$release.log" 2>&1; echo $? >".matrix/status/install-$release"; } &
    installs[$release]=$!
done
failed=()
releases=()
declare -A pins_run=() tests=()
# Two releases' tests at once (MATRIX_LANES, default: the cores), each one pytest process: on CI's 2 cores
# that took 99 s for two releases where one after the other on two xdist workers took 123 s (each worker
# collects the whole suite, and one idles while the other ends a release). Job control on: otherwise bash
# starts them ignoring SIGINT, which the Ctrl-C tests send themselves. Each release's output is printed, in
# order, once its tests end.
set -m
trap 'status=$?; kill -- $(jobs -p | sed "s/^/-/") 2>/dev/null || true; exit $status' EXIT  # keeps the status
lanes="${MATRIX_LANES:-$(nproc)}"
run_tests() {  # release selection: one release's tests, output into .matrix/tests-RELEASE.log, status beside
    local release="$1" selection="$2" status=0
    PYTHONPATH="$PWD/.matrix/transformers-$release" HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 \
        .venv/bin/python -m pytest -q -m "$selection" -p no:cacheprovider -n "${MATRIX_WORKERS:-0}" \
        --junitxml ".matrix/results/$release.xml" ${MATRIX_PYTEST_ARGS:-} tests >".matrix/tests-$release.log" 2>&1 \
        || status=$?
    echo "$status" >".matrix/status/tests-$release"
}
printed=0
running() {  # this run's releases whose tests have not ended
    local release count=0
    for release in "${releases[@]}"; do
        if [ -n "${tests[$release]+set}" ] && [ ! -f ".matrix/status/tests-$release" ]; then
            count=$((count + 1))
        fi
    done
    echo "$count"
}
print_finished() {  # the releases whose tests ended, in order, up to the first still running (all: wait for them)
    local release status
    while [ "$printed" -lt "${#releases[@]}" ]; do
        release="${releases[$printed]}"
        if [ -n "${tests[$release]+set}" ]; then
            if [ "${1:-}" = all ]; then
                wait "${tests[$release]}" 2>/dev/null || true
            elif [ ! -f ".matrix/status/tests-$release" ]; then
                return 0
            fi
            status="$(cat ".matrix/status/tests-$release" 2>/dev/null || echo 1)"
            cat ".matrix/install-$release.log"
            PYTHONPATH="$PWD/.matrix/transformers-$release" .venv/bin/python -W ignore -c "import numpy, safetensors, torch, transformers; print(
                f'== transformers {transformers.__version__}, torch {torch.__version__}, numpy {numpy.__version__}, '
                f'safetensors {safetensors.__version__}')" || true  # a broken install: its tests failed, saying why
            cat ".matrix/tests-$release.log"
            if [ "$status" -ne 0 ]; then
                failed+=("$release")
            fi
        fi
        printed=$((printed + 1))
    done
}
for entry in "${entries[@]}"; do
    read -r release extra <<<"$entry"
    target=".matrix/transformers-$release"
    wait "${installs[$release]}" 2>/dev/null || true  # its status: in its file (a `wait -n` below may have reaped it)
    installed="$(cat ".matrix/status/install-$release" 2>/dev/null || echo 1)"
    if [ "$installed" -ne 0 ]; then
        cat ".matrix/install-$release.log"
        echo "matrix: transformers $release did not install into $target; going on with the other releases" >&2
        failed+=("$release")
        releases+=("$release")  # (print_finished passes over it: no tests)
        continue
    fi
    # Tests of the store, reader, answers and command line (marked release_independent in tests/conftest.py)
    # run once per set of other packages an entry pins (numpy, safetensors, pyarrow: what they depend on), on
    # its first entry; the newest release (scripts/test.sh) runs them with the .venv's.
    selection="not slow and not cuda"
    if [ -z "$extra" ] || [ -n "${pins_run[$extra]+set}" ]; then
        selection="$selection and not release_independent"
    else
        pins_run[$extra]=$release
    fi
    while [ "$(running)" -ge "$lanes" ]; do
        wait -n 2>/dev/null || sleep 1  # until a job ends (a release's tests, or an install)
        print_finished
    done
    run_tests "$release" "$selection" &
    tests[$release]=$!
    releases+=("$release")
done
print_finished all
if [ "${#failed[@]}" -gt 0 ]; then
    echo "matrix: failed on transformers ${failed[*]}" >&2
    exit 1
fi
echo "matrix: passed on transformers ${releases[*]}"
