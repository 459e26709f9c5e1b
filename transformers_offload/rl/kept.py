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
from typing import Any

import torch

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
            TypeError: `rows` not integers in one dimension (a boolean mask, floats).
            ValueError: a row outside `0 .. rows - 1`, or a negative `steps`.
        """
        given = torch.as_tensor(rows)
        if given.dim() > 1 or given.dtype.is_floating_point or given.dtype in (torch.bool, torch.complex64, torch.complex128):
            raise TypeError(f"`rows` must be a sequence of row indices (ints, one dimension), got {given.dtype} of "
                            f"shape {tuple(given.shape)}" + (": for a mask, pass `mask.nonzero()[:, 0]`." if
                                                           given.dtype == torch.bool else "."))
        chosen = given.to(torch.long).cpu().reshape(-1)
        if chosen.numel() and (int(chosen.min()) < 0 or int(chosen.max()) >= self.rows):
            raise ValueError(f"`rows` must lie in 0 .. {self.rows - 1}, got {chosen.tolist()}.")
        steps = self.steps if steps is None else int(steps)
        if steps < 0:
            raise ValueError(f"`steps` must be at least 0, got {steps}.")
        host = self.to("cpu")
        keep = min(steps, self.steps)
        counts = (host.offsets[1:] - host.offsets[:-1]).view(self.rows, self.steps)
        starts = host.offsets[:-1].view(self.rows, self.steps)
        new_counts = torch.zeros((chosen.numel(), steps), dtype=torch.long)
        new_counts[:, :keep] = counts[chosen, :keep]
        new_starts = torch.zeros((chosen.numel(), steps), dtype=torch.long)
        new_starts[:, :keep] = starts[chosen, :keep]
        flat_counts = new_counts.reshape(-1)
        offsets = torch.zeros(flat_counts.numel() + 1, dtype=torch.long)
        offsets[1:] = flat_counts.cumsum(0)
        within = torch.arange(int(offsets[-1])) - offsets[:-1].repeat_interleave(flat_counts)
        ids = host.ids[new_starts.reshape(-1).repeat_interleave(flat_counts) + within]

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
    tokens, valid, full, greedy, temperature, owners, counts, ids = [], [], [], [], [], [], [], []
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
        per_step_ids: list[list[torch.Tensor]] = [[] for _ in range(rows)]
        if t_count:
            step_tokens[:, :t_count] = torch.stack(generation.tokens(), 1)
            step_valid[:, :t_count] = ~torch.stack(generation.finished(), 1)
            raw = generation.logits() if _raw_exact(generation) and not mask_only else None
            for t, kept in enumerate(_finite_sets(generation, encoding)):
                vocab = kept["vocab"] if vocab is None else vocab
                if vocab != kept["vocab"]:
                    raise ValueError(f"generation {generation.index} has {kept['vocab']} entries per row, an earlier "
                                     f"one {vocab}: kept sets span one vocabulary.")
                if raw is not None:
                    _check_temperature_only(generation, t, raw[t], kept, temp)
                step_full[:, t] = kept["full"]
                for r in range(rows):
                    if not kept["full"][r]:
                        per_step_ids[r].append(kept["ids"][r])
                        step_counts[r, t] = kept["ids"][r].numel()
                    else:
                        per_step_ids[r].append(torch.zeros(0, dtype=torch.int32))
        step_counts.masked_fill_(~step_valid, 0)
        for r in range(rows):
            valid_r = step_valid[r, :t_count].tolist()
            for t, values in enumerate(per_step_ids[r]):
                if valid_r[t]:
                    ids.append(values)
        tokens.append(step_tokens)
        valid.append(step_valid)
        full.append(step_full & step_valid)
        greedy.append(torch.full((rows, steps), not sampled, dtype=torch.bool))
        temperature.append(torch.full((rows,), temp, dtype=torch.float32))
        owners.extend([number] * rows)
        counts.append(step_counts)
    every_count = torch.cat(counts).flatten()
    offsets = torch.zeros(every_count.numel() + 1, dtype=torch.long)
    offsets[1:] = every_count.cumsum(0)
    flat_ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int32)
    return KeptSets(offsets=offsets, ids=flat_ids.to(torch.int32), tokens=torch.cat(tokens), valid=torch.cat(valid),
                    full=torch.cat(full), greedy=torch.cat(greedy), temperature=torch.cat(temperature),
                    vocab_size=int(vocab or 0), generations=tuple(generations[i].index for i in owners),
                    any_full=bool(torch.cat(full).any()))


def _finite_sets(generation: Any, encoding: str):
    """Per step: `{"vocab", "full" (rows,) bool, "ids": per row int32 ascending}`."""
    if is_topk(encoding):
        for record in generation.topk("scores"):
            if bool((record["mass_outside"] > 0).any()):
                raise ValueError(f"generation {generation.index}'s scores are recorded `{encoding}` and some row's "
                                 "kept set is larger than K (probability mass outside the K): record them dense, "
                                 "`sparse`, or with a larger K.")
            finite = torch.isfinite(record["values"])
            ids, values = [], []
            for r in range(finite.shape[0]):
                kept_ids, order = record["indices"][r][finite[r]].sort()
                ids.append(kept_ids.to(torch.int32))
                values.append(record["values"][r][finite[r]][order])
            yield {"vocab": _topk_vocab(generation), "full": torch.zeros(finite.shape[0], dtype=torch.bool),
                   "ids": ids, "values": values}
        return
    for scores in generation.scores():
        finite = torch.isfinite(scores)
        ids = [finite[r].nonzero().flatten() for r in range(scores.shape[0])]
        yield {"vocab": int(scores.shape[-1]), "full": finite.all(-1), "ids": [i.to(torch.int32) for i in ids],
               "values": [scores[r][i] for r, i in enumerate(ids)]}


def _raw_exact(generation: Any) -> bool:
    """Whether the generation's raw logits are recorded, every entry exactly."""
    return "logits" in generation.streams and generation.encodings.get("logits", "dense") in ("dense", "sparse", "native")


def _topk_vocab(generation: Any) -> int:
    """A top-k record's vocabulary: the raw logits' width where recorded, else the model config's."""
    if _raw_exact(generation):
        return int(generation.logits(steps=slice(0, 1))[0].shape[-1])
    return int(generation.generation_config.get("vocab_size") or 0)


def _refuse_value_changes(generation: Any) -> None:
    config = generation.generation_config
    found = [name for name, neutral in VALUE_CHANGING.items()
             if config.get(name) is not None and config.get(name) != neutral]
    if found:
        raise ValueError(f"generation {generation.index} was generated with {', '.join(found)}, which change the "
                         "scores' finite values, not only which are kept: a replay over the kept sets would not be "
                         "the sampler's distribution. Pass `mask_only=True` to take the sets anyway.")


def _check_temperature_only(generation: Any, t: int, raw: torch.Tensor, kept: dict, temperature: float) -> None:
    """Refuse a step whose kept entries are not the raw logits over `temperature`, bit for bit."""
    expected = raw.float() / temperature if temperature != 1.0 else raw.float()
    same = all(torch.equal(values, expected[r][ids.long()]) for r, (ids, values) in enumerate(zip(kept["ids"], kept["values"])))
    if not same:
        raise ValueError(f"generation {generation.index}, step {t}: the kept scores are not the raw logits / "
                         f"{temperature} (a processor changed finite values: a logits processor passed to "
                         "generate(), or one the config does not name). Pass `mask_only=True` to take the sets "
                         "anyway.")
