"""Transition scores: the score of each returned sequence's token at each step, as Hugging Face's
`model.compute_transition_scores(out.sequences, out.scores, out.beam_indices, normalize_logits)`
computes them, read from a recording a part at a time.

Hugging Face stacks every step (`(rows * vocab, steps)`) and gathers one entry per sequence and step;
with `normalize_logits` it first applies `log_softmax` over the vocabulary of the stacked
`(rows, vocab, steps)` tensor. A gather copies values, so without normalisation each step is read on
its own. The `log_softmax` of that layout gives bits that depend on how many steps lie side by side
(the kernel vectorises across them), but not on how many rows do: normalised, the recording is read
a group of rows at a time, every step of them, so each value is the one Hugging Face computes.
"""

from __future__ import annotations

from typing import Any

from .._lazy import torch  # imported when first used: reading a manifest needs no torch (`inspect`, `verify`)

ROW_GROUP_BYTES = 256 * 2**20  # normalised: scores read at a time, at least one row's every step


def transition_scores(generation: Any, *, normalize_logits: bool = False,
                      row_group_bytes: int = ROW_GROUP_BYTES) -> torch.Tensor:
    """See `Generation.transition_scores`."""
    if not isinstance(normalize_logits, bool):
        raise TypeError(f"`normalize_logits` must be True or False, got {normalize_logits!r}.")
    if generation.sequences is None:
        raise ValueError(
            "`transition_scores()` needs the sequences `generate()` returned, and this generation is "
            f"incomplete ({generation.error}); its per-step `scores()` are still available."
        )
    sequences = generation.sequences
    num_steps = generation.num_steps
    if generation.is_beam:
        beam_indices = generation.beam_indices()
    else:
        beam_indices = torch.arange(generation.num_rows).view(-1, 1).expand(-1, num_steps)
    empty = beam_indices < 0
    length = int((~empty).sum(-1).max()) if beam_indices.numel() else 0
    beam_indices = beam_indices[:, :length].clone()
    empty = empty[:, :length]
    beam_indices[empty] = 0
    tokens = sequences[:, sequences.shape[-1] - length:]
    if length == 0:
        return torch.zeros(tokens.shape, dtype=torch.float32)
    if normalize_logits:
        result = _normalized(generation, beam_indices, tokens, length, row_group_bytes)
    else:
        result = None
        for t in range(length):
            (step,) = generation.scores(steps=range(t, t + 1))
            if result is None:
                result = torch.empty(tokens.shape, dtype=step.dtype)
            result[:, t] = step[beam_indices[:, t], tokens[:, t]]
    result[empty] = 0
    return result


def _normalized(generation: Any, beam_indices: torch.Tensor, tokens: torch.Tensor, length: int,
                row_group_bytes: int) -> torch.Tensor:
    (first,) = generation.scores(steps=range(0, 1), rows=[0])
    vocab = first.shape[-1]
    per_row = vocab * length * first.element_size()
    group = max(1, row_group_bytes // max(1, per_row))
    result = torch.empty(tokens.shape, dtype=first.dtype)
    steps = torch.arange(length).expand_as(beam_indices)
    for start in range(0, generation.num_rows, group):
        rows = list(range(start, min(start + group, generation.num_rows)))
        scores = generation.scores(steps=range(0, length), rows=rows)
        # Hugging Face's layout: (rows, vocab, steps), log_softmax over the vocabulary.
        stacked = torch.stack(scores).reshape(length, -1).transpose(0, 1).reshape(-1, vocab, length)
        normalized = torch.nn.functional.log_softmax(stacked, dim=1)
        here = (beam_indices >= start) & (beam_indices < start + len(rows))
        result[here] = normalized[beam_indices[here] - start, tokens[here], steps[here]]
    return result
