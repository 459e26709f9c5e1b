"""The layout of a recording on disk: the format's name and version, the names of its files, streams
and rank directories, the metadata of a shard, and which layers and heads `layers` and `heads` select.

A recording is one directory: a JSON manifest (`manifest.json`) and safetensors files beside it.
docs/format.md is the specification; this module, `manifest` and the `codecs` are its implementation,
shared by the writer (`shards`) and the reader (`read.reader`). Nothing here unpickles anything.
"""

from __future__ import annotations

import json
import operator
import re
from pathlib import Path
from typing import Any, Sequence

from .header import ManifestEntry

FORMAT = "transformers-offload"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# Where the `record` processes writing a recording (or a data-parallel run's directory) keep their claims
# on its samples (`claims`): present only while one writes; not part of the recording.
WRITERS = ".writers"
# The settings `record` and `score` ran with (`jobs.settings`), compared when they resume: not part of the recording.
JOB_SETTINGS = ".job.json"
# One line per generation a writer added (`ledger`), kept beside the manifest: how `verify` finds two
# processes that wrote one recording at once. Part of the recording; recordings made before it lack it.
LEDGER = "ledger.jsonl"
BEAM_MODES = ("beam_search", "beam_sample", "group_beam_search")  # whose generations carry `beam_parents`

# Per-layer streams, one per recorded layer, named `KIND.LAYER` (`attentions.3`): KIND is the name of
# the `generate()` output they mirror, LAYER the index into that output's per-step tuple (hidden states
# count the embeddings as entry 0). Encoder kinds are recorded once per generation, the others per step.
STEP_LAYER_KINDS = ("attentions", "hidden_states", "decoder_attentions", "cross_attentions", "decoder_hidden_states")
ENCODER_KINDS = ("encoder_attentions", "encoder_hidden_states")
LAYER_KINDS = STEP_LAYER_KINDS + ENCODER_KINDS
ATTENTION_KINDS = ("attentions", "decoder_attentions", "cross_attentions", "encoder_attentions")
GROWING_KINDS = ("attentions", "decoder_attentions")  # self-attention: one more key per step


def layer_stream(kind: str, layer: int) -> str:
    """The stream name of one layer of `kind`: `layer_stream("attentions", 3) == "attentions.3"`."""
    return f"{kind}.{layer}"


def split_layer_stream(name: str) -> tuple[str, int] | None:
    """`"attentions.3"` -> `("attentions", 3)`; None for a name that is not a per-layer stream."""
    kind, _, layer = name.rpartition(".")
    if kind in LAYER_KINDS and layer.isdigit() and layer == str(int(layer)):
        return kind, int(layer)
    return None


def ragged_shape(name: str, shape: tuple[int, ...]) -> list[int | None]:
    """The manifest's per-step `shape` of ragged stream `name`, given one step's shape: None where it
    changes from step to step (attentions `(rows, heads, queries, keys)`, hidden states
    `(rows, positions, hidden_size)`)."""
    kind, _ = split_layer_stream(name)
    if kind in ATTENTION_KINDS:
        return [shape[0], shape[1], None, None]
    return [shape[0], None, shape[2]]


def shapes_key(name: str) -> str:
    """The shard tensor that holds ragged stream `name`'s per-step shapes."""
    return name + ".shapes"


RANK_DIRECTORY = re.compile(r"rank-(0|[1-9][0-9]{0,5})")  # a data-parallel rank's recording, inside the run's


def rank_directory(rank: int) -> str:
    """The sub-directory data-parallel rank `rank` records into (`rank-0`, `rank-1`...)."""
    return f"rank-{rank}"


def rank_directories(root: Path) -> list[tuple[int, Path]]:
    """The rank sub-directories of `root` that hold a manifest, by rank (a rank killed before its first
    manifest left none: it recorded nothing)."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = RANK_DIRECTORY.fullmatch(child.name)
        if match and (child / MANIFEST).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def shard_name(generation: int, shard: int) -> str:
    return f"g{generation:04d}-s{shard:05d}.safetensors"


def sequences_name(generation: int) -> str:
    return f"g{generation:04d}-sequences.safetensors"


def encoder_name(generation: int) -> str:
    return f"g{generation:04d}-encoder.safetensors"


def prompt_name(generation: int) -> str:
    return f"g{generation:04d}-prompt.safetensors"


# Recorded once per call with `prompt_logprobs` (in the generation's `encoder` entry, a file of their
# own): per prompt and position p, the prompt's token p + 1, its logprob and rank, and the top-k.
PROMPT_STREAMS = ("prompt_tokens", "prompt_logprobs", "prompt_ranks", "prompt_top_tokens", "prompt_top_logprobs")


def shard_metadata(generation: int, first_step: int) -> dict[str, str]:
    """The safetensors `__metadata__` of a shard: lets the reader check that a file is the one named.

    One key holding sorted JSON: safetensors stores `__metadata__` as a hash map, so several keys would
    come out in a different order in each process, and shards would not be reproducible byte for byte.
    """
    fields = {"format": FORMAT, "format_version": FORMAT_VERSION, "generation": generation, "first_step": first_step}
    return {FORMAT: json.dumps(fields, sort_keys=True)}


def read_shard_metadata(metadata: dict[str, str] | None) -> dict[str, Any]:
    """The fields `shard_metadata` wrote, or {} when they are missing or unreadable."""
    try:
        fields = json.loads((metadata or {}).get(FORMAT, "{}"))
    except json.JSONDecodeError:
        return {}
    return fields if isinstance(fields, dict) else {}


# -- layer and head indices, as `layers` and `heads` name them ------------------------------------
def indices(value: Any, name: str) -> tuple[int, ...] | None:
    """`value` (None, or a sequence of integers: Python or NumPy ints, negative ones allowed) as a tuple.

    Raises:
        TypeError: not a sequence of integers (a string, a float, a bool...).
        ValueError: an empty sequence.
    """
    if value is None:
        return None
    wrong = TypeError(f"`{name}` must be a sequence of int indices (e.g. `[-1]`), got {value!r}.")
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise wrong
    items = list(value)
    if any(isinstance(i, bool) for i in items):
        raise wrong
    try:
        found = tuple(operator.index(i) for i in items)
    except TypeError:
        raise wrong from None
    if not found:
        raise ValueError(f"`{name}` is empty; pass None to keep them all.")
    return found


def resolve(chosen: Sequence[int] | None, count: int, what: str) -> tuple[int, ...]:
    """`chosen` (negative indices count from the end) as sorted, distinct indices into `count` entries.

    Raises:
        IndexError: an index is out of range, naming `what` and the count.
    """
    if chosen is None:
        return tuple(range(count))
    wrong = [i for i in chosen if not -count <= i < count]
    if wrong:
        raise IndexError(f"{what} {wrong} out of range: this model has {count} (valid: {-count} to {count - 1}).")
    return tuple(sorted({i % count for i in chosen}))


def files_of(entry: dict[str, Any]) -> list[str]:
    """Every file one (checked) generation entry names: its shards, sequences and encoder outputs."""
    written = ManifestEntry(entry)
    files = [shard.file for shard in written.shards]
    if written.sequences:
        files.append(written.sequences)
    if written.once is not None:
        files.append(written.once.file)
    return files
