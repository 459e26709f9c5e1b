"""`replay_logprobs_from_hidden(hidden, weight, kept)`: `replay_logprobs` from the hidden states that feed the
output head, without the `(rows, steps, vocab)` logits: only the logits of the kept ids (and of the sampled
token) are computed, one dot product each, so a trainer pays `nnz x hidden` multiply-adds where a full head
pays `rows x steps x vocab x hidden`.

For position `(r, t)` with hidden state `h = hidden[r, t]`, head `W` (`(vocab, hidden)`, `b` its bias or 0),
kept set `K` and temperature `T`, with every product taken in float32:

    z[k] = ((h.float() * W[k].float()).sum() + b[k]) / T       # for k in K and for the sampled y
    replay[r, t] = z[y] - (m + log(sum(exp(z[K] - m))))        # m = max(z[K]), without gradient

the expression of `replay_logprobs` on the logits `h @ W.T + b` (its products summed in another order: within
1e-5 of it on float32 logits, tests/rl/test_head.py states the measured difference). Where the step kept the
whole vocabulary (`full`) the value is `full_logprobs[r, t]` when given (a trainer's own logprob of the token
at `T`, such as TRL's fused head computes), else `z[y] - logsumexp(h @ W.T + b) / T` over the whole head,
`chunk` positions at a time, recomputed in the backward pass rather than kept. 0 where not `kept.valid`.

The gradient reaches `h`, `W` and `b` through the kept ids' rows only (and through the whole head at full
steps); the kept logits are recomputed in the backward pass (a custom `autograd.Function`), so what is kept for
it is `hidden`, the head and the CSR, not `nnz x hidden` gathered rows.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .kept import KeptSets
from .replay import check_kept, kept_logsumexp, on_device


class _GatheredLogits(torch.autograd.Function):
    """`z[i] = hidden[positions[i]] . weight[ids[i]] (+ bias[ids[i]])` in float32, `chunk` entries at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, positions, ids, chunk):  # noqa: ANN001, ANN205 - torch's signature
        out = torch.empty(ids.numel(), dtype=torch.float32, device=hidden.device)
        for start in range(0, ids.numel(), chunk):
            p, i = positions[start : start + chunk], ids[start : start + chunk]
            value = (hidden[p].float() * weight[i].float()).sum(-1)
            out[start : start + chunk] = value if bias is None else value + bias[i].float()
        ctx.save_for_backward(hidden, weight, positions, ids)
        ctx.has_bias, ctx.chunk, ctx.vocab = bias is not None, chunk, weight.shape[0]
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        hidden, weight, positions, ids = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        for start in range(0, ids.numel(), ctx.chunk):
            p, i = positions[start : start + ctx.chunk], ids[start : start + ctx.chunk]
            g = grad[start : start + ctx.chunk, None].float()
            if need_hidden:
                grad_hidden.index_add_(0, p, g * weight[i].float())
            if need_weight:
                grad_weight.index_add_(0, i, g * hidden[p].float())
        grad_bias = None
        if ctx.has_bias and need_bias:
            grad_bias = torch.zeros(ctx.vocab, dtype=torch.float32, device=grad.device).index_add_(0, ids, grad.float())
        return (None if grad_hidden is None else grad_hidden.to(hidden.dtype),
                None if grad_weight is None else grad_weight.to(weight.dtype), grad_bias, None, None, None)


def replay_logprobs_from_hidden(hidden: torch.Tensor, weight: torch.Tensor, kept: KeptSets, *,
                                bias: torch.Tensor | None = None, temperature: float | torch.Tensor | None = None,
                                full_logprobs: torch.Tensor | None = None, chunk: int = 8192) -> torch.Tensor:
    """Each sampled token's logprob at `temperature` renormalised over its kept set, from hidden states and
    the head's weight (module docstring).

    Args:
        hidden (`torch.FloatTensor` of shape `(rows, steps, hidden_size)`): the hidden states that predicted
            each recorded step (what the model's output head reads), any floating dtype, `requires_grad` kept.
        weight (`torch.FloatTensor` of shape `(vocab, hidden_size)`): the output head's weight
            (`model.get_output_embeddings().weight`), on `hidden`'s device; `vocab` at least the recording's.
        kept (`KeptSets`): with the same rows and steps (`KeptSets.select`); moved to `hidden`'s device.
        bias (`torch.FloatTensor` of shape `(vocab,)`, *optional*): the head's bias.
        temperature (`float` or `torch.Tensor` of shape `(rows,)`, *optional*): default each row's sampling
            temperature (`kept.temperature`).
        full_logprobs (`torch.FloatTensor` of shape `(rows, steps)`, *optional*): the token's logprob over
            the whole vocabulary at `temperature`, used where a step kept it all (else computed here).
        chunk (`int`, *optional*, defaults to 8192): kept entries (and full positions) computed at once.

    Returns:
        `torch.FloatTensor` of shape `(rows, steps)`, float32, on `hidden`'s device; 0 where not `kept.valid`.

    Raises:
        TypeError: a tensor argument not floating, `kept` not a `KeptSets`, a temperature of another type.
        ValueError: shapes that do not match `kept` or each other; tensors on other devices than `hidden`; a
            bad `chunk`; a temperature as `replay_logprobs` refuses it.

    Example:
        >>> h = model.model(ids).last_hidden_state[:, prompt_len - 1 : -1]  # doctest: +SKIP
        >>> lp = replay_logprobs_from_hidden(h, model.lm_head.weight, kept)  # doctest: +SKIP
    """
    check_kept(kept)
    for name, value in (("hidden", hidden), ("weight", weight), ("bias", bias)):
        if value is not None and (not isinstance(value, torch.Tensor) or not value.is_floating_point()):
            raise TypeError(f"`{name}` must be a floating-point tensor, got {getattr(value, 'dtype', type(value).__name__)}.")
        if value is not None and value.device != hidden.device:
            raise ValueError(f"`{name}` is on {value.device}, `hidden` on {hidden.device}: put them on one device.")
    if hidden.dim() != 3 or hidden.shape[:2] != (kept.rows, kept.steps):
        raise ValueError(f"`hidden` must be (rows, steps, hidden_size) = ({kept.rows}, {kept.steps}, hidden_size) as "
                         f"`kept`, got {tuple(hidden.shape)}.")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] < kept.vocab_size:
        raise ValueError(f"`weight` must be (vocab, {hidden.shape[-1]}) with vocab at least the recording's "
                         f"{kept.vocab_size}, got {tuple(weight.shape)}.")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"`bias` must be ({weight.shape[0]},) as `weight`'s rows, got {tuple(bias.shape)}.")
    if full_logprobs is not None and full_logprobs.shape != hidden.shape[:2]:
        raise ValueError(f"`full_logprobs` must be (rows, steps) = {tuple(hidden.shape[:2])}, got "
                         f"{tuple(full_logprobs.shape)}.")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"`chunk` must be an int of at least 1, got {chunk!r}.")
    device, (rows, steps) = hidden.device, hidden.shape[:2]
    kept, _, per_position = on_device(kept, temperature, device)
    flat = hidden.reshape(rows * steps, hidden.shape[-1])
    everywhere = torch.arange(rows * steps, device=device)
    chosen = _GatheredLogits.apply(flat, weight, bias, everywhere, kept.tokens.clamp(min=0).reshape(-1), chunk)
    chosen = chosen / per_position
    positions = kept.positions()
    z = _GatheredLogits.apply(flat, weight, bias, positions, kept.ids.long(), chunk) / per_position[positions]
    picked = chosen - kept_logsumexp(z, kept, positions)
    if kept.any_full:
        if full_logprobs is not None:
            whole = full_logprobs.reshape(-1).float()
        else:
            whole = chosen - _head_logsumexp(flat, weight, bias, per_position, chunk)
        picked = torch.where(kept.full.reshape(-1), whole, picked)
    return torch.where(kept.valid, picked.view(rows, steps), torch.zeros((), device=device))


def _head_logsumexp(flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, per_position: torch.Tensor,
                    chunk: int) -> torch.Tensor:
    """`logsumexp((flat @ weight.T + bias).float() / T, -1)` per position, `chunk` positions at a time, each
    chunk's logits recomputed in the backward pass (`torch.utils.checkpoint`) rather than kept."""
    def part(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logits = h @ weight.T if bias is None else torch.addmm(bias, h, weight.T)
        return torch.logsumexp(logits.float() / t[:, None], -1)

    rows = max(1, chunk // max(1, weight.shape[0] // 1024))  # about `chunk` x 1,024 logits at once
    return torch.cat([checkpoint(part, flat[start : start + rows], per_position[start : start + rows],
                                 use_reentrant=False) for start in range(0, flat.shape[0], rows)])
