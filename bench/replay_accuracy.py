"""How far `replay_logprobs` (float32, its sums over each token's kept ids) lies from the recorded processed
logprob (`log_softmax(out.scores[t])[y]`) and from the float64 value over the kept ids, at the vocabulary sizes
users run and with kept sets of every size.

    .venv/bin/python bench/replay_accuracy.py [--rows 4] [--new-tokens 48]

Cases: `smollm2`, SmolLM2-135M-Instruct (vocabulary 49,152); `wide`, a 2-layer Qwen2 with Qwen2's vocabulary of
152,064 made from a config (random weights: near-uniform logits, so top-p keeps thousands of ids). Each samples
from the first prompts of Python's help texts (48 tokens each) at temperature 0.7 with the whole vocabulary kept
(`top_k=0, top_p=1.0`), `top_k=50`, and `top_p=0.9`, recording `logits` and `scores`; `replay_logprobs` runs on
the recorded raw logits and `kept_sets` of the recording. Reports the largest and mean absolute difference from
the recorded processed logprob and from `x[y] / T - logsumexp(x[kept] / T)` in float64, and the mean kept-set
size. Writes `replay_accuracy.json`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, help_text_prompts, machine, print_table, smollm2_or_wide, write_json  # noqa: E402

SETTINGS = {"whole vocabulary": {"top_k": 0, "top_p": 1.0}, "top_k 50": {"top_k": 50}, "top_p 0.9": {"top_k": 0, "top_p": 0.9}}
TEMPERATURE = 0.7


def measure(case: str, rows: int, new_tokens: int) -> list[dict]:
    from transformers_offload import Recorder, kept_sets, replay_logprobs

    model, _ = smollm2_or_wide(case)
    vocab = model.get_output_embeddings().weight.shape[0]
    prompts = help_text_prompts(vocab, rows)
    found = []
    for name, settings in SETTINGS.items():
        with Recorder(model, streams=("logits", "scores")) as rec:
            torch.manual_seed(0)
            model.generate(prompts, attention_mask=torch.ones_like(prompts), logits_processor=[rec], do_sample=True,
                           temperature=TEMPERATURE, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           eos_token_id=None, pad_token_id=0, **settings)
        kept = kept_sets(rec)
        raw = torch.stack(rec.logits(), 1)
        processed = torch.stack([torch.log_softmax(s, -1).gather(-1, t[:, None])[:, 0]
                                 for s, t in zip(rec.scores(), rec.tokens())], 1)
        replayed = replay_logprobs(raw, kept)
        exact = torch.zeros_like(replayed, dtype=torch.float64)
        sizes = []
        for r in range(kept.rows):
            for t in range(kept.steps):
                if kept.valid[r, t]:
                    x = raw[r, t].double() / TEMPERATURE
                    ids = kept.ids_at(r, t)
                    ids = torch.arange(x.numel()) if ids is None else ids.long()  # None: the whole vocabulary kept
                    sizes.append(ids.numel())
                    exact[r, t] = x[int(kept.tokens[r, t])] - torch.logsumexp(x[ids], -1)
        valid = kept.valid
        to_processed = (replayed - processed).abs()[valid]
        to_exact = (replayed.double() - exact).abs()[valid]
        found.append({"case": case, "vocab": vocab, "setting": name, "tokens": int(valid.sum()),
                      "mean_kept": sum(sizes) / len(sizes),
                      "to_processed_max": float(to_processed.max()), "to_processed_mean": float(to_processed.mean()),
                      "to_float64_max": float(to_exact.max()), "to_float64_mean": float(to_exact.mean())})
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows = [row for case in ("smollm2", "wide") for row in measure(case, args.rows, args.new_tokens)]
    print_table(["case", "vocabulary", "kept", "mean kept ids", "to processed: max", "mean", "to float64: max", "mean"],
                [[r["case"], r["vocab"], r["setting"], f"{r['mean_kept']:.0f}", f"{r['to_processed_max']:.2e}",
                  f"{r['to_processed_mean']:.2e}", f"{r['to_float64_max']:.2e}", f"{r['to_float64_mean']:.2e}"] for r in rows])
    write_json(args.out / "replay_accuracy.json", {"machine": machine(), "rows": args.rows,
                                                   "new_tokens": args.new_tokens, "temperature": TEMPERATURE, "cases": rows})


if __name__ == "__main__":
    main()
