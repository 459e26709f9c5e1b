"""What rescoring and comparing cost: time against stock, compare's tokens per second, peak memory at
long lengths and large vocabularies, and the bytes of a reference.

    .venv/bin/python bench/rescore_cost.py [--batch 4] [--new-tokens 64] [--repeats 3]
    .venv/bin/python bench/rescore_cost.py --part compare [--batch 4] [--new-tokens 128] [--vocab 152064]
    .venv/bin/python bench/rescore_cost.py --part memory [--tokens 32768] [--vocab 152064] [--runs 3]

`--part time` (SmolLM2-135M-Instruct, CPU, float32, `--batch` chat prompts, greedy, `--new-tokens`):
a reference recording is made once (logits, dense, spilled); then, interleaved `--repeats` times:
stock `generate()` of the same prompts (greedy: the same tokens) against `rescore(..., mode="decode")`
(in memory); one forward of each sequence (prompt and tokens) against `rescore(..., mode="forward")`;
reading both recordings' logits against `compare(reference, rescored).summary()` (the rescored one in
bfloat16, spilled). Also the bytes of the reference per token, dense and `topk:20`, against 16-bit
full-vocabulary log-probabilities (llama.cpp's `--kl-divergence-base` file holds those).

`--part compare` (a tiny Llama with a `--vocab` vocabulary, `--batch` rows x `--new-tokens` greedy steps,
spilled in float32, and its forward rescore in bfloat16): compare's tokens per second against reading
both recordings, interleaved `--repeats` times, and with a `topk:32+tail:48` reference (the float32
model's forward rescore in that encoding) instead, with its bytes a token against llama.cpp's 16-bit
reference file; writes `compare_speed.json`.

`--part memory` (a tiny Llama with a `--vocab` vocabulary, one row, `--tokens` steps): records a greedy
run of that length spilled to disk, then in fresh processes with default allocator settings measures the
peak anonymous memory (sampled `RssAnon`: what the process holds) and the peak RSS (sampled `VmRSS`, which
also counts the recordings' memory-mapped pages, page cache the kernel can drop) of: loading the model and
the recording only (the base); stock forwards of the same sequence, 512 positions each, keeping the KV
cache (what scoring it without this library holds); `rescore(mode="forward")` into a spilled recording,
also reported over those stock forwards; and `compare` of the two recordings (`--cases` picks some);
`--runs` times, median and min..max. Writes `rescore_cost.json` / `rescore_memory.json` under `--out`.
"""

from __future__ import annotations

import argparse
import json
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
    ResidentPeaks,
    fresh_runs,
    interleaved,
    machine,
    print_peaks,
    print_table,
    summarize,
    timed,
    timing_columns,
    write_json,
)
from compact_cost import PROMPTS  # noqa: E402

from transformers_offload import Recorder, compare, open_recording, rescore  # noqa: E402


def time_part(args: argparse.Namespace) -> None:
    from transformers_offload.demo_model import load

    model, tokenizer = load()
    chats = [[{"role": "user", "content": p}] for p in (PROMPTS * args.batch)[: args.batch]]
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    options = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    work = Path(tempfile.mkdtemp(prefix="bench-rescore-"))
    try:
        with Recorder(model, spill_dir=work / "reference", streams=("logits",)) as rec:
            model.generate(**batch, logits_processor=[rec], **options)
        reference = open_recording(work / "reference")
        generation = reference.generation()
        sequences = generation.sequences
        mask = torch.cat([batch["attention_mask"], torch.ones(len(sequences), generation.num_steps, dtype=torch.long)], 1)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        end = generation.prompt_length + generation.num_steps - 1
        rescore(reference, model.to(torch.bfloat16), work / "bf16")
        model.to(torch.float32)
        rescored = open_recording(work / "bf16")

        def one_forward(_: int) -> float:
            with torch.no_grad():
                return timed(lambda: model(input_ids=sequences[:, :end], attention_mask=mask[:, :end],
                                           position_ids=positions[:, :end]))

        def read_both(_: int) -> float:
            return timed(lambda: [g.logits() for r in (reference, rescored) for g in r.generations])

        cases = {
            "stock generate (same tokens)": lambda _: timed(lambda: model.generate(**batch, **options)),
            "rescore, decode": lambda _: timed(lambda: rescore(reference, model)),
            "one forward of the sequences": one_forward,
            "rescore, forward": lambda _: timed(lambda: rescore(reference, model, mode="forward")),
            "read both recordings": read_both,
            "compare": lambda _: timed(lambda: compare(reference, rescored).summary()),
        }
        times = interleaved(cases, args.repeats, warmup=lambda: model.generate(**batch, max_new_tokens=2,
                                                                                pad_token_id=tokenizer.pad_token_id))
        tokens = compare(reference, rescored).summary()["tokens"]
        dense = sum(p.stat().st_size for p in (work / "reference").glob("*-s*.safetensors"))
        rows_steps = generation.num_rows * generation.num_steps
        vocab = int(generation.logits(steps=range(1))[0].shape[-1])
        with Recorder(model, spill_dir=work / "topk", streams=("logits",), encodings={"logits": "topk:20"}) as rec:
            model.generate(**batch, logits_processor=[rec], **options)
        topk = sum(p.stat().st_size for p in (work / "topk").glob("*-s*.safetensors"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    pairs = {"rescore, decode": "stock generate (same tokens)", "rescore, forward": "one forward of the sequences",
             "compare": "read both recordings"}
    rows, summary = [], {}
    for case, base in pairs.items():
        entry = summarize({case: times[case], base: times[base]}, base)
        summary[case] = entry[case]
        summary[base] = entry[base]
        rows.append([case, *timing_columns(entry[case])[:2], base, *timing_columns(entry[base])[:2],
                     f"{entry[case]['over_base']:.3f}x"])
    print_table(["case", "median s", "min..max s", "against", "median s", "min..max s", "ratio"], rows)
    compare_rate = tokens / summary["compare"]["median_exact"]
    sizes = {"dense float32": dense / rows_steps, "topk:20": topk / rows_steps, "16-bit log-probabilities": 2 * vocab}
    print(f"compare: {tokens} tokens, {compare_rate:.1f} tokens/s "
          f"({tokens / summary['read both recordings']['median_exact']:.1f} tokens/s to read both)")
    print_table(["reference", "bytes per token", "over 16-bit log-probabilities"],
                [[name, f"{size:,.0f}", f"{size / sizes['16-bit log-probabilities']:.3f}x"] for name, size in sizes.items()])
    write_json(args.out / "rescore_cost.json", {"machine": machine(), "args": vars(args) | {"out": str(args.out)},
                                                "times": times, "summary": summary, "compare_tokens": tokens,
                                                "compare_tokens_per_second": compare_rate, "bytes_per_token": sizes,
                                                "vocab": vocab, "headers": TIMING_HEADERS})


SMALL_REFERENCE = "topk:32+tail:48"  # the small reference of docs/compare.md


def compare_part(args: argparse.Namespace) -> None:
    """compare's tokens per second at a large vocabulary against reading both recordings: a tiny Llama with
    a `--vocab` vocabulary, `--batch` rows x `--new-tokens` greedy steps spilled in float32, its rescore in
    bfloat16 spilled (stored natively), interleaved `--repeats` times (the page cache warm)."""
    work = Path(tempfile.mkdtemp(prefix="bench-compare-", dir=args.work_dir))
    try:
        model = tiny_model(args.vocab, args.new_tokens + 8)
        with Recorder(model, spill_dir=work / "reference", streams=("logits",)) as rec:
            model.generate(input_ids=torch.tensor([[1, 5, 6, 7]] * args.batch), logits_processor=[rec],
                           max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
        rescore(open_recording(work / "reference"), model, work / "small", mode="forward", progress=False,
                encodings={"logits": SMALL_REFERENCE})
        rescore(open_recording(work / "reference"), model.to(torch.bfloat16), work / "bf16", mode="forward",
                progress=False)
        reference, rescored = open_recording(work / "reference"), open_recording(work / "bf16")
        small = open_recording(work / "small")
        tokens = len(compare(reference, rescored))
        small_bytes = sum(p.stat().st_size for p in (work / "small").glob("*-s*.safetensors")) / tokens
        cases = {
            "read both recordings": lambda _: timed(lambda: [g.logits() for r in (reference, rescored)
                                                             for g in r.generations]),
            "compare": lambda _: timed(lambda: compare(reference, rescored).summary()),
            f"compare, {SMALL_REFERENCE} reference": lambda _: timed(lambda: compare(small, rescored).summary()),
        }
        times = interleaved(cases, args.repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = summarize(times, "read both recordings")
    rates = {case: tokens / summary[case]["median_exact"] for case in cases}
    print_table(["case", "median s", "min..max s", "tokens/s"],
                [[case, *timing_columns(summary[case])[:2], f"{rates[case]:,.0f}"] for case in cases])
    print(f"compare: {tokens} tokens at a {args.vocab:,} vocabulary, {rates['compare']:,.0f} tokens/s "
          f"({rates['read both recordings']:,.0f} tokens/s to read both)")
    llama_cpp = 2 * (args.vocab + 4)  # llama.cpp's --kl-divergence-base file: uint16 a token id, 4 more a token
    print(f"{SMALL_REFERENCE} reference: {small_bytes:,.0f} bytes a token (spilled shards), llama.cpp's "
          f"{llama_cpp:,}: 1/{llama_cpp / small_bytes:,.0f}")
    write_json(args.out / "compare_speed.json", {"machine": machine(), "args": vars(args) | {"out": str(args.out)},
                                                 "times": times, "summary": summary, "tokens": tokens,
                                                 "small_reference": SMALL_REFERENCE,
                                                 "small_reference_bytes_per_token": small_bytes,
                                                 "tokens_per_second": rates, "headers": TIMING_HEADERS})


def tiny_model(vocab: int, positions: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions + 16,
                         bos_token_id=1, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def stock_forward(model, reference, chunk_size: int = 512) -> None:
    """What a user's own forward scoring of the same sequence holds: `chunk_size` positions a forward (as
    `rescore`'s forward mode), the KV cache kept between chunks, each chunk's logits dropped."""
    from transformers_offload import _compat

    sequences = reference.generation(0).sequences
    mask = torch.ones_like(sequences)
    positions = torch.arange(sequences.shape[1])[None]
    cache, argument = None, _compat.cache_argument(model)
    with torch.no_grad():
        for start in range(0, sequences.shape[1] - 1, chunk_size):
            end = min(start + chunk_size, sequences.shape[1] - 1)
            out = model(input_ids=sequences[:, start:end], attention_mask=mask[:, :end],
                        position_ids=positions[:, start:end], use_cache=True, **{argument: cache})
            cache = _compat.cache_of(out)
            del out


def memory_child(args: argparse.Namespace) -> None:
    """One measurement in this (fresh) process; prints its result as JSON on the last line: the peaks of
    its anonymous memory and of its resident set, sampled every 20 ms (`_common.ResidentPeaks`). The first
    forward rescore writes `rescored` (compare's second recording); later ones write a directory removed
    after."""
    peaks = ResidentPeaks(interval=0.02)
    work = Path(args.work)
    model = tiny_model(args.vocab, args.tokens)
    reference = open_recording(work / "reference")
    target = work / "rescored" if not (work / "rescored").exists() else work / f"child-{os.getpid()}"
    if args.child == "stock-forward":
        stock_forward(model, reference)
    elif args.child == "rescore-forward":
        rescore(reference, model, target, mode="forward", progress=False)
    elif args.child == "compare":
        compare(reference, open_recording(work / "rescored")).summary()
    anon_peak, rss_peak = peaks.stop()
    if target.name != "rescored":
        shutil.rmtree(target, ignore_errors=True)
    print(json.dumps({"anon_peak_mib": anon_peak / 2**20, "rss_peak_mib": rss_peak / 2**20}))


MEMORY_CASES = ("base", "stock-forward", "rescore-forward", "compare")


def memory_part(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-rescore-memory-", dir=args.work_dir))
    try:
        model = tiny_model(args.vocab, args.tokens)
        with Recorder(model, spill_dir=work / "reference", streams=("logits",)) as rec:
            model.generate(input_ids=torch.tensor([[1, 5, 6, 7]]), logits_processor=[rec], max_new_tokens=args.tokens,
                           do_sample=False, pad_token_id=0)
        if "compare" in args.cases and "rescore-forward" not in args.cases:
            rescore(open_recording(work / "reference"), model, work / "rescored", mode="forward", progress=False)
        common = ["--part", "memory-child", "--work", str(work), "--tokens", str(args.tokens), "--vocab", str(args.vocab)]
        found = fresh_runs(__file__, {case: [*common, "--child", case] for case in args.cases}, args.runs)
        base = "base" if "base" in args.cases else None
        summary = {"anon": print_peaks(found, key="anon_peak_mib", base=base, label="anonymous peak"),
                   "rss": print_peaks(found, key="rss_peak_mib", base=base, label="RSS peak (mapped files included)")}
        if {"stock-forward", "rescore-forward"} <= set(args.cases):
            pair = {case: found[case] for case in ("stock-forward", "rescore-forward")}
            summary["anon_over_stock_forward"] = print_peaks(pair, key="anon_peak_mib", base="stock-forward",
                                                             label="anonymous peak")
        on_disk = sum(p.stat().st_size for p in (work / "reference").iterdir())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_json(args.out / "rescore_memory.json", {"machine": machine(), "args": vars(args) | {"out": str(args.out)},
                                                  "runs": found, "summary": summary, "reference_bytes": on_disk})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("time", "compare", "memory", "memory-child"), default="time")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cases", nargs="+", choices=MEMORY_CASES, default=list(MEMORY_CASES),
                        help="the memory part's cases (each run in a process of its own)")
    parser.add_argument("--work-dir", default=None,
                        help="where the memory part writes its recordings (2 x tokens x vocab x 4 bytes)")
    parser.add_argument("--work"), parser.add_argument("--child")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    {"time": time_part, "compare": compare_part, "memory": memory_part, "memory-child": memory_child}[args.part](args)


if __name__ == "__main__":
    main()
