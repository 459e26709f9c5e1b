"""The in-memory store on made-up steps: steps packed into a few chunks, rewrites, resident memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transformers_offload import _memory_store
from transformers_offload._memory_store import MemoryStore

ROOT = Path(__file__).resolve().parent.parent


HEADER = {
    "index": 0, "mode": "greedy_search", "prompt_length": 2, "prompt_lengths": None, "num_rows": 2, "num_beams": 1,
    "pad_token_id": 0, "eos_token_id": (), "generation_config": {}, "layers": None,
}


def _finish(store: MemoryStore, steps: int):
    """What the store kept, per stream (the Generation's source: the layer below its accessors)."""
    return store.finish(steps, HEADER, None, None, ring_waits=0)._source


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_steps_are_kept_in_a_few_chunks_whatever_the_number_of_steps():
    store = MemoryStore(["logits", "tokens"])
    sources = [torch.randn(2, 50) for _ in range(2000)]
    for step, source in enumerate(sources):
        store.drain(step, {"logits": source, "tokens": source.argmax(-1)})
    kept = _finish(store, 2000)
    logits = kept.read("logits", range(2000), None)
    assert all(torch.equal(a, b) for a, b in zip(logits, sources))
    assert all(t.is_contiguous() and not t.is_pinned() for t in logits)
    # 800 KB of logits: chunks of 64 KiB, 128 KiB, ... 512 KiB, not 2,000 allocations.
    assert len(_storages(logits)) <= 5
    tokens = kept.read("tokens", range(2000), None)
    assert len(_storages(tokens)) == 1 and tokens[7].dtype == torch.long


def test_the_last_chunk_is_trimmed_to_what_it_holds(tmp_path):
    store = MemoryStore(["logits"])
    sources = [torch.randn(2, 50) for _ in range(3)]  # 400 bytes a step, in a 64 KiB first chunk
    for step, source in enumerate(sources):
        store.drain(step, {"logits": source})
    logits = _finish(store, 3).read("logits", range(3), None)
    assert all(torch.equal(a, b) for a, b in zip(logits, sources))
    assert _storages(logits) == {logits[0].untyped_storage().data_ptr()}
    assert logits[0].untyped_storage().nbytes() == 3 * 400
    torch.save(logits, tmp_path / "logits.pt")  # what a user may do with `rec.logits()`
    assert (tmp_path / "logits.pt").stat().st_size < 3 * 400 + 4096


def test_the_store_copies_what_it_keeps():
    store = MemoryStore(["x"])
    slot = torch.ones(3)
    store.drain(0, {"x": slot})
    slot.zero_()  # the ring reuses its slot
    assert torch.equal(_finish(store, 1).read("x", range(1), None)[0], torch.ones(3))


@pytest.mark.parametrize("shape", [(4,), (2, 3)], ids=["same shape", "another shape"])
def test_a_step_written_twice_keeps_the_last_value(shape):
    store = MemoryStore(["x"])
    store.drain(0, {"x": torch.zeros(4)})
    store.drain(1, {"x": torch.full((4,), 7.0)})
    store.drain(0, {"x": torch.ones(shape)})
    kept = _finish(store, 2).read("x", range(2), None)
    assert torch.equal(kept[0], torch.ones(shape))
    assert torch.equal(kept[1], torch.full((4,), 7.0))


def test_shapes_and_dtypes_may_change_between_steps():
    store = MemoryStore(["x"])
    sources = [torch.arange(step + 1, dtype=torch.float32) for step in range(5)] + [torch.arange(3)]
    for step, source in enumerate(sources):
        store.drain(step, {"x": source})
    kept = _finish(store, 6).read("x", range(6), None)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(kept, sources))


def test_a_step_larger_than_a_chunk_gets_a_chunk_of_its_own(monkeypatch):
    monkeypatch.setattr(_memory_store, "CHUNK_BYTES_MIN", 64)
    monkeypatch.setattr(_memory_store, "CHUNK_BYTES_MAX", 256)
    store = MemoryStore(["x"])
    sources = [torch.randn(100) for _ in range(3)]  # 400 bytes each
    for step, source in enumerate(sources):
        store.drain(step, {"x": source})
    kept = _finish(store, 3).read("x", range(3), None)
    assert all(torch.equal(a, b) for a, b in zip(kept, sources))
    assert all(t.untyped_storage().nbytes() == 400 for t in kept)


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident set from /proc (Linux)")
def test_resident_memory_stays_near_the_data_next_to_a_growing_cache():
    # One allocation per kept step, between the model's own per-step reallocations, pinned the heap:
    # this very script grew the resident set by 1,562 MiB for 31 MiB kept before steps were packed into
    # chunks (62 MiB after).
    script = ROOT / "tests" / "scripts" / "memory_store_next_to_a_growing_cache.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(script), "1024"], env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    measured = json.loads(done.stdout)
    assert measured["growth"] < 4 * measured["kept"] + 64 * 2**20, measured
