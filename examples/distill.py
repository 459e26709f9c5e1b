"""Distil SmolLM2-135M-Instruct's recorded targets into a tiny student, on CPU.

Run it with the package and its `demo` and `table` extras installed (and `datasets`):
`python examples/distill.py` (about two minutes on two CPU cores), or a short run:
`python examples/distill.py --prompts 4 --new-tokens 16 --steps 30`.

1. Record the teacher: chat prompts, sampled (temperature 0.7), through a Recorder that keeps the raw
   logits as top-K (`encodings={"logits": "topk:K"}`) and the prompt's own top-K logprobs
   (`prompt_logprobs=K`), spilled to a recording directory.
2. Export the distillation table twice, as `python -m transformers_offload export REC kd.parquet --kd`
   (and `--kd --prompt`) does: the teacher's targets on its own completions, and on the prompts' text.
3. Load both with `datasets.Dataset.from_parquet`, join each sequence's rows (`group_sequences`) and
   train a 2-layer Llama with the teacher's vocabulary on `kd_loss` (forward KL over the kept ids and the
   tail bucket) with `KDCollator` batches; print the loss as it falls, and the mean loss before and after
   training over the training sequences and over the sequences held out (`--held-out`, default 2).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from datasets import Dataset, concatenate_datasets  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from transformers_offload import (  # noqa: E402
    KDCollator,
    Recorder,
    group_sequences,
    kd_loss,
    open_recording,
    write_kd_parquet,
)
from transformers_offload.demo_model import load  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about the sea.",
    "Explain what a prime number is.",
    "How do plants make their food?",
    "Name three animals that live in the desert.",
    "What is the boiling point of water?",
    "Describe a rainy day in two sentences.",
    "Why is the sky blue?",
    "Suggest a name for a small coffee shop.",
    "What does a computer's memory do?",
    "Tell me a fun fact about octopuses.",
    "How many days are in a leap year?",
    "Write one sentence about friendship.",
    "What is the largest planet in the solar system?",
    "Give me a simple recipe for pancakes.",
]


def record_teacher(model, tokenizer, directory: Path, *, prompts: int, new_tokens: int, top: int, seed: int) -> Path:
    """Record the teacher on chat prompts: top-K raw logits of every step and top-K prompt logprobs."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in (PROMPTS * (prompts // len(PROMPTS) + 1))[:prompts]]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    recording = directory / "recording"
    with Recorder(model, spill_dir=recording, streams=("logits",), encodings={"logits": f"topk:{top}"},
                  prompt_logprobs=top) as rec:
        torch.manual_seed(seed)
        model.generate(**batch, logits_processor=[rec], do_sample=True, temperature=0.7, max_new_tokens=new_tokens,
                       pad_token_id=tokenizer.pad_token_id)
    return recording


def tiny_student(vocab_size: int, pad_token_id: int, seed: int) -> LlamaForCausalLM:
    """A 2-layer Llama with the teacher's vocabulary (3.2M parameters, most of them the tied embeddings)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, pad_token_id=pad_token_id)
    return LlamaForCausalLM(config)


def mean_loss(student, examples, collate, batch_size: int) -> float:
    """The loss over every example (each target position weighs the same)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            batch = collate(examples[start:start + batch_size])
            logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            total += float(kd_loss(logits, batch, reduction="sum"))
            count += int(batch["target_mask"].sum())
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16, help="chat prompts the teacher answers (16)")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens the teacher generates per prompt (48)")
    parser.add_argument("--top", type=int, default=20, help="K, the teacher's ids kept per token (20)")
    parser.add_argument("--steps", type=int, default=150, help="training steps (150)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--kind", choices=("forward", "reverse", "jsd"), default="forward")
    parser.add_argument("--held-out", type=int, default=2, help="sequences kept out of training (2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="a directory for the recording and the tables (default: temporary)")
    parser.add_argument("--json", type=Path, help="also write the loss curve here as JSON")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    directory = args.out or Path(tempfile.mkdtemp(prefix="distill-"))
    try:
        teacher, tokenizer = load()
        started = time.perf_counter()
        recording = record_teacher(teacher, tokenizer, directory, prompts=args.prompts, new_tokens=args.new_tokens,
                                   top=args.top, seed=args.seed)
        run = open_recording(recording)
        completions = write_kd_parquet(run, directory / "kd.parquet")
        prompt_rows = write_kd_parquet(run, directory / "kd_prompt.parquet", prompt=True)
        run.close()
        print(f"teacher recorded and exported in {time.perf_counter() - started:.1f} s: {completions['rows']} completion "
              f"rows ({completions['bytes']} B), {prompt_rows['rows']} prompt rows ({prompt_rows['bytes']} B), K = {args.top}")
        rows = concatenate_datasets([Dataset.from_parquet(str(directory / "kd.parquet")),
                                     Dataset.from_parquet(str(directory / "kd_prompt.parquet"))])
        examples = group_sequences(rows)
        # The last sequences are held out (not trained on): their loss shows what carries over.
        held_out = examples[-args.held_out:] if 0 < args.held_out < len(examples) else []
        examples = examples[:len(examples) - len(held_out)]
        print(f"{len(rows)} rows -> {len(examples)} training sequences ({sum(len(e['position']) for e in examples)} "
              f"target positions), {len(held_out)} held out")

        student = tiny_student(teacher.config.vocab_size, tokenizer.pad_token_id, args.seed)
        collate = KDCollator(pad_token_id=tokenizer.pad_token_id)
        optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr)
        before = mean_loss(student, examples, collate, args.batch_size)
        held_before = mean_loss(student, held_out, collate, args.batch_size) if held_out else None
        print(f"mean {args.kind} loss over the training sequences before training: {before:.4f} nats")
        order = random.Random(args.seed)
        curve = []
        started = time.perf_counter()
        queue: list[dict] = []
        for step in range(1, args.steps + 1):
            if len(queue) < args.batch_size:
                queue += order.sample(examples, len(examples))
            batch = collate(queue[:args.batch_size])
            del queue[:args.batch_size]
            logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss = kd_loss(logits, batch, kind=args.kind)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            curve.append(loss.item())
            if step % 10 == 0 or step == 1:
                recent = curve[-10:]
                print(f"step {step:4d}  loss {curve[-1]:.4f}  (mean of the last {len(recent)}: {sum(recent) / len(recent):.4f})",
                      flush=True)
        after = mean_loss(student, examples, collate, args.batch_size)
        print(f"trained {args.steps} steps in {time.perf_counter() - started:.1f} s")
        print(f"mean {args.kind} loss over the training sequences: before {before:.4f}, after {after:.4f} nats")
        held_after = mean_loss(student, held_out, collate, args.batch_size) if held_out else None
        if held_out:
            print(f"mean {args.kind} loss over the held-out sequences: before {held_before:.4f}, after {held_after:.4f} nats")
        if args.json:
            args.json.write_text(json.dumps({"before": before, "after": after, "held_out_before": held_before,
                                             "held_out_after": held_after, "curve": curve}))
    finally:
        if args.out is None:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
