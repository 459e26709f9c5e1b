"""Replay on a CUDA device (run where one is lent: `scripts/device_checks.sh`): `replay_logprobs` and
`replay_logprobs_from_hidden` on the device equal their CPU values within 1e-5, forward and backward, under
CUDA's sync debug mode set to raise (no call makes the host wait)."""

from __future__ import annotations

import pytest
import torch

from transformers_offload import replay_logprobs, replay_logprobs_from_hidden

from ..helpers import cuda_strict

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_on_cuda_is_its_cpu_value_without_a_synchronising_call(kept, dtype):
    torch.manual_seed(0)
    logits = torch.randn(kept.rows, kept.steps, kept.vocab_size, dtype=dtype)
    on_device = logits.cuda().requires_grad_(True)
    device_kept = kept.to("cuda")
    found = cuda_strict(replay_logprobs)(on_device, device_kept)
    cuda_strict(lambda: found.sum().backward())()
    cpu = logits.clone().requires_grad_(True)
    expected = replay_logprobs(cpu, kept)
    expected.sum().backward()
    assert (found.cpu() - expected).abs().max() <= 1e-5
    assert (on_device.grad.float().cpu() - cpu.grad.float()).abs().max() <= 1e-5


def test_replay_from_hidden_on_cuda_is_its_cpu_value_without_a_synchronising_call(kept):
    torch.manual_seed(0)
    hidden, weight = torch.randn(kept.rows, kept.steps, 16), torch.randn(kept.vocab_size, 16)
    h, w = hidden.cuda().requires_grad_(True), weight.cuda().requires_grad_(True)
    device_kept = kept.to("cuda")
    found = cuda_strict(replay_logprobs_from_hidden)(h, w, device_kept)
    cuda_strict(lambda: found.sum().backward())()
    hc, wc = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    expected = replay_logprobs_from_hidden(hc, wc, kept)
    expected.sum().backward()
    assert (found.cpu() - expected).abs().max() <= 1e-5
    assert (h.grad.cpu() - hc.grad).abs().max() <= 1e-5 and (w.grad.cpu() - wc.grad).abs().max() <= 1e-5
