"""How much did quantizing change the model? Score a text corpus with SmolLM2-135M-Instruct in float32 (the
reference), in bfloat16 and with torchao's int8 weight-only quantization (candidates), as llama.cpp's
perplexity tool scores it, and compare each with the reference: KL divergence, both perplexities,
same top token, as `llama-perplexity --kl-divergence` prints them. A second, small reference keeps only
each position's top-K logits and N tokens drawn from the rest (`topk:K+tail:N`): its KL is an estimate,
printed beside the full one, with its bytes per token against llama.cpp's 16-bit reference file.

    python examples/quantization_kl.py [--text FILE] [--context 512] [--windows 8] [--topk 32] [--tail 48] [--out DIR]

The corpus defaults to Python's own help texts (`pydoc_data.topics`, which ships with CPython); pass a
file (wikitext-2's `wiki.test.raw`, as llama.cpp users do) with `--text`. Runs on CPU (the `demo` extra
for the model; the `quantization` extra, torchao, for the int8 candidate, skipped without it).
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
from pathlib import Path

import torch

from transformers_offload import compare, open_recording, score
from transformers_offload.answers.comparison import candidates_table
from transformers_offload.demo_model import load, model_dir


def corpus(path: str | None) -> str:
    if path is not None:
        return Path(path).read_text(encoding="utf-8")
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def recorded_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*-s*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", help="a UTF-8 text file (default: Python's help texts)")
    parser.add_argument("--context", type=int, default=512, help="tokens per window (llama.cpp's -c)")
    parser.add_argument("--windows", type=int, default=8, help="windows scored (llama.cpp's --chunks)")
    parser.add_argument("--topk", type=int, default=32, help="K of the small reference: the largest logits kept")
    parser.add_argument("--tail", type=int, default=48, help="N of the small reference: tokens drawn from the rest")
    parser.add_argument("--out", help="keep the recordings in this new directory (default: a temporary one)")
    args = parser.parse_args()
    text = corpus(args.text)
    model, tokenizer = load()
    options = dict(tokenizer=tokenizer, context=args.context, max_windows=args.windows, progress=True)
    with tempfile.TemporaryDirectory() as temporary:
        out = Path(args.out or temporary)
        reference = score(model, text, out / "float32", **options)
        small_encoding = f"topk:{args.topk}+tail:{args.tail}"
        small_dir = out / f"float32-topk{args.topk}-tail{args.tail}"
        small = score(model, text, small_dir, encodings={"logits": small_encoding}, **options)
        candidates = {"bfloat16": lambda: load()[0].to(torch.bfloat16)}
        if importlib.util.find_spec("torchao") is not None:
            from transformers import AutoModelForCausalLM

            from transformers_offload.rescoring.quantization import quantization_config

            candidates["torchao int8 weight-only"] = lambda: AutoModelForCausalLM.from_pretrained(
                model_dir(), local_files_only=True, device_map="cpu",
                quantization_config=quantization_config("torchao:int8-weight-only"))
        else:
            print("torchao is not installed: the int8 candidate is left out (pip install 'transformers-offload[quantization]')")
        summaries, estimates = [], []
        for name, build in candidates.items():
            candidate = score(build().eval(), text, out / name.replace(" ", "-"), **options)
            comparison = compare(reference, candidate)
            print(f"\n=== {name} against float32 ===\n{comparison.summary_text()}")
            summaries.append({"candidate": name, **comparison.summary()})
            estimate = compare(small, candidate).summary()["kl_ab"]["mean"]
            estimates.append((name, summaries[-1]["kl_ab"]["mean"], estimate))
        print("\n" + candidates_table(summaries))
        tokens = summaries[0]["tokens"]
        vocab = int(open_recording(out / "float32").generation(0).logits(steps=range(1))[0].shape[-1])
        llama_cpp = 2 * (vocab + 4)  # uint16 log-probabilities a token, and 4 uint16 of scale and minimum
        small_bytes = recorded_bytes(small_dir) / tokens
        print(f"\nreference bytes per token: dense float32 {recorded_bytes(out / 'float32') / tokens:,.0f}, "
              f"{small_encoding} {small_bytes:,.0f}, llama.cpp's 16-bit file {llama_cpp:,} "
              f"({llama_cpp / small_bytes:,.0f}x the small reference's)")
        for name, full, estimate in estimates:
            print(f"mean KL, {name}: {full:.6f} from the full reference, {estimate:.6f} estimated from {small_encoding} "
                  f"({(estimate - full) / full * 100:+.2f}%)")


if __name__ == "__main__":
    main()
