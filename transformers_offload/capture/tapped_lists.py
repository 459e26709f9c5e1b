"""The processor and stopping-criteria lists `generate()` builds for a recorded call, tapped: each hands
the capture what it needs of a step (the raw logits, the processed scores, the tokens appended) around
the lists' own work, which runs unchanged."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .. import _compat, _interrupts
from .capture import Capture


class TappedProcessorList(_compat.LogitsProcessorList):
    """The processor list `generate()` built, with a tap before the first and after the last entry."""

    def __init__(self, processors: Any, capture: Capture, *, raw: bool, processed: bool) -> None:
        super().__init__(processors)
        self._capture = capture
        self._raw = raw
        self._processed = processed

    def __len__(self) -> int:
        # Assisted decoding skips an empty list (`if len(logits_processor) > 0`): the taps must run.
        return max(1, super().__len__())

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        group = kwargs.get("beam_group_idx")  # group beam search calls the list once per group
        if self._raw:
            with _interrupts.held():
                self._capture.on_raw(input_ids, scores, group)
        with self._capture.inside_a_list():
            scores = super().__call__(input_ids, scores, **kwargs)
        if self._processed:
            with _interrupts.held():
                self._capture.on_processed(input_ids, scores, group)
        return scores


class TappedCriteriaList(_compat.StoppingCriteriaList):
    """The stopping criteria `generate()` built, reporting each step's verdict to the capture."""

    def __init__(self, criteria: Any, capture: Capture) -> None:
        super().__init__(criteria)
        self._capture = capture

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> Any:
        try:
            with self._capture.inside_a_list():
                is_done = super().__call__(input_ids, scores, **kwargs)
        except BaseException:
            # A criterion raised (or Ctrl-C came) after the step's token was appended: record it.
            with contextlib.suppress(Exception), _interrupts.held():
                self._capture.on_stopping(input_ids, None)
            raise
        with _interrupts.held():
            self._capture.on_stopping(input_ids, is_done)
        return is_done
