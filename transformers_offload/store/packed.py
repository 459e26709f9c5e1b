"""The packed records of the top-k and sampled encodings: their layouts, the bit packing they share
(written on the device by `capture.packed_encodings`, without a host synchronisation) and their parsing
(on the host, by the reader). docs/format.md is the specification.

A step's record is one flat int32 tensor: a header `[rows, vocab, dense code, stored code, width]`
(codes index `format.SPARSE_DTYPES`: the dtype of the tensor that was encoded, and the one the kept
values are stored in; width is K or N), then `rows x row_bytes` bytes, row after row, zero-padded to
a whole number of int32 words. Multi-byte fields are little-endian. Per row:

- `"topk:K"`: the K largest values in decreasing order, bit for bit in the stored dtype (the tensor's
  own, or the model's bfloat16/float16 for a float32 step every kept value of which converts back bit
  for bit); their K token ids, `id_bytes(vocab)` bytes each; the logsumexp and the mass outside the K,
  float32. `(value bytes + id bytes) x K + 8` bytes.
- `"topk:K:qB"`: the logsumexp, the mass outside, the largest value `top` and the step `scale`,
  float32; the K token ids, ascending, Elias-Fano coded (`elias_fano_bytes`); then per id (in that
  order) a B-bit code c: the value is `top - c x scale`, or -inf for c = 2**B - 1.
- `"sample:N@T"`: the logsumexp of `x / T`, float32; the N sampled token ids, ascending (repeats kept),
  Elias-Fano coded; their values `x[id]`, in the stored dtype.

Elias-Fano (n non-decreasing ids below `vocab`, L = floor(log2(vocab / n)), at least 0): each id's low
L bits packed (LSB first, n x L bits, in whole bytes), then a bitmap of `n + ((vocab - 1) >> L) + 1` bits
(in whole bytes) with bit `(id >> L) + i` set for the i-th id.
"""

from __future__ import annotations

from typing import Any

from .._lazy import torch

from .format import SPARSE_DTYPES, SPARSE_MAX_VOCAB, sample_spec, topk_bits, topk_width

PACKED_HEADER = 5
_LE = (1, 256, 65536, 16777216)  # little-endian byte weights of an id


def id_bytes(vocab: int) -> int:
    """Bytes per token id in a `"topk:K"` record: 1 up to 256 tokens, 2 up to 65,536, else 3."""
    return 1 if vocab <= 256 else 2 if vocab <= 65536 else 3


def _low_bits(vocab: int, n: int) -> int:
    return max(0, (vocab // n).bit_length() - 1)


def elias_fano_bytes(vocab: int, n: int) -> int:
    """Bytes of n Elias-Fano coded ids below `vocab`."""
    low = _low_bits(vocab, n)
    return -(-n * low // 8) + -(-(n + ((vocab - 1) >> low) + 1) // 8)


def row_bytes(encoding: str, vocab: int, stored: torch.dtype) -> int:
    """Bytes per row of a packed record of `encoding` over `vocab` tokens, values stored in `stored`."""
    k, bits, sample = topk_width(encoding), topk_bits(encoding), sample_spec(encoding)
    if bits is not None:
        return 16 + elias_fano_bytes(vocab, k) + -(-k * bits // 8)
    if k is not None:
        return (stored.itemsize + id_bytes(vocab)) * k + 8
    n = sample[0]
    return 4 + elias_fano_bytes(vocab, n) + n * stored.itemsize


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


def record(payload: torch.Tensor, vocab: int, dense: torch.dtype, stored: torch.dtype, width: int) -> torch.Tensor:
    """The flat int32 record of one step: its header, then `payload` `(rows, row_bytes)` uint8 (host)."""
    rows = payload.shape[0]
    flat = payload.reshape(-1)
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % 4)])
    header = torch.tensor([rows, vocab, SPARSE_DTYPES.index(dense), SPARSE_DTYPES.index(stored), width], dtype=torch.int32)
    return torch.cat([header, flat.view(torch.int32)])


# -- parsing, on the host ---------------------------------------------------------------------------
class PackedRecord:
    """One step's packed record of `encoding`, parsed and checked; `columns()` decodes it.

    Raises:
        ValueError: the record is not a consistent record of `encoding` (damaged data).
    """

    def __init__(self, record: torch.Tensor, encoding: str) -> None:
        if record.dtype != torch.int32 or record.dim() != 1 or record.numel() < PACKED_HEADER:
            raise ValueError(f"a {encoding} record is a flat int32 tensor of at least {PACKED_HEADER} values, got "
                             f"{list(record.shape)} {record.dtype}")
        rows, vocab, dense, stored, width = (int(v) for v in record[:PACKED_HEADER])
        codes = range(len(SPARSE_DTYPES))
        expected = topk_width(encoding) or (sample_spec(encoding) or (0,))[0]
        if (rows < 0 or not 1 <= vocab <= SPARSE_MAX_VOCAB or dense not in codes or stored not in codes
                or width != expected):
            raise ValueError(f"a {encoding} record's header [{rows}, {vocab}, {dense}, {stored}, {width}] is not valid")
        self.encoding, self.rows, self.vocab, self.width = encoding, rows, vocab, width
        self.dtype, self.stored = SPARSE_DTYPES[dense], SPARSE_DTYPES[stored]
        self.row_bytes = row_bytes(encoding, vocab, self.stored)
        payload = record[PACKED_HEADER:].view(torch.uint8)
        if payload.numel() != rows * self.row_bytes + (-rows * self.row_bytes % 4):
            raise ValueError(f"a {encoding} record of {rows} rows holds {payload.numel()} bytes, not "
                             f"{rows * self.row_bytes} (padded to whole words)")
        self._rows = payload[: rows * self.row_bytes].reshape(rows, self.row_bytes)

    def _floats(self, start: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        end = start + count * dtype.itemsize
        return self._rows[:, start:end].reshape(-1).clone().view(dtype).reshape(self.rows, count)

    def columns(self) -> dict[str, torch.Tensor]:
        """The record decoded: for top-k, `Generation.topk`'s keys; for samples, `Generation.sampled_targets`'."""
        if sample_spec(self.encoding) is not None:
            return self._samples()
        if topk_bits(self.encoding) is not None:
            return self._quantised()
        k, size, ib = self.width, self.stored.itemsize, id_bytes(self.vocab)
        values = self._floats(0, k, self.stored).to(self.dtype).float()
        raw = self._rows[:, k * size : k * (size + ib)].reshape(self.rows, k, ib).to(torch.int64)
        indices = (raw * torch.tensor(_LE[:ib], dtype=torch.int64)).sum(-1)
        if bool((indices >= self.vocab).any()):
            raise ValueError("a packed record holds a token id outside the vocabulary")
        tail = self._floats(k * (size + ib), 2, torch.float32)
        return _topk(values, indices, tail[:, 0], tail[:, 1])

    def _quantised(self) -> dict[str, torch.Tensor]:
        k, bits = self.width, topk_bits(self.encoding)
        fixed = self._floats(0, 4, torch.float32)
        logsumexp, mass, top, scale = fixed.unbind(-1)
        coded = elias_fano_bytes(self.vocab, k)
        ids = elias_fano_ids(self._rows[:, 16 : 16 + coded], k, self.vocab)
        codes = unpack_bits(self._rows[:, 16 + coded :], k, bits)
        order = codes.sort(dim=-1, stable=True).indices  # by code, ties by id
        codes, ids = codes.gather(-1, order), ids.gather(-1, order)
        values = torch.where(codes == 2**bits - 1, float("-inf"), top[:, None] - codes * scale[:, None])
        return _topk(values.float(), ids, logsumexp, mass)

    def _samples(self) -> dict[str, torch.Tensor]:
        n, temperature = sample_spec(self.encoding)
        logsumexp = self._floats(0, 1, torch.float32)[:, 0]
        coded = elias_fano_bytes(self.vocab, n)
        ids = elias_fano_ids(self._rows[:, 4 : 4 + coded], n, self.vocab)
        values = self._floats(4 + coded, n, self.stored).to(self.dtype).float()
        first = torch.ones_like(ids, dtype=torch.bool)
        first[:, 1:] = ids[:, 1:] != ids[:, :-1]
        # Per id its count at its first position (0 at repeats): sum(counts / N * f(indices)) estimates E_p[f].
        start = torch.where(first, torch.arange(n), 0).cummax(-1).values
        runs = torch.zeros_like(ids).scatter_add_(1, start, torch.ones_like(ids))
        counts = torch.where(first, runs, 0)
        return {"indices": ids, "counts": counts, "values": values, "logsumexp": logsumexp,
                "logprobs": values / temperature - logsumexp[:, None]}


def _topk(values: torch.Tensor, indices: torch.Tensor, logsumexp: torch.Tensor, mass: torch.Tensor) -> dict[str, Any]:
    return {"values": values, "indices": indices, "logsumexp": logsumexp, "mass_outside": mass,
            "logprobs": values - logsumexp[:, None]}
