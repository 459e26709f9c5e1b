"""The rollouts the RL tests read: a tiny Llama sampling two prompts twice each (top-p 0.8, top-k 20, T 0.7)."""

from __future__ import annotations

import pytest
import torch

from transformers_offload import Recorder, kept_sets

from ..helpers import make_tiny

PROMPTS = {"input_ids": torch.tensor([[5, 6, 7, 8], [0, 9, 10, 11]]),
           "attention_mask": torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])}


def _sampled(model, rec, **kwargs):
    torch.manual_seed(0)
    options = {"do_sample": True, "top_p": 0.8, "top_k": 20, "temperature": 0.7, "max_new_tokens": 6, "pad_token_id": 0,
               "num_return_sequences": 2, "return_dict_in_generate": True, "output_scores": True, **kwargs}
    return model.generate(**PROMPTS, logits_processor=[rec], **options)


@pytest.fixture
def sample():
    """`sample(model, rec, **generate_options)`: the rollouts, recorded by `rec`; returns generate()'s output."""
    return _sampled


@pytest.fixture
def prompts():
    return PROMPTS


@pytest.fixture(params=[{}, {"top_p": 1.0, "top_k": 0}], ids=["masked", "full"])
def kept(request):
    """The kept sets of a tiny Llama's rollouts (8 steps, rows finishing early), masked by top-p/top-k or, with
    both off, keeping the whole vocabulary at every step."""
    model = make_tiny("llama")
    with Recorder(model, streams=("logits", "scores")) as rec:
        _sampled(model, rec, max_new_tokens=8, eos_token_id=list(range(3, 20)), output_scores=False,
                 return_dict_in_generate=False, **request.param)
    return kept_sets(rec)
