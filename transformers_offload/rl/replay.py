"""`replay_logprobs(logits, kept)`: the trainer's logprob of each sampled token under its own logits at the
sampling temperature, renormalised over the token's kept set (the distribution the sampler drew from),
differentiably, on the trainer's device.

For position `(r, t)` with trainer logits `x = logits[r, t]`, kept set `K` (`kept_sets`; every id where
`full`) and temperature `T`, the value is exactly this torch expression, float32 whatever `logits`' dtype:

    z = (x.float() / T).masked_fill(~isin(arange(vocab), K), -inf)
    replay[r, t] = torch.log_softmax(z, -1)[kept.tokens[r, t]]          # 0 where not kept.valid[r, t]

Its gradient is zero outside `K` (and at invalid positions). Where `x` is the recorded raw logits
(`out.logits[t]`) and the processors were temperature and masks only, `z` is the recorded processed scores
bit for bit, and the value equals `log_softmax(out.scores[t])[token]` (tests/rl/test_replay.py).
Steps are taken `chunk_steps` at a time: the temporaries are `(rows, chunk_steps, vocab)` (a bool mask,
the float32 `z` and its log-softmax), never `(rows, steps, vocab)` beyond the input itself; nothing reads
a value back to the host.
"""

from __future__ import annotations

import torch

from .kept import KeptSets


def replay_logprobs(logits: torch.Tensor, kept: KeptSets, *, temperature: float | torch.Tensor | None = None,
                    chunk_steps: int = 16) -> torch.Tensor:
    """Each sampled token's logprob under `logits / temperature` renormalised over its kept set.

    Args:
        logits (`torch.Tensor` of shape `(rows, steps, vocab)`): the trainer's logits at the positions that
            predicted each recorded step (any floating dtype and device; `requires_grad` kept). `vocab` may
            exceed the recording's (padded embeddings): ids beyond it are never kept.
        kept (`KeptSets`): from `kept_sets(...)`, with the same rows and steps; moved to `logits`' device.
        temperature (`float` or `torch.Tensor` of shape `(rows,)`, *optional*): default: each row's sampling
            temperature (`kept.temperature`).
        chunk_steps (`int`, *optional*, defaults to 16): steps computed at once.

    Returns:
        `torch.FloatTensor` of shape `(rows, steps)`, float32, on `logits`' device: the module's expression, 0
        where not `kept.valid`.

    Raises:
        ValueError: shapes that do not match `kept`; a vocabulary narrower than the recording's; a bad
            `chunk_steps` or a non-positive temperature.

    Example:
        >>> kept = kept_sets(rec)  # doctest: +SKIP
        >>> lp = replay_logprobs(model(ids).logits[:, prompt_len - 1 : -1], kept)  # doctest: +SKIP
    """
    if logits.dim() != 3 or logits.shape[:2] != (kept.rows, kept.steps):
        raise ValueError(f"`logits` must be (rows, steps, vocab) = ({kept.rows}, {kept.steps}, vocab) as `kept`, got "
                         f"{tuple(logits.shape)}.")
    if logits.shape[-1] < kept.vocab_size:
        raise ValueError(f"`logits` have {logits.shape[-1]} entries per position, the recording {kept.vocab_size}: "
                         "pass the trainer's logits over the whole vocabulary.")
    if isinstance(chunk_steps, bool) or not isinstance(chunk_steps, int) or chunk_steps < 1:
        raise ValueError(f"`chunk_steps` must be an int of at least 1, got {chunk_steps!r}.")
    device, (rows, steps, vocab) = logits.device, logits.shape
    if kept.device != device:
        kept = kept.to(device, non_blocking=True)
    if temperature is None:
        temperature = kept.temperature
    elif not isinstance(temperature, torch.Tensor):
        if not temperature > 0:
            raise ValueError(f"`temperature` must be positive, got {temperature!r}.")
        temperature = torch.full((rows,), float(temperature), dtype=torch.float32, device=device)
    temperature = temperature.to(device=device, dtype=torch.float32)
    parts = []
    for start in range(0, steps, chunk_steps):
        stop = min(start + chunk_steps, steps)
        mask = _mask(kept, start, stop, vocab)
        z = (logits[:, start:stop].float() / temperature[:, None, None]).masked_fill(~mask, float("-inf"))
        picked = torch.log_softmax(z, -1).gather(-1, kept.tokens[:, start:stop, None].clamp(min=0))[..., 0]
        parts.append(torch.where(kept.valid[:, start:stop], picked, torch.zeros((), device=device)))
    return torch.cat(parts, 1) if parts else logits.new_zeros((rows, 0), dtype=torch.float32)


def _mask(kept: KeptSets, start: int, stop: int, vocab: int) -> torch.Tensor:
    """`(rows, stop - start, vocab)` bool: True on each position's kept ids, on every id where the step kept
    the whole vocabulary or is not valid (so that its log-softmax stays finite; its value is dropped). Built by
    one scatter on the device: ids outside the chunk go to a spare row, dropped after."""
    rows, width = kept.rows, stop - start
    spare = rows * width
    mask = torch.zeros((spare + 1, vocab), dtype=torch.bool, device=kept.device)
    if kept.ids.numel():
        positions = kept.positions()
        step = positions % kept.steps
        slot = (positions // kept.steps) * width + (step - start)
        inside = (step >= start) & (step < stop)
        slot = torch.where(inside, slot, torch.full_like(slot, spare))
        mask.index_put_((slot, kept.ids.long()), torch.ones((), dtype=torch.bool, device=kept.device))
    mask = mask[:spare].view(rows, width, vocab)
    everything = kept.full[:, start:stop] | ~kept.valid[:, start:stop]
    return mask | everything[..., None]
