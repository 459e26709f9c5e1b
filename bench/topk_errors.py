"""Bytes per row and step and log-probability errors of each top-k variant (docs/recording.md's table):
SmolLM2 (transformers_offload.demo_model) and a made-up 152k vocabulary. Usage: python scripts/topk_errors.py"""
import torch
from transformers_offload import demo_model
from transformers_offload.capture.packed_encodings import QuantisedTopK, TopK
from transformers_offload.store.packed import PackedRecord

torch.manual_seed(0)
model, tok = demo_model.load()
prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Explain quantum computing simply:"]
steps = []
for p in prompts:
    enc = tok(p, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True)
    steps += [l.float() for l in out.logits]
smol = torch.cat(steps)
made_up = torch.randn(64, 152_064, generator=torch.Generator().manual_seed(0)) * 2.5
made_up[:, :50] += 6  # a peaked head, like an LM's
results: dict = {}
for name, x in (("SmolLM2 (49,152)", smol), ("made-up 152k", made_up)):
    lse = torch.logsumexp(x, -1, keepdim=True)
    for k in (20, 128):
        for enc in (f"topk:{k}", f"topk:{k}:q8", f"topk:{k}:q6", f"topk:{k}:q5", f"topk:{k}:q4"):
            coder = TopK(enc, torch.bfloat16) if ":q" not in enc else QuantisedTopK(enc)
            xs = x.bfloat16().float() if ":q" not in enc else x
            record = coder.on_cpu(xs)
            cols = PackedRecord(record, enc).columns()
            values, ids = torch.topk(xs, k)
            exact = values - torch.logsumexp(xs, -1, keepdim=True)
            got = torch.full_like(xs, float("nan")).scatter(-1, cols["indices"], cols["logprobs"]).gather(-1, ids)
            err = (got - exact).abs()
            p = exact.exp()
            results[f"{name} {enc}"] = {"bytes_per_row": (record.numel() * 4 - 20) / x.shape[0],
                                        "max_err": float(err.max()), "mean_err": float(err.mean()),
                                        "prob_weighted_err": float((p * err).sum(-1).mean() / p.sum(-1).mean())}
            print(f"{name:18s} {enc:13s} {results[f'{name} {enc}']}", flush=True)
