#!/usr/bin/env bash
# Everything CI checks, from a fresh machine, in six stages:
#   lint         ruff over the checkout, with pyproject.toml's rules (sets up first, for ruff itself)
#   package      the sdist and the wheel built, their files and metadata checked, the wheel installed into a
#                fresh environment outside the checkout and every command run from it (scripts/package.sh)
#   suite        the whole test suite on the newest transformers (scripts/test.sh, which sets up first)
#   matrix       the version matrix: the release-dependent fast tests on each older release (scripts/matrix.sh)
#   support      the support table (docs/support.md) against their results (scripts/support_table.py --check)
#   conformance  Hugging Face's own generation tests with a Recorder on every call (scripts/conformance.sh;
#                the tree: $TRANSFORMERS_OFFLOAD_HF_TESTS, which .ci/run sets; skipped without one, but
#                under CI=true, where it fails)
# Every stage runs even after one fails; a summary of all of them ends the output, and the exit status
# is non-zero if any failed. A stage that exits 77 did not run (it says why): "skipped" in the summary.
#
#   bash scripts/check.sh                  # all six
#   bash scripts/check.sh matrix support   # only these (to rerun what failed)
#
# CHECK_LINT, CHECK_PACKAGE, CHECK_SUITE, CHECK_MATRIX, CHECK_SUPPORT and CHECK_CONFORMANCE replace a stage's command (a bash command
# line), e.g. to try this script itself (tests/test_check_script.py) without the 40 minutes of the real stages.
# The whole suite runs on every core, one torch thread per worker, as the matrix does: on CI's 2 cores
# 12.6 min for the whole suite (serially, the whole CI run had reached 45 min, its budget).
set -uo pipefail
cd "$(dirname "$0")/.."
declare -A commands=(
    [lint]="${CHECK_LINT:-bash scripts/setup.sh && .venv/bin/ruff check .}"
    [package]="${CHECK_PACKAGE:-bash scripts/package.sh}"
    [suite]="${CHECK_SUITE:-OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 bash scripts/test.sh -q -n auto --durations=30}"
    [matrix]="${CHECK_MATRIX:-bash scripts/matrix.sh}"
    [support]="${CHECK_SUPPORT:-.venv/bin/python scripts/support_table.py --check}"
    [conformance]="${CHECK_CONFORMANCE:-bash scripts/conformance.sh}"
)
stages=("$@")
if [ "${#stages[@]}" -eq 0 ]; then
    stages=(lint package suite matrix support conformance)
fi
for stage in "${stages[@]}"; do
    if [ -z "${commands[$stage]+set}" ]; then
        echo "check: unknown stage '$stage' (stages: lint package suite matrix support conformance)" >&2
        exit 2
    fi
done
summary=()
failed=()
skipped=()
for stage in "${stages[@]}"; do
    echo "== check: $stage: ${commands[$stage]}"
    started=$SECONDS
    bash -c "${commands[$stage]}"
    status=$?
    took="$(( (SECONDS - started) / 60 )) min $(( (SECONDS - started) % 60 )) s"
    if [ "$status" -eq 0 ]; then
        outcome="passed"
    elif [ "$status" -eq 77 ]; then
        outcome="skipped"
        skipped+=("$stage")
    else
        outcome="FAILED (exit $status)"
        failed+=("$stage")
    fi
    summary+=("$(printf '  %-12s %-18s %s' "$stage" "$outcome" "$took")")
done
echo "== check: summary"
printf '%s\n' "${summary[@]}"
if [ "${#failed[@]}" -gt 0 ]; then
    echo "check: ${#failed[@]} of ${#stages[@]} stages failed: ${failed[*]} (rerun them: bash scripts/check.sh ${failed[*]})"
    exit 1
fi
if [ "${#skipped[@]}" -gt 0 ]; then
    echo "check: $(( ${#stages[@]} - ${#skipped[@]} )) of ${#stages[@]} stages passed; skipped: ${skipped[*]}"
else
    echo "check: all ${#stages[@]} stages passed"
fi
