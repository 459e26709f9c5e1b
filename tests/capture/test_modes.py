"""More decoding set-ups, each against Hugging Face's own outputs: one new token, a static cache,
encoder-decoder models (decoder steps), and stop strings."""

from __future__ import annotations

import pytest
import torch

from transformers_offload import Recorder, UnsupportedModeError, _compat

from ..helpers import (
    ENCODER_DECODERS,
    GROUP_BEAM,
    HAS_OUTPUT_LOGITS,
    HF_LOGITS_EXACT,
    IN_LIBRARY,
    MODE_CASES,
    PAD,
    TRANSFORMERS,
    assert_same_beam_rows,
    assert_steps_equal,
    beam_hypotheses,
    hf_reference,
    left_padded_batch,
    make_tiny,
    missing_options,
)


def _check(model, batch, **kwargs):
    missing = missing_options(kwargs)
    if missing:
        pytest.skip(f"transformers {TRANSFORMERS} has no {missing}")
    torch.manual_seed(0)
    reference = hf_reference(model, **batch, **kwargs)
    with Recorder(model) as rec:
        torch.manual_seed(0)
        sequences = model.generate(**batch, logits_processor=[rec], **kwargs)
    assert torch.equal(sequences, reference.sequences)
    assert_steps_equal(rec.logits(), reference.logits, "logits")
    assert_steps_equal(rec.scores(), reference.scores, "scores")
    if reference.beam_indices is not None:
        assert_same_beam_rows(rec.beam_indices(), reference.beam_indices, rec.tokens(), rec.beam_parents())
    return rec


@pytest.mark.parametrize("mode", sorted(MODE_CASES))
def test_one_new_token(tiny_model, mode):
    rec = _check(tiny_model, left_padded_batch(), max_new_tokens=1, **MODE_CASES[mode])
    assert rec.generation().num_steps == 1


@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_static_cache(mode):
    model = make_tiny("llama")
    _check(model, left_padded_batch(), max_new_tokens=8, cache_implementation="static", **MODE_CASES[mode])


@pytest.mark.parametrize("mode", sorted(MODE_CASES))
@pytest.mark.parametrize("name", sorted(ENCODER_DECODERS))
def test_encoder_decoder_models_record_their_decoder_steps(name, mode):
    model = make_tiny(name)
    rec = _check(model, left_padded_batch(), max_new_tokens=10, **MODE_CASES[mode])
    generation = rec.generation()
    assert generation.prompt_length == 1  # the decoder starts from its start token


# 4.46's own low-memory path calls a cache method with an argument it deprecated itself.
@pytest.mark.filterwarnings("ignore:`num_hidden_layers` is deprecated:FutureWarning")
@pytest.mark.parametrize("mode", ["beam_search", "beam_sample"])
def test_low_memory_beam_search(tiny_model, mode, record_property):
    """4.38-4.49 run each step's forward in sub-batches; 4.50+ refuse `low_memory=True` themselves."""
    kwargs = {"beam_sample": {"num_beams": 3, "do_sample": True}, "beam_search": MODE_CASES["beam_search"]}[mode]
    if _compat.REFUSES_LOW_MEMORY_BEAM_SEARCH:
        record_property("outcome", "refused")  # for the support table (docs/support.md)
        with Recorder(tiny_model) as rec:
            with pytest.raises(UnsupportedModeError, match="low_memory=True"):
                tiny_model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=6,
                                    low_memory=True, **kwargs)
        assert rec.generations == ()
        return
    _check(tiny_model, left_padded_batch(), max_new_tokens=6, low_memory=True, **kwargs)


@pytest.mark.parametrize("case", sorted(IN_LIBRARY))
def test_contrastive_search_and_dola(case, store, tmp_path, record_property):
    kwargs = IN_LIBRARY[case]
    mode = "dola_generation" if "dola_layers" in kwargs else "contrastive_search"
    if missing_options(kwargs):
        pytest.skip(f"transformers {TRANSFORMERS} has no {missing_options(kwargs)}")
    model = make_tiny("llama")
    batch = left_padded_batch()
    options = store.options(shard_bytes=3_000)
    if mode not in _compat.SUPPORTED_MODES:
        record_property("outcome", "refused")  # for the support table (docs/support.md)
        with Recorder(model, **options) as rec:
            with pytest.raises(UnsupportedModeError, match=f"{mode}.*custom_generate"):
                model.generate(**batch, logits_processor=[rec], max_new_tokens=6, **kwargs)
        assert rec.generations == ()
        return
    common = dict(max_new_tokens=10, **kwargs)
    output_logits = {"output_logits": True} if HAS_OUTPUT_LOGITS else {}
    reference = model.generate(**batch, **common, return_dict_in_generate=True, output_scores=True, **output_logits)
    with Recorder(model, **options) as rec:
        sequences = model.generate(**batch, logits_processor=[rec], **common)
    rec = store.reopen(rec)
    assert torch.equal(sequences, reference.sequences)
    assert rec.generation().mode == mode
    assert_steps_equal(rec.scores(), reference.scores, "scores")
    if _compat.HF_RAW_LOGITS_EXACT:
        assert_steps_equal(rec.logits(), reference.logits, "logits")
    elif "repetition_penalty" not in kwargs:
        # 4.36-4.39: no trustworthy out.logits; with no processor in the list, raw equals processed.
        assert_steps_equal(rec.logits(), reference.scores, "logits")


def _word_tokenizer():
    """A tokenizer for the tiny models, built offline: token i is the word `w{i}`, except the last,
    `abcdef`, the probe `StopStringCriteria` tokenizes to learn how tokens join into text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from ..helpers import VOCAB

    words = {f"w{i}": i for i in range(VOCAB - 1)}
    words["abcdef"] = VOCAB - 1
    backend = Tokenizer(models.WordLevel(words, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(cleanup=False)  # words joined by spaces (4.42-4.46 need a decoder)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="w0", pad_token=f"w{PAD}", clean_up_tokenization_spaces=False
    )


@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_stop_strings_with_a_tiny_tokenizer(mode):
    """A stop string ends a row mid-batch (every release with `stop_strings`, 4.39+)."""
    if missing_options({"stop_strings": None}):
        pytest.skip(f"transformers {TRANSFORMERS} has no ['stop_strings']")
    model = make_tiny("llama")
    batch = left_padded_batch()
    tokenizer = _word_tokenizer()
    kwargs = dict(MODE_CASES[mode], max_new_tokens=12, tokenizer=tokenizer, pad_token_id=PAD)
    torch.manual_seed(0)
    plain = model.generate(**batch, **kwargs)
    prompt = batch["input_ids"].shape[1]
    stop = tokenizer.convert_ids_to_tokens(int(plain[0, prompt + 3]))  # row 0's fourth token
    rec = _check(model, batch, stop_strings=[stop], **kwargs)
    tokens = [int(step[0]) for step in rec.tokens()]
    first = tokens.index(int(plain[0, prompt + 3]))  # the step whose token ends row 0
    assert first <= 3
    if first + 1 < len(tokens):
        assert bool(rec.finished()[first + 1][0]), "the stop string did not end row 0"


def _assert_rows_hold_the_sequences(indices, sequences, prompt, tokens, parents):
    """Each row `beam_indices()` names holds that returned sequence's tokens so far (rebuilt from the
    recorded ancestry). transformers' own `out.beam_indices` in group beam search count rows within
    each group, so they are not comparable with ours."""
    hypotheses = beam_hypotheses(tokens, parents)
    for sequence in range(indices.shape[0]):
        for step in range(indices.shape[1]):
            row = int(indices[sequence, step])
            if row >= 0:
                assert hypotheses[step][row] == tuple(sequences[sequence, prompt : prompt + step].tolist())


@pytest.mark.parametrize("case", sorted(GROUP_BEAM))
def test_group_beam_search(case, store, tiny_model, tmp_path, record_property):
    """Run inside the library up to 4.56: the processors run once per group of beams, on its rows."""
    kwargs = dict(GROUP_BEAM[case], max_new_tokens=8)
    batch = left_padded_batch()
    if "group_beam_search" not in _compat.SUPPORTED_MODES:
        record_property("outcome", "refused")  # for the support table (docs/support.md)
        with Recorder(tiny_model) as rec:
            with pytest.raises(UnsupportedModeError, match="group_beam_search.*custom_generate"):
                tiny_model.generate(**batch, logits_processor=[rec], **kwargs)
        assert rec.generations == ()
        return
    torch.manual_seed(0)
    reference = hf_reference(tiny_model, **batch, **kwargs)
    options = store.options(shard_bytes=4_000)
    with Recorder(tiny_model, **options) as rec:
        torch.manual_seed(0)
        sequences = tiny_model.generate(**batch, logits_processor=[rec], **kwargs)
    rec = store.reopen(rec)
    assert rec.generation().mode == "group_beam_search"
    assert torch.equal(sequences, reference.sequences)
    assert_steps_equal(rec.logits(), reference.logits, "logits")
    assert_steps_equal(rec.scores(), reference.scores, "scores")
    prompt = batch["input_ids"].shape[1]
    _assert_rows_hold_the_sequences(rec.beam_indices(), sequences, prompt, rec.tokens(), rec.beam_parents())


@pytest.mark.parametrize("mode", sorted(MODE_CASES))
def test_a_processor_that_runs_the_model_does_not_shift_the_raw_logits(mode):
    """Classifier-free guidance's processor runs one more forward per step, inside the processor list:
    beam search's raw logits (taken from the forward) must come from the decoding loop's own."""
    if missing_options({"guidance_scale": 1.5}):
        pytest.skip(f"transformers {TRANSFORMERS} has no classifier-free guidance (`guidance_scale`, 4.31)")
    model = make_tiny("llama")
    kwargs = dict(MODE_CASES[mode], max_new_tokens=8, guidance_scale=1.5)
    logits = {"output_logits": True} if HF_LOGITS_EXACT else {}
    torch.manual_seed(0)
    reference = model.generate(**left_padded_batch(), **kwargs, return_dict_in_generate=True, output_scores=True, **logits)
    with Recorder(model) as rec:
        torch.manual_seed(0)
        sequences = model.generate(**left_padded_batch(), logits_processor=[rec], **kwargs)
    assert torch.equal(sequences, reference.sequences)
    assert_steps_equal(rec.scores(), reference.scores, "scores")
    if HF_LOGITS_EXACT:  # out.logits is exact from 4.40
        assert_steps_equal(rec.logits(), reference.logits, "logits")
