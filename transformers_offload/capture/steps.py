"""What each decoding mode's step hands the capture, by mode: one class per way transformers' loop calls the
processor list (`on_raw`, before the first processor; `on_processed`, after the last), appends the token
and runs the stopping criteria (`on_stopping`), and how its end is checked (`verdict`).

- `PlainSteps`: greedy search, sampling, contrastive search: one call of each list per step.
- `DolaSteps`: as plain, with the raw logits from the forward (DoLa hands the processors its contrast).
- `AssistedSteps`: assisted decoding and prompt lookup: the lists also run on the assistant's drafts and
  on candidate positions; only what follows a forward of the recorded model is recorded, one step per
  accepted token.
- `BeamSteps`: beam search and beam sampling: the raw logits from the forward, the tokens and parents one
  step late (from the rows the next step starts from).
- `GroupBeamSteps`: group beam search: the lists run once per group of beams; a step's scores are every
  group's.

They read and write the `Capture`'s state; nothing here waits for the device.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _compat
from ..codecs.stats import STATS_STREAM
from ..store.layout import BEAM_MODES
from .loop_check import Verdict, check_beams, check_loop

# The `Capture` the steps belong to (`capture.capture`, which imports this module: typed as `Any` here).
Capture = Any


class PlainSteps:
    """Greedy search, sampling and contrastive search."""

    def __init__(self, capture: Capture) -> None:
        self.capture = capture

    def on_raw(self, input_ids: torch.Tensor, scores: torch.Tensor, group: int | None) -> None:
        c = self.capture
        # Assisted decoding calls the list once per candidate position; a rejected position is
        # written again later (the last write of a step wins) or has no token and is dropped.
        c.step = input_ids.shape[-1] - c.prompt_length
        c.num_rows = input_ids.shape[0]
        if c.finished is None:
            c.finished = torch.zeros(c.num_rows, dtype=torch.bool, device=input_ids.device)
        if c.records_raw:
            raw = self.raw_logits(scores)
            if "logits" in c.streams:
                c.put_full(c.step, "logits", raw)
            if c.stats is not None:
                c.stats.raw(c.step, raw)
        if c.scores_as_logits:
            c.raw_scores = scores
        c.ring.put(c.step, "finished", c.finished)

    def raw_logits(self, scores: torch.Tensor) -> torch.Tensor:
        """The step's raw logits, given what the first processor receives."""
        return scores

    def on_processed(self, input_ids: torch.Tensor, scores: torch.Tensor, group: int | None) -> None:
        # 4.36-4.44 assisted decoding runs the warpers after all positions went through the processors.
        self.capture.put_processed(input_ids.shape[-1] - self.capture.prompt_length, scores)

    def on_stopping(self, input_ids: torch.Tensor, is_done: Any) -> None:
        if self.capture.finished is not None:
            self.capture.record_tokens(input_ids, is_done)

    def at_end(self, steps: int) -> None:
        """What the step after the last adds (nothing outside beam search)."""

    def at_loop_end(self, output: Any) -> None:
        """Before 4.30, the loop ends without calling its stopping criteria at the step where every row
        finished (`_compat.SKIPS_STOPPING_ONCE_ALL_FINISHED`): that step's tokens are the returned
        sequences' last column."""
        c = self.capture
        sequences = _compat.output_sequences(output)
        if (c.finished is not None and c._tokens_until == c.step and isinstance(sequences, torch.Tensor)
                and sequences.shape[-1] == c.prompt_length + c.step + 1):
            c.record_tokens(sequences, None)

    def verdict(self, complete_steps: int, sequences: torch.Tensor | None) -> Verdict:
        """The end-of-loop check of what was recorded against what the loop returned (`loop_check`)."""
        c = self.capture
        seen = None
        if c.seen_prompt is not None:
            seen = c.seen_prompt
            if len(c.seen_tokens):
                seen = torch.cat([seen, c.seen_tokens.values()], dim=1)
        return check_loop(complete_steps=complete_steps, sequences=sequences, seen_ids=seen,
                          prompt_length=c.prompt_length)


class DolaSteps(PlainSteps):
    """DoLa (up to 4.56): the processors get a contrast of layers; `out.logits` is the final layer's."""

    def raw_logits(self, scores: torch.Tensor) -> torch.Tensor:
        return self.capture.take_forward_logits()


class AssistedSteps(PlainSteps):
    """Assisted decoding and prompt lookup: only what follows a forward of the recorded model is recorded."""

    def on_raw(self, input_ids: torch.Tensor, scores: torch.Tensor, group: int | None) -> None:
        if self.capture.target_forward:  # else an assistant's draft, or prompt lookup probing its candidates
            super().on_raw(input_ids, scores, group)

    def on_processed(self, input_ids: torch.Tensor, scores: torch.Tensor, group: int | None) -> None:
        if self.capture.target_forward:
            super().on_processed(input_ids, scores, group)

    def on_stopping(self, input_ids: torch.Tensor, is_done: Any) -> None:
        c = self.capture
        if c.finished is None or not c.target_forward:
            return  # 4.40+ also check the unverified candidates, before the recorded model runs
        c.target_forward = False
        c.record_tokens(input_ids, is_done)


class BeamSteps:
    """Beam search and beam sampling: running beams never finish (finished hypotheses leave them)."""

    def __init__(self, capture: Capture) -> None:
        self.capture = capture
        self.previous_ids: torch.Tensor | None = None  # the rows the last step started from
        self._none_finished: torch.Tensor | None = None  # `finished` of running beams: known on the host

    def on_raw(self, input_ids: torch.Tensor, scores: torch.Tensor, group: int | None) -> None:
        c = self.capture
        c.step += 1
        step = c.step
        # The previous step's token first: this step's first put may wait for a slot.
        self.record_ancestry(step, input_ids)
        if c.records_raw:
            raw = c.take_forward_logits()
            if "logits" in c.streams:
                c.put_full(step, "logits", raw)
            if c.stats is not None:
                c.stats.raw(step, raw)
        self.put_running_finished(step, input_ids.shape[0])

    def put_running_finished(self, step: int, rows: int) -> None:
        if self._none_finished is None:
            self._none_finished = torch.zeros(rows, dtype=torch.bool)
        self.capture.ring.put(step, "finished", self._none_finished)

    def record_ancestry(self, step: int, input_ids: torch.Tensor) -> None:
        """At step `step`, which row of the previous step each row extends: the previous step's parents
        and tokens (stored under `step - 1`)."""
        c = self.capture
        rows = input_ids.shape[0]
        c.num_rows = rows
        previous, self.previous_ids = self.previous_ids, input_ids
        if c.seen_prompt is None:
            c.seen_prompt = (input_ids if previous is None else previous)[:, : c.prompt_length].clone()
        if previous is None:
            return
        # Row r of this step extends the row of the previous step that holds the same sequence. Only
        # beams of one prompt are compared, and only the generated part (the prompt is shared).
        batch = rows // c.num_beams
        new = input_ids[:, c.prompt_length : -1].reshape(batch, c.num_beams, 1, -1)
        old = previous[:, c.prompt_length :].reshape(batch, 1, c.num_beams, -1)
        same = (new == old).all(dim=-1)  # (batch, new beam, old beam)
        first = same.to(torch.int8).argmax(dim=-1)  # first matching old beam
        offset = torch.arange(batch, device=input_ids.device).unsqueeze(1) * c.num_beams
        parents = (first + offset).reshape(rows)
        if self.check_paths:
            c.seen_tokens.append(input_ids[:, -1])
            c.seen_parents.append(parents)
        c.ring.put(step - 1, "beam_parents", parents)
        c.ring.put(step - 1, "tokens", input_ids[:, -1])
        if c.stats is not None and c.stats.has(step - 1):
            c.ring.put(step - 1, STATS_STREAM, c.stats.record(step - 1, input_ids[:, -1], parents))

    def on_processed(self, input_ids: torch.Tensor, scores: torch.Tensor, group: int | None) -> None:
        self.capture.put_processed(self.capture.step, scores)

    def on_stopping(self, input_ids: torch.Tensor, is_done: Any) -> None:
        """Beam search passes candidate rows to the criteria, not running beams: nothing to record."""

    def at_loop_end(self, output: Any) -> None:
        """Nothing: beam search's last tokens come from `at_end`."""

    def at_end(self, steps: int) -> None:
        """After the last step no running beam continues."""
        c = self.capture
        if steps <= 0:
            return
        last = torch.full((c.num_rows,), -1, dtype=torch.long)
        c.ring.put(steps - 1, "beam_parents", last)
        c.ring.put(steps - 1, "tokens", last)
        if c.stats is not None and c.stats.has(steps - 1):
            c.ring.put(steps - 1, STATS_STREAM, c.stats.record(steps - 1, last, last))

    check_paths = True  # each returned sequence is traced down the recorded ancestry

    def verdict(self, complete_steps: int, sequences: torch.Tensor | None) -> Verdict:
        c = self.capture
        fill_ids = tuple(i for i in (c.header.pad_token_id, *c.header.eos_token_id) if isinstance(i, int))
        return check_beams(
            complete_steps=complete_steps, sequences=sequences, prompt=c.seen_prompt, tokens=c.seen_tokens.steps(),
            parents=c.seen_parents.steps(), check_paths=self.check_paths, num_beams=c.num_beams, fill_ids=fill_ids,
        )


class GroupBeamSteps(BeamSteps):
    """Group beam search (up to 4.56): each list runs once per group, with that group's rows only."""

    # It reorders its rows group by group: its returned sequences are checked by their length only.
    check_paths = False

    def __init__(self, capture: Capture) -> None:
        super().__init__(capture)
        self.group_scores: torch.Tensor | None = None  # out.scores of the step: every group's, as they come

    def on_raw(self, input_ids: torch.Tensor, scores: torch.Tensor, group: int | None) -> None:
        c = self.capture
        if group:  # not the first group of a step
            return
        c.step += 1
        raw = c.take_forward_logits()
        c.num_rows = raw.shape[0]
        if "logits" in c.streams:
            c.put_full(c.step, "logits", raw)
        if c.stats is not None:
            c.stats.raw(c.step, raw)
        self.group_scores = torch.zeros_like(raw)  # in the model's dtype, as out.scores
        self.put_running_finished(c.step, c.num_rows)

    def on_processed(self, input_ids: torch.Tensor, scores: torch.Tensor, group: int | None) -> None:
        c = self.capture
        size = c.num_beams // c.num_beam_groups
        start = (group or 0) * size
        end = min(start + size, c.num_beams)
        beams = self.group_scores.view(-1, c.num_beams, self.group_scores.shape[-1])
        beams[:, start:end] = scores.view(beams.shape[0], end - start, -1)
        if end == c.num_beams and "scores" in c.streams:
            c.put_full(c.step, "scores", self.group_scores)
        if end == c.num_beams and c.stats is not None:
            c.stats.processed(c.step, self.group_scores)

    def on_stopping(self, input_ids: torch.Tensor, is_done: Any) -> None:
        c = self.capture
        # Every row, after every group appended its tokens: the rows the next step starts from.
        if self.previous_ids is None:
            self.previous_ids = input_ids[:, :-1]  # the prompt, the same in every beam
        # A copy: the next step reorders these rows in place, group by group.
        self.record_ancestry(c.step + 1, input_ids.clone())


def steps_for(mode: str, capture: Capture) -> PlainSteps | BeamSteps:
    """The step handling of decoding `mode` (transformers' `GenerationMode` value)."""
    if mode == _compat.GROUP_BEAM_MODE:
        return GroupBeamSteps(capture)
    if mode in BEAM_MODES:
        return BeamSteps(capture)
    if mode == _compat.ASSISTED_MODE:
        return AssistedSteps(capture)
    if mode == _compat.DOLA_MODE:
        return DolaSteps(capture)
    return PlainSteps(capture)
