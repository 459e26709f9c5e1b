"""How many completed steps a SIGKILL loses with the default shard size: the steps not yet committed.

    .venv/bin/python bench/sigkill_loss.py [--runs 20] [--rows 1] [--vocab 49152] [--out bench/results]

A child process spills a greedy run of a tiny GPT-2 with SmolLM2's vocabulary (49,152; `--vocab`)
at the default shard size (64 MiB), and prints the number of completed steps (tokens appended) after
each step. The parent kills it with SIGKILL at a random time, then counts the steps the recording
holds: lost = completed - readable. The bound, from the design: steps in the ring (`ring_slots`, 4)
plus the three shard buffers that may not be committed yet (one filling, one waiting, one being
written), i.e. `3 x steps_per_shard + ring_slots`; with a writer that keeps up, only the shard being
filled and the ring. Writes `sigkill_loss.json` under `--out`.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from _common import RESULTS, machine, print_table, write_json  # noqa: E402


def child(path: str, rows: int, vocab: int) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, StoppingCriteria

    from transformers_offload import Recorder

    class Report(StoppingCriteria):
        steps = 0

        def __call__(self, input_ids, scores, **kwargs):
            self.steps += 1
            os.write(1, f"{self.steps}\n".encode())
            return False

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=vocab, n_positions=4096,
                        bos_token_id=1, eos_token_id=1, pad_token_id=0)
    model = GPT2LMHeadModel(config).eval()
    input_ids = torch.randint(3, vocab, (rows, 8), generator=torch.Generator().manual_seed(1))
    with Recorder(model, spill_dir=path) as rec:
        model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), logits_processor=[rec],
                       stopping_criteria=[Report()], max_new_tokens=4000, min_new_tokens=4000)


def one_run(path: Path, rows: int, vocab: int, kill_after: float) -> dict:
    from transformers_offload import open_recording

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen([sys.executable, __file__, "--child", str(path), str(rows), str(vocab)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    first = process.stdout.readline()  # the first step is done: generation runs
    assert first, "the child ended before its first step"
    time.sleep(kill_after)
    process.send_signal(signal.SIGKILL)
    rest = process.stdout.read().split()
    process.wait()
    completed = int(rest[-1]) if rest else int(first)
    generation = open_recording(path).generation()
    shards = generation.source._shards  # noqa: SLF001 - the bench reads the layout it measures
    steps_per_shard = shards[0]["num_steps"] if shards else None
    return {"kill_after_s": round(kill_after, 3), "completed": completed, "readable": generation.num_steps,
            "lost": completed - generation.num_steps, "steps_per_shard": steps_per_shard}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--max-seconds", type=float, default=6.0, help="latest kill time after the first step")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.child:
        path, rows, vocab = arguments.child
        child(path, int(rows), int(vocab))
        return
    from transformers_offload.store.shard_writer import shard_size

    step_bytes = arguments.rows * (arguments.vocab * 4 * 2 + 8 + 1)
    shard_bytes = shard_size(step_bytes * 4000)  # the Recorder's default for the child's 4,000 steps
    steps_per_shard = shard_bytes // step_bytes
    ring_slots = 4
    rng = random.Random(0)
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(arguments.runs):
            run = one_run(Path(scratch) / f"run{index}", arguments.rows, arguments.vocab,
                          rng.uniform(0.2, arguments.max_seconds))
            runs.append(run)
            print(f"run {index}: killed {run['kill_after_s']} s after step 1, {run['completed']} completed, "
                  f"{run['readable']} readable, {run['lost']} lost", flush=True)
    bound = 3 * steps_per_shard + ring_slots
    summary = {
        "runs": len(runs), "rows": arguments.rows, "vocab": arguments.vocab, "step_bytes": step_bytes,
        "shard_bytes": shard_bytes, "steps_per_shard": steps_per_shard, "ring_slots": ring_slots,
        "bound_steps": bound, "lost_max": max(r["lost"] for r in runs),
        "lost_mean": round(sum(r["lost"] for r in runs) / len(runs), 1),
    }
    print_table(["runs", "steps per shard", "bound (3 x shard + ring)", "lost: max", "lost: mean"],
                [[summary["runs"], steps_per_shard, bound, summary["lost_max"], summary["lost_mean"]]])
    write_json(arguments.out / "sigkill_loss.json", {"machine": machine(), "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
