"""What scoring a corpus costs: `score` against a plain chunked forward of the same windows.

    .venv/bin/python bench/score_cost.py [--windows 8] [--context 512] [--batch 4] [--repeats 3]

SmolLM2-135M-Instruct (CPU, float32) over Python's help texts (`pydoc_data.topics`), cut into llama.cpp's
windows (`transformers_offload.rescoring.corpus.windows`); interleaved `--repeats` times: the plain forward
(the text tokenised, then `model(input_ids=window[:, :context - 1])` per batch of `--batch` windows, the
logits dropped: what scoring them without this library costs at least) against `score(model, text, out)` spilling every
scored position's logits to a new directory (what a reference costs). Writes `score_cost.json`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _common import (  # noqa: E402
    RESULTS,
    TIMING_HEADERS,
    interleaved,
    machine,
    print_table,
    summarize,
    timed,
    timing_columns,
    write_json,
)

from transformers_offload import score  # noqa: E402
from transformers_offload.rescoring.corpus import windows  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    from pydoc_data.topics import topics

    from transformers_offload.demo_model import load

    model, tokenizer = load()
    text = "\n\n".join(topics[name] for name in sorted(topics))[: args.windows * args.context * 8]
    cut = windows(tokenizer(text, add_special_tokens=False)["input_ids"], args.context, tokenizer.bos_token_id)
    assert len(cut) >= args.windows, "a longer text is needed"
    work = Path(tempfile.mkdtemp(prefix="bench-score-"))

    def plain(_: int) -> float:
        def run() -> None:  # the same tokenisation, then the forwards
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            batch = windows(ids, args.context, tokenizer.bos_token_id)[: args.windows]
            with torch.no_grad():
                for start in range(0, len(batch), args.batch):
                    model(input_ids=batch[start : start + args.batch, : args.context - 1])
        return timed(run)

    def scored(round_: int) -> float:
        target = work / f"run-{round_}"
        seconds = timed(lambda: score(model, text, target, tokenizer=tokenizer, context=args.context,
                                      batch_size=args.batch, max_windows=args.windows))
        shutil.rmtree(target, ignore_errors=True)
        return seconds

    try:
        times = interleaved({"plain forward": plain, "score (spilled)": scored}, args.repeats,
                            warmup=lambda: plain(0))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = summarize(times, "plain forward")
    tokens = args.windows * (args.context - 1 - args.context // 2)
    print_table(["case", "median s", "min..max s", "over plain", "tokens/s"],
                [[case, *timing_columns(summary[case])[:2], f"{summary[case]['over_base']:.3f}x",
                  f"{tokens / summary[case]['median_exact']:,.0f}"] for case in times])
    write_json(args.out / "score_cost.json", {"machine": machine(), "args": vars(args) | {"out": str(args.out)},
                                              "times": times, "summary": summary, "tokens_scored": tokens,
                                              "headers": TIMING_HEADERS})


if __name__ == "__main__":
    main()
