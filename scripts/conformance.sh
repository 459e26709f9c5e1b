#!/usr/bin/env bash
# The conformance stage of scripts/check.sh: Hugging Face's own generation tests run with a Recorder on
# every generate() call (scripts/conformance.py), on the newest release (the project's .venv), with the
# baseline run without the Recorder. Fails on any call `different` or `crashed`, any test failing only
# with the Recorder, and any run that checked nothing (a file that did not collect, a family with no call).
#
# The tests come from a tree laid out as a checkout of the transformers repository, named by
# $TRANSFORMERS_OFFLOAD_HF_TESTS (.ci/run gives ../shared/hf-generation-tests/transformers). Without one
# the stage says so and is skipped (exit 77, which check.sh reports as skipped) on a user's machine, and
# fails under CI=true: CI never passes a stage that ran nothing.
#
#   TRANSFORMERS_OFFLOAD_HF_TESTS=../shared/hf-generation-tests/transformers bash scripts/conformance.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tree="${TRANSFORMERS_OFFLOAD_HF_TESTS:-}"
if [ -z "$tree" ]; then
    if [ "${CI:-}" = true ]; then
        echo "conformance: FAILED: CI=true and no tree of Hugging Face's generation tests was given" \
            "(TRANSFORMERS_OFFLOAD_HF_TESTS=PATH, a checkout of the transformers repository)" >&2
        exit 1
    fi
    echo "conformance: skipped: no tree of Hugging Face's generation tests given; set" \
        "TRANSFORMERS_OFFLOAD_HF_TESTS=PATH to a checkout of the transformers repository to run them"
    exit 77
fi
bash scripts/setup.sh
exec .venv/bin/python scripts/conformance.py --hf-repo "$tree" --baseline "$@"
