"""Buffers made once and written into again, so that per-step and per-chunk work allocates no new
`(rows, vocab)` tensor: a process's peak then does not depend on how the C library's allocator reuses
freed blocks (glibc keeps them, and with its default settings the heap grows by a block a step).

`logsumexp` computes `torch.logsumexp(t, -1)` with its one large temporary in a given workspace.
"""

from __future__ import annotations

import math

from .._lazy import torch


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
    its log; the maximum added back. `tests/capture/test_stats.py` checks the equality on this torch.

    On the CPU, `exp` of an argument so far below 0 that its result is 0 (-inf included) takes a slow
    path, several times the cost of any other: a masked step's scores (few finite entries a row) took
    1.2 ms of exp against 0.33 ms for its logits (8 x 49,152 float32, one core). Where a sample of the
    differences holds many such entries (and no row's maximum is +inf), they are replaced by 2 before
    the exp and their results (e**2, above any other: the other differences are <= 0) by 0 after it:
    the same values as exp gives them, without the slow path. On other devices nothing looks at the
    values (no host synchronisation).

    Args:
        t (`torch.Tensor` of shape `(rows, vocab)`): the values, any floating dtype and device.
        work (`torch.Tensor` of `t`'s shape, dtype and device): overwritten.

    Returns:
        `torch.Tensor` of shape `(rows,)`, `t`'s dtype and device: a new (small) tensor.
    """
    maxes = torch.amax(t, -1, keepdim=True)
    infinite = maxes.abs() == float("inf")
    difference = torch.sub(t, maxes.masked_fill(infinite, 0), out=work)
    if t.device.type == "cpu" and not bool((maxes == float("inf")).any()) and _mostly_underflow(difference):
        # threshold_(x, bound, value): x where x > bound, else value; NaN stays NaN.
        torch.nn.functional.threshold_(difference, _underflow(t.dtype), 2.0)
        # -exp(2) <= -7 (set to -0.0, +0.0 once negated back); -exp(d) for d <= 0 is >= -1: kept.
        torch.nn.functional.threshold_(difference.exp_().neg_(), -7.0, -0.0).neg_()
    else:
        difference.exp_()
    total = difference.sum(-1)
    return total.log_().add_(maxes.masked_fill_(infinite, 0).squeeze(-1))


_SAMPLE_STRIDE = 61  # a prime: the sample does not follow a row's period


def _mostly_underflow(difference: torch.Tensor) -> bool:
    """Whether at least a quarter of a strided sample (one entry in 61, on the host) is at or below the
    underflow bound: then replacing them costs less than the slow path it avoids."""
    sample = difference.reshape(-1)[::_SAMPLE_STRIDE]
    bound = _underflow(difference.dtype)
    return 4 * int(torch.count_nonzero(sample <= bound)) >= sample.numel()


def _underflow(dtype: torch.dtype) -> float:
    """The bound below which exp() is +0.0 in `dtype`, with a wide margin: float32's smallest denormal is
    about exp(-103.3), float64's exp(-744.4); float16 and bfloat16 underflow sooner or with float32."""
    return -760.0 if dtype == torch.float64 else -110.0
