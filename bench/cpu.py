"""CPU, real model: peak memory and time of stock generate() against generate() with outputs and the Recorder.

    .venv/bin/python bench/cpu.py [--batches 1 8] [--new-tokens 2048] [--checkpoints 128 256 512 1024 2048]
                                  [--shard-mib 64] [--out bench/results]

SmolLM2-135M-Instruct (float32, the cached real model), greedy, every case forced to `--new-tokens`
with `min_new_tokens` (so `out.scores` and `out.logits` are two tensors per step). For each batch size
four cases run, each in its own process (a process's memory is never fully given back), one after
the other: stock generate without outputs (the baseline), the Recorder in memory, generate with
`output_scores` + `output_logits` (`return_dict_in_generate=True`), the Recorder spilling to a
temporary directory. Every case carries a stopping criterion that notes the resident set and the
clock after each step, so one run of `--new-tokens` gives every checkpoint: the peak RSS above the
loaded model (after a short warm-up) up to step N, and the time from the call to step N.

Prints a table per checkpoint (ratios to the baseline of the same batch size, same run) and writes
`cpu.json` and `cpu.png` (memory against steps) under `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from _common import (  # noqa: E402
    RESULTS,
    MemoryProbe,
    Stopwatch,
    fresh_runs,
    machine,
    plot_traces,
    print_table,
    rss_bytes,
    stopwatch,
    write_json,
)

CASES = ("baseline", "recorder (memory)", "output_scores + output_logits", "recorder (spill)")
PROMPTS = [
    "Tell me a long story about a lighthouse keeper.",
    "Explain how a steam engine works, step by step.",
    "Write a letter to a friend about a trip to the mountains.",
    "Describe the history of the printing press.",
]


def worker(case: str, batch_size: int, new_tokens: int, shard_mib: float) -> dict:
    """Run one case in this process; returns the loaded RSS and the per-step RSS and clock."""
    from transformers_offload import Recorder
    from transformers_offload.demo_model import load

    model, tokenizer = load()
    prompts = (PROMPTS * (batch_size // len(PROMPTS) + 1))[:batch_size]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    common = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id)
    model.generate(**batch, max_new_tokens=4, pad_token_id=tokenizer.pad_token_id)  # warm-up
    loaded = rss_bytes()
    probe = MemoryProbe(rss_bytes)  # notes the clock (`probe.times`) and the resident set after each step
    extra: dict = {}
    with tempfile.TemporaryDirectory(prefix="offload-bench-") as scratch, stopwatch() as clock:
        if case == "baseline":
            model.generate(**batch, **common, stopping_criteria=[probe])
        elif case == "output_scores + output_logits":
            out = model.generate(**batch, **common, stopping_criteria=[probe], return_dict_in_generate=True,
                                 output_scores=True, output_logits=True)
            del out
        else:
            spill_dir = Path(scratch) / "run" if case == "recorder (spill)" else None
            options = {"spill_dir": spill_dir, "shard_bytes": int(shard_mib * 2**20)} if spill_dir else {}
            with Recorder(model, **options) as rec:
                model.generate(**batch, **common, stopping_criteria=[probe], logits_processor=[rec])
            stats = rec.generation().transfer
            extra = {"waits": stats.waits, "bytes_written": stats.bytes_written,
                     "write_seconds": round(stats.write_seconds, 3)}
    return {"case": case, "batch": batch_size, "loaded_bytes": loaded, "rss_bytes": probe.trace,
            "seconds_to_step": [t - clock.started for t in probe.times], "total_seconds": clock.seconds, **extra}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=2048)
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    parser.add_argument("--shard-mib", type=float, default=64.0, help="shard size of the spilling case, MiB")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", nargs=2, metavar=("CASE", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = worker(args.worker[0], int(args.worker[1]), args.new_tokens, args.shard_mib)
        print(json.dumps(result))
        return

    checkpoints = [n for n in args.checkpoints if n <= args.new_tokens]
    clock = Stopwatch()
    runs = []
    for batch_size in args.batches:
        # One run of each case, each in a fresh process with default allocator settings, one after the other.
        found = fresh_runs(__file__, {case: ["--worker", case, str(batch_size), "--new-tokens", str(args.new_tokens),
                                             "--shard-mib", str(args.shard_mib)] for case in CASES}, 1, show=False)
        for case in CASES:
            run = found[case][0]
            runs.append(run)
            print(f"[batch {batch_size}] {case}: {run['total_seconds']:.1f} s, peak RSS above the loaded model "
                  f"{(max(run['rss_bytes']) - run['loaded_bytes']) / 2**20:.1f} MiB", flush=True)

    rows = []
    for run in runs:
        base = next(r for r in runs if r["batch"] == run["batch"] and r["case"] == "baseline")
        for n in checkpoints:
            peak = max(run["rss_bytes"][:n]) - run["loaded_bytes"]
            base_peak = max(base["rss_bytes"][:n]) - base["loaded_bytes"]
            seconds = run["seconds_to_step"][n - 1]
            rows.append({
                "batch": run["batch"], "new_tokens": n, "case": run["case"],
                "peak_rss_above_loaded_mib": peak / 2**20,
                "peak_ratio_to_baseline": peak / base_peak if base_peak > 0 else None,
                "seconds": seconds, "time_ratio_to_baseline": seconds / base["seconds_to_step"][n - 1],
                **({"waits": run["waits"]} if "waits" in run else {}),
            })
    for batch_size in args.batches:
        print(f"\nbatch {batch_size}")
        print_table(
            ["new tokens", "case", "peak RSS above loaded (MiB)", "x baseline", "time (s)", "x baseline"],
            [[r["new_tokens"], r["case"], r["peak_rss_above_loaded_mib"], r["peak_ratio_to_baseline"] or "-",
              r["seconds"], r["time_ratio_to_baseline"]] for r in rows if r["batch"] == batch_size],
        )
    for run in runs:
        run["rss_mib"] = [round((v - run["loaded_bytes"]) / 2**20, 1) for v in run.pop("rss_bytes")]
        run["seconds_to_step"] = [round(v, 4) for v in run["seconds_to_step"]]
    record = {"machine": machine(), "new_tokens": args.new_tokens, "checkpoints": checkpoints,
              "shard_mib": args.shard_mib, "wall_seconds": clock.elapsed(), "rows": rows,
              "runs": runs}
    write_json(args.out / "cpu.json", record)
    plot_traces(
        args.out / "cpu.png",
        {f"SmolLM2-135M, batch {b}": {r["case"]: [v / 1024 for v in r["rss_mib"]] for r in runs if r["batch"] == b}
         for b in args.batches},
        ylabel="resident set above the loaded model (GiB)",
        title="memory against steps (CPU)",
    )


if __name__ == "__main__":
    main()
