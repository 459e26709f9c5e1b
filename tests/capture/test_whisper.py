"""Whisper: its `generate()` runs transformers' decoding loop once per 30-second segment and per fallback
temperature. Each loop is one generation, checked against that loop's own output, with the prompts the
call kept (`Generation.loop`); each is equal (`torch.equal`) to what Hugging Face returns for it."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, WhisperConfig, WhisperForConditionalGeneration

from transformers_offload import Recorder, RecordingMismatchWarning, _compat

from ..helpers import HF_LOGITS_EXACT, assert_steps_equal

HAS_TAPS = all(callable(getattr(WhisperForConditionalGeneration, name, None)) for name in _compat.LOOP_TAPS)
# Short-form (up to 30 s) runs through the segment loop, with its fallback and reworked outputs, where
# `generate_with_fallback` knows it (4.4x+); before, it ran transformers' loop once and returned its output.
SEGMENTED_SHORT_FORM = HAS_TAPS and "is_shortform" in inspect.signature(
    WhisperForConditionalGeneration.generate_with_fallback).parameters
TAPPED = pytest.mark.skipif(
    not HAS_TAPS, reason=f"transformers {_compat.TRANSFORMERS_VERSION}'s Whisper has no loop taps: see the last test"
)
SEGMENTED = pytest.mark.skipif(
    not SEGMENTED_SHORT_FORM,
    reason=f"transformers {_compat.TRANSFORMERS_VERSION} runs short-form Whisper as one plain loop (the first tests)",
)
# Whisper's generate() in 4.46-4.50 validates its config halfway through applying the call's options, and
# warns that `output_scores` (`output_logits`) comes without `return_dict_in_generate` (the reference call passes both).
pytestmark = pytest.mark.filterwarnings(
    "ignore:`return_dict_in_generate` is NOT set to `True`, but `output_:UserWarning"
)
# Whisper's long-form generate() up to 4.4x logs through `logger.warn`, which Python deprecates: not ours.
LOGGER_WARN = pytest.mark.filterwarnings("ignore:The 'warn' method is deprecated:DeprecationWarning")


VOCAB, NO_TIMESTAMPS, EOS, PAD, START = 300, 200, 2, 0, 3
TIMESTAMP = NO_TIMESTAMPS + 1  # <|0.00|>; TIMESTAMP + k is k x 0.02 s


def whisper() -> WhisperForConditionalGeneration:
    torch.manual_seed(0)
    config = WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, d_model=16, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=1500,
        max_target_positions=64, pad_token_id=PAD, bos_token_id=1, eos_token_id=EOS, decoder_start_token_id=START,
    )
    model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.proj_out.weight.mul_(8.0)  # sharper logits: no ties in greedy and beam choices
    # What a released checkpoint's generation config holds, minus the languages.
    model.generation_config = GenerationConfig(
        decoder_start_token_id=START, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=1,
        no_timestamps_token_id=NO_TIMESTAMPS, suppress_tokens=[5, 6], begin_suppress_tokens=[EOS, 7],
        max_initial_timestamp_index=5, is_multilingual=False, max_length=40,
    )
    return model


class Script(LogitsProcessor):
    """Per prompt row, the token to choose at each generated position (then EOS): every other entry -inf.
    Positions count from the loop's decoder prompt (`prompt_length`). A loop over fewer rows than the
    script (a fallback attempt) decodes its first rows' prompts."""

    def __init__(self, script: list[list[int]], prompt_length: int) -> None:
        self.script, self.prompt_length = script, prompt_length

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_length
        rows = scores.shape[0]
        chosen = torch.tensor([row[step] if step < len(row) else EOS for row in self.script])
        chosen = chosen[:rows] if rows < len(self.script) else chosen.repeat_interleave(rows // len(self.script))
        keep = torch.zeros_like(scores, dtype=torch.bool)
        keep[torch.arange(rows), chosen] = True
        return scores.masked_fill(~keep, float("-inf"))


def _features(frames: int = 3000) -> torch.Tensor:
    return torch.randn(2, 8, frames, generator=torch.Generator().manual_seed(1))


def _run(model, store=None, *, extra=(), **options):
    """The call recorded, and the same call with Hugging Face's own outputs (the same random state)."""
    torch.manual_seed(0)
    reference = model.generate(logits_processor=list(extra), return_dict_in_generate=True, output_scores=True,
                               **({"output_logits": True} if HF_LOGITS_EXACT else {}), **options)
    with Recorder(model, **(store.options() if store else {})) as rec:
        torch.manual_seed(0)
        out = model.generate(logits_processor=[rec, *extra], **options)
    run = store.reopen(rec) if store else rec
    return reference, out, run


@TAPPED
@pytest.mark.parametrize("options", [{}, {"do_sample": True}], ids=["greedy", "sample"])
def test_short_form_is_one_loop_equal_to_what_whisper_returns(store, options):
    reference, out, run = _run(whisper(), store, input_features=_features(), max_new_tokens=10,
                               **options)
    (generation,) = run.generations
    assert generation.complete, generation.error
    segment = {"call": 0, "loop": 0, "segment": 0, "attempt": 0, "batch_rows": [0, 1], "kept_rows": [0, 1]}
    assert generation.loop == (segment if SEGMENTED_SHORT_FORM else None)  # None: one plain loop
    assert torch.equal(generation.sequences, reference.sequences)  # the loop's own, start ids included
    assert len(generation.scores()) == len(reference.scores) == 10
    assert_steps_equal(generation.scores(), reference.scores, "scores")
    if HF_LOGITS_EXACT:
        assert_steps_equal(generation.logits(), reference.logits, "logits")


@TAPPED
def test_beam_search_rows_are_the_running_beams_whisper_reselects_per_sequence(store):
    reference, out, run = _run(whisper(), store, input_features=_features(), max_new_tokens=10,
                               num_beams=3)
    (generation,) = run.generations
    assert generation.complete and generation.num_rows == 6
    if not SEGMENTED_SHORT_FORM:  # the loop's own outputs, as returned
        assert_steps_equal(generation.scores(), reference.scores, "scores")
        return
    # Whisper returns, per sequence and step, the scores row its beam came from (where it keeps
    # `beam_indices`; up to 4.4x it drops them and returns the first running rows, as for the logits)...
    for step, theirs in enumerate(reference.scores):
        rows = slice(0, theirs.shape[0]) if reference.beam_indices is None else reference.beam_indices[:, step]
        assert torch.equal(generation.scores(steps=step)[0][rows], theirs)
    # ...and, for the logits, the first rows of the running beams (rows 0 and 1 of the batch's beams).
    for step, theirs in enumerate(reference.logits if HF_LOGITS_EXACT else ()):
        assert torch.equal(generation.logits(steps=step)[0][: theirs.shape[0]], theirs)


@SEGMENTED
def test_temperature_fallback_records_every_attempt_and_which_prompts_it_kept(store):
    model = whisper()
    # Prompt 0 repeats one token (its compression ratio fails the threshold at every temperature), prompt 1 does not.
    script = Script([[20] * 20, list(range(30, 50))], prompt_length=2)
    reference, out, run = _run(model, store, extra=[script], input_features=_features(),
                               max_new_tokens=20, temperature=(0.0, 0.2, 0.4), compression_ratio_threshold=1.5)
    first, second, last = run.generations
    assert [g.complete for g in run.generations] == [True, True, True]
    assert [g.loop["attempt"] for g in run.generations] == [0, 1, 2]
    assert [g.loop["batch_rows"] for g in run.generations] == [[0, 1], [0], [0]]
    assert [g.loop["kept_rows"] for g in run.generations] == [[1], [], [0]]  # the last attempt keeps what is left
    assert [g.num_rows for g in run.generations] == [2, 1, 1]
    # Whisper returns each prompt's kept attempt: prompt 1 from the first, prompt 0 from the last.
    for step in range(20):
        assert torch.equal(first.scores(steps=step, rows=[1])[0][0], reference.scores[step][1])
        assert torch.equal(last.scores(steps=step)[0][0], reference.scores[step][0])
        if HF_LOGITS_EXACT:
            assert torch.equal(first.logits(steps=step, rows=[1])[0][0], reference.logits[step][1])
            assert torch.equal(last.logits(steps=step)[0][0], reference.logits[step][0])


@SEGMENTED
def test_each_attempt_names_its_prompts_sample_ids():
    model = whisper()
    script = Script([[20] * 20, list(range(30, 50))], prompt_length=2)
    with Recorder(model) as rec:
        rec.set_samples(["a", "b"])
        model.generate(input_features=_features(), logits_processor=[rec, script], max_new_tokens=20,
                       temperature=(0.0, 0.2), compression_ratio_threshold=1.5)
    assert [g.sample_ids for g in rec.generations] == [("a", "b"), ("a",)]


@SEGMENTED
def test_loops_whose_rows_repeat_a_prompt_are_not_given_its_id():
    # num_return_sequences=2: Whisper decodes each prompt twice, as rows of their own (ids must be distinct).
    model = whisper()
    with Recorder(model) as rec:
        rec.set_samples(["a", "b"])
        model.generate(input_features=_features(), logits_processor=[rec], max_new_tokens=4, do_sample=True,
                       num_return_sequences=2)
    assert all(g.sample_ids is None for g in rec.generations)
    assert all(len(g.loop["batch_rows"]) == 4 for g in rec.generations)


@TAPPED
@LOGGER_WARN
def test_long_form_records_a_loop_per_segment_equal_to_each_segments_result(store):
    model = whisper()
    mask = torch.ones(2, 6000, dtype=torch.long)
    mask[1, 4500:] = 0  # the second audio is 45 s long
    # A timestamp, a word, a closing timestamp: a single timestamp ending moves on by the whole segment.
    script = Script([[TIMESTAMP, 10, TIMESTAMP + 50]], prompt_length=1)
    reference, out, run = _run(model, store, extra=[script], input_features=_features(6000),
                               attention_mask=mask, return_timestamps=True, return_segments=True)
    loops = run.generations
    assert [g.complete for g in loops] == [True, True]
    assert ([(g.loop["segment"], g.loop["batch_rows"], g.loop["kept_rows"]) for g in loops]
            == [(0, [0, 1], [0, 1]), (1, [0, 1], [0, 1])])
    for prompt, segments in enumerate(reference["segments"]):
        assert len(segments) == 2
        for generation, segment in zip(loops, segments):
            theirs = segment["result"]
            assert len(theirs["scores"]) == generation.num_steps
            # Whisper up to 4.4x does not split `logits` per prompt in a segment's result (it keeps one step's
            # tensor of every prompt): nothing to compare the recorded logits with there.
            split_logits = HF_LOGITS_EXACT and isinstance(theirs.get("logits"), (list, tuple))
            for step, scores in enumerate(theirs["scores"]):
                assert torch.equal(generation.scores(steps=step)[0][prompt], scores)
                if split_logits:
                    assert torch.equal(generation.logits(steps=step)[0][prompt], theirs["logits"][step])
            # The loop's sequence; Whisper up to 4.38 keeps it without the decoder's start ids.
            mine = generation.sequences[prompt]
            assert torch.equal(mine, theirs["sequences"]) or torch.equal(mine[generation.prompt_length:], theirs["sequences"])


@SEGMENTED
def test_short_form_timestamps_are_one_loop(store):
    script = Script([[TIMESTAMP, 10, 11, TIMESTAMP + 50]], prompt_length=1)
    reference, out, run = _run(whisper(), store, extra=[script], input_features=_features(),
                               return_timestamps=True, return_segments=True)
    (generation,) = run.generations
    assert generation.complete, generation.error
    for prompt, (segment,) in enumerate(reference["segments"]):
        for step, scores in enumerate(segment["result"]["scores"]):
            assert torch.equal(generation.scores(steps=step)[0][prompt], scores)


@pytest.mark.skipif(HAS_TAPS, reason="this release's Whisper has loop taps: the tests above")
@pytest.mark.parametrize("options", [{}, {"do_sample": True}, {"num_beams": 3}], ids=["greedy", "sample", "beam"])
def test_without_loop_taps_each_loop_is_exact_or_marked(options):
    """An older Whisper: each recorded loop is either complete and equal to what Whisper returns, or
    marked incomplete with a warning; never complete with other content."""
    model = whisper()
    torch.manual_seed(0)
    reference = model.generate(input_features=_features(), max_new_tokens=10, return_dict_in_generate=True,
                               output_scores=True, **options)
    with Recorder(model) as rec, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        model.generate(input_features=_features(), max_new_tokens=10, logits_processor=[rec], **options)
    warned = [w for w in caught if issubclass(w.category, RecordingMismatchWarning)]
    for generation in rec.generations:
        if generation.complete:
            assert len(rec.generations) == 1
            if "num_beams" not in options:  # Whisper reselects beam rows (see the tapped test)
                assert all(torch.equal(a, b) for a, b in zip(generation.scores(), reference.scores))
        else:
            assert "RecordingMismatch" in generation.error and warned
