#!/usr/bin/env bash
# Runs the test suite against other transformers releases, each in its own environment.
#
#   bash scripts/matrix.sh                 # every release in scripts/matrix-releases.txt
#   bash scripts/matrix.sh 4.41.2 4.51.3   # any other releases, on demand
#
# Each release is installed once, with what it pins (tokenizers, huggingface-hub...), into
# .matrix/transformers-VERSION with `pip install --target`, and put first on PYTHONPATH over the
# project's .venv, whose torch and test tools stay. Results (JUnit XML) go to .matrix/results/.
# Extra pytest arguments: MATRIX_PYTEST_ARGS="-k greedy". Exits non-zero if any release fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -gt 0 ]; then
    releases=("$@")
else
    mapfile -t releases < <(grep -v '^\s*#' scripts/matrix-releases.txt | grep -v '^\s*$')
fi
mkdir -p .matrix/results
failed=()
for release in "${releases[@]}"; do
    target=".matrix/transformers-$release"
    if [ ! -f "$target/.installed" ]; then
        rm -rf "$target"
        .venv/bin/python -m pip install --quiet --disable-pip-version-check --target "$target" \
            "transformers==$release" 2>&1 | grep -v "^WARNING: Location" || true
        .venv/bin/python -c "import sys; sys.path.insert(0, '$target'); import transformers; assert transformers.__version__ == '$release'"
        touch "$target/.installed"
    fi
    echo "== transformers $release"
    if PYTHONPATH="$PWD/$target" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLOAD_MATRIX="$release" \
        .venv/bin/python -m pytest -q -m "not slow and not cuda" -p no:cacheprovider \
        --junitxml ".matrix/results/$release.xml" ${MATRIX_PYTEST_ARGS:-} tests; then
        :
    else
        failed+=("$release")
    fi
done
if [ "${#failed[@]}" -gt 0 ]; then
    echo "matrix: failed on transformers ${failed[*]}" >&2
    exit 1
fi
echo "matrix: passed on transformers ${releases[*]}"
