"""The per-step path makes the host wait for the device nowhere, checked on CPU: `HostSyncGuard` (tests/helpers.py)
notes each op that synchronises on CUDA while the recorder's per-step methods run (the ones the CUDA sync-debug
test wraps: `Capture.on_forward`, `on_raw`, `on_processed`, `on_stopping`; continuous batching's per-batch
`_to_host`), in every decoding mode, encoding and store; a planted `.item()` is caught."""

from __future__ import annotations

import pytest
import torch

from transformers_offload import Recorder
from transformers_offload.capture import capture as _capture
from transformers_offload.capture import transfer as _transfer

from ..helpers import HostSyncGuard, left_padded_batch, make_tiny

STEP_METHODS = ("on_forward", "on_raw", "on_processed", "on_stopping")
# `logsumexp`'s sample of underflowing exps runs only where `t.device.type == "cpu"` (codecs/workspace.py).
CPU_ONLY = ("codecs/workspace.py:logsumexp", "codecs/workspace.py:_mostly_underflow")


def _guard(monkeypatch) -> HostSyncGuard:
    guard = HostSyncGuard(cpu_only=CPU_ONLY)
    for name in STEP_METHODS:
        monkeypatch.setattr(_capture.Capture, name, guard.guarded(getattr(_capture.Capture, name)))
    monkeypatch.setattr(_transfer.HostRing, "put", guard.paused_in(_transfer.HostRing.put))
    return guard


DENSE, STATS = ("logits", "scores"), ("logits", "scores", "stats")
GREEDY, SAMPLE, BEAMS = {}, {"do_sample": True, "top_k": 20}, {"num_beams": 3}
# Every mode, every encoding and the statistics, each at least once (the version matrix runs them all on 15 releases).
CASES = {
    "greedy-dense": (GREEDY, None, DENSE), "greedy-topk-tail-stats": (GREEDY, {"logits": "topk:5+tail:8"}, STATS),
    "sample-topk-q4-stats": (SAMPLE, {"logits": "topk:5", "scores": "topk:5:q4"}, STATS),
    "sample-sparse": (SAMPLE, {"scores": "sparse"}, DENSE), "sample-drawn": (SAMPLE, {"logits": "sample:8@0.7"}, DENSE),
    "beams-stats": (BEAMS, None, STATS), "beams-topk": (BEAMS, {"logits": "topk:5", "scores": "topk:5:q4"}, DENSE),
}


@pytest.mark.parametrize("case", CASES)
def test_the_recorder_makes_no_synchronising_call_in_the_step_path(monkeypatch, tmp_path, case):
    kwargs, encodings, streams = CASES[case]
    guard = _guard(monkeypatch)
    model = make_tiny("llama")
    with Recorder(model, streams=streams, encodings=encodings, spill_dir=tmp_path / "run", shard_bytes=20_000) as rec:
        torch.manual_seed(0)
        model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=8, min_new_tokens=8, **kwargs)
    assert rec.generation().complete and rec.generation().num_steps == 8
    assert guard.ops > 0, "the guard saw no op: it checked nothing"
    assert not guard.found, sorted(set(guard.found))


def test_a_planted_item_is_caught(monkeypatch):
    on_raw = _capture.Capture.on_raw

    def planted(self, input_ids, scores, group=None):
        scores.max().item()  # the host waits for the device, on CUDA
        return on_raw(self, input_ids, scores, group)

    monkeypatch.setattr(_capture.Capture, "on_raw", planted)
    guard = _guard(monkeypatch)
    model = make_tiny("llama")
    with Recorder(model) as rec:
        model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=2)
    assert len(guard.found) == 2 and all("_local_scalar_dense" in found for found in guard.found)


def test_continuous_batchings_per_batch_work_makes_no_synchronising_call(monkeypatch):
    from transformers import GenerationConfig

    from transformers_offload.capture import continuous

    if not continuous.runner_known():
        pytest.skip("this release's continuous batching is refused by the recorder")
    guard = _guard(monkeypatch)
    monkeypatch.setattr(continuous, "_to_host", guard.guarded(continuous._to_host))
    model = make_tiny("llama")
    with Recorder(model, streams=("logits", "scores", "stats")) as rec:
        torch.manual_seed(0)
        model.generate_batch([[3, 4, 5], [6, 7, 8, 9]], logits_processor=[rec], progress_bar=False,
                             generation_config=GenerationConfig(max_new_tokens=4, do_sample=True, top_k=5, pad_token_id=0))
    assert len(rec.generations) == 2 and guard.ops > 0
    assert not guard.found, guard.found
