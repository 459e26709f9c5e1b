"""A Recorder's options, checked once against its model (`RecorderOptions.check`) and handed whole to the
capture of each call: what to record and how to encode and store it; and the prompts' names a call is
given (`check_samples`, for `Recorder.set_samples`)."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import safetensors
import torch
import transformers
from transformers import GenerationMixin

from .. import _compat
from ..codecs import spec as _spec
from ..codecs.spec import NATIVE
from ..store.header import Samples, check_sample_ids
from ..store.location import local_directory
from . import layers as _layers
from . import prompt_logprobs as _prompt_logprobs

DEFAULT_STREAMS = ("logits", "scores")
STREAMS = (*DEFAULT_STREAMS, *_layers.STREAMS, "stats")


@dataclass(frozen=True)
class RecorderOptions:
    """What a Recorder records and how, checked (`check`). The arguments are the `Recorder`'s.

    Attributes:
        streams (`tuple[str, ...]`): the streams recorded, each once, in the order given.
        ring_slots (`int`): host slots of the transfer ring.
        encodings (`dict[str, str]`): the streams not stored dense with their encoding, this model's
            defaults included (a 16-bit model's logits `"native"` where transformers upcasts them).
        scores_once (`bool`): scores that are the logits' very tensor are stored once with them (False
            when `encodings` names `"scores": "dense"`).
        sparse_scores (`bool`): scores sampled through a masking warper default to `"sparse"` (no
            encoding named for `"scores"`).
        selection (`layers.Selection`): the `layers`, `heads` and `newest_position_only` chosen.
        prompt_scoring (`prompt_logprobs.PromptScoring | None`): how prompts are scored, or None.
        encoding_seed (`int`): the seed of the `"sample:N@T"` draws.
        spill_dir (`pathlib.Path | None`), shard_bytes (`int | None`), append (`bool`): where and how the
            recording is written; None for host memory.
        named_encodings (`tuple[str, ...]`): the streams whose encoding the user named.
        every_call (`bool`): record every generate() and generate_batch() call of the model, not only
            those given the recorder in `logits_processor`.
    """

    streams: tuple[str, ...]
    ring_slots: int
    encodings: dict[str, str]
    scores_once: bool
    sparse_scores: bool
    selection: _layers.Selection
    prompt_scoring: _prompt_logprobs.PromptScoring | None
    encoding_seed: int
    spill_dir: Path | None
    shard_bytes: int | None
    append: bool
    named_encodings: tuple[str, ...] = ()
    every_call: bool = False

    @classmethod
    def check(cls, model: Any, *, streams: Sequence[str], layers: Sequence[int] | None, heads: Sequence[int] | None,
              newest_position_only: bool, ring_slots: int, spill_dir: str | os.PathLike | None,
              shard_bytes: int | None, encodings: dict[str, str] | None, append: bool, prompt_logprobs: bool | int,
              prompt_chunk: int | None, encoding_seed: int, every_call: bool = False) -> RecorderOptions:
        """The Recorder's arguments, checked against `model`.

        Raises:
            TypeError, ValueError, IndexError: as the `Recorder` documents them.
        """
        if not isinstance(model, GenerationMixin) or not callable(getattr(model, "generate", None)):
            raise TypeError(
                f"`model` must be a transformers model with `generate()` (a `GenerationMixin`, such as "
                f"`AutoModelForCausalLM.from_pretrained(...)`), got {type(model).__name__}."
            )
        if isinstance(streams, str) or not isinstance(streams, (tuple, list)):
            raise TypeError(f"`streams` must be a tuple of names from {STREAMS}, got {streams!r}.")
        unknown = [s for s in streams if s not in STREAMS]
        if unknown:
            raise ValueError(f"`streams` holds unknown names {unknown}; choose from {STREAMS}.")
        _check_int(ring_slots, "ring_slots", "host slots", least=1)
        if spill_dir is not None and not isinstance(spill_dir, (str, os.PathLike)):
            raise TypeError(f"`spill_dir` must be a path (str or os.PathLike), got {spill_dir!r}.")
        if append and spill_dir is None:
            raise ValueError("`append` adds generations to the recording in `spill_dir`; pass `spill_dir` too.")
        if shard_bytes is not None:
            if spill_dir is None:
                raise ValueError("`shard_bytes` sizes the shards written to `spill_dir`; pass `spill_dir` too.")
            _check_int(shard_bytes, "shard_bytes", "bytes", least=1, unit=" (byte)")
        if not isinstance(every_call, bool):
            raise TypeError(f"`every_call` must be True or False, got {every_call!r}.")
        if isinstance(encoding_seed, bool) or not isinstance(encoding_seed, int):
            raise TypeError(f"`encoding_seed` must be an int (the seed of the `sample:N` draws), got {encoding_seed!r}.")
        streams = tuple(streams)
        selection = _layers.selection(model, streams, layers, heads, newest_position_only)
        chosen = _spec.check(encodings, streams, model_info(model)["vocab_size"])
        named = encodings if isinstance(encodings, dict) else {}
        if ("logits" in streams and "logits" not in named
                and _compat.UPCASTS_LOGITS and getattr(model, "dtype", None) in (torch.bfloat16, torch.float16)):
            # A 16-bit model's logits, upcast to float32 by transformers: stored in the model's dtype where
            # they convert back exactly (lossless; half the bytes, and less time than dense: bench/native_cost.py).
            chosen["logits"] = NATIVE
        prompt_scoring = _prompt_logprobs.scoring_for(model, prompt_logprobs, prompt_chunk)
        if "attentions" in streams:
            _layers.require_eager(model)
        return cls(
            streams=tuple(dict.fromkeys(streams)),
            ring_slots=ring_slots,
            encodings=chosen,
            scores_once=named.get("scores") != "dense",
            sparse_scores="scores" not in named,
            selection=selection,
            prompt_scoring=prompt_scoring,
            encoding_seed=encoding_seed,
            spill_dir=None if spill_dir is None else local_directory(spill_dir, "`spill_dir`"),
            shard_bytes=shard_bytes,
            append=bool(append),
            named_encodings=tuple(named),
            every_call=every_call,
        )


def _check_int(value: Any, name: str, what: str, *, least: int, unit: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int ({what}), got {value!r}.")
    if value < least:
        raise ValueError(f"`{name}` must be at least {least}{unit}, got {value}.")


def device_type(model: Any) -> str | None:
    """The type of the device `model` computes on (`"cuda"`, `"cpu"`...), None where it has no `device`."""
    device = getattr(model, "device", None)
    return device.type if isinstance(device, torch.device) else None


def model_info(model: Any) -> dict[str, Any]:
    """What a recording's manifest says of `model`: its class, `name_or_path`, config class and vocabulary size."""
    config = getattr(model, "config", None)
    text_config = _compat.text_config(config)
    return {
        "class": type(model).__name__,
        "name_or_path": str(getattr(model, "name_or_path", "") or ""),
        "config_class": type(config).__name__,
        "vocab_size": getattr(text_config, "vocab_size", None),
    }


def created_by() -> dict[str, str]:
    """The versions that write a recording, for its manifest's `created_by`."""
    from .._version import __version__

    return {
        "transformers_offload": __version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "python": platform.python_version(),
    }


def check_samples(ids: Any, metadata: Any) -> Samples:
    """`Recorder.set_samples`'s arguments checked (`store.header.check_sample_ids`) and copied, as the
    header's `sample_ids` and `sample_metadata` (the metadata through JSON).

    Raises:
        TypeError: `ids` or `metadata` of the wrong types, or metadata that is not JSON.
        ValueError: repeated ids, or a metadata list of another length.
    """
    ids = list(ids) if isinstance(ids, (list, tuple)) else ids
    metadata = list(metadata) if isinstance(metadata, (list, tuple)) else metadata
    problem = check_sample_ids(ids, metadata)
    if problem is not None:
        kind = ValueError if "distinct" in problem or "one per id" in problem else TypeError
        raise kind(f"`set_samples`: {problem}.")
    try:
        metadata = None if metadata is None else json.loads(json.dumps(metadata, allow_nan=False))
    except (TypeError, ValueError) as error:
        raise TypeError(f"`metadata` must be JSON-serialisable (str keys; str, numbers, lists, dicts): {error}") from None
    return Samples(tuple(ids), None if metadata is None else tuple(metadata))
