"""`replay_logprobs(logits, kept)`: the trainer's logprob of each sampled token under its own logits at the
sampling temperature, renormalised over the token's kept set (the distribution the sampler drew from),
differentiably, on the trainer's device.

For position `(r, t)` with trainer logits `x = logits[r, t]`, kept set `K` (`kept_sets`) and temperature `T`,
the value is, in float32 whatever `logits`' dtype, with `z = x.float() / T`:

    m = z[K].max()                                     # no gradient: the value does not depend on it
    replay[r, t] = z[y] - (m + torch.log(torch.exp(z[K] - m).sum()))   # y = kept.tokens[r, t]

a log-softmax over `K` at `y`; where the step kept the whole vocabulary (`full`), `K` is every id and the
sum is `torch.logsumexp(z, -1)`; 0 where not `kept.valid`. Only the kept entries are read: `z[K]` is gathered
(`(nnz,)`), the sums are scatters over the CSR's positions, and nothing `(rows, steps, vocab)` is made beyond
the input, but for steps that kept the whole vocabulary (a `logsumexp` of their logits, `chunk_steps` steps at
a time). The gradient reaches the kept entries only. Nothing reads a value back to the host.

Against `torch.log_softmax(z.masked_fill(~K, -inf), -1)[y]` (on the recorded raw logits, the recorded
processed logprob) the sums run in another order: within 1e-6 (tests/rl/test_replay.py states the measured
difference); against a float64 computation from the kept ids, within 2e-6.
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
        chunk_steps (`int`, *optional*, defaults to 16): steps whose whole-vocabulary sums are computed at once.

    Returns:
        `torch.FloatTensor` of shape `(rows, steps)`, float32, on `logits`' device: the module's expression, 0
        where not `kept.valid`.

    Raises:
        TypeError: `logits` not a floating tensor, `kept` not a `KeptSets`, a temperature of another type.
        ValueError: shapes that do not match `kept`; a vocabulary narrower than the recording's; a bad
            `chunk_steps`; a non-positive number, or a tensor not `(rows,)`, as temperature (a tensor's values
            are taken as given: reading them would wait for the device).

    Example:
        >>> kept = kept_sets(rec)  # doctest: +SKIP
        >>> lp = replay_logprobs(model(ids).logits[:, prompt_len - 1 : -1], kept)  # doctest: +SKIP
    """
    check_kept(kept)
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"`logits` must be a floating-point tensor, got {getattr(logits, 'dtype', type(logits).__name__)}.")
    if logits.dim() != 3 or logits.shape[:2] != (kept.rows, kept.steps):
        raise ValueError(f"`logits` must be (rows, steps, vocab) = ({kept.rows}, {kept.steps}, vocab) as `kept`, got "
                         f"{tuple(logits.shape)}.")
    if logits.shape[-1] < kept.vocab_size:
        raise ValueError(f"`logits` have {logits.shape[-1]} entries per position, the recording {kept.vocab_size}: "
                         "pass the trainer's logits over the whole vocabulary.")
    if isinstance(chunk_steps, bool) or not isinstance(chunk_steps, int) or chunk_steps < 1:
        raise ValueError(f"`chunk_steps` must be an int of at least 1, got {chunk_steps!r}.")
    device, (rows, steps) = logits.device, logits.shape[:2]
    kept, temperature, per_position = on_device(kept, temperature, device)
    # `logits` is read where it lies (a slice of a forward's output is not contiguous: no reshape, no copy).
    chosen = logits.gather(-1, kept.tokens.clamp(min=0)[..., None]).reshape(-1).float() / per_position
    positions = kept.positions()
    z = logits[positions // steps, positions % steps, kept.ids.long()].float() / per_position[positions]  # (nnz,)
    normaliser = kept_logsumexp(z, kept, positions)
    if kept.any_full:
        full = _full_logsumexp(logits, temperature, chunk_steps)
        normaliser = torch.where(kept.full.reshape(-1), full, normaliser)
    picked = (chosen - normaliser).view(rows, steps)
    return torch.where(kept.valid, picked, torch.zeros((), device=device))


def check_kept(kept: object) -> None:
    """Raises TypeError where `kept` is not a `KeptSets`."""
    if not isinstance(kept, KeptSets):
        raise TypeError(f"`kept` must be a KeptSets (from `kept_sets(...)`), got {type(kept).__name__}.")


def row_temperatures(temperature: object, kept: KeptSets, device: torch.device) -> torch.Tensor:
    """`(rows,)` float32 on `device`: `kept.temperature` where `temperature` is None, else the number for every
    row, or the tensor as given (its values are not read on the host, which would wait for the device).

    Raises:
        TypeError: neither None, a number nor a floating tensor. ValueError: a number that is not positive, or
            a tensor that is not `(rows,)`.
    """
    if temperature is None:
        return kept.temperature.to(device=device, dtype=torch.float32)
    if isinstance(temperature, torch.Tensor):
        if not temperature.is_floating_point() or tuple(temperature.shape) != (kept.rows,):
            raise ValueError(f"a `temperature` tensor must be floating, of shape ({kept.rows},) (one per row), got "
                             f"{temperature.dtype} of shape {tuple(temperature.shape)}.")
        return temperature.to(device=device, dtype=torch.float32)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"`temperature` must be a number, a (rows,) tensor or None, got {temperature!r}.")
    if not temperature > 0:
        raise ValueError(f"`temperature` must be positive, got {temperature!r}.")
    return torch.full((kept.rows,), float(temperature), dtype=torch.float32, device=device)


def on_device(kept: KeptSets, temperature: object, device: torch.device) -> tuple[KeptSets, torch.Tensor, torch.Tensor]:
    """`kept` on `device`, each row's temperature (`row_temperatures`) and each position's, `(rows * steps,)`
    float32 in row-major order."""
    if kept.device != device:
        kept = kept.to(device, non_blocking=True)
    temperature = row_temperatures(temperature, kept, device)
    per_position = temperature.repeat_interleave(kept.steps, output_size=kept.rows * kept.steps)
    return kept, temperature, per_position


def kept_logsumexp(z: torch.Tensor, kept: KeptSets, positions: torch.Tensor) -> torch.Tensor:
    """`(rows * steps,)` float32: per position, `m + log(sum(exp(z[K] - m)))` over its kept entries `z` (`(nnz,)`,
    in `kept.ids`' order; `positions` is `kept.positions()`), `m` their max taken without gradient; 0 where the
    position stores no id (full, or not valid)."""
    size = kept.rows * kept.steps
    with torch.no_grad():
        peak = torch.zeros(size, device=z.device).scatter_reduce_(0, positions, z, reduce="amax", include_self=False)
    empty = (kept.offsets[1:] == kept.offsets[:-1]).float()  # no kept id stored (full, or not valid): a sum of 1
    total = torch.zeros(size, device=z.device).index_add(0, positions, (z - peak[positions]).exp()) + empty
    return peak + total.log()


def _full_logsumexp(logits: torch.Tensor, temperature: torch.Tensor, chunk_steps: int) -> torch.Tensor:
    """`torch.logsumexp(logits.float() / temperature, -1)` per position, `(rows * steps,)` in row-major order,
    `chunk_steps` steps at a time."""
    parts = [torch.logsumexp(logits[:, start : start + chunk_steps].float() / temperature[:, None, None], -1)
             for start in range(0, logits.shape[1], chunk_steps)]
    return torch.cat(parts, 1).reshape(-1)
