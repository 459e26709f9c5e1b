"""One generation's header: what a recorded `generate()` call was, as capture describes it when its decoding
loop starts (and completes when it ends), as both stores keep it and as the reader reads it back from a
manifest entry. The one schema of a generation's metadata; docs/format.md gives the manifest's fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..codecs.spec import stored_as_records, stored_flat


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


    def to_manifest(self) -> dict[str, Any]:
        """The header as its manifest entry spells it, in the entry's order (what `from_manifest` reads back;
        the entry's streams carry `encodings`): the optional fields (`adapters`, `sample_ids` with
        `sample_metadata`, `layers`, `loop`, `nested_calls`) only where set, so that a recording without
        them reads as before them."""
        entry: dict[str, Any] = {
            "index": self.index,
            "mode": self.mode,
            "num_rows": self.num_rows,
            "num_beams": self.num_beams,
            "prompt_length": self.prompt_length,
            "prompt_lengths": None if self.prompt_lengths is None else list(self.prompt_lengths),
            "pad_token_id": self.pad_token_id,
            "eos_token_id": list(self.eos_token_id),
            "generation_config": self.generation_config,
        }
        if self.adapters is not None:  # a PEFT model's
            entry["adapters"] = self.adapters
        if self.sample_ids is not None:
            entry["sample_ids"] = list(self.sample_ids)
            entry["sample_metadata"] = None if self.sample_metadata is None else list(self.sample_metadata)
        if self.layers is not None:
            entry["layers"] = self.layers
        if self.loop is not None:  # a call that ran the loop several times
            entry["loop"] = self.loop
        if self.nested_calls:  # a loop that made generate() calls of its own
            entry["nested_calls"] = self.nested_calls
        return entry


# A generation's status in its manifest entry: still being written, ended normally, or not.
RECORDING, COMPLETE, FAILED = "recording", "complete", "failed"
STATUSES = (RECORDING, COMPLETE, FAILED)
# What a reader relies on in a generation's entry, with its JSON type: the fields every entry has, those that may
# be null (or absent), and the counts that must not be negative (`store.manifest` checks them).
ENTRY_FIELDS = {"index": int, "status": str, "mode": str, "num_steps": int, "num_rows": int, "num_beams": int,
                "prompt_length": int, "streams": dict, "shards": list, "eos_token_id": list, "generation_config": dict}
NULLABLE_FIELDS = {"error": str, "pad_token_id": int, "sequences": str, "prompt_lengths": list}
COUNT_FIELDS = ("num_steps", "num_rows", "prompt_length")
POSITIVE_FIELDS = ("num_beams",)
ID_LIST_FIELDS = ("eos_token_id", "prompt_lengths")  # lists of non-negative integers


@dataclass(frozen=True)
class ShardEntry:
    """One committed shard in a generation's entry: its `file` holds steps `[first_step, first_step + num_steps)`."""

    file: str
    first_step: int
    num_steps: int

    FIELDS = (("file", str), ("first_step", int), ("num_steps", int))  # as the manifest spells them, with their types

    @classmethod
    def from_manifest(cls, shard: dict[str, Any]) -> ShardEntry:
        """The shard of a manifest entry already checked by `manifest`."""
        return cls(**{key: shard[key] for key, _ in cls.FIELDS})

    def to_manifest(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key, _ in self.FIELDS}


@dataclass(frozen=True)
class StreamEntry:
    """One stream of a generation's entry: its stored `dtype` and per-step `shape` (`None` for a length that
    varies), its `encoding` (`codecs.spec`), and for records that read back as dense tensors (`"sparse"`,
    `"native"`, packed top-k) those tensors' dtype and shape (`dense_dtype`, `dense_shape`)."""

    dtype: str
    shape: list[Any]
    encoding: str
    dense: dict[str, Any] | None = None

    FIELDS = (("dtype", str), ("shape", list), ("encoding", str))  # as the manifest spells them, with their types

    @classmethod
    def from_manifest(cls, stream: dict[str, Any]) -> StreamEntry:
        """The stream of a manifest entry whose `FIELDS` were checked (`manifest`)."""
        return cls(stream["dtype"], stream["shape"], stream["encoding"], stream.get("dense"))

    def to_manifest(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"dtype": self.dtype, "shape": self.shape, "encoding": self.encoding}
        if self.dense is not None:
            entry["dense"] = self.dense
        return entry

    @staticmethod
    def dense_of(dtype: str, shape: list[int]) -> dict[str, Any]:
        """The `dense` part of records that read back as `(rows, vocab)` tensors of `dtype`."""
        return {"dtype": dtype, "shape": shape}

    @property
    def dense_dtype(self) -> Any:
        """The dtype of what the records read back as (None: not records, or damaged)."""
        return self.dense.get("dtype") if isinstance(self.dense, dict) else None

    @property
    def dense_shape(self) -> Any:
        """The `[rows, vocab]` of what the records read back as (None: not records, or damaged)."""
        return self.dense.get("shape") if isinstance(self.dense, dict) else None

    @property
    def as_records(self) -> bool:
        """One flat int32 record per step (`codecs.spec.stored_as_records`)."""
        return stored_as_records(self.encoding, self.dtype)

    @property
    def flat(self) -> bool:
        """Stored flat, the steps' shapes beside it (`codecs.spec.stored_flat`)."""
        return stored_flat(self.encoding, self.dtype)


def stream_entries(streams: dict[str, Any]) -> dict[str, StreamEntry]:
    """A manifest's streams (checked), by name, in order."""
    return {name: StreamEntry.from_manifest(stream) for name, stream in streams.items()}


@dataclass(frozen=True)
class OnceEntry:
    """The file of a generation's streams recorded once per call: the prompt logprobs alone, or an encoder's
    outputs (with the prompt logprobs, if any)."""

    file: str
    streams: dict[str, StreamEntry]

    FIELDS = (("file", str), ("streams", dict))
    # The entry's key for each kind of file (one at most): `"encoder"` for an encoder's outputs (with any prompt
    # logprobs beside them), `"prompt"` for prompt logprobs alone (format 1 also allows these under `"encoder"`).
    KEYS = ("encoder", "prompt")

    @classmethod
    def of(cls, entry: dict[str, Any]) -> OnceEntry | None:
        """The once-per-call file a (checked) entry names, or None."""
        found = next((entry[key] for key in cls.KEYS if entry.get(key)), None)
        return None if found is None else cls(found["file"], stream_entries(found["streams"]))

    @staticmethod
    def unchecked_streams(once: dict[str, Any]) -> dict[str, Any]:
        """A once-per-call entry's streams as the manifest holds them (its `FIELDS` checked), for `manifest`."""
        return once["streams"]

    @classmethod
    def unchecked(cls, entry: dict[str, Any]) -> dict[str, Any]:
        """Per key of `KEYS` the entry holds, its value as the manifest holds it, for `manifest` to check."""
        return {key: entry[key] for key in cls.KEYS if entry.get(key) is not None}


class ManifestEntry:
    """A generation's entry in a recording's manifest, as the spill writes it: opened with the header when the
    call's loop starts (status `"recording"`), given its streams, shards and files as they are committed, and
    closed with a status. `data` is the entry itself, the dict the manifest holds (written as JSON)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    @classmethod
    def opened(cls, header: GenerationHeader, *, writer: str) -> ManifestEntry:
        """A new entry for `header`'s generation, written by `writer` (the process's ledger token)."""
        fields = header.to_manifest()
        data = {"index": fields.pop("index"), "status": RECORDING, "error": None, "mode": fields.pop("mode"),
                "num_steps": 0}
        data.update((key, fields.pop(key)) for key in ("num_rows", "num_beams", "prompt_length", "prompt_lengths",
                                                        "pad_token_id", "eos_token_id", "generation_config"))
        data.update(streams={}, shards=[], sequences=None, writer=writer)
        # The optional fields known now; `layers` comes at the first forward, `loop` and `nested_calls` at `close`.
        data.update((key, value) for key, value in fields.items() if key in ("adapters", "sample_ids", "sample_metadata"))
        return cls(data)

    @property
    def index(self) -> int:
        return self.data["index"]

    @property
    def status(self) -> str:
        return self.data["status"]

    @property
    def error(self) -> str | None:
        return self.data.get("error")

    @property
    def num_steps(self) -> int:
        """The steps committed (in shards)."""
        return self.data["num_steps"]

    @property
    def writer(self) -> str | None:
        return self.data.get("writer")

    @property
    def streams(self) -> dict[str, StreamEntry]:
        """The per-step streams (empty until the first shard), by name, in order."""
        return stream_entries(self.data["streams"])

    @property
    def streams_known(self) -> bool:
        """Whether the per-step streams are written (from the first shard on), without parsing them."""
        return bool(self.data["streams"])

    @property
    def unchecked_streams(self) -> Any:
        """The streams as the manifest holds them, for `manifest` to check."""
        return self.data["streams"]

    @property
    def once(self) -> OnceEntry | None:
        """The file of the streams recorded once per call, or None."""
        return OnceEntry.of(self.data)

    @property
    def layers(self) -> Any:
        return self.data.get("layers")

    @property
    def sample_ids(self) -> Any:
        return self.data.get("sample_ids")

    @property
    def sample_metadata(self) -> Any:
        return self.data.get("sample_metadata")

    @property
    def shards(self) -> list[ShardEntry]:
        """The committed shards, in step order."""
        return [ShardEntry.from_manifest(shard) for shard in self.data["shards"]]

    @property
    def unchecked_shards(self) -> list[Any]:
        """The shards as the manifest holds them (JSON objects, or damage), for `manifest` to check."""
        return self.data["shards"]

    @property
    def sequences(self) -> str | None:
        """The sequences file's name, or None."""
        return self.data.get("sequences")

    def set_layers(self, layers: dict[str, Any]) -> None:
        """The layer selection (`GenerationHeader.layers`), known at the call's first forward."""
        self.data["layers"] = layers

    def set_streams(self, streams: dict[str, StreamEntry], *, num_rows: int) -> None:
        """The per-step streams, in order, and the rows of a step: at the first shard."""
        self.data["num_rows"] = num_rows
        self.data["streams"] = {name: stream.to_manifest() for name, stream in streams.items()}

    def commit_shard(self, file: str, first_step: int, num_steps: int) -> None:
        """A shard holding steps `[first_step, first_step + num_steps)` is durable as `file`."""
        self.data["shards"].append(ShardEntry(file, first_step, num_steps).to_manifest())
        self.data["num_steps"] = first_step + num_steps

    def commit_once(self, file: str, streams: dict[str, StreamEntry], *, prompt_only: bool) -> None:
        """The streams recorded once per generation are durable as `file`: the prompt logprobs alone
        (`prompt_only`), or an encoder's outputs with them."""
        self.data["prompt" if prompt_only else "encoder"] = {
            "file": file, "streams": {name: stream.to_manifest() for name, stream in streams.items()}}

    def commit_sequences(self, file: str) -> None:
        """What generate() returned is durable as `file`."""
        self.data["sequences"] = file

    def close(self, header: GenerationHeader, num_steps: int, problem: BaseException | None) -> None:
        """The call ended, having run `num_steps` steps (only those committed count), with `header` complete
        (its rows, loop and nested calls), ended by `problem` (None: it completed)."""
        self.data["num_steps"] = min(self.data["num_steps"], num_steps)
        if not self.data["num_rows"]:
            self.data["num_rows"] = header.num_rows
        fields = header.to_manifest()
        for key in ("loop", "nested_calls"):  # only where set: others read the same without them
            if key in fields:
                self.data[key] = fields[key]
        self.data["status"] = COMPLETE if problem is None else FAILED
        self.data["error"] = None if problem is None else repr(problem)

    def stopped(self, when: str) -> str:
        """Why a generation still `"recording"` has no end: its process stopped `when` (killed, or still
        running), after its committed steps."""
        return f"the recording process stopped before this generation ended ({when}): {self.num_steps} step(s) were committed"

    def fail_stopped(self) -> None:
        """Mark a generation its process left `"recording"` (killed) as failed, saying so."""
        self.data["status"] = FAILED
        self.data["error"] = self.stopped("killed")


@dataclass(frozen=True)
class Samples:
    """The prompts' ids of a call's batch, in batch order, and each one's metadata (`Recorder.set_samples`): what
    the header keeps as `sample_ids` and `sample_metadata`."""

    ids: tuple[Any, ...]
    metadata: tuple[dict[str, Any], ...] | None = None

    def of_rows(self, rows: list[int]) -> Samples | None:
        """The samples of the batch rows `rows` (a loop that decodes some of the call's prompts), or None where
        those rows are not each a prompt of its own (a row past the ids, or a prompt repeated)."""
        if not all(row < len(self.ids) for row in rows):
            return None
        picked = tuple(self.ids[row] for row in rows)
        if len(set(map(str, picked))) != len(picked):
            return None
        return Samples(picked, None if self.metadata is None else tuple(self.metadata[row] for row in rows))


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
