"""The prompt logprobs' part of a call's capture: it keeps the first forward's final hidden states, then, at
the first step's processors, scores the prompt (`prompt_logprobs.PromptScoring`) and hands the tensors over
as streams recorded once per call."""

from __future__ import annotations

from typing import Any

import torch

from .prompt_logprobs import PromptScoring


class PromptCapture:
    """Scores one call's prompt with `scoring`, from the hidden states its first forward computed."""

    def __init__(self, scoring: PromptScoring) -> None:
        self.scoring = scoring
        self.scored = False
        self._hidden: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._pad: int | None = None  # without an attention mask: the pad token id it is inferred from
        self._rows_per_prompt = 1

    def start(self, generation_config: Any, mask: torch.Tensor | None, eos_ids: list[int], rows_per_prompt: int) -> None:
        """Set up, before the decoding loop: the call's attention mask (None: inferred from the pad token,
        as generate() does) and its rows per prompt.

        Raises:
            ValueError: the call splits its prefill (`prefill_chunk_size`).
        """
        if getattr(generation_config, "prefill_chunk_size", None):
            raise ValueError(
                "`prompt_logprobs` scores the prompt from the prefill's one forward, and `prefill_chunk_size` "
                "splits it into several; nothing was run. Drop one of them for this call."
            )
        self._mask = mask
        pad = generation_config.pad_token_id
        if mask is None and pad is not None and int(pad) not in eos_ids:
            self._pad = int(pad)  # as generate() infers the mask: padding is the pad token
        self._rows_per_prompt = rows_per_prompt

    def on_base_output(self, output: Any) -> None:
        """The decoder's own output (the head's input) in a forward: the first one's final hidden states
        are kept until the first step's processors."""
        if self.scored or self._hidden is not None:
            return
        hidden = getattr(output, "last_hidden_state", None)
        if hidden is None and isinstance(output, (tuple, list)) and output:
            hidden = output[0]
        if isinstance(hidden, torch.Tensor) and hidden.dim() == 3:
            self._hidden = hidden.detach()

    def score(self, input_ids: torch.Tensor, prompt_length: int, mode: str) -> dict[str, torch.Tensor]:
        """At the first step's processors: the prompt logprobs' tensors, by stream name (on the device).

        Raises:
            RuntimeError: no decoder output was seen, or it did not hold the whole prompt.
        """
        hidden, self._hidden = self._hidden, None
        self.scored = True
        if hidden is None:
            raise RuntimeError(
                f"transformers-offload saw no decoder output before the first {mode!r} step, so it cannot "
                f"score the prompt (`prompt_logprobs`): this {self.scoring.model_name}'s forward does not "
                "call its base model (or decoder). Record without `prompt_logprobs`, and please report it."
            )
        if hidden.shape[1] < prompt_length:
            raise RuntimeError(
                f"transformers-offload: the call's first forward saw {hidden.shape[1]} of the prompt's "
                f"{prompt_length} positions (a cache or a chunked prefill), so `prompt_logprobs` cannot "
                "score the prompt. Record without it, or score the whole prompt in one forward."
            )
        prompt = input_ids[:, :prompt_length]
        mask, self._mask = self._mask, None
        if mask is None and self._pad is not None:
            mask = (prompt[:: self._rows_per_prompt] != self._pad).long()
        return self.scoring.score(hidden, prompt, mask, self._rows_per_prompt)
