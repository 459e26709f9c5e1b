"""How far the per-token statistics' `logprob_raw` (float32 `log_softmax(x)[y]`, computed in the step: the
`stats` stream) lies from the float64 value of the same raw logits, at the vocabulary sizes users run.

    .venv/bin/python bench/stats_accuracy.py [--rows 4] [--new-tokens 64]

Cases: `smollm2`, SmolLM2-135M-Instruct (vocabulary 49,152); `wide`, a 2-layer Qwen2 with Qwen2's vocabulary of
152,064 made from a config (random weights, as bench/score_memory.py's). Each generates greedily from the first
prompts of Python's help texts (`pydoc_data.topics`, 48 tokens each) with a Recorder recording `logits` and
`stats`; per token, the difference is `logprob_raw - log_softmax(x.double())[y]`, `x` the recorded raw logits
(`out.logits[t]`, bit-equal to generate's). Reports the largest and mean absolute difference, the mean signed
one, the share of tokens off by more than 1e-6 nats, and the perplexity's relative difference (`exp` of the mean
negative logprob, float32 stats against float64). Writes `stats_accuracy.json`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, help_text_prompts, machine, print_table, smollm2_or_wide, write_json  # noqa: E402


def measure(case: str, rows: int, new_tokens: int) -> dict:
    from transformers_offload import Recorder

    model, _ = smollm2_or_wide(case)
    vocab = model.get_output_embeddings().weight.shape[0]
    prompts = help_text_prompts(vocab, rows)
    with Recorder(model, streams=("logits", "stats")) as rec:
        model.generate(prompts, attention_mask=torch.ones_like(prompts), logits_processor=[rec], do_sample=False,
                       max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    generation = rec.generation()
    stats = generation.stats()  # one dict of (rows,) tensors per step
    recorded = torch.stack([step["logprob_raw"] for step in stats]).double()
    exact = torch.stack([torch.log_softmax(x.double(), -1).gather(-1, step["token"][:, None])[:, 0]
                         for x, step in zip(generation.logits(), stats)])
    difference = recorded - exact
    return {"case": case, "vocab": vocab, "tokens": int(difference.numel()),
            "max_abs": float(difference.abs().max()), "mean_abs": float(difference.abs().mean()),
            "mean_signed": float(difference.mean()), "over_1e-6": float((difference.abs() > 1e-6).double().mean()),
            "ppl_relative": float(torch.exp(-recorded.mean()) / torch.exp(-exact.mean()) - 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    found = [measure(case, args.rows, args.new_tokens) for case in ("smollm2", "wide")]
    print_table(["case", "vocabulary", "tokens", "max |diff| (nats)", "mean |diff|", "mean signed", "> 1e-6",
                 "PPL relative"],
                [[r["case"], r["vocab"], r["tokens"], f"{r['max_abs']:.2e}", f"{r['mean_abs']:.2e}",
                  f"{r['mean_signed']:+.2e}", f"{100 * r['over_1e-6']:.0f}%", f"{r['ppl_relative']:+.2e}"]
                 for r in found])
    write_json(args.out / "stats_accuracy.json", {"machine": machine(), "rows": args.rows,
                                                  "new_tokens": args.new_tokens, "cases": found})


if __name__ == "__main__":
    main()
