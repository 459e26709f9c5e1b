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


def _random_step(generator: torch.Generator, rows: int, vocab: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's scores with kept sets of every size (none, one, a few, clustered, most, all), -inf elsewhere,
    some rows with ties, NaN or +inf, and sampled tokens mostly inside their sets."""
    logits = (torch.randn(rows, vocab, generator=generator) * 4).to(dtype)
    logits[rows // 3] = logits[rows // 3].round()  # ties
    sizes = torch.randint(0, vocab + 1, (rows,), generator=generator)
    sizes[: rows // 2] = torch.randint(0, max(2, vocab // 50), (rows // 2,), generator=generator)
    rank = torch.rand(rows, vocab, generator=generator).argsort(-1).argsort(-1)
    clustered = torch.arange(vocab)[None, :] - torch.randint(0, vocab, (rows, 1), generator=generator)
    rank[1::5] = clustered[1::5].remainder(vocab)  # sets of neighbouring ids
    scores = torch.where(rank < sizes[:, None], logits, torch.tensor(float("-inf"), dtype=dtype))
    if rows > 8:
        scores[7, 0], scores[8, vocab - 1] = float("nan"), float("inf")
    kept = torch.isfinite(scores) | scores.isnan() | (scores == float("inf"))
    chosen = torch.where(kept.any(-1), (kept.float() + 1e-3 * torch.rand(rows, vocab, generator=generator)).argmax(-1), 0)
    outside = torch.rand(rows, generator=generator) < 0.1
    return scores, torch.where(outside, torch.randint(0, vocab, (rows,), generator=generator), chosen)


@pytest.mark.parametrize("vocab", [5, 63, 64, 100, 1000, 4097, 49152])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_packed_log_softmax_is_the_dense_one_bit_for_bit(vocab, dtype):
    from transformers_offload.codecs.sparse import sparse_entries
    from transformers_offload.rl.entries import StepEntries
    from transformers_offload.rl.sampler import packed_log_softmax

    generator, checked, packed_rows = torch.Generator().manual_seed(vocab), 0, 0
    for _ in range(3):
        scores, tokens = _random_step(generator, 64, vocab, dtype)
        found = sparse_entries(scores)
        entries = StepEntries(ids=found["indices"], values=found["values"], vocab=vocab,
                              counts=found["offsets"][1:] - found["offsets"][:-1])
        expected = torch.log_softmax(scores.float(), -1).gather(-1, tokens[:, None])[:, 0]
        mine = packed_log_softmax(entries, tokens)
        # every number and infinity bit for bit; NaN where the dense row gives NaN (a NaN's sign bit may differ)
        assert torch.equal(mine.isnan(), expected.isnan()), (vocab, dtype)
        assert torch.equal(mine.nan_to_num(0.0).view(torch.int32), expected.nan_to_num(0.0).view(torch.int32)), (vocab, dtype)
        checked += tokens.numel()
        packed_rows += int(((entries.counts > 0) & (entries.counts < vocab // 64)).sum())
    assert checked == 192 and (vocab < 4097 or packed_rows > 50)  # the packed layout ran, not only the dense one
