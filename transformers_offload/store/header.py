"""One generation's header: what a recorded `generate()` call was, as capture describes it when its decoding
loop starts (and completes when it ends), as both stores keep it and as the reader reads it back from a
manifest entry. The one schema of a generation's metadata; docs/format.md gives the manifest's fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class GenerationHeader:
    """A generation's metadata (not its steps). Every field is plain JSON data.

    Attributes:
        index (`int`): the generation's position in its recording.
        mode (`str`): the decoding mode, transformers' `GenerationMode` value (`"greedy_search"`, `"sample"`...).
        prompt_length (`int`): tokens of the (left-padded) prompt given to the decoding loop.
        num_beams (`int`): beams per prompt (1 outside beam search).
        eos_token_id (`tuple[int, ...]`), pad_token_id (`int | None`): from the call's generation config.
        generation_config (`dict`): the call's `GenerationConfig.to_diff_dict()`, private keys left out.
        prompt_lengths (`tuple[int, ...] | None`): each prompt's tokens that are not padding; None without
            an attention mask.
        encodings (`dict[str, str]`): the streams not stored dense, with their encoding as stored
            (`codecs.spec`: `"scores": "same_as_logits"` for scores stored once with the logits).
        num_rows (`int`): rows per step (0 until known).
        layers (`dict | None`): with attentions or hidden states, the layer selection (`counts`, `heads`,
            `newest_position_only`).
        sample_ids (`tuple | None`), sample_metadata (`tuple | None`): the prompts' ids and metadata
            (`Recorder.set_samples`).
        loop (`dict | None`): for a call that ran the decoding loop several times (Whisper), which loop.
        nested_calls (`int`): unrecorded `generate()` calls of the model's children during the loop.
        adapters (`dict | None`): for a PEFT model, the adapters in use (`active`, `merged`, `disabled`).
    """

    index: int
    mode: str
    prompt_length: int
    num_beams: int
    eos_token_id: tuple[int, ...]
    generation_config: dict[str, Any]
    prompt_lengths: tuple[int, ...] | None = None
    pad_token_id: int | None = None
    encodings: dict[str, str] = field(default_factory=dict)
    num_rows: int = 0
    layers: dict[str, Any] | None = None
    sample_ids: tuple[Any, ...] | None = None
    sample_metadata: tuple[dict[str, Any], ...] | None = None
    loop: dict[str, Any] | None = None
    nested_calls: int = 0
    adapters: dict[str, Any] | None = None

    @classmethod
    def from_manifest(cls, entry: dict[str, Any]) -> GenerationHeader:
        """The header of a manifest entry already checked by `manifest` (its streams give `encodings`)."""
        lengths = entry.get("prompt_lengths")
        return cls(
            index=entry["index"],
            mode=entry["mode"],
            prompt_length=entry["prompt_length"],
            num_beams=entry["num_beams"],
            eos_token_id=tuple(entry["eos_token_id"]),
            generation_config=dict(entry["generation_config"]),
            prompt_lengths=None if lengths is None else tuple(lengths),
            pad_token_id=entry.get("pad_token_id"),
            encodings={name: stream["encoding"] for name, stream in entry["streams"].items()},
            num_rows=entry["num_rows"],
            layers=entry.get("layers"),
            sample_ids=None if entry.get("sample_ids") is None else tuple(entry["sample_ids"]),
            sample_metadata=None if entry.get("sample_metadata") is None else tuple(entry["sample_metadata"]),
            loop=entry.get("loop"),
            nested_calls=entry.get("nested_calls", 0),
            adapters=entry.get("adapters"),
        )


def check_sample_ids(ids: Any, metadata: Any) -> str | None:
    """What is wrong with a call's sample ids and metadata (None: nothing): the ids a list of distinct
    str or int, the metadata None or a list of JSON objects, one per id."""
    if not isinstance(ids, list) or not all(isinstance(i, (str, int)) and not isinstance(i, bool) for i in ids):
        return f"the sample ids must be a list of str or int (one per prompt), got {ids!r}"
    if not ids:
        return "the sample ids must name at least one prompt"
    wide = [i for i in ids if isinstance(i, int) and not -2**63 <= i < 2**63]
    if wide:
        return f"an int sample id must fit in 64 bits (a table's int64 column), got {wide[0]}"
    as_text = [str(i) for i in ids]  # the table writes ids as text when any is a string: 1 and "1" collide
    if len(set(as_text)) != len(ids):
        repeated = sorted({t for t in as_text if as_text.count(t) > 1})
        return f"the sample ids must be distinct within a call (1 and '1' count as the same); repeated: {repeated}"
    if metadata is not None:
        if not isinstance(metadata, list) or not all(isinstance(m, dict) for m in metadata):
            return f"the sample metadata must be a list of dicts (one per prompt), got {metadata!r}"
        if len(metadata) != len(ids):
            return f"{len(metadata)} metadata dicts were given for {len(ids)} sample ids; give one per id"
    return None


def jsonable(value: Any) -> Any:
    """`value` as plain JSON types, for the header's `generation_config` (generate() keeps some of its
    fields as tensors; a value of another type is kept as its `repr`)."""
    if hasattr(value, "tolist"):  # a tensor or an array
        return value.tolist()
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)
