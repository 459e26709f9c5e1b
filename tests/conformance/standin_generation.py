"""A stand-in for Hugging Face's generation tests: `generate()` calls on tiny models of many families,
in the modes `GenerationTesterMixin` exercises, with Hugging Face-style checks on what they return.

Not collected by the project's own test run (its name does not start with `test_`); run it with the
conformance plugin: `python scripts/conformance.py --corpus standin`. It holds no Recorder itself:
the plugin adds one to every call and compares.
"""

from __future__ import annotations

import functools

import pytest
import torch
from families import FAMILIES, Family

NEW = 4  # new tokens per call

# name -> (kinds it applies to, batch, generate() options)
DICT = {"return_dict_in_generate": True, "output_scores": True, "output_logits": True}
SAMPLING = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9}
MODES = {
    "greedy": ("*", 2, {}),
    "greedy_dict_outputs": ("*", 2, DICT),
    "sample": ("*", 2, SAMPLING),
    "sample_dict_outputs_num_return_sequences": ("*", 2, {**SAMPLING, **DICT, "num_return_sequences": 2}),
    "beam_search": ("*", 2, {"num_beams": 2}),
    "beam_search_dict_outputs_num_return_sequences": ("*", 2, {**DICT, "num_beams": 3, "num_return_sequences": 2}),
    "beam_sample_dict_outputs": ("*", 2, {**DICT, "num_beams": 2, "do_sample": True, "top_k": 10}),
    "processors": ("*", 2, {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "min_new_tokens": 3,
                            "bad_words_ids": [[5]], "return_dict_in_generate": True, "output_scores": True}),
    # transformers 5.24 refuses it itself (the test expects the ValueError): "raises without the Recorder too".
    "beam_search_low_memory": ("*", 2, {"num_beams": 2, "low_memory": True, "raises": ValueError}),
    # Early-exit assistance: the Recorder refuses it (capture/modes.py), the test goes on without it.
    # (Continuous batching, refused too, is left out: `cache_implementation="paged"` takes seconds a call on
    # CPU and kills pytest-xdist workers now and then, with or without the plugin.)
    "assisted_decoding_early_exit": ("decoder-only", 1, {"assistant_early_exit": 1, "maybe_unsupported": True}),
    "assisted_decoding_self": ("text", 1, {"assistant": True}),
    "assisted_decoding_sample": ("text", 1, {"assistant": True, "do_sample": True, **DICT}),
    "prompt_lookup": ("decoder-only", 1, {"prompt_lookup_num_tokens": 2}),
    "static_cache": ("decoder-only", 2, {"cache_implementation": "static", **DICT}),
    "inputs_embeds": ("decoder-only", 2, {"embeds": True, **DICT}),
    "continue_from_past_key_values": ("decoder-only", 2, {"continue": True}),
    "whisper_timestamps": ("whisper", 2, {"return_timestamps": True, **DICT}),
    "whisper_temperature_fallback": ("whisper", 2, {"temperature": (0.0, 0.2, 0.4), "logprob_threshold": 0.0, **DICT}),
    "whisper_long_form": ("whisper", 2, {"long_form": True, "return_timestamps": True}),
}


def _applies(family: Family, kinds: str) -> bool:
    if kinds == "*":
        return True
    if kinds == "text":
        return family.kind in ("decoder-only", "encoder-decoder")
    return kinds in (family.kind, family.name)


CASES = [pytest.param(family, mode, id=f"{family.name}-{mode}")
         for family in FAMILIES for mode, (kinds, _, _) in MODES.items() if _applies(family, kinds)]


@functools.lru_cache(maxsize=4)
def _model(name: str) -> torch.nn.Module:
    return next(f for f in FAMILIES if f.name == name).build()


@pytest.mark.parametrize(("family", "mode"), CASES)
def test_generate(family: Family, mode: str) -> None:
    _, batch, options = MODES[mode]
    options = dict(options)
    # A failed early-exit call leaves its model broken (transformers 5.24): it gets a model of its own.
    model = family.build() if "assistant_early_exit" in options else _model(family.name)
    inputs = family.inputs(batch)
    if options.pop("assistant", False):
        options["assistant_model"] = model
    if options.pop("long_form", False):
        inputs = {"input_features": torch.randn(batch, 8, 6000, generator=torch.Generator().manual_seed(1)),
                  "attention_mask": torch.ones(batch, 6000, dtype=torch.long)}
        inputs["attention_mask"][1:, 4500:] = 0
    if options.pop("embeds", False):
        inputs = {"inputs_embeds": model.get_input_embeddings()(inputs["input_ids"]),
                  "attention_mask": inputs["attention_mask"]}
    if options.pop("continue", False):
        torch.manual_seed(0)
        first = model.generate(**inputs, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
        inputs = {"input_ids": first.sequences,
                  "attention_mask": torch.cat([inputs["attention_mask"], torch.ones_like(first.sequences[:, -2:])], 1)}
        options["past_key_values"] = first.past_key_values
    expected_error = options.pop("raises", None)
    maybe_unsupported = options.pop("maybe_unsupported", False)
    torch.manual_seed(0)
    if expected_error is not None:
        with pytest.raises(expected_error):
            model.generate(**inputs, max_new_tokens=NEW, **options)
        return
    try:
        out = model.generate(**inputs, max_new_tokens=NEW, **options)
    except Exception as error:
        if maybe_unsupported:  # early exit needs a model whose layers transformers can skip (not GPT-2's)
            pytest.skip(f"transformers cannot run {mode} on {family.name}: {type(error).__name__}: {error}")
        raise
    if family.name == "whisper" and "num_return_sequences" in options:
        # Its dict output keeps one row of a 2 x 2 sampled call (its loop ran per segment): the plugin
        # recorded the call (it counts as unchecked), the Hugging Face-style check below would fail.
        pytest.xfail("Whisper's dict output of a sampled call with num_return_sequences=2 holds 1 row")
    sequences = out if isinstance(out, torch.Tensor) else out["sequences"]
    rows = batch * options.get("num_return_sequences", 1)
    assert sequences.shape[0] == rows
    if options.get("output_scores") and not options.get("return_timestamps"):
        assert len(out.scores) == sequences.shape[1] - _prompt_length(model, inputs, sequences)


def _prompt_length(model: torch.nn.Module, inputs: dict, sequences: torch.Tensor) -> int:
    if model.config.is_encoder_decoder:
        return sequences.shape[1] - min(NEW, sequences.shape[1] - 1) if "input_features" in inputs else 1
    key = "input_ids" if "input_ids" in inputs else "inputs_embeds"
    return 0 if key == "inputs_embeds" else inputs[key].shape[1]
