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
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import torch  # noqa: E402
from _common import RESULTS, interleaved, machine, print_table, process_seconds, spread, write_json  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

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
        # Interleaved, no warm-up: a slow moment of the machine falls on both.
        runs = interleaved({"inspect": lambda _: process_seconds(inspect, cwd=ROOT),
                            "import torch": lambda _: process_seconds(torch_only, first_line=False, cwd=ROOT)},
                           arguments.runs, show=True)
    found = {"inspect first line": [run["first_line"] for run in runs["inspect"]],
             "inspect exit": [run["exit"] for run in runs["inspect"]],
             "import torch exit": [run["exit"] for run in runs["import torch"]]}
    summary = {name: spread(values, digits=3) for name, values in found.items()}
    print_table(["what", "median s", "min s", "max s"],
                [[name, s["median"], s["min"], s["max"]] for name, s in summary.items()])
    write_json(arguments.out / "cli_start.json", {
        "machine": machine(), "load_average": os.getloadavg(), "recording_bytes": size,
        "vocab": arguments.vocab, "rows": arguments.rows, "steps": arguments.steps, "runs": arguments.runs,
        "seconds": summary, "samples": {name: [round(s, 4) for s in values] for name, values in found.items()},
    })


if __name__ == "__main__":
    main()
