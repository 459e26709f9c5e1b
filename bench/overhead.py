"""Time of stock generate() vs generate() with outputs vs the Recorder, side by side in one run.

    .venv/bin/python bench/overhead.py [--batch 4] [--new-tokens 128] [--repeats 3]

Greedy decoding on SmolLM2-135M-Instruct (CPU, float32), every case forced to the same length with
`min_new_tokens`. Prints a table of median wall times and ratios to the baseline (plain generate, no
outputs) and writes bench/results/overhead.json. The full benchmark suite (memory against steps,
GPU, spill, reader) comes with its own issue; this is the first, CPU-only measure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from transformers_offload import Recorder  # noqa: E402
from transformers_offload.demo_model import load  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    model, tokenizer = load()
    prompts = ["Tell me a long story about a lighthouse keeper."] * args.batch
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    common = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=tokenizer.pad_token_id)

    def baseline():
        return model.generate(**batch, **common)

    def with_outputs():
        return model.generate(**batch, **common, return_dict_in_generate=True, output_scores=True, output_logits=True)

    rec = Recorder(model)

    def recorder():
        rec.clear()
        return model.generate(**batch, logits_processor=[rec], **common)

    cases = {"generate (no outputs)": baseline, "generate + output_scores/logits": with_outputs, "Recorder (memory)": recorder}
    baseline()  # warm-up
    times = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, run in cases.items():  # interleaved, so drift hits every case alike
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    rec.close()

    base = statistics.median(times["generate (no outputs)"])
    rows = []
    print(f"batch {args.batch}, {args.new_tokens} new tokens, median of {args.repeats}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, {os.cpu_count()} CPUs")
    print(f"{'case':<34}{'seconds':>9}{'x baseline':>12}")
    for name, values in times.items():
        median = statistics.median(values)
        rows.append({"case": name, "seconds": median, "ratio_to_baseline": median / base, "all_seconds": values})
        print(f"{name:<34}{median:>9.3f}{median / base:>12.3f}")
    with_out = statistics.median(times["generate + output_scores/logits"])
    rec_time = statistics.median(times["Recorder (memory)"])
    print(f"Recorder / generate with outputs: {rec_time / with_out:.3f}")
    RESULTS.mkdir(exist_ok=True)
    record = {
        "batch": args.batch, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "transformers": transformers.__version__},
        "cases": rows, "recorder_over_outputs": rec_time / with_out,
    }
    (RESULTS / "overhead.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
