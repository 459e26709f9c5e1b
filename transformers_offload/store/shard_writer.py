"""One `generate()` call's shards: steps drained from the ring are packed into shards that a background
thread writes (`Spill`, in `spill`, opens one `ShardStore` per call). The store copies each drained step into a shard
buffer (one contiguous `(steps, *shape)` tensor per stream) and, once every stream of every step of a
shard is in, hands the buffer to its writer thread, which writes the shard under a temporary name,
fsyncs it, renames it, and then replaces the manifest. So the manifest only ever names complete,
durable shards, whatever happens to the process afterwards.

At most `MAX_SHARD_BUFFERS` shard buffers exist per call (one being filled, one waiting, one being
written; beam search briefly fills two, because a step's token is known one step later). `generate()`
waits only when all of them are taken and the writer holds one, and such waits are counted. Assisted
decoding writes candidate steps ahead of the accepted ones: while every buffer is still being filled,
one more is taken (as many as the candidates span).
"""

from __future__ import annotations

import errno
import queue
import threading
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from safetensors.torch import save_file

from .. import _compat, _interrupts
from ..codecs.dtypes import dtype_name
from ..codecs.sparse import SPARSE_DTYPES, SPARSE_HEADER, sparse_dense
from ..codecs.spec import RECORD_ENCODINGS, SAME_AS_LOGITS, is_packed
from ..errors import SpillError
from . import files as _files
from . import heap as _heap
from . import layout as _layout
from .header import GenerationHeader, ManifestEntry, StreamEntry
from .shard_buffer import ShardBuffer
from .shard_reader import stored_generation
from .stored import StoredGeneration, TransferStats


class SpillDirectory(Protocol):
    """What a `ShardStore` uses of the `Spill` that opens it: the directory, its manifest (updated in
    place, then written whole) and the target shard size in bytes."""

    root: Path
    manifest: dict[str, Any]
    shard_bytes: int | None  # None: sized per call (`shard_size`)


MAX_SHARD_BUFFERS = 3
MIN_SHARD_BYTES, MAX_SHARD_BYTES = 8 * 2**20, 64 * 2**20


def shard_size(call_bytes: int) -> int:
    """The target size of a shard, in bytes, for a call whose steps can take `call_bytes` in all (every stream,
    at the most steps it can run; for `score`, a batch's scored logits in float32): a 128th of them, at least
    8 MiB, at most 64 MiB (reached where a call can take 8 GiB). The writer holds up to `MAX_SHARD_BUFFERS`
    shard buffers at once (one filling, one being written, one more while the writer lags), so a call's host
    buffers follow what its steps need: 24 MiB for a call of up to 1 GiB, 192 MiB from 8 GiB. A 128th adds about
    2% to what `score`'s forward of a batch holds (bench/README.md); the floor keeps small calls from writing
    many small files, each synced to disk."""
    return max(MIN_SHARD_BYTES, min(MAX_SHARD_BYTES, call_bytes // 128))


@dataclass
class _Counters:
    waits: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0


class ShardStore:
    """Packs one generation's drained steps into shards and writes them on a background thread."""

    keep = None  # the ring drains whole steps into it (`drain`), not tensor by tensor

    def __init__(self, spill: SpillDirectory, entry: ManifestEntry, names: list[str], max_steps: int, *,
                 encodings: dict[str, str]) -> None:
        self._spill = spill
        self._max_steps = max_steps
        self._entry = entry
        self._names = list(names)
        self._encodings = dict(encodings)  # stream -> its encoding, where not dense
        # Streams stored as one flat int32 record per step (sparse, native, packed top-k and sampled).
        self._record_streams = {name for name, encoding in self._encodings.items()
                                 if encoding in RECORD_ENCODINGS or is_packed(encoding)}
        self._ragged: set[str] = set()  # per-layer streams (attentions, hidden states)
        self._once: set[str] = set()  # the encoder's outputs, at step 0 only
        self._size_hints: dict[str, int] = {}  # ragged streams: elements per shard, estimated
        self._capacity = 0  # steps per shard, fixed by the first drained step
        self._open: dict[int, ShardBuffer] = {}
        self._sealed_until = 0  # steps below this are in shards handed to the writer
        self._free: list[ShardBuffer] = []
        self._allocated = 0
        self._released = threading.Condition()
        # Jobs for the writer: (what to write, or None; the shard buffer to hand back, or None).
        self._jobs: queue.Queue[tuple[Callable[[], None] | None, ShardBuffer | None] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._raised = False
        self.counters = _Counters()
        self.failure: SpillError | None = None
        self._thread = threading.Thread(target=self._write_jobs, name="transformers-offload-writer", daemon=True)
        self._thread.start()

    # -- the generate() thread ---------------------------------------------------------------------------
    def add_once(self, once: list[str]) -> None:
        """More streams recorded at step 0 only, in the call's once-per-call file (prompt logprobs)."""
        self._once.update(once)

    def add_streams(self, names: list[str], once: list[str], layers: dict[str, Any]) -> None:
        """More streams, before the first drain: per-layer `names` recorded every step (ragged), and
        `once` (the encoder's outputs, at step 0, written to a file of their own); `layers` is the
        manifest's `layers` entry."""
        self._names += names
        self._ragged.update(names)
        self._once.update(once)
        self._entry.set_layers(layers)

    def drain(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """Copy one step's host tensors into its shard buffer; hand over every shard that is complete."""
        if self._raised:
            return  # a failure was raised in generate(); what remains is not written
        taken = False
        try:
            self._raise_failure()
            once = {name: tensors[name] for name in self._once if name in tensors}
            tensors = {name: tensor for name, tensor in tensors.items() if name not in once}
            if not self._capacity:
                self._capacity = self._steps_per_shard(tensors)
            if step < self._sealed_until:
                raise RuntimeError(
                    f"transformers-offload: step {step} arrived after its shard was written; please "
                    "report this with your transformers version."
                )
            buffer = self._buffer_for(step // self._capacity)  # may wait for the writer
            taken = True
            if once:  # a copy: the ring reuses its buffers
                self._jobs.put((partial(self._write_encoder, {name: t.clone() for name, t in once.items()}), None))
            for name, tensor in tensors.items():
                if name in self._ragged:
                    buffer.put_ragged(name, step, tensor, self._size_hints.get(name, 0))
                elif name in self._record_streams:
                    buffer.put_record(name, step, tensor)
                else:
                    buffer.put(name, step, tensor)
        except KeyboardInterrupt:
            # Ctrl-C while waiting for a shard buffer: nothing of the step was taken, and the ring
            # hands it over again. Later (a second Ctrl-C mid-copy), the step is half taken: stop.
            self._raised = taken
            raise
        except BaseException:
            self._raised = True  # later steps would leave a gap: keep what is complete so far
            raise
        while self._open:
            first = min(self._open)
            if not self._open[first].full(self._names):
                break
            sealed = self._open.pop(first)
            self._sealed_until = sealed.first_step + sealed.capacity
            self._jobs.put((partial(self._write_shard, sealed, sealed.capacity), sealed))

    def has(self, name: str, step: int) -> bool:
        """Whether `step` of stream `name` reached the store."""
        if step < self._sealed_until:
            return True
        buffer = self._open.get(step // self._capacity) if self._capacity else None
        return buffer is not None and step in buffer.filled.get(name, ())

    def finish(self, num_steps: int, header: GenerationHeader, sequences: torch.Tensor | None,
               error: BaseException | None, *, ring_waits: int) -> StoredGeneration:
        """Write what is left of the first `num_steps` steps, wait for the writer, close the manifest entry."""
        for index in sorted(self._open):
            buffer = self._open.pop(index)
            count = min(buffer.capacity, num_steps - buffer.first_step)
            self._jobs.put((partial(self._write_shard, buffer, count) if count > 0 else None, buffer))
        if sequences is not None:
            self._jobs.put((partial(self._write_sequences, sequences), None))  # after the last shard
        self._jobs.put(None)
        with _interrupts.waiting("writer"):
            self._thread.join()
        entry = self._entry
        if self._error is not None and self.failure is None:
            self.failure = self._as_spill_error(self._error)
        problem = error if error is not None else self.failure
        while True:
            if problem is None and _interrupts.pending():
                problem = KeyboardInterrupt()  # Ctrl-C held while the call ended: it raises next
            entry.close(header, num_steps, problem)
            try:
                _files.write_manifest(self._spill.root, self._spill.manifest)
            except OSError as write_error:
                if problem is None:
                    self.failure = self._as_spill_error(write_error)
                # Otherwise the previous manifest stays: it names every committed shard.
                break
            if problem is not None or not _interrupts.pending():
                break  # else a Ctrl-C came during the write: the call fails, and says so
        transfer = TransferStats(waits=ring_waits + self.counters.waits, bytes_written=self.counters.bytes_written,
                                 write_seconds=self.counters.write_seconds)
        return stored_generation(self._spill.root, dict(entry.data), transfer=transfer)

    def _steps_per_shard(self, tensors: dict[str, torch.Tensor]) -> int:
        """Steps per shard, from the first drained step (step 0): about `shard_bytes` a shard (by default
        `shard_size` of what the call's steps can take, at the most steps it can run).

        A ragged stream's step 0 is the prefill; a later step holds one position, and self-attention
        one more key per step: it is counted at the size of the last step the call can run.
        """
        rows = next((t.shape[0] for name, t in tensors.items() if name not in self._record_streams and t.dim()), 1)
        sizes = {}
        for name in self._names:
            tensor = tensors.get(name)
            if tensor is None:
                sizes[name] = rows * 8
            elif name in self._ragged and tensor.dim() >= 2:
                size = tensor.nbytes / max(1, tensor.shape[-2])
                if _layout.split_layer_stream(name)[0] in _layout.GROWING_KINDS:
                    size *= (tensor.shape[-1] + self._max_steps) / max(1, tensor.shape[-1])
                sizes[name] = size
            elif name in self._record_streams and is_packed(self._encodings[name]):
                # Top-k or sampled: a step's values narrower than the dense dtype (native) take at most
                # twice as many bytes in a later step.
                sizes[name] = 2 * tensor.nbytes
            elif name in self._record_streams:
                # At most the dense step (plus its header): shards are sized for the worst case, so
                # that three shard buffers stay bounded whatever the rows hold.
                rows_of, vocab, code = tensor[: SPARSE_HEADER].tolist()
                sizes[name] = max(tensor.nbytes, rows_of * vocab * SPARSE_DTYPES[code].itemsize)
            else:
                sizes[name] = tensor.nbytes
        step_bytes = max(1, int(sum(sizes.values())))
        target = self._spill.shard_bytes or shard_size(step_bytes * min(self._max_steps, 2**32))
        capacity = int(max(1, min(self._max_steps, target // step_bytes)))
        for name in self._ragged:
            if name in tensors:
                self._size_hints[name] = int(min(capacity * sizes[name], 2**40) // tensors[name].element_size())
        return capacity

    def _buffer_for(self, index: int) -> ShardBuffer:
        buffer = self._open.get(index)
        if buffer is not None:
            return buffer
        with self._released:
            # Wait only for a buffer the writer holds: when every buffer is still being filled (assisted
            # decoding writes candidate steps ahead of the accepted ones), waiting would never end, and
            # one more buffer is taken instead.
            with_writer = self._allocated - len(self._open) - len(self._free)
            if not self._free and self._allocated >= MAX_SHARD_BUFFERS and with_writer > 0:
                self.counters.waits += 1
                with _interrupts.waiting("shard buffer"):
                    while not self._free and self._error is None:
                        self._released.wait()
            self._raise_failure()
            if self._free:
                buffer = self._free.pop()
            else:
                buffer = ShardBuffer()
                self._allocated += 1
        buffer.reset(index, self._capacity)
        self._open[index] = buffer
        return buffer

    def _raise_failure(self) -> None:
        if self._error is not None:
            self.failure = self._as_spill_error(self._error)
            self._raised = True
            raise self.failure from self._error

    def _as_spill_error(self, error: BaseException) -> SpillError:
        if isinstance(error, SpillError):
            return error
        steps = self._entry.num_steps
        code = getattr(error, "errno", None) or _compat.errno_in_message(str(error)) or errno.EIO
        return SpillError(
            code,
            f"transformers-offload could not write the recording in {str(self._spill.root)!r}: "
            f"{error}. The {steps} step(s) already written are intact and readable with "
            "`open_recording`; free some space (or pick another `spill_dir`) and run again.",
        )

    # -- the writer thread -----------------------------------------------------------------------------
    def _write_jobs(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            write, buffer = job
            try:
                if write is not None and self._error is None:
                    write()
                    if buffer is not None:  # a shard: its blocks and the step's are freed by now
                        _heap.release_free_pages()
            except BaseException as error:  # reported to generate() at its next step, or at the end
                self._error = error
            finally:
                if buffer is not None:
                    with self._released:
                        self._free.append(buffer)
                        self._released.notify_all()

    def _write_shard(self, buffer: ShardBuffer, count: int) -> None:
        entry = self._entry
        name = _layout.shard_name(entry.index, buffer.index)
        tensors = {stream: buffer.tensors[stream][:count] for stream in self._names
                   if stream not in self._ragged and stream not in self._record_streams}
        shapes = {}
        for stream in self._ragged:
            tensors[stream], shapes[stream] = buffer.ragged(stream, count)
            tensors[_layout.shapes_key(stream)] = shapes[stream]
        for stream in self._record_streams:
            tensors[stream], tensors[_layout.shapes_key(stream)] = buffer.records_of(stream, count)
        started = time.perf_counter()
        size = self._commit(name, tensors, _layout.shard_metadata(entry.index, buffer.first_step))
        if not entry.streams_known:
            streams = {}
            for stream in self._names:
                if stream in self._ragged:
                    continue
                encoding = self._encodings.get(stream, "dense")
                if stream in self._record_streams:  # one flat int32 record per step, and what it decodes to
                    header = buffer.records[stream][buffer.first_step][: SPARSE_HEADER].tolist()
                    streams[stream] = StreamEntry(dtype_name(tensors[stream].dtype), [None], encoding,
                                                  dense=StreamEntry.dense_of(*sparse_dense(header)))
                else:
                    streams[stream] = StreamEntry(dtype_name(tensors[stream].dtype), list(tensors[stream].shape[1:]),
                                                  encoding)
            if self._encodings.get("scores") == SAME_AS_LOGITS:  # no data of its own: the logits'
                streams = _with_scores_as_logits(streams)
            for stream in sorted(self._ragged, key=self._names.index):
                streams[stream] = StreamEntry(dtype_name(tensors[stream].dtype),
                                              _layout.ragged_shape(stream, tuple(shapes[stream][0].tolist())), "ragged")
            entry.set_streams(streams, num_rows=int(tensors["tokens"].shape[1]))
        entry.commit_shard(name, buffer.first_step, count)
        _files.write_manifest(self._spill.root, self._spill.manifest)
        self.counters.write_seconds += time.perf_counter() - started
        self.counters.bytes_written += size

    def _write_encoder(self, tensors: dict[str, torch.Tensor]) -> None:
        entry = self._entry
        prompt_only = all(key in _layout.PROMPT_STREAMS for key in tensors)
        name = (_layout.prompt_name if prompt_only else _layout.encoder_name)(entry.index)
        tensors = {key: tensor.contiguous() for key, tensor in tensors.items()}
        self._commit(name, tensors, _layout.shard_metadata(entry.index, 0))
        streams = {key: StreamEntry(dtype_name(tensor.dtype), list(tensor.shape), "dense")
                   for key, tensor in sorted(tensors.items(), key=lambda item: _once_order(item[0]))}
        entry.commit_once(name, streams, prompt_only=prompt_only)
        _files.write_manifest(self._spill.root, self._spill.manifest)

    def _write_sequences(self, sequences: torch.Tensor) -> None:
        name = _layout.sequences_name(self._entry.index)
        self._commit(name, {"sequences": sequences.contiguous()}, None)
        self._entry.commit_sequences(name)

    def _commit(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> int:
        """Write one safetensors file of the recording durably, and note its size and checksum in the
        manifest's `files` (the manifest written next names it). Returns its size in bytes."""
        # Each tensor's bytes, for the checksum (computed from memory, not read back from the file).
        contents = {key: tensor.contiguous().reshape(-1).view(torch.uint8).numpy() for key, tensor in tensors.items()}
        record = _files.write_atomically(
            self._spill.root / name, lambda temporary: save_file(tensors, temporary, metadata=metadata), checksum=True,
            drop_cache=True, contents=contents,
        )
        self._spill.manifest["files"][name] = record
        return record["bytes"]


def _once_order(name: str) -> tuple:
    """Once-per-call streams in the manifest: encoder layers by output and layer, then the prompt's."""
    split = _layout.split_layer_stream(name)
    if split is not None:
        return (0, split, 0)
    return (1, ("", 0), _layout.PROMPT_STREAMS.index(name))


def _with_scores_as_logits(streams: dict[str, StreamEntry]) -> dict[str, StreamEntry]:
    """The manifest's streams with `scores` right after `logits`, stored as them (`SAME_AS_LOGITS`)."""
    found: dict[str, StreamEntry] = {}
    for name, stream in streams.items():
        found[name] = stream
        if name == "logits":
            found["scores"] = replace(stream, encoding=SAME_AS_LOGITS)
    return found
