"""What `record` costs over a plain loop of generate() on the same prompts, single process, CPU.

    .venv/bin/python bench/record_cost.py [--prompts 24] [--batch-size 8] [--new-tokens 32] [--repeats 3]

SmolLM2-135M-Instruct (CPU, float32), `--prompts` chat prompts (from bench/export.py), sampled
(temperature 0.7, top_p 0.9) with `min_new_tokens` = `max_new_tokens`, in batches of `--batch-size`.
Three cases, interleaved, `--repeats` times, each the wall time of the whole run (median reported):

- stock: a plain loop of generate() over the batches, no recorder;
- loop + Recorder: the same loop with `Recorder(model, spill_dir=...)` (what `record` does per batch);
- record: `transformers_offload.record.record(...)` on a JSON Lines file of the same prompts (reading
  the file, batching, tokenizing, `set_samples`, the progress bar off).

Reports prompts/s and tokens/s of each and `record`'s time over each loop (target: <= 1.05x the loop
that records the same thing); writes `record_cost.json` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _common import RESULTS, machine, print_table, write_json  # noqa: E402
from export import PROMPTS  # noqa: E402
from transformers_offload import Recorder  # noqa: E402
from transformers_offload.demo_model import load  # noqa: E402
from transformers_offload.record import record  # noqa: E402

SAMPLING = dict(do_sample=True, temperature=0.7, top_p=0.9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    model, tokenizer = load()
    prompts = (PROMPTS * (1 + args.prompts // len(PROMPTS)))[: args.prompts]
    chats = [[{"role": "user", "content": p}] for p in prompts]
    generate = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, **SAMPLING)
    work = Path(tempfile.mkdtemp(prefix="bench-record-"))
    source = work / "prompts.jsonl"
    source.write_text("".join(json.dumps({"id": f"p{i}", "messages": chat}) + "\n" for i, chat in enumerate(chats)))

    def loop(recorded: bool, out: Path) -> None:
        rec = Recorder(model, spill_dir=out) if recorded else None
        for first in range(0, len(chats), args.batch_size):
            texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
                     for c in chats[first:first + args.batch_size]]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            torch.manual_seed(first)
            model.generate(**enc, logits_processor=[rec] if rec else None, pad_token_id=tokenizer.pad_token_id, **generate)
        if rec is not None:
            rec.close()

    cases = {
        "stock loop": lambda out: loop(False, out),
        "loop + Recorder": lambda out: loop(True, out),
        "record": lambda out: record(model, tokenizer, source, out, batch_size=args.batch_size, progress=False, **generate),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for repeat in range(args.repeats):
            for name, run in cases.items():
                out = work / f"{name.replace(' ', '-')}-{repeat}"
                start = time.perf_counter()
                run(out)
                times[name].append(time.perf_counter() - start)
                shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = {name: statistics.median(values) for name, values in times.items()}
    tokens = args.prompts * args.new_tokens
    rows = [[name, f"{medians[name]:.2f}", f"{args.prompts / medians[name]:.2f}", f"{tokens / medians[name]:.1f}",
             f"{medians['record'] / medians[name]:.3f}x"] for name in cases]
    print(print_table(["case", "median s", "prompts/s", "tokens/s", "record over it"], rows))
    write_json(args.out / "record_cost.json", {"machine": machine(), "args": vars(args) | {"out": str(args.out)},
                                               "times": times, "medians": medians})


if __name__ == "__main__":
    main()
