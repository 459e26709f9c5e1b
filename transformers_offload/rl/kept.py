"""`kept_sets(recording)`: per row and step, the token ids the processors left finite, the support of the
distribution each token was drawn from, in a compact sparse layout (CSR) a trainer can ship with its batch.

For step `t` of row `r` with processed scores `s = out.scores[t][r]` (the recording's `scores`), the kept set
is `torch.isfinite(s).nonzero()`: under top-p, top-k, min-p and the other filters, the ids that survived.
A step whose scores mask nothing keeps the whole vocabulary and is flagged `full` (no ids stored).

What replaying over the set means (`replay_logprobs`) assumes the processors changed nothing but the mask
and the temperature: `s = x / T` on the set, `x` the raw logits. `kept_sets` checks it where the raw logits
are recorded (`torch.equal` on every kept entry of every step) and refuses the processors the generation
config names that change finite values (repetition penalty, sequence bias, length penalty on EOS,
classifier-free guidance, watermarking), unless `mask_only=True` (then the sets are still exact; what a
replay over them computes is `logits / T` renormalised there, not the sampler's values).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch

from ..codecs.sparse import ranges
from .entries import StepEntries, raw_exact, step_entries
from .layout import check_scores_exact, generations_of, is_topk, temperature_of

# Generation settings whose processors change finite scores beyond `x / T` (the values a replay needs).
VALUE_CHANGING = {
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "sequence_bias": None,
    "exponential_decay_length_penalty": None, "guidance_scale": None, "watermarking_config": None,
}


@dataclasses.dataclass(frozen=True)
class KeptSets:
    """Each token's kept set over a `(rows, steps)` layout, as CSR (`kept_sets` builds it).

    Attributes:
        offsets (`torch.LongTensor` of shape `(rows * steps + 1,)`): position `p = r * steps + t`'s ids are
            `ids[offsets[p]:offsets[p + 1]]` (none where `full`, or not `valid`).
        ids (`torch.IntTensor` of shape `(nnz,)`): the kept token ids, ascending within a position.
        tokens (`torch.LongTensor` of shape `(rows, steps)`): the token sampled at each position (the
            recording's `tokens()`; the pad token after a row finished).
        valid (`torch.BoolTensor` of shape `(rows, steps)`): a token the row sampled: False after it
            finished (its later steps are padding) and beyond its generation's steps.
        full (`torch.BoolTensor` of shape `(rows, steps)`): the step masked nothing (the whole vocabulary kept).
        greedy (`torch.BoolTensor` of shape `(rows, steps)`): the row's generation did not sample (greedy).
        temperature (`torch.FloatTensor` of shape `(rows,)`): each row's sampling temperature (1.0 greedy).
        vocab_size (`int`): the scores' width.
        generations (`tuple[int, ...]`): each row's generation (its index in the source).
        any_full (`bool`): some valid step kept the whole vocabulary (known on the host, so that a replay
            computes those steps' sums only where there are some, without asking the device).
    All tensors on one device (CPU as built; `.to(device)`).
    """

    offsets: torch.Tensor
    ids: torch.Tensor
    tokens: torch.Tensor
    valid: torch.Tensor
    full: torch.Tensor
    greedy: torch.Tensor
    temperature: torch.Tensor
    vocab_size: int
    generations: tuple[int, ...]
    any_full: bool = False

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def steps(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def device(self) -> torch.device:
        return self.ids.device

    def to(self, device: Any, non_blocking: bool = False) -> KeptSets:
        """The same sets on `device` (every tensor moved, dtypes kept).

        Raises:
            TypeError: `device` is not a device (a dtype, say: the ids and offsets stay integers)."""
        if isinstance(device, torch.dtype) or not isinstance(device, (str, int, torch.device)):
            raise TypeError(f"`KeptSets.to` takes a device (\"cuda\", torch.device(...)), got {device!r}.")
        device = torch.device(device)
        moved = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device, non_blocking=non_blocking)
        return KeptSets(**moved)

    def ids_at(self, row: int, step: int) -> torch.Tensor | None:
        """The kept ids of one position (int32, ascending); None where the whole vocabulary was kept.

        Raises:
            IndexError: `row` or `step` outside `0 .. rows - 1`, `0 .. steps - 1`."""
        if not (0 <= row < self.rows and 0 <= step < self.steps):
            raise IndexError(f"position ({row}, {step}) is outside the sets' {self.rows} rows x {self.steps} steps.")
        if bool(self.full[row, step]):
            return None
        p = row * self.steps + step
        return self.ids[int(self.offsets[p]) : int(self.offsets[p + 1])]

    def positions(self) -> torch.Tensor:
        """`(nnz,)` int64 on the sets' device: each id's position `p = row * steps + step`, from `offsets`
        without reading them on the host (the output size is `ids`' length)."""
        counts = self.offsets[1:] - self.offsets[:-1]
        return torch.repeat_interleave(torch.arange(counts.numel(), device=self.device), counts,
                                       output_size=self.ids.numel())

    def select(self, rows: Any, steps: int | None = None) -> KeptSets:
        """The sets of `rows` (in that order), over `steps` steps (the first `steps`; positions beyond this
        layout's steps are added, not valid), on this layout's device. Built on the host: for a trainer's
        micro-batch, once per batch, not inside a decoding step.

        Args:
            rows (sequence of `int` or `torch.LongTensor` of shape `(n,)`): rows of this layout.
            steps (`int`, *optional*): default: this layout's steps.

        Raises:
            TypeError: `rows` not integers in one dimension (a boolean mask, floats, a lone int), or `steps` not an int.
            ValueError: a row outside `0 .. rows - 1`, or a negative `steps`.
        """
        if rows is None or isinstance(rows, (str, bytes)):
            raise TypeError(f"`rows` must be a sequence of row indices (ints, one dimension), got {rows!r}.")
        if steps is not None and (isinstance(steps, bool) or not hasattr(type(steps), "__index__")):
            raise TypeError(f"`steps` must be an int (or None: every step), got {steps!r}.")
        given = torch.as_tensor(rows)
        if given.numel() == 0 and given.dim() == 1:  # `[]`: no row (torch makes it float32)
            given = given.long()
        if given.dim() != 1 or given.dtype.is_floating_point or given.dtype in (torch.bool, torch.complex64, torch.complex128):
            raise TypeError(f"`rows` must be a sequence of row indices (ints, one dimension), got {given.dtype} of "
                            f"shape {tuple(given.shape)}" + (": for a mask, pass `mask.nonzero()[:, 0]`." if
                                                           given.dtype == torch.bool else "."))
        chosen = given.to(torch.long).cpu().reshape(-1)
        if chosen.numel() and (int(chosen.min()) < 0 or int(chosen.max()) >= self.rows):
            raise ValueError(f"`rows` must lie in 0 .. {self.rows - 1}, got {chosen.tolist()}.")
        steps = self.steps if steps is None else operator.index(steps)
        if steps < 0:
            raise ValueError(f"`steps` must be at least 0, got {steps}.")
        host = self.to("cpu")
        keep = min(steps, self.steps)
        counts = (host.offsets[1:] - host.offsets[:-1]).view(self.rows, self.steps)
        new_counts = torch.zeros((chosen.numel(), steps), dtype=torch.long)
        new_counts[:, :keep] = counts[chosen, :keep]
        offsets = torch.zeros(new_counts.numel() + 1, dtype=torch.long)
        offsets[1:] = new_counts.reshape(-1).cumsum(0)
        # a row's ids over its first `keep` steps lie together: one range per chosen row
        first = host.offsets[chosen * self.steps]
        ids = host.ids.index_select(0, ranges(first, host.offsets[chosen * self.steps + keep] - first))

        def widened(values: torch.Tensor, fill: Any) -> torch.Tensor:
            out = torch.full((chosen.numel(), steps), fill, dtype=values.dtype)
            out[:, :keep] = values[chosen, :keep]
            return out

        full = widened(host.full, False)
        selected = KeptSets(offsets=offsets, ids=ids, tokens=widened(host.tokens, -1), valid=widened(host.valid, False),
                            full=full, greedy=widened(host.greedy, False), temperature=host.temperature[chosen],
                            vocab_size=self.vocab_size, generations=tuple(self.generations[i] for i in chosen.tolist()),
                            any_full=bool(full.any()))
        return selected.to(self.device)

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor (what shipping the sets with a batch costs)."""
        return sum(value.numel() * value.element_size() for value in dataclasses.asdict(self).values()
                   if isinstance(value, torch.Tensor))

    def bytes_per_token(self) -> float:
        """`nbytes` over the valid tokens."""
        return self.nbytes / max(1, int(self.valid.sum()))


def kept_sets(source: Any, *, mask_only: bool = False) -> KeptSets:
    """Each sampled token's kept set (the ids its processors left finite) from a recording.

    Args:
        source: a `Generation`, or a `Recording` / `Recorder` (every generation's rows one after another, their
            steps padded to the longest: continuous batching's requests are a row each), recorded with
            `"scores"` in `streams` (dense, `sparse`, `native`, or `topk:K` with K at least every set).
        mask_only (`bool`, *optional*, defaults to False): accept processors that change finite values
            (repetition penalty...): the sets are exact, a replay over them is not the sampler's values.

    Returns:
        `KeptSets` on CPU (`.to(device)`).

    Raises:
        ValueError: scores not recorded or recorded lossily (`topk:K:qB`, `sample:N@T`); a `topk:K` record with
            mass outside its K (a set larger than K); a beam search; a processor that changes finite values
            (named), or recorded raw logits whose kept entries are not `logits / T` bit for bit, without
            `mask_only`.
        TypeError: `source` is not a generation, recording or recorder.

    Example:
        >>> kept = kept_sets(rec)  # doctest: +SKIP
        >>> kept.ids_at(0, 3)  # doctest: +SKIP
        tensor([  13,  284, 1135], dtype=torch.int32)
    """
    generations = generations_of(source)
    steps = max(generation.num_steps for generation in generations)
    tokens, valid, full, greedy, temperature, owners, counts, found = [], [], [], [], [], [], [], []
    vocab = None
    for number, generation in enumerate(generations):
        encoding = check_scores_exact(generation)
        if not mask_only:
            _refuse_value_changes(generation)
        sampled = bool(generation.generation_config.get("do_sample"))
        rows, t_count, temp = generation.num_rows, generation.num_steps, temperature_of(generation)
        step_tokens = torch.full((rows, steps), -1, dtype=torch.long)
        step_valid = torch.zeros((rows, steps), dtype=torch.bool)
        step_full = torch.zeros((rows, steps), dtype=torch.bool)
        step_counts = torch.zeros((rows, steps), dtype=torch.long)
        step_ids: list[torch.Tensor] = []  # per step, its kept ids of every valid row that is not full, in row order
        if t_count:
            step_tokens[:, :t_count] = torch.stack(generation.tokens(), 1)
            step_valid[:, :t_count] = ~torch.stack(generation.finished(), 1)
        check_raw = raw_exact(generation) and not mask_only
        for t, entries in enumerate(step_entries(generation, encoding)):
            vocab = entries.vocab if vocab is None else vocab
            if vocab != entries.vocab:
                raise ValueError(f"generation {generation.index} has {entries.vocab} entries per row, an earlier "
                                 f"one {vocab}: kept sets span one vocabulary.")
            finite = torch.isfinite(entries.values)
            finite = None if bool(finite.all()) else finite
            rows_of = entries.rows() if finite is not None or check_raw else None
            if check_raw:
                _check_temperature_only(generation, t, entries, rows_of, finite, temp)
            finite_counts = entries.counts if finite is None else torch.bincount(rows_of[finite], minlength=rows)
            if not is_topk(encoding):  # a top-k record never says the whole vocabulary was kept
                step_full[:, t] = finite_counts == entries.vocab
            take = step_valid[:, t] & ~step_full[:, t]
            if finite is not None:  # a NaN or +inf score: not kept
                keep = finite & take[rows_of]
                step_counts[:, t] = torch.bincount(rows_of[keep], minlength=rows)
                step_ids.append(entries.ids[keep].to(torch.int32))
            elif bool(take.all()):
                step_counts[:, t] = entries.counts
                step_ids.append(entries.ids.to(torch.int32))
            else:  # the rows finished or full: their entries left out, row by row
                step_counts[:, t] = torch.where(take, entries.counts, 0)
                step_ids.append(entries.ids.index_select(0, ranges(entries.starts(), step_counts[:, t])).to(torch.int32))
        tokens.append(step_tokens)
        valid.append(step_valid)
        full.append(step_full & step_valid)
        greedy.append(torch.full((rows, steps), not sampled, dtype=torch.bool))
        temperature.append(torch.full((rows,), temp, dtype=torch.float32))
        owners.extend([number] * rows)
        counts.append(step_counts)
        found.append(step_ids)
    every_count = torch.cat(counts)
    offsets = torch.zeros(every_count.numel() + 1, dtype=torch.long)
    offsets[1:] = every_count.flatten().cumsum(0)
    # each step's ids into their rows' places (row-major positions `r * steps + t`), a step at a time
    flat_ids = torch.empty(int(offsets[-1]), dtype=torch.int32)
    base = 0
    for step_counts, step_ids in zip(counts, found):
        rows = step_counts.shape[0]
        for t, ids in enumerate(step_ids):
            starts = offsets[(base + torch.arange(rows)) * steps + t]
            flat_ids.index_copy_(0, ranges(starts, step_counts[:, t]), ids)
        base += rows
    every_full = torch.cat(full)
    return KeptSets(offsets=offsets, ids=flat_ids, tokens=torch.cat(tokens), valid=torch.cat(valid),
                    full=every_full, greedy=torch.cat(greedy), temperature=torch.cat(temperature),
                    vocab_size=int(vocab or 0), generations=tuple(generations[i].index for i in owners),
                    any_full=bool(every_full.any()))


def _refuse_value_changes(generation: Any) -> None:
    config = generation.generation_config
    found = [name for name, neutral in VALUE_CHANGING.items()
             if config.get(name) is not None and config.get(name) != neutral]
    if found:
        raise ValueError(f"generation {generation.index} was generated with {', '.join(found)}, which change the "
                         "scores' finite values, not only which are kept: a replay over the kept sets would not be "
                         "the sampler's distribution. Pass `mask_only=True` to take the sets anyway.")


def _check_temperature_only(generation: Any, t: int, entries: StepEntries, rows: torch.Tensor,
                            finite: torch.Tensor | None, temperature: float) -> None:
    """Refuse a step whose finite entries (`finite`: None where every entry is) are not the raw logits over
    `temperature`, bit for bit; `rows` is each entry's row."""
    raw = generation.logits(steps=slice(t, t + 1))[0]
    expected = raw.float() / temperature if temperature != 1.0 else raw.float()
    values, ids = (entries.values, entries.ids) if finite is None else (entries.values[finite], entries.ids[finite])
    if not torch.equal(values, expected[rows if finite is None else rows[finite], ids]):
        raise ValueError(f"generation {generation.index}, step {t}: the kept scores are not the raw logits / "
                         f"{temperature} (a processor changed finite values: a logits processor passed to "
                         "generate(), or one the config does not name). Pass `mask_only=True` to take the sets "
                         "anyway.")
