"""Per-token statistics, computed on the device from each step's full raw logits and processed scores.

With `"stats"` in the Recorder's `streams`, each step records one small `(rows, 9)` float32 tensor
instead of (or beside) the `(rows, vocab)` ones: 36 bytes per row and step. The columns, in
`COLUMNS` order, are exactly these torch expressions of the step's raw logits `x` (`out.logits[t]`)
and processed scores `s` (`out.scores[t]`), on the device they were computed on, for the rows `r` of
the step (`r = arange(rows)`; in beam search, each running beam's parent, `beam_parents`) and the
tokens `y` they continue with (`tokens`):

    token               y
    logprob_raw         torch.log_softmax(x, -1)[r, y].float()
    logprob_processed   torch.log_softmax(s, -1)[r, y].float()
    rank_raw            (x[r] > x[r, y][:, None]).sum(-1)           # 0 = the most likely
    rank_processed      (s[r] > s[r, y][:, None]).sum(-1)
    entropy_raw         torch.special.entr(torch.softmax(x, -1)).sum(-1)[r].float()   # nats
    entropy_processed   torch.special.entr(torch.softmax(s, -1)).sum(-1)[r].float()
    logsumexp_raw       torch.logsumexp(x, -1)[r].float()
    support_processed   torch.isfinite(s).sum(-1)[r]

Float32 holds each of them exactly (float32 values, and integers up to 2**24: token ids, ranks and
counts below the vocabulary size; a vocabulary larger than 2**24 gets a float64 record, which holds
integers below 2**53; a reader takes either), so the reader gives back float32
and int64 tensors equal to the expressions. In beam search a running beam of the last
step continues with no token: its `token` and ranks are -1 and its logprobs NaN, and its entropies,
logsumexp and support are its own row's.

The capture hands this module each step's tensors as it sees them (raw logits before the first
processor, a copy, since processors may edit them in place; processed scores after the last one) and,
once the step's tokens are known, asks for the step's record. Nothing here waits for the device.
"""

from __future__ import annotations

import torch

from ..codecs.stats import STATS_COLUMNS as COLUMNS
from ..codecs.workspace import ChunkBuffers, logsumexp

FLOAT32_INTEGERS = 2**24  # every integer up to this is a float32 value


class StepStats:
    """Each pending step's raw logits and processed scores, until its tokens are known.

    Nothing here allocates a `(rows, vocab)` tensor after the first steps of a call: a step's raw logits
    are copied into a buffer a recorded step gave back, and the statistics are computed into workspaces
    made once per (shape, dtype, device) (`ChunkBuffers`), so the host's peak does not depend on how the
    C library reuses freed blocks. `buffers.allocations` (plus `raw_allocations`) counts the tensors made.
    """

    def __init__(self) -> None:
        self._raw: dict[int, torch.Tensor] = {}
        self._processed: dict[int, torch.Tensor] = {}
        self._free: list[torch.Tensor] = []  # raw buffers of steps already recorded, to copy into again
        self.buffers = ChunkBuffers()
        self.raw_allocations = 0

    def raw(self, step: int, logits: torch.Tensor) -> None:
        """The step's raw logits `(rows, vocab)`, copied (a later write of the same step replaces it)."""
        logits = logits.detach()
        kept = self._raw.pop(step, None)
        if kept is not None:
            self._free.append(kept)
        # Only contiguous logits (what generate() hands the processors) reuse a buffer: a clone keeps a
        # dense tensor's strides, and the statistics must reduce over the same layout as before.
        for index, free in enumerate(self._free if logits.is_contiguous() else ()):
            if (free.shape, free.dtype, free.device) == (logits.shape, logits.dtype, logits.device) and free.is_contiguous():
                self._raw[step] = self._free.pop(index).copy_(logits)
                return
        self._raw[step] = logits.clone()
        self.raw_allocations += 1

    def processed(self, step: int, scores: torch.Tensor) -> None:
        """The step's processed scores `(rows, vocab)`, as the decoding loop uses them."""
        self._processed[step] = scores.detach()

    def has(self, step: int) -> bool:
        return step in self._raw and step in self._processed

    def record(self, step: int, tokens: torch.Tensor, parents: torch.Tensor | None = None) -> torch.Tensor:
        """The step's `(rows, 9)` float32 record (float64 above a 2**24-token vocabulary); earlier steps
        are forgotten (this one is kept: beam search records its last step again when the call ends,
        with no beam continuing).

        Args:
            tokens (`torch.LongTensor` of shape `(rows,)`): the token each row continues with (-1: none).
            parents (`torch.LongTensor` of shape `(rows,)`, *optional*): in beam search, the row of the
                step each running beam extends (-1: none); None means row r extends row r.
        """
        x, s = self._raw[step], self._processed[step]
        for old in [t for t in self._raw if t < step]:
            self._free.append(self._raw.pop(old))
        for old in [t for t in self._processed if t < step]:
            del self._processed[old]
        rows = torch.arange(tokens.shape[0], device=x.device)
        tokens = tokens.to(x.device)
        continues = tokens >= 0
        if parents is not None:
            parents = parents.to(x.device)
            continues = continues & (parents >= 0)
            rows = torch.where(parents >= 0, parents, rows)
        y = torch.where(continues, tokens, torch.zeros_like(tokens))
        columns = {
            "token": torch.where(continues, tokens, torch.full_like(tokens, -1)),
            "logprob_raw": torch.log_softmax(x, -1, out=self._work(x))[rows, y].float(),
            "logprob_processed": torch.log_softmax(s, -1, out=self._work(s))[rows, y].float(),
            "rank_raw": self._rank(x, rows, y, parents is not None),
            "rank_processed": self._rank(s, rows, y, parents is not None),
            "entropy_raw": self._entropy(x)[rows].float(),
            "entropy_processed": self._entropy(s)[rows].float(),
            "logsumexp_raw": self._logsumexp(x)[rows].float(),
            # isfinite(s) as |s| < inf (False for NaN and +-inf), held as 0.0 / 1.0 and counted exactly.
            "support_processed": torch.lt(torch.abs(s, out=self._work(s)), float("inf"), out=self._above(s)).sum(-1)[rows],
        }
        for name in ("logprob_raw", "logprob_processed"):
            columns[name] = torch.where(continues, columns[name], torch.full_like(columns[name], float("nan")))
        for name in ("rank_raw", "rank_processed"):
            columns[name] = torch.where(continues, columns[name], torch.full_like(columns[name], -1))
        dtype = torch.float32 if x.shape[-1] <= FLOAT32_INTEGERS else torch.float64
        return torch.stack([columns[name].to(dtype) for name in COLUMNS], dim=-1)

    def clear(self) -> None:
        self._raw.clear()
        self._processed.clear()
        self._free.clear()

    # Each expression below equals (torch.equal) the one in the module's docstring: the same kernels,
    # written into workspaces instead of new tensors. A count sums a comparison held as 0.0 / 1.0 in a
    # float32 buffer (float64 above 2**24 entries): exact in any order, without the int64 copy that
    # summing a bool tensor makes.
    def _work(self, t: torch.Tensor) -> torch.Tensor:
        return self.buffers.take(f"work {t.dtype}", t.shape, t.dtype, t.device)

    def _above(self, t: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32 if t.shape[-1] <= FLOAT32_INTEGERS else torch.float64
        return self.buffers.take("above", t.shape, dtype, t.device)

    def _rank(self, t: torch.Tensor, rows: torch.Tensor, y: torch.Tensor, gathered: bool) -> torch.Tensor:
        """`(t[rows] > t[rows, y][:, None]).sum(-1)`, as float counts."""
        threshold = t[rows, y][:, None]
        if gathered:  # beam search: rows are the running beams' parents
            t = torch.index_select(t, 0, rows, out=self._work(t))
        return torch.gt(t, threshold, out=self._above(t)).sum(-1)

    def _entropy(self, t: torch.Tensor) -> torch.Tensor:
        """`torch.special.entr(torch.softmax(t, -1)).sum(-1)`."""
        probabilities = torch.softmax(t, -1, out=self._work(t))
        return torch.special.entr(probabilities, out=probabilities).sum(-1)

    def _logsumexp(self, t: torch.Tensor) -> torch.Tensor:
        """`torch.logsumexp(t, -1)` (`workspace.logsumexp`)."""
        return logsumexp(t, self._work(t))
