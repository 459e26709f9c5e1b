"""A processor that edits the scores in place, as Outlines' masks do: the recording keeps the raw logits the
model's forward computed. Hugging Face's `out.logits` cannot: in greedy search and sampling the processors
receive the very tensor `generate()` keeps as `out.logits` (every release with `output_logits`, 4.38 on), so
an in-place edit lands in it; beam search hands them `log_softmax(logits)`, a new tensor. The end-of-loop
check does not call that a recorder difference (docs/support.md, "Where Hugging Face's raw logits are not
raw")."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor

from transformers_offload import Recorder

from ..helpers import HAS_OUTPUT_LOGITS, assert_steps_equal, left_padded_batch, make_tiny

# The calls ask for Hugging Face's own per-step outputs, to show where they differ.
pytestmark = pytest.mark.filterwarnings("ignore::transformers_offload.errors.DeviceAccumulationWarning")


class MaskOddIdsInPlace(LogitsProcessor):
    """Sets every odd id's score to -inf in the tensor it is given, and returns that tensor (Outlines' way)."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores[:, 1::2] = -float("inf")
        return scores


@pytest.mark.parametrize("kwargs", [{"do_sample": False}, {"do_sample": True, "top_k": 10}, {"num_beams": 2}],
                         ids=["greedy", "sample", "beam_search"])
def test_the_recording_keeps_the_forwards_raw_logits_where_an_in_place_processor_masks_out_logits(kwargs):
    model = make_tiny("llama")
    forward = []
    handle = model.register_forward_hook(lambda module, args, output: forward.append(output.logits[:, -1].clone()))
    try:
        with Recorder(model) as rec:
            torch.manual_seed(0)
            out = model.generate(**left_padded_batch(), logits_processor=[MaskOddIdsInPlace(), rec], max_new_tokens=4,
                                 pad_token_id=0, return_dict_in_generate=True, output_scores=True,
                                 **({"output_logits": True} if HAS_OUTPUT_LOGITS else {}), **kwargs)
    finally:
        handle.remove()
    raw = tuple(step.float() for step in forward)
    assert_steps_equal(rec.logits(), raw, "logits against the model's forward")  # odd ids unmasked: raw
    assert all(torch.isfinite(step).all() for step in rec.logits())
    assert_steps_equal(rec.scores(), out.scores, "scores")
    if not HAS_OUTPUT_LOGITS:
        return
    masked = [bool(torch.isinf(step[:, 1::2]).all()) for step in out.logits]
    if "num_beams" in kwargs:
        assert not any(masked)  # beam search hands the processors log_softmax(logits): out.logits stay raw
        assert_steps_equal(rec.logits(), out.logits, "logits")
    else:
        assert all(masked)  # the tensor the processors were handed, and edited: Hugging Face's "raw" logits
