"""The recorder's own host work per decoding step, on a model too small to hide it.

    .venv/bin/python bench/host_overhead.py [--steps 300] [--repeats 7] [--out bench/results]

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
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from _common import RESULTS, interleaved, machine, plot_bars, print_table, summarize, write_json  # noqa: E402
from transformers_offload import Recorder, recorder as recorder_module  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build()
    prompt = torch.randint(1, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    call = dict(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.steps,
                min_new_tokens=args.steps, do_sample=False)
    original = recorder_module._on_cuda

    def run(case: str) -> tuple[float, float, float]:
        recorder_module._on_cuda = (lambda model: True) if case == CASES[2] else original
        try:
            started, cpu, own = time.perf_counter(), time.process_time(), time.thread_time()
            if case == CASES[0]:
                model.generate(**call)
            else:
                with Recorder(model, encodings=ENCODINGS.get(case)) as rec:
                    model.generate(**call, logits_processor=[rec])
                assert rec.generation().num_steps == args.steps
            return time.perf_counter() - started, time.process_time() - cpu, time.thread_time() - own
        finally:
            recorder_module._on_cuda = original

    found = interleaved({case: (lambda _, case=case: run(case)) for case in CASES}, args.repeats,
                        warmup=lambda: [run(case) for case in CASES])  # every case warmed up once
    seconds, cpu_seconds, thread_seconds = ({case: [r[i] for r in found[case]] for case in CASES} for i in range(3))
    median, cpu_median, thread_median = ({case: entry["median_exact"] for case, entry in summarize(values).items()}
                                         for values in (seconds, cpu_seconds, thread_seconds))
    rows = []
    for case in CASES:
        rows.append({
            "case": case,
            "median_seconds": median[case],
            "us_per_step": median[case] / args.steps * 1e6,
            "us_per_step_over_baseline": (median[case] - median[CASES[0]]) / args.steps * 1e6,
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
