"""Scores stored once: a call with no processor (greedy search, or sampling without any processor or
warper) hands the processors' output tensor back as the raw logits themselves, so `scores` is stored
with the logits (`"same_as_logits"`, no bytes of its own) and `scores()` still equals `out.scores`."""

from __future__ import annotations

import json

import pytest
import torch

from transformers_offload import Recorder, _compat, open_recording
from transformers_offload.cli.summary import format_summary
from transformers_offload.errors import RecordingError

from ..helpers import assert_steps_equal, left_padded_batch, make_tiny

CALLS = {  # generate() options: how the Recorder's defaults store the scores
    "greedy": (dict(do_sample=False), "same_as_logits"),
    # Sampling with nothing to warp: one list from 4.45; 4.36-4.44 build a warper list after it.
    "sampling, no warper": (dict(do_sample=True, top_k=0),
                            "dense" if _compat.HAS_SEPARATE_WARPER_LIST else "same_as_logits"),
    "greedy with a processor": (dict(do_sample=False, repetition_penalty=1.3), "dense"),
    "sampling with top-k": (dict(do_sample=True, top_k=5), "sparse"),  # a masking warper (test_sparse.py)
    "beam search": (dict(num_beams=2), "dense"),
}


def _streams(root):
    return json.loads((root / "manifest.json").read_text())["generations"][-1]["streams"]


@pytest.mark.parametrize("call", sorted(CALLS))
def test_scores_equal_to_the_logits_are_stored_once(call, store, tmp_path):
    model = make_tiny("gpt2")
    kwargs, encoding = CALLS[call]
    once = encoding == "same_as_logits"
    torch.manual_seed(0)
    reference = model.generate(**left_padded_batch(), max_new_tokens=4, min_length=0, return_dict_in_generate=True,
                               output_scores=True, pad_token_id=0, **kwargs)
    options = store.options()
    with Recorder(model, **options) as rec:
        torch.manual_seed(0)
        model.generate(**left_padded_batch(), max_new_tokens=4, min_length=0, logits_processor=[rec], pad_token_id=0, **kwargs)
    run = store.reopen(rec, verify=True)
    assert_steps_equal(run.scores(), reference.scores, "scores")
    assert "scores" in run.generation().streams
    assert run.generation().encodings == ({"scores": "sparse"} if encoding == "sparse" else {})
    if store.spill:
        assert _streams(tmp_path / "run")["scores"]["encoding"] == encoding
        described = run.describe()["generations"][0]["streams"]["scores"]
        assert (described["bytes"] == 0) == once
        if once:
            from safetensors import safe_open

            with safe_open(str(tmp_path / "run" / "g0000-s00000.safetensors"), "pt") as shard:
                assert "scores" not in shard.keys() and "logits" in shard.keys()
            assert "same_as_logits" in format_summary(run.describe())


def test_naming_dense_scores_stores_them_twice(tmp_path):
    model = make_tiny("gpt2")
    with Recorder(model, spill_dir=tmp_path / "run", encodings={"scores": "dense"}) as rec:
        model.generate(torch.tensor([[5, 6]]), logits_processor=[rec], max_new_tokens=3, pad_token_id=0)
    assert _streams(tmp_path / "run")["scores"]["encoding"] == "dense"
    run = open_recording(tmp_path / "run")
    assert all(torch.equal(a, b) for a, b in zip(run.scores(), run.logits()))


def test_stats_and_logprobs_read_scores_stored_once(tmp_path):
    model = make_tiny("llama")
    with Recorder(model, streams=("logits", "scores", "stats"), spill_dir=tmp_path / "run") as rec:
        model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=3, pad_token_id=0)
    run = open_recording(tmp_path / "run")
    for step in run.stats():
        assert torch.equal(step["logprob_raw"], step["logprob_processed"])
        assert torch.equal(step["rank_raw"], step["rank_processed"])
    entry = run.logprobs(kind="processed", top=2)[0][0]
    assert entry["logprob"] == run.logprobs(kind="raw", top=2)[0][0]["logprob"]


@pytest.mark.parametrize("edit, match", [
    (lambda streams: streams.pop("logits"), "stored as the `logits` stream"),
    (lambda streams: streams["scores"].update(dtype="float64"), "stored as the `logits` stream"),
    (lambda streams: streams["logits"].update(encoding="same_as_logits"), "only `scores` can"),
])
def test_a_damaged_scores_once_entry_is_refused(tmp_path, edit, match):
    model = make_tiny("gpt2")
    with Recorder(model, spill_dir=tmp_path / "run") as rec:
        model.generate(torch.tensor([[5, 6]]), logits_processor=[rec], max_new_tokens=2, pad_token_id=0)
    path = tmp_path / "run" / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest["generations"][0]["streams"])
    path.write_text(json.dumps(manifest))
    with pytest.raises(RecordingError, match=match):
        open_recording(tmp_path / "run")
