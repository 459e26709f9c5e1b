"""The command line's start: seconds until `inspect` prints its first line on a ~1 GB recording, in fresh
processes, beside what importing torch alone costs (what every command paid before it started without it).

    .venv/bin/python bench/cli_start.py [--dir DIR] [--vocab 131072] [--rows 8] [--steps 125] [--runs 5]
                                        [--out bench/results]

A tiny GPT-2 from a config (2 layers, 32 wide) with a large vocabulary records `--steps` steps of `--rows`
rows, logits and scores (float32, spilled): `2 x rows x vocab x 4` bytes per step, 1.0 GiB with the
defaults. Then, interleaved, `--runs` times each in a fresh process (`HF_HUB_OFFLINE=1`):
- `inspect`: `python -m transformers_offload inspect DIR`, wall seconds from the start of the process to its
  first line on stdout, and to its exit;
- `import torch`: `python -c "import torch"`, wall seconds to its exit (the floor of a command that imports it).
Prints the table and writes `cli_start.json` under `--out`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from _common import RESULTS, default_env, machine, print_table, spread, write_json  # noqa: E402
from transformers_offload import Recorder, open_recording  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def make_recording(directory: Path, *, vocab: int, rows: int, steps: int) -> int:
    """Record `steps` steps of `rows` rows of a tiny model with a `vocab`-token head; returns the bytes on disk."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=vocab, n_positions=steps + 8,
                                       bos_token_id=1, eos_token_id=1)).eval()
    prompts = torch.randint(2, vocab, (rows, 4))
    with Recorder(model, spill_dir=directory) as rec:
        # temperature and no top-k: the scores differ from the logits and stay dense, so both are stored whole
        model.generate(prompts, attention_mask=torch.ones_like(prompts), logits_processor=[rec], do_sample=True,
                       temperature=0.7, top_k=0, max_new_tokens=steps, min_new_tokens=steps, pad_token_id=0)
    with open_recording(directory) as recording:
        return sum(generation["file_bytes"] for generation in recording.describe()["generations"])


def first_line_seconds(command: list[str]) -> tuple[float, float]:
    """Wall seconds from starting `command` to its first line on stdout, and to its exit."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                               env=default_env(HF_HUB_OFFLINE="1"))
    line = process.stdout.readline()
    first = time.perf_counter() - started
    rest, errors = process.communicate(timeout=600)
    total = time.perf_counter() - started
    if process.returncode != 0 or not line:
        raise SystemExit(f"{command} failed ({process.returncode}):\n{errors[-3000:]}")
    return first, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", help="where to write the recording (default: a temporary directory, removed)")
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--steps", type=int, default=125)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    arguments = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(arguments.dir or scratch) / "run"
        size = make_recording(directory, vocab=arguments.vocab, rows=arguments.rows, steps=arguments.steps)
        print(f"recording: {size / 2**30:.2f} GiB in {directory}", flush=True)
        inspect = [sys.executable, "-m", "transformers_offload", "inspect", str(directory)]
        torch_only = [sys.executable, "-c", "import torch"]
        found: dict[str, list[float]] = {"inspect first line": [], "inspect exit": [], "import torch exit": []}
        for run in range(arguments.runs):  # interleaved: a slow moment of the machine falls on both
            first, total = first_line_seconds(inspect)
            found["inspect first line"].append(first)
            found["inspect exit"].append(total)
            started = time.perf_counter()
            subprocess.run(torch_only, check=True, cwd=ROOT, env=default_env(HF_HUB_OFFLINE="1"))
            found["import torch exit"].append(time.perf_counter() - started)
            print(f"run {run + 1}/{arguments.runs}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in found.items()),
                  flush=True)
    summary = {name: {key: round(value / 1000, 3) for key, value in spread([s * 1000 for s in values]).items()}
               for name, values in found.items()}
    print_table(["what", "median s", "min s", "max s"],
                [[name, s["median"], s["min"], s["max"]] for name, s in summary.items()])
    write_json(arguments.out / "cli_start.json", {
        "machine": machine(), "load_average": os.getloadavg(), "recording_bytes": size,
        "vocab": arguments.vocab, "rows": arguments.rows, "steps": arguments.steps, "runs": arguments.runs,
        "seconds": summary, "samples": {name: [round(s, 4) for s in values] for name, values in found.items()},
    })


if __name__ == "__main__":
    main()
