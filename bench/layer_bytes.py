"""Bytes per step of attentions and hidden states on the real model, for each selection.

    .venv/bin/python bench/layer_bytes.py [--steps 64] [--out bench/results]

SmolLM2-135M-Instruct (CPU, float32, eager attention: 30 layers, 9 heads, hidden size 576), one chat
prompt ("What is the capital of France?"), greedy, `--steps` new tokens, recorded to a spill
directory with each selection in turn. For each: the bytes of the prefill step (step 0), of the
first and last decode steps, and on disk (shards, from `describe()`), as recorded (not estimated).
A decode step t over a prompt of P tokens holds, per kept layer, rows x heads x (P + t) x 4 bytes of
attentions and rows x hidden_size x 4 bytes of hidden states; the prefill rows x heads x P x P x 4
and rows x P x hidden_size x 4 (x 1 instead of x P with `newest_position_only`).
Prints a table and writes `layer_bytes.json` under `--out`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from _common import RESULTS, machine, print_table, write_json  # noqa: E402

from transformers_offload import Recorder, open_recording  # noqa: E402
from transformers_offload.demo_model import load  # noqa: E402

SELECTIONS = {
    "attentions, all 30 layers": dict(streams=("attentions",)),
    "attentions, last layer": dict(streams=("attentions",), layers=[-1]),
    "attentions, last layer, newest position": dict(streams=("attentions",), layers=[-1], newest_position_only=True),
    "attentions, last layer, 1 head": dict(streams=("attentions",), layers=[-1], heads=[0]),
    "hidden states, all 31 entries": dict(streams=("hidden_states",)),
    "hidden states, last entry": dict(streams=("hidden_states",), layers=[-1]),
    "hidden states, last entry, newest position": dict(streams=("hidden_states",), layers=[-1], newest_position_only=True),
    "both, all layers": dict(streams=("attentions", "hidden_states")),
}


def step_bytes(generation, step: int) -> int:
    kinds = generation.layer_indices
    total = 0
    for kind in kinds:
        for tensor in getattr(generation, kind)(steps=range(step, step + 1))[0]:
            total += tensor.numel() * tensor.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    model, tokenizer = load(attn_implementation="eager")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    batch = tokenizer([text], return_tensors="pt")
    prompt = int(batch["input_ids"].shape[1])
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for index, (label, options) in enumerate(SELECTIONS.items()):
            root = Path(scratch) / str(index)
            with Recorder(model, spill_dir=root, **options) as rec:
                model.generate(**batch, logits_processor=[rec], max_new_tokens=args.steps,
                               min_new_tokens=args.steps, pad_token_id=tokenizer.pad_token_id)
            run = open_recording(root)
            generation = run.generation()
            described = run.describe()["generations"][0]
            recorded = sum(s["bytes"] for name, s in described["streams"].items() if "." in name)
            rows.append({
                "selection": label,
                "prefill_bytes": step_bytes(generation, 0),
                "step_1_bytes": step_bytes(generation, 1),
                f"step_{args.steps - 1}_bytes": step_bytes(generation, args.steps - 1),
                "recorded_bytes": recorded,
                "file_bytes": described["file_bytes"],
            })
    headers = ["selection", "prefill (step 0)", "step 1", f"step {args.steps - 1}", f"all {args.steps} steps", "on disk"]
    table = print_table(headers, [[r["selection"], *(v for k, v in r.items() if k != "selection")] for r in rows])
    print(f"\nprompt: {prompt} tokens, batch 1, float32; bytes per step as recorded")
    write_json(args.out / "layer_bytes.json", {
        "machine": machine(), "prompt_tokens": prompt, "steps": args.steps, "rows": 1, "results": rows,
        "table": table,
    })


if __name__ == "__main__":
    main()
