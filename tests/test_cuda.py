"""The CUDA path: pinned host slots, non-blocking copies, exact values. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from transformers_offload import Recorder, open_recording
from transformers_offload._transfer import HostRing

from .conftest import left_padded_batch, make_tiny
from .helpers import assert_steps_equal

pytestmark = pytest.mark.cuda


def test_ring_uses_pinned_slots_and_waits_only_on_reuse():
    kept = []
    ring = HostRing(2, lambda step, tensors: kept.append((step, tensors["x"].clone())))
    for step in range(5):
        ring.put(step, "x", torch.full((4, 8), float(step), device="cuda"))
    assert all(slot.buffers["x"].is_pinned() for slot in ring._slots)
    ring.flush()
    assert [step for step, _ in kept] == list(range(5))
    assert all(torch.equal(t, torch.full((4, 8), float(s))) for s, t in kept)
    assert 0 <= ring.waits <= 5  # counted only when a copy was still in flight (3 reuses + 2 at the flush)


@pytest.mark.parametrize("store", ["memory", "spill"])
@pytest.mark.parametrize("kwargs", [dict(), dict(do_sample=True, top_k=20), dict(num_beams=3)])
def test_recording_on_cuda_equals_hugging_face(kwargs, store, tmp_path):
    model = make_tiny("llama").to("cuda")
    batch = {k: v.to("cuda") for k, v in left_padded_batch().items()}
    torch.manual_seed(0)
    reference = model.generate(
        **batch, max_new_tokens=16, return_dict_in_generate=True, output_scores=True, output_logits=True, **kwargs
    )
    options = {"spill_dir": tmp_path / "run", "shard_bytes": 20_000} if store == "spill" else {}
    with Recorder(model, **options) as rec:
        torch.manual_seed(0)
        sequences = model.generate(**batch, logits_processor=[rec], max_new_tokens=16, **kwargs)
    if store == "spill":
        rec = open_recording(tmp_path / "run")
    assert torch.equal(sequences, reference.sequences)
    assert_steps_equal(rec.logits(), reference.logits, "logits")
    assert_steps_equal(rec.scores(), reference.scores, "scores")


def test_device_memory_does_not_grow_with_steps():
    model = make_tiny("llama").to("cuda")
    batch = {k: v.to("cuda") for k, v in left_padded_batch().items()}
    peaks = []
    for steps in (16, 96):
        with Recorder(model) as rec:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            model.generate(**batch, logits_processor=[rec], max_new_tokens=steps, min_new_tokens=steps)
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - base)
    # The KV cache grows with steps (a few KB per step for this model); the recorder adds nothing per step.
    assert peaks[1] - peaks[0] < 512 * 1024, peaks
