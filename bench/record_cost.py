"""What `record` costs over a plain loop of generate() on the same prompts, single process, CPU.

    .venv/bin/python bench/record_cost.py [--prompts 24] [--batch-size 8] [--new-tokens 32] [--repeats 3]
                                          [--ranks 2]

SmolLM2-135M-Instruct (CPU, float32), `--prompts` chat prompts (from bench/export.py), sampled
(temperature 0.7, top_p 0.9) with `min_new_tokens` = `max_new_tokens`, in batches of `--batch-size`.
Three cases, interleaved, `--repeats` times, each the wall time of the whole run (median reported):

- stock: a plain loop of generate() over the batches, no recorder;
- loop + Recorder: the same loop with `Recorder(model, spill_dir=...)` (what `record` does per batch);
- record: `transformers_offload.jobs.record.record(...)` on a JSON Lines file of the same prompts (reading
  the file, batching, tokenizing, `set_samples`, the progress bar off).

Reports prompts/s and tokens/s of each and `record`'s time over each loop (target: <= 1.05x the loop
that records the same thing); writes `record_cost.json` under `--out`.

With `--ranks N` it relaunches itself under `torchrun --nproc_per_node N` (gloo, the machine's cores
shared out as torch threads): each rank runs every case over its own share of the prompts
(`parallel.share`; `record` finds its rank itself and writes `rank-R`), the ranks start each case
together (a barrier), and a case's time is the slowest rank's. Writes `record_cost_ranksN.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _common import RESULTS, interleaved, machine, print_table, summarize, timed, timing_columns, write_json  # noqa: E402
from export import PROMPTS  # noqa: E402

from transformers_offload import Recorder  # noqa: E402
from transformers_offload.demo_model import load  # noqa: E402
from transformers_offload.jobs.record import record  # noqa: E402
from transformers_offload.parallel import share  # noqa: E402

SAMPLING = dict(do_sample=True, temperature=0.7, top_p=0.9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--ranks", type=int, default=1, help="data-parallel processes (torchrun, gloo)")
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)  # set for the ranks by the launcher
    args = parser.parse_args()
    if args.ranks > 1 and "RANK" not in os.environ:
        return launch(args)
    rank, world_size = 0, 1
    if args.ranks > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, world_size = dist.get_rank(), dist.get_world_size()
    model, tokenizer = load()
    prompts = (PROMPTS * (1 + args.prompts // len(PROMPTS)))[: args.prompts]
    all_chats = [[{"role": "user", "content": p}] for p in prompts]
    chats = [all_chats[i] for i in share(len(all_chats), rank, world_size)]
    generate = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, **SAMPLING)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-record-"))
    source = work / "prompts.jsonl"
    if rank == 0:
        source.write_text("".join(json.dumps({"id": f"p{i}", "messages": chat}) + "\n" for i, chat in enumerate(all_chats)))

    def loop(recorded: bool, out: Path) -> None:
        rec = Recorder(model, spill_dir=out / f"rank-{rank}") if recorded else None
        for first in range(0, len(chats), args.batch_size):
            texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
                     for c in chats[first:first + args.batch_size]]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            torch.manual_seed(first)
            model.generate(**enc, logits_processor=[rec] if rec else None, pad_token_id=tokenizer.pad_token_id, **generate)
        if rec is not None:
            rec.close()

    cases = {
        "stock loop": lambda out: loop(False, out),
        "loop + Recorder": lambda out: loop(True, out),
        "record": lambda out: record(model, tokenizer, source, out, batch_size=args.batch_size, progress=False, **generate),
    }
    def case(name: str, run):
        def timed_case(repeat: int) -> float:
            out = work / f"{name.replace(' ', '-')}-{repeat}"
            barrier(world_size)
            seconds = slowest(timed(lambda: run(out)), world_size)
            barrier(world_size)
            if rank == 0:
                shutil.rmtree(out, ignore_errors=True)
            return seconds
        return timed_case

    try:  # no warm-up call: the first round's first case is its own (as before the harness)
        times = interleaved({name: case(name, run) for name, run in cases.items()}, args.repeats)
    finally:
        if rank == 0 and args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    if rank != 0:
        return
    summary = summarize(times, "record")
    medians = {name: entry["median_exact"] for name, entry in summary.items()}
    tokens = args.prompts * args.new_tokens
    # "record over it": record's median over this case's (the stock loop is not the base here).
    rows = [[name, *timing_columns({k: v for k, v in summary[name].items() if k != "over_base"}),
             f"{args.prompts / medians[name]:.2f}", f"{tokens / medians[name]:.1f}",
             f"{medians['record'] / medians[name]:.3f}x"] for name in cases]
    print_table(["case", "median s", "min..max s", "prompts/s", "tokens/s", "record over it"], rows)
    name = "record_cost.json" if world_size == 1 else f"record_cost_ranks{world_size}.json"
    write_json(args.out / name, {"machine": machine(), "args": vars(args) | {"out": str(args.out), "work": None},
                                 "ranks": world_size, "threads_per_rank": torch.get_num_threads(),
                                 "times": times, "medians": medians, "summary": summary})


def barrier(world_size: int) -> None:
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()


def slowest(seconds: float, world_size: int) -> float:
    """The slowest rank's time for a case (every rank's, through an all-reduce)."""
    if world_size == 1:
        return seconds
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value[0])


def launch(args: argparse.Namespace) -> None:
    """Run this script under torchrun with `--ranks` processes, the cores shared out between them."""
    work = Path(tempfile.mkdtemp(prefix="bench-record-ranks-"))
    threads = max(1, (os.cpu_count() or 1) // args.ranks)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.ranks),
               __file__, "--prompts", str(args.prompts), "--batch-size", str(args.batch_size), "--new-tokens",
               str(args.new_tokens), "--repeats", str(args.repeats), "--out", str(args.out), "--ranks", str(args.ranks),
               "--work", str(work)]
    try:
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
