"""Comparisons used across tests: exact, never with a tolerance."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor


def assert_steps_equal(recorded: tuple, reference: tuple, what: str) -> None:
    assert len(recorded) == len(reference), f"{what}: {len(recorded)} steps recorded, {len(reference)} in HF"
    for step, (mine, theirs) in enumerate(zip(recorded, reference)):
        assert mine.device.type == "cpu", f"{what}[{step}] is on {mine.device}"
        assert mine.dtype == theirs.dtype, f"{what}[{step}]: dtype {mine.dtype} vs {theirs.dtype}"
        assert torch.equal(mine, theirs.cpu()), f"{what}[{step}] differs from Hugging Face's"


def finished_from_sequences(sequences: torch.Tensor, prompt_length: int, eos: list[int]) -> list[torch.Tensor]:
    """Rows finished before each step, from the generated tokens: after their first EOS."""
    eos_ids = torch.tensor(eos)
    generated = sequences[:, prompt_length:]
    finished = torch.zeros(sequences.shape[0], dtype=torch.bool)
    out = []
    for t in range(generated.shape[1]):
        out.append(finished.clone())
        finished |= torch.isin(generated[:, t], eos_ids)
    return out


class Boom(Exception):
    pass


class FailAtStep(LogitsProcessor):
    """A user processor that raises `error` when called for step `step` (0-based)."""

    def __init__(self, step: int, error: BaseException) -> None:
        self.step, self.error, self.calls = step, error, 0

    def __call__(self, input_ids, scores):
        if self.calls == self.step:
            raise self.error
        self.calls += 1
        return scores
