"""The recorder's own host work per decoding step, on a model too small to hide it, and spilled on the
real model at batch 8, per encoding.

    .venv/bin/python bench/host_overhead.py [--steps 300] [--repeats 7] [--out bench/results]
    .venv/bin/python bench/host_overhead.py --part spill [--batch 8] [--steps 64] [--repeats 3]
        [--setting top_k] [--threads 1] [--out bench/results]

On a GPU, generation at small and medium sizes is bound by the host: the device waits for Python to
launch the next kernels, and `generate()` waits for the device once per step. Whatever the recorder
does in `generate()`'s thread then adds to every step in full. This measures that work on CPU with a
model so small (one Llama layer, hidden size 32, vocabulary 256, batch 1, one thread) that copying
the tensors costs next to nothing and the difference is the recorder's Python: its taps, the ring's
`put` calls, the store's `drain` (and making and closing the Recorder, once per call). Cases,
interleaved, `--repeats` times, each the median:

- stock `generate()` (the baseline);
- the Recorder in memory, draining in `generate()`'s thread (the CPU path);
- the Recorder in memory, draining in a background thread (the CUDA path's structure, forced on CPU;
  its CUDA calls, which the GPU benchmark's ring table measures, are not in it);
- the Recorder in memory, inline, with `encodings={"scores": "sparse"}` (greedy: every row is finite,
  so each is stored whole, the sparse encoding's costliest host path), and with `"topk:20"`.

Prints microseconds per step over the baseline, of the wall clock, of the process's CPU time (all
threads; steadier on a shared machine) and of the CPU time of `generate()`'s own thread (what the
recorder adds to the thread that launches the model's work; the drainer thread's copies are not in
it: on a GPU host they run on another core), and writes `host_overhead.json` and `.png` under `--out`.

`--part spill`: SmolLM2-135M-Instruct (float32, vocabulary 49,152), `--batch` chat prompts, `--steps`
sampled steps (`--setting`: top_k 50, top_p 0.9 with temperature 0.7, or greedy), each recorder spilling
to a fresh directory, with `encodings` dense, `{"scores": "sparse"}` and `topk:20` for both streams.
Per case, the median over `--repeats` interleaved calls of CPU time, not wall time, so that other
processes on the machine move it little: in generate()'s thread, inside the recorder's taps (the ring's
puts, the encodings, the inline drain into shard buffers), and in the store's writer thread (the
safetensors files, their checksums, the manifest), both per step, in microseconds; their sum is the
recorder's host work per step. `--threads` (default 1) sets torch's threads, so that a tap's torch
operations run in the thread that is timed. Writes `host_overhead-spill-<setting>-b<batch>.json`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import torch  # noqa: E402
from _common import CHAT_PROMPTS as PROMPTS  # noqa: E402
from _common import RESULTS, Stopwatch, interleaved, machine, median, plot_bars, print_table, stopwatch, summarize, write_json
from _common import SAMPLING_SETTINGS as SETTINGS
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from transformers_offload import Recorder  # noqa: E402
from transformers_offload import recorder as recorder_module
from transformers_offload.capture.capture import Capture  # noqa: E402
from transformers_offload.store.shard_writer import ShardStore  # noqa: E402

CASES = ("baseline", "Recorder, drained inline (CPU path)", "Recorder, drained by a thread (CUDA path)",
         "Recorder, scores sparse, inline", "Recorder, scores topk:20, inline")
ENCODINGS = {CASES[3]: {"scores": "sparse"}, CASES[4]: {"scores": "topk:20"}}


def build() -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, vocab_size=256, bos_token_id=0, eos_token_id=None,
                         pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


SPILL_CASES = {
    "dense": {"logits": "dense", "scores": "dense"},
    "scores sparse": {"scores": "sparse"},
    "topk:20 both": {"logits": "topk:20", "scores": "topk:20"},
}
TAPS = ("on_forward", "on_raw", "on_processed", "on_stopping")  # what generate()'s thread runs of the recorder


@contextmanager
def cpu_counters() -> Iterator[dict[str, float]]:
    """CPU seconds spent in the capture's taps (generate()'s thread) and in the shard store's writer
    thread, summed into the returned dict while the block runs (the classes' methods wrapped, then put back).
    A counter inside the measured code rather than a clock around a case: it reads the thread's CPU clock
    alone (`time.thread_time()`), as cheaply as it can, since its own cost falls into what it counts."""
    counts = {"taps": 0.0, "writer": 0.0}
    originals = {name: getattr(Capture, name) for name in TAPS}
    write_jobs = ShardStore._write_jobs

    def timed_tap(method: Any) -> Any:
        def tap(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                counts["taps"] += time.thread_time() - started
        return tap

    def timed_writer(store: ShardStore) -> None:
        started = time.thread_time()
        try:
            write_jobs(store)
        finally:
            counts["writer"] += time.thread_time() - started

    for name, method in originals.items():
        setattr(Capture, name, timed_tap(method))
    ShardStore._write_jobs = timed_writer
    try:
        yield counts
    finally:
        for name, method in originals.items():
            setattr(Capture, name, method)
        ShardStore._write_jobs = write_jobs


def spill_part(args: argparse.Namespace) -> None:
    from transformers_offload.demo_model import load

    torch.set_num_threads(args.threads)
    model, tokenizer = load()
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in (PROMPTS * args.batch)[: args.batch]]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    options = dict(SETTINGS[args.setting], max_new_tokens=args.steps, min_new_tokens=args.steps,
                   pad_token_id=tokenizer.pad_token_id)
    scratch = Path(tempfile.mkdtemp(prefix="host-overhead-"))

    def run(case: str) -> dict[str, float]:
        root = scratch / "run"
        shutil.rmtree(root, ignore_errors=True)
        torch.manual_seed(0)
        clock = Stopwatch()  # the whole call, removing its recording included
        with cpu_counters() as counts, Recorder(model, spill_dir=root, encodings=SPILL_CASES[case]) as rec:
            model.generate(**batch, logits_processor=[rec], **options)
        assert rec.generation().num_steps == args.steps
        shutil.rmtree(root)
        clock.stop()
        return {"taps_us": counts["taps"] / args.steps * 1e6, "writer_us": counts["writer"] / args.steps * 1e6,
                "seconds": clock.seconds, "cpu_seconds": clock.cpu_seconds}

    try:
        found = interleaved({case: (lambda _, case=case: run(case)) for case in SPILL_CASES}, args.repeats,
                            warmup=lambda: [run(case) for case in SPILL_CASES])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = []
    for case, runs in found.items():
        medians = {key: median(r[key] for r in runs) for key in runs[0]}
        rows.append({"case": case, "encodings": SPILL_CASES[case], **{f"median_{k}": v for k, v in medians.items()},
                     "host_us_per_step": medians["taps_us"] + medians["writer_us"], "runs": runs})
    load = os.getloadavg()
    print(f"host work per step, spilled: SmolLM2-135M, batch {args.batch}, {args.setting}, {args.steps} steps, "
          f"{args.threads} torch thread(s), median of {args.repeats}; load average {load[0]:.2f}")
    print_table(["encodings", "generate() thread, in the taps: CPU us per step", "writer thread: CPU us per step",
                 "host work: CPU us per step", "wall s per call"],
                [[r["case"], r["median_taps_us"], r["median_writer_us"], r["host_us_per_step"], r["median_seconds"]]
                 for r in rows])
    write_json(args.out / f"host_overhead-spill-{args.setting}-b{args.batch}.json",
               {"machine": machine(), "load_average": load, "batch": args.batch, "setting": args.setting,
                "steps": args.steps, "repeats": args.repeats, "threads": args.threads, "cases": rows})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("tiny", "spill"), default="tiny")
    parser.add_argument("--steps", type=int, default=None, help="default 300 (tiny), 64 (spill)")
    parser.add_argument("--repeats", type=int, default=None, help="default 7 (tiny), 3 (spill)")
    parser.add_argument("--batch", type=int, default=8, help="spill only")
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="top_k", help="spill only")
    parser.add_argument("--threads", type=int, default=1, help="spill only: torch's threads")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.part == "spill":
        args.steps, args.repeats = args.steps or 64, args.repeats or 3
        spill_part(args)
        return
    args.steps, args.repeats = args.steps or 300, args.repeats or 7
    torch.set_num_threads(1)
    model = build()
    prompt = torch.randint(1, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    call = dict(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.steps,
                min_new_tokens=args.steps, do_sample=False)
    original = recorder_module._on_cuda

    def run(case: str) -> tuple[float, float, float]:
        recorder_module._on_cuda = (lambda model: True) if case == CASES[2] else original
        try:
            with stopwatch() as clock:
                if case == CASES[0]:
                    model.generate(**call)
                else:
                    with Recorder(model, encodings=ENCODINGS.get(case)) as rec:
                        model.generate(**call, logits_processor=[rec])
                    assert rec.generation().num_steps == args.steps
            return clock.seconds, clock.cpu_seconds, clock.thread_seconds
        finally:
            recorder_module._on_cuda = original

    found = interleaved({case: (lambda _, case=case: run(case)) for case in CASES}, args.repeats,
                        warmup=lambda: [run(case) for case in CASES])  # every case warmed up once
    seconds, cpu_seconds, thread_seconds = ({case: [r[i] for r in found[case]] for case in CASES} for i in range(3))
    wall_median, cpu_median, thread_median = ({case: entry["median_exact"] for case, entry in summarize(values).items()}
                                         for values in (seconds, cpu_seconds, thread_seconds))
    rows = []
    for case in CASES:
        rows.append({
            "case": case,
            "median_seconds": wall_median[case],
            "us_per_step": wall_median[case] / args.steps * 1e6,
            "us_per_step_over_baseline": (wall_median[case] - wall_median[CASES[0]]) / args.steps * 1e6,
            # The process's CPU time (every thread): unlike the wall clock, not lengthened by what else
            # runs on the machine or by the hypervisor taking the CPU away.
            "cpu_us_per_step_over_baseline": (cpu_median[case] - cpu_median[CASES[0]]) / args.steps * 1e6,
            # The CPU time of generate()'s thread alone (the drainer thread's work excluded).
            "thread_cpu_us_per_step_over_baseline": (thread_median[case] - thread_median[CASES[0]]) / args.steps * 1e6,
            "seconds": seconds[case],
            "cpu_seconds": cpu_seconds[case],
            "thread_cpu_seconds": thread_seconds[case],
        })
    print(f"host work per step: one Llama layer, vocabulary 256, batch 1, {args.steps} steps, "
          f"median of {args.repeats}")
    print_table(["case", "us per step", "us per step over the baseline", "CPU us per step over the baseline",
                 "generate() thread's CPU us over the baseline"],
                [[r["case"], r["us_per_step"], r["us_per_step_over_baseline"], r["cpu_us_per_step_over_baseline"],
                  r["thread_cpu_us_per_step_over_baseline"]] for r in rows])
    write_json(args.out / "host_overhead.json",
               {"machine": machine(), "steps": args.steps, "repeats": args.repeats, "cases": rows})
    plot_bars(args.out / "host_overhead.png",
              {"us per step over the baseline": {r["case"]: r["us_per_step_over_baseline"] for r in rows[1:]}},
              title=f"recorder's host work per step (CPU, {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
