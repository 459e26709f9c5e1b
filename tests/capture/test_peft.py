"""PEFT models: `Recorder(peft_model)` records `peft_model.generate(...)` exactly (LoRA with non-zero weights:
greedy, sampling, beam search; a merged adapter; adapters switched and disabled between calls, each
generation's `adapters` naming those in use), in memory and in a recording directory."""

from __future__ import annotations

import pytest
import torch

from transformers_offload import Recorder, open_recording

from ..helpers import TRANSFORMERS, assert_steps_equal, left_padded_batch, make_tiny

try:  # the test extra's peft is made for the newest transformers; the version matrix's older releases may not import it
    import peft
except Exception as error:  # noqa: BLE001 - any failure to import: skipped, saying why
    pytest.skip(f"peft does not import with transformers {TRANSFORMERS}: {type(error).__name__}: {error}",
                allow_module_level=True)

# The calls ask for Hugging Face's own per-step outputs, the reference they are compared with; peft 0.21 reads
# transformers 5.x's deprecated `is_gradient_checkpointing` (its warning, not ours).
pytestmark = [pytest.mark.filterwarnings("ignore::transformers_offload.errors.DeviceAccumulationWarning"),
              pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")]
MODES = {
    "greedy": {"do_sample": False},
    "sample": {"do_sample": True, "top_p": 0.9, "temperature": 0.7},
    "beam_search": {"do_sample": False, "num_beams": 3, "num_return_sequences": 2},
}


def _lora(seed: int, **extra) -> "peft.LoraConfig":
    # init_lora_weights=False: B is random too, so the adapter changes every logit (its default makes B zero).
    torch.manual_seed(seed)
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, **extra)


def _peft_model():
    model = make_tiny("llama")
    return peft.get_peft_model(model, _lora(1)).eval()


def _generate(peft_model, rec, mode: str, seed: int = 3):
    torch.manual_seed(seed)
    return peft_model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=5, pad_token_id=0,
                               return_dict_in_generate=True, output_logits=True, output_scores=True, **MODES[mode])


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_lora_model_is_recorded_exactly_in_every_mode(mode):
    peft_model = _peft_model()
    with Recorder(peft_model) as rec:
        out = _generate(peft_model, rec, mode)
    assert_steps_equal(rec.logits(), out.logits, "logits")
    assert_steps_equal(rec.scores(), out.scores, "scores")
    assert torch.equal(rec.generations[-1].sequences, out.sequences)
    assert rec.generations[-1].adapters == {"active": ["default"], "merged": [], "disabled": False}
    # The adapter is in the logits: the base model alone computes others.
    with peft_model.disable_adapter(), Recorder(peft_model) as base:
        plain = _generate(peft_model, base, "greedy")
    assert base.generations[-1].adapters["disabled"] is True
    assert not torch.equal(plain.logits[0], _generate_greedy_logits(peft_model))


def _generate_greedy_logits(peft_model) -> torch.Tensor:
    with Recorder(peft_model) as rec:
        return _generate(peft_model, rec, "greedy").logits[0]


def test_merged_and_switched_adapters_are_recorded_exactly_and_named_in_each_generation(tmp_path):
    peft_model = _peft_model()
    peft_model.add_adapter("other", _lora(2))
    with Recorder(peft_model, spill_dir=tmp_path / "run") as rec:
        outs = [_generate(peft_model, rec, "sample")]
        peft_model.set_adapter("other")
        outs.append(_generate(peft_model, rec, "sample"))
        peft_model.merge_adapter()
        outs.append(_generate(peft_model, rec, "beam_search"))
        peft_model.unmerge_adapter()
    run = open_recording(tmp_path / "run")
    assert [generation.adapters for generation in run.generations] == [
        {"active": ["default"], "merged": [], "disabled": False},
        {"active": ["other"], "merged": [], "disabled": False},
        {"active": ["other"], "merged": ["other"], "disabled": False},
    ]
    for index, out in enumerate(outs):
        assert_steps_equal(run.logits(generation=index), out.logits, f"generation {index}'s logits")
        assert_steps_equal(run.scores(generation=index), out.scores, f"generation {index}'s scores")
    assert not torch.equal(outs[0].logits[0], outs[1].logits[0])  # the two adapters differ
    from transformers_offload.cli.summary import format_summary

    shown = format_summary(run.describe())
    assert "adapters: active default" in shown and "adapters: active other; merged other" in shown


def test_a_model_without_adapters_has_none_in_its_header():
    model = make_tiny("llama")
    with Recorder(model) as rec:
        model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=2, pad_token_id=0)
    assert rec.generations[-1].adapters is None


def test_a_mixed_batch_names_each_rows_adapter_and_records_exactly():
    peft_model = _peft_model()
    peft_model.add_adapter("other", _lora(2))
    with Recorder(peft_model) as rec:
        torch.manual_seed(3)
        out = peft_model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=4, pad_token_id=0,
                                  adapter_names=["other", "__base__", "default"], return_dict_in_generate=True,
                                  output_logits=True, output_scores=True, do_sample=False)
    assert rec.generations[-1].adapters["per_row"] == ["other", "__base__", "default"]
    assert_steps_equal(rec.logits(), out.logits, "logits")
    with Recorder(peft_model) as rec:
        _generate(peft_model, rec, "greedy")
    assert "per_row" not in rec.generations[-1].adapters  # the hooks went with the mixed call


def test_score_computes_a_lora_models_scored_positions_only_and_records_its_forwards_values():
    """A PeftModel's forward takes `logits_to_keep` and the cache through its keywords, as the model inside names them
    (before, `score` passed `past_key_values`, deprecated on 5.24 and later, and computed every position)."""
    from transformers_offload import score
    from transformers_offload.rescoring.corpus import windows

    peft_model = _peft_model()
    widths: list[int] = []
    peft_model.register_forward_hook(lambda module, args, out: widths.append(out.logits.shape[1]))
    ids = [3 + i % 50 for i in range(70)]
    tokenizer = type("Ids", (), {"bos_token_id": None, "pad_token_id": 0,
                                 "__call__": lambda self, text, add_special_tokens=True: {"input_ids": ids}})()
    run = score(peft_model, "any text", tokenizer=tokenizer, context=32, max_windows=2)
    assert widths == [15]
    with torch.no_grad():
        expected = peft_model(input_ids=windows(ids, 32, None)[:2, :31]).logits.float()
    logits = run.generation().logits()
    assert len(logits) == 15
    for t, step in enumerate(logits):
        assert torch.equal(step, expected[:, 16 + t]), t
