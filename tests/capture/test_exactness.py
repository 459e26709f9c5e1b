"""The recording equals Hugging Face's own outputs, bit for bit, in every supported mode.

Each case runs `generate()` twice with the same seed: once stock, with `return_dict_in_generate=True,
output_scores=True, output_logits=True` (the reference), once with the Recorder and no outputs.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from transformers_offload import DeviceAccumulationWarning, Recorder, UnsupportedModeError, open_recording

from ..helpers import (
    CASES,
    HF_LOGITS_EXACT,
    NEW_TOKENS,
    READERS,
    SEED,
    SMALL_SHARD_BYTES,
    TRANSFORMERS,
    assert_same_beam_rows,
    assert_steps_equal,
    finished_from_sequences,
    hf_reference,
    left_padded_batch,
    make_tiny,
    missing_options,
    refused_here,
    resolve_eos,
)


class ShiftTokenOutOfPlace(LogitsProcessor):
    """A user processor that returns a new tensor."""

    def __init__(self, token: int, amount: float) -> None:
        self.token, self.amount = token, amount

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        scores[:, self.token] += self.amount
        return scores


class ShiftTokenInPlace(ShiftTokenOutOfPlace):
    """The same arithmetic, written into the tensor it receives."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores[:, self.token] += self.amount
        return scores


def _run_pair(model, case, user_processors, placement, spill_dir=None):
    batch = left_padded_batch()
    kwargs, eos_ids = resolve_eos(model, batch, CASES[case])
    missing = missing_options(kwargs)
    if missing:
        pytest.skip(f"transformers {TRANSFORMERS} has no {missing}")
    torch.manual_seed(SEED)
    reference = hf_reference(
        model, **batch, logits_processor=LogitsProcessorList(user_processors), max_new_tokens=NEW_TOKENS, **kwargs
    )
    options = {} if spill_dir is None else {"spill_dir": spill_dir, "shard_bytes": SMALL_SHARD_BYTES}
    with Recorder(model, **options) as rec:
        processors = list(user_processors)
        processors.insert(min(placement, len(processors)), rec)
        torch.manual_seed(SEED)
        sequences = model.generate(**batch, logits_processor=processors, max_new_tokens=NEW_TOKENS, **kwargs)
    return batch, kwargs, eos_ids, reference, sequences, rec


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_recording_equals_hugging_face(tiny_model, case, reader, tmp_path, record_property):
    spill_dir = None if reader == "memory" else tmp_path / "run"
    refused = refused_here(CASES[case])
    if refused:  # before generation, naming the mode; nothing recorded
        record_property("outcome", "refused")  # for the support table (docs/support.md)
        batch = left_padded_batch()
        kwargs, _ = resolve_eos(tiny_model, batch, CASES[case])
        with Recorder(tiny_model) as rec:
            with pytest.raises(UnsupportedModeError, match=refused):
                tiny_model.generate(**batch, logits_processor=[rec], max_new_tokens=NEW_TOKENS, **kwargs)
        assert rec.generations == ()
        return
    batch, kwargs, eos_ids, reference, sequences, rec = _run_pair(tiny_model, case, [], 0, spill_dir)
    prompt = batch["input_ids"].shape[1]
    if reader == "open_recording":
        rec = open_recording(spill_dir)

    assert torch.equal(sequences, reference.sequences), "the recorder changed the generated tokens"
    assert_steps_equal(rec.logits(), reference.logits, "logits")
    assert_steps_equal(rec.scores(), reference.scores, "scores")
    generation = rec.generation()
    assert generation.complete and generation.prompt_length == prompt
    assert torch.equal(generation.sequences, reference.sequences)
    if "num_beams" in kwargs:
        assert_same_beam_rows(rec.beam_indices(), reference.beam_indices, rec.tokens(), rec.beam_parents())
        assert not any(f.any() for f in rec.finished())
        assert all(p.shape == (generation.num_rows,) for p in generation.beam_parents())
    else:
        assert torch.equal(torch.stack(rec.tokens(), dim=1), reference.sequences[:, prompt:])
        expected = finished_from_sequences(reference.sequences, prompt, eos_ids)
        assert len(rec.finished()) == len(expected)
        for step, (mine, theirs) in enumerate(zip(rec.finished(), expected)):
            assert torch.equal(mine, theirs), f"finished mask differs at step {step}"


@pytest.mark.parametrize("case", ["greedy_rows_finish_early", "sample_rows_finish_early", "beam_rows_finish_early"])
def test_rows_really_finish_early(gpt2, case):
    batch, kwargs, _, reference, _, rec = _run_pair(gpt2, case, [], 0)
    generated = reference.sequences.shape[1] - batch["input_ids"].shape[1]
    if "num_beams" in kwargs:
        assert (reference.beam_indices == -1).any(), "no returned sequence ended early"
    else:
        assert rec.finished()[-1].any(), "no row finished before the last step"
    assert len(rec.scores()) <= generated


@pytest.mark.parametrize("placement", [0, 1, 2])
@pytest.mark.parametrize("case", ["greedy_penalties", "sample_everything", "beam_penalties_renormalize"])
def test_any_place_in_the_list_and_other_processors(gpt2, case, placement, tmp_path):
    user = [ShiftTokenOutOfPlace(5, 2.0), ShiftTokenOutOfPlace(9, -1.5)]
    spill_dir = tmp_path / "run" if placement == 1 else None  # one placement also goes through shards
    _, _, _, reference, sequences, rec = _run_pair(gpt2, case, user, placement, spill_dir)
    assert torch.equal(sequences, reference.sequences)
    assert_steps_equal(rec.logits(), reference.logits, "logits")
    assert_steps_equal(rec.scores(), reference.scores, "scores")


@pytest.mark.parametrize("case", ["greedy", "sample_top_k_top_p"])
def test_in_place_user_processor_does_not_reach_the_raw_logits(gpt2, case):
    """A processor that edits its input in place corrupts HF's own `out.logits` (same tensor); the
    recording keeps the model's logits. The reference uses the out-of-place twin of that processor."""
    batch = left_padded_batch()
    kwargs = CASES[case]
    torch.manual_seed(SEED)
    reference = hf_reference(
        gpt2, **batch, logits_processor=[ShiftTokenOutOfPlace(5, 4.0)], max_new_tokens=NEW_TOKENS, **kwargs
    )
    with Recorder(gpt2) as rec:
        torch.manual_seed(SEED)
        sequences = gpt2.generate(
            **batch, logits_processor=[ShiftTokenInPlace(5, 4.0), rec], max_new_tokens=NEW_TOKENS, **kwargs
        )
    assert torch.equal(sequences, reference.sequences)
    assert_steps_equal(rec.logits(), reference.logits, "logits")
    assert_steps_equal(rec.scores(), reference.scores, "scores")


@pytest.mark.parametrize("case", ["sample_everything", "beam_return_sequences"])
def test_same_call_with_hf_outputs_on_warns_and_matches(gpt2, case):
    if not HF_LOGITS_EXACT:
        pytest.skip(f"transformers {TRANSFORMERS}: out.logits is not exact (or absent) before 4.40")
    if missing_options(CASES[case]):
        pytest.skip(f"transformers {TRANSFORMERS} has no {missing_options(CASES[case])}")
    batch = left_padded_batch()
    with Recorder(gpt2) as rec:
        torch.manual_seed(SEED)
        with pytest.warns(DeviceAccumulationWarning, match="output_scores"):
            out = gpt2.generate(
                **batch, logits_processor=[rec], max_new_tokens=NEW_TOKENS,
                return_dict_in_generate=True, output_scores=True, output_logits=True, **CASES[case],
            )
        assert_steps_equal(rec.logits(), out.logits, "logits")
        assert_steps_equal(rec.scores(), out.scores, "scores")
        # Warned once per recorder, not on every call.
        torch.manual_seed(SEED)
        gpt2.generate(
            **batch, logits_processor=[rec], max_new_tokens=NEW_TOKENS,
            return_dict_in_generate=True, output_scores=True, **CASES[case],
        )


def test_numpy_framework_gives_the_same_values(gpt2):
    batch = left_padded_batch()
    with Recorder(gpt2) as rec:
        gpt2.generate(**batch, logits_processor=[rec], max_new_tokens=4)
    for as_torch, as_numpy in zip(rec.logits(), rec.logits(framework="np")):
        assert as_numpy.dtype.name == "float32" and as_numpy.shape == tuple(as_torch.shape)
        assert torch.equal(torch.from_numpy(as_numpy), as_torch)
    assert rec.tokens(framework="np")[0].dtype.name == "int64"
    assert rec.finished(framework="np")[0].dtype.name == "bool"
    with pytest.raises(ValueError, match="framework"):
        rec.scores(framework="jax")


@pytest.mark.parametrize("case", ["greedy", "sample_top_k_top_p", "beam_search", "beam_sample"])
def test_a_bfloat16_model_keeps_the_dtypes_transformers_gives(case):
    """Raw logits stay in the model's dtype up to 4.44 and are float32 from 4.45, as in out.logits."""
    model = make_tiny("llama").to(torch.bfloat16)
    _, _, _, reference, sequences, rec = _run_pair(model, case, [], 0)
    assert torch.equal(sequences, reference.sequences)
    assert_steps_equal(rec.logits(), reference.logits, "logits")
    assert_steps_equal(rec.scores(), reference.scores, "scores")


# The processors (and warpers) generate() builds for these options, in the order it applies them.
REPLAY = {
    "no_processors": ({}, []),
    "repetition_penalty": ({"repetition_penalty": 1.3}, [RepetitionPenaltyLogitsProcessor(1.3)]),
    "sampling": (
        {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9},
        [TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.9)],
    ),
    "penalty_and_sampling": (
        {"do_sample": True, "repetition_penalty": 1.2, "temperature": 1.3, "top_k": 40},
        [RepetitionPenaltyLogitsProcessor(1.2), TemperatureLogitsWarper(1.3), TopKLogitsWarper(40)],
    ),
}


@pytest.mark.parametrize("name", sorted(REPLAY))
def test_replaying_the_processors_on_the_raw_logits_gives_the_processed_scores(gpt2, name):
    """What holds on every release, 4.36 included (no `output_logits` there to compare with): the
    processed scores are the recorded raw logits run through the very processors generate() used."""
    kwargs, processors = REPLAY[name]
    batch = left_padded_batch((6, 6, 6))  # no padding: 5.x's repetition penalty skips left padding
    with Recorder(gpt2) as rec:
        torch.manual_seed(SEED)
        sequences = gpt2.generate(**batch, logits_processor=[rec], max_new_tokens=NEW_TOKENS, **kwargs)
    prompt = batch["input_ids"].shape[1]
    assert len(rec.scores()) == sequences.shape[1] - prompt
    for step, (raw, processed) in enumerate(zip(rec.logits(), rec.scores())):
        replayed = raw.clone()
        for processor in processors:
            replayed = processor(sequences[:, : prompt + step], replayed)
        assert torch.equal(replayed, processed), f"step {step}: replaying {name} differs"
