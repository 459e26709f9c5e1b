"""The host ring on made-up `(rows, vocab)` tensors."""

from __future__ import annotations

import pytest
import torch

from transformers_offload.capture.transfer import HostRing


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


@pytest.fixture(params=[False, True], ids=["inline", "threaded"])
def threaded(request):
    """Both drain paths: in the caller's thread (CPU) and in a drainer thread (the CUDA path)."""
    return request.param


@pytest.mark.parametrize("slots", [1, 2, 4])
def test_ring_drains_every_step_in_order_and_copies(slots, threaded):
    store = MemoryStore()
    ring = HostRing(slots, store.drain, threaded=threaded)
    sources = [torch.randn(3, 16) for _ in range(9)]
    for step, source in enumerate(sources):
        ring.put(step, "logits", source)
        ring.put(step, "tokens", source.argmax(dim=-1))
        source.mul_(0)  # a later processor editing in place must not reach the recording
    ring.flush()
    assert store.order == list(range(9))
    logits = store.stream("logits")
    assert sorted(logits) == list(range(9))
    assert all(not torch.equal(logits[s], torch.zeros(3, 16)) for s in logits)
    assert len(ring._slots) == slots
    assert all(len(slot.buffers) <= 2 for slot in ring._slots)


def test_store_keeps_its_own_copy_of_the_slot(threaded):
    store = MemoryStore()
    ring = HostRing(1, store.drain, threaded=threaded)
    ring.put(0, "x", torch.ones(2, 2))
    ring.put(1, "x", torch.full((2, 2), 2.0))  # reuses the only slot
    ring.flush()
    assert torch.equal(store.stream("x")[0], torch.ones(2, 2))
    assert torch.equal(store.stream("x")[1], torch.full((2, 2), 2.0))


def test_a_step_written_twice_keeps_the_last_value(threaded):
    store = MemoryStore()
    ring = HostRing(2, store.drain, threaded=threaded)
    ring.put(0, "x", torch.zeros(2))
    ring.put(0, "x", torch.ones(2))
    ring.flush()
    assert torch.equal(store.stream("x")[0], torch.ones(2))


def test_shapes_may_change_between_steps(threaded):
    store = MemoryStore()
    ring = HostRing(2, store.drain, threaded=threaded)
    for step in range(4):
        ring.put(step, "x", torch.arange(step + 1, dtype=torch.float32))
    ring.flush()
    assert [t.numel() for _, t in sorted(store.stream("x").items())] == [1, 2, 3, 4]


def test_a_late_entry_joins_its_step_while_the_slot_is_held(threaded):
    # Beam search learns step t's token at step t + 1: it must land in step t's slot, not a new one.
    store = MemoryStore()
    ring = HostRing(2, store.drain, threaded=threaded)
    ring.put(0, "logits", torch.zeros(2))
    ring.put(1, "logits", torch.ones(2))
    ring.put(0, "tokens", torch.tensor([5, 6]))
    ring.flush()
    assert store.order == [0, 1]
    assert torch.equal(store.stream("tokens")[0], torch.tensor([5, 6]))


def test_a_step_is_drained_two_steps_later_so_late_entries_still_join_it(threaded):
    store = MemoryStore()
    ring = HostRing(4, store.drain, threaded=threaded)
    for step in range(4):
        ring.put(step, "logits", torch.full((2,), float(step)))
        if step:
            ring.put(step - 1, "tokens", torch.tensor([step, step]))
    ring.flush()
    assert store.order == [0, 1, 2, 3]
    assert sorted(store.stream("tokens")) == [0, 1, 2]


class Failing(MemoryStore):
    def drain(self, step, tensors):
        if step == 2:
            raise OSError(28, "No space left on device")
        super().drain(step, tensors)


def test_a_failing_drain_is_raised_in_the_callers_thread_once_and_nothing_after_it_is_stored(threaded):
    store = Failing()
    ring = HostRing(2, store.drain, threaded=threaded)
    with pytest.raises(OSError, match="No space"):
        for step in range(40):
            ring.put(step, "x", torch.zeros(2))
    ring.flush()  # already raised: the flush only waits for the drainer
    assert store.order == [0, 1]


def test_a_failure_in_the_last_steps_is_raised_by_flush(threaded):
    store = Failing()
    ring = HostRing(4, store.drain, threaded=threaded)
    for step in range(3):
        ring.put(step, "x", torch.zeros(2))
    with pytest.raises(OSError, match="No space"):
        ring.flush()
    assert store.order == [0, 1]


@pytest.mark.parametrize("kwargs", [dict(), dict(do_sample=True, top_k=20), dict(num_beams=3)])
def test_the_threaded_drain_records_what_generate_computed(kwargs, recorded, monkeypatch):
    # CUDA models drain in a thread; here that path runs on CPU, so it is tested without a GPU.
    from transformers_offload import recorder as recorder_module

    from ..helpers import assert_steps_equal, left_padded_batch, make_tiny

    monkeypatch.setattr(recorder_module, "_on_cuda", lambda model: True)
    call = recorded(make_tiny("llama"), seed=0, recorder=dict(ring_slots=2), spill=dict(shard_bytes=5_000),
                    **left_padded_batch(), max_new_tokens=12, **kwargs)
    reference, rec = call.reference, call.recording
    assert_steps_equal(rec.logits(), reference.logits, "logits")
    assert_steps_equal(rec.scores(), reference.scores, "scores")
