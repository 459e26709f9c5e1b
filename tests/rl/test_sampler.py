"""`sampler_logprobs`: per sampled token, from the recording alone, the logprob under the distribution sampled
(the processed scores, renormalised over the kept set) and under the raw logits at temperature 1 and at T."""

from __future__ import annotations

import pytest
import torch

from transformers_offload import Recorder, kept_sets, sampler_logprobs

from ..helpers import make_tiny


def test_the_sampler_logprobs_are_the_recorded_distributions_at_each_token(sample):
    model = make_tiny("llama")
    with Recorder(model, streams=("logits", "scores")) as rec:
        sample(model, rec, output_scores=False, return_dict_in_generate=False)
    found, kept = sampler_logprobs(rec), kept_sets(rec)
    assert torch.equal(found["tokens"], kept.tokens) and torch.equal(found["valid"], kept.valid)
    for t, (x, s) in enumerate(zip(rec.logits(), rec.scores())):
        y = found["tokens"][:, t, None]
        for name, values in (("sampled", s), ("raw", x), ("raw_temperature", x / 0.7)):
            expected = torch.log_softmax(values, -1).gather(-1, y)[:, 0]
            assert torch.equal(found[name][:, t], torch.where(found["valid"][:, t], expected, 0.0)), name
    # top-p/top-k renormalise: the sampled distribution gives each kept token more than the raw one at T
    assert torch.all(found["sampled"][found["valid"]] >= found["raw_temperature"][found["valid"]])


def test_without_the_raw_logits_only_the_sampled_logprob_is_given(sample):
    model = make_tiny("llama")
    with Recorder(model, streams=("scores",)) as rec:
        sample(model, rec, output_scores=False, return_dict_in_generate=False)
    with pytest.raises(ValueError, match="or pass `raw=False` for the sampled logprob alone"):
        sampler_logprobs(rec)
    found = sampler_logprobs(rec, raw=False)  # the sampler's own logprob needs the scores only
    assert sorted(found) == ["sampled", "tokens", "valid"]
    for t, s in enumerate(rec.scores()):
        expected = torch.log_softmax(s, -1).gather(-1, found["tokens"][:, t, None])[:, 0]
        assert torch.equal(found["sampled"][:, t], torch.where(found["valid"][:, t], expected, 0.0))


def test_sparse_scores_give_the_same_sampled_logprobs_bit_for_bit(sample):
    model = make_tiny("llama")
    found = []
    for options in ({}, {"encodings": {"scores": "sparse"}}):
        with Recorder(model, streams=("scores",), **options) as rec:
            sample(model, rec, output_scores=False, return_dict_in_generate=False)
        found.append(sampler_logprobs(rec, raw=False))
    assert all(torch.equal(found[0][name], found[1][name]) for name in found[0])

