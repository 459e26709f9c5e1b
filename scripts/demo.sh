#!/usr/bin/env bash
# Sets everything up (see setup.sh), then runs the real-model demo (examples/chat_demo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
# The demo needs no browser: no system packages (set TRANSFORMERS_OFFLOAD_SKIP_SYSTEM_PACKAGES=0 for them).
TRANSFORMERS_OFFLOAD_SKIP_SYSTEM_PACKAGES="${TRANSFORMERS_OFFLOAD_SKIP_SYSTEM_PACKAGES:-1}" bash scripts/setup.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/python examples/chat_demo.py "$@"
