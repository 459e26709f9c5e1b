"""Peak resident memory of `score`, against the model's own size and one chunk's scored logits.

    .venv/bin/python bench/score_memory.py [--runs 1]                       # every case, fresh processes
    .venv/bin/python bench/score_memory.py --case smollm2 --mode on         # one case (what the driver runs)

Cases: `smollm2`, SmolLM2-135M-Instruct (float32, vocabulary 49,152) at context 512, 4 windows of
Python's help texts (`pydoc_data.topics`) in one batch; `wide`, a 2-layer Qwen2 made from a config with
Qwen2's vocabulary of 152,064 (hidden size 256, random weights, float32) at context 2,048, 2 windows in
one batch, the text's ids folded into the vocabulary. `--mode on` is `score` as it is (each forward
computes its scored positions' logits only, `logits_to_keep`); `head` the path of releases and models
without that argument (the head's input cut to the scored positions), by making
`_compat.logits_to_keep_argument` answer None; `before` neither (every position's logits) and the
Recorder's usual 64 MiB shards (`score` before issue 47, which now sizes its shards to its batches:
`corpus.shard_size`); `plain` the floor, one forward of the same windows with `logits_to_keep`, no KV cache (`score` builds none
for a window scored in one forward) and nothing recorded. The chunk
is the whole window (`chunk_size` = context). Each case runs in a fresh process (a peak never goes down);
the peak is the kernel's high-water mark (`VmHWM`) started over once the model is loaded and has run (a
model loaded by mmap pages its weights in at its first forward), so `peak_over_model_mib` is what scoring
added to a process holding the model. Target (issue 47): model + one chunk's scored logits (`windows x
(context - 1 - context // 2) x vocab` float32) + 10%. Writes `score_memory.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    RESULTS,
    fresh_runs,
    high_water_mib,
    machine,
    print_table,
    reset_high_water,
    rss_bytes,
    smollm2_or_wide,
    write_json,
)

CASES = {"smollm2": {"context": 512, "windows": 4}, "wide": {"context": 2048, "windows": 2}}


class _FoldedTokenizer:
    """The demo tokenizer's ids folded into the wide model's vocabulary (the values do not matter here)."""

    bos_token_id = None
    pad_token_id = 0

    def __init__(self, inner, vocab: int) -> None:
        self.inner, self.vocab = inner, vocab

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [i % self.vocab for i in self.inner(text, add_special_tokens=False)["input_ids"]]}


def one(case: str, mode: str) -> dict:
    from pydoc_data.topics import topics

    from transformers_offload import _compat, score

    if mode in ("head", "before"):  # no `logits_to_keep`: the head's input cut to the scored positions
        _compat.logits_to_keep_argument = lambda model: None
    if mode == "before":  # not cut either (every position's logits), and the Recorder's usual 64 MiB shards
        from transformers_offload.rescoring import corpus, forward

        forward._HeadOnScored._cut = lambda self, module, args: None
        from transformers_offload.store.shard_writer import MAX_SHARD_BYTES

        corpus.shard_size = lambda batch_logits_bytes: MAX_SHARD_BYTES
    settings = CASES[case]
    model, tokenizer = smollm2_or_wide(case)
    if tokenizer is None:
        from transformers import AutoTokenizer

        from transformers_offload.demo_model import model_dir

        tokenizer = _FoldedTokenizer(AutoTokenizer.from_pretrained(model_dir()), model.config.vocab_size)
    text = "\n".join(topics.values())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    context, count = settings["context"], settings["windows"]
    scored_logits = count * (context - 1 - context // 2) * model.config.vocab_size * 4
    import torch

    with torch.no_grad():  # every weight touched once: a model loaded by mmap is resident before the peak starts
        model(input_ids=torch.zeros(1, 2, dtype=torch.long))
    with tempfile.TemporaryDirectory() as scratch:
        reset_high_water()
        before = rss_bytes()
        start = time.perf_counter()
        if mode == "plain":  # the floor: one forward of the windows computing the scored positions' logits only
            ids = torch.as_tensor(tokenizer("\n".join(topics.values()), add_special_tokens=False)["input_ids"])
            with torch.no_grad():
                model(input_ids=ids[: count * context].reshape(count, context)[:, :-1],
                      logits_to_keep=context - 1 - context // 2, use_cache=False)
        else:
            score(model, text, Path(scratch) / "run", tokenizer=tokenizer, context=context, batch_size=count,
                  chunk_size=context, max_windows=count)
        seconds = time.perf_counter() - start
        peak = high_water_mib()
    over = peak - before / 2**20
    return {"case": case, "mode": mode, "model_mib": round(model_bytes / 2**20, 1),
            "scored_logits_mib": round(scored_logits / 2**20, 1), "peak_over_model_mib": round(over, 1),
            "over_scored_logits": round(over / (scored_logits / 2**20), 3), "seconds": round(seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES))
    parser.add_argument("--mode", choices=["on", "head", "before", "plain"], default="on")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(one(args.case, args.mode)))
        return
    cases = {f"{case} {mode}": ["--case", case, "--mode", mode] for case in CASES for mode in ("plain", "before", "head", "on")}
    found = fresh_runs(__file__, cases, args.runs)
    rows = []
    for name, results in found.items():
        peak = min(r["peak_over_model_mib"] for r in results)
        first = results[0]
        rows.append([name, first["model_mib"], first["scored_logits_mib"], peak, round(peak / first["scored_logits_mib"], 3),
                     min(r["seconds"] for r in results)])
    print_table(["case", "model MiB", "one chunk's scored logits MiB", "peak over model MiB", "peak / scored logits",
                 "seconds"], rows)
    write_json(args.out / "score_memory.json", {"machine": machine(), "runs": args.runs, "results": found})


if __name__ == "__main__":
    main()
