"""Record a real chat generation with SmolLM2-135M-Instruct and check it against Hugging Face's own outputs.

Run it with `bash scripts/demo.sh` (sets everything up), or, with the package and its `demo` extra
installed, `python examples/chat_demo.py`.

Three chat prompts run as one left-padded batch with sampling (temperature 0.7, top_p 0.9, 64 new
tokens) through a Recorder that spills to a recording directory (`--out`, default a new temporary
one), with `output_scores`/`output_logits` off. The script reads the directory back with
`open_recording`, prints its summary (as `python -m transformers_offload inspect` does), each answer
and a per-token table for the first one, then re-runs the same seed with `output_logits=True,
output_scores=True` and reports whether what it read back is bit-identical.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from transformers_offload import Recording, Recorder, open_recording  # noqa: E402
from transformers_offload.cli import format_summary  # noqa: E402
from transformers_offload.demo_model import load  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about the sea.",
]
SAMPLING = dict(do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="a new or empty directory for the recording (default: a temporary one)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="chat-demo-")) / "recording"

    model, tokenizer = load()
    chats = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
    texts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in chats]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    prompt_length = batch["input_ids"].shape[1]

    with Recorder(model, spill_dir=out) as rec:
        torch.manual_seed(args.seed)
        sequences = model.generate(**batch, logits_processor=[rec], pad_token_id=tokenizer.pad_token_id, **SAMPLING)

    run = open_recording(out)
    print(format_summary(run.describe()))
    for prompt, row in zip(PROMPTS, sequences):
        answer = tokenizer.decode(row[prompt_length:], skip_special_tokens=True).strip()
        print(f"\n>>> {prompt}\n{answer}")

    print_token_table(run, tokenizer, row=0)

    torch.manual_seed(args.seed)
    reference = model.generate(
        **batch, pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True,
        output_logits=True, output_scores=True, **SAMPLING,
    )
    same_tokens = torch.equal(sequences, reference.sequences)
    same_logits = len(run.logits()) == len(reference.logits) and all(
        torch.equal(mine, theirs) for mine, theirs in zip(run.logits(), reference.logits)
    )
    same_scores = len(run.scores()) == len(reference.scores) and all(
        torch.equal(mine, theirs) for mine, theirs in zip(run.scores(), reference.scores)
    )
    steps, rows, vocab = len(run.logits()), *run.logits()[0].shape
    print(f"\nrecorded {steps} steps x {rows} rows x {vocab} vocabulary, 2 streams, in {out}")
    print("read back with open_recording; compared with a stock generate() of the same seed:")
    print(f"same tokens as stock generate():              {same_tokens}")
    print(f"raw logits bit-identical to out.logits:       {same_logits}")
    print(f"processed scores bit-identical to out.scores: {same_scores}")
    if not (same_tokens and same_logits and same_scores):
        raise SystemExit("MISMATCH: the recording differs from Hugging Face's outputs")


def print_token_table(rec: Recording, tokenizer, row: int) -> None:
    """Per generated token of one row: logprob under the raw logits and the processed scores, entropy."""
    print(f"\nfirst answer, token by token (nats)\n{'step':>4}  {'token':<18}{'logprob raw':>12}{'logprob processed':>19}{'entropy raw':>13}")
    for step, (logits, scores, tokens, finished) in enumerate(
        zip(rec.logits(), rec.scores(), rec.tokens(), rec.finished())
    ):
        if finished[row]:
            break
        token = int(tokens[row])
        raw = torch.log_softmax(logits[row].double(), dim=-1)
        processed = torch.log_softmax(scores[row].double(), dim=-1)
        entropy = -(raw.exp() * raw).sum()
        text = repr(tokenizer.decode([token]))[:17]
        print(f"{step:>4}  {text:<18}{raw[token].item():>12.4f}{processed[token].item():>19.4f}{entropy.item():>13.4f}")


if __name__ == "__main__":
    main()
