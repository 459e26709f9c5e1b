"""The rollouts the RL tests read: a tiny Llama sampling two prompts twice each (top-p 0.8, top-k 20, T 0.7)."""

from __future__ import annotations

import pytest
import torch

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
