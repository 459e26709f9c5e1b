"""Device memory and time on a GPU: stock generate() against generate() with outputs and the Recorder.

    python bench/gpu.py [--models llama-1.1b smollm2-135m] [--batch 64] [--new-tokens 1000]
                        [--warmup-tokens 32] [--sdpa no-cudnn] [--budget-s 290] [--out bench/results]
    python bench/gpu.py --dry-run        # the same code end to end on CPU, tiny models, no GPU figures

Per model, in one process and in this order: a warm-up call of `--warmup-tokens`, stock generate
(no outputs, the baseline), the Recorder in memory, generate with `output_scores` + `output_logits`
(`return_dict_in_generate=True`), the Recorder spilling to `--spill-root` with its defaults (a bf16
model's logits `"native"` from transformers 4.45, the greedy scores stored once as the logits), the
same with both streams dense float32 (`encodings={"logits": "dense", "scores": "dense"}`), the same
with the per-token stats alone (`streams=("stats",)`), and the baseline again (the two baseline
timings are averaged; each case's sequences are compared with each baseline's).
Greedy, bf16, batch 64, 1,000 new tokens with no end-of-sequence token (every row runs to the end),
random prompts of 32 tokens. For each case: `torch.cuda.max_memory_allocated()` after
`reset_peak_memory_stats()`, time between `torch.cuda.synchronize()` calls, the process's CPU time
(all threads), and whether the sequences equal the baselines'. Every case, the baseline too, carries
a stopping criterion that notes `torch.cuda.memory_allocated()` and the host clock after each step
(host counters: no synchronisation), for the memory and step-time plots.

Attention runs without PyTorch's cuDNN backend (`--sdpa no-cudnn`, the default). On Hopper, PyTorch
may pick cuDNN attention, which builds a plan for every new key length: every decode step of a
model's first call. In the first H200 run (2026-11-30, cuDNN allowed) the first full-length call of
each model took 41-46 s longer than the later ones (59 s against 18 s for llama-1.1b), about 40 ms per
step whatever the model, so every case after it needed a full-length warm-up, and both models did not
fit in 5 minutes. `--sdpa default` keeps PyTorch's choice; then pass `--warmup-tokens 1000`.

Last, the ring alone: the host time per step of the four `HostRing.put` calls a greedy step makes
(logits and scores `(batch, vocab)` float32, tokens, finished), with a drain that keeps nothing: the
recorder's own per-step cost in `generate()`'s thread, without a model.

Models are built from configs with random weights, on the GPU (no download, and the GPU machine
reaches no network): `smollm2-135m` has SmolLM2-135M's exact shape (30 layers, vocabulary 49,152),
`llama-1.1b` TinyLlama-1.1B's (22 layers, hidden 2,048, vocabulary 32,000; 1.1 B parameters).
Memory and time depend on the shapes, not on the weights' values.

Writes `gpu.json` and `gpu.png` under `--out` (`gpu-dry-run.*` with `--dry-run`) and prints two
tables: ratios to the baseline, and the upstream attempt's shape (initial, peak, increase, time,
overhead, sequences match). `--budget-s` stops starting new cases once that many seconds have passed.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import torch  # noqa: E402
from _common import (  # noqa: E402
    RESULTS,
    MemoryProbe,
    Stopwatch,
    interleaved,
    machine,
    median,
    plot_traces,
    print_table,
    rss_bytes,
    stopwatch,
    write_json,
)
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from transformers_offload import Recorder  # noqa: E402
from transformers_offload.capture.transfer import HostRing  # noqa: E402

SHAPES = {
    # SmolLM2-135M-Instruct's config.json (the real model of the CPU benchmarks), weights random.
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192, rms_norm_eps=1e-5),
    # TinyLlama-1.1B's shape: a Llama-style model of about 1 B parameters.
    "llama-1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                       num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False,
                       max_position_embeddings=2048, rms_norm_eps=1e-5),
}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
CASES = ("baseline", "recorder (memory)", "output_scores + output_logits", "recorder (spill)",
         "recorder (spill, dense float32)", "recorder (spill, stats only)", "baseline (again)")
# The Recorder's options per recorder case: its defaults (a bf16 model's logits "native" from 4.45,
# greedy scores stored once as the logits), both streams dense float32, or the per-token stats alone.
RECORDER_OPTIONS = {CASES[1]: {}, CASES[3]: {}, CASES[4]: {"encodings": {"logits": "dense", "scores": "dense"}},
                    CASES[5]: {"streams": ("stats",)}}
PROMPT_LENGTH = 32


def build(name: str, device: torch.device, dry_run: bool) -> LlamaForCausalLM:
    shape = dict(SHAPES[name])
    if dry_run:
        shape.update(TINY, vocab_size=min(shape["vocab_size"], 1024))
    config = LlamaConfig(**shape, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


class Meter:
    """Device memory and synchronised time of one case (host RSS on the CPU dry run)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else rss_bytes()

    def run(self, case: Callable[[MemoryProbe], torch.Tensor]) -> dict[str, Any]:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        initial = self.allocated()
        probe = MemoryProbe(self.allocated)
        with stopwatch() as clock:
            sequences = case(probe)
            if self.cuda:
                torch.cuda.synchronize()
        started, seconds = clock.started, clock.seconds
        peak = torch.cuda.max_memory_allocated() if self.cuda else max([initial, *probe.trace])
        # Milliseconds per step as the host saw it; the first one holds the prefill.
        ends = [started, *probe.times]
        step_ms = [round((b - a) * 1e3, 3) for a, b in zip(ends, ends[1:])]
        return {"sequences": sequences, "initial": initial, "peak": peak, "seconds": seconds,
                "cpu_seconds": clock.cpu_seconds, "trace": probe.trace, "step_ms": step_ms}


def bench_model(name: str, args: argparse.Namespace, device: torch.device, clock: Stopwatch) -> dict[str, Any]:
    """Every case of `name`, starting none once `clock` has run `args.budget_s` seconds."""
    model = build(name, device, args.dry_run)
    params = sum(p.numel() for p in model.parameters())
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, model.config.vocab_size, (args.batch, PROMPT_LENGTH), generator=generator)
    batch = {"input_ids": input_ids.to(device), "attention_mask": torch.ones_like(input_ids).to(device)}
    common = dict(max_new_tokens=args.new_tokens, do_sample=False)
    spill_root = Path(args.spill_root or tempfile.mkdtemp(prefix="offload-bench-"))
    stats: dict[str, Any] = {}

    def baseline(probe):
        return model.generate(**batch, **common, stopping_criteria=[probe])

    def outputs(probe):
        out = model.generate(**batch, **common, stopping_criteria=[probe], return_dict_in_generate=True,
                             output_scores=True, output_logits=True)
        return out.sequences  # the per-step tensors are freed with `out`, after the peak was read

    def recorder(case: str):
        spill = "spill" in case

        def run(probe):
            spill_dir = spill_root / f"{name}-run" if spill else None
            with Recorder(model, spill_dir=spill_dir, **RECORDER_OPTIONS[case]) as rec:
                sequences = model.generate(**batch, **common, stopping_criteria=[probe], logits_processor=[rec])
            generation = rec.generation()
            stats[case] = {
                "steps": generation.num_steps, "waits": generation.transfer.waits,
                "bytes_written": generation.transfer.bytes_written,
                "write_seconds": round(generation.transfer.write_seconds, 3),
            }
            del rec, generation
            if spill:
                shutil.rmtree(spill_dir)
            return sequences

        return run

    runs = {case: baseline if case.startswith("baseline") else outputs if case == CASES[2] else recorder(case)
            for case in CASES}
    meter = Meter(device)
    with stopwatch() as warmup:
        model.generate(**batch, max_new_tokens=args.warmup_tokens, do_sample=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
    print(f"[{name}] warm-up: {warmup.seconds:.2f} s", flush=True)
    results: dict[str, dict[str, Any]] = {}
    for case, run in runs.items():
        if clock.elapsed() > args.budget_s:
            print(f"[{name}] budget spent: {case!r} not run", flush=True)
            continue
        results[case] = meter.run(run)
        print(f"[{name}] {case}: {results[case]['seconds']:.2f} s, peak {results[case]['peak'] / 2**20:.1f} MiB"
              f"{', ' + str(stats[case]) if case in stats else ''}", flush=True)
    shutil.rmtree(spill_root, ignore_errors=True)
    model = None  # frees it before the next model (the closures above hold its cell)
    return summarize(name, params, args, results, stats)


def summarize(name: str, params: int, args: argparse.Namespace, results: dict[str, dict[str, Any]],
              stats: dict[str, Any]) -> dict[str, Any]:
    base_runs = [results[c] for c in (CASES[0], CASES[-1]) if c in results]
    base_seconds = sum(r["seconds"] for r in base_runs) / len(base_runs)
    base_increase = sum(r["peak"] - r["initial"] for r in base_runs) / len(base_runs)
    references = [r["sequences"].cpu() for r in base_runs]
    base_steps = [ms for r in base_runs for ms in r["step_ms"][1:]]  # none in a call of one step
    base_step_ms = median(base_steps) if base_steps else None
    extra_outputs = None
    if CASES[2] in results:
        extra_outputs = results[CASES[2]]["peak"] - results[CASES[2]]["initial"] - base_increase
    rows = []
    for case, result in results.items():
        increase = result["peak"] - result["initial"]
        extra = increase - base_increase
        row = {
            "case": case,
            "initial_mib": result["initial"] / 2**20,
            "peak_mib": result["peak"] / 2**20,
            "increase_mib": increase / 2**20,
            "extra_over_baseline_mib": extra / 2**20,
            "seconds": result["seconds"],
            "time_ratio_to_baseline": result["seconds"] / base_seconds,
            # Equal to each baseline run's sequences (the two baselines are also compared).
            "matches_baselines": [torch.equal(result["sequences"].cpu(), ref) for ref in references],
            "cpu_seconds": result["cpu_seconds"],
            "median_step_ms": median(result["step_ms"][1:]) if len(result["step_ms"]) > 1 else None,
            "trace_mib": [round(v / 2**20, 2) for v in result["trace"]],
            "step_ms": result["step_ms"],
        }
        row["sequences_match"] = all(row["matches_baselines"])
        if extra_outputs is not None and extra_outputs > 0 and case.startswith("recorder"):
            row["extra_share_of_outputs_extra"] = extra / extra_outputs
        row.update(stats.get(case, {}))
        rows.append(row)
    return {"model": name, "parameters": params, "batch": args.batch, "new_tokens": args.new_tokens,
            "baseline_seconds_mean": base_seconds, "baseline_median_step_ms": base_step_ms, "cases": rows}


def ring_cost(device: torch.device, batch: int, vocab: int, steps: int) -> dict[str, Any]:
    """Host microseconds per step of a greedy step's four puts into a ring whose drain keeps nothing
    (threaded on CUDA, as in the recorder), measured until the last put returns, then after the flush."""
    cuda = device.type == "cuda"
    tensors = {
        "logits": torch.randn(batch, vocab, device=device),
        "finished": torch.zeros(batch, dtype=torch.bool, device=device),
        "scores": torch.randn(batch, vocab, device=device),
        "tokens": torch.zeros(batch, dtype=torch.long, device=device),
    }

    def one_round(_: int = 0) -> tuple[float, float, int]:
        ring = HostRing(4, lambda step, drained: None, threaded=cuda)
        if cuda:
            torch.cuda.synchronize()
        with stopwatch() as clock:
            for step in range(steps):
                for name, tensor in tensors.items():
                    ring.put(step, name, tensor)
            issued = clock.elapsed()
            ring.flush()
            if cuda:
                torch.cuda.synchronize()
        return issued, clock.seconds, ring.waits

    # One round after a warm-up round, which allocates the slots.
    issued, total, waits = interleaved({"ring": one_round}, 1, warmup=one_round)["ring"][0]
    return {"batch": batch, "vocab": vocab, "steps": steps, "host_us_per_step": issued / steps * 1e6,
            "with_flush_us_per_step": total / steps * 1e6, "waits": waits,
            "bytes_per_step": sum(t.numel() * t.element_size() for t in tensors.values())}


def report(models: list[dict[str, Any]], ring: dict[str, Any] | None) -> None:
    for entry in models:
        print(f"\n{entry['model']} ({entry['parameters'] / 1e6:,.1f} M parameters), batch {entry['batch']}, "
              f"{entry['new_tokens']} new tokens")
        print_table(
            ["case", "extra peak over baseline (MiB)", "share of outputs' extra", "time (s)", "x baseline",
             "median step (ms)", "CPU time (s)", "waits", "matches baselines"],
            [[r["case"], r["extra_over_baseline_mib"], r.get("extra_share_of_outputs_extra", "-"), r["seconds"],
              r["time_ratio_to_baseline"], r["median_step_ms"], r["cpu_seconds"], r.get("waits", "-"),
              "/".join("yes" if m else "no" for m in r["matches_baselines"])] for r in entry["cases"]],
        )
        print()
        print_table(
            ["case", "initial (MB)", "peak (MB)", "increase (MB)", "time (s)", "overhead", "sequences match"],
            [[r["case"], r["initial_mib"] * 2**20 / 1e6, r["peak_mib"] * 2**20 / 1e6,
              r["increase_mib"] * 2**20 / 1e6, r["seconds"], f"{(r['time_ratio_to_baseline'] - 1) * 100:+.1f}%",
              r["sequences_match"]] for r in entry["cases"]],
        )
    if ring is not None:
        print(f"\nthe ring alone: four puts per step, batch {ring['batch']}, vocabulary {ring['vocab']}, "
              f"{ring['bytes_per_step'] / 1e6:.1f} MB per step")
        print_table(["host time per step until the last put (us)", "with the flush (us)", "waits"],
                    [[ring["host_us_per_step"], ring["with_flush_us_per_step"], ring["waits"]]])


def sdpa_backends() -> dict[str, bool]:
    """Which of PyTorch's attention backends are enabled (torch.backends.cuda flags)."""
    flags = {}
    for name in ("flash", "mem_efficient", "math", "cudnn"):
        check = getattr(torch.backends.cuda, f"{name}_sdp_enabled", None)
        if check is not None:
            flags[name] = bool(check())
    return flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=tuple(SHAPES), default=["llama-1.1b", "smollm2-135m"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=1000)
    parser.add_argument("--warmup-tokens", type=int, default=32, help="new tokens of the warm-up call")
    parser.add_argument("--sdpa", choices=("no-cudnn", "default"), default="no-cudnn",
                        help="no-cudnn: attention without PyTorch's cuDNN backend (see above); default: "
                        "PyTorch's own choice")
    parser.add_argument("--budget-s", type=float, default=290.0, help="start no case after this many seconds")
    parser.add_argument("--spill-root", help="where the spilling case writes (default: a temporary directory)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--dry-run", action="store_true",
                        help="run on CPU with tiny models (batch 4, 16 new tokens unless given): checks the "
                        "script end to end; its figures are not GPU figures")
    args = parser.parse_args()
    clock = Stopwatch()
    if args.dry_run:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # tiny models: more threads only add scheduling noise to the timings
        if args.batch == parser.get_default("batch"):
            args.batch = 4
        if args.new_tokens == parser.get_default("new_tokens"):
            args.new_tokens = 16
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        parser.error("no CUDA device is visible; run with --dry-run to check the script on CPU")
    if args.sdpa == "no-cudnn" and hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)
    stem = "gpu-dry-run" if args.dry_run else "gpu"
    record = {"machine": machine(), "dry_run": args.dry_run, "sdpa": args.sdpa, "sdpa_backends": sdpa_backends(),
              "warmup_tokens": args.warmup_tokens, "models": [], "ring": None}
    for name in args.models:
        record["models"].append(bench_model(name, args, device, clock))
        record["wall_seconds"] = clock.elapsed()
        write_json(args.out / f"{stem}.json", record)  # after each model: a later timeout keeps it
    vocab = 1024 if args.dry_run else SHAPES[args.models[-1]]["vocab_size"]
    record["ring"] = ring_cost(device, args.batch, vocab, steps=200)
    record["wall_seconds"] = clock.elapsed()
    write_json(args.out / f"{stem}.json", record)
    models = record["models"]
    report(models, record["ring"])
    plot_traces(
        args.out / f"{stem}.png",
        {f"{m['model']}, batch {m['batch']}": {r["case"]: [v / 1024 for v in r["trace_mib"]] for r in m["cases"]}
         for m in models},
        ylabel="device memory allocated (GiB)" if device.type == "cuda" else "resident set (GiB)",
        title=f"memory against steps ({'CPU dry run' if args.dry_run else machine().get('gpu', '')})",
    )
    plot_traces(
        args.out / f"{stem}-step-time.png",
        {f"{m['model']}, batch {m['batch']}": {r["case"]: r["step_ms"][1:] for r in m["cases"]} for m in models},
        ylabel="step time seen by the host (ms)",
        title=f"time per decode step ({'CPU dry run' if args.dry_run else machine().get('gpu', '')})",
    )
    print(f"total {clock.elapsed():.1f} s")


if __name__ == "__main__":
    main()
