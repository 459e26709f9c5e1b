"""Run under torchrun: `record` in one gloo process group, batches of 4 prompts, 24 new tokens, small shards.

    python -m torch.distributed.run --standalone --nproc_per_node 2 record_ranks.py MODEL PROMPTS OUT

With KILL_RANK_1_IN_CALL=N, rank 1 SIGKILLs itself at the third step of its N-th generate() call, once
its manifest names a committed step of that call (so the test does not depend on how fast the writer
is); torchrun then stops the other rank. With PAUSE_RANK_1_IN_CALL=N, rank 1 stops there instead: it
writes its pid to `paused-1.json` in the working directory and waits (up to 10 minutes) until a file
`resume-1` appears there, then goes on. With USE_ACCELERATE=1 the process group comes from
accelerate's `PartialState` instead of `init_process_group`. Each rank writes its result to `result-RANK.json` in the working
directory.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

from transformers_offload.jobs.record import record


class _StopAtStep(StoppingCriteria):
    def __init__(self, step: int, manifest: Path, pause: bool = False) -> None:
        self.step, self.seen, self.manifest, self.pause = step, 0, manifest, pause

    def __call__(self, input_ids, scores, **kwargs):
        self.seen += 1
        if self.seen == self.step:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and json.loads(self.manifest.read_text())["generations"][-1]["num_steps"] < 1:
                time.sleep(0.02)
            if not self.pause:
                os.kill(os.getpid(), signal.SIGKILL)
            Path("paused-1.json").write_text(json.dumps({"pid": os.getpid()}))
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and not Path("resume-1").exists():
                time.sleep(0.02)
        return False


def main() -> None:
    model_dir, prompts, out = sys.argv[1:4]
    if os.environ.get("USE_ACCELERATE") == "1":
        from accelerate import PartialState

        PartialState(cpu=True)  # what a script under `accelerate launch` does: a gloo group on CPU
    else:
        dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    kill, pause = os.environ.get("KILL_RANK_1_IN_CALL", ""), os.environ.get("PAUSE_RANK_1_IN_CALL", "")
    if (kill or pause) and dist.get_rank() == 1:
        original, calls = model.generate, []

        def generate(*args, **kwargs):
            calls.append(1)
            if len(calls) == int(kill or pause):
                manifest = Path(out) / "rank-1" / "manifest.json"
                kwargs["stopping_criteria"] = StoppingCriteriaList([_StopAtStep(3, manifest, pause=bool(pause))])
            return original(*args, **kwargs)

        model.generate = generate
    result = record(model, tokenizer, prompts, out, batch_size=4, progress=False, max_new_tokens=24,
                    min_new_tokens=24, recorder_options={"shard_bytes": 4096})  # a shard every step or so
    Path(f"result-{dist.get_rank()}.json").write_text(json.dumps(result))  # (stdout would interleave the ranks)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
