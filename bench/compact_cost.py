"""What compact recordings cost (per-token statistics, sparse scores, top-k), against stock generate() and against
recording the full tensors.

    .venv/bin/python bench/compact_cost.py [--batch 4] [--new-tokens 64] [--repeats 3] [--sampling top_p]
        [--out bench/results]

SmolLM2-135M-Instruct (CPU, float32; vocabulary 49,152), `--batch` chat prompts, `--sampling`
`top_p` (temperature 0.7, top_p 0.9), `top_k` (top_k 50) or `greedy`, `--new-tokens` steps (`min_new_tokens` too, so every
case runs the same
number of steps). Cases, interleaved, `--repeats` times, each the median wall time of one generate()
call, in memory:

- stock generate() (the baseline);
- the Recorder with `streams=("logits", "scores")` (the default: the full tensors);
- the Recorder with `streams=("stats",)` (72 bytes per row and step);
- the Recorder with `streams=("logits", "scores", "stats")`;
- the Recorder with `encodings={"scores": "sparse"}` (lossless), with and without the logits;
- the Recorder with `encodings={"logits": "topk:20", "scores": "topk:20"}` (336 bytes per row, step
  and stream);
- the Recorder with `streams=("scores", "stats")` and `encodings={"scores": "topk:20"}`.

Reports each case's time over the baseline and the bytes it recorded, and writes `compact_cost.json`
under `--out` (`compact_cost-SAMPLING-bBATCH.json` for other settings than top_p at batch 4).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _common import (  # noqa: E402
    CHAT_PROMPTS,
    RESULTS,
    TIMING_HEADERS,
    interleaved,
    machine,
    print_table,
    summarize,
    timed,
    timing_columns,
    write_json,
)

from transformers_offload import Recorder  # noqa: E402
from transformers_offload.demo_model import load  # noqa: E402

CASES = {  # name: (streams, encodings), or None for stock generate()
    "stock generate": None,
    "Recorder: logits, scores": (("logits", "scores"), None),
    "Recorder: stats": (("stats",), None),
    "Recorder: logits, scores, stats": (("logits", "scores", "stats"), None),
    "Recorder: logits, scores as sparse": (("logits", "scores"), {"scores": "sparse"}),
    "Recorder: scores as sparse": (("scores",), {"scores": "sparse"}),
    "Recorder: logits, scores as topk:20": (("logits", "scores"), {"logits": "topk:20", "scores": "topk:20"}),
    "Recorder: scores as topk:20, stats": (("scores", "stats"), {"scores": "topk:20"}),
}
SAMPLING = {  # --sampling
    "top_p": dict(do_sample=True, temperature=0.7, top_p=0.9),
    "top_k": dict(do_sample=True, top_k=50),
    "greedy": dict(do_sample=False),
}
PROMPTS = CHAT_PROMPTS[:4]


def recorded_bytes(rec: Recorder) -> int:
    generation = rec.generation()
    total = 0
    for name in generation.streams:
        for step in generation._get(name, None, None, "pt"):  # noqa: SLF001 - the bench counts what is kept
            total += step.numel() * step.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sampling", choices=sorted(SAMPLING), default="top_p")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    model, tokenizer = load()
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in (PROMPTS * args.batch)[: args.batch]]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    options = dict(SAMPLING[args.sampling], max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                   pad_token_id=tokenizer.pad_token_id)

    def run(case):
        torch.manual_seed(0)
        if case is None:
            return timed(lambda: model.generate(**batch, **options)), 0
        streams, encodings = case
        with Recorder(model, streams=streams, encodings=encodings) as rec:
            seconds = timed(lambda: model.generate(**batch, logits_processor=[rec], **options))
            return seconds, recorded_bytes(rec)

    found = interleaved({name: (lambda _, case=case: run(case)) for name, case in CASES.items()}, args.repeats,
                        warmup=lambda: run(None))
    times = {name: [seconds for seconds, _ in found[name]] for name in CASES}
    sizes = {name: found[name][-1][1] for name in CASES}
    summary = summarize(times, "stock generate")
    rows = []
    record = {"machine": machine(), "batch": args.batch, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "sampling": args.sampling, "cases": {}}
    for name in CASES:
        entry = summary[name]
        per_row_step = sizes[name] / (args.batch * args.new_tokens)
        rows.append([name, *timing_columns(entry), f"{sizes[name]:,}", f"{per_row_step:,.0f}"])
        record["cases"][name] = {"seconds": times[name], "median_s": entry["median_exact"], "ratio": entry["over_base"],
                                 "bytes": sizes[name], "bytes_per_row_and_step": per_row_step}
    print_table(["case", *TIMING_HEADERS, "bytes recorded", "per row and step"], rows)
    suffix = "" if (args.sampling, args.batch) == ("top_p", 4) else f"-{args.sampling}-b{args.batch}"
    write_json(args.out / f"compact_cost{suffix}.json", record)


if __name__ == "__main__":
    main()
