#!/usr/bin/env bash
# The GPU checks, as one run on a machine with a CUDA device: the CUDA-marked tests, then the GPU
# benchmark (bench/gpu.py). Everything it prints and writes lands in $OUT (default: device-out/).
#
#   OUT=/tmp/gpu bash scripts/device_checks.sh            # python3 must hold torch with CUDA
#   PYTHON=.venv/bin/python bash scripts/device_checks.sh --dry-run   # the same steps on CPU
#
# The package runs from the checkout (PYTHONPATH), with whatever torch, transformers, safetensors and
# NumPy that Python has: nothing is installed. pytest runs with `-W default` because that
# machine's releases are not the pinned ones of `.venv`: their warnings are listed, not errors.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-device-out}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
dry_run=()
[[ "${1:-}" == "--dry-run" ]] && dry_run=(--dry-run)

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
    "$PYTHON" -c 'import platform, torch, transformers, safetensors, numpy
print("python", platform.python_version(), "torch", torch.__version__, "transformers", transformers.__version__,
      "safetensors", safetensors.__version__, "numpy", numpy.__version__, "cuda", torch.cuda.is_available())'
    nproc; free -g | head -2; df -h /tmp . | tail -2
} 2>&1 | tee "$OUT/machine.txt"

started=$SECONDS
# The CUDA-marked tests: recording (test_cuda.py), continuous batching's per-step work, and RL's replay.
timeout "${TESTS_TIMEOUT:-240}" "$PYTHON" -m pytest -q -p no:cacheprovider -W default -m cuda tests/capture/test_cuda.py \
    tests/capture/test_continuous_batching.py tests/rl/test_cuda.py \
    --junitxml "$OUT/cuda-tests.xml" 2>&1 | tee "$OUT/cuda-tests.log"
tests_rc=${PIPESTATUS[0]}
echo "cuda tests: exit $tests_rc after $((SECONDS - started)) s" | tee -a "$OUT/cuda-tests.log"

started=$SECONDS
rm -rf .bench-spill && mkdir -p .bench-spill  # on the checkout's disk, not a tmpfs /tmp
timeout "${BENCH_TIMEOUT:-300}" "$PYTHON" bench/gpu.py --out "$OUT" --budget-s "${BENCH_BUDGET:-240}" \
    --spill-root .bench-spill "${dry_run[@]}" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/gpu-bench.log"
bench_rc=${PIPESTATUS[0]}
echo "gpu benchmark: exit $bench_rc after $((SECONDS - started)) s" | tee -a "$OUT/gpu-bench.log"
rm -rf .bench-spill
exit $(( tests_rc != 0 || bench_rc != 0 ))
