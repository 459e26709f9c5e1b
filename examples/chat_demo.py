"""Record a real chat generation with SmolLM2-135M-Instruct and check it against Hugging Face's own outputs.

Run it with `bash scripts/demo.sh` (sets everything up), or, with the package and its `demo` extra
installed, `python examples/chat_demo.py`.

Three chat prompts run as one left-padded batch with sampling (temperature 0.7, top_p 0.9, 64 new
tokens) through a Recorder, with `output_scores`/`output_logits` off. The script prints each answer,
a per-token table for the first one, then re-runs the same seed with `output_logits=True,
output_scores=True` and reports whether the recording is bit-identical.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from transformers_offload import Recorder  # noqa: E402
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
    args = parser.parse_args()

    model, tokenizer = load()
    chats = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
    texts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in chats]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    prompt_length = batch["input_ids"].shape[1]

    with Recorder(model) as rec:
        torch.manual_seed(args.seed)
        sequences = model.generate(**batch, logits_processor=[rec], pad_token_id=tokenizer.pad_token_id, **SAMPLING)

    for prompt, row in zip(PROMPTS, sequences):
        answer = tokenizer.decode(row[prompt_length:], skip_special_tokens=True).strip()
        print(f"\n>>> {prompt}\n{answer}")

    print_token_table(rec, tokenizer, row=0)

    torch.manual_seed(args.seed)
    reference = model.generate(
        **batch, pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True,
        output_logits=True, output_scores=True, **SAMPLING,
    )
    same_tokens = torch.equal(sequences, reference.sequences)
    same_logits = len(rec.logits()) == len(reference.logits) and all(
        torch.equal(mine, theirs) for mine, theirs in zip(rec.logits(), reference.logits)
    )
    same_scores = len(rec.scores()) == len(reference.scores) and all(
        torch.equal(mine, theirs) for mine, theirs in zip(rec.scores(), reference.scores)
    )
    steps, rows, vocab = len(rec.logits()), *rec.logits()[0].shape
    print(f"\nrecorded {steps} steps x {rows} rows x {vocab} vocabulary, 2 streams")
    print(f"same tokens as stock generate():              {same_tokens}")
    print(f"raw logits bit-identical to out.logits:       {same_logits}")
    print(f"processed scores bit-identical to out.scores: {same_scores}")
    if not (same_tokens and same_logits and same_scores):
        raise SystemExit("MISMATCH: the recording differs from Hugging Face's outputs")


def print_token_table(rec: Recorder, tokenizer, row: int) -> None:
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
