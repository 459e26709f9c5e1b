"""The reader: latency of one step of one row, and sequential throughput against a plain read of the same files.

    .venv/bin/python bench/reader.py [--dir DIR] [--rows 8] [--vocab 49152] [--steps 256] [--shard-mib 64]
                                     [--samples 200] [--repeats 3] [--out bench/results]

No model: the spill store writes a recording of made-up `(rows, vocab)` float32 logits and scores
(the same as `bench/spill_throughput.py`). Then, in one run:
- latency: `open_recording(dir).logits(steps=slice(t, t + 1), rows=[r])` for random `t`, `r`, copied
  out of the mapping, per call; "cold" drops the shards from the page cache before each call
  (`posix_fadvise(DONTNEED)`), "warm" reads what earlier calls left cached. The recording is opened
  once (opening is timed on its own).
- sequential: every step of `logits` and `scores` copied into one preallocated buffer, against
  `readinto` of every shard file into the same kind of buffer; both cold, interleaved, median of
  `--repeats`.
Prints the tables and writes `reader.json` and `reader.png` under `--out`.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import torch  # noqa: E402
from _common import (  # noqa: E402
    RESULTS,
    interleaved,
    machine,
    median,
    percentile,
    plot_bars,
    print_table,
    stopwatch,
    timed,
    write_json,
)
from spill_throughput import add_recording_arguments, made_up_steps, spill  # noqa: E402

from transformers_offload import open_recording  # noqa: E402


def drop_cache(root: Path) -> None:
    """Ask the kernel to drop `root`'s files from the page cache (they are clean: written and fsynced)."""
    for path in root.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def latencies(root: Path, samples: int, *, cold: bool, seed: int) -> list[float]:
    """Seconds of `samples` reads of one step of one row, at random, each its own round (no warm-up)."""
    recording = open_recording(root)
    generation = recording.generation(0)
    rng = random.Random(seed)

    def one(_: int) -> float:
        step, row = rng.randrange(generation.num_steps), rng.randrange(generation.num_rows)
        if cold:
            drop_cache(root)
        with stopwatch() as clock:
            value = generation.logits(steps=slice(step, step + 1), rows=[row])[0].clone()
        del value  # freed outside the clock
        return clock.seconds

    seconds = interleaved({"read": one}, samples)["read"]
    recording.close()
    return seconds


def read_recording(root: Path, buffer: torch.Tensor) -> float:
    drop_cache(root)
    with stopwatch() as clock:
        recording = open_recording(root)
        generation = recording.generation(0)
        for name in ("logits", "scores"):
            for step in getattr(generation, name)():
                buffer.copy_(step)
        recording.close()
    return clock.seconds


def read_plain(root: Path, buffer: bytearray) -> float:
    drop_cache(root)
    view = memoryview(buffer)
    with stopwatch() as clock:
        for path in sorted(root.glob("*-s*.safetensors")):
            with open(path, "rb", buffering=0) as file:
                while file.readinto(view):
                    pass
    return clock.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_recording_arguments(parser)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    base = args.dir or Path(tempfile.mkdtemp(prefix="reader-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    root = base / "recording"
    try:
        written = spill(root, made_up_steps(args.rows, args.vocab, args.steps), int(args.shard_mib * 2**20))
        open_seconds = timed(lambda: open_recording(root).close())
        cold = latencies(root, args.samples, cold=True, seed=1)
        warm = latencies(root, args.samples, cold=False, seed=2)

        shard_bytes = sum(p.stat().st_size for p in root.glob("*-s*.safetensors"))
        stream_bytes = 2 * args.steps * args.rows * args.vocab * 4  # logits and scores, float32
        step_buffer = torch.empty(args.rows, args.vocab)
        file_buffer = bytearray(8 * 2**20)
        found = interleaved({"reader": lambda _: read_recording(root, step_buffer),
                             "plain": lambda _: read_plain(root, file_buffer)}, args.repeats)
        reader_s, plain_s = found["reader"], found["plain"]
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
        else:
            shutil.rmtree(root, ignore_errors=True)

    def ms(values: list[float], q: int) -> float:
        return percentile(values, q) * 1e3

    print(f"{written['bytes'] / 1e6:.0f} MB in {written['shards']} shards; {args.steps} steps x {args.rows} rows x "
          f"{args.vocab}; one read = one row of one step ({args.vocab * 4} bytes)")
    print_table(
        ["one step of one row", "median (ms)", "p90 (ms)", "p99 (ms)"],
        [["cold (page cache dropped)", ms(cold, 50), ms(cold, 90), ms(cold, 99)],
         ["warm", ms(warm, 50), ms(warm, 90), ms(warm, 99)],
         ["open_recording (once)", open_seconds * 1e3, "-", "-"]],
    )
    reader_rate = stream_bytes / 1e6 / median(reader_s)
    plain_rate = shard_bytes / 1e6 / median(plain_s)
    print()
    print_table(
        ["sequential, cold", "MB/s", "x plain read"],
        [["plain readinto of the shard files (baseline)", plain_rate, 1.0],
         ["reader: every step of logits and scores", reader_rate, reader_rate / plain_rate]],
    )
    record = {
        "machine": machine(), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "recording": {"bytes": written["bytes"], "shards": written["shards"], "stream_bytes": stream_bytes},
        "open_seconds": open_seconds,
        "latency_ms": {"cold": [s * 1e3 for s in cold], "warm": [s * 1e3 for s in warm]},
        "sequential_mb_per_s": {"plain": plain_rate, "reader": reader_rate, "ratio": reader_rate / plain_rate},
        "sequential_seconds": {"plain": plain_s, "reader": reader_s},
    }
    write_json(args.out / "reader.json", record)
    plot_bars(
        args.out / "reader.png",
        {"one step of one row, median (ms)": {"cold": ms(cold, 50), "warm": ms(warm, 50)},
         "sequential, cold (MB/s)": {"plain read": plain_rate, "reader": reader_rate}},
        title="reader",
    )


if __name__ == "__main__":
    main()
