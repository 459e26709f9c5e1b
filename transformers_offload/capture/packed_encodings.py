"""The top-k and sampled encodings of a `(rows, vocab)` step, in two parts like `encodings.Sparse`: the
device part (`on_device`, where the tensor is; on CUDA on the side stream over the step's staging copy)
computes everything from the tensor with fixed shapes, so nothing in it waits for the device; the host
part (`on_host`, in the drainer thread on CUDA) only lays the bytes out (`store.packed` has the layouts).

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
- `Sampled` (`"sample:N@T"`): N ids drawn with replacement from `softmax(x.float() / T)` by
  `torch.multinomial` with the recorder's own generator (generate()'s random stream is left alone), their
  values `x[id]` and `torch.logsumexp(x.float() / T, -1)`.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..store import packed as _packed
from ..store.format import sample_spec, topk_bits, topk_width
from .workspace import ChunkBuffers, logsumexp as _logsumexp


class _Packed:
    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        self.buffers = ChunkBuffers()  # the (rows, vocab) work of each step, made at the first one

    def on_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """The step's record of a CPU tensor at once."""
        return self.on_host(self.on_device(x), vocab=x.shape[-1], dtype=x.dtype, fetch=None)

    def on_host(self, fixed: torch.Tensor, *, vocab: int, dtype: torch.dtype,
                fetch: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
        return _packed.record(fixed, vocab, dtype, dtype, self.width)


def _topk(x: torch.Tensor, k: int, buffers: ChunkBuffers) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The K largest values and their ids, `torch.logsumexp(x, -1)` and the mass outside them
    (`exp(logsumexp(x.scatter(-1, ids, -inf)) - logsumexp(x))`), their `(rows, vocab)` work written into
    one buffer made once per encoder (`workspace.logsumexp` equals `torch.logsumexp`)."""
    values, indices = torch.topk(x, k, dim=-1)
    work = buffers.take("topk", x.shape, x.dtype, x.device)
    logsumexp = _logsumexp(x, work)
    # x.scatter(-1, indices, -inf) is a clone then scatter_: here the clone is into the buffer.
    mass_outside = torch.exp(_logsumexp(work.copy_(x).scatter_(-1, indices, float("-inf")), work) - logsumexp)
    return values, indices, logsumexp.float(), mass_outside.float()


class TopK(_Packed):
    """`"topk:K"`, lossless for what it keeps. `model_dtype`: the model's (a float32 step of a
    bfloat16/float16 model may be stored in it)."""

    def __init__(self, encoding: str, model_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(encoding)
        self.width = topk_width(encoding)
        self.model_dtype = model_dtype

    def _narrow(self, dtype: torch.dtype) -> torch.dtype | None:
        if dtype == torch.float32 and self.model_dtype in (torch.bfloat16, torch.float16):
            return self.model_dtype
        return None

    def on_device(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `(rows, vocab)` -> `(rows, bytes)` uint8 on `x`'s device: [narrowable flag (1 byte), values,
        values in the model's dtype (when it may narrow), ids, logsumexp, mass]; no host synchronisation."""
        x = x.detach()
        rows, vocab = x.shape
        values, indices, logsumexp, mass = _topk(x, self.width, self.buffers)
        narrow = self._narrow(x.dtype)
        parts = [_packed.float_bytes(values)]
        flag = torch.zeros(rows, 1, dtype=torch.uint8, device=x.device)
        if narrow is not None:
            small = values.to(narrow)
            same = (small.to(x.dtype).view(torch.int32) == values.view(torch.int32)).all()
            flag = same.to(torch.uint8).expand(rows, 1)
            parts.append(_packed.float_bytes(small))
        parts += [_packed.ids_bytes(indices, vocab), _packed.float_bytes(logsumexp[:, None]),
                  _packed.float_bytes(mass[:, None])]
        return torch.cat([flag, *parts], dim=-1)

    def on_host(self, fixed: torch.Tensor, *, vocab: int, dtype: torch.dtype,
                fetch: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
        """The step's flat int32 record from `on_device`'s host copy (nothing fetched)."""
        k, narrow = self.width, self._narrow(dtype)
        wide = 1 + k * dtype.itemsize
        rest = fixed[:, wide:]
        stored = dtype
        if narrow is not None:
            small, rest = rest[:, : k * narrow.itemsize], rest[:, k * narrow.itemsize :]
            if fixed.shape[0] and bool(fixed[0, 0]):
                stored = narrow
        values = small if stored is not dtype else fixed[:, 1:wide]
        return _packed.record(torch.cat([values, rest], dim=-1), vocab, dtype, stored, k)


class QuantisedTopK(_Packed):
    """`"topk:K:qB"`: lossy by choice (`store.packed` has the layout, docs/recording.md the errors)."""

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
        return torch.cat([_packed.float_bytes(fixed), _packed.elias_fano(ids, x.shape[-1]),
                          _packed.pack_bits(codes.gather(-1, order), self.bits)], dim=-1)


class Sampled(_Packed):
    """`"sample:N@T"`: `generators` maps a device to the recorder's generator there (made from `seed`
    on first use, so that a recorder's samples are reproducible)."""

    def __init__(self, encoding: str, generators: dict[torch.device, torch.Generator], seed: int) -> None:
        super().__init__(encoding)
        self.width, self.temperature = sample_spec(encoding)
        self._generators, self._seed = generators, seed

    def _generator(self, device: torch.device) -> torch.Generator:
        found = self._generators.get(device)
        if found is None:
            found = self._generators[device] = torch.Generator(device=device)
            found.manual_seed(self._seed)
        return found

    def on_device(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `(rows, vocab)` -> the `(rows, row_bytes)` uint8 rows on `x`'s device; no host synchronisation."""
        x = x.detach()
        scaled = x.float() / self.temperature
        logsumexp = torch.logsumexp(scaled, -1)
        draws = torch.multinomial(torch.softmax(scaled, -1), self.width, replacement=True,
                                  generator=self._generator(x.device))
        ids = draws.sort(-1).values
        return torch.cat([_packed.float_bytes(logsumexp[:, None]), _packed.elias_fano(ids, x.shape[-1]),
                          _packed.float_bytes(x.gather(-1, ids))], dim=-1)


def encoder(encoding: str, *, model_dtype: torch.dtype, generators: dict[torch.device, torch.Generator],
            seed: int) -> _Packed:
    """The encoder of a top-k or sampled `encoding` name."""
    if sample_spec(encoding) is not None:
        return Sampled(encoding, generators, seed)
    if topk_bits(encoding) is not None:
        return QuantisedTopK(encoding)
    return TopK(encoding, model_dtype)

