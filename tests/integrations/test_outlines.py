"""Outlines' constrained generation (a regex and a JSON schema, through its outlines-core logits processors) with
a Recorder beside them, on the real model: the recorded processed scores are Hugging Face's `out.scores`, their
finite entries at each step exactly the tokens Outlines' guide allows there (an independent `Guide` walked along
the recorded tokens), and the recorded raw logits the model's forward output, while Hugging Face's `out.logits`
come back masked: Outlines edits the scores in place, and greedy search keeps the tensor the processors were
handed as `out.logits` (docs/support.md, "Where Hugging Face's raw logits are not raw")."""

from __future__ import annotations

import pytest
import torch

from transformers_offload import Recorder

from ..helpers import TRANSFORMERS, assert_steps_equal

try:  # Outlines is made for the newest transformers
    import outlines
    from outlines.backends import get_json_schema_logits_processor, get_regex_logits_processor
    from outlines_core import Guide
except Exception as error:  # noqa: BLE001 - any failure to import: skipped, saying why
    pytest.skip(f"Outlines does not import with transformers {TRANSFORMERS}: {type(error).__name__}: {error}",
                allow_module_level=True)

# The real model; the call asks for Hugging Face's own per-step outputs, to show where they differ.
# (outlines-core's torch kernels are compiled with torch.jit.script, which torch 2.13 deprecates: theirs.)
pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::transformers_offload.errors.DeviceAccumulationWarning"),
              pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")]
CONSTRAINTS = {
    "regex": lambda model: get_regex_logits_processor("outlines_core", model, r"[0-9]{4}"),
    "json_schema": lambda model: get_json_schema_logits_processor(
        "outlines_core", model, '{"type": "object", "properties": {"year": {"type": "integer"}}, "required": ["year"]}'),
}


@pytest.mark.parametrize("constraint", sorted(CONSTRAINTS))
def test_the_recorded_scores_allow_exactly_what_outlines_guide_allows(real_model, constraint):
    model, tokenizer = real_model
    processor = CONSTRAINTS[constraint](outlines.from_transformers(model, tokenizer))
    enc = tokenizer(["The year of the first moon landing, as JSON or four digits:"], return_tensors="pt")
    forward = []
    handle = model.register_forward_hook(lambda module, args, output: forward.append(output.logits[:, -1].float().clone()))
    try:
        with Recorder(model) as rec:
            out = model.generate(**enc, logits_processor=[processor, rec], max_new_tokens=8, do_sample=False,
                                 return_dict_in_generate=True, output_logits=True, output_scores=True)
    finally:
        handle.remove()
    assert_steps_equal(rec.scores(), out.scores, "scores")
    assert_steps_equal(rec.logits(), tuple(forward), "logits against the model's forward")
    assert all(torch.isfinite(step).all() for step in rec.logits())
    assert any(bool(torch.isinf(step).any()) for step in out.logits)  # Hugging Face's, masked in place
    guide, checked = Guide(processor.index), 0
    for scores, token in zip(rec.scores(), rec.tokens()):
        allowed = sorted(guide.get_tokens())
        assert torch.isfinite(scores[0]).nonzero().flatten().tolist() == allowed
        checked += 1
        if guide.is_finished():
            break
        guide.advance(int(token[0]))
    assert checked >= 4
