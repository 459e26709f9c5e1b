#!/usr/bin/env bash
# Sets everything up (see setup.sh), then runs the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLOAD_REQUIRE_REAL_MODEL=1
exec .venv/bin/python -m pytest "$@"
