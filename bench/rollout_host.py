"""The host-side work of a rollout batch: `kept_sets`, `sampler_logprobs(raw=False)` and `KeptSets.select`,
per row-step, at rollout scale.

    .venv/bin/python bench/rollout_host.py [--rows 4096] [--steps 1024] [--vocab 49152] [--repeats 3]
    .venv/bin/python bench/rollout_host.py --rows 512 --steps 64 --code /work/before   # another checkout's code

No model: the recording is written through the shard store (the layer below `generate()`), one generation
of `--rows` rows sampled for `--steps` steps with the processed scores recorded `"sparse"` (what a rollout
recorder at this scale keeps: SmolLM2's top-p 0.9 kept sets are 50 ids on average, bench/kept_sets.py). Each
row-step keeps a set of ids drawn so that its sizes look like top-p 0.9's on SmolLM2 (mostly tens of ids,
now and then thousands: a log-normal with mean about 50, capped at a tenth of the vocabulary); a fifth of
the rows finish at a step of the second half, and row 0 keeps the whole vocabulary at every eighth step
(stored whole).
Each function runs in a fresh process: its first call's anonymous memory peak over what the process held
before it (sampled; the shards are memory-mapped, so the resident set also counts the file pages read) against
the recording's sparse bytes, then `--repeats` timed calls (the median).
`--code DIR` imports transformers_offload from DIR (a worktree at another commit) to time its code on the
same recording. Writes `rollout_host[-LABEL].json`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent


def write_recording(root: Path, rows: int, steps: int, vocab: int, seed: int = 0) -> int:
    """The synthetic rollout recording (module docstring) at `root`; returns its sparse bytes (the scores'
    records)."""
    import torch

    from transformers_offload.store.header import GenerationHeader
    from transformers_offload.store.spill import Spill

    generator = torch.Generator().manual_seed(seed)
    spill = Spill(root, shard_bytes=None, model_info={"class": "Synthetic", "name_or_path": "synthetic",
                                                      "config_class": "SyntheticConfig", "vocab_size": vocab},
                  created_by={"package": "bench/rollout_host.py"})
    header = GenerationHeader(index=0, mode="sample", prompt_length=4, prompt_lengths=tuple([4] * rows), num_beams=1,
                              pad_token_id=0, eos_token_id=(1,), generation_config={"do_sample": True, "top_p": 0.9},
                              encodings={"scores": "sparse"})
    store = spill.open_store(["scores", "tokens", "finished"], header, max_steps=steps)
    finished = torch.zeros(rows, dtype=torch.bool)
    # a fifth of the rows end (emit EOS) at a step of the second half; the others run to the end
    ends = torch.where(torch.rand(rows, generator=generator) < 0.2,
                       torch.randint(steps // 2, steps, (rows,), generator=generator), steps)
    sparse_bytes, sampled = 0, []
    for step in range(steps):
        sizes = torch.exp(torch.randn(rows, generator=generator) * 1.2 + 3.2).long().clamp(1, vocab // 10)
        whole = torch.zeros(rows, dtype=torch.bool)
        if step % 8 == 0:
            whole[0] = True
        counts = torch.where(whole, 0, sizes)
        # ascending ids per row: gaps of 1 .. vocab / size, so the set spans the vocabulary
        offsets = torch.zeros(rows + 1, dtype=torch.long)
        offsets[1:] = counts.cumsum(0)
        total = int(offsets[-1])
        row_of = torch.repeat_interleave(torch.arange(rows), counts, output_size=total)
        gap_max = (vocab // counts.clamp(min=1))[row_of]
        gaps = (torch.rand(total, generator=generator) * gap_max).long() + 1
        ids = gaps.cumsum(0)
        ids -= (ids - gaps)[offsets[:-1].clamp(max=max(total - 1, 0))].repeat_interleave(counts, output_size=total)
        ids -= 1
        values = torch.randn(total, generator=generator) * 2
        within = torch.arange(total) - offsets[:-1].repeat_interleave(counts, output_size=total)
        payload = torch.empty(2 * total, dtype=torch.int32)
        payload[2 * offsets[:-1][row_of] + within] = ids.to(torch.int32)
        payload[2 * offsets[:-1][row_of] + counts[row_of] + within] = values.view(torch.int32)
        marks = torch.where(whole, -1, counts).to(torch.int32)
        whole_rows = [torch.randn(int(whole.sum()), vocab, generator=generator).view(torch.int32).reshape(-1)]
        # the whole rows' words go where their row is: row 0 first
        record = torch.cat([torch.tensor([rows, vocab, 0], dtype=torch.int32), marks,
                            *(whole_rows if bool(whole[0]) else []), payload])
        first = torch.where(whole, 0, ids[offsets[:-1].clamp(max=max(total - 1, 0))])
        tokens = torch.where(finished, 0, first)
        store.drain(step, {"scores": record, "tokens": tokens, "finished": finished.clone()})
        sampled.append(tokens)
        sparse_bytes += record.numel() * 4
        finished = finished | (ends == step)
    sequences = torch.cat([torch.full((rows, 4), 2, dtype=torch.long), torch.stack(sampled, 1)], 1)
    store.finish(steps, replace(header, num_rows=rows), sequences, None, ring_waits=0)
    spill.close()
    return sparse_bytes


def measure(root: Path, what: str, repeats: int) -> dict:
    """`what`'s median seconds over `repeats` calls (after one untimed) and the process's peak resident set."""
    import resource

    import torch
    from _common import ResidentPeaks, resident_bytes

    from transformers_offload import kept_sets, open_recording, sampler_logprobs

    recording = open_recording(root)
    kept = kept_sets(recording) if what == "select" else None
    rows = torch.randperm(kept.rows, generator=torch.Generator().manual_seed(0))[: kept.rows // 4] if kept else None
    run = {"kept_sets": lambda: kept_sets(recording), "sampler_logprobs": lambda: sampler_logprobs(recording, raw=False),
           "select": lambda: kept.select(rows)}[what]
    anonymous_before = resident_bytes()[0]
    peaks = ResidentPeaks()
    result = run()
    anonymous_peak = peaks.stop()[0] - anonymous_before
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    times.sort()
    digest = None
    if what == "kept_sets":
        digest = {"nnz": int(result.ids.numel()), "ids_sum": int(result.ids.long().sum()),
                  "offsets_sum": int(result.offsets.sum()), "full": int(result.full.sum()), "valid": int(result.valid.sum())}
    elif what == "sampler_logprobs":
        digest = {"sampled_bits_sum": int(result["sampled"].view(torch.int32).long().sum())}
    elif what == "select":
        digest = {"nnz": int(result.ids.numel()), "ids_sum": int(result.ids.long().sum())}
    return {"seconds": times[len(times) // 2], "all_seconds": times, "anonymous_peak_mib": anonymous_peak / 2**20,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "digest": digest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--code", type=Path, default=HERE.parent, help="the checkout whose package is timed")
    parser.add_argument("--label", default="")
    parser.add_argument("--only", nargs="*", default=["kept_sets", "sampler_logprobs", "select"])
    parser.add_argument("--recording", type=Path, help="reuse a recording this script wrote")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--child", nargs=2, metavar=("ROOT", "WHAT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, str(args.code))
        sys.path.insert(0, str(HERE))
        print(json.dumps(measure(Path(args.child[0]), args.child[1], args.repeats)))
        return
    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE))
    from _common import machine, print_table, write_json

    with tempfile.TemporaryDirectory() as scratch:
        root = args.recording or Path(scratch) / "rollouts"
        started = time.perf_counter()
        if args.recording is None or not (root / "manifest.json").exists():
            sparse_bytes = write_recording(root, args.rows, args.steps, args.vocab)
            (root.parent / f"{root.name}.sparse_bytes").write_text(str(sparse_bytes))
        sparse_bytes = int((root.parent / f"{root.name}.sparse_bytes").read_text())
        print(f"recording: {args.rows} rows x {args.steps} steps, vocab {args.vocab}, {sparse_bytes / 2**20:.0f} MiB "
              f"sparse ({time.perf_counter() - started:.0f} s to write)", flush=True)
        found = {}
        for what in args.only:
            child = subprocess.run([sys.executable, __file__, "--child", str(root), what, "--repeats", str(args.repeats),
                                    "--code", str(args.code)], capture_output=True, text=True)
            if child.returncode:
                raise SystemExit(f"{what} failed:\n{child.stderr[-3000:]}")
            found[what] = json.loads(child.stdout.strip().splitlines()[-1])
            found[what]["us_per_row_step"] = found[what]["seconds"] / (args.rows * args.steps) * 1e6
            print(what, json.dumps(found[what]), flush=True)
    rows = [[what, f"{value['seconds']:.2f}", f"{value['us_per_row_step']:.3f}", f"{value['anonymous_peak_mib']:.0f}",
             f"{value['anonymous_peak_mib'] * 2**20 / sparse_bytes:.2f}", f"{value['peak_rss_mib']:.0f}"]
            for what, value in found.items()]
    print_table(["function", "seconds (median)", "us per row-step", "anonymous peak MiB (the call)",
                 "that / sparse bytes", "peak RSS MiB (with the mapped shards)"], rows)
    label = f"-{args.label}" if args.label else ""
    write_json(args.out / f"rollout_host{label}.json",
               {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "sparse_bytes": sparse_bytes,
                "results": found})


if __name__ == "__main__":
    main()
