"""Run by tests/store/test_spill.py: record a sampling run to a directory and SIGKILL this process mid-run.

Usage: python spill_then_sigkill.py RECORDING_DIR KILL_AT_STEP COMMITTED_STEPS

At step KILL_AT_STEP it waits (up to 60 s) until the manifest names COMMITTED_STEPS steps, which the
writer has been handed by then, so that the test does not depend on how fast the writer is.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from transformers import LogitsProcessor

from tests.helpers import left_padded_batch, make_tiny
from transformers_offload import Recorder


class KillAt(LogitsProcessor):
    def __init__(self, step: int, path: str, committed: int) -> None:
        self.step, self.calls, self.manifest, self.committed = step, 0, Path(path) / "manifest.json", committed

    def __call__(self, input_ids, scores):
        if self.calls == self.step:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and self._committed() < self.committed:
                time.sleep(0.05)  # the writer commits what it was handed: the test checks what is on disk
            os.kill(os.getpid(), signal.SIGKILL)
        self.calls += 1
        return scores

    def _committed(self) -> int:
        generations = json.loads(self.manifest.read_text())["generations"]
        return generations[0]["num_steps"] if generations else 0


def main() -> None:
    path, kill_at, committed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)  # the test compares with its own run: one thread sums in one order
    model = make_tiny("gpt2")
    rows = 3
    step_bytes = rows * 128 * 4 * 2 + rows * 9
    with Recorder(model, spill_dir=path, shard_bytes=4 * step_bytes) as rec:
        torch.manual_seed(0)
        model.generate(
            **left_padded_batch(), logits_processor=[rec, KillAt(kill_at, path, committed)], max_new_tokens=30,
            min_new_tokens=30, do_sample=True,
        )
    raise SystemExit("not killed")


if __name__ == "__main__":
    main()
