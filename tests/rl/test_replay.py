"""`replay_logprobs`: the trainer's logprob of each sampled token at the sampling temperature, renormalised over
its kept set. On the recorded raw logits it is the recorded processed logprob within 1e-6 (its sums over the kept
ids run in another order than log_softmax's: 2.4e-7 measured here); against a float64 computation from the kept
ids, within 2e-6; its gradient is zero outside the kept sets and at invalid positions."""

from __future__ import annotations

import pytest
import torch

from transformers_offload import Recorder, kept_sets, replay_logprobs

from ..helpers import HostSyncGuard, make_tiny


@pytest.fixture
def recorded(sample):
    model = make_tiny("llama")
    with Recorder(model, streams=("logits", "scores")) as rec:
        sample(model, rec, max_new_tokens=8, eos_token_id=list(range(3, 20)), output_scores=False,
                 return_dict_in_generate=False)
    return rec


def test_on_the_recorded_raw_logits_replay_is_the_processed_logprob_within_1e_6(recorded):
    kept = kept_sets(recorded)
    raw = torch.stack(recorded.logits(), 1)
    processed = torch.stack([torch.log_softmax(s, -1).gather(-1, t[:, None])[:, 0]
                             for s, t in zip(recorded.scores(), recorded.tokens())], 1)
    assert 0 < int(kept.valid.sum()) < kept.valid.numel()  # some rows finished: invalid positions are there
    found = replay_logprobs(raw, kept)
    assert found.dtype == torch.float32 and found.shape == kept.tokens.shape
    assert torch.all(found[~kept.valid] == 0)
    assert (found - torch.where(kept.valid, processed, 0.0)).abs().max() <= 1e-6


def test_a_step_that_kept_the_whole_vocabulary_replays_over_all_of_it(sample):
    model = make_tiny("llama")
    with Recorder(model, streams=("logits", "scores")) as rec:
        sample(model, rec, top_p=1.0, top_k=0, temperature=0.7, output_scores=False, return_dict_in_generate=False)
    kept = kept_sets(rec)
    assert kept.any_full and kept.ids.numel() == 0
    raw = torch.stack(rec.logits(), 1)
    expected = torch.log_softmax(raw / 0.7, -1).gather(-1, kept.tokens.clamp(min=0)[..., None])[..., 0]
    for chunk_steps in (1, 4, 16):
        found = replay_logprobs(raw, kept, chunk_steps=chunk_steps)
        assert (found - torch.where(kept.valid, expected, 0.0)).abs().max() <= 1e-6


def test_replay_is_the_float64_expression_over_the_kept_ids_and_differentiable(recorded):
    kept = kept_sets(recorded)
    torch.manual_seed(1)
    logits = torch.randn(kept.rows, kept.steps, kept.vocab_size + 3, dtype=torch.bfloat16, requires_grad=True)
    found = replay_logprobs(logits, kept, temperature=0.9)
    expected = torch.zeros(kept.rows, kept.steps, dtype=torch.float64)
    for r in range(kept.rows):
        for t in range(kept.steps):
            if kept.valid[r, t]:
                x = logits[r, t].detach().double() / 0.9
                ids = kept.ids_at(r, t).long()
                expected[r, t] = x[int(kept.tokens[r, t])] - torch.logsumexp(x[ids], 0)
    assert (found.double() - expected).abs().max() < 2e-6
    found.sum().backward()
    outside = torch.ones_like(logits, dtype=torch.bool)
    for r in range(kept.rows):
        for t in range(kept.steps):
            if kept.valid[r, t]:
                outside[r, t, kept.ids_at(r, t).long()] = False
    assert torch.all(logits.grad[outside] == 0) and logits.grad[~outside].abs().sum() > 0


def test_bad_input_is_refused(recorded):
    kept = kept_sets(recorded)
    with pytest.raises(ValueError, match=r"must be \(rows, steps, vocab\)"):
        replay_logprobs(torch.zeros(kept.rows, kept.steps + 1, kept.vocab_size), kept)
    with pytest.raises(ValueError, match="entries per position"):
        replay_logprobs(torch.zeros(kept.rows, kept.steps, kept.vocab_size - 1), kept)
    with pytest.raises(ValueError, match="`temperature` must be positive"):
        replay_logprobs(torch.zeros(kept.rows, kept.steps, kept.vocab_size), kept, temperature=0.0)


def test_replay_makes_no_synchronising_call(recorded):
    kept, guard = kept_sets(recorded), HostSyncGuard()
    raw = torch.stack(recorded.logits(), 1).requires_grad_(True)
    found = guard.guarded(replay_logprobs)(raw, kept)
    guard.guarded(lambda: found.sum().backward())()
    assert guard.ops > 0 and not guard.found, guard.found
