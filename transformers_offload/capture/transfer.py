"""The transfer: a bounded ring of host slots that each step's tensors are copied into.

A step's captured tensors (raw logits, processed scores, tokens, finished mask...) are copied into one
slot as soon as they exist, inside the step that produced them.

On CUDA nothing in the per-step path waits for the device:

1. the tensor is first copied on the device, on the stream that computed it, into the slot's staging
   buffer (a device-to-device copy, ordered before any later in-place edit of the tensor);
2. a side stream waits on an event recorded after that copy, copies the staging buffer into the
   slot's pinned host buffer (`non_blocking=True`) and records the slot's event;
3. a drainer thread waits on the slot's event and hands the host buffers to the store (which keeps
   its own copy), so neither that wait nor the store's host copy runs in `generate()`'s thread.

`generate()`'s thread waits only when it needs a slot the drainer has not released yet (counted in
`waits`). On CPU the same ring runs with plain copies and drains in the calling thread
(`Tensor.to("cpu")` would return the very tensor that later processors modify in place, so the ring
always copies). A store that keeps each tensor as it comes (`keep`: the in-memory store) takes a CPU
tensor straight from `put` instead, its own copy the only one: no slot, no second copy, no hand-over.

A step's slot is handed to the store once the ring has moved two steps past it (beam search learns a
step's token and parent one step later), or earlier when the ring needs the slot back.

A slot keeps one flat buffer per stream and views it in each step's shape, so streams whose shape
changes from step to step (attentions gain a key per step) reuse it; it grows (at least doubling)
only when a step needs more room.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from .. import _interrupts

Drain = Callable[[int, dict[str, torch.Tensor]], None]
Keep = Callable[[int, str, torch.Tensor], None]


class Encoder(Protocol):
    """A stream encoded in two parts on CUDA (`codecs.sparse.Sparse`): one where the tensor is, one
    on the host once that part's result has arrived (`fetch` gives rows of the step's tensor, whole);
    a CPU tensor is encoded at once (`on_cpu`, the same record)."""

    def on_device(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def on_host(self, fixed: torch.Tensor, *, vocab: int, dtype: torch.dtype,
                fetch: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor: ...

    def on_cpu(self, tensor: torch.Tensor) -> torch.Tensor: ...


@dataclass
class _Slot:
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # flat, host (pinned on CUDA)
    staging: dict[str, torch.Tensor] = field(default_factory=dict)  # flat, device, CUDA only
    views: dict[str, torch.Tensor] = field(default_factory=dict)  # this step's host tensors
    # the last view of each buffer, by (stream, device), handed out again while shape and dtype hold
    shaped: dict[tuple[str, torch.device], torch.Tensor] = field(default_factory=dict)
    written: list[str] = field(default_factory=list)
    step: int | None = None
    submitted: bool = False
    # CUDA, per two-part encoded stream: (encoder, its device part's result, the staging view, vocab, dtype)
    encoded: dict[str, tuple] = field(default_factory=dict)
    copied: dict[torch.device, torch.cuda.Event] = field(default_factory=dict)  # per device, on the side stream
    staged: dict[torch.device, torch.cuda.Event] = field(default_factory=dict)  # per device, on the compute stream
    free: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.free.set()


class HostRing:
    """A bounded ring of host slots, one slot per step in flight.

    Args:
        slots (`int`): number of host slots (steps in flight), at least 1.
        drain (`Callable[[int, dict[str, torch.Tensor]], None]`): called with a step and its host tensors
            (CPU, read-only views of the slot: the callee copies what it keeps), in step order.
        threaded (`bool`, *optional*, defaults to False): drain in a background thread (the CUDA path),
            so that `put` never waits for a device copy unless the ring is full. A failure of `drain`
            is then raised by the next `put` or by `flush`.
        keep (`Callable[[int, str, torch.Tensor], None]`, *optional*): without `threaded`, a store's
            copy of one CPU tensor of a step, made at once: a CPU tensor put goes there instead of
            through a slot (the in-memory store's `keep`).
    """

    def __init__(self, slots: int, drain: Drain, *, threaded: bool = False, keep: Keep | None = None) -> None:
        self._slots = [_Slot() for _ in range(slots)]
        self._drain = drain
        self._keep = None if threaded else keep
        self._current = -1
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._queue: queue.SimpleQueue[_Slot | None] | None = None
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None  # what the drainer thread's drain raised
        self._failure_raised = False
        if threaded:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._drainer, name="transformers-offload-drain", daemon=True)
            self._thread.start()
        self.waits = 0  # times the caller had to wait for a slot (a device copy or a drain still running)

    def put(self, step: int, stream: str, tensor: torch.Tensor, *, encoder: Encoder | None = None) -> None:
        """Copy `tensor` (any device) into the host slot of `step`, under the name `stream`; with
        `encoder`, what reaches the store is its encoding of `tensor` (on CUDA: its device part runs
        on the side stream over the staging copy, its host part before the drain).

        Raises:
            BaseException: what the drain raised for an earlier step (threaded ring).
        """
        if self._failure is not None:
            self._raise_drain_error()
        if self._keep is not None and not tensor.is_cuda:
            # Straight into the store: its copy is made now, before any later in-place edit of `tensor`.
            self._keep(step, stream, tensor if encoder is None else encoder.on_cpu(tensor))
            return
        current = self._slots[self._current]  # most puts go to the step in the current slot
        slot = current if current.step == step and not current.submitted else self._slot_for(step)
        if encoder is not None and not tensor.is_cuda:
            # On the host the record is made now, before any later in-place edit of `tensor`.
            slot.views[stream] = encoder.on_cpu(tensor)
            slot.encoded.pop(stream, None)
        elif encoder is not None:
            self._copy_from_cuda(slot, stream, tensor, None, encoder=encoder)
        else:
            buffer = _view(slot, slot.buffers, stream, tensor, _CPU, pinned=tensor.is_cuda)
            slot.views[stream] = buffer
            slot.encoded.pop(stream, None)
            if tensor.device.type == "cuda":
                self._copy_from_cuda(slot, stream, tensor, buffer)
            else:
                buffer.copy_(tensor)
        slot.written.append(stream)

    def flush(self) -> None:
        """Drain every occupied slot in step order and wait until the store has them all.

        Raises:
            BaseException: what the drain raised (threaded ring).
        """
        # Only slots not yet handed over: the drainer thread resets the step of those it released.
        for slot in self._occupied(submitted=False):
            self._submit(slot)
        if self._queue is not None:
            self._queue.put(None)
            with _interrupts.waiting("flush"):
                self._thread.join()
            self._queue = None
        # Anything still occupied was never drained (an interrupt left it in its slot): drain it here.
        for slot in self._occupied():
            self._release(slot)
        self._raise_drain_error()

    def _occupied(self, *, submitted: bool | None = None) -> list[_Slot]:
        """The slots holding a step, oldest first (`submitted`: only those handed over, or not)."""
        slots = [s for s in self._slots if s.step is not None and submitted in (None, s.submitted)]
        return sorted(slots, key=lambda s: s.step)

    # -- the generate() side -------------------------------------------------------------------------
    def _slot_for(self, step: int) -> _Slot:
        for slot in self._slots:  # a step still held takes late entries (beam search's tokens)
            if slot.step == step and not slot.submitted:
                return slot
        # A new step: hand over every slot two or more steps behind it, oldest first.
        for slot in self._occupied(submitted=False):
            if slot.step <= step - 2:
                self._submit(slot)
        self._current = (self._current + 1) % len(self._slots)
        slot = self._slots[self._current]
        if slot.step is not None:
            self._submit(slot)  # the ring is short: the slot goes before its two steps are up
        if not slot.free.is_set():
            self.waits += 1
            with _interrupts.waiting("ring slot"):
                slot.free.wait()
            self._raise_drain_error()
        slot.step = step
        slot.submitted = False
        return slot

    def _submit(self, slot: _Slot) -> None:
        if slot.submitted or slot.step is None:
            return
        slot.submitted = True
        slot.free.clear()
        if self._queue is not None:
            self._queue.put(slot)
            return
        if any(not event.query() for event in slot.copied.values()):
            self.waits += 1  # the copy is still in flight: the host waits for it
        self._release(slot)

    def _copy_from_cuda(self, slot: _Slot, stream: str, tensor: torch.Tensor, buffer: torch.Tensor | None, *,
                        encoder: Encoder | None = None) -> None:
        device = tensor.device
        compute = torch.cuda.current_stream(device)
        side = self._side_stream(device)
        staging = _view(slot, slot.staging, stream, tensor, device, pinned=False)
        copied = slot.copied.get(device)
        if copied is not None and stream in slot.written:
            # This step's `stream` is written again: its first copy may still read the staging buffer.
            # (Other waits are not needed: a reused slot was drained, so its copies are done.)
            compute.wait_event(copied)
        staging.copy_(tensor)  # on the compute stream: before any later in-place edit of `tensor`
        staged = slot.staged.get(device)
        if staged is None:
            staged = slot.staged[device] = torch.cuda.Event()
        staged.record(compute)
        side.wait_event(staged)
        with torch.cuda.stream(side):
            if encoder is not None:
                # The device part, on the side stream: the compute stream never waits for it. Its
                # result stays referenced by the slot until the copy below has finished.
                fixed = encoder.on_device(staging)
                buffer = _view(slot, slot.buffers, stream, fixed, _CPU, pinned=True)
                slot.views[stream] = buffer
                slot.encoded[stream] = (encoder, fixed, staging, tensor.shape[-1], tensor.dtype)
            buffer.copy_(fixed if encoder is not None else staging, non_blocking=True)
        if copied is None:
            copied = slot.copied[device] = torch.cuda.Event()
        copied.record(side)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        side = self._copy_streams.get(device)
        if side is None:
            side = self._copy_streams[device] = torch.cuda.Stream(device=device)
        return side

    def _finish_encoded(self, slot: _Slot) -> None:
        """The host part of each two-part encoded stream of a slot whose copies have finished (CUDA)."""
        for name in list(slot.encoded):
            encoder, _, staging, vocab, dtype = slot.encoded[name]
            side = self._side_stream(staging.device)

            def fetch(rows: torch.Tensor, staging: torch.Tensor = staging, side: torch.cuda.Stream = side) -> torch.Tensor:
                with torch.cuda.stream(side):  # after the staging copy; waits in this thread only
                    return staging.index_select(0, rows.to(staging.device)).cpu()

            slot.views[name] = encoder.on_host(slot.views[name], vocab=vocab, dtype=dtype, fetch=fetch)
            del slot.encoded[name]  # done: a slot handed over again (after a Ctrl-C) keeps the record

    def _raise_drain_error(self) -> None:
        if self._failure is not None and not self._failure_raised:
            self._failure_raised = True
            raise self._failure

    # -- the store side --------------------------------------------------------------------------------
    def _release(self, slot: _Slot) -> None:
        try:
            if self._failure is None:  # after a failure nothing more reaches the store
                for event in slot.copied.values():
                    event.synchronize()
                self._finish_encoded(slot)
                self._drain(slot.step, {name: slot.views[name] for name in slot.written})
        except KeyboardInterrupt:
            # Ctrl-C while the store waited for room (in the caller's thread): the step keeps its slot,
            # and `flush` hands it over again.
            slot.submitted = False
            slot.free.set()
            raise
        except BaseException as error:  # noqa: BLE001 - kept; raised in the generate() thread
            self._failure = error
            self._reset(slot)
            if self._queue is None:
                self._failure_raised = True
                raise
            return
        self._reset(slot)

    @staticmethod
    def _reset(slot: _Slot) -> None:
        slot.step = None
        slot.written = []
        slot.views = {}
        slot.encoded = {}
        slot.free.set()

    def _drainer(self) -> None:
        for slot in iter(self._queue.get, None):
            self._release(slot)


_CPU = torch.device("cpu")


def _view(slot: _Slot, pool: dict[str, torch.Tensor], stream: str, tensor: torch.Tensor, device: torch.device, *,
          pinned: bool) -> torch.Tensor:
    """A view of `pool[stream]`, a flat buffer on `device`, in `tensor`'s shape and dtype (contiguous);
    the buffer is replaced by a larger one (at least twice the size) when `tensor` does not fit. The
    slot keeps the last view of each buffer and hands it out again while the shape and dtype hold."""
    key = (stream, device)
    shaped = slot.shaped.get(key)
    if shaped is not None and shaped.shape == tensor.shape and shaped.dtype == tensor.dtype:
        return shaped
    flat = pool.get(stream)
    size = tensor.numel()
    if flat is None or flat.dtype != tensor.dtype or flat.device != device or flat.numel() < size:
        if flat is not None and flat.dtype == tensor.dtype and flat.device == device:
            size = max(size, 2 * flat.numel())
        flat = pool[stream] = torch.empty(size, dtype=tensor.dtype, device=device, pin_memory=pinned)
    shaped = slot.shaped[key] = flat[: tensor.numel()].view(tensor.shape)
    return shaped
