"""`inspect`'s report: a recording's summary (`Recording.describe()`) as text, one block per generation and one
line per stream, with the generation settings that choose tokens."""

from __future__ import annotations

from typing import Any

from ..errors import verify_command
from .options import size


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
        windows = generation.get("scored_windows")
        # A batch of `score`'s windows reaches the recorder as a greedy loop of the corpus's tokens would: say what it is.
        mode = generation["mode"] if windows is None else (
            f"score, windows {_short_list(windows['windows'])} of {_count(windows['context'], 'token')}"
            f"{'' if windows['bos'] is None else ', BOS ' + str(windows['bos']) + ' first'}")
        lines += [
            "",
            f"generation {generation['index']}{_rank_of(generation)}: {mode}, {state}",
            f"  {_steps_and_rows(generation['num_steps'], generation['num_rows'])}{beams}, prompt "
            f"{_count(generation['prompt_length'], 'token')}, {_count(generation['num_shards'], 'shard')}, "
            f"{size(generation['file_bytes'])} on disk",
        ]
        for damaged in generation.get("damaged_files", ()):
            lines.append(f"  DAMAGED {damaged['file']}: {damaged['error']} (reading its steps raises; check every "
                         f"file: {verify_command(summary['path'])})")
        if generation.get("prompt_lengths"):
            lines.append(f"  prompt lengths (tokens, without padding): {_short_list(generation['prompt_lengths'])}")
        if generation.get("sample_ids"):
            lines.append(f"  samples: {_short_list(generation['sample_ids'])}")
        if generation.get("adapters"):
            lines.append(f"  adapters: {_adapters(generation['adapters'])}")
        chosen = settings(generation.get("generation_config") or {}, verbose=verbose) if windows is None else None
        if chosen:
            lines.append(f"  settings: {chosen}")
        width = max([14, *(len(stream) + 2 for stream in generation["streams"])])
        encoding_width = max([10, *(len(info["encoding"]) + 2 for info in generation["streams"].values())])
        encoded = any("dense_bytes" in info for info in generation["streams"].values())
        lines.append(
            f"  {'stream':<{width}}{'dtype':<10}{'encoding':<{encoding_width}}{'shape per step':<20}{'bytes':>12}"
            + ("  of dense" if encoded else "")
        )
        for stream, info in generation["streams"].items():
            # A ragged stream's varying dimensions (null in the manifest) show as "*".
            shape = ("(" + ", ".join("*" if n is None else str(n) for n in info["shape"])
                     + ("," if len(info["shape"]) == 1 else "") + ")")
            shape += " once" if info.get("once") else ""
            dense = info.get("dense_bytes")
            ratio = f"  {info['bytes'] / dense:.2%}" if dense and info["bytes"] is not None else ""
            lines.append(
                f"  {stream:<{width}}{info['dtype']:<10}{info['encoding']:<{encoding_width}}{shape:<20}"
                f"{'?' if info['bytes'] is None else size(info['bytes']):>12}{ratio}"
            )
    return "\n".join(lines)


def _adapters(adapters: dict[str, Any]) -> str:
    """A PEFT model's adapters of a generation, as `inspect` shows them."""
    if adapters.get("disabled"):
        return "disabled (the base model alone)"
    parts = [f"active {', '.join(adapters.get('active', [])) or 'none'}"]
    if adapters.get("merged"):
        parts.append(f"merged {', '.join(adapters['merged'])}")
    if adapters.get("per_row"):
        parts.append(f"per row {_short_list(adapters['per_row'])}")
    return "; ".join(parts)


def _count(number: int, noun: str) -> str:
    """`1 step`, `16 steps`."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _steps_and_rows(steps: int, rows: int) -> str:
    """`16 steps of 1 row each`; a generation stopped before its first step recorded none."""
    if not steps:
        return "no step recorded (stopped before its first step)"
    return f"{_count(steps, 'step')} of {_count(rows, 'row')} each"


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


def settings(config: dict[str, Any], *, verbose: bool = False) -> str:
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
