"""Models whose `generate()` calls an inner model's (BLIP-2's language model) are recorded exactly, as
one generation of the outer call, instead of refused."""

from __future__ import annotations

import pytest
import torch
import transformers

if not hasattr(transformers, "Blip2Config"):
    pytest.skip(f"transformers {transformers.__version__} has no BLIP-2 (it arrives in 4.27)", allow_module_level=True)

from transformers import (  # noqa: E402
    Blip2Config,
    Blip2ForConditionalGeneration,
    Blip2QFormerConfig,
    Blip2VisionConfig,
    OPTConfig,
)

from transformers_offload import Recorder
from transformers_offload.capture.hooks import is_hooked

from ..helpers import HF_LOGITS_EXACT, assert_steps_equal, attention

IMAGE_TOKEN = 98


def blip2(attn_implementation: str | None = None) -> Blip2ForConditionalGeneration:
    vision = Blip2VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                               image_size=30, patch_size=15)
    qformer = Blip2QFormerConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                 encoder_hidden_size=16, vocab_size=99)
    text = OPTConfig(vocab_size=99, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
                     word_embed_proj_dim=16, max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    config = Blip2Config(vision_config=vision.to_dict(), qformer_config=qformer.to_dict(), text_config=text.to_dict(),
                         num_query_tokens=4, image_token_index=IMAGE_TOKEN)
    torch.manual_seed(0)
    if not attention(attn_implementation):
        return Blip2ForConditionalGeneration(config).eval()
    return Blip2ForConditionalGeneration._from_config(config, **attention(attn_implementation)).eval()


def _inputs() -> dict:
    return {
        "pixel_values": torch.randn(2, 3, 30, 30, generator=torch.Generator().manual_seed(1)),
        "input_ids": torch.tensor([[IMAGE_TOKEN] * 4 + [0, 5, 6], [IMAGE_TOKEN] * 4 + [0, 7, 8]]),
    }


@pytest.mark.parametrize("options", [{}, {"do_sample": True}, {"num_beams": 2}], ids=["greedy", "sample", "beam"])
def test_blip2_is_recorded_as_its_language_models_call(store, options):
    model = blip2()
    torch.manual_seed(0)
    reference = model.generate(**_inputs(), max_new_tokens=5, return_dict_in_generate=True, output_scores=True,
                               **({"output_logits": True} if HF_LOGITS_EXACT else {}), **options)
    with Recorder(model, **store.options()) as rec:
        rec.set_samples(["cat", "dog"])
        torch.manual_seed(0)
        out = model.generate(**_inputs(), max_new_tokens=5, logits_processor=[rec], **options)
        assert not is_hooked(model.language_model)  # attached for the call only
    run = store.reopen(rec)
    (generation,) = run.generations
    assert generation.complete, generation.error
    assert generation.sample_ids == ("cat", "dog")
    assert torch.equal(out, reference.sequences)
    # The inner call's own sequences: what BLIP-2 returns, or (up to 4.4x, where the language model is
    # given embeddings only) the same after the BOS id BLIP-2 puts before them.
    assert torch.equal(generation.sequences, out[:, out.shape[1] - generation.sequences.shape[1]:])
    assert generation.sequences.shape[1] >= out.shape[1] - 1
    assert_steps_equal(generation.scores(), reference.scores, "scores")
    if HF_LOGITS_EXACT:  # 4.40+ (before, tests/capture/test_exactness.py checks the logits against the forward's)
        assert_steps_equal(generation.logits(), reference.logits, "logits")


def test_blip2_attentions_and_hidden_states():
    model = blip2("eager")
    torch.manual_seed(0)
    reference = model.generate(**_inputs(), max_new_tokens=3, return_dict_in_generate=True, output_attentions=True,
                               output_hidden_states=True)
    with Recorder(model, streams=("logits", "attentions", "hidden_states")) as rec:
        torch.manual_seed(0)
        model.generate(**_inputs(), max_new_tokens=3, logits_processor=[rec])
    generation = rec.generation()
    for mine, theirs in zip(generation.hidden_states(), reference.hidden_states):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    for mine, theirs in zip(generation.attentions(), reference.attentions):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))


class KeepsItsProcessors(Blip2ForConditionalGeneration):
    """A delegating generate() that does not pass `logits_processor` on."""

    def generate(self, pixel_values, input_ids=None, logits_processor=None, **kwargs):
        return super().generate(pixel_values, input_ids=input_ids, **kwargs)


def test_a_delegating_generate_that_drops_the_recorder_is_an_error_not_an_empty_recording():
    base = blip2()
    model = KeepsItsProcessors(base.config).eval()
    model.load_state_dict(base.state_dict())
    with Recorder(model) as rec:
        with pytest.raises(RuntimeError, match="nothing was recorded"):
            model.generate(**_inputs(), max_new_tokens=3, logits_processor=[rec])
    assert rec.generations == ()


def test_blip2_records_a_call_whose_inputs_are_passed_by_position():
    model = blip2()
    inputs = _inputs()
    reference = model.generate(inputs["pixel_values"], inputs["input_ids"], max_new_tokens=3,
                               return_dict_in_generate=True, output_scores=True)
    with Recorder(model) as rec:
        out = model.generate(inputs["pixel_values"], inputs["input_ids"], logits_processor=[rec], max_new_tokens=3)
    assert torch.equal(out, reference.sequences) and rec.generation().complete
    assert_steps_equal(rec.scores(), reference.scores, "scores")
