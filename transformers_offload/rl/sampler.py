"""`sampler_logprobs(recording)`: per sampled token, in `kept_sets`' `(rows, steps)` layout, the logprobs
an importance-sampling correction needs, from the recording alone (no second forward):

    sampled[r, t]          = torch.log_softmax(s.float(), -1)[y]       # s = out.scores[t][r]: the distribution drawn from
    raw[r, t]              = torch.log_softmax(x.float(), -1)[y]       # x = out.logits[t][r], temperature 1
    raw_temperature[r, t]  = torch.log_softmax(x.float() / T, -1)[y]   # at the sampling temperature T

with `y` the sampled token; 0 where not `valid`. `sampled` is the sampler's own logprob (renormalised over the
kept set, since `s` is -inf outside it); `raw_temperature` is what TRL's `old_per_token_logps` computes
from a trainer forward; their difference is what top-p/top-k sampling moved.

`sampled` is that expression bit for bit, without making `s` dense: torch's CPU `log_softmax` over a row sums
`exp(s - max)` in SIMD lanes (lane = position modulo the vector width: 8 floats with AVX2, 16 with AVX-512),
each lane in position order, then the lanes together; a -inf entry adds an exact 0.0 to its lane. So the
row packed without its empty blocks of positions (a block a multiple of the vector width: each entry keeps
its lane and its order in it) gives the same max, the same lane sums and the same logprob from a row of a
few blocks instead of `vocab` entries (`packed_log_softmax`), for scores recorded `sparse`; dense steps are
read and computed one at a time. The block is not assumed: `packing_block()` finds, once per process, the
smallest of 4 .. 64 positions whose packing gives this torch's dense results bit for bit on 512 probe rows (and
every larger one does too); where none does, every row is computed dense. tests/rl/test_rollout_scale.py checks
the packing against the dense expression with `torch.equal`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..codecs.sparse import ranges, sparse_entries
from ..codecs.spec import SPARSE
from .entries import StepEntries, step_entries
from .layout import check_scores_exact, generations_of, is_topk, temperature_of

# The blocks `packing_block` tries, widest first: 64 floats is four AVX-512 vectors.
BLOCKS = (64, 32, 16, 8, 4)


def sampler_logprobs(source: Any, *, raw: bool = True) -> dict[str, torch.Tensor]:
    """The sampled tokens' logprobs under the distribution sampled and under the raw one (module docstring).

    Args:
        source: a `Generation`, `Recording` or `Recorder` (rows laid out as `kept_sets(source)`), recorded with
            `streams=("logits", "scores")` (dense, `sparse` or `native`); `("scores",)` is enough with `raw=False`.
        raw (`bool`, *optional*, defaults to True): also `raw` and `raw_temperature` (which read the raw logits).

    Returns:
        `dict` of CPU tensors `(rows, steps)`: `sampled`, `raw`, `raw_temperature` (float32; the last two only
        with `raw`), `tokens` (int64), `valid` (bool).

    Raises:
        ValueError: a stream not recorded, or recorded top-k or lossily; a beam search.
        TypeError: `source` is not a generation, recording or recorder.

    Example:
        >>> lp = sampler_logprobs(rec)  # doctest: +SKIP
        >>> ratio = (trainer_logprobs - lp["sampled"]).exp()  # doctest: +SKIP
    """
    generations = generations_of(source)
    steps = max(generation.num_steps for generation in generations)
    kinds = ("sampled", "raw", "raw_temperature") if raw else ("sampled",)
    found: dict[str, list[torch.Tensor]] = {name: [] for name in (*kinds, "tokens", "valid")}
    for generation in generations:
        encoding = check_scores_exact(generation)
        no_logits = "logits" not in generation.streams or is_topk(generation.encodings.get("logits", "dense"))
        if is_topk(encoding):
            raise ValueError(f"generation {generation.index}'s scores are recorded `{encoding}` (the top K only): the "
                             "sampler's logprob needs every kept entry, so record the scores dense, `sparse` or "
                             "`native`.")
        if raw and no_logits:
            raise ValueError(f"generation {generation.index}: `raw` and `raw_temperature` need the raw logits recorded "
                             "in full (dense, `sparse` or `native`): record with `streams=(\"logits\", \"scores\")`, "
                             "or pass `raw=False` for the sampled logprob alone.")
        rows, count, temperature = generation.num_rows, generation.num_steps, temperature_of(generation)
        columns = {name: torch.zeros((rows, steps), dtype=torch.float32) for name in kinds}
        tokens = torch.full((rows, steps), -1, dtype=torch.long)
        valid = torch.zeros((rows, steps), dtype=torch.bool)
        if count:
            tokens[:, :count] = torch.stack(generation.tokens(), 1)
            valid[:, :count] = ~torch.stack(generation.finished(), 1)
            if encoding == SPARSE:  # the kept entries as stored: packed, not made dense
                for t, entries in enumerate(step_entries(generation, encoding)):
                    columns["sampled"][:, t] = packed_log_softmax(entries, tokens[:, t])
            else:  # dense steps are the expression's own input: a step at a time
                for t in range(count):
                    s = generation.scores(steps=slice(t, t + 1))[0]
                    columns["sampled"][:, t] = torch.log_softmax(s.float(), -1).gather(-1, tokens[:, t, None])[:, 0]
            for t in range(count if raw else 0):
                x, y = generation.logits(steps=slice(t, t + 1))[0], tokens[:, t, None]
                columns["raw"][:, t] = torch.log_softmax(x.float(), -1).gather(-1, y)[:, 0]
                columns["raw_temperature"][:, t] = torch.log_softmax(x.float() / temperature, -1).gather(-1, y)[:, 0]
        for name, column in columns.items():
            found[name].append(torch.where(valid, column, 0.0))
        found["tokens"].append(tokens)
        found["valid"].append(valid)
    return {name: torch.cat(parts) for name, parts in found.items()}


def packed_log_softmax(entries: StepEntries, tokens: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """`torch.log_softmax(s.float(), -1).gather(-1, tokens[:, None])[:, 0]` of one step's scores `s` (`(rows, vocab)`,
    -inf where `entries` hold nothing), bit for bit, from the entries (module docstring): float32 `(rows,)` on CPU
    (NaN where that is NaN: a row with no entry, or a NaN or +inf entry and the token outside the row's entries;
    the NaN's sign bit may differ).

    Each row's entries go into a row of its non-empty blocks of `block` positions (`packing_block()` by
    default; None there: every row dense), in order (an entry at `b * block + i` of the packed row, `b` its
    block's rank among the row's); rows are grouped by their packed width, rounded up to one of four widths
    per power of two, and a group as wide as the vocabulary is laid out as the vocabulary itself. One
    `torch.log_softmax` per group."""
    block = packing_block() if block is None else block
    rows, vocab = entries.counts.numel(), entries.vocab
    ids, counts, starts = entries.ids, entries.counts, entries.starts()
    row_of = entries.rows()
    has = counts > 0
    if block is None:
        width = torch.full((rows,), vocab, dtype=torch.int64)
        dense = torch.ones(rows, dtype=torch.bool)
    else:
        shift = block.bit_length() - 1  # `BLOCKS` are powers of two
        in_block = ids >> shift
        opens = torch.ones(ids.numel(), dtype=torch.bool)  # an entry that starts a (row, block)
        torch.ne(in_block[1:], in_block[:-1], out=opens[1:])
        opens[starts[has]] = True  # a row's first entry (its block may be the row before's last)
        opened = torch.cumsum(opens, 0)
        before = torch.zeros(rows, dtype=torch.int64)  # blocks opened before each row's first entry
        before[has] = opened[starts[has]] - 1
        blocks = torch.zeros(rows, dtype=torch.int64)
        blocks[has] = opened[starts[has] + counts[has] - 1] - before[has]
        width = block * _rounded_up(blocks.clamp(min=1))
        dense = width >= vocab
        width = torch.where(dense, vocab, width)
    order = torch.argsort(width, stable=True)  # rows grouped by width, each group one (n, width) block
    base = torch.zeros(rows, dtype=torch.int64)
    base[order] = torch.cumsum(width[order], 0) - width[order]
    if block is None:
        at = base.index_select(0, row_of) + ids
    else:  # packed: base + (the entry's block rank) * block + its place in the block
        at = (base - (before + 1) * block).index_select(0, row_of) + (opened << shift) + (ids & (block - 1))
        if bool(dense.any()):  # the rows laid out as the vocabulary
            where = ranges(starts[dense], counts[dense])
            at.index_copy_(0, where, base[dense].repeat_interleave(counts[dense]) + ids.index_select(0, where))
    packed = torch.full((int(width.sum()),), float("-inf"))
    packed.index_copy_(0, at, entries.values.float())
    sorted_width = width[order]
    edges = torch.cat([torch.tensor([0]), (sorted_width[1:] != sorted_width[:-1]).nonzero().flatten() + 1,
                       torch.tensor([rows])]).tolist()
    firsts = base[order[edges[:-1]]].tolist()
    for lo, hi, first in zip(edges[:-1], edges[1:], firsts):  # one group of rows of one width, in place
        size = int(sorted_width[lo])
        group = packed[first : first + (hi - lo) * size].view(hi - lo, size)
        torch.log_softmax(group, -1, out=group)
    # each row's sampled token among its entries (ids ascending within a row, rows in order: `row * vocab + id`
    # ascends over the whole step); a row without it gets what the dense row gives at a -inf: -inf, or NaN where
    # the row's max or sum is not finite (a NaN or +inf entry, or no entry at all)
    wanted = torch.arange(rows) * vocab + tokens.to(torch.int64)
    place = torch.searchsorted(row_of * vocab + ids, wanted).clamp(max=max(ids.numel() - 1, 0))
    hit = has & (ids[place] == tokens) & (row_of[place] == torch.arange(rows)) if ids.numel() else has
    result = torch.full((rows,), float("-inf"))
    result[hit] = packed.index_select(0, at[place[hit]])
    if not bool(hit.all()):  # -inf at a -inf of the row, unless its max or sum is not finite
        missed = (~hit).nonzero().flatten()
        where = ranges(starts[missed], counts[missed])
        finite = torch.isfinite(entries.values.index_select(0, where).float())
        unbounded = torch.bincount(row_of.index_select(0, where)[~finite], minlength=rows) > 0
        result[unbounded | ~has] = float("nan")
    return result


def _rounded_up(blocks: torch.Tensor) -> torch.Tensor:
    """Each count (at least 1) rounded up to 4, 5, 6 or 7 times a power of two (or itself below 8): at most
    a quarter more, about four widths per doubling."""
    quarter = torch.pow(2, (torch.floor(torch.log2(blocks.double())).long() - 2).clamp(min=0))
    return (blocks + quarter - 1).div(quarter, rounding_mode="floor") * quarter


@functools.cache
def packing_block() -> int | None:
    """The block `packed_log_softmax` packs rows by: the smallest of `BLOCKS` whose packing gives this process's
    `torch.log_softmax` bit for bit on 512 probe rows, every wider one doing so too; None where 64 does not
    (the kernel sums otherwise than the module docstring says: every row is then computed dense)."""
    generator = torch.Generator().manual_seed(0)
    rows, vocab = 512, 4096
    sizes = torch.randint(16, 400, (rows,), generator=generator)
    keep = torch.rand(rows, vocab, generator=generator).argsort(-1).argsort(-1) < sizes[:, None]
    scores = torch.where(keep, torch.randn(rows, vocab, generator=generator) * 3, float("-inf"))
    tokens = (keep.float() + torch.rand(rows, vocab, generator=generator)).argmax(-1)
    expected = torch.log_softmax(scores, -1).gather(-1, tokens[:, None])[:, 0]
    entries = StepEntries.of(sparse_entries(scores), vocab)
    chosen = None
    for block in BLOCKS:
        if not torch.equal(packed_log_softmax(entries, tokens, block), expected):
            break
        chosen = block
    return chosen
