"""The commands that read a recording: `inspect`, `verify`, `export`, `view`, `plot`. They start without torch
and transformers: `inspect` and `verify` never need them; `export`, `view` and `plot` read with NumPy, importing
torch only where the recording needs it and transformers only for `--tokenizer`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..errors import RecordingError
from . import options
from .summary import format_summary

JSON_INDENT = 2
_FAILED = (((ValueError, TypeError, LookupError, ImportError, OSError), 1),)
ERRORS = dict.fromkeys(("inspect", "verify", "export", "view", "plot"), _FAILED)  # exception types -> exit status


def add(commands: Any) -> None:
    recording = options.parent("path", "json")
    chosen = options.parent("generations")
    tokens = options.parent("tokenizer")
    inspect = commands.add_parser(
        "inspect", parents=[recording],
        help="summarise a recording: generations, steps, rows, streams, sizes, versions",
    )
    inspect.add_argument("--verbose", action="store_true",
                         help="every generation setting the recording holds, not only those that choose tokens")
    commands.add_parser(
        "verify", parents=[recording],
        help="read every byte of a recording and check each file against its checksum",
        description="Read every file of a recording (every rank's, for a data-parallel run) and check its "
        "size, CRC-32C and header against the manifest; every damaged or missing file is listed with what is "
        "wrong (--json: under `damaged`). Exit status: 0 when every file is intact; 1 when a file is damaged "
        "or missing, when the manifest itself is, or when the recording carries no checksums.",
    )
    export = commands.add_parser(
        "export", parents=[recording, chosen, tokens],
        help="write the per-token table (one row per generated token) to a Parquet, CSV or JSON Lines file",
        description="Write one row per generated token of each returned sequence: generation, sample, "
        "prompt, sequence, step, token, logprob/rank/entropy under the raw logits and the processed scores "
        "(and the top alternatives with --top), a chunk of steps at a time. A .parquet file loads with pandas.read_parquet "
        "or datasets.Dataset.from_parquet.",
    )
    export.add_argument("out", help="the file to write, its format by its extension: .parquet, .csv (not with --top "
                        "or --kd: their columns hold lists) or .jsonl (replaced whole, or left untouched on error)")
    export.add_argument("--top", type=int, default=None, help="alternatives per token (0)")
    export.add_argument("--chunk-steps", type=int, default=16, help="steps read at once (16)")
    export.add_argument("--prompt", action="store_true",
                        help="write the prompt-token table instead: each prompt token's logprob and rank "
                        "(recorded with prompt_logprobs / record --prompt-logprobs)")
    export.add_argument("--kd", action="store_true",
                        help="write the distillation table instead: per token its context's ids, the teacher's top "
                        "ids and logprobs (--top K, default 20 or the recorded K) and the tail's log-mass "
                        "(docs/distill.md); with --prompt, from the prompt logprobs (recorded with K)")
    view = commands.add_parser(
        "view", parents=[recording, chosen, tokens],
        help="write one self-contained HTML page of the returned sequences (no network needed)",
        description="Tokens coloured by logprob or rank, their alternatives under the raw logits and the "
        "processed scores on a click, a line of logprob and entropy per step, and a beam search's tree.",
    )
    view.add_argument("-o", "--output", required=True, help="the HTML file to write")
    view.add_argument("--top", type=int, default=None, help="alternatives per token (5)")
    view.add_argument("--max-sequences", type=int, default=16, help="sequences shown per generation (16)")
    view.add_argument("--max-steps", type=int, default=512, help="steps shown per sequence (512)")
    plot = commands.add_parser(
        "plot", parents=[recording, chosen],
        help="draw PNG plots: logprob and entropy per step, and an attention map (needs matplotlib)",
    )
    plot.add_argument("-o", "--output", required=True, help="the directory to write the PNG files into")
    plot.add_argument("--layer", type=int, default=-1, help="the attention layer to draw (-1: the last)")
    plot.add_argument("--head", type=int, default=0, help="the attention head to draw (default 0)")
    plot.add_argument("--sequence", type=int, default=0,
                      help="the row of out.sequences whose attention map is drawn (0)")


def run(arguments: argparse.Namespace, command_line: str) -> tuple[Any, str]:
    """Open the recording and answer the command: (the JSON result, the text for people)."""
    from ..read.reader import open_recording

    recording = open_recording(arguments.path)
    if arguments.command == "verify":
        result = {"path": str(recording.path), "ok": True, **recording.verify()}
        ledger = (f"{result['ledger']} generation(s) each added by one writer" if result["ledger"]
                  else "no ledger to check for two writers (a recording made before it, or one without generations)")
        return result, f"ok: {result['files']} file(s), {options.size(result['bytes'])}, intact; {ledger}; in {result['path']}"
    if arguments.command == "inspect":
        from ..rescoring.corpus_windows import scored_windows

        result = recording.describe()
        for described, generation in zip(result["generations"], recording.generations):
            windows = scored_windows(generation.sample_metadata)
            if windows is not None:  # one of `score`'s batches: its mode and settings are what it was handed as
                described["scored_windows"] = windows
        return result, format_summary(result, verbose=arguments.verbose)
    result = _write(arguments, recording)
    return result, options.human(result)


def damaged(arguments: argparse.Namespace, error: Exception) -> int | None:
    """A damaged or missing recording: with `--json`, the damaged files as JSON on stdout; exit status 1."""
    if not isinstance(error, RecordingError):
        return None
    if arguments.json:
        files = [{"file": str(each.path), "error": each.problem} for each in error.damaged]
        options.emit(json.dumps({"path": arguments.path, "ok": False, "file": str(error.path), "error": str(error),
                                 "damaged": files}, indent=2))
    print(f"error: {error}", file=sys.stderr)
    if (arguments.command in ("export", "view", "plot") and getattr(arguments, "generations", None) is None
            and _a_generations_file(arguments.path, error)):
        print(f"hint: to {arguments.command} the generations that are intact, name them with `--generations` "
              f"(`inspect {arguments.path}` marks each generation's damaged files)", file=sys.stderr)
    return 1


def _a_generations_file(recording: str, error: RecordingError) -> bool:
    """Whether `error` names a file of one generation (a shard, its sequences), not the recording or its
    manifest: then the other generations read, and `--generations` can name them."""
    from pathlib import Path

    damaged = Path(error.path).resolve()
    return damaged.name != "manifest.json" and Path(recording).resolve() in damaged.parents


def _write(arguments: argparse.Namespace, recording: Any) -> dict[str, Any]:
    """Run `export`, `view` or `plot` on an open recording; returns what it wrote."""
    if arguments.command == "export" and arguments.kd:
        from ..answers.kd_table import write_kd_parquet

        result = write_kd_parquet(recording, arguments.out, generations=arguments.generations, top=arguments.top,
                                  prompt=arguments.prompt, chunk_steps=arguments.chunk_steps)
        return {"wrote": arguments.out, **result}
    if arguments.command == "export" and arguments.prompt:
        from ..answers.prompt_table import write_prompt_parquet

        result = write_prompt_parquet(recording, arguments.out, generations=arguments.generations,
                                      tokenizer=options.tokenizer(arguments.tokenizer))
        return {"wrote": arguments.out, **result}
    if arguments.command == "export":
        from ..answers.table import write_parquet

        result = write_parquet(recording, arguments.out, generations=arguments.generations, top=arguments.top or 0,
                               tokenizer=options.tokenizer(arguments.tokenizer), chunk_steps=arguments.chunk_steps)
        return {"wrote": arguments.out, **result}
    if arguments.command == "view":
        from ..answers.viewer import write_html

        result = write_html(recording, arguments.output, generations=arguments.generations,
                            top=5 if arguments.top is None else arguments.top,
                            tokenizer=options.tokenizer(arguments.tokenizer),
                            max_sequences=arguments.max_sequences, max_steps=arguments.max_steps)
        return {"wrote": arguments.output, **result}
    from ..answers.plots import write_plots

    files = write_plots(recording, arguments.output, generations=arguments.generations, layer=arguments.layer,
                        head=arguments.head, sequence=arguments.sequence)
    return {"wrote": ", ".join(str(f) for f in files)}
