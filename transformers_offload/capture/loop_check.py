"""Checks, when a decoding loop ends, that what the capture recorded is what the loop produced.

A recording counts its steps from the recorder's own calls (the processor list's and the stopping
criteria's), never from lengths of what `generate()` returns. This module then compares the two:
copies of the prompt and of every token the stopping criteria saw appended against the sequences the
call returned (in beam search, each returned sequence down the recorded ancestry), and the steps whose
logits and scores were recorded against the steps whose tokens were. Any disagreement is named in words; the capture then
marks the
generation incomplete with it (`RecordingMismatch`), and the recorder warns. The checks run once, after
the loop, never inside a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class RecordingMismatch(Exception):
    """What a generation recorded disagrees with what its `generate()` call computed or returned; the
    generation is marked incomplete with this as its error (its steps stay readable, as recorded)."""


@dataclass(frozen=True)
class Verdict:
    """The outcome of the end-of-loop check.

    Attributes:
        num_steps (`int`): the steps the generation keeps (the leading steps recorded in every stream).
        problem (`str | None`): the disagreement, in words; None when the recording matches.
    """

    num_steps: int
    problem: str | None = None


class StepLog:
    """One value per row and step (the tokens the loop chose, the beams' parents), copied as they come
    into one `(rows, capacity)` buffer per call that doubles when full: a tensor kept per step would
    leave small long-lived blocks between the step's large temporaries, which the C library's default
    allocator then cannot merge (the heap grew by tens of MiB over a few hundred steps). Rows, dtype
    and device are the first value's; a value that differs starts another buffer."""

    def __init__(self, capacity: int = 256) -> None:
        self._capacity = max(1, capacity)
        self._segments: list[list] = []  # [buffer, count]

    def append(self, values: torch.Tensor) -> None:
        """Copy `values` (`(rows,)`, any device; no host sync) as the next step's."""
        segment = self._segments[-1] if self._segments else None
        if segment is not None:
            buffer, count = segment
            if buffer.shape[0] != values.shape[0] or buffer.dtype != values.dtype or buffer.device != values.device:
                segment = None
            elif count == buffer.shape[1]:
                grown = buffer.new_empty((buffer.shape[0], 2 * count))
                grown[:, :count].copy_(buffer)
                segment[0] = grown
        if segment is None:
            segment = [values.new_empty((values.shape[0], self._capacity)), 0]
            self._segments.append(segment)
        segment[0][:, segment[1]].copy_(values)
        segment[1] += 1

    def __len__(self) -> int:
        return sum(count for _, count in self._segments)

    def steps(self) -> list[torch.Tensor]:
        """Each step's values, `(rows,)` views, in order."""
        return [buffer[:, i] for buffer, count in self._segments for i in range(count)]

    def values(self) -> torch.Tensor:
        """`(rows, steps)`: every step's values side by side (raises where rows differ between steps, or
        where there are none)."""
        if len(self._segments) == 1:
            buffer, count = self._segments[0]
            return buffer[:, :count]
        return torch.cat([buffer[:, :count] for buffer, count in self._segments], dim=1)


def check_loop(*, complete_steps: int, sequences: torch.Tensor | None, seen_ids: torch.Tensor | None,
               prompt_length: int) -> Verdict:
    """Compare one decoding loop's recording with what it produced (outside beam search, whose rows keep
    their order from step to step: greedy search, sampling, assisted decoding...).

    Args:
        complete_steps (`int`): leading steps for which every recorded stream has a record.
        sequences (`torch.LongTensor | None`): what the call returned as sequences, `(rows, length)`,
            any device; None when it returned none (nothing to compare the tokens with).
        seen_ids (`torch.LongTensor | None`): the loop's prompt and every token the stopping criteria saw
            it append, `(rows, prompt_length + tokens)`, copied as they were seen (a result edited in
            place afterwards differs); None if they never ran.
        prompt_length (`int`): tokens of the loop's prompt (decoder start ids for encoder-decoder).

    Returns:
        `Verdict`: the steps to keep (the complete ones; with a disagreement they stay readable, marked
        incomplete) and the disagreement, if any.
    """
    tokens = 0 if seen_ids is None else int(seen_ids.shape[-1]) - prompt_length
    if complete_steps < tokens:
        return Verdict(complete_steps, (
            f"the decoding loop appended {tokens} token(s), but the logits processors ran (and so the "
            f"logits and scores were recorded) for {complete_steps} of them"
        ))
    kept = min(complete_steps, tokens)
    if sequences is None:
        return Verdict(kept)
    if seen_ids is None:
        if int(sequences.shape[-1]) <= prompt_length and complete_steps == 0:
            return Verdict(0)  # no step ran, and none was returned
        return Verdict(0, (
            f"the call returned sequences of shape {tuple(sequences.shape)}, but the recorder saw no step of "
            "a decoding loop end (its stopping criteria never ran)"
        ))
    if tuple(sequences.shape) != tuple(seen_ids.shape):
        return Verdict(kept, (
            f"the call returned sequences of shape {tuple(sequences.shape)}, and its decoding loop ended with "
            f"{tuple(seen_ids.shape)} (rows, prompt of {prompt_length} + {tokens} recorded token(s)): not the "
            "same rows and steps"
        ))
    returned = sequences.to(seen_ids.device)
    if not torch.equal(returned, seen_ids):
        # The end of the call: a host sync here is fine.
        row, position = (returned != seen_ids).nonzero()[0].tolist()
        where = f"prompt position {position}" if position < prompt_length else f"step {position - prompt_length}"
        return Verdict(kept, (
            f"the returned sequences differ from the recorded tokens first at row {row}, {where}: "
            f"{int(returned[row, position])} returned, {int(seen_ids[row, position])} recorded"
        ))
    return Verdict(kept)


def check_beams(*, complete_steps: int, sequences: torch.Tensor | None, prompt: torch.Tensor | None,
                tokens: list[torch.Tensor], parents: list[torch.Tensor], num_beams: int,
                fill_ids: tuple[int, ...], check_paths: bool = True) -> Verdict:
    """Compare a beam search's recording with the sequences it returned.

    Each returned sequence must be a path down the recorded ancestry: its prompt that of its prompt's
    beams, and each token, step by step, the one a running beam whose parent holds the sequence so far
    appended; where no running beam continues it, the hypothesis ended there (its last token left the
    running beams), and every later position is the fill after a finished hypothesis (the pad id, or
    an EOS id: 5.x fills with the first EOS id where the pad id is 0). The last token of each
    hypothesis was chosen from its row's scores and is not among the running beams: it is not checked.

    Args:
        complete_steps (`int`): leading steps for which every recorded stream has a record.
        sequences (`torch.LongTensor | None`): the returned sequences, `(returned, prompt + generated)`.
        prompt (`torch.LongTensor | None`): the running beams' prompt, `(rows, prompt_length)`.
        tokens, parents (`list[torch.LongTensor]`): per step but the last, for each running row after the
            step, the token it appended and the row of the step it extends, `(rows,)` each.
        num_beams (`int`): beams per prompt. fill_ids (`tuple[int, ...]`): the ids a finished sequence
            may be filled with (the pad and EOS ids; empty: not checked).
        check_paths (`bool`): False: check the returned sequences' length only.

    Returns:
        `Verdict`: the steps to keep and the disagreement, if any.
    """
    if sequences is None or prompt is None:
        return Verdict(complete_steps)
    prompt_length = int(prompt.shape[1])
    generated = int(sequences.shape[-1]) - prompt_length
    if generated > complete_steps:
        return Verdict(complete_steps, (
            f"the call returned sequences of {generated} generated token(s), but the recorder saw "
            f"{complete_steps} step(s) of its decoding loop"
        ))
    if not check_paths:
        return Verdict(complete_steps)
    returned, rows = int(sequences.shape[0]), int(prompt.shape[0])
    prompts = rows // max(1, num_beams)
    if prompts == 0 or returned % prompts or returned // prompts > num_beams:
        return Verdict(complete_steps, (
            f"the call returned {returned} sequences for {prompts} prompt(s) of {num_beams} beams"
        ))
    # The end of the call: the host may wait for the device here.
    seq = sequences.detach().cpu().numpy()
    first_rows = np.arange(returned) // (returned // prompts) * num_beams
    differs = (seq[:, :prompt_length] != prompt.detach().cpu().numpy()[first_rows]).any(axis=1)
    if differs.any():
        return Verdict(complete_steps, f"returned sequence {int(np.argmax(differs))} has another prompt than its beams")
    steps_tokens = [t.detach().cpu().numpy() for t in tokens]
    steps_parents = [p.detach().cpu().numpy() for p in parents]
    alive = np.zeros((returned, rows), dtype=bool)  # the running rows holding each sequence so far
    alive[np.arange(returned), first_rows] = True
    ended = np.zeros(returned, dtype=bool)
    for step in range(generated):
        token = seq[:, prompt_length + step]
        if step < len(steps_tokens):
            children = alive[:, steps_parents[step]] & (steps_tokens[step][None, :] == token[:, None])
        else:
            children = np.zeros_like(alive)
        continues = children.any(axis=1)
        for j in np.flatnonzero(~ended & ~continues):
            rest = seq[j, prompt_length + step + 1:]
            if fill_ids and not np.isin(rest, fill_ids).all():
                return Verdict(complete_steps, (
                    f"returned sequence {j} goes on after step {step} with tokens no recorded beam holds"
                ))
        ended |= ~continues
        alive = np.where(continues[:, None], children, alive)
    if generated < len(steps_tokens) + 1 and not ended.all():
        # A hypothesis ends where its last token leaves the running beams, or at the loop's last step.
        j = int(np.argmin(ended))
        return Verdict(complete_steps, (
            f"returned sequence {j} stops after step {generated - 1} while a running beam still held it "
            f"(the loop ran {len(steps_tokens) + 1} steps): it was cut short"
        ))
    return Verdict(complete_steps)
