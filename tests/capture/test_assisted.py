"""Assisted decoding (an assistant model) and prompt lookup: one record per accepted token.

The processor list is called once per candidate position, so rejected positions are seen and must be
discarded; the assistant's own calls (its drafts) and prompt lookup's probes with made-up scores must
not be recorded at all.
"""

from __future__ import annotations

import pytest
import torch

from transformers_offload import Recorder, UnsupportedModeError
from transformers_offload.capture import capture as _capture

from ..helpers import (
    ASSISTED_CONFIGS,
    ASSISTED_PROMPT,
    ASSISTED_SOURCES,
    HAS_OUTPUT_LOGITS,
    TRANSFORMERS,
    assert_steps_equal,
    assisted_source,
    make_tiny,
    missing_options,
    refused_here,
)

SEED = 11
NEW_TOKENS = 24


class CountRawCalls:
    """How often the capture saw a raw-logits call it recorded or skipped (candidates included)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = _capture.Capture.on_raw

        def on_raw(capture, *args):
            self.calls += 1
            return original(capture, *args)

        monkeypatch.setattr(_capture.Capture, "on_raw", on_raw)


@pytest.mark.parametrize("config", sorted(ASSISTED_CONFIGS))
@pytest.mark.parametrize("source", ASSISTED_SOURCES)
def test_assisted_recording_equals_hugging_face(source, config, store, tmp_path, monkeypatch, record_property):
    model = make_tiny("llama")  # untied embeddings: a random GPT-2 drafts exactly what its target picks
    kwargs, processors = ASSISTED_CONFIGS[config]
    extra = assisted_source(source)
    if source == "prompt_lookup" and missing_options(extra):
        pytest.skip(f"transformers {TRANSFORMERS} has no {missing_options(extra)}")
    common = dict(max_new_tokens=NEW_TOKENS, **kwargs, **extra)
    if refused_here(common):  # before 4.36: before generation, naming the mode
        record_property("outcome", "refused")  # for the support table (docs/support.md)
        with Recorder(model, **store.options(shard_bytes=1_500)) as rec:
            with pytest.raises(UnsupportedModeError, match="assisted_generation"):
                model.generate(**ASSISTED_PROMPT, logits_processor=[rec], **common)
        assert rec.generations == ()
        return
    torch.manual_seed(SEED)
    output_logits = {"output_logits": True} if HAS_OUTPUT_LOGITS else {}
    reference = model.generate(**ASSISTED_PROMPT, **common, return_dict_in_generate=True, output_scores=True, **output_logits)

    calls = CountRawCalls(monkeypatch)
    options = store.options(shard_bytes=1_500)
    with Recorder(model, **options) as rec:
        torch.manual_seed(SEED)
        sequences = model.generate(**ASSISTED_PROMPT, logits_processor=[rec], **common)
    rec = store.reopen(rec)

    prompt = ASSISTED_PROMPT["input_ids"].shape[1]
    assert torch.equal(sequences, reference.sequences)
    generation = rec.generation()
    assert generation.mode == "assisted_generation" and generation.complete
    assert generation.num_steps == sequences.shape[1] - prompt
    assert calls.calls > generation.num_steps, "no candidate was ever rejected: the test proves nothing"
    assert_steps_equal(rec.scores(), reference.scores, "scores")  # one per token on every release
    assert torch.equal(torch.cat(rec.tokens()), sequences[0, prompt:])
    theirs = getattr(reference, "logits", None)
    if theirs is not None and all(t.dim() == 2 for t in theirs):  # per token from 4.46 (3-D per round before)
        assert_steps_equal(rec.logits(), theirs, "logits")
    for step, (raw, processed) in enumerate(zip(rec.logits(), rec.scores())):
        replayed = raw.clone()
        for processor in processors:
            replayed = processor(sequences[:, : prompt + step], replayed)
        assert torch.equal(replayed, processed), f"step {step}: replaying {config} on the raw logits differs"


def test_early_exit_assistance_is_refused_before_generation(gpt2):
    if missing_options({"assistant_early_exit": 1}):
        pytest.skip(f"transformers {TRANSFORMERS} has no `assistant_early_exit`")
    with Recorder(gpt2) as rec:
        with pytest.raises(UnsupportedModeError, match="assistant_early_exit"):
            gpt2.generate(**ASSISTED_PROMPT, logits_processor=[rec], max_new_tokens=4, assistant_early_exit=1)
    assert rec.generations == ()
