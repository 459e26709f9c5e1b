"""A call's decoding steps, by mode: one class per way transformers' loop calls the processor list (`on_raw`,
before the first processor; `on_processed`, after the last), appends the token and runs the stopping
criteria (`on_stopping`), and how its end is checked (`verdict`).

- `PlainSteps`: greedy search, sampling, contrastive search: one call of each list per step.
- `DolaSteps`: as plain, with the raw logits from the forward (DoLa hands the processors its contrast).
- `AssistedSteps`: assisted decoding and prompt lookup: the lists also run on the assistant's drafts and
  on candidate positions; only what follows a forward of the recorded model is recorded, one step per
  accepted token.
- `BeamSteps`: beam search and beam sampling: the raw logits from the forward, the tokens and parents one
  step late (from the rows the next step starts from).
- `GroupBeamSteps`: group beam search: the lists run once per group of beams; a step's scores are every
  group's.

The steps own the per-step state (the step number, the rows, which rows finished, the forward's logits,
the per-token statistics pending their tokens, the tokens seen for the end-of-loop check) and read the
call's `CallFacts`. Each tap hands back what to store, as `Put`s, in order; the capture puts them into the
ring. Nothing here waits for the device.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _compat
from ..codecs.stats import STATS_STREAM
from .facts import CallFacts
from .loop_check import StepLog, Verdict, check_beams, check_loop
from .stats import StepStats

# What a step hands the capture to store: (step, stream name, tensor on any device), in the order to put.
Put = tuple[int, str, torch.Tensor]


class Steps:
    """What every mode's steps hold: the step number, the rows, the raw logits a forward handed over, the
    per-token statistics pending their tokens, and what the loop appended, for the end-of-loop check."""

    def __init__(self, facts: CallFacts) -> None:
        self.facts = facts
        self.step = -1  # the step the loop is at (-1 before the first)
        self.num_rows = 0  # the loop's rows (batch x beams or return sequences)
        self._forward_logits: list[torch.Tensor] = []
        # Per-token statistics: each step's full tensors, kept on the device until its tokens are known.
        self.stats = StepStats() if facts.with_stats else None
        # What the loop appended, copied as seen (tiny per-step clones on the device, no host sync), for
        # the end-of-loop check (`loop_check`): the prompt and each step's tokens; in beam search also each
        # step's parents.
        self.seen_prompt: torch.Tensor | None = None
        self.seen_tokens = StepLog()
        self.seen_parents = StepLog()

    @property
    def recorded_model_ran(self) -> bool:
        """Whether the lists now run on the recorded model's logits (not on an assistant's drafts)."""
        return True

    def on_forward(self, logits: torch.Tensor | None) -> None:
        """The model's forward ran, with these next-token `logits` (None where it gave none)."""
        if logits is not None and self.facts.keeps_forward_logits:
            # low_memory beam search (4.38-4.49) runs one forward per sub-batch: joined when taken.
            upcast = _compat.UPCASTS_LOGITS and not self.facts.is_group
            self._forward_logits.append(_compat.forward_raw_logits(logits, upcast=upcast))

    def take_forward_logits(self) -> torch.Tensor:
        parts, self._forward_logits = self._forward_logits, []
        if not parts:
            raise RuntimeError(
                f"transformers-offload saw no model forward before this {self.facts.mode!r} step, so it cannot "
                "record the raw logits; please report this with your transformers version."
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def raw(self, step: int, raw: torch.Tensor) -> list[Put]:
        """Step `step`'s raw logits: stored where recorded, kept for the statistics."""
        if self.stats is not None:
            self.stats.raw(step, raw)
        return [(step, "logits", raw)] if "logits" in self.facts.streams else []

    def processed(self, step: int, scores: torch.Tensor) -> list[Put]:
        """Step `step`'s processed scores: stored where recorded, kept for the statistics."""
        if self.stats is not None:
            self.stats.processed(step, scores)
        return [(step, "scores", scores)] if self.facts.stores_scores else []

    def token_stats(self, step: int, tokens: torch.Tensor, parents: torch.Tensor | None = None) -> list[Put]:
        """Step `step`'s statistics record, once its `tokens` (and beams' `parents`) are known."""
        if self.stats is None or not self.stats.has(step):
            return []
        return [(step, STATS_STREAM, self.stats.record(step, tokens, parents))]

    def clear(self) -> None:
        """Drop what is held on the device (the call ended)."""
        self._forward_logits = []
        if self.stats is not None:
            self.stats.clear()
        self.seen_prompt, self.seen_tokens, self.seen_parents = None, StepLog(), StepLog()


class PlainSteps(Steps):
    """Greedy search, sampling and contrastive search."""

    def __init__(self, facts: CallFacts) -> None:
        super().__init__(facts)
        self.finished: torch.Tensor | None = None  # which rows finished, on the loop's device
        self._tokens_until = 0  # steps [0, _tokens_until) have their token recorded
        self._raw_scores: torch.Tensor | None = None  # this step's raw logits, with `scores_as_logits`
        self._eos = torch.tensor(facts.eos_token_id) if facts.eos_token_id else None  # moved to the loop's device

    def on_raw(self, input_ids: torch.Tensor, scores: torch.Tensor, group: int | None) -> list[Put]:
        # Assisted decoding calls the list once per candidate position; a rejected position is
        # written again later (the last write of a step wins) or has no token and is dropped.
        self.step = step = input_ids.shape[-1] - self.facts.prompt_length
        self.num_rows = input_ids.shape[0]
        if self.finished is None:
            self.finished = torch.zeros(self.num_rows, dtype=torch.bool, device=input_ids.device)
        puts = self.raw(step, self.raw_logits(scores)) if self.facts.records_raw else []
        if self.facts.scores_as_logits:
            self._raw_scores = scores
        puts.append((step, "finished", self.finished))
        return puts

    def raw_logits(self, scores: torch.Tensor) -> torch.Tensor:
        """The step's raw logits, given what the first processor receives."""
        return scores

    def on_processed(self, input_ids: torch.Tensor, scores: torch.Tensor, group: int | None) -> list[Put]:
        # 4.36-4.44 assisted decoding runs the warpers after all positions went through the processors.
        step = input_ids.shape[-1] - self.facts.prompt_length
        if self.facts.scores_as_logits:
            raw, self._raw_scores = self._raw_scores, None
            if raw is not scores:
                raise RuntimeError(
                    "transformers-offload stored this call's scores as its logits (no processor ran), but the "
                    f"decoding loop's processed scores at step {step} are another tensor; please report this with "
                    "your transformers version (record with `encodings={'scores': 'dense'}` meanwhile)."
                )
        return self.processed(step, scores)

    def on_stopping(self, input_ids: torch.Tensor, is_done: Any) -> list[Put]:
        return [] if self.finished is None else self.tokens(input_ids, is_done)

    def tokens(self, input_ids: torch.Tensor, is_done: Any) -> list[Put]:
        """The tokens appended since the last call (assisted decoding accepts several at once), given
        the criteria's verdict `is_done` (None when a criterion raised); notes which rows finished."""
        token = input_ids[:, -1]
        if self._eos is not None and not isinstance(is_done, torch.Tensor) and self._eos.device != token.device:
            # Up to 4.38 EOS is checked here (`rows_done`). Once, and from pinned memory: a plain copy
            # from the host would wait for the device.
            eos = self._eos.pin_memory() if token.is_cuda else self._eos
            self._eos = eos.to(token.device, non_blocking=True)
        prompt_length = self.facts.prompt_length
        if self.seen_prompt is None:
            self.seen_prompt = input_ids[:, :prompt_length].clone()
        last = input_ids.shape[-1] - prompt_length
        puts: list[Put] = []
        for step in range(self._tokens_until, last):
            chosen = token if step == last - 1 else input_ids[:, prompt_length + step]
            self.seen_tokens.append(chosen)
            puts.append((step, "tokens", chosen))
            puts += self.token_stats(step, chosen)
        self._tokens_until = last
        if is_done is not None:
            self.finished = self.finished | _compat.rows_done(is_done, token, self._eos)
        return puts

    def at_end(self, steps: int) -> list[Put]:
        """What the step after the last adds (nothing outside beam search)."""
        return []

    def at_loop_end(self, output: Any) -> list[Put]:
        """Before 4.30, the loop ends without calling its stopping criteria at the step where every row
        finished (`_compat.SKIPS_STOPPING_ONCE_ALL_FINISHED`): that step's tokens are the returned
        sequences' last column."""
        sequences = _compat.output_sequences(output)
        if (self.finished is not None and self._tokens_until == self.step and isinstance(sequences, torch.Tensor)
                and sequences.shape[-1] == self.facts.prompt_length + self.step + 1):
            return self.tokens(sequences, None)
        return []

    def verdict(self, complete_steps: int, sequences: torch.Tensor | None) -> Verdict:
        """The end-of-loop check of what was recorded against what the loop returned (`loop_check`)."""
        seen = self.seen_prompt
        if seen is not None and len(self.seen_tokens):
            seen = torch.cat([seen, self.seen_tokens.values()], dim=1)
        return check_loop(complete_steps=complete_steps, sequences=sequences, seen_ids=seen,
                          prompt_length=self.facts.prompt_length)

    def clear(self) -> None:
        super().clear()
        self.finished = self._raw_scores = None


class DolaSteps(PlainSteps):
    """DoLa (up to 4.56): the processors get a contrast of layers; `out.logits` is the final layer's."""

    def raw_logits(self, scores: torch.Tensor) -> torch.Tensor:
        return self.take_forward_logits()


class AssistedSteps(PlainSteps):
    """Assisted decoding and prompt lookup: only what follows a forward of the recorded model is recorded."""

    def __init__(self, facts: CallFacts) -> None:
        super().__init__(facts)
        self._target_forward = False  # the recorded model ran since the last check

    @property
    def recorded_model_ran(self) -> bool:
        return self._target_forward

    def on_forward(self, logits: torch.Tensor | None) -> None:
        self._target_forward = True  # the forwards hooked are the recorded model's (not the assistant's)
        super().on_forward(logits)

    def on_raw(self, input_ids: torch.Tensor, scores: torch.Tensor, group: int | None) -> list[Put]:
        if not self._target_forward:  # an assistant's draft, or prompt lookup probing its candidates
            return []
        return super().on_raw(input_ids, scores, group)

    def on_processed(self, input_ids: torch.Tensor, scores: torch.Tensor, group: int | None) -> list[Put]:
        return super().on_processed(input_ids, scores, group) if self._target_forward else []

    def on_stopping(self, input_ids: torch.Tensor, is_done: Any) -> list[Put]:
        if self.finished is None or not self._target_forward:
            return []  # 4.40+ also check the unverified candidates, before the recorded model runs
        self._target_forward = False
        return self.tokens(input_ids, is_done)


class BeamSteps(Steps):
    """Beam search and beam sampling: running beams never finish (finished hypotheses leave them)."""

    check_paths = True  # each returned sequence is traced down the recorded ancestry

    def __init__(self, facts: CallFacts) -> None:
        super().__init__(facts)
        self.previous_ids: torch.Tensor | None = None  # the rows the last step started from
        self._none_finished: torch.Tensor | None = None  # `finished` of running beams: known on the host

    def on_raw(self, input_ids: torch.Tensor, scores: torch.Tensor, group: int | None) -> list[Put]:
        self.step += 1
        # The previous step's token first: this step's first put may wait for a slot.
        puts = self.ancestry(self.step, input_ids)
        if self.facts.records_raw:
            puts += self.raw(self.step, self.take_forward_logits())
        puts.append(self.running_finished(self.step, input_ids.shape[0]))
        return puts

    def running_finished(self, step: int, rows: int) -> Put:
        if self._none_finished is None:
            self._none_finished = torch.zeros(rows, dtype=torch.bool)
        return (step, "finished", self._none_finished)

    def ancestry(self, step: int, input_ids: torch.Tensor) -> list[Put]:
        """At step `step`, which row of the previous step each row extends: the previous step's parents
        and tokens (stored under `step - 1`)."""
        rows = input_ids.shape[0]
        self.num_rows = rows
        previous, self.previous_ids = self.previous_ids, input_ids
        prompt_length, num_beams = self.facts.prompt_length, self.facts.num_beams
        if self.seen_prompt is None:
            self.seen_prompt = (input_ids if previous is None else previous)[:, :prompt_length].clone()
        if previous is None:
            return []
        # Row r of this step extends the row of the previous step that holds the same sequence. Only
        # beams of one prompt are compared, and only the generated part (the prompt is shared).
        batch = rows // num_beams
        new = input_ids[:, prompt_length:-1].reshape(batch, num_beams, 1, -1)
        old = previous[:, prompt_length:].reshape(batch, 1, num_beams, -1)
        same = (new == old).all(dim=-1)  # (batch, new beam, old beam)
        first = same.to(torch.int8).argmax(dim=-1)  # first matching old beam
        offset = torch.arange(batch, device=input_ids.device).unsqueeze(1) * num_beams
        parents = (first + offset).reshape(rows)
        tokens = input_ids[:, -1]
        if self.check_paths:
            self.seen_tokens.append(tokens)
            self.seen_parents.append(parents)
        return [(step - 1, "beam_parents", parents), (step - 1, "tokens", tokens),
                *self.token_stats(step - 1, tokens, parents)]

    def on_processed(self, input_ids: torch.Tensor, scores: torch.Tensor, group: int | None) -> list[Put]:
        return self.processed(self.step, scores)

    def on_stopping(self, input_ids: torch.Tensor, is_done: Any) -> list[Put]:
        """Beam search passes candidate rows to the criteria, not running beams: nothing to record."""
        return []

    def at_loop_end(self, output: Any) -> list[Put]:
        """Nothing: beam search's last tokens come from `at_end`."""
        return []

    def at_end(self, steps: int) -> list[Put]:
        """After the last step no running beam continues."""
        if steps <= 0:
            return []
        last = torch.full((self.num_rows,), -1, dtype=torch.long)
        return [(steps - 1, "beam_parents", last), (steps - 1, "tokens", last), *self.token_stats(steps - 1, last, last)]

    def verdict(self, complete_steps: int, sequences: torch.Tensor | None) -> Verdict:
        facts = self.facts
        fill_ids = tuple(i for i in (facts.pad_token_id, *facts.eos_token_id) if isinstance(i, int))
        return check_beams(
            complete_steps=complete_steps, sequences=sequences, prompt=self.seen_prompt,
            tokens=self.seen_tokens.steps(), parents=self.seen_parents.steps(), check_paths=self.check_paths,
            num_beams=facts.num_beams, fill_ids=fill_ids,
        )

    def clear(self) -> None:
        super().clear()
        self.previous_ids = None


class GroupBeamSteps(BeamSteps):
    """Group beam search (up to 4.56): each list runs once per group, with that group's rows only."""

    # It reorders its rows group by group: its returned sequences are checked by their length only.
    check_paths = False

    def __init__(self, facts: CallFacts) -> None:
        super().__init__(facts)
        self.group_scores: torch.Tensor | None = None  # out.scores of the step: every group's, as they come

    def on_raw(self, input_ids: torch.Tensor, scores: torch.Tensor, group: int | None) -> list[Put]:
        if group:  # not the first group of a step
            return []
        self.step += 1
        raw = self.take_forward_logits()
        self.num_rows = raw.shape[0]
        puts = self.raw(self.step, raw)
        self.group_scores = torch.zeros_like(raw)  # in the model's dtype, as out.scores
        puts.append(self.running_finished(self.step, self.num_rows))
        return puts

    def on_processed(self, input_ids: torch.Tensor, scores: torch.Tensor, group: int | None) -> list[Put]:
        num_beams = self.facts.num_beams
        size = num_beams // self.facts.num_beam_groups
        start = (group or 0) * size
        end = min(start + size, num_beams)
        beams = self.group_scores.view(-1, num_beams, self.group_scores.shape[-1])
        beams[:, start:end] = scores.view(beams.shape[0], end - start, -1)
        return self.processed(self.step, self.group_scores) if end == num_beams else []

    def on_stopping(self, input_ids: torch.Tensor, is_done: Any) -> list[Put]:
        # Every row, after every group appended its tokens: the rows the next step starts from.
        if self.previous_ids is None:
            self.previous_ids = input_ids[:, :-1]  # the prompt, the same in every beam
        # A copy: the next step reorders these rows in place, group by group.
        return self.ancestry(self.step + 1, input_ids.clone())

    def clear(self) -> None:
        super().clear()
        self.group_scores = None


def steps_for(facts: CallFacts) -> Steps:
    """The step handling of the call's decoding mode (transformers' `GenerationMode` value)."""
    if facts.mode == _compat.GROUP_BEAM_MODE:
        return GroupBeamSteps(facts)
    if facts.is_beam:
        return BeamSteps(facts)
    if facts.mode == _compat.ASSISTED_MODE:
        return AssistedSteps(facts)
    if facts.mode == _compat.DOLA_MODE:
        return DolaSteps(facts)
    return PlainSteps(facts)
