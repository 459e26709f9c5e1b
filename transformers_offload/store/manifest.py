"""A recording's manifest, read and checked: every field a reader relies on has the type and range
the format (`layout`, `codecs`) gives it, and every file it names lies inside the recording directory.

A damaged or hostile manifest raises `RecordingError` naming what is wrong, never another error.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from ..codecs.dtypes import DTYPE_BYTES
from ..codecs.sparse import SPARSE_DTYPES, SPARSE_MAX_VOCAB
from ..codecs.spec import (
    ENCODED_STREAMS,
    ENCODINGS,
    RECORD_ENCODINGS,
    SAME_AS_LOGITS,
    is_packed,
    topk_bits,
    topk_width,
)
from ..codecs.stats import STATS_COLUMNS, STATS_STREAM
from ..errors import RecordingError
from .header import (
    COMPLETE,
    COUNT_FIELDS,
    ENTRY_FIELDS,
    ID_LIST_FIELDS,
    NULLABLE_FIELDS,
    POSITIVE_FIELDS,
    STATUSES,
    GenerationHeader,
    ManifestEntry,
    OnceEntry,
    ShardEntry,
    StreamEntry,
    check_sample_ids,
)
from .layout import (
    ATTENTION_KINDS,
    BEAM_MODES,
    ENCODER_KINDS,
    FORMAT,
    FORMAT_VERSION,
    LAYER_KINDS,
    MANIFEST,
    PROMPT_STREAMS,
    STEP_LAYER_KINDS,
    split_layer_stream,
)

SPARSE_DTYPE_NAMES = SPARSE_DTYPES.names
PER_ROW_STREAMS = ("tokens", "finished", "beam_parents")  # shape (rows,)
REQUIRED_STREAMS = ("tokens", "finished")


def read_manifest(root: Path) -> dict[str, Any]:
    """Load and check `root/manifest.json`; raise `RecordingError` naming what is wrong."""
    path = root / MANIFEST
    if not root.exists():
        raise RecordingError(root, "no such recording directory.")
    if not root.is_dir():
        raise RecordingError(root, "is a file, not a recording directory (pass the directory `spill_dir` named).")
    if not path.is_file():
        raise RecordingError(
            path, "missing: this directory is not a transformers-offload recording (no manifest)."
        )
    inside(root, MANIFEST, path)  # a manifest symlinked from elsewhere is not this recording's
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise RecordingError(path, f"not valid JSON ({type(error).__name__}: {error}); the manifest is damaged.") from None
    _check_numbers(manifest, path)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise RecordingError(path, f"not a transformers-offload manifest (no \"format\": {FORMAT!r}).")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise RecordingError(path, f"`format_version` must be an integer, got {version!r}.")
    if version != FORMAT_VERSION:
        newer = "newer than" if version > FORMAT_VERSION else "older than"
        raise RecordingError(
            path,
            f"format version {version} is {newer} the one this transformers-offload reads "
            f"({FORMAT_VERSION}); read it with a transformers-offload release of that format version.",
        )
    _field(manifest, "generations", list, path)
    _field(manifest, "created_by", dict, path)
    _field(manifest, "model", dict, path)
    files: set[str] = set()
    for index, entry in enumerate(manifest["generations"]):
        check_generation(entry, index, root, path, files)
    _check_file_records(manifest.get("files"), root, path)
    return manifest


_CHECKSUM_PATTERN = re.compile(r"[a-z0-9]+:[0-9a-f]{1,128}")


def _check_file_records(records: Any, root: Path, path: Path) -> None:
    """The optional `files` map (recordings written before checksums have none): per file name,
    `{"bytes": size, "checksum": "ALGORITHM:HEX"}`."""
    if records is None:
        return
    if not isinstance(records, dict):
        raise RecordingError(path, f"`files` must be a JSON object of file records, got {type(records).__name__}.")
    for name, record in records.items():
        inside(root, name, path)
        ok = isinstance(record, dict) and _count(record.get("bytes")) and isinstance(record.get("checksum"), str)
        if not ok or not _CHECKSUM_PATTERN.fullmatch(record["checksum"]):
            raise RecordingError(
                path, f"`files` holds {record!r} for {name!r}; expected {{\"bytes\": SIZE, \"checksum\": \"ALGORITHM:HEX\"}}."
            )


def _check_numbers(manifest: Any, path: Path) -> None:
    """Every number in the manifest is finite and fits 64 bits (no field needs more): a huge or
    non-finite one is damage, refused before any field is used."""
    pending = [manifest]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
        elif isinstance(value, int) and not -(2**63) <= value < 2**63:
            raise RecordingError(path, f"holds the number {str(value)[:24]}..., beyond 64 bits; the manifest is damaged.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise RecordingError(path, f"holds the number {value}; the manifest is damaged.")


def check_generation(entry: Any, index: int, root: Path, path: Path, files: set[str]) -> None:
    """Check one generation entry of the manifest: types, values, stream shapes, and every file name.

    `files` collects the names seen so far: no file may be named twice in a recording.
    """
    where = f"generation {index}"
    if not isinstance(entry, dict):
        raise RecordingError(path, f"{where} must be a JSON object, got {type(entry).__name__}.")
    for key, kind in ENTRY_FIELDS.items():
        _field(entry, key, kind, path, where)
    written = ManifestEntry(entry)
    if written.index != index:
        raise RecordingError(path, f"{where} says `index` {written.index}; generations are listed in order.")
    if written.status not in STATUSES:
        raise RecordingError(path, f"{where}: unknown `status` {written.status!r}; expected {STATUSES}.")
    for key in COUNT_FIELDS:
        if entry[key] < 0:
            raise RecordingError(path, f"{where}: `{key}` must not be negative, got {entry[key]}.")
    for key, kind in NULLABLE_FIELDS.items():
        value = entry.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise RecordingError(path, f"{where}: `{key}` must be {kind.__name__} or null, got {value!r}.")
    for key in ID_LIST_FIELDS:
        values = entry.get(key) or []
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise RecordingError(path, f"{where}: `{key}` must list non-negative integers, got {values!r}.")
    for key in POSITIVE_FIELDS:
        if entry[key] < 1:
            raise RecordingError(path, f"{where}: `{key}` must be at least 1, got {entry[key]}.")
    _check_samples(entry, path, where)
    for name, stream in written.unchecked_streams.items():
        _check_stream(name, stream, path, where)
    _check_stream_set(entry, path, where)
    expected_first = 0
    for shard in written.unchecked_shards:
        if not isinstance(shard, dict):
            raise RecordingError(path, f"{where}: a shard entry must be a JSON object.")
        for key, kind in ShardEntry.FIELDS:
            _field(shard, key, kind, path, where)
        shard = ShardEntry.from_manifest(shard)
        _claim(root, shard.file, path, files)
        if shard.first_step != expected_first or shard.num_steps < 1:
            raise RecordingError(
                path,
                f"{where}: shard {shard.file!r} covers steps from {shard.first_step} "
                f"({shard.num_steps} steps), expected a non-empty shard from step {expected_first}.",
            )
        expected_first += shard.num_steps
    if expected_first < written.num_steps:
        raise RecordingError(
            path, f"{where}: its shards hold {expected_first} steps, the manifest says {written.num_steps}."
        )
    if written.sequences is not None:
        _claim(root, written.sequences, path, files)
    elif written.status == COMPLETE:
        raise RecordingError(path, f"{where} is complete but names no `sequences` file; the manifest is damaged.")
    _check_layers(entry, root, path, where, files)


def _check_layers(entry: dict[str, Any], root: Path, path: Path, where: str, files: set[str]) -> None:
    """The optional parts of a generation that recorded attentions or hidden states: `layers` (what
    was selected) and `encoder` (an encoder-decoder model's encoder outputs, in a file of their own)."""
    written = ManifestEntry(entry)
    layers = written.layers
    if layers is not None:
        if not isinstance(layers, dict):
            raise RecordingError(path, f"{where}: `layers` must be a JSON object, got {layers!r}.")
        counts = _field(layers, "counts", dict, path, where + ", `layers`")
        if not all(kind in LAYER_KINDS and _count(n) for kind, n in counts.items()):
            raise RecordingError(path, f"{where}: `layers.counts` must map output names to layer counts, got {counts!r}.")
        heads = layers.get("heads")
        if heads is not None and not (
            isinstance(heads, dict)
            and all(kind in ATTENTION_KINDS and isinstance(kept, list) and all(_count(h) for h in kept)
                    for kind, kept in heads.items())
        ):
            raise RecordingError(
                path, f"{where}: `layers.heads` must map attention outputs to head indices, or be null; got {heads!r}."
            )
        if not isinstance(layers.get("newest_position_only"), bool):
            raise RecordingError(path, f"{where}: `layers.newest_position_only` must be true or false.")
    streams = dict(written.streams)
    once = OnceEntry.unchecked(entry)
    if len(once) > 1:
        raise RecordingError(path, f"{where}: has both `encoder` and `prompt`; a generation has one file of "
                                   "tensors recorded once per call.")
    for key, encoder in once.items():
        if not isinstance(encoder, dict):
            raise RecordingError(path, f"{where}: `{key}` must be a JSON object, got {encoder!r}.")
        for field_name, kind in OnceEntry.FIELDS:
            _field(encoder, field_name, kind, path, where + f", `{key}`")
        for name, stream in OnceEntry.unchecked_streams(encoder).items():
            _check_stream(name, stream, path, where)
        checked = OnceEntry.of(entry)
        _claim(root, checked.file, path, files)
        for name, stream in checked.streams.items():
            split = split_layer_stream(name)
            known = name in PROMPT_STREAMS or (key == "encoder" and split is not None and split[0] in ENCODER_KINDS)
            if not known or stream.encoding != "dense":
                raise RecordingError(path, f"{where}: {name!r} is not a stream recorded once per call "
                                           "(an encoder output or a prompt logprob).")
            streams[name] = stream
    # Every per-layer stream is a layer the model has, and holds as many heads as were kept.
    for name, stream in streams.items():
        split = split_layer_stream(name)
        if split is None:
            continue
        kind, layer = split
        if layers is None or layer >= layers["counts"].get(kind, 0):
            raise RecordingError(
                path, f"{where}: stream {name!r} names a layer that `layers.counts` does not have "
                      f"({layers and layers['counts']})."
            )
        heads = layers.get("heads")
        if kind in ATTENTION_KINDS and heads is not None and stream.shape[1] != len(heads.get(kind, ())):
            raise RecordingError(
                path, f"{where}: stream {name!r} holds {stream.shape[1]} heads, `layers.heads` lists {heads.get(kind)}."
            )


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_stream_set(entry: dict[str, Any], path: Path, where: str) -> None:
    """Streams agree with each other, with `num_rows`, and with the mode (beam search has parents)."""
    written = ManifestEntry(entry)
    streams = written.streams
    if not written.unchecked_shards:
        return  # nothing written yet: the streams are not known
    header = GenerationHeader.from_manifest(entry)  # its fields checked, and its streams' encodings
    missing = [name for name in REQUIRED_STREAMS if name not in streams]
    if header.mode in BEAM_MODES and "beam_parents" not in streams:
        missing.append("beam_parents")
    if missing:
        raise RecordingError(path, f"{where}: the streams lack {missing}, which every {header.mode!r} recording has.")
    if "beam_parents" in streams and header.mode not in BEAM_MODES:
        raise RecordingError(path, f"{where}: holds `beam_parents` but its mode is {header.mode!r}.")
    rows = header.num_rows
    if header.mode in BEAM_MODES and (rows == 0 or rows % header.num_beams):
        raise RecordingError(path, f"{where}: {rows} rows are not a whole number of prompts of {header.num_beams} beams.")
    for name, stream in streams.items():
        shape = stream.shape
        if stream.encoding == SAME_AS_LOGITS:
            logits = streams.get("logits")
            whole = (logits is not None and logits.encoding in ("dense", *RECORD_ENCODINGS)
                     and not is_packed(logits.encoding))
            if not whole or ((logits.dtype, logits.shape, logits.dense) != (stream.dtype, shape, stream.dense)):
                raise RecordingError(path, f"{where}: stream {name!r} is stored as the `logits` stream (dense, sparse "
                                           f"or native), which it must then match in dtype and shape "
                                           f"({None if logits is None else logits.to_manifest()!r}).")
            continue
        if stream.as_records:
            if stream.dense_shape[0] != rows:
                raise RecordingError(
                    path, f"{where}: stream {name!r} decodes to {stream.dense_shape[0]} rows, `num_rows` is {rows}."
                )
            continue
        if stream.encoding == "ragged":
            if shape[0] != rows:
                raise RecordingError(
                    path, f"{where}: stream {name!r} has {shape[0]} rows, which disagrees with `num_rows` {rows}."
                )
            continue
        if name == STATS_STREAM and (shape != [rows, len(STATS_COLUMNS)] or stream.dtype not in ("float32", "float64")):
            raise RecordingError(
                path, f"{where}: stream {name!r} must be float32 or float64 of per-step shape [{rows}, {len(STATS_COLUMNS)}], "
                f"got {stream.dtype} {shape}.",
            )
        per_row = name in PER_ROW_STREAMS
        if (per_row and shape != [rows]) or (not per_row and (len(shape) != 2 or shape[0] != rows)):
            raise RecordingError(
                path, f"{where}: stream {name!r} has per-step shape {shape}, which disagrees with `num_rows` {rows}."
            )


def _check_stream(name: str, stream: Any, path: Path, where: str) -> None:
    if not isinstance(stream, dict):
        raise RecordingError(path, f"{where}: stream {name!r} must be a JSON object.")
    for key, kind in StreamEntry.FIELDS:
        _field(stream, key, kind, path, f"{where}, stream {name!r}")
    stream = StreamEntry.from_manifest(stream)
    if stream.dtype not in DTYPE_BYTES:
        raise RecordingError(path, f"{where}: stream {name!r} has unknown dtype {stream.dtype!r}.")
    k = topk_width(stream.encoding)
    packed = is_packed(stream.encoding) and stream.dtype == "int32"
    if k is not None and not packed:  # recorded before the packed records: float64 (rows, 2K + 2)
        if topk_bits(stream.encoding) is not None or name not in ENCODED_STREAMS or stream.dtype != "float64" or not (
                len(stream.shape) == 2 and stream.shape[1] == 2 * k + 2):
            raise RecordingError(
                path, f"{where}: stream {name!r} uses {stream.encoding!r}, which stores float64 of per-step shape "
                f"[rows, {2 * k + 2}] for {ENCODED_STREAMS} only; got {stream.dtype} {stream.shape!r}.",
            )
    elif stream.encoding in RECORD_ENCODINGS or packed:
        shape = stream.dense_shape
        good_dense = (
            stream.dense_dtype in SPARSE_DTYPE_NAMES and isinstance(shape, list)
            and len(shape) == 2 and _count(shape[0]) and _count(shape[1]) and 1 <= shape[1] <= SPARSE_MAX_VOCAB
        )
        if name not in ENCODED_STREAMS or stream.dtype != "int32" or stream.shape != [None] or not good_dense:
            raise RecordingError(
                path, f"{where}: stream {name!r} uses {stream.encoding!r}, which stores one flat int32 record per step "
                f"(shape [null]) for {ENCODED_STREAMS} only, with `dense` naming a float dtype and [rows, vocab]; "
                f"got {stream.dtype} {stream.shape!r}, dense {stream.dense!r}.",
            )
        return
    elif stream.encoding == SAME_AS_LOGITS:
        if name != "scores":
            raise RecordingError(path, f"{where}: stream {name!r} cannot use {SAME_AS_LOGITS!r} (only `scores` can).")
        return  # its dtype and shape are the logits' (checked with the generation's streams)
    elif stream.encoding not in ENCODINGS:
        raise RecordingError(
            path,
            f"{where}: stream {name!r} uses encoding {stream.encoding!r}, which this "
            f"transformers-offload cannot read (it reads {ENCODINGS}, 'sparse', 'native', 'same_as_logits', \"topk:K\", "
            f"\"topk:K:qB\", \"topk:K+tail:N\" and \"sample:N@T\"); upgrade transformers-offload.",
        )
    ragged = stream.encoding == "ragged"
    shape = stream.shape
    if not shape or not all(_count(n) or (ragged and n is None) for n in shape) or (ragged and shape[0] is None):
        raise RecordingError(path, f"{where}: stream {name!r} has a bad shape {shape!r}.")
    split = split_layer_stream(name)
    if ragged != (split is not None and split[0] in STEP_LAYER_KINDS):
        raise RecordingError(
            path, f"{where}: stream {name!r} cannot use encoding {stream.encoding!r} (only per-layer streams are ragged)."
        )


def _claim(root: Path, name: str, path: Path, files: set[str]) -> None:
    inside(root, name, path)
    if name in files:
        raise RecordingError(path, f"names file {name!r} twice; every shard is its own file.")
    files.add(name)


def inside(root: Path, name: str, path: Path) -> Path:
    """`root / name`, refused unless `name` is a plain file name that stays inside `root`."""
    bad = not name or name in (".", "..") or "\x00" in name or len(name.encode("utf-8", "surrogateescape")) > 255
    if bad or Path(name).name != name or "\\" in name or "/" in name:
        raise RecordingError(path, f"names file {name!r}, which is not a plain file name inside the recording.")
    target = root / name
    try:
        leads_out = target.resolve().parent != root.resolve()
    except (OSError, RuntimeError, ValueError):  # a name too long, a symlink loop...
        leads_out = True
    if leads_out:
        raise RecordingError(path, f"names file {name!r}, which leads outside the recording directory.")
    return target


def _field(obj: dict, key: str, kind: type, path: Path, where: str = "manifest") -> Any:
    value = obj.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RecordingError(path, f"{where}: `{key}` must be a {kind.__name__}, got {value!r}.")
    return value


def _check_samples(entry: dict[str, Any], path: Path, where: str) -> None:
    written = ManifestEntry(entry)
    if written.sample_ids is None:
        if written.sample_metadata is not None:
            raise RecordingError(path, f"{where} has `sample_metadata` without `sample_ids`.")
        return
    problem = check_sample_ids(written.sample_ids, written.sample_metadata)
    if problem is not None:
        raise RecordingError(path, f"{where}: {problem}.")
