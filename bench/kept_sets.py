"""Kept-set bytes per token on SmolLM2: what shipping each token's kept set with a rollout batch costs.

    .venv/bin/python bench/kept_sets.py [--prompts 8] [--completions 4] [--new-tokens 64]

SmolLM2-135M-Instruct (CPU, float32), chat prompts, `--completions` samples each, `--new-tokens` tokens, at
temperature 1.0 with top_p 0.9, top_p 0.8 and top_k 20; `kept_sets(rec).bytes_per_token()` (every tensor
of the `KeptSets`, CSR offsets and int32 ids included, over the valid tokens), with the mean and largest
set. Writes `kept_sets.json`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS, machine, print_table, write_json  # noqa: E402

PROMPTS = ["Tell me a story about a lighthouse keeper.", "Explain how a steam engine works.",
           "Write a letter to a friend about the mountains.", "Describe the history of the printing press.",
           "What makes bread rise?", "Give three tips for learning to swim.", "Why is the sky blue?",
           "Summarise the rules of chess."]


# The two filters the replay benches sample with (transformers' default top-k of 50 off with top-p).
REPLAY_FILTERS = (("top_p 0.8", {"top_p": 0.8, "top_k": 0}), ("top_k 20", {"top_k": 20, "top_p": 1.0}))


def rollout_arguments(description: str) -> argparse.Namespace:
    """The replay benches' options: `--prompts`, `--completions`, `--new-tokens`, `--repeats`, `--out`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--completions", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args()


def chat_batch(tokenizer, count: int):
    """The first `count` of `PROMPTS` (repeated as needed), as chat prompts, tokenised and left-padded."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in (PROMPTS * 4)[:count]]
    return tokenizer(texts, return_tensors="pt", padding=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--completions", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    import torch

    from transformers_offload import Recorder, kept_sets
    from transformers_offload.demo_model import load

    model, tokenizer = load()
    batch = chat_batch(tokenizer, args.prompts)
    rows = []
    found = {}
    filters = (("top_p 0.9", {"top_p": 0.9, "top_k": 0}), ("top_p 0.8", {"top_p": 0.8, "top_k": 0}),
               ("top_k 20", {"top_k": 20, "top_p": 1.0}))  # top_k 0: transformers' default of 50 off
    for name, options in filters:
        torch.manual_seed(0)
        with Recorder(model, streams=("scores",)) as rec:
            model.generate(**batch, logits_processor=[rec], do_sample=True, temperature=1.0, max_new_tokens=args.new_tokens,
                           num_return_sequences=args.completions, pad_token_id=tokenizer.pad_token_id, **options)
        kept = kept_sets(rec)
        counts = (kept.offsets[1:] - kept.offsets[:-1]).view(kept.rows, kept.steps)[kept.valid & ~kept.full]
        found[name] = {"bytes_per_token": kept.bytes_per_token(), "tokens": int(kept.valid.sum()),
                       "mean_set": float(counts.float().mean()), "largest_set": int(counts.max()),
                       "full_steps": int((kept.full & kept.valid).sum())}
        rows.append([name, found[name]["tokens"], round(found[name]["mean_set"], 1), found[name]["largest_set"],
                     found[name]["full_steps"], round(found[name]["bytes_per_token"], 1)])
    print_table(["filter", "tokens", "mean kept set", "largest", "steps masking nothing", "bytes per token"], rows)
    write_json(args.out / "kept_sets.json", {"machine": machine(), "args": vars(args) | {"out": str(args.out)},
                                             "results": found})


if __name__ == "__main__":
    main()
