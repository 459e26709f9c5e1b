"""Checks, when a decoding loop ends, that what the capture recorded is what the loop produced.

A recording counts its steps from the recorder's own calls (the processor list's and the stopping
criteria's), never from lengths of what `generate()` returns. This module then compares the two:
the tokens the stopping criteria saw appended (the loop's last `input_ids`, which hold every recorded
token) against the sequences the call returned, and the steps whose logits and scores were recorded
against the steps whose tokens were. Any disagreement is named in words; the capture then marks the
generation incomplete with it (`RecordingMismatch`), and the recorder warns. The checks run once, after
the loop, never inside a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class RecordingMismatch(Exception):
    """What a generation recorded disagrees with what its `generate()` call computed or returned; the
    generation is marked incomplete with this as its error (its steps stay readable, as recorded)."""


@dataclass(frozen=True)
class Verdict:
    """The outcome of the end-of-loop check.

    Attributes:
        num_steps (`int`): the steps the generation keeps (the leading steps recorded in every stream,
            less a last step whose token `generate()` itself dropped).
        problem (`str | None`): the disagreement, in words; None when the recording matches.
    """

    num_steps: int
    problem: str | None = None


def check_loop(*, complete_steps: int, sequences: torch.Tensor | None, last_ids: torch.Tensor | None,
               prompt_length: int, tracks_ids: bool) -> Verdict:
    """Compare one decoding loop's recording with what it produced.

    Args:
        complete_steps (`int`): leading steps for which every recorded stream has a record.
        sequences (`torch.LongTensor | None`): what the call returned as sequences, `(rows, length)`,
            any device; None when it returned none (nothing to compare the tokens with).
        last_ids (`torch.LongTensor | None`): the loop's `input_ids` when the stopping criteria last
            ran, `(rows, prompt_length + tokens)`: every token the loop appended; None if they never ran.
        prompt_length (`int`): tokens of the loop's prompt (decoder start ids for encoder-decoder).
        tracks_ids (`bool`): whether the mode's rows keep their order from step to step (greedy search,
            sampling, assisted decoding...), so that `last_ids` are the returned rows. False in beam
            search, whose returned sequences are finished hypotheses: only their length is checked.

    Returns:
        `Verdict`: the steps to keep (the complete ones; with a disagreement they stay readable, marked
        incomplete) and the disagreement, if any.
    """
    if not tracks_ids:
        if sequences is None:
            return Verdict(complete_steps)
        generated = int(sequences.shape[-1]) - prompt_length
        if generated > complete_steps:
            return Verdict(complete_steps, (
                f"the call returned sequences of {generated} generated token(s), but the recorder saw "
                f"{complete_steps} step(s) of its decoding loop"
            ))
        return Verdict(complete_steps)
    tokens = 0 if last_ids is None else int(last_ids.shape[-1]) - prompt_length
    if complete_steps < tokens:
        return Verdict(complete_steps, (
            f"the decoding loop appended {tokens} token(s), but the logits processors ran (and so the "
            f"logits and scores were recorded) for {complete_steps} of them"
        ))
    kept = min(complete_steps, tokens)
    if sequences is None:
        return Verdict(kept)
    if last_ids is None:
        if int(sequences.shape[-1]) <= prompt_length and complete_steps == 0:
            return Verdict(0)  # no step ran, and none was returned
        return Verdict(0, (
            f"the call returned sequences of shape {tuple(sequences.shape)}, but the recorder saw no step of "
            "a decoding loop end (its stopping criteria never ran)"
        ))
    if tuple(sequences.shape) != tuple(last_ids.shape):
        return Verdict(kept, (
            f"the call returned sequences of shape {tuple(sequences.shape)}, and its decoding loop ended with "
            f"{tuple(last_ids.shape)} (rows, prompt of {prompt_length} + {tokens} recorded token(s)): not the "
            "same rows and steps"
        ))
    returned = sequences.to(last_ids.device)
    expected = last_ids
    if not torch.equal(returned, expected):
        # The end of the call: a host sync here is fine.
        row, position = (returned != expected).nonzero()[0].tolist()
        where = f"prompt position {position}" if position < prompt_length else f"step {position - prompt_length}"
        return Verdict(kept, (
            f"the returned sequences differ from the recorded tokens first at row {row}, {where}: "
            f"{int(returned[row, position])} returned, {int(expected[row, position])} recorded"
        ))
    return Verdict(kept)
