"""Run by tests/test_spill.py: record a sampling run to a directory and SIGKILL this process mid-run.

Usage: python spill_then_sigkill.py RECORDING_DIR KILL_AT_STEP
"""

import os
import signal
import sys
import time

import torch
from transformers import LogitsProcessor

from tests.conftest import left_padded_batch, make_tiny
from transformers_offload import Recorder


class KillAt(LogitsProcessor):
    def __init__(self, step: int) -> None:
        self.step, self.calls = step, 0

    def __call__(self, input_ids, scores):
        if self.calls == self.step:
            time.sleep(1.0)  # let the writer commit what it has: the test checks what is on disk
            os.kill(os.getpid(), signal.SIGKILL)
        self.calls += 1
        return scores


def main() -> None:
    path, kill_at = sys.argv[1], int(sys.argv[2])
    model = make_tiny("gpt2")
    rows = 3
    step_bytes = rows * 128 * 4 * 2 + rows * 9
    with Recorder(model, spill_dir=path, shard_bytes=4 * step_bytes) as rec:
        torch.manual_seed(0)
        model.generate(
            **left_padded_batch(), logits_processor=[rec, KillAt(kill_at)], max_new_tokens=30,
            min_new_tokens=30, do_sample=True,
        )
    raise SystemExit("not killed")


if __name__ == "__main__":
    main()
