"""Scores stored once with the logits (a call with no processor) against storing them twice, CPU.

    .venv/bin/python bench/scores_once.py [--batch 8] [--new-tokens 64] [--repeats 3] [--out bench/results]

SmolLM2-135M-Instruct (CPU, float32), `--batch` chat prompts, greedy search with no processor (no
`min_new_tokens`: that is a processor; the calls stop at the same step, greedy being deterministic).
Cases, interleaved, `--repeats` times, the median wall time of one generate() call, each recorder
spilling to a fresh directory: stock generate(); `Recorder(model, spill_dir=...)` (the default:
`scores` stored as the logits); the same with `encodings={"scores": "dense"}` (stored twice). Reports
the time over stock and the bytes on disk per row and step; writes `scores_once.json` under `--out`.
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


from _common import (  # noqa: E402
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
from compact_cost import PROMPTS  # noqa: E402

from transformers_offload import Recorder, open_recording  # noqa: E402
from transformers_offload.demo_model import load  # noqa: E402

CASES = {"stock generate": None, "Recorder (scores once)": {}, "Recorder, scores dense (twice)": {"scores": "dense"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    model, tokenizer = load()
    chats = [[{"role": "user", "content": p}] for p in (PROMPTS * args.batch)[: args.batch]]
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    options = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    work = Path(tempfile.mkdtemp(prefix="bench-scores-once-"))
    sizes: dict[str, dict] = {}

    def case(number: int, name: str, encodings: dict | None):
        def run(repeat: int) -> float:
            out = work / f"{repeat}-{number}"
            if encodings is None:
                return timed(lambda: model.generate(**batch, **options))
            with stopwatch() as clock:
                with Recorder(model, spill_dir=out, encodings=encodings or None) as rec:
                    model.generate(**batch, logits_processor=[rec], **options)
            generation = open_recording(out).generation()
            steps, rows = generation.num_steps, generation.num_rows
            on_disk = sum(p.stat().st_size for p in out.iterdir() if "sequences" not in p.name and p.suffix == ".safetensors")
            sizes[name] = {"steps": steps, "rows": rows, "bytes_per_row_step": on_disk / (steps * rows)}
            shutil.rmtree(out)
            return clock.seconds
        return run

    try:
        times = interleaved({name: case(number, name, encodings) for number, (name, encodings) in enumerate(CASES.items())},
                            args.repeats,
                            warmup=lambda: model.generate(**batch, max_new_tokens=2, pad_token_id=tokenizer.pad_token_id))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = summarize(times, "stock generate")
    medians = {name: entry["median_exact"] for name, entry in summary.items()}
    rows = [[name, *timing_columns(summary[name]),
             f"{sizes[name]['bytes_per_row_step']:,.0f}" if name in sizes else "-"] for name in CASES]
    print_table(["case", *TIMING_HEADERS, "bytes per row and step on disk"], rows)
    write_json(args.out / "scores_once.json", {"machine": machine(), "args": vars(args) | {"out": str(args.out)},
                                               "times": times, "medians": medians, "summary": summary, "sizes": sizes})


if __name__ == "__main__":
    main()
