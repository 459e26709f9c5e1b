"""Verify, don't assume: each generation's recording is checked against what its call returned when the
call ends; a disagreement marks it incomplete, names the disagreement and warns, never `complete=True`."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2LMHeadModel

from transformers_offload import Recorder, RecordingMismatchWarning
from transformers_offload.capture.loop_check import StepLog, check_beams, check_loop

from ..helpers import assert_steps_equal, hf_reference, left_padded_batch, make_tiny, skip_if_refused


class TwiceThenSecond(GPT2LMHeadModel):
    """A user's `generate()` override that runs transformers' loop twice and returns the second run."""

    def generate(self, *args, **kwargs):
        super().generate(*args, **kwargs)
        return super().generate(*args, **kwargs)


class TwiceThenFirst(GPT2LMHeadModel):
    """The same, returning the first run's result."""

    def generate(self, *args, **kwargs):
        first = super().generate(*args, **kwargs)
        super().generate(*args, **kwargs)
        return first


class DropsLastToken(GPT2LMHeadModel):
    """An override that returns less than its loop appended."""

    def generate(self, *args, **kwargs):
        return super().generate(*args, **kwargs)[:, :-1]


class EditsInPlace(GPT2LMHeadModel):
    """An override that edits the returned tensor, the loop's own last input_ids, in place."""

    def generate(self, *args, **kwargs):
        out = super().generate(*args, **kwargs)
        out[:, -1] = 7
        return out


class Reworks(GPT2LMHeadModel):
    """An override whose beam search result is reworked by `rework` before it is returned."""

    rework = None

    def generate(self, *args, **kwargs):
        return type(self).rework(super().generate(*args, **kwargs))


def _as(cls):
    base = make_tiny("gpt2")
    model = cls(base.config).eval()
    model.load_state_dict(base.state_dict())
    return model


def _generate(model, rec, **options):
    torch.manual_seed(0)
    return model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=5, do_sample=True,
                          pad_token_id=0, **options)


def test_a_loop_run_twice_gives_two_generations_the_first_marked_superseded(store):
    model = _as(TwiceThenSecond)
    with Recorder(model, **store.options()) as rec:
        rec.set_samples(["a", "b", "c"])
        with pytest.warns(RecordingMismatchWarning, match="another decoding loop"):
            out = _generate(model, rec)
    run = store.reopen(rec)
    first, second = run.generations
    assert first.sample_ids == second.sample_ids == ("a", "b", "c")  # both loops ran over the call's prompts
    assert not first.complete and "RecordingMismatch" in first.error and "another decoding loop" in first.error
    assert first.num_steps == 5  # its steps stay readable
    assert second.complete and second.error is None
    assert torch.equal(second.sequences, out)
    # The kept loop is exact: the same call's second loop, rerun with Hugging Face's own outputs.
    plain = make_tiny("gpt2")
    torch.manual_seed(0)
    plain.generate(**left_padded_batch(), max_new_tokens=5, do_sample=True, pad_token_id=0)  # loop 1
    reference = hf_reference(plain, **left_padded_batch(), max_new_tokens=5, do_sample=True, pad_token_id=0)
    assert torch.equal(reference.sequences, out)
    assert_steps_equal(run.logits(1), reference.logits, "logits")
    assert_steps_equal(run.scores(1), reference.scores, "scores")


def test_a_call_returning_an_earlier_loop_marks_the_last_one_incomplete(store):
    model = _as(TwiceThenFirst)
    with Recorder(model, **store.options()) as rec:
        with pytest.warns(RecordingMismatchWarning) as caught:
            _generate(model, rec)
    messages = [str(w.message) for w in caught]
    assert any("another decoding loop" in m for m in messages)
    assert any("differ from the recorded tokens" in m for m in messages)
    run = store.reopen(rec)
    assert [g.complete for g in run.generations] == [False, False]
    assert "differ from the recorded tokens first at row" in run.generations[1].error
    assert run.generations[1].sequences is None


def test_returned_sequences_of_another_shape_mark_it_incomplete(store):
    model = _as(DropsLastToken)
    with Recorder(model, **store.options()) as rec:
        with pytest.warns(RecordingMismatchWarning, match="not the same rows and steps"):
            _generate(model, rec)
    generation = store.reopen(rec).generation()
    assert not generation.complete and generation.num_steps == 5


def test_a_result_edited_in_place_is_caught():
    model = _as(EditsInPlace)
    with Recorder(model) as rec:
        with pytest.warns(RecordingMismatchWarning, match="differ from the recorded tokens"):
            _generate(model, rec)
    assert not rec.generation().complete


@pytest.mark.parametrize("rework", [
    lambda out: out[:1],  # a row dropped
    lambda out: out[:, :-2],  # cut short
    lambda out: out.flip(0),  # rows swapped
    lambda out: torch.cat([out[:, :8], (out[:, 8:9] + 1) % 128, out[:, 9:]], dim=1),  # the first generated token
], ids=["row-dropped", "cut-short", "rows-swapped", "token-changed"])
def test_a_reworked_beam_search_result_is_caught(rework):
    model = _as(Reworks)
    Reworks.rework = staticmethod(rework)
    with Recorder(model) as rec:
        with pytest.warns(RecordingMismatchWarning):
            torch.manual_seed(0)
            model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=6, num_beams=3,
                           num_return_sequences=2, pad_token_id=0)
    assert not rec.generation().complete


@pytest.mark.parametrize("options", [
    {"num_beams": 3}, {"num_beams": 3, "num_return_sequences": 3}, {"num_beams": 3, "do_sample": True},
    {"num_beams": 4, "length_penalty": -2.0}, {"num_beams": 2, "eos_token_id": [1, 5, 9, 11], "max_new_tokens": 12},
], ids=["beam", "all-beams", "beam-sample", "short-preferred", "early-ends"])
def test_stock_beam_searches_pass_the_check(gpt2, options):
    skip_if_refused(options)
    # filterwarnings=error: a RecordingMismatchWarning would fail this test.
    with Recorder(gpt2) as rec:
        torch.manual_seed(0)
        out = gpt2.generate(**left_padded_batch(), logits_processor=[rec], pad_token_id=0,
                            **{"max_new_tokens": 6, **options})
    assert rec.generation().complete and torch.equal(rec.generation().sequences, out)


def test_a_stock_call_is_complete_without_a_warning(gpt2):
    # filterwarnings=error: any RecordingMismatchWarning would fail this test.
    with Recorder(gpt2) as rec:
        out = _generate(gpt2, rec)
    assert rec.generation().complete and torch.equal(rec.generation().sequences, out)


def _ids(*rows):
    return torch.tensor(rows)


@pytest.mark.parametrize(
    ("complete_steps", "sequences", "seen_ids", "problem"),
    [
        (2, _ids([5, 6, 7]), _ids([5, 6, 7]), None),
        (1, _ids([5, 6, 7]), _ids([5, 6, 7]), "processors ran (and so the logits and scores were recorded) for 1 of them"),
        (2, _ids([5, 6]), _ids([5, 6, 7]), "not the same rows and steps"),
        (2, _ids([5, 6, 8]), _ids([5, 6, 7]), "first at row 0, step 1: 8 returned, 7 recorded"),
        (2, _ids([5, 6, 7], [5, 6, 7]), _ids([5, 6, 7]), "not the same rows and steps"),
        (0, _ids([5, 6, 7]), None, "stopping criteria never ran"),
        (0, _ids([5]), None, None),
        (2, None, _ids([5, 6, 7]), None),
    ],
)
def test_check_loop(complete_steps, sequences, seen_ids, problem):
    verdict = check_loop(complete_steps=complete_steps, sequences=sequences, seen_ids=seen_ids, prompt_length=1)
    if problem is None:
        assert verdict.problem is None
    else:
        assert problem in verdict.problem
    assert verdict.num_steps == min(complete_steps, 0 if seen_ids is None else seen_ids.shape[-1] - 1)


def test_check_beams_in_beam_search_checks_the_length():
    prompt = _ids([5], [5])  # one prompt, two beams
    verdict = check_beams(complete_steps=2, sequences=_ids([5, 6, 7, 8]), prompt=prompt, tokens=[], parents=[],
                          num_beams=2, fill_ids=(0,))
    assert "3 generated token(s), but the recorder saw 2 step(s)" in verdict.problem


def test_a_step_log_keeps_every_step_in_order_across_its_growth_and_a_change_of_rows():
    log = StepLog(capacity=2)
    steps = [torch.arange(3) + 10 * t for t in range(5)]  # 5 steps: the buffer doubles twice
    for values in steps:
        log.append(values)
        values.zero_()  # kept as copies: the caller's tensors may change later (input_ids do)
    assert len(log) == 5
    assert torch.equal(log.values(), torch.stack([torch.arange(3) + 10 * t for t in range(5)], dim=1))
    assert all(torch.equal(a, torch.arange(3) + 10 * t) for t, a in enumerate(log.steps()))
    log.append(torch.tensor([7, 8]))  # another row count: another buffer, the order kept
    assert len(log) == 6 and torch.equal(log.steps()[-1], torch.tensor([7, 8]))
