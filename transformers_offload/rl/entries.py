"""A generation's processed scores as entries, a step at a time, every row at once: what `kept_sets` and
`sampler_logprobs` read, with no loop over rows (the steps are read as they are stored, a chunk of steps per
read; what is done with them is vectorised over every row of the step).

A step's entries are its scores that are not -inf (`Readable.sparse`'s: ids ascending within a row, the
recorded dtype), each with its row; a `"topk:K"` record gives its finite entries, sorted by id (the top-k
reader's order is by value)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy
import torch

from ..codecs.spec import SPARSE
from .layout import is_topk

# Steps read at once: a sparse or top-k record is about a kept set per row, so 64 steps of a 4,096-row
# batch stay in the tens of MiB; a dense step is (rows, vocab) and is read alone.
STEPS_PER_READ = 64


@dataclass(frozen=True)
class StepEntries:
    """One step's entries, every row, in row order: `ids` int64 `(n,)` ascending within a row, `values` `(n,)`
    in the recorded dtype, `counts` int64 `(num_rows,)` (entries per row), `vocab` the scores' width."""

    ids: torch.Tensor
    values: torch.Tensor
    counts: torch.Tensor
    vocab: int

    @classmethod
    def of(cls, found: dict[str, torch.Tensor], vocab: int) -> StepEntries:
        """From one step's `Readable.sparse()` dict (`indices`, `values`, `offsets`) of scores `vocab` wide."""
        return cls(ids=found["indices"], values=found["values"], counts=found["offsets"][1:] - found["offsets"][:-1],
                   vocab=vocab)

    def rows(self) -> torch.Tensor:
        """Each entry's row, int64 `(n,)` (numpy's `repeat`: several times torch's `repeat_interleave` on the host)."""
        return torch.from_numpy(numpy.repeat(numpy.arange(self.counts.numel()), self.counts.numpy()))

    def starts(self) -> torch.Tensor:
        """Each row's first entry, int64 `(num_rows,)`."""
        return torch.cumsum(self.counts, 0) - self.counts


def step_entries(generation: Any, encoding: str) -> Iterator[StepEntries]:
    """`generation`'s processed scores, one `StepEntries` per step in order (`encoding`: the scores',
    checked exact by `check_scores_exact`).

    Raises:
        ValueError: a `topk:K` record with mass outside its K (a kept set larger than K).
    """
    chunk = STEPS_PER_READ if encoding == SPARSE or is_topk(encoding) else 1
    if not generation.num_steps:
        return
    vocab = _topk_vocab(generation) if is_topk(encoding) else int(generation.scores(steps=slice(0, 1), rows=0)[0].shape[-1])
    for start in range(0, generation.num_steps, chunk):
        steps = slice(start, min(start + chunk, generation.num_steps))
        if is_topk(encoding):
            for record in generation.topk("scores", steps=steps):
                yield _topk_entries(generation, encoding, record, vocab)
            continue
        for found in generation.sparse("scores", steps=steps):
            yield StepEntries.of(found, vocab)


def _topk_entries(generation: Any, encoding: str, record: dict, vocab: int) -> StepEntries:
    if bool((record["mass_outside"] > 0).any()):
        raise ValueError(f"generation {generation.index}'s scores are recorded `{encoding}` and some row's kept set "
                         "is larger than K (probability mass outside the K): record them dense, `sparse`, or with a "
                         "larger K.")
    values, indices = record["values"], record["indices"].to(torch.int64)
    finite = torch.isfinite(values)
    # the finite entries first, by id: a key past every id for the others
    order = torch.where(finite, indices, torch.iinfo(torch.int64).max).sort(-1).indices
    finite, indices, values = finite.gather(-1, order), indices.gather(-1, order), values.gather(-1, order)
    return StepEntries(ids=indices[finite], values=values[finite], counts=finite.sum(-1), vocab=vocab)


def _topk_vocab(generation: Any) -> int:
    """A top-k record's vocabulary: the raw logits' width where recorded, else the model config's."""
    if raw_exact(generation):
        return int(generation.logits(steps=slice(0, 1))[0].shape[-1])
    return int(generation.generation_config.get("vocab_size") or 0)


def raw_exact(generation: Any) -> bool:
    """Whether the generation's raw logits are recorded, every entry exactly."""
    return "logits" in generation.streams and generation.encodings.get("logits", "dense") in ("dense", "sparse", "native")
