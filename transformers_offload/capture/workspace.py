"""Buffers made once and written into again, so that per-step and per-chunk work allocates no new
`(rows, vocab)` tensor: a process's peak then does not depend on how the C library's allocator reuses
freed blocks (glibc keeps them, and with its default settings the heap grows by a block a step).

`logsumexp` computes `torch.logsumexp(t, -1)` with its one large temporary in a given workspace.
"""

from __future__ import annotations

import math

import torch


class ChunkBuffers:
    """Buffers by name: one flat tensor per name, made at its first use (for prompt logprobs the first
    chunk, the largest; for a step's statistics or encoding the first step) and viewed in each later
    use's shape, so no later chunk or step allocates them again. `allocations` counts the tensors made."""

    def __init__(self) -> None:
        self._flat: dict[str, torch.Tensor] = {}
        self.allocations = 0

    def take(self, name: str, shape: torch.Size | tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """A contiguous `shape` view of the buffer `name` (made, or made again larger, when it does not fit)."""
        size = math.prod(shape)
        flat = self._flat.get(name)
        if flat is None or flat.numel() < size or flat.dtype != dtype or flat.device != device:
            flat = self._flat[name] = torch.empty(size, dtype=dtype, device=device)
            self.allocations += 1
        return flat[:size].view(shape)


def logsumexp(t: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """`torch.logsumexp(t, -1)`, equal to it (`torch.equal`), with its `(rows, vocab)` difference written
    into `work` (`t`'s shape and dtype; `t` itself may be `work`, overwritten). The steps are ATen's own
    (`logsumexp_out_impl`, torch 2.x): the maximum, made 0 where it is infinite, subtracted; exp; the sum;
    its log; the maximum added back. `tests/test_stats.py` checks the equality on this torch.

    Args:
        t (`torch.Tensor` of shape `(rows, vocab)`): the values, any floating dtype and device.
        work (`torch.Tensor` of `t`'s shape, dtype and device): overwritten.

    Returns:
        `torch.Tensor` of shape `(rows,)`, `t`'s dtype and device: a new (small) tensor.
    """
    maxes = torch.amax(t, -1, keepdim=True)
    maxes.masked_fill_(maxes.abs() == float("inf"), 0)
    total = torch.sub(t, maxes, out=work).exp_().sum(-1)
    return total.log_().add_(maxes.squeeze(-1))
