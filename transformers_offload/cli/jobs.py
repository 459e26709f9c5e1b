"""The commands that run a model over many inputs, resumably and over torchrun ranks: `record` (a prompts
file through `generate()` with a Recorder), `rescore` (a recording's tokens through another model) and
`score` (a text corpus in llama.cpp's windows)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ..errors import RecordingError
from ..rescoring.corpus_windows import SMALLEST_CONTEXT
from . import options

JSON_INDENT = None
_FAILED = (ValueError, TypeError, LookupError, ImportError, OSError, RecordingError)
ERRORS = {"record": ((_FAILED, 1),), "rescore": (((*_FAILED, RuntimeError), 1),),  # exception types -> exit status
          "score": (((*_FAILED, RuntimeError), 1),)}


def add(commands: Any) -> None:
    shared = options.parent("device", "no-progress", "json")
    record = commands.add_parser(
        "record", parents=[shared], help="record every prompt of a file into a recording directory, resumably",
        description="Batches the prompts of a JSON Lines or Parquet file (or a saved dataset) through "
        "generate() with a Recorder, keyed by sample id. Run it again on the same --out to resume: complete "
        "samples are skipped, the rest recorded.",
    )
    record.add_argument("--model", required=True, help=options.MODEL_HELP)
    record.add_argument("--tokenizer", help="a local tokenizer directory or the demo model's name (smollm2) (default: --model)")
    record.add_argument("--prompts", required=True, help="a .jsonl/.parquet file or a saved dataset's directory")
    record.add_argument("--out", required=True, help="the recording directory (created, or resumed)")
    record.add_argument("--batch-size", type=options.at_least(1), default=8, help="prompts per generate() call (8)")
    record.add_argument("--text-column", help="the column of prompt texts (default: text)")
    record.add_argument("--messages-column", help="the column of chats (lists of role/content messages), used where "
                        "there is no text column (default: messages)")
    record.add_argument("--id-column", help="the column of sample ids (default: `id` where there is one, else line numbers)")
    record.add_argument("--chat", action="store_true", help="wrap text prompts in the chat template")
    record.add_argument("--max-new-tokens", type=options.at_least(1), default=64, help="tokens generated per prompt at most (64)")
    record.add_argument("--do-sample", action="store_true", help="sample (default: greedy, or beam search with --num-beams)")
    counts = {"--top-k": options.at_least(0), "--num-beams": options.at_least(1), "--num-return-sequences": options.at_least(1)}
    for name in ("--temperature", "--top-p", "--repetition-penalty", "--top-k", "--num-beams", "--num-return-sequences"):
        record.add_argument(name, type=counts.get(name, float),
                            help=f"generate()'s `{name[2:].replace('-', '_')}` (default: the model's generation config)")
    record.add_argument("--seed", type=int, default=0, help="seed + the batch's first prompt position, per call (0)")
    record.add_argument("--streams", default="logits,scores", help="what to record, e.g. scores,stats (logits,scores)")
    record.add_argument("--encodings", default="", help="e.g. scores=sparse,logits=topk:20")
    record.add_argument("--prompt-logprobs", type=int, nargs="?", const=0, default=None, metavar="K",
                        help="also score each prompt's own tokens (with K: the top-K alternatives too)")
    _resume_option(record)
    rescore = commands.add_parser(
        "rescore", parents=[shared],
        help="replay a recording's tokens through another model, dtype or release; record its logits",
        description="Teacher-forces every generation of a recording through --model and records that model's logits "
        "on the same tokens into --out (see transformers_offload.rescore; docs/rescore.md). Decode mode replays "
        "generate() step by step (the same model gives bit-equal logits); forward mode scores each sequence in "
        "chunked forwards. Run it again on the same --out to resume; under torchrun each rank rescores its share.",
        epilog="example:\n  python -m transformers_offload rescore runs/france --model ./smollm2 --out runs/france-bf16 "
        "--dtype bfloat16\n  python -m transformers_offload compare runs/france runs/france-bf16",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rescore.add_argument("path", help="the recording directory to rescore")
    rescore.add_argument("--model", required=True, help=options.MODEL_HELP)
    rescore.add_argument("--out", required=True, help="the rescored recording's directory (created, or resumed)")
    _loading_options(rescore)
    rescore.add_argument("--mode", choices=("decode", "forward"), default="decode",
                         help="decode: step by step as generate() ran; forward: chunked forwards (decode)")
    rescore.add_argument("--chunk-size", type=options.at_least(1), default=512, help="forward mode: positions per forward (512)")
    rescore.add_argument("--streams", default="logits", help="what to record, e.g. logits,stats (logits)")
    rescore.add_argument("--encodings", default="", help="e.g. logits=topk:20")


    score = commands.add_parser(
        "score", parents=[shared],
        help="score a text corpus as llama.cpp's perplexity tool does; record each scored position's logits",
        description="Cuts the texts into llama.cpp's windows of --context tokens (BOS first and as each window's first "
        "id where the tokenizer adds one, as llama.cpp does; --bos/--no-bos choose), "
        "scores the second half of each window with chunked forwards and records each position's raw logits "
        "(see transformers_offload.score; docs/compare.md, 'a quantization on a corpus'). Score the base and "
        "each candidate into their own --out, then `compare BASE CANDIDATE...`. Run it again on the same --out "
        "to resume; under torchrun each rank scores its share.",
        epilog="example:\n  python -m transformers_offload score --model smollm2 --text wiki.test.raw --out runs/base\n"
        "  python -m transformers_offload score --model smollm2 --dtype bfloat16 --text wiki.test.raw --out runs/bf16\n"
        "  python -m transformers_offload compare runs/base runs/bf16",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    score.add_argument("--model", required=True, help=options.MODEL_HELP)
    score.add_argument("--tokenizer", help="a local tokenizer directory or the demo model's name (default: --model)")
    score.add_argument("--text", nargs="+", help="plain text files, read as UTF-8, their tokens one after another")
    score.add_argument("--dataset", help="a directory saved by datasets.Dataset.save_to_disk, or a .jsonl/.parquet file")
    score.add_argument("--text-column", default="text", help="--dataset's column of texts (text)")
    score.add_argument("--out", required=True, help="the recording directory (created, or resumed)")
    score.add_argument("--context", type=options.at_least(SMALLEST_CONTEXT), default=512,
                       help="tokens per window (512, llama.cpp's -c)")
    score.add_argument("--batch-size", type=options.at_least(1), default=4, help="windows per forward (4)")
    score.add_argument("--chunk-size", type=options.at_least(1), default=512, help="positions per forward (512)")
    score.add_argument("--max-windows", type=options.at_least(1), help="score the first N windows only (llama.cpp's --chunks)")
    bos = score.add_mutually_exclusive_group()
    bos.add_argument("--bos", dest="bos", action="store_true", default=None,
                     help="BOS first and as each window's first id (default: as llama.cpp, where the tokenizer adds BOS)")
    bos.add_argument("--no-bos", dest="bos", action="store_false", default=None,
                     help="no BOS: each window's first id kept (default: as llama.cpp, where the tokenizer adds none)")
    _loading_options(score)
    score.add_argument("--encodings", default="", help="e.g. logits=topk:32+tail:48 (a small reference)")
    _resume_option(score)


def _resume_option(parser: Any) -> None:
    parser.add_argument("--allow-other-settings", action="store_true",
                        help="resume an --out recorded with other settings (refused by default, naming each difference; "
                        "each generation's header keeps its own generation settings)")


def _settings(arguments: argparse.Namespace, names: tuple[str, ...], **more: Any) -> dict[str, Any]:
    """The settings a resume of this job must share with the run that began `--out` (`jobs.settings`)."""
    from .. import demo_model

    model = str(Path(arguments.model).resolve())
    tokenizer = model if arguments.tokenizer is None else str(
        Path(demo_model.resolve(arguments.tokenizer, what="`--tokenizer`")).resolve())
    chosen = {name: getattr(arguments, name) for name in names}
    if "streams" in chosen:  # a set: `scores,logits` records what `logits,scores` does
        chosen["streams"] = sorted(chosen["streams"].split(","))
    return {"model": model, "tokenizer": tokenizer, **chosen, **more}


def _loading_options(parser: Any) -> None:
    """How `_load_candidate` loads `--model`: `--dtype`, `--attn-implementation`, `--quantization`."""
    parser.add_argument("--dtype", help="load the model in this dtype (float32, bfloat16, float16)")
    parser.add_argument("--attn-implementation", help="eager, sdpa, flash_attention_2...")
    parser.add_argument("--quantization", help="quantize on load through transformers' integration: "
                        "torchao:int8-weight-only, torchao:int8-dynamic, quanto:int8, quanto:int4 (CPU, CUDA), "
                        "bitsandbytes:8bit, bitsandbytes:4bit, fp8 (CUDA); a checkpoint saved quantized "
                        "(GPTQ, AWQ, compressed-tensors...) needs none: pass its directory as --model")


def run(arguments: argparse.Namespace, command_line: str) -> tuple[Any, str]:
    """Run `record`, `rescore` or `score` to the end: (the JSON result, the text for people)."""
    jobs = {"record": _record, "rescore": _rescore, "score": _score}
    result = jobs[arguments.command](arguments)
    return result, options.human(result)


def interrupted(arguments: argparse.Namespace, command_line: str) -> str:
    """What Ctrl-C leaves, and the command that resumes it."""
    kept = "batch" if arguments.command in ("record", "score") else "generation"
    verb = arguments.command
    message = (f"interrupted: every complete {kept} is kept in {arguments.out!r}; to {verb} the rest, run:\n"
               f"  {command_line}")
    if arguments.command == "record" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        message += ("\n  (that is this rank's command: it resumes every rank's share in one process; or launch "
                    "the same torchrun / accelerate launch command again, with any number of processes)")
    return message


def _record(arguments: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from ..jobs.record import check_generate_options, read_prompts, record, refuse_generations_without_ids

    encodings = options.encodings(arguments.encodings)
    # The prompts, the decoding options and the tokenizer are checked before the model loads (which takes the
    # longest) and before `--out` is written to.
    read_prompts(arguments.prompts, text_column=arguments.text_column, messages_column=arguments.messages_column,
                 id_column=arguments.id_column)
    settings = {name: getattr(arguments, name) for name in ("temperature", "top_p", "repetition_penalty", "top_k",
                                                              "num_beams", "num_return_sequences")
                if getattr(arguments, name) is not None}
    generate_options = {"max_new_tokens": arguments.max_new_tokens, "do_sample": arguments.do_sample, **settings}
    try:
        check_generate_options(generate_options, spelled=lambda name: f"`--{name.replace('_', '-')}`")
    except ValueError as error:
        raise options.UsageError(str(error)) from None
    arguments.model = options.model_directory(arguments.model)
    tokenizer = options.job_tokenizer(arguments.tokenizer, arguments.model)
    from ..jobs import settings as job_settings

    refuse_generations_without_ids(Path(arguments.out))
    job_settings.check(arguments.out, "record", _settings(arguments, _RECORD_SETTINGS),
                       allow_other=arguments.allow_other_settings)
    if arguments.no_progress:
        options.disable_progress_bars()
    model = AutoModelForCausalLM.from_pretrained(arguments.model, local_files_only=True).to(options.device(arguments.device))
    return record(
        model.eval(), tokenizer, arguments.prompts, arguments.out, batch_size=arguments.batch_size,
        text_column=arguments.text_column, messages_column=arguments.messages_column,
        id_column=arguments.id_column, chat=arguments.chat, progress=not arguments.no_progress,
        seed=arguments.seed, recorder_options={
            "streams": tuple(arguments.streams.split(",")), **({"encodings": encodings} if encodings else {}),
            **({} if arguments.prompt_logprobs is None else {"prompt_logprobs": arguments.prompt_logprobs or True}),
        },
        **generate_options,
    )


# What a resumed `record` must share with the run that began its `--out` (besides the model and tokenizer): the
# prompts' reading, the decoding and its parameters, the seed, and what is recorded. Not the batch size.
_RECORD_SETTINGS = ("text_column", "messages_column", "id_column", "chat", "max_new_tokens", "do_sample", "temperature", "top_p",
                    "repetition_penalty", "top_k", "num_beams", "num_return_sequences", "seed", "streams", "encodings",
                    "prompt_logprobs")
# And a resumed `score`: the model's loading, the windows and the encoding (the texts by their digest). Not
# --max-windows (a resume may score more), nor the batch or chunk sizes.
_SCORE_SETTINGS = ("dtype", "attn_implementation", "quantization", "context", "bos", "encodings")


def _dtype(name: str | None) -> Any:
    import torch

    if name is None:
        return None
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise options.UsageError(f"`--dtype` must name a torch floating dtype (float32, bfloat16, float16), got {name!r}")
    return dtype


def _load_candidate(arguments: argparse.Namespace) -> Any:
    """`--model` with `--dtype`, `--attn-implementation` and `--quantization`, on `--device`, in eval mode."""
    from transformers import AutoModelForCausalLM

    dtype = _dtype(arguments.dtype)
    loading: dict[str, Any] = {}
    if arguments.attn_implementation is not None:
        loading["attn_implementation"] = arguments.attn_implementation
    device = options.device(arguments.device)
    if arguments.quantization is not None:
        from ..rescoring.quantization import quantization_config

        if dtype is not None:
            raise options.UsageError("`--dtype` and `--quantization` together are not supported: the quantization "
                                     "sets the weights' dtype; drop `--dtype`")
        loading.update(quantization_config=quantization_config(arguments.quantization), device_map=str(device))
        return AutoModelForCausalLM.from_pretrained(arguments.model, local_files_only=True, **loading).eval()
    model = AutoModelForCausalLM.from_pretrained(arguments.model, local_files_only=True, **loading)
    return model.to(device=device, dtype=dtype).eval()


def _score(arguments: argparse.Namespace) -> dict[str, Any]:
    import time

    from ..jobs.record import read_prompts
    from ..rescoring.corpus import score_run

    if (arguments.text is None) == (arguments.dataset is None):
        raise options.UsageError("give the corpus as `--text FILE...` or as `--dataset DIR --text-column C` (one of them)")
    encodings = options.encodings(arguments.encodings)
    _dtype(arguments.dtype)  # a bad name refused before the corpus is read
    if arguments.text is not None:
        texts = []
        for path in arguments.text:
            try:
                with open(path, encoding="utf-8") as file:
                    texts.append(file.read())
            except OSError as error:
                raise options.UsageError(f"`--text` {path!r} cannot be read ({error.strerror or error}): pass a plain "
                                         "text file that exists and this user may read") from None
            except UnicodeDecodeError as error:
                raise options.UsageError(f"`--text` {path!r} is not UTF-8 text (byte {error.start}: {error.reason}): "
                                         "pass a plain text file, or convert it (iconv -t UTF-8)") from None
    else:
        texts = [text for _, text in read_prompts(arguments.dataset, text_column=arguments.text_column)]
        if not all(isinstance(text, str) for text in texts):
            raise options.UsageError(f"`--text-column` {arguments.text_column!r} of {arguments.dataset!r} must hold text")
    arguments.model = options.model_directory(arguments.model)
    tokenizer = options.job_tokenizer(arguments.tokenizer, arguments.model)
    # The corpus must fill one window before the model loads (score_run cuts the windows again, as it must).
    tokens = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts)
    if tokens < arguments.context:
        raise options.UsageError("the corpus holds no tokens (its texts are empty): pass a text to score" if not tokens
                                 else f"the corpus holds {tokens} tokens, fewer than one window of `--context` "
                                 f"{arguments.context}: pass a longer text or a smaller `--context`")
    import hashlib

    from ..jobs import settings as job_settings

    texts_sha256 = hashlib.sha256("\x00".join(texts).encode("utf-8")).hexdigest()
    job_settings.check(arguments.out, "score", _settings(arguments, _SCORE_SETTINGS, texts_sha256=texts_sha256),
                       allow_other=arguments.allow_other_settings)
    if arguments.no_progress:
        options.disable_progress_bars()
    model = _load_candidate(arguments)
    start = time.perf_counter()
    run, counts = score_run(model, texts, arguments.out, tokenizer=tokenizer, context=arguments.context,
                            batch_size=arguments.batch_size, chunk_size=arguments.chunk_size, bos=arguments.bos,
                            encodings=encodings or None, max_windows=arguments.max_windows,
                            progress=not arguments.no_progress)
    run.close()
    # This process's own work: under torchrun each rank reports its share (as rescore's result does).
    return {**counts, "seconds": round(time.perf_counter() - start, 3), "out": str(arguments.out)}


def _rescore(arguments: argparse.Namespace) -> dict[str, Any]:
    from ..read.reader import open_recording
    from ..rescoring.run import rescore_recording

    encodings = options.encodings(arguments.encodings)
    _dtype(arguments.dtype)  # a bad name refused before the model loads
    if Path(arguments.out).resolve() == Path(arguments.path).resolve():
        raise options.UsageError(f"`--out` {arguments.out!r} is the recording to rescore: write the rescore to "
                                 "another directory")
    arguments.model = options.model_directory(arguments.model)
    open_recording(arguments.path).close()  # a bad recording is reported before the model loads
    if arguments.no_progress:
        options.disable_progress_bars()
    model = _load_candidate(arguments)
    return rescore_recording(arguments.path, model, arguments.out, mode=arguments.mode,
                             streams=tuple(arguments.streams.split(",")), encodings=encodings or None,
                             chunk_size=arguments.chunk_size, progress=not arguments.no_progress)
