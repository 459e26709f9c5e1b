"""Bad input gets a clear error naming the argument and the fix, before any generation work."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor

from transformers_offload import Recorder, UnsupportedModeError, _compat

from ..helpers import TRANSFORMERS, Boom, FailAtStep, hf_reference, left_padded_batch, make_tiny, missing_options


class CountForwards:
    """Counts the model's forward calls, to prove an error came before any."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.count = 0
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, *args):
        self.count += 1


@pytest.mark.parametrize(
    ("model", "match"),
    [(None, "`model`"), ("gpt2", "`model`"), (torch.nn.Linear(2, 2), "`model` must be a transformers model")],
)
def test_model_without_generate(model, match):
    with pytest.raises(TypeError, match=match):
        Recorder(model)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        (dict(streams="logits"), TypeError, "`streams` must be a tuple"),
        (dict(streams=("logits", "past_key_values")), ValueError, "unknown names \\['past_key_values'\\]"),
        (dict(ring_slots=0), ValueError, "`ring_slots` must be at least 1, got 0"),
        (dict(ring_slots=2.5), TypeError, "`ring_slots` must be an int"),
        (dict(ring_slots=True), TypeError, "`ring_slots` must be an int"),
    ],
)
def test_bad_options(gpt2, options, error, match):
    with pytest.raises(error, match=match):
        Recorder(gpt2, **options)
    assert "generate" not in vars(gpt2), "a refused Recorder left hooks behind"


def test_options_are_keyword_only(gpt2):
    with pytest.raises(TypeError):
        Recorder(gpt2, ("logits",))  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "mode"),
    [
        (dict(num_beams=2, force_words_ids=[[5]]), "constrained_beam_search"),
    ],
)
def test_unsupported_modes_fail_before_generation(gpt2, kwargs, mode):
    if missing_options(kwargs):
        pytest.skip(f"transformers {TRANSFORMERS} has no {missing_options(kwargs)}")
    forwards = CountForwards(gpt2)
    with Recorder(gpt2) as rec:
        with pytest.raises(UnsupportedModeError, match=mode):
            gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=3, **kwargs)
    assert forwards.count == 0
    assert rec.generations == ()


def test_recorder_of_another_model_is_refused_before_work(gpt2):
    other = make_tiny("gpt2", seed=1)
    forwards = CountForwards(other)
    with Recorder(gpt2) as rec, Recorder(other) as own:
        with pytest.raises(ValueError, match="attached to another model.*Recorder\\(model\\)"):
            other.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=3)
        assert forwards.count == 0
        other.generate(**left_padded_batch(), logits_processor=[own], max_new_tokens=2)
    assert rec.generations == () and len(own.generations) == 1


def test_recorder_of_another_model_without_hooks_fails_at_its_first_step(gpt2):
    """A model with no recorder attached has no hook to stop the call early: the recorder, called as
    an ordinary processor, fails at the first step and records nothing."""
    other = make_tiny("gpt2", seed=1)
    with Recorder(gpt2) as rec:
        with pytest.raises(RuntimeError, match="ordinary processor.*Recorder\\(model\\)"):
            other.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=3)
    assert rec.generations == ()


def test_two_recorders_in_one_call(gpt2):
    with Recorder(gpt2) as first, Recorder(gpt2) as second:
        with pytest.raises(ValueError, match="holds 2 Recorders"):
            gpt2.generate(**left_padded_batch(), logits_processor=[first, second], max_new_tokens=2)


def test_closed_recorder(gpt2):
    other_rec = Recorder(gpt2)  # keeps the model hooked, so the closed one is seen by the wrapper
    rec = Recorder(gpt2)
    rec.close()
    with pytest.raises(RuntimeError, match="Recorder is closed"):
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=2)
    other_rec.close()
    with pytest.raises(RuntimeError, match="closed recorder"):
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=2)
    with pytest.raises(RuntimeError, match="closed"):
        with rec:
            pass


def test_one_recorder_in_two_calls_at_once(gpt2):
    """A second call with a busy recorder (here: from inside the first call) is refused before work."""
    batch = left_padded_batch()
    seen = {}

    class StartAnotherCall(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if "error" not in seen:
                try:
                    gpt2.generate(**batch, logits_processor=[rec], max_new_tokens=2)
                except RuntimeError as error:
                    seen["error"] = str(error)
            return scores

    with Recorder(gpt2) as rec:
        gpt2.generate(**batch, logits_processor=[StartAnotherCall(), rec], max_new_tokens=3)
    assert "already recording" in seen["error"]
    assert len(rec.generations) == 1 and rec.generation().num_steps == 3


def test_reading_before_any_generation(gpt2):
    with Recorder(gpt2) as rec:
        with pytest.raises(LookupError, match="no generation yet"):
            rec.logits()
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=2)
        with pytest.raises(LookupError, match="out of range"):
            rec.logits(5)
        with pytest.raises(ValueError, match="beam search only"):
            rec.beam_indices()


def test_stream_not_recorded(gpt2):
    with Recorder(gpt2, streams=("scores",)) as rec:
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=2)
    assert len(rec.scores()) == 2
    with pytest.raises(KeyError, match="no 'logits' stream"):
        rec.logits()


@pytest.mark.parametrize("error", [Boom("disk on fire"), KeyboardInterrupt()])
def test_a_fault_mid_run_keeps_every_recorded_step(gpt2, error):
    batch = left_padded_batch()
    reference = hf_reference(gpt2, **batch, max_new_tokens=10)
    with Recorder(gpt2) as rec:
        with pytest.raises(type(error)):
            gpt2.generate(**batch, logits_processor=[rec, FailAtStep(5, error)], max_new_tokens=10)
        generation = rec.generation()
        assert not generation.complete and type(error).__name__ in generation.error
        assert generation.num_steps == 5
        assert all(torch.equal(a, b) for a, b in zip(generation.logits(), reference.logits[:5]))
        assert all(torch.equal(a, b) for a, b in zip(generation.scores(), reference.scores[:5]))
        # The recorder is free again for the next call.
        gpt2.generate(**batch, logits_processor=[rec], max_new_tokens=2)
    assert [g.complete for g in rec.generations] == [False, True]


def test_recorder_not_in_a_list(gpt2):
    with Recorder(gpt2) as rec:
        with pytest.raises(TypeError, match="`logits_processor` must be a list"):
            gpt2.generate(**left_padded_batch(), logits_processor=rec, max_new_tokens=2)


def test_recorder_in_stopping_criteria_only(gpt2):
    forwards = CountForwards(gpt2)
    with Recorder(gpt2) as rec:
        with pytest.raises(ValueError, match="pass `logits_processor=\\[rec\\]`"):
            gpt2.generate(**left_padded_batch(), stopping_criteria=[rec], max_new_tokens=2)
        assert forwards.count == 0
        # In both lists is fine: it records from the processor list.
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], stopping_criteria=[rec], max_new_tokens=2)
    assert rec.generation().num_steps == 2


def test_copying_a_hooked_model_says_to_close_first(gpt2):
    import copy

    with Recorder(gpt2):
        with pytest.raises(TypeError, match="rec.close\\(\\)"):
            copy.deepcopy(gpt2)
    copy.deepcopy(gpt2)  # fine once closed


def test_custom_generate_is_refused_before_anything_is_loaded(gpt2):
    if not _compat.ACCEPTS_CUSTOM_GENERATE:
        pytest.skip(f"transformers {TRANSFORMERS} has no `custom_generate`")
    forwards = CountForwards(gpt2)
    with Recorder(gpt2) as rec:
        with pytest.raises(UnsupportedModeError, match="custom_generate"):
            gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=3,
                          custom_generate="someone/a-decoding-loop")
    assert forwards.count == 0 and rec.generations == ()


def test_a_recorder_that_recorded_nothing_while_generate_ran_without_it_says_so_once(gpt2, tmp_path):
    from transformers_offload import UnrecordedCallWarning

    rec = Recorder(gpt2, spill_dir=tmp_path / "run")
    gpt2.generate(**left_padded_batch(), max_new_tokens=2)  # the recorder was not handed to the call
    gpt2.generate(**left_padded_batch(), max_new_tokens=2)
    with pytest.warns(UnrecordedCallWarning, match=r"recorded nothing, while GPT2LMHeadModel.generate\(\) ran 2 "
                                                   r"time\(s\) without it.*logits_processor=\[rec\]"):
        rec.close()
    rec.close()  # once


@pytest.mark.filterwarnings("error")
def test_no_warning_where_the_recorder_recorded_or_generate_never_ran(gpt2):
    with Recorder(gpt2):
        pass  # nothing ran: nothing to say
    with Recorder(gpt2) as rec:
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=2)
        gpt2.generate(**left_padded_batch(), max_new_tokens=2)  # one call without it, one with: fine
    assert len(rec.generations) == 1
