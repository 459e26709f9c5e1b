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


FIXED_CREATED_BY = {"transformers_offload": "0.1.0", "transformers": "x", "torch": "y", "safetensors": "z", "python": "3"}
FIXED_MODEL = {"class": "MadeUpForCausalLM", "name_or_path": "made-up", "config_class": "MadeUpConfig", "vocab_size": 4}


def made_up_step(step: int, rows: int, vocab: int) -> dict[str, torch.Tensor]:
    """One step's tensors with values that depend only on (step, row, token): no RNG involved."""
    grid = torch.arange(rows * vocab, dtype=torch.float32).reshape(rows, vocab)
    return {
        "logits": grid / 8 + step,
        "scores": -(grid / 16) - step,
        "tokens": (torch.arange(rows) + step) % vocab,
        "finished": (torch.arange(rows) + step) % 3 == 0,
    }


def write_made_up_recording(root, *, steps: int, rows: int, vocab: int, shard_bytes: int, complete: bool = True):
    """Drive the shard store directly (no model): the layer below `generate()`. Returns the Generation."""
    from transformers_offload._shard_store import Spill

    spill = Spill(root, shard_bytes=shard_bytes, model_info=FIXED_MODEL, created_by=FIXED_CREATED_BY)
    header = {
        "index": 0, "mode": "sample", "prompt_length": 2, "prompt_lengths": tuple([2] * rows), "num_beams": 1,
        "pad_token_id": 0, "eos_token_id": (1,), "generation_config": {"do_sample": True},
    }
    store = spill.open_store(["logits", "scores", "tokens", "finished"], header)
    for step in range(steps):
        store.drain(step, made_up_step(step, rows, vocab))
    sequences = torch.arange(rows * (2 + steps)).reshape(rows, 2 + steps) % vocab if complete else None
    error = None if complete else KeyboardInterrupt()
    return store.finish(steps, {**header, "num_rows": rows}, sequences, error, ring_waits=0)
