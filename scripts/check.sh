#!/usr/bin/env bash
# Everything CI checks, from a fresh machine: sets up (scripts/setup.sh, through test.sh), runs the
# whole test suite on the newest transformers (scripts/test.sh), the version matrix on the older
# releases (scripts/matrix.sh), and checks the support table (docs/support.md) against their results.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/test.sh -q
bash scripts/matrix.sh
.venv/bin/python scripts/support_table.py --check
