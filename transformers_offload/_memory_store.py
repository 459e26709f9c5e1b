"""The in-memory store: keeps each drained step as plain CPU tensors, per stream."""

from __future__ import annotations

import torch


class MemoryStore:
    """Per-stream, per-step CPU tensors of one generation, in step order."""

    def __init__(self) -> None:
        self.steps: dict[str, dict[int, torch.Tensor]] = {}

    def drain(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keep a copy of `tensors` (host slot buffers that the ring reuses) for `step`."""
        for name, tensor in tensors.items():
            # The last write of a step wins: a step recorded twice keeps its final value.
            self.steps.setdefault(name, {})[step] = tensor.clone()

    def stream(self, name: str) -> dict[int, torch.Tensor]:
        return self.steps.get(name, {})
