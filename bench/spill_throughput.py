"""Spill throughput against a plain sequential write of the same bytes to the same disk, in one run.

    .venv/bin/python bench/spill_throughput.py [--dir DIR] [--rows 8] [--vocab 49152] [--steps 256]
                                               [--shard-mib 64] [--repeats 3] [--out bench/results]

No model: made-up `(rows, vocab)` float32 logits and scores per step go straight into the spill store
(the layer under the recorder), which packs them into shards and writes them on its background
thread (safetensors, fsync, rename, manifest). Two figures for the store:
- end to end: bytes of shards / seconds from the first step handed over to the end of `finish()`;
- writer: bytes of shards / seconds the writer thread spent writing them (`TransferStats`).
The baseline writes the same number of files of the same size with `write()` + `fsync`, one after
another, into the same directory: this disk's own sequential write bandwidth. Two more cases give
the checksums' cost: the store with its checksum replaced by a constant (A/B), and the CRC-32C alone
over the shards just written (read back from the page cache, as the writer does before the fsync).
Median of the repeats, cases interleaved. Writes `spill_throughput.json` and `spill_throughput.png`
under `--out`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import torch  # noqa: E402
from _common import RESULTS, interleaved, machine, median, plot_bars, print_table, stopwatch, write_json  # noqa: E402

from transformers_offload.store import files as _files  # noqa: E402
from transformers_offload.store.header import GenerationHeader  # noqa: E402
from transformers_offload.store.spill import Spill  # noqa: E402


def add_recording_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the made-up recording (shared with bench/reader.py)."""
    parser.add_argument("--dir", type=Path, help="where to write (default: a temporary directory)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--shard-mib", type=float, default=64.0)


def made_up_steps(rows: int, vocab: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """What the ring hands the store per step, with random values: float32 logits and scores."""
    generator = torch.Generator().manual_seed(0)
    return [
        {
            "logits": torch.randn(rows, vocab, generator=generator),
            "scores": torch.randn(rows, vocab, generator=generator),
            "tokens": torch.randint(0, vocab, (rows,), generator=generator),
            "finished": torch.zeros(rows, dtype=torch.bool),
        }
        for _ in range(steps)
    ]


def spill(root: Path, steps: list[dict[str, torch.Tensor]], shard_bytes: int) -> dict[str, float]:
    header = GenerationHeader(index=0, mode="sample", prompt_length=1, num_beams=1, eos_token_id=(),
                              generation_config={}, pad_token_id=0)
    store = Spill(root, shard_bytes=shard_bytes, model_info={}, created_by={}).open_store(
        ["logits", "scores", "tokens", "finished"], header)
    # The call's sequences (a one-token prompt, then the steps' tokens): a complete recording names them.
    rows = steps[0]["tokens"].shape[0]
    sequences = torch.cat([torch.zeros(rows, 1, dtype=torch.long), torch.stack([s["tokens"] for s in steps], dim=1)], dim=1)
    with stopwatch() as clock:
        for step, tensors in enumerate(steps):
            store.drain(step, tensors)
        generation = store.finish(len(steps), replace(header, num_rows=rows), sequences, None, ring_waits=0)
    seconds = clock.seconds
    transfer = generation.transfer  # a StoredGeneration (store/stored.py)
    return {"bytes": transfer.bytes_written, "seconds": seconds, "writer_seconds": transfer.write_seconds,
            "shards": len(list(root.glob("*-s*.safetensors")))}


def spill_without_checksums(root: Path, steps: list[dict[str, torch.Tensor]], shard_bytes: int) -> dict[str, float]:
    real = _files.file_checksum
    _files.file_checksum = lambda file: "crc32c:00000000"  # the A/B case: no checksum
    try:
        return spill(root, steps, shard_bytes)
    finally:
        _files.file_checksum = real


def checksum_only(root: Path) -> dict[str, float]:
    """The checksum of every shard under `root`, from the page cache (just written)."""
    total = 0
    with stopwatch() as clock:
        for path in sorted(root.glob("*-s*.safetensors")):
            with open(path, "rb") as file:
                _files.file_checksum(file)
            total += path.stat().st_size
    return {"bytes": total, "seconds": clock.seconds}


def plain_write(root: Path, total_bytes: int, files: int) -> dict[str, float]:
    root.mkdir()
    size = total_bytes // files
    payload = os.urandom(min(size, 2**20)) * (size // min(size, 2**20) + 1)
    payload = memoryview(payload)[:size]
    with stopwatch() as clock:
        for index in range(files):
            with open(root / f"plain-{index:05d}.bin", "wb") as file:
                file.write(payload)
                file.flush()
                os.fsync(file.fileno())
    return {"bytes": size * files, "seconds": clock.seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_recording_arguments(parser)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    steps = made_up_steps(args.rows, args.vocab, args.steps)
    base = args.dir or Path(tempfile.mkdtemp(prefix="spill-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    shard_bytes = int(args.shard_mib * 2**20)
    total = spill(base / "size", steps, shard_bytes)  # also a warm-up; sizes the plain write
    shutil.rmtree(base / "size")
    cases = {
        "spill": lambda root: spill(root, steps, shard_bytes),
        "plain": lambda root: plain_write(root, total["bytes"], total["shards"]),
        "no_checksums": lambda root: spill_without_checksums(root, steps, shard_bytes),
    }

    def case(name: str):
        def run(repeat: int) -> dict[str, Any]:
            root = base / f"{name}-{repeat}"
            result = cases[name](root)
            if name == "spill":
                result = {**result, "checksum": checksum_only(root)}
            shutil.rmtree(root)
            os.sync()
            return result
        return run

    try:  # the writing cases in a rotated order: a disk's speed drifts with what was written before
        runs = interleaved({name: case(name) for name in cases}, args.repeats, rotate=True)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    runs["checksum"] = [run.pop("checksum") for run in runs["spill"]]

    def rate(results: list[dict[str, float]], key: str = "seconds") -> float:
        return median([r["bytes"] / 1e6 / r[key] for r in results])

    table = {
        "plain write + fsync (baseline)": rate(runs["plain"]),
        "spill, end to end": rate(runs["spill"]),
        "spill, writer thread only": rate(runs["spill"], "writer_seconds"),
        "spill without checksums (A/B), end to end": rate(runs["no_checksums"]),
        "CRC-32C alone (read back from the page cache)": rate(runs["checksum"]),
    }
    baseline = table["plain write + fsync (baseline)"]
    total_mb = runs["spill"][0]["bytes"] / 1e6
    print(f"{total_mb:.0f} MB in {runs['spill'][0]['shards']} shards of {args.shard_mib:g} MiB, "
          f"{args.steps} steps x {args.rows} rows x {args.vocab}, median of {args.repeats}")
    print_table(["case", "MB/s", "x plain write"], [[name, value, value / baseline] for name, value in table.items()])
    write_json(args.out / "spill_throughput.json", {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine(), "mb_per_s": table, "runs": runs,
    })
    plot_bars(args.out / "spill_throughput.png", {"MB/s (median)": table}, title="spill against a plain write + fsync")


if __name__ == "__main__":
    main()
