"""Bytes and time of each encoding, spilled to disk, against the dense recorder and stock generate(),
for greedy search, top_p 0.9 and top_k 50 at batch 1 and 8, side by side in one run.

    .venv/bin/python bench/encodings_cost.py [--batches 1 8] [--settings greedy top_p top_k]
        [--new-tokens 64] [--repeats 3] [--cases dense "lossless: scores sparse"] [--out bench/results]

SmolLM2-135M-Instruct (CPU, float32; vocabulary 49,152), chat prompts left-padded into a batch,
`--new-tokens` steps (`min_new_tokens` too, so every case runs as many). Per setting and batch, the cases
run interleaved, `--repeats` times; each time is the median wall time of one generate() call, each
recorder spilling to a fresh directory (shards fsynced, as always):

- stock generate() (the baseline);
- dense: `encodings={"logits": "dense", "scores": "dense"}`, both full float32 tensors (`"dense"` for
  the scores also stores them on their own where no processor runs);
- the Recorder's defaults (`Recorder(model, spill_dir=...)`);
- lossless compact: `{"scores": "sparse"}` (the logits of a float32 model have no lossless narrower form),
  and the scores alone so;
- stats only: `streams=("stats",)`;
- top-k, lossy by choice: `{"logits": "topk:20", "scores": "topk:20"}`.

Bytes per row and step are the shards' bytes on disk (safetensors headers and the tokens and finished
mask included; manifest and checksums not) over rows x steps. Writes `encodings_cost.json` under `--out`
(`encodings_cost-<setting>-<batch>.json` when `--cases` picks some of the cases; stock always runs).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _common import CHAT_PROMPTS as PROMPTS  # noqa: E402
from _common import (
    RESULTS,
    TIMING_HEADERS,
    interleaved,
    machine,
    print_table,
    stopwatch,
    summarize,
    timed,
    timing_columns,
    write_json,
)
from _common import SAMPLING_SETTINGS as SETTINGS

from transformers_offload import Recorder  # noqa: E402
from transformers_offload.demo_model import load  # noqa: E402

CASES = {  # name: Recorder options, or None for stock generate()
    "stock generate()": None,
    "dense": dict(encodings={"logits": "dense", "scores": "dense"}),
    "defaults": dict(),
    "lossless: scores sparse": dict(encodings={"scores": "sparse"}),
    "lossless: scores alone, sparse": dict(streams=("scores",), encodings={"scores": "sparse"}),
    "stats only": dict(streams=("stats",)),
    "lossy: topk:20 both": dict(encodings={"logits": "topk:20", "scores": "topk:20"}),
}
# Distillation stores of the top 128 logprobs, after lossy compression (issue 14's survey).
DISTILLATION_BYTES_PER_TOKEN = 300


def shard_bytes(root: Path) -> int:
    return sum(path.stat().st_size for path in root.rglob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", nargs="+", choices=[name for name in CASES if CASES[name] is not None])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    cases_run = [name for name in CASES if CASES[name] is None or args.cases is None or name in args.cases]

    model, tokenizer = load()
    tokenizer.padding_side = "left"
    scratch = Path(tempfile.mkdtemp(prefix="encodings-cost-"))
    record = {"machine": machine(), "new_tokens": args.new_tokens, "repeats": args.repeats,
              "distillation_bytes_per_token": DISTILLATION_BYTES_PER_TOKEN, "runs": []}
    try:
        for setting in args.settings:
            for batch_size in args.batches:
                texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                       add_generation_prompt=True)
                         for p in (PROMPTS * batch_size)[:batch_size]]
                batch = tokenizer(texts, return_tensors="pt", padding=True)
                options = dict(SETTINGS[setting], max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                               pad_token_id=tokenizer.pad_token_id)

                def run(name: str, batch=batch, options=options) -> tuple[float, int]:
                    case = CASES[name]
                    torch.manual_seed(0)
                    if case is None:
                        return timed(lambda: model.generate(**batch, **options)), 0
                    root = scratch / "run"
                    shutil.rmtree(root, ignore_errors=True)
                    with stopwatch() as clock:
                        with Recorder(model, spill_dir=root, **case) as rec:
                            model.generate(**batch, logits_processor=[rec], **options)
                    seconds = clock.seconds
                    size = shard_bytes(root)
                    shutil.rmtree(root)
                    return seconds, size

                found = interleaved({name: (lambda _, name=name: run(name)) for name in cases_run}, args.repeats,
                                    warmup=lambda: run("stock generate()"))
                times = {name: [seconds for seconds, _ in found[name]] for name in cases_run}
                sizes = {name: found[name][-1][1] for name in cases_run}
                summary = summarize(times, "stock generate()")
                # The dense recording's bytes per row and step; without it, its two float32 tensors alone.
                dense = (sizes["dense"] / (batch_size * args.new_tokens) if "dense" in sizes
                         else 2 * 4 * model.config.vocab_size)
                rows, cases = [], {}
                for name in cases_run:
                    entry = summary[name]
                    per = sizes[name] / (batch_size * args.new_tokens)
                    cases[name] = {"seconds": times[name], "median_s": entry["median_exact"],
                                   "over_stock": entry["over_base"], "bytes": sizes[name], "bytes_per_row_and_step": per,
                                   "smaller_than_dense": dense / per if per else None}
                    rows.append([name, *timing_columns(entry), f"{per:,.0f}", f"{dense / per:,.1f}x" if per else "-"])
                print(f"\n{setting}, batch {batch_size}, {args.new_tokens} steps, median of {args.repeats}, spilled")
                print_table(["case", *TIMING_HEADERS, "bytes per row and step", "smaller than dense"], rows)
                record["runs"].append({"setting": setting, "batch": batch_size, "cases": cases})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\nfor comparison: distillation stores of the top 128 logprobs, about {DISTILLATION_BYTES_PER_TOKEN} "
          "bytes per token after lossy compression")
    name = "encodings_cost" if args.cases is None else "-".join(["encodings_cost", *args.settings, *map(str, args.batches)])
    write_json(args.out / f"{name}.json", record)


if __name__ == "__main__":
    main()
