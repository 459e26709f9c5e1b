"""The per-token table's export on a recording of more than 1 GB: rows per second and peak memory.

    .venv/bin/python bench/export.py [--new-tokens 112] [--chunk-steps 16] [--runs 5] [--out bench/results]

Records 24 chat prompts with SmolLM2-135M-Instruct (CPU, float32, vocabulary 49,152) in 3 batches of 8
(sampling: temperature 0.7, top_p 0.9; `--new-tokens` steps each, `min_new_tokens` too), raw logits and
processed scores spilled to disk (393 KB per row and step: 1.06 GB at 112 steps), each prompt named with
`set_samples`. Then, `--runs` times, interleaved, each in a fresh process with the C library's default
allocator settings (`_common.fresh_runs`; peak RSS from `ru_maxrss`):

- the baseline: open the recording and read one step (the imports, torch, the reader);
- `write_parquet(run, path)`: logprob, rank and entropy under both kinds, from the full tensors;
- `write_parquet(run, path, top=5)`: the same with 5 alternatives per kind.

Reports tokens (table rows) per second, recording bytes read per second, and each export's peak RSS
over the baseline of the same round (median, min..max), and of it the anonymous memory (`RssAnon`, sampled every 5 ms; the
rest is the
recording's shard pages the reader maps, file-backed and reclaimable), next to the bytes of one chunk of steps
(`--chunk-steps` x 8 rows x 2 streams x
vocabulary x 4); writes `export.json` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    RESULTS,
    TIMING_HEADERS,
    ResidentPeaks,
    fresh_runs,
    machine,
    peak_rss_bytes,
    print_table,
    stopwatch,
    summarize,
    timing_columns,
    write_json,
)

PROMPTS = [
    "Write a haiku about the sea.", "What is the capital of France?", "Explain photosynthesis briefly.",
    "Name three primary colours.", "How do vaccines work?", "Give me a tip for learning Python.",
    "What is a black hole?", "Describe a cat in one sentence.", "Why is the sky blue?",
    "Suggest a name for a bakery.", "What is 12 times 13?", "Summarise the plot of Hamlet.",
    "How far is the Moon?", "What does a CPU do?", "Translate 'good morning' into Spanish.",
    "List two uses of copper.", "What causes rain?", "Recommend a board game for four players.",
    "What is an API?", "Write a limerick about a frog.", "How do plants drink water?",
    "What is inflation?", "Describe the taste of lemon.", "Why do we sleep?",
]


def record(root: Path, new_tokens: int) -> float:
    import torch

    from transformers_offload import Recorder
    from transformers_offload.demo_model import load

    model, tokenizer = load()
    with stopwatch() as clock, Recorder(model, spill_dir=root) as rec:
        for first in range(0, len(PROMPTS), 8):
            batch = PROMPTS[first:first + 8]
            texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                   tokenize=False) for p in batch]
            enc = tokenizer(texts, return_tensors="pt", padding=True)
            rec.set_samples([f"prompt-{first + i}" for i in range(len(batch))], metadata=[{"text": p} for p in batch])
            torch.manual_seed(first)
            model.generate(**enc, logits_processor=[rec], do_sample=True, temperature=0.7, top_p=0.9,
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id)
    return clock.seconds


def child(root: str, case: str, target: str, chunk_steps: int) -> None:
    from transformers_offload import open_recording
    from transformers_offload.answers.table import write_parquet

    run = open_recording(root)
    peaks = ResidentPeaks(interval=0.005)  # the anonymous memory's peak, sampled every 5 ms
    with stopwatch() as clock:
        if case == "baseline":
            run.logits(0, steps=0)
            result = {"rows": 0, "bytes": 0}
        else:
            result = write_parquet(run, target, top=5 if case == "top 5" else 0, chunk_steps=chunk_steps)
    peak_anonymous, _ = peaks.stop()
    print(json.dumps({**result, "seconds": clock.seconds, "peak_rss": peak_rss_bytes(), "peak_anonymous": peak_anonymous}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=112)
    parser.add_argument("--chunk-steps", type=int, default=16)
    parser.add_argument("--runs", type=int, default=5, help="each export this many times, each in a fresh default process")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", nargs=4, metavar=("ROOT", "CASE", "TARGET", "CHUNK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        root, case, target, chunk = args.child
        child(root, case, target, int(chunk))
        return
    work = Path(tempfile.mkdtemp(prefix="bench-export-"))
    try:
        seconds_recorded = record(work / "run", args.new_tokens)
        size = sum(p.stat().st_size for p in (work / "run").rglob("*") if p.is_file())
        print(f"recorded {size / 1e9:.2f} GB in {seconds_recorded:.0f} s")
        cases = ("baseline", "no alternatives", "top 5")
        found = fresh_runs(__file__, {case: ["--child", str(work / "run"), case,
                                             str(work / f"{case.replace(' ', '-')}.parquet"), str(args.chunk_steps)]
                                      for case in cases}, args.runs)
        vocab = 49152
        chunk_bytes = args.chunk_steps * 8 * 2 * vocab * 4  # a generation has 8 rows
        mib = {key: {case: [run[key] / 2**20 for run in found[case]] for case in cases}
               for key in ("peak_rss", "peak_anonymous")}
        over = {key: summarize(values, "baseline") for key, values in mib.items()}
        rows, summary = [], {}
        for case in cases[1:]:
            seconds = summarize({case: [run["seconds"] for run in found[case]]})[case]
            rss, anonymous = over["peak_rss"][case]["excess"], over["peak_anonymous"][case]["excess"]
            last = found[case][-1]
            summary[case] = {"seconds": seconds, "rows": last["rows"], "parquet_bytes": last["bytes"],
                             "peak_rss_over_baseline_mib": rss, "peak_anonymous_over_baseline_mib": anonymous}
            rows.append([case, last["rows"], *timing_columns(seconds), f"{last['rows'] / seconds['median_exact']:,.0f}",
                         f"{size / seconds['median_exact'] / 1e6:,.0f}",
                         f"{rss['median']:,.0f} ({rss['min']:,.0f}..{rss['max']:,.0f})",
                         f"{anonymous['median']:,.0f} ({anonymous['min']:,.0f}..{anonymous['max']:,.0f})",
                         f"{last['bytes'] / 1e6:.2f}"])
        print_table(["export", "rows", *TIMING_HEADERS[:2], "rows/s", "recording MB/s",
                     "peak RSS over baseline, MiB (min..max)", "of it anonymous, MiB (min..max)", "parquet MB"], rows)
        base = over["peak_rss"]["baseline"]
        print(f"baseline peak RSS {base['median']:,.0f} MiB ({base['min']:,.0f}..{base['max']:,.0f}) over {args.runs} "
              f"runs, each in a fresh default process; one chunk of steps is {chunk_bytes / 2**20:,.0f} MiB")
        write_json(args.out / "export.json", {
            "machine": machine(), "recording_bytes": size, "record_seconds": seconds_recorded, "chunk_steps": args.chunk_steps,
            "chunk_bytes": chunk_bytes, "new_tokens": args.new_tokens, "runs": args.runs, "allocator_env": "default",
            "summary": summary, "each": found,
        })
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
