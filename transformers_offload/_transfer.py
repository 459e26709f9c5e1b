"""The transfer: a bounded ring of host slots that each step's tensors are copied into.

A step's captured tensors (raw logits, processed scores, tokens, finished mask...) are copied into one
slot as soon as they exist, inside the step that produced them. On CUDA the slots are pinned host
memory and the copies are non-blocking; the host waits on a slot's event only when the slot is
reused, or when the ring is flushed at the end of a generation. On CPU the same path runs with plain
copies (`Tensor.to("cpu")` would return the very tensor that later processors modify in place, so the
ring always copies).

When a slot is reused or flushed, its content is handed to the store (`drain`), which keeps its own
copy; the slot's buffers are then reused for a later step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

Drain = Callable[[int, dict[str, torch.Tensor]], None]


@dataclass
class _Slot:
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    written: list[str] = field(default_factory=list)
    step: int | None = None
    event: torch.cuda.Event | None = None


class HostRing:
    """A bounded ring of host slots, one slot per step in flight.

    Args:
        slots (`int`): number of host slots (steps in flight), at least 1.
        drain (`Callable[[int, dict[str, torch.Tensor]], None]`): called with a step and its host tensors
            (CPU, read-only views of the slot: the callee copies what it keeps) when the slot is reused
            or the ring is flushed, in step order.
    """

    def __init__(self, slots: int, drain: Drain) -> None:
        self._slots = [_Slot() for _ in range(slots)]
        self._drain = drain
        self._current = -1
        self.waits = 0  # times the host had to wait for a device copy still in flight

    def put(self, step: int, stream: str, tensor: torch.Tensor) -> None:
        """Copy `tensor` (any device) into the host slot of `step`, under the name `stream`."""
        slot = self._slot_for(step)
        buffer = slot.buffers.get(stream)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pinned = tensor.device.type == "cuda"
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pinned)
            slot.buffers[stream] = buffer
        if tensor.device.type == "cuda":
            buffer.copy_(tensor, non_blocking=True)
            if slot.event is None:
                slot.event = torch.cuda.Event()
            slot.event.record()
        else:
            buffer.copy_(tensor)
        slot.written.append(stream)

    def flush(self) -> None:
        """Wait for every pending copy and drain every occupied slot, in step order."""
        count = len(self._slots)
        for offset in range(1, count + 1):
            self._release(self._slots[(self._current + offset) % count])

    def _slot_for(self, step: int) -> _Slot:
        for slot in self._slots:  # a step still held takes late entries (beam search's tokens)
            if slot.step == step:
                return slot
        self._current = (self._current + 1) % len(self._slots)
        slot = self._slots[self._current]
        self._release(slot)
        slot.step = step
        return slot

    def _release(self, slot: _Slot) -> None:
        if slot.step is None:
            return
        if slot.event is not None:
            if not slot.event.query():
                self.waits += 1  # the copy is still in flight: the host waits for it
            slot.event.synchronize()
        self._drain(slot.step, {name: slot.buffers[name] for name in slot.written})
        slot.step = None
        slot.written = []
