#!/usr/bin/env bash
# Everything CI checks, from a fresh machine: sets up (scripts/setup.sh, through test.sh), runs the
# whole test suite on the newest transformers (scripts/test.sh), the version matrix on the older
# releases (scripts/matrix.sh), and checks the support table (docs/support.md) against their results.
# The whole suite runs on every core, one torch thread per worker, as the matrix does: on CI's 2 cores
# 12.6 min for the whole suite (serially, the whole CI run had reached 45 min, its budget).
set -euo pipefail
cd "$(dirname "$0")/.."
OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 bash scripts/test.sh -q -n auto
bash scripts/matrix.sh
.venv/bin/python scripts/support_table.py --check
