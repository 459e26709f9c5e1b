"""The packed records of the top-k and sampled encodings: their layouts, the bit packing they share
(`bits`), their parsing on the host (`PackedRecord`) and the encoders that write them on the device
(`TopK`, `QuantisedTopK`, `Sampled`). docs/format.md is the specification.

A step's record is one flat int32 tensor: a header `[rows, vocab, dense code, stored code, width]`
(codes index `sparse.SPARSE_DTYPES`: the dtype of the tensor that was encoded, and the one the kept
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
- `"topk:K+tail:N"`: the `"topk:K"` row, then the N token ids drawn from outside the K, ascending (repeats
  kept), Elias-Fano coded, and their values `x[id]` in the stored dtype (narrow only when every kept and
  every drawn value converts back bit for bit).

Elias-Fano (n non-decreasing ids below `vocab`, L = floor(log2(vocab / n)), at least 0): each id's low
L bits packed (LSB first, n x L bits, in whole bytes), then a bitmap of `n + ((vocab - 1) >> L) + 1` bits
(in whole bytes) with bit `(id >> L) + i` set for the i-th id.

The encoders, one per encoding: The top-k and sampled encodings of a `(rows, vocab)` step, in two parts like `sparse.Sparse`: the
device part (`on_device`, where the tensor is; on CUDA on the side stream over the step's staging copy)
computes everything from the tensor with fixed shapes, so nothing in it waits for the device; the host
part (`on_host`, in the drainer thread on CUDA) only lays the bytes out.

- `TopK` (`"topk:K"`): per row the K largest values bit for bit, their ids, the logsumexp and the mass
  outside the K, the columns of these torch expressions of the step's tensor `x`:

      values, indices = torch.topk(x, K, dim=-1)
      logsumexp       = torch.logsumexp(x, -1)
      mass_outside    = torch.exp(torch.logsumexp(x.scatter(-1, indices, -inf), -1) - logsumexp)

  A float32 step of a bfloat16/float16 model (transformers upcasts its logits from 4.45) keeps its
  values in the model's dtype when every kept value converts back bit for bit (checked on the device;
  the host picks the narrow or the wide copy), as `"native"` does.
- `QuantisedTopK` (`"topk:K:qB"`, lossy by choice): the same K ids, Elias-Fano coded, and each value as
  a B-bit step below the row's largest (kept exactly): `code = round((top - v) / scale)`, `scale = (top -
  smallest finite kept value) / (2**B - 2)`, at least 1 for a value below the top (so the top token stays
  first), `2**B - 1` for -inf.
- `TopK` with a tail (`"topk:K+tail:N"`): also N ids drawn with replacement from the distribution over
  the ids outside the K, `torch.multinomial(softmax(x.float().scatter(-1, indices, -inf)), N)` with the
  recorder's own generator, and their values `x[id]`. A row whose mass outside is 0 (its draws carry no
  weight) draws from its weights plus 1 (uniformly where its ids outside the K are all -inf).
- `Sampled` (`"sample:N@T"`): N ids drawn with replacement from `softmax(x.float() / T)` by
  `torch.multinomial` with the recorder's own generator (generate()'s random stream is left alone), their
  values `x[id]` and `torch.logsumexp(x.float() / T, -1)`.
"""

from __future__ import annotations

from typing import Any, Callable

from .._lazy import torch
from .bits import elias_fano, elias_fano_bytes, elias_fano_ids, float_bytes, id_bytes, ids_bytes, pack_bits, unpack_bits
from .dtypes import cast
from .sparse import SPARSE_DTYPES, SPARSE_MAX_VOCAB
from .spec import sample_spec, topk_bits, topk_tail, topk_width
from .workspace import ChunkBuffers
from .workspace import logsumexp as _logsumexp

PACKED_HEADER = 5
_LE = (1, 256, 65536, 16777216)  # little-endian byte weights of an id


def row_bytes(encoding: str, vocab: int, stored: torch.dtype) -> int:
    """Bytes per row of a packed record of `encoding` over `vocab` tokens, values stored in `stored`."""
    k, bits, sample = topk_width(encoding), topk_bits(encoding), sample_spec(encoding)
    if bits is not None:
        return 16 + elias_fano_bytes(vocab, k) + -(-k * bits // 8)
    if k is not None:
        tail = topk_tail(encoding)
        drawn = 0 if tail is None else elias_fano_bytes(vocab, tail) + tail * stored.itemsize
        return (stored.itemsize + id_bytes(vocab)) * k + 8 + drawn
    n = sample[0]
    return 4 + elias_fano_bytes(vocab, n) + n * stored.itemsize


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
        fixed = self._floats(k * (size + ib), 2, torch.float32)
        columns = _topk_columns(values, indices, fixed[:, 0], fixed[:, 1])
        n = topk_tail(self.encoding)
        if n is not None:
            start = k * (size + ib) + 8
            coded = elias_fano_bytes(self.vocab, n)
            drawn = elias_fano_ids(self._rows[:, start : start + coded], n, self.vocab)
            drawn_values = self._floats(start + coded, n, self.stored).to(self.dtype).float()
            columns |= {"tail_indices": drawn, "tail_values": drawn_values,
                        "tail_logprobs": drawn_values - fixed[:, :1]}
        return columns

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
        return _topk_columns(values.float(), ids, logsumexp, mass)

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


def _topk_columns(values: torch.Tensor, indices: torch.Tensor, logsumexp: torch.Tensor, mass: torch.Tensor) -> dict[str, Any]:
    return {"values": values, "indices": indices, "logsumexp": logsumexp, "mass_outside": mass,
            "logprobs": values - logsumexp[:, None]}


# -- encoding, inside the step ---------------------------------------------------------------------
class _Packed:
    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        self.buffers = ChunkBuffers()  # the (rows, vocab) work of each step, made at the first one

    def on_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """The step's record of a CPU tensor at once."""
        return self.on_host(self.on_device(x), vocab=x.shape[-1], dtype=x.dtype, fetch=None)

    def on_host(self, fixed: torch.Tensor, *, vocab: int, dtype: torch.dtype,
                fetch: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
        return record(fixed, vocab, dtype, dtype, self.width)


def _topk(x: torch.Tensor, k: int, buffers: ChunkBuffers) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The K largest values and their ids, `torch.logsumexp(x, -1)` and the mass outside them
    (`exp(logsumexp(x.scatter(-1, ids, -inf)) - logsumexp(x))`), their `(rows, vocab)` work written into
    one buffer made once per encoder (`workspace.logsumexp` equals `torch.logsumexp`)."""
    values, indices = torch.topk(x, k, dim=-1)
    work = buffers.take("topk", x.shape, x.dtype, x.device)  # left holding exp(rest - max(rest)): `TopK._draw`
    logsumexp = _logsumexp(x, work)
    # x.scatter(-1, indices, -inf) is a clone then scatter_: here the clone is into the buffer.
    mass_outside = torch.exp(_logsumexp(work.copy_(x).scatter_(-1, indices, float("-inf")), work) - logsumexp)
    return values, indices, logsumexp.float(), mass_outside.float()


class TopK(_Packed):
    """`"topk:K"`, lossless for what it keeps, and `"topk:K+tail:N"` (also N ids drawn from outside the K).
    `model_dtype`: the model's (a float32 step of a bfloat16/float16 model may be stored in it);
    `generator`: per device, the recorder's generator that draws the tail (`_generators`)."""

    def __init__(self, encoding: str, model_dtype: torch.dtype | None = None,
                 generator: Callable[[torch.device], torch.Generator] | None = None) -> None:
        super().__init__(encoding)
        self.width, self.tail = topk_width(encoding), topk_tail(encoding)
        self.model_dtype = torch.float32 if model_dtype is None else model_dtype
        self._generator = generator

    def _narrow(self, dtype: torch.dtype) -> torch.dtype | None:
        if dtype == torch.float32 and self.model_dtype in (torch.bfloat16, torch.float16):
            return self.model_dtype
        return None

    def on_device(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `(rows, vocab)` -> `(rows, bytes)` uint8 on `x`'s device: [narrowable flag (1 byte), values,
        values in the model's dtype (when it may narrow), ids, logsumexp, mass, and with a tail its ids
        (Elias-Fano), values, values in the model's dtype]; no host synchronisation."""
        x = x.detach()
        rows, vocab = x.shape
        values, indices, logsumexp, mass = _topk(x, self.width, self.buffers)
        drawn, drawn_values = self._draw(x, indices, mass) if self.tail is not None else (None, None)
        narrow = self._narrow(x.dtype)
        flag = torch.zeros(rows, 1, dtype=torch.uint8, device=x.device)
        small = None
        if narrow is not None:
            kept = values if drawn_values is None else torch.cat([values, drawn_values], -1)
            small = kept.to(narrow)
            same = (small.to(x.dtype).view(torch.int32) == kept.view(torch.int32)).all()
            flag = same.to(torch.uint8).expand(rows, 1)
        k = self.width
        parts = [flag, float_bytes(values)]
        if small is not None:
            parts.append(float_bytes(small[:, :k]))
        parts += [ids_bytes(indices, vocab), float_bytes(logsumexp[:, None]), float_bytes(mass[:, None])]
        if drawn is not None:
            parts += [elias_fano(drawn, vocab), float_bytes(drawn_values)]
            if small is not None:
                parts.append(float_bytes(small[:, k:]))
        return torch.cat(parts, dim=-1)

    def _draw(self, x: torch.Tensor, indices: torch.Tensor, mass: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """N ids per row drawn from the softmax over the ids outside `indices`, ascending, and their values
        in `x`. The weights are `exp(rest - max(rest))` (multinomial scales them): for a float32 step, what
        `_topk` left in its buffer while finding the mass outside (computed once); else computed here in a
        float32 buffer. A row whose mass outside is 0 (its draws carry no weight) gets 1 added to every
        weight, so that it always has some."""
        if x.dtype == torch.float32:
            rest = self.buffers.take("topk", x.shape, x.dtype, x.device)  # `_topk`'s: exp(rest - max(rest))
        else:
            rest = self.buffers.take("tail", x.shape, torch.float32, x.device).copy_(x).scatter_(-1, indices, float("-inf"))
            top = rest.amax(-1, keepdim=True)
            rest.sub_(top.masked_fill_(top == float("-inf"), 0.0)).exp_()
        weights = rest.add_((mass == 0)[:, None])
        drawn = torch.multinomial(weights, self.tail, replacement=True, generator=self._generator(x.device))
        drawn = drawn.sort(-1).values
        return drawn, x.gather(-1, drawn)

    def on_host(self, fixed: torch.Tensor, *, vocab: int, dtype: torch.dtype,
                fetch: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
        """The step's flat int32 record from `on_device`'s host copy (nothing fetched)."""
        k, narrow = self.width, self._narrow(dtype)
        narrowed = narrow is not None and fixed.shape[0] > 0 and bool(fixed[0, 0])
        stored = narrow if narrowed else dtype
        small = narrow.itemsize if narrow is not None else 0
        fields = [k * dtype.itemsize, k * small, k * id_bytes(vocab) + 8]
        if self.tail is not None:
            fields += [elias_fano_bytes(vocab, self.tail), self.tail * dtype.itemsize, self.tail * small]
        parts, start = [], 1
        for size in fields:
            parts.append(fixed[:, start : start + size])
            start += size
        keep = [1 if narrowed else 0, 2, 3, 5 if narrowed else 4] if self.tail is not None else [1 if narrowed else 0, 2]
        return record(torch.cat([parts[i] for i in keep], dim=-1), vocab, dtype, stored, k)


class QuantisedTopK(_Packed):
    """`"topk:K:qB"`: lossy by choice (this module's docstring has the layout, docs/recording.md the errors)."""

    def __init__(self, encoding: str) -> None:
        super().__init__(encoding)
        self.width, self.bits = topk_width(encoding), topk_bits(encoding)

    def on_device(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `(rows, vocab)` -> the `(rows, row_bytes)` uint8 rows on `x`'s device; no host synchronisation."""
        x = x.detach()
        values, indices, logsumexp, mass = _topk(x, self.width, self.buffers)
        v = values.float()
        top = v[:, :1]
        finite = v != float("-inf")
        levels = 2**self.bits - 2  # the largest code of a finite value; levels + 1 is -inf
        scale = (top - torch.where(finite, v, top).min(-1, keepdim=True).values) / levels
        steps = ((top - v) / torch.where(scale > 0, scale, 1.0)).round().clamp(0, levels)
        steps = torch.where((v < top) & (steps == 0), 1.0, steps)
        codes = torch.where(finite, steps, levels + 1.0).to(torch.int64)
        ids, order = indices.sort(-1)
        fixed = torch.cat([logsumexp[:, None], mass[:, None], top, scale], dim=-1)
        return torch.cat([float_bytes(fixed), elias_fano(ids, x.shape[-1]),
                          pack_bits(codes.gather(-1, order), self.bits)], dim=-1)


def _generators(generators: dict[torch.device, torch.Generator], seed: int) -> Callable[[torch.device], torch.Generator]:
    """Per device, the recorder's generator there, made from `seed` on first use (so that a recorder's
    draws are reproducible), kept in `generators` (shared by the recorder's encoders)."""

    def generator(device: torch.device) -> torch.Generator:
        found = generators.get(device)
        if found is None:
            found = generators[device] = torch.Generator(device=device)
            found.manual_seed(seed)
        return found

    return generator


class Sampled(_Packed):
    """`"sample:N@T"`: `generators` maps a device to the recorder's generator there (made from `seed`
    on first use, so that a recorder's samples are reproducible)."""

    def __init__(self, encoding: str, generators: dict[torch.device, torch.Generator], seed: int) -> None:
        super().__init__(encoding)
        self.width, self.temperature = sample_spec(encoding)
        self._generator = _generators(generators, seed)

    def on_device(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `(rows, vocab)` -> the `(rows, row_bytes)` uint8 rows on `x`'s device; no host synchronisation."""
        x = x.detach()
        scaled = x.float() / self.temperature
        logsumexp = torch.logsumexp(scaled, -1)
        draws = torch.multinomial(torch.softmax(scaled, -1), self.width, replacement=True,
                                  generator=self._generator(x.device))
        ids = draws.sort(-1).values
        return torch.cat([float_bytes(logsumexp[:, None]), elias_fano(ids, x.shape[-1]),
                          float_bytes(x.gather(-1, ids))], dim=-1)


def encoder(encoding: str, *, model_dtype: torch.dtype, generators: dict[torch.device, torch.Generator],
            seed: int) -> _Packed:
    """The encoder of a top-k or sampled `encoding` name."""
    if sample_spec(encoding) is not None:
        return Sampled(encoding, generators, seed)
    if topk_bits(encoding) is not None:
        return QuantisedTopK(encoding)
    return TopK(encoding, model_dtype, _generators(generators, seed))


# -- top-k streams stored as one `(rows, 2K + 2)` float64 tensor per step (a stream of dtype float64) ---
def topk_columns(record: Any, k: int) -> dict[str, Any]:
    """A `(rows, 2K + 2)` float64 top-k record (a `"topk:K"` stream of dtype float64; a tensor, or a
    NumPy array) as columns of its kind:
    `values` float32 `(rows, K)`, `indices` int64 `(rows, K)`, `logsumexp` and `mass_outside` float32
    `(rows,)` (exact: float64 holds them), and `logprobs`, float32 `(rows, K)`: `values - logsumexp[:, None]`."""
    values = cast(record[..., :k], "float32")
    logsumexp = cast(record[..., 2 * k], "float32")
    return {
        "values": values,
        "indices": cast(record[..., k : 2 * k], "int64"),
        "logsumexp": logsumexp,
        "mass_outside": cast(record[..., 2 * k + 1], "float32"),
        "logprobs": values - logsumexp[..., None],
    }
