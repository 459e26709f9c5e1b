"""A beam search generation's accessors: each running beam's parent per step, and which row of each step
each returned sequence came from (`out.beam_indices`), traced from the recorded tokens and parents."""

from __future__ import annotations

from typing import Any

import numpy

from ..store.layout import BEAM_MODES
from .indexing import Rows, Steps, as_framework, check_framework


class BeamReading:
    """`Generation`'s beam-search accessors (a mixin: it reads through `Generation._get` and `tokens`)."""

    @property
    def is_beam(self) -> bool:
        """Whether this generation is a beam search (`beam_parents()` and `beam_indices()` exist)."""
        return self.mode in BEAM_MODES

    def _require_beams(self, what: str) -> None:
        if not self.is_beam:
            raise ValueError(f"`{what}()` exists for beam search only; this generation ran {self.mode!r}.")

    def beam_parents(self, *, steps: Steps = None, rows: Rows = None, framework: str = "pt") -> tuple[Any, ...]:
        """Beam search only: per step, the row of step `t` that each running beam of step `t + 1` extends.

        A tuple of int64 tensors `(num_rows,)`, row indices flattened over the batch as in
        `out.beam_indices`; -1 after the last step.

        Raises:
            ValueError: this generation is not a beam search.
        """
        self._require_beams("beam_parents")
        return self._get("beam_parents", steps, rows, framework)

    def beam_indices(self, *, framework: str = "pt") -> Any:
        """Beam search only: for each returned sequence and step, the row whose scores chose its token.

        Mirrors `out.beam_indices` of transformers 4.50+: an int64 tensor of shape
        `(num_returned_sequences, generated_length)` where `generated_length` is
        `sequences.shape[1] - prompt_length`, padded with -1 after a sequence's last token. Built from
        the returned sequences and the recorded ancestry, so it needs no `return_dict_in_generate`.
        In a degenerate search where several hypotheses are the very same token sequence (e.g. every
        candidate but one forced to -inf), it may name another row holding that same sequence.

        Raises:
            ValueError: this generation is not a beam search, or it is incomplete (no sequences).
        """
        self._require_beams("beam_indices")
        check_framework(framework)
        if not self.has_sequences:
            raise ValueError(
                "`beam_indices()` needs the sequences `generate()` returned, and this generation is "
                f"incomplete ({self.error}); the per-step `beam_parents()` are still available."
            )
        indices = trace_beam_indices(self.sequences_array(), self.prompt_length, self.num_beams,
                                      self.tokens(framework="np"), self.beam_parents(framework="np"))
        return as_framework(indices, "beam_indices", framework)


def trace_beam_indices(
    sequences: numpy.ndarray,
    prompt_length: int,
    num_beams: int,
    tokens: tuple[numpy.ndarray, ...],
    parents: tuple[numpy.ndarray, ...],
) -> numpy.ndarray:
    """Walk each returned sequence down the recorded ancestry, step by step.

    At step 0 every beam of a prompt holds the same prompt and transformers expands beam 0 only. A
    sequence that is at row `r` at step `t` and continues with token `x` is at step `t + 1` in the
    running beam whose parent is `r` and whose token is `x`; running beams are distinct sequences, so
    that beam is unique. When no running beam continues it, the sequence ended at step `t`.
    """
    returned, total = sequences.shape
    generated = total - prompt_length
    per_prompt = returned // max(1, tokens[0].shape[0] // num_beams) if tokens else 1
    indices = numpy.full((returned, generated), -1, dtype=numpy.int64)
    for j in range(returned):
        row = (j // per_prompt) * num_beams
        for t in range(min(generated, len(tokens))):
            indices[j, t] = row
            if t + 1 >= generated:
                break
            token = int(sequences[j, prompt_length + t])
            children = ((parents[t] == row) & (tokens[t] == token)).nonzero()[0]
            if children.size == 0:
                break
            row = int(children[0])
    return indices
