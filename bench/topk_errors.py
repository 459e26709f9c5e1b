"""Bytes per row and step and log-probability errors of each top-k variant (docs/recording.md's table).

    .venv/bin/python bench/topk_errors.py [--out bench/results]

Two sets of logits: SmolLM2-135M-Instruct's raw logits (`transformers_offload.demo_model`, CPU, float32;
4 prompts x 16 greedy steps, `output_logits`) and a made-up 152,064-token tensor (64 rows of
`2.5 x randn` with 50 tokens raised by 6: a peaked head, like an LM's). For each, `topk:K` (K = 20, 128;
its values as a bfloat16 model stores them) and `topk:K:qB` (B = 8, 6, 5, 4) are encoded as the recorder
encodes them (`on_cpu`) and read back (`PackedRecord.columns`): the bytes per row and step (without the
20-byte header of a step) and the errors of the K log-probabilities in nats against `log_softmax` of the
same tensor: the largest, the mean, and the mean weighted by the token's probability. No timing. Prints
the table and writes `topk_errors.json` under `--out`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402
from _common import RESULTS, machine, print_table, write_json  # noqa: E402

from transformers_offload import demo_model  # noqa: E402
from transformers_offload.codecs.packed import PackedRecord, QuantisedTopK, TopK  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Explain quantum computing simply:"]
VOCABULARIES = ("SmolLM2 (49,152)", "made-up 152k")


def smollm2_logits() -> torch.Tensor:
    """SmolLM2's raw logits, float32, one row per greedy step of each prompt."""
    model, tokenizer = demo_model.load()
    steps = []
    for prompt in PROMPTS:
        enc = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True)
        steps += [logits.float() for logits in out.logits]
    return torch.cat(steps)


def made_up_logits() -> torch.Tensor:
    made_up = torch.randn(64, 152_064, generator=torch.Generator().manual_seed(0)) * 2.5
    made_up[:, :50] += 6  # a peaked head, like an LM's
    return made_up


def errors(x: torch.Tensor, k: int, enc: str) -> dict[str, float]:
    """Bytes per row and the log-probability errors of encoding `x` with `enc` (top `k`)."""
    coder = TopK(enc, torch.bfloat16) if ":q" not in enc else QuantisedTopK(enc)
    xs = x.bfloat16().float() if ":q" not in enc else x
    record = coder.on_cpu(xs)
    cols = PackedRecord(record, enc).columns()
    values, ids = torch.topk(xs, k)
    exact = values - torch.logsumexp(xs, -1, keepdim=True)
    got = torch.full_like(xs, float("nan")).scatter(-1, cols["indices"], cols["logprobs"]).gather(-1, ids)
    err = (got - exact).abs()
    p = exact.exp()
    return {"bytes_per_row": (record.numel() * 4 - 20) / x.shape[0],
            "max_err": float(err.max()), "mean_err": float(err.mean()),
            "prob_weighted_err": float((p * err).sum(-1).mean() / p.sum(-1).mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.manual_seed(0)
    logits = dict(zip(VOCABULARIES, (smollm2_logits(), made_up_logits())))
    results: dict[str, dict[str, float]] = {}
    rows = []
    for name, x in logits.items():
        for k in (20, 128):
            for enc in (f"topk:{k}", f"topk:{k}:q8", f"topk:{k}:q6", f"topk:{k}:q5", f"topk:{k}:q4"):
                found = results[f"{name} {enc}"] = errors(x, k, enc)
                print(f"{name:18s} {enc:13s} {found}", flush=True)
                rows.append([name, enc, f"{found['bytes_per_row']:g}",  # as docs/recording.md gives them
                             *(f"{found[key]:.2g}" for key in ("max_err", "mean_err", "prob_weighted_err"))])
    print()
    print_table(["vocabulary", "encoding", "bytes", "max error", "mean error", "weighted"], rows)
    write_json(args.out / "topk_errors.json", {"machine": machine(), "results": results})


if __name__ == "__main__":
    main()
