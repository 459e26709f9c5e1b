#!/usr/bin/env bash
# Sets everything up (see setup.sh), then runs the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The real model and the browser are required here: their tests fail instead of skipping; the browser
# not where system packages were skipped (TRANSFORMERS_OFFLOAD_SKIP_SYSTEM_PACKAGES=1, see setup.sh).
if [ "${TRANSFORMERS_OFFLOAD_SKIP_SYSTEM_PACKAGES:-0}" = 1 ]; then require_browser=0; else require_browser=1; fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLOAD_REQUIRE_REAL_MODEL=1
export TRANSFORMERS_OFFLOAD_REQUIRE_BROWSER="${TRANSFORMERS_OFFLOAD_REQUIRE_BROWSER:-$require_browser}"
# Results per transformers release feed the support table (docs/support.md) (scripts/support_table.py).
release="$(.venv/bin/python -c 'import transformers; print(transformers.__version__)')"
mkdir -p .matrix/results
exec .venv/bin/python -m pytest --junitxml ".matrix/results/$release.xml" "$@"
