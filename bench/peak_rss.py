"""Peak resident memory of one generate() call, at a checkpoint step and at the end, in a fresh process.

    .venv/bin/python bench/peak_rss.py --store {none,memory,spill} [--steps 512] [--checkpoint 128]
                                       [--batch 4] [--shard-mib 16] [--spill-dir DIR]
                                       [--streams logits,scores]

Greedy decoding on SmolLM2-135M-Instruct (CPU, float32), forced to `--steps` new tokens. `none` is
stock generate() without outputs (the baseline: its own growth is the KV cache), `memory` the
in-memory Recorder, `spill` the Recorder writing shards. Peak RSS is the kernel's high-water mark
(Linux `VmHWM`, started over once the model is loaded, whose own transient peak depends on timing;
`getrusage` elsewhere: `_common.reset_high_water`, `high_water_mib`), read when the decoding loop
reaches `--checkpoint` and after generate() returns, so "growth" is how much the peak rose over the
last `steps - checkpoint` steps. `--streams` is the Recorder's `streams` (with `attentions`, the
model loads with eager attention, for every store). Prints one JSON object.
Run each store in its own process: a peak never goes down.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _common import high_water_mib, reset_high_water, stopwatch  # noqa: E402
from transformers import LogitsProcessor  # noqa: E402

from transformers_offload import Recorder  # noqa: E402
from transformers_offload.demo_model import load  # noqa: E402

PROMPTS = [
    "Tell me a long story about a lighthouse keeper.",
    "Explain how a steam engine works, step by step.",
    "Write a letter to a friend about a trip to the mountains.",
    "Describe the history of the printing press.",
]


class PeakAt(LogitsProcessor):
    """A pass-through processor that notes the peak RSS when the loop reaches `step`."""

    def __init__(self, step: int) -> None:
        self.step, self.calls, self.peak_mib = step, 0, None

    def __call__(self, input_ids, scores):
        if self.calls == self.step:
            self.peak_mib = high_water_mib()
        self.calls += 1
        return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", choices=("none", "memory", "spill"), required=True)
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--checkpoint", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--shard-mib", type=float, default=16.0, help="shard size for --store spill, MiB")
    parser.add_argument("--spill-dir", help="where --store spill writes (default: a temporary directory)")
    parser.add_argument("--streams", default="logits,scores", help="the Recorder's streams, comma-separated")
    args = parser.parse_args()
    streams = tuple(args.streams.split(","))

    model, tokenizer = load(attn_implementation="eager" if "attentions" in streams else None)
    prompts = (PROMPTS * (args.batch // len(PROMPTS) + 1))[: args.batch]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    common = dict(max_new_tokens=args.steps, min_new_tokens=args.steps, pad_token_id=tokenizer.pad_token_id)
    model.generate(**batch, max_new_tokens=2, pad_token_id=tokenizer.pad_token_id)  # warm-up
    reset_high_water()
    loaded = high_water_mib()

    checkpoint = PeakAt(args.checkpoint)
    processors = [checkpoint]
    recorder = None
    with tempfile.TemporaryDirectory() as scratch:
        if args.store == "memory":
            recorder = Recorder(model, streams=streams)
        elif args.store == "spill":
            spill_dir = Path(args.spill_dir) if args.spill_dir else Path(scratch) / "run"
            recorder = Recorder(model, streams=streams, spill_dir=spill_dir, shard_bytes=int(args.shard_mib * 2**20))
        if recorder is not None:
            processors.append(recorder)
        with stopwatch() as clock:
            model.generate(**batch, logits_processor=processors, **common)
        end = high_water_mib()
        result = {
            "store": args.store,
            "batch": args.batch,
            "steps": args.steps,
            "prompt_length": int(batch["input_ids"].shape[1]),
            "streams": list(streams),
            "checkpoint": args.checkpoint,
            "loaded_mib": round(loaded, 1),
            "peak_at_checkpoint_mib": round(checkpoint.peak_mib, 1),
            "peak_at_end_mib": round(end, 1),
            "growth_mib": round(end - checkpoint.peak_mib, 1),
            "wall_s": round(clock.seconds, 2),
        }
        if recorder is not None:
            stats = recorder.generation().transfer
            result["waits"] = stats.waits
            if args.store == "spill":
                result["shard_mib"] = args.shard_mib
                result["bytes_written"] = stats.bytes_written
                result["write_s"] = round(stats.write_seconds, 3)
                result["write_mb_per_s"] = round(stats.bytes_written / 1e6 / max(stats.write_seconds, 1e-9), 1)
            recorder.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
