"""Bit-level pieces of the packed records: values packed B bits each, token ids in as few bytes as the
vocabulary needs, and Elias-Fano coded sorted ids."""

from __future__ import annotations

from .._lazy import torch


def id_bytes(vocab: int) -> int:
    """Bytes per token id in a `"topk:K"` record: 1 up to 256 tokens, 2 up to 65,536, else 3."""
    return 1 if vocab <= 256 else 2 if vocab <= 65536 else 3


def _low_bits(vocab: int, n: int) -> int:
    return max(0, (vocab // n).bit_length() - 1)


def elias_fano_bytes(vocab: int, n: int) -> int:
    """Bytes of n Elias-Fano coded ids below `vocab`."""
    low = _low_bits(vocab, n)
    return -(-n * low // 8) + -(-(n + ((vocab - 1) >> low) + 1) // 8)


# -- bit packing, on any device, fixed shapes only (no host synchronisation) ------------------------
def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """`values` `(rows, n)` integers in `[0, 2**bits)` as `(rows, ceil(n x bits / 8))` uint8, LSB first."""
    rows, n = values.shape
    if bits == 0 or n == 0:
        return torch.zeros(rows, 0, dtype=torch.uint8, device=values.device)
    shifts = torch.arange(bits, device=values.device)
    flat = ((values.to(torch.int64)[..., None] >> shifts) & 1).reshape(rows, n * bits)
    return _bytes_of_bits(flat)


def _bytes_of_bits(flat: torch.Tensor) -> torch.Tensor:
    rows, count = flat.shape
    flat = torch.nn.functional.pad(flat, (0, -count % 8))
    weights = 2 ** torch.arange(8, device=flat.device)
    return (flat.reshape(rows, -1, 8) * weights).sum(-1).to(torch.uint8)


def _bits_of_bytes(data: torch.Tensor, count: int) -> torch.Tensor:
    shifts = torch.arange(8, device=data.device)
    return ((data.to(torch.int64)[..., None] >> shifts) & 1).reshape(data.shape[0], -1)[:, :count]


def unpack_bits(data: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """`pack_bits` undone: `(rows, n)` int64."""
    if bits == 0:
        return torch.zeros(data.shape[0], n, dtype=torch.int64)
    flat = _bits_of_bytes(data, n * bits).reshape(data.shape[0], n, bits)
    return (flat << torch.arange(bits)).sum(-1)


def elias_fano(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """`ids` `(rows, n)` int64, non-decreasing along each row, below `vocab`, Elias-Fano coded:
    `(rows, elias_fano_bytes(vocab, n))` uint8 on `ids`' device."""
    rows, n = ids.shape
    low = _low_bits(vocab, n)
    ones = (ids >> low) + torch.arange(n, device=ids.device)
    size = n + ((vocab - 1) >> low) + 1
    bitmap = torch.zeros(rows, size, dtype=torch.int64, device=ids.device).scatter_(1, ones, 1)
    return torch.cat([pack_bits(ids & ((1 << low) - 1), low), _bytes_of_bits(bitmap)], dim=-1)


def elias_fano_ids(data: torch.Tensor, n: int, vocab: int) -> torch.Tensor:
    """`elias_fano` undone (host): `(rows, n)` int64.

    Raises:
        ValueError: the bitmap does not hold n ids per row (damaged data).
    """
    rows = data.shape[0]
    low = _low_bits(vocab, n)
    low_bytes = -(-n * low // 8)
    size = n + ((vocab - 1) >> low) + 1
    bitmap = _bits_of_bytes(data[:, low_bytes:], size)
    if rows and not bool((bitmap.sum(-1) == n).all()):
        raise ValueError(f"an Elias-Fano bitmap does not hold {n} ids per row")
    ones = torch.where(bitmap.bool(), torch.arange(size), size).sort(-1).values[:, :n]
    ids = ((ones - torch.arange(n)) << low) | unpack_bits(data[:, :low_bytes], n, low)
    if bool((ids >= vocab).any()):
        raise ValueError("a packed record holds a token id outside the vocabulary")
    return ids


def float_bytes(values: torch.Tensor) -> torch.Tensor:
    """`(rows, n)` floats as their `(rows, n x itemsize)` uint8 bit patterns."""
    return values.contiguous().view(torch.uint8).reshape(values.shape[0], -1)


def ids_bytes(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """`(rows, n)` token ids as `(rows, n x id_bytes(vocab))` uint8, little-endian."""
    rows, n = ids.shape
    return ids.to(torch.int32).view(torch.uint8).reshape(rows, n, 4)[..., : id_bytes(vocab)].reshape(rows, -1)
