"""The cross-release table (docs/support.md): the real model recorded on the newest transformers release
and rescored under every release of the version matrix, compared token by token.

    .venv/bin/python scripts/cross_release.py            # every release installed under .matrix/
    .venv/bin/python scripts/cross_release.py 4.44.2     # some of them
    .venv/bin/python scripts/cross_release.py --no-write # print the table only

Records SmolLM2-135M-Instruct (the demo model, float32, CPU, one thread) on `--prompts` chat prompts,
greedy search, `--new-tokens` tokens each, with this interpreter's release (the newest: scripts/setup.sh's),
then rescores that recording in decode mode (`python -m transformers_offload rescore`) in each release's
environment (`.matrix/transformers-X`, as scripts/matrix.sh installs them, put first on PYTHONPATH), and
compares the two (`transformers_offload.compare`): KL(recorded || rescored) in nats per token, mean and
maximum, and how often the top-1 token agrees. The newest release's own row is the control (0 where the
replay is exact). Writes the table between the `cross-release-table` markers of docs/support.md.

A model directory that 5.x writes keeps RoPE's base in `rope_parameters`, which releases before 5.0 do
not read (they would take the default, 10,000, instead of SmolLM2's 100,000): the older releases get
a copy of the directory whose config also carries `rope_theta`.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MATRIX = ROOT / ".matrix"
SUPPORT = ROOT / "docs" / "support.md"
START, END = "<!-- cross-release-table:start -->", "<!-- cross-release-table:end -->"
PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain what a KV cache is.",
    "Give three tips for writing clear code.", "What is 17 times 23?", "Summarise the plot of Hamlet in two sentences.",
    "Translate 'good morning' into Spanish.", "Why is the sky blue?",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("releases", nargs="*", help="releases to rescore under (default: every one installed)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--no-write", action="store_true", help="print the table, leave docs/support.md alone")
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    import transformers

    from transformers_offload import compare, demo_model
    from transformers_offload.jobs.record import record

    torch.set_num_threads(1)
    releases = args.releases or _installed()
    model, tokenizer = demo_model.load()
    work = Path(tempfile.mkdtemp(prefix="cross-release-"))
    try:
        legacy = _legacy_copy(demo_model.model_dir(), work / "model-legacy")
        reference = work / "recorded"
        prompts = [{"id": f"p{n}", "messages": [{"role": "user", "content": text}]}
                   for n, text in enumerate((PROMPTS * args.prompts)[: args.prompts])]
        record(model, tokenizer, prompts, reference, batch_size=4, max_new_tokens=args.new_tokens, do_sample=False,
               progress=False, recorder_options={"streams": ("logits",)})
        rows = [_row(transformers.__version__, reference, _rescore(reference, demo_model.model_dir(), work / "newest",
                                                                   None), compare)]
        for release in releases:
            environment = MATRIX / f"transformers-{release}"
            if not (environment / ".installed").is_file():
                print(f"cross-release: {release} is not installed in {environment} (scripts/matrix.sh {release} "
                      "installs it); skipped", file=sys.stderr)
                continue
            model_dir = legacy if int(release.split(".")[0]) < 5 else demo_model.model_dir()
            rows.append(_row(release, reference, _rescore(reference, model_dir, work / release, environment), compare))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = _table(rows, args)
    print(table)
    if not args.no_write:
        text = SUPPORT.read_text()
        before, rest = text.split(START, 1)
        _, after = rest.split(END, 1)
        SUPPORT.write_text(before + START + "\n" + table + "\n" + END + after)
        print(f"wrote {SUPPORT}")
    return 0


def _installed() -> list[str]:
    listed = [line.split()[0] for line in (ROOT / "scripts" / "matrix-releases.txt").read_text().splitlines()
              if line.strip() and not line.lstrip().startswith("#")]
    return [release for release in listed if (MATRIX / f"transformers-{release}" / ".installed").is_file()]


def _legacy_copy(source: Path, target: Path) -> Path:
    target.mkdir(parents=True)
    for path in source.iterdir():
        if path.name != "config.json":
            (target / path.name).symlink_to(path.resolve())
    config = json.loads((source / "config.json").read_text())
    for key, value in (config.get("rope_parameters") or {}).items():
        if key == "rope_theta":
            config.setdefault("rope_theta", value)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def _rescore(reference: Path, model_dir: Path, out: Path, environment: Path | None) -> Path | str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if environment is not None:
        env["PYTHONPATH"] = str(environment)
    done = subprocess.run([sys.executable, "-W", "ignore", "-m", "transformers_offload", "rescore", str(reference),
                           "--model", str(model_dir), "--out", str(out), "--no-progress", "--json",
                           "--device", "cpu"], env=env, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        return done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
    return out


def _row(release: str, reference: Path, rescored: Path | str, compare) -> dict:
    if isinstance(rescored, str):
        return {"release": release, "error": rescored}
    summary = compare(reference, rescored).summary()
    return {"release": release, "kl_mean": summary["kl_ab"]["mean"], "kl_max": summary["kl_ab"]["max"],
            "same_top1": summary["same_top1_percent"]["value"], "tokens": summary["tokens"]}


def _table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"SmolLM2-135M-Instruct (float32, CPU, one thread), {args.prompts} chat prompts x {args.new_tokens} tokens, "
        f"greedy, recorded on {rows[0]['release']} and rescored (decode mode) under each release "
        "(`scripts/cross_release.py`); KL(recorded || rescored) in nats per token.",
        "",
        "| release | tokens | KL mean | KL max | same top-1 |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['release']} | — | — | — | failed: {row['error'][:80]} |")
        else:
            lines.append(f"| {row['release']} | {row['tokens']} | {row['kl_mean']:.3g} | {row['kl_max']:.3g} | "
                         f"{row['same_top1']:.2f} % |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
