"""Measure what keeping only the teacher's top-K (and the tail's mass) costs `kd_loss`, on SmolLM2's logits.

Run: `python examples/kd_gap.py` (about a minute on two CPU cores). The teacher, SmolLM2-135M-Instruct in
float32, answers chat prompts (greedy, dense logits recorded); the distillation table is exported at each
K; each student's logits on the same tokens are compared with `kd_loss` (forward, reverse, JSD) and with
the same divergence over the whole vocabulary from the recorded logits. Students: the teacher itself in
bfloat16 (a close student) and an untrained 2-layer Llama (a far one). Also printed: the forward KL over
the top-K renormalised on both sides, without the tail bucket, as pipelines that drop the tail compute it.
docs/distill.md quotes the output.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distill import PROMPTS, tiny_student  # noqa: E402

from transformers_offload import KDCollator, Recorder, group_sequences, kd_loss  # noqa: E402
from transformers_offload.answers.kd_table import kd_arrow  # noqa: E402
from transformers_offload.demo_model import load  # noqa: E402


def dense(log_p: torch.Tensor, log_q: torch.Tensor, kind: str) -> torch.Tensor:
    p, q = log_p.exp(), log_q.exp()
    if kind == "forward":
        return (p * (log_p - log_q)).sum(-1)
    if kind == "reverse":
        return (q * (log_q - log_p)).sum(-1)
    log_m = torch.logaddexp(log_p, log_q) - math.log(2.0)
    return 0.5 * ((p * (log_p - log_m)).sum(-1) + (q * (log_q - log_m)).sum(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    teacher, tokenizer = load()
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in PROMPTS[:args.prompts]]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with Recorder(teacher, streams=("logits",)) as rec:
        teacher.generate(**batch, logits_processor=[rec], do_sample=False, max_new_tokens=args.new_tokens,
                         pad_token_id=tokenizer.pad_token_id)
    vocab = teacher.config.vocab_size
    rows = kd_arrow(rec, top=1).to_pylist()
    full = KDCollator(pad_token_id=tokenizer.pad_token_id)(group_sequences(rows))
    mask = full["target_mask"]
    # The teacher's whole distribution at each target (batch order, as `mask` picks them), from its recorded
    # logits, as the table computes it (float32 log-softmax); the targets at each K are its top-K and tail.
    logits, generation = rec.logits(), rec.generation()
    at = {(row["sequence"], row["position"]): row for row in rows}
    sequences = [example["sequence"] for example in group_sequences(rows)]
    log_p = []
    for b, position in mask.nonzero().tolist():
        j = sequences[b]
        step = position + 1 - generation.prompt_lengths[j]
        assert (j, position + 1) in at
        log_p.append(torch.log_softmax(logits[step][j].float(), -1))
    log_p = torch.stack(log_p).double()
    print(f"{int(mask.sum())} target positions, vocabulary {vocab}")
    bf16 = copy.deepcopy(teacher).to(torch.bfloat16)
    students = {"teacher in bfloat16": bf16, "untrained 2-layer Llama": tiny_student(vocab, tokenizer.pad_token_id, 0)}
    results = []
    for name, student in students.items():
        with torch.no_grad():
            z = student(input_ids=full["input_ids"], attention_mask=full["attention_mask"]).logits.double()[mask]
        log_q = torch.log_softmax(z, -1)
        reference = {kind: float(dense(log_p, log_q, kind).mean()) for kind in ("forward", "reverse", "jsd")}
        print(f"\n{name}: dense loss (whole vocabulary) forward {reference['forward']:.6g}, reverse "
              f"{reference['reverse']:.6g}, jsd {reference['jsd']:.6g} nats")
        print(f"  {'K':>6} {'tail mass':>10} {'forward':>10} {'gap':>9} {'reverse':>10} {'gap':>9} {'jsd':>10} {'gap':>9}"
              f" {'top-K no tail':>14}")
        for k in (1, 8, 20, 128, 1024, vocab):
            best = torch.topk(log_p.float(), k, -1)
            rest = log_p.float().scatter(-1, best.indices, float("-inf"))
            t = {"top_ids": best.indices, "top_logprobs": best.values, "tail_logmass": torch.logsumexp(rest, -1)}
            row = {"student": name, "K": k, "tail_mass": float(t["tail_logmass"].double().exp().mean())}
            for kind in ("forward", "reverse", "jsd"):
                row[kind] = float(kd_loss(z, t, kind=kind))
                row[f"{kind}_gap"] = reference[kind] - row[kind]
            # The forward KL over the top-K, each side renormalised over them (no tail bucket).
            kept_p = torch.log_softmax(t["top_logprobs"].double(), -1)
            kept_q = torch.log_softmax(log_q.gather(-1, t["top_ids"]), -1)
            row["topk_no_tail"] = float((kept_p.exp() * (kept_p - kept_q)).sum(-1).mean())
            results.append(row)
            print(f"  {k:>6} {row['tail_mass']:>10.3g} {row['forward']:>10.6g} {row['forward_gap']:>9.2g} "
                  f"{row['reverse']:>10.6g} {row['reverse_gap']:>9.2g} {row['jsd']:>10.6g} {row['jsd_gap']:>9.2g} "
                  f"{row['topk_no_tail']:>14.6g}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
