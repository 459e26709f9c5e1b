"""The largest entries of each row of an `(n, vocab)` tensor without sorting the vocabulary (`answers.compare_metrics`
asks for each row's top 5 and the chosen token's rank): each row's maxima over tiles of 256 entries point to
the few tiles that can hold them. `largest(x, k)` gives what `torch.sort(x, descending=True, stable=True)`
would (ties to the lower id); `count_above(x, picked)` what `(x > picked).sum(-1)` would."""

from __future__ import annotations

import torch

_TILE = 256  # entries per tile of `largest` and `count_above`
_FEW_TILES = 32  # `count_above` counts in the tiles above when there are at most this many
_SEARCHED_WHOLE = 10  # a row of at most this many tiles (twice the compare's top 5) is searched whole


def tile_maxima(x: torch.Tensor) -> torch.Tensor | None:
    """Each row's maximum over each tile of `_TILE` entries (the last tile may be shorter): `(n, tiles)`,
    in `x`'s dtype; None where the vocabulary is too small to gain from tiles (at most `_SEARCHED_WHOLE` of them)
    or a maximum is nan (the callers then look at every entry)."""
    n, vocab = x.shape
    if -(-vocab // _TILE) <= _SEARCHED_WHOLE:
        return None
    whole = vocab // _TILE * _TILE
    maxima = x[:, :whole].reshape(n, -1, _TILE).amax(-1)
    if whole < vocab:
        maxima = torch.cat([maxima, x[:, whole:].amax(-1, keepdim=True)], -1)
    return None if bool(maxima.isnan().any()) else maxima


def _tile_entries(x: torch.Tensor, tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids and values of tiles `tiles` `(n, m)` of each row, `(n, m * _TILE)`; ids past the vocabulary
    (the last tile's) hold -inf."""
    vocab = x.shape[-1]
    ids = (tiles[:, :, None] * _TILE + torch.arange(_TILE)).reshape(x.shape[0], -1)
    values = x.gather(-1, ids.clamp(max=vocab - 1)).masked_fill(ids >= vocab, float("-inf"))
    return ids, values


def largest(x: torch.Tensor, k: int, maxima: torch.Tensor | None = None) -> torch.Tensor:
    """The ids of each row's `k` largest entries, largest first, ties broken by the lower id: what
    `torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]` gives (nan counts largest), as an
    `(n, min(k, vocab))` int64 tensor, for an `(n, vocab)` tensor of any floating dtype (`maxima`: its
    `tile_maxima`, computed here if not given).

    Found among the tiles whose maximum reaches the k-th largest tile maximum: those hold every entry at
    least the k-th largest (k tiles have a maximum at least that threshold, so the k-th largest entry is
    too), so ordering their entries, in id order, by value and then id picks the same ids; a few thousand
    entries instead of the vocabulary."""
    k = min(k, x.shape[-1])
    maxima = tile_maxima(x) if maxima is None else maxima
    if maxima is None or k > maxima.shape[-1]:
        return torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    threshold = torch.topk(maxima, k, -1).values[:, -1:]
    reaching = int((maxima >= threshold).sum(-1).max())  # k, or more where tile maxima tie
    tiles = torch.topk(maxima, reaching, -1).indices.sort(-1).values  # in id order
    ids, values = _tile_entries(x, tiles)  # ids past the vocabulary: -inf, last in id order, never above a kept one
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        order = torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]
        return ids.gather(-1, order)
    return ids.gather(-1, torch.topk(_ordered(values, ids), k, -1).indices)


def count_above(x: torch.Tensor, picked: torch.Tensor, maxima: torch.Tensor | None = None) -> torch.Tensor:
    """`(x > picked).sum(-1)`: per row of `x` `(n, vocab)`, the entries above `picked` `(n, 1)`, int64,
    counted in the tiles whose maximum is above it (`maxima`: `x`'s `tile_maxima`) when those are few,
    as they are for a likely token."""
    if maxima is not None:
        above = maxima > picked
        reaching = int(above.sum(-1).max())
        if reaching <= _FEW_TILES:
            if reaching == 0:
                return torch.zeros(x.shape[0], dtype=torch.int64)
            tiles = torch.topk(above.to(torch.int8), reaching, -1).indices  # every tile above, and others
            _, values = _tile_entries(x, tiles)
            return (values > picked).sum(-1)
    return (x > picked).sum(-1)


def _ordered(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """An int64 key per entry, larger for a larger value and, between equal values, for a lower id: the
    float32 value's bits made monotone (negative ones' magnitude bits flipped; -0.0 made +0.0, which it
    equals) in the high 32 bits, `2**32 - 1 - id` in the low ones. Exact for float32, bfloat16 and float16
    (which float32 holds); no nan (the caller's tiles have none)."""
    bits = (values.float() + 0.0).view(torch.int32).long()
    monotone = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return monotone * (1 << 32) + ((1 << 32) - 1 - ids)
