"""The native encoding (a bf16 model's float32 logits stored in bf16) against dense, CPU.

    .venv/bin/python bench/native_cost.py [--batch 4] [--new-tokens 32] [--repeats 3] [--out bench/results]

SmolLM2-135M-Instruct cast to bfloat16, `--batch` chat prompts, sampling with top_k 50 (a processor
that only masks) and `--new-tokens` steps (`min_new_tokens` too), each recorder spilling to a fresh
directory. Cases, interleaved, `--repeats` times (median wall time of one generate() call): stock
generate(); the Recorder with the dense logits and scores (float32 from 4.45); the Recorder with
`encodings={"logits": "native", "scores": "native"}`. Reports the time over stock and the bytes on
disk per row and step; writes `native_cost.json` under `--out`.
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

CASES = {"stock generate": None, "Recorder, dense": {}, "Recorder, native": {"logits": "native", "scores": "native"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    model, tokenizer = load()
    model = model.to(torch.bfloat16)
    chats = [[{"role": "user", "content": p}] for p in (PROMPTS * args.batch)[: args.batch]]
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    options = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=True, top_k=50,
                   pad_token_id=tokenizer.pad_token_id)
    work = Path(tempfile.mkdtemp(prefix="bench-native-"))
    sizes: dict[str, dict] = {}

    def case(number: int, name: str, encodings: dict | None):
        def run(repeat: int) -> float:
            out = work / f"{repeat}-{number}"
            torch.manual_seed(repeat)
            if encodings is None:
                return timed(lambda: model.generate(**batch, **options))
            with stopwatch() as clock:
                with Recorder(model, spill_dir=out, encodings=encodings or None) as rec:
                    model.generate(**batch, logits_processor=[rec], **options)
            generation = open_recording(out).generation()
            on_disk = sum(p.stat().st_size for p in out.glob("*-s*.safetensors"))
            sizes[name] = {"bytes_per_row_step": on_disk / (generation.num_steps * generation.num_rows),
                           "logits_dtype": str(generation.logits(steps=0)[0].dtype)}
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
    write_json(args.out / "native_cost.json", {"machine": machine(), "args": vars(args) | {"out": str(args.out)},
                                               "times": times, "medians": medians, "summary": summary, "sizes": sizes})


if __name__ == "__main__":
    main()
