"""`replay_logprobs_from_hidden`: the replay from hidden states and the head's weight, without the logits. On
float32 it is `replay_logprobs` over `hidden @ W.T + b` within 1e-5 (the products summed in another order: the
measured difference is asserted below it), with and without full steps, given `full_logprobs` or not; its
gradient equals the one through the logits within 1e-5 and is zero on head rows no kept set names."""

from __future__ import annotations

import pytest
import torch

from transformers_offload import replay_logprobs, replay_logprobs_from_hidden

from ..helpers import HostSyncGuard


def _case(kept, bias=True):
    torch.manual_seed(3)
    hidden = torch.randn(kept.rows, kept.steps, 16, requires_grad=True)
    weight = torch.randn(kept.vocab_size + 2, 16, requires_grad=True)
    b = torch.randn(kept.vocab_size + 2, requires_grad=True) if bias else None
    return hidden, weight, b


def test_from_hidden_is_the_replay_over_the_heads_logits(kept):
    hidden, weight, bias = _case(kept)
    logits = torch.addmm(bias, hidden.reshape(-1, 16), weight.T).view(kept.rows, kept.steps, -1)
    expected = replay_logprobs(logits, kept, temperature=0.8)
    found = replay_logprobs_from_hidden(hidden, weight, kept, bias=bias, temperature=0.8, chunk=7)
    assert found.dtype == torch.float32 and torch.all(found[~kept.valid] == 0)
    assert (found - expected).abs().max() <= 1e-5
    grads = torch.autograd.grad(found.sum(), (hidden, weight, bias))
    expected_grads = torch.autograd.grad(expected.sum(), (hidden, weight, bias))
    for mine, theirs in zip(grads, expected_grads):
        assert (mine - theirs).abs().max() <= 1e-5
    if not kept.any_full:  # head rows no kept set names get no gradient
        named = torch.zeros(weight.shape[0], dtype=torch.bool)
        named[kept.ids.long()] = True
        assert torch.all(grads[1][~named] == 0) and grads[1][named].abs().sum() > 0


def test_full_steps_take_the_given_full_logprobs(kept):
    hidden, weight, _ = _case(kept, bias=False)
    given = torch.full((kept.rows, kept.steps), -1.25)
    found = replay_logprobs_from_hidden(hidden, weight, kept, full_logprobs=given)
    computed = replay_logprobs_from_hidden(hidden, weight, kept)
    where = kept.full & kept.valid
    assert torch.all(found[where] == -1.25) and torch.equal(found[~where], computed[~where])
    assert kept.any_full == bool(where.any())


def test_select_takes_rows_in_order_and_widens_or_narrows_steps(kept):
    rows = [kept.rows - 1, 0]
    for steps in (kept.steps, kept.steps - 2, kept.steps + 3):
        part = kept.select(rows, steps)
        assert part.tokens.shape == (2, steps) and part.generations == tuple(kept.generations[r] for r in rows)
        for i, r in enumerate(rows):
            for t in range(steps):
                inside = t < kept.steps
                assert bool(part.valid[i, t]) == (inside and bool(kept.valid[r, t]))
                assert int(part.tokens[i, t]) == (int(kept.tokens[r, t]) if inside else -1)
                if part.valid[i, t] and not part.full[i, t]:
                    assert torch.equal(part.ids_at(i, t), kept.ids_at(r, t))
    with pytest.raises(ValueError, match="`rows` must lie in"):
        kept.select([kept.rows])


def test_bad_input_is_refused(kept):
    hidden, weight, _ = _case(kept)
    with pytest.raises(ValueError, match="`hidden` must be"):
        replay_logprobs_from_hidden(hidden[:, 1:], weight, kept)
    with pytest.raises(ValueError, match="`weight` must be"):
        replay_logprobs_from_hidden(hidden, weight[:, 1:], kept)
    with pytest.raises(ValueError, match="`chunk` must be"):
        replay_logprobs_from_hidden(hidden, weight, kept, chunk=0)
    with pytest.raises(ValueError, match=r"`bias` must be \("):
        replay_logprobs_from_hidden(hidden, weight, kept, bias=torch.zeros(5))
    with pytest.raises(ValueError, match=r"a `temperature` tensor must be floating, of shape"):
        replay_logprobs_from_hidden(hidden, weight, kept, temperature=torch.ones(kept.rows + 1))
    with pytest.raises(TypeError, match="`temperature` must be a number"):
        replay_logprobs_from_hidden(hidden, weight, kept, temperature="0.7")
    with pytest.raises(TypeError, match="`kept` must be a KeptSets"):
        replay_logprobs_from_hidden(hidden, weight, {"rows": 1})
    with pytest.raises(TypeError, match="`hidden` must be a floating-point tensor"):
        replay_logprobs_from_hidden(hidden.long(), weight, kept)
    with pytest.raises(TypeError, match="`rows` must be a sequence of row indices"):
        kept.select(torch.ones(kept.rows, dtype=torch.bool))
    with pytest.raises(TypeError, match="`rows` must be a sequence of row indices"):
        kept.select([0.7])
    with pytest.raises(IndexError, match="outside the sets"):
        kept.ids_at(-1, -1)
    with pytest.raises(TypeError, match="takes a device"):
        kept.to(torch.float16)


def test_from_hidden_makes_no_synchronising_call(kept):
    hidden, weight, bias = _case(kept)
    guard = HostSyncGuard()
    found = guard.guarded(replay_logprobs_from_hidden)(hidden, weight, kept, bias=bias)
    guard.guarded(lambda: found.sum().backward())()
    assert guard.ops > 0 and not guard.found, guard.found
