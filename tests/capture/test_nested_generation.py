"""A model that calls another model's `generate()` while its own recorded loop runs (a decoder that
generates per step with an inner decoder, as Moshi's forward does with its depth decoder): the outer loop
is recorded exactly; each inner call is not recorded, and is counted on the outer generation
(`Generation.nested_calls`); never a `RuntimeError` from the processor. Of transformers' own models,
Moshi (its depth decoder generates per step of the text decoder's loop) records exactly; CSM, whose
`_sample` replaces the loop (its steps are codebook frames), is refused before it runs, saying why."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from transformers_offload import Recorder, UnsupportedModeError

from ..helpers import EOS, PAD, VOCAB, assert_steps_equal, left_padded_batch

NEW_TOKENS = 4


def _gpt2(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=128,
                                       bos_token_id=2, eos_token_id=EOS, pad_token_id=PAD)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


class PerStepInner(GPT2LMHeadModel):
    """Each forward also generates two tokens with an inner decoder (a child model), from the last
    position's top token; its own `generate()` passes everything to transformers' (as Moshi's does),
    and with `hand_down` also hands the call's processors to one more inner call after the loop."""

    hand_down = False

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        first = output.logits[:, -1:].argmax(-1)
        self.inner.generate(input_ids=first, max_new_tokens=2, do_sample=False, pad_token_id=PAD)
        return output

    def generate(self, *args, **kwargs):
        out = super().generate(*args, **kwargs)
        if self.hand_down:
            self.inner.generate(input_ids=torch.tensor([[5]]), max_new_tokens=2,
                                logits_processor=kwargs.get("logits_processor"), pad_token_id=PAD)
        return out


# generate() checks its keyword arguments against the forward's parameters (up to 4.4x, by signature).
PerStepInner.forward.__signature__ = inspect.signature(GPT2LMHeadModel.forward)


def _outer() -> PerStepInner:
    base = _gpt2(0)
    model = PerStepInner(base.config).eval()
    model.load_state_dict(base.state_dict())
    model.inner = _gpt2(1)  # a child that generates
    return model


@pytest.mark.parametrize("hand_down", [False, True])
def test_the_outer_loop_is_recorded_exactly_and_each_inner_call_is_counted(recorded, hand_down):
    model = _outer()
    model.hand_down = hand_down
    call = recorded(model, **left_padded_batch(), max_new_tokens=NEW_TOKENS, do_sample=False)
    reference, recording, out = call.reference, call.recording, call.sequences
    generation = recording.generation(0)
    assert len(recording.generations) == 1 and generation.complete, generation.error
    assert torch.equal(out, reference.sequences) and torch.equal(generation.sequences, out)
    assert_steps_equal(generation.scores(), reference.scores, "scores")
    assert_steps_equal(generation.logits(), reference.logits, "logits")
    # One inner call per forward of the outer loop (its steps), and the one handed the processors.
    assert generation.nested_calls == NEW_TOKENS + hand_down


def test_a_model_without_inner_calls_counts_none(gpt2):
    with Recorder(gpt2) as rec:
        gpt2.generate(**left_padded_batch(), max_new_tokens=2, logits_processor=[rec])
    assert rec.generation().nested_calls == 0


def test_csm_whose_sample_replaces_the_loop_is_refused_before_it_runs_not_a_processor_error():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "CsmForConditionalGeneration"):
        pytest.skip("CSM arrived in transformers 4.52")
    depth = dict(num_codebooks=3, backbone_hidden_size=32, vocab_size=20, hidden_size=16, intermediate_size=32,
                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8)
    config = transformers.CsmConfig(
        num_codebooks=3, vocab_size=20, text_vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=38, codebook_pad_token_id=19, codebook_eos_token_id=0,
        bos_token_id=37, audio_token_id=36, audio_eos_token_id=35, depth_decoder_config=depth, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.CsmForConditionalGeneration(config).eval()
    calls = []
    model.depth_decoder.register_forward_hook(lambda *_: calls.append(1))
    with Recorder(model) as rec:
        with pytest.raises(UnsupportedModeError, match=r"CsmForConditionalGeneration runs 'greedy_search' in a decoding "
                                                       r"loop of its own \(_sample overrides transformers'\)"):
            model.generate(input_ids=torch.tensor([[37, 5, 6, 7]]), max_new_tokens=2, logits_processor=[rec])
    assert calls == [] and rec.generations == ()  # refused before any forward


def _tiny_moshi():
    """Moshi (transformers' own): its forward's input preparation runs the depth decoder's generate() once
    per step of the text decoder's loop, which is transformers' own."""
    transformers = pytest.importorskip("transformers")
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.0"):
        pytest.skip("the tiny Moshi here is built with 5.x's MoshiConfig; earlier Moshi releases are not tried")
    mimi = {"model_type": "mimi", "audio_channels": 1, "hidden_size": 32, "num_filters": 8, "num_residual_layers": 1,
            "upsampling_ratios": [8, 4], "codebook_size": 64, "vector_quantization_hidden_dimension": 64,
            "upsample_groups": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
            "sliding_window": 3, "codebook_dim": 64, "use_cache": False, "sampling_rate": 800}
    depth = {"hidden_size": 16, "num_hidden_layers": 1, "max_position_embeddings": 5, "num_attention_heads": 2,
             "ffn_dim": 16, "sliding_window": 4}
    config = transformers.MoshiConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_codebooks=4, rms_norm_eps=1e-3,
        tie_word_embeddings=False, pad_token_id=25, bos_token_id=25, ffn_dim=32, audio_encoder_config=mimi,
        depth_decoder_config=depth)
    torch.manual_seed(0)
    model = transformers.MoshiForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(0, 50, (2, 5), generator=generator),
              "moshi_audio_codes": torch.randint(0, 64, (2, 4, 5), generator=generator),
              "user_audio_codes": torch.randint(0, 64, (2, 4, 5), generator=generator),
              "return_audio_waveforms": False, "return_audio_codes": False, "concat_unconditional_inputs": False}
    return model, inputs


@pytest.mark.parametrize("do_sample", [False, True])
def test_moshi_records_its_text_decoders_loop_exactly_and_counts_the_depth_decoders_calls(do_sample):
    model, inputs = _tiny_moshi()
    kwargs = {**inputs, "max_new_tokens": 4, "do_sample": do_sample}
    torch.manual_seed(2)
    reference = model.generate(**kwargs, return_dict_in_generate=True, output_scores=True, output_logits=True)
    depth_calls = []
    handle = model.depth_decoder.register_forward_pre_hook(lambda module, args: depth_calls.append(1))
    with Recorder(model) as rec:
        torch.manual_seed(2)
        out = model.generate(**kwargs, logits_processor=[rec])
    handle.remove()
    generation = rec.generation()
    assert len(rec.generations) == 1 and generation.complete, generation.error
    assert torch.equal(out, reference.sequences)
    assert_steps_equal(generation.scores(), reference.scores, "scores")
    assert_steps_equal(generation.logits(), reference.logits, "logits")
    # One depth decoder generate() per step after the first (the audio codes of the previous text token).
    assert generation.nested_calls == kwargs["max_new_tokens"] - 1 and depth_calls


def test_a_model_with_generating_children_is_refused_before_anything_runs_where_a_recorder_would_refuse():
    """Its capture begins with its own loop, if it runs one; what the recorder refuses is refused first."""
    model = _outer()
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    with Recorder(model) as rec:
        rec.set_samples(["only-one"])
        with pytest.raises(ValueError, match="`set_samples` named 1 prompt\\(s\\), but this generate\\(\\) call has a batch of"):
            model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=2)
        with pytest.raises(UnsupportedModeError, match="`custom_generate` replaces transformers' decoding loop"):
            model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=2,
                           custom_generate=lambda *args, **kwargs: None)
    assert forwards == [] and rec.generations == ()
