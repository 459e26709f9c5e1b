"""The in-memory store on made-up steps: steps packed into a few chunks, rewrites, resident memory."""

from __future__ import annotations

import copy
import gc
import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transformers_offload.store import memory as _memory_store
from transformers_offload.store.header import GenerationHeader
from transformers_offload.store.memory import MemoryStore

from ..helpers import ROOT

HEADER = GenerationHeader(
    index=0, mode="greedy_search", prompt_length=2, prompt_lengths=None, num_rows=2, num_beams=1, pad_token_id=0,
    eos_token_id=(), generation_config={},
)


def _finish(store: MemoryStore, steps: int):
    """What the store kept, per stream (the Generation's source: the layer below its accessors)."""
    return store.finish(steps, HEADER, None, None, ring_waits=0).source


def _chunks_spanned(steps) -> int:
    """How many separate blocks of memory hold `steps` (each starts where the previous one ended,
    rounded up to the store's alignment, unless a new chunk began)."""
    room = [-(-t.numel() * t.element_size() // _memory_store.ALIGNMENT) * _memory_store.ALIGNMENT for t in steps]
    return 1 + sum(b.data_ptr() != a.data_ptr() + r for a, b, r in zip(steps, steps[1:], room))


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
    assert _chunks_spanned(logits) <= 5
    tokens = kept.read("tokens", range(2000), None)
    assert _chunks_spanned(tokens) <= 2 and tokens[7].dtype == torch.long


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.long, torch.bool])
def test_each_step_serializes_as_its_own_bytes(dtype, tmp_path):
    # Steps share chunks in memory; `pickle`, `torch.save` and `deepcopy` must still write one step's
    # bytes per step (a view of a chunk would carry the whole chunk, once per step with `pickle`).
    store = MemoryStore(["logits"])
    sources = [torch.randn(2, 50).to(dtype) for _ in range(60)]  # 400 bytes or less a step
    for step, source in enumerate(sources):
        store.drain(step, {"logits": source})
    logits = _finish(store, 60).read("logits", range(60), None)
    assert _chunks_spanned(logits) == 1
    data = sum(t.numel() * t.element_size() for t in logits)
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in logits)
    assert len(pickle.dumps(logits)) < data + 60 * 1024
    buffer = io.BytesIO()
    torch.save(logits, buffer)
    assert len(buffer.getvalue()) < data + 60 * 1024
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(pickle.loads(pickle.dumps(logits)), sources))
    assert all(torch.equal(a, b) for a, b in zip(copy.deepcopy(logits), sources))


def test_a_step_kept_alone_outlives_the_store_and_its_neighbours():
    store = MemoryStore(["logits"])
    for step in range(10):
        store.drain(step, {"logits": torch.full((3, 7), float(step))})
    kept = _finish(store, 10).read("logits", range(10), None)[4]
    del store
    gc.collect()
    assert torch.equal(kept, torch.full((3, 7), 4.0))
    assert kept.numpy().sum() == 84.0  # NumPy reads the same memory


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
    assert _chunks_spanned(kept) == 3


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident set from /proc (Linux)")
def test_resident_memory_stays_near_the_data_next_to_a_growing_cache():
    # One allocation per kept step, between the model's own per-step reallocations, pinned the heap:
    # this very script grew the resident set by 1,562 MiB for 31 MiB kept before steps were packed into
    # chunks (62-78 MiB after).
    script = ROOT / "tests" / "scripts" / "memory_store_next_to_a_growing_cache.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(script), "1024"], env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    measured = json.loads(done.stdout)
    assert measured["growth"] < 4 * measured["kept"] + 64 * 2**20, measured
