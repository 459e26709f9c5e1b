"""Continuous batching runs its processors on packed requests outside the per-step loop the Recorder taps
(and drops a `logits_processor` it is given): a recorded call that asks for it is refused before it runs,
never an empty recording that looks fine. `generate_batch` without a Recorder is left alone."""

from __future__ import annotations

import pytest
import torch

from transformers_offload import Recorder, UnsupportedModeError, _compat

from ..helpers import make_tiny

pytestmark = pytest.mark.skipif(
    not _compat.CONTINUOUS_BATCHING_ENTRIES, reason=f"transformers {_compat.TRANSFORMERS_VERSION} has no continuous batching"
)


def test_generate_with_a_paged_cache_is_refused_before_it_runs():
    model = make_tiny("llama")
    with Recorder(model) as rec:
        # UnsupportedModeError is a ValueError; releases whose generate() does not switch to continuous
        # batching on a paged cache (4.54-4.5x) refuse the value themselves, as without a Recorder.
        with pytest.raises(ValueError, match="continuous batching|paged") as caught:
            model.generate(torch.tensor([[3, 4, 5]]), logits_processor=[rec], cache_implementation="paged",
                           max_new_tokens=3)
    if isinstance(caught.value, UnsupportedModeError):
        assert "logits_processor=[rec]" in str(caught.value)  # says what works
    assert rec.generations == ()


@pytest.mark.parametrize("as_list", [True, False], ids=["list", "bare"])
def test_generate_batch_given_a_recorder_is_refused(as_list):
    model = make_tiny("llama")
    with Recorder(model) as rec:
        with pytest.raises(UnsupportedModeError, match="continuous batching"):
            model.generate_batch([[3, 4, 5]], logits_processor=[rec] if as_list else rec)
    assert rec.generations == ()


def test_generate_batch_is_wrapped_only_while_a_recorder_is_attached():
    model = make_tiny("llama")
    with Recorder(model):
        assert "generate_batch" in vars(model)
    assert "generate_batch" not in vars(model)
