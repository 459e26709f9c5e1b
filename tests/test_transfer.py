"""The host ring on made-up `(rows, vocab)` tensors."""

from __future__ import annotations

import pytest
import torch

from transformers_offload._transfer import HostRing


class MemoryStore:
    """Collects what the ring drains, per stream and step (the last write of a step wins)."""

    def __init__(self) -> None:
        self.steps: dict[str, dict[int, torch.Tensor]] = {}
        self.order: list[int] = []

    def drain(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        self.order.append(step)
        for name, tensor in tensors.items():
            self.steps.setdefault(name, {})[step] = tensor.clone()

    def stream(self, name: str) -> dict[int, torch.Tensor]:
        return self.steps.get(name, {})


@pytest.mark.parametrize("slots", [1, 2, 4])
def test_ring_drains_every_step_in_order_and_copies(slots):
    store = MemoryStore()
    ring = HostRing(slots, store.drain)
    sources = [torch.randn(3, 16) for _ in range(9)]
    for step, source in enumerate(sources):
        ring.put(step, "logits", source)
        ring.put(step, "tokens", source.argmax(dim=-1))
        source.mul_(0)  # a later processor editing in place must not reach the recording
    ring.flush()
    logits = store.stream("logits")
    assert sorted(logits) == list(range(9))
    assert all(not torch.equal(logits[s], torch.zeros(3, 16)) for s in logits)
    assert len(ring._slots) == slots
    assert all(len(slot.buffers) <= 2 for slot in ring._slots)


def test_store_keeps_its_own_copy_of_the_slot():
    store = MemoryStore()
    ring = HostRing(1, store.drain)
    ring.put(0, "x", torch.ones(2, 2))
    ring.put(1, "x", torch.full((2, 2), 2.0))  # reuses the only slot
    ring.flush()
    assert torch.equal(store.stream("x")[0], torch.ones(2, 2))
    assert torch.equal(store.stream("x")[1], torch.full((2, 2), 2.0))


def test_a_step_written_twice_keeps_the_last_value():
    store = MemoryStore()
    ring = HostRing(2, store.drain)
    ring.put(0, "x", torch.zeros(2))
    ring.put(0, "x", torch.ones(2))
    ring.flush()
    assert torch.equal(store.stream("x")[0], torch.ones(2))


def test_shapes_may_change_between_steps():
    store = MemoryStore()
    ring = HostRing(2, store.drain)
    for step in range(4):
        ring.put(step, "x", torch.arange(step + 1, dtype=torch.float32))
    ring.flush()
    assert [t.numel() for _, t in sorted(store.stream("x").items())] == [1, 2, 3, 4]


def test_a_late_entry_joins_its_step_while_the_slot_is_held():
    # Beam search learns step t's token at step t + 1: it must land in step t's slot, not a new one.
    store = MemoryStore()
    ring = HostRing(2, store.drain)
    ring.put(0, "logits", torch.zeros(2))
    ring.put(1, "logits", torch.ones(2))
    ring.put(0, "tokens", torch.tensor([5, 6]))
    ring.flush()
    assert store.order == [0, 1]
    assert torch.equal(store.stream("tokens")[0], torch.tensor([5, 6]))
