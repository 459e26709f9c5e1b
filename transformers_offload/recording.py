"""What one `generate()` call recorded: per-step tensors in Hugging Face's layout."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

FRAMEWORKS = ("pt", "np")


@dataclass(frozen=True, eq=False)
class Generation:
    """The recording of one `generate()` call.

    Every per-step accessor returns a tuple with one entry per generated step (step 0 comes from the
    prefill forward). A row is one running sequence: `batch x num_return_sequences`, or
    `batch x num_beams` in beam search. Tensors are CPU tensors owned by the recording: copy them
    before modifying them in place.

    Attributes:
        mode (`str`): the decoding mode, as transformers' `GenerationMode` value (`"greedy_search"`,
            `"sample"`, `"beam_search"`, `"beam_sample"`).
        prompt_length (`int`): length of the (left-padded) prompt `input_ids` given to the decoding loop,
            in tokens; for encoder-decoder models, of the decoder's start ids.
        num_rows (`int`): rows per step.
        num_beams (`int`): beams per prompt (1 outside beam search).
        complete (`bool`): False when `generate()` raised (or was interrupted) mid-run; the steps
            recorded before that are kept.
        error (`str | None`): the exception that ended an incomplete generation, as `repr`.
        sequences (`torch.LongTensor | None`): what `generate()` returned as sequences (`out.sequences`
            or the plain tensor), on CPU; None for an incomplete generation.
    """

    mode: str
    prompt_length: int
    num_rows: int
    num_beams: int
    complete: bool
    error: str | None
    sequences: torch.Tensor | None
    _streams: dict[str, tuple[torch.Tensor, ...]] = field(repr=False)

    @property
    def num_steps(self) -> int:
        """Number of recorded steps."""
        return len(self._streams.get("tokens", ()))

    @property
    def streams(self) -> tuple[str, ...]:
        """Names of the per-step streams this generation holds."""
        return tuple(self._streams)

    def logits(self, *, framework: str = "pt") -> tuple[Any, ...]:
        """Raw next-token logits per step, before any processor or warper.

        Mirrors `out.logits` of the same call made with `return_dict_in_generate=True,
        output_logits=True`: a tuple of `num_steps` tensors of shape `(num_rows, vocab_size)`, in the
        dtype transformers gives them (float32 from 4.45), on CPU.

        Args:
            framework (`str`): `"pt"` for torch tensors, `"np"` for NumPy arrays.

        Raises:
            KeyError: the recorder was created without the `"logits"` stream.
            ValueError: `framework` is not `"pt"` or `"np"`.

        Example:
            >>> gen.logits()[0].shape  # doctest: +SKIP
            torch.Size([2, 49152])
        """
        return self._get("logits", framework)

    def scores(self, *, framework: str = "pt") -> tuple[Any, ...]:
        """Processed scores per step, after every processor and warper (`LogitNormalization` included).

        Mirrors `out.scores` with `return_dict_in_generate=True, output_scores=True`: a tuple of
        `num_steps` float32 tensors of shape `(num_rows, vocab_size)` on CPU. In beam search these are
        the processed log-probabilities of each running beam, without the cumulative beam score.

        Raises:
            KeyError: the recorder was created without the `"scores"` stream.
            ValueError: `framework` is not `"pt"` or `"np"`.
        """
        return self._get("scores", framework)

    def tokens(self, *, framework: str = "pt") -> tuple[Any, ...]:
        """The token chosen at each step, per row: a tuple of `num_steps` int64 tensors `(num_rows,)`.

        Outside beam search, `tokens()[t]` equals `out.sequences[:, prompt_length + t]` (a finished row
        gets the pad token, as in `out.sequences`). In beam search, `tokens()[t][r]` is the token that
        extended row `beam_parents()[t][r]` of step `t` into running beam `r` of step `t + 1`; after the
        last step no running beam continues, so its entries are -1 (see `beam_indices()` for how the
        returned sequences map to rows).
        """
        return self._get("tokens", framework)

    def finished(self, *, framework: str = "pt") -> tuple[Any, ...]:
        """Rows that had already finished before each step: a tuple of bool tensors `(num_rows,)`.

        A row is finished once a stopping criterion marked it done (its end-of-sequence token, a stop
        string...): from the next step on its scores are still finite and recorded, and its token is
        forced to the pad token. With `pad_token_id == eos_token_id` only the first EOS ends a row.
        In beam search, finished hypotheses leave the running beams, so every entry is False.
        """
        return self._get("finished", framework)

    def beam_parents(self, *, framework: str = "pt") -> tuple[Any, ...]:
        """Beam search only: per step, the row of step `t` that each running beam of step `t + 1` extends.

        A tuple of `num_steps` int64 tensors `(num_rows,)`, row indices flattened over the batch as in
        `out.beam_indices`; -1 after the last step.

        Raises:
            ValueError: this generation is not a beam search.
        """
        self._require_beams("beam_parents")
        return self._get("beam_parents", framework)

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
        if self.sequences is None:
            raise ValueError(
                "`beam_indices()` needs the sequences `generate()` returned, and this generation is "
                f"incomplete ({self.error}); the per-step `beam_parents()` are still available."
            )
        indices = _trace_beam_indices(
            self.sequences,
            self.prompt_length,
            self.num_beams,
            self._streams["tokens"],
            self._streams["beam_parents"],
        )
        return indices.numpy() if _check_framework(framework) == "np" else indices

    def _require_beams(self, what: str) -> None:
        if "beam_parents" not in self._streams:
            raise ValueError(f"`{what}()` exists for beam search only; this generation ran {self.mode!r}.")

    def _get(self, name: str, framework: str) -> tuple[Any, ...]:
        _check_framework(framework)
        if name not in self._streams:
            raise KeyError(
                f"this recording has no {name!r} stream (it holds {sorted(self._streams)}); create the "
                f"Recorder with {name!r} in `streams` to record it."
            )
        steps = self._streams[name]
        if framework == "np":
            if steps and steps[0].dtype == torch.bfloat16:
                raise TypeError(
                    f"NumPy has no bfloat16: {name!r} was recorded in torch.bfloat16. Use "
                    "`framework='pt'` and convert with `.float().numpy()`."
                )
            return tuple(step.numpy() for step in steps)
        return steps


def _check_framework(framework: str) -> str:
    if framework not in FRAMEWORKS:
        raise ValueError(f"`framework` must be 'pt' (torch) or 'np' (NumPy), got {framework!r}.")
    return framework


def _trace_beam_indices(
    sequences: torch.Tensor,
    prompt_length: int,
    num_beams: int,
    tokens: tuple[torch.Tensor, ...],
    parents: tuple[torch.Tensor, ...],
) -> torch.Tensor:
    """Walk each returned sequence down the recorded ancestry, step by step.

    At step 0 every beam of a prompt holds the same prompt and transformers expands beam 0 only. A
    sequence that is at row `r` at step `t` and continues with token `x` is at step `t + 1` in the
    running beam whose parent is `r` and whose token is `x`; running beams are distinct sequences, so
    that beam is unique. When no running beam continues it, the sequence ended at step `t`.
    """
    returned, total = sequences.shape
    generated = total - prompt_length
    per_prompt = returned // max(1, tokens[0].shape[0] // num_beams) if tokens else 1
    indices = torch.full((returned, generated), -1, dtype=torch.long)
    for j in range(returned):
        row = (j // per_prompt) * num_beams
        for t in range(min(generated, len(tokens))):
            indices[j, t] = row
            if t + 1 >= generated:
                break
            token = int(sequences[j, prompt_length + t])
            children = ((parents[t] == row) & (tokens[t] == token)).nonzero()
            if children.numel() == 0:
                break
            row = int(children[0, 0])
    return indices
