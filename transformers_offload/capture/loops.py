"""One recorded `generate()` call, and the decoding loops it runs.

A stock `generate()` runs transformers' decoding loop once; a model's own `generate()` may run it
several times in one call. Whisper's cuts long audio into 30-second segments and, per segment, runs the
loop once per temperature of its fallback schedule, rerunning only the prompts whose result failed its
thresholds; what it returns is assembled from the loops' outputs. Each loop is recorded as its own
generation (one `Capture` each), checked when it ends against that loop's own output, and told which of
its prompts the call kept (`Generation.loop`).

How a loop's output and its kept prompts are known depends on the model: `LOOP_TAPS` names, per
wrapper, the methods its `generate()` calls on the instance around each loop (`_compat` says which the
installed release has). A model that runs the loop several times without such taps (a user's override)
still gets a generation per loop, the earlier ones marked incomplete (`RecordingMismatch`): the recorder
cannot tell which loop's result the call returns.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from .. import _interrupts
from ..store.header import Samples
from .capture import Capture
from .loop_check import RecordingMismatch

_ACTIVE = threading.local()  # .calls: dict[id(model), RecordedCall] for the calls running in this thread


def active_call(model: torch.nn.Module) -> RecordedCall | None:
    """The recorded call of `model` running in this thread, if any."""
    calls = getattr(_ACTIVE, "calls", None)
    return None if calls is None else calls.get(id(model))


def active_calls() -> list[RecordedCall]:
    """Every recorded call running in this thread (an outer call's, and an inner model's within it)."""
    return list(getattr(_ACTIVE, "calls", {}).values())


def active_capture(model: torch.nn.Module) -> Capture | None:
    """The capture of the decoding loop `model`'s recorded call runs now in this thread, if any."""
    call = active_call(model)
    return None if call is None else call.capture


@contextlib.contextmanager
def calls_on(model: torch.nn.Module, call: RecordedCall | None) -> Iterator[None]:
    """Make `call` the one this thread's calls on `model` report to (None: no call), then restore
    whatever was active before (an outer call, or none)."""
    calls = _ACTIVE.__dict__.setdefault("calls", {})
    key = id(model)
    outer = calls.pop(key, None)
    if call is not None:
        calls[key] = call
    try:
        yield
    finally:
        calls.pop(key, None)
        if outer is not None:
            calls[key] = outer


def arguments_of(function: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    """A call's arguments by parameter name, however they were passed."""
    return inspect.signature(function).bind(*args, **kwargs).arguments


@dataclass
class LoopState:
    """Where a tapped loop of a call stands, as the model's loop taps tell (`loop_tap_wrappers`): which
    loop it is (the manifest's `loop` entry), what transformers' loop returned, the model's verdict on
    each of its prompts, and whether it is its segment's last attempt."""

    loop: dict[str, Any] | None = None
    output: Any = None
    verdicts: dict[int, tuple[bool, bool]] = field(default_factory=dict)  # prompt -> (rerun, skipped)
    last_attempt: bool = False

    def kept_prompts(self) -> list[int]:
        """The prompts whose result the call kept: not skipped, and not rerun (the last attempt of a
        segment keeps those that still fail the thresholds)."""
        prompts = len((self.loop or {}).get("batch_rows") or [])
        kept = []
        for index in range(prompts):
            rerun, skipped = self.verdicts.get(index, (False, False))
            if not skipped and (self.last_attempt or not rerun):
                kept.append(index)
        return kept

    def rerun_rows(self) -> list[int]:
        """The call's batch rows the model reruns at the next temperature."""
        rows = (self.loop or {}).get("batch_rows") or []
        return [row for index, row in enumerate(rows) if self.verdicts.get(index, (False, False))[0]]


class RecordedCall:
    """One recorded `generate()` call in progress: its recorder, the capture of the decoding loop that
    runs now and, for a model with loop taps, where that loop stands (segment, attempt, prompts)."""

    def __init__(self, recorder: Any, begin: Callable[..., Capture], *, tapped: bool = False) -> None:
        self.recorder = recorder
        self._begin = begin
        self.tapped = tapped  # the model's generate() tells each loop's output and kept prompts
        self.capture: Capture | None = None
        self.loops = 0  # decoding loops started in this call
        self._state = LoopState()  # the current capture's loop
        self._first_index = 0
        self._samples: Samples | None = None  # the call's sample ids, from set_samples
        self._segment = -1
        self._attempt = 0
        self._rows: list[int] | None = None  # the call's batch rows the next loop decodes

    def begin(self) -> Capture:
        """The call's first capture (before any loop starts)."""
        self.capture = self._begin()
        self._first_index = self.capture.index
        self._samples = self.capture.samples
        return self.capture

    def loop_starts(self) -> Capture:
        """A decoding loop starts (transformers builds its processor list): returns the capture that
        records it, a new one from the call's second loop on."""
        capture = self.capture
        if capture.started:
            capture = self._next_capture()
        if self.tapped and self._rows is not None:  # a loop of a segment (not a plain one: Whisper short-form up to 4.4x)
            batch_rows = list(self._rows)
            self._state.loop = {"call": self._first_index, "loop": self.loops, "segment": max(self._segment, 0),
                                "attempt": self._attempt, "batch_rows": batch_rows, "kept_rows": None}
            capture.set_loop(self._state.loop)
            if self._samples is not None:  # the call's ids of the rows this loop decodes, where they are its prompts
                # (rows that repeat a prompt, num_return_sequences > 1: numbered, not named)
                capture.set_samples(self._samples.of_rows(batch_rows))
        elif self._samples is not None and self.loops:  # another plain loop over the same prompts
            capture.set_samples(self._samples)
        return capture

    def _next_capture(self) -> Capture:
        previous, state = self.capture, self._state
        if self.tapped and not state.last_attempt:  # a fallback attempt of the same segment: the prompts rerun
            self._rows = state.rerun_rows()
            self._attempt += 1
        if self.tapped and state.output is not None:
            self._finish(previous, state.output, None)  # checked against its own output
        else:
            superseded = RecordingMismatch(
                f"generate() ran another decoding loop after this one in the same call (loop {self.loops + 1} "
                f"of at least {self.loops + 2}) without handing this one's output over to be checked: the "
                "call's result is not this loop's, or not this loop's alone; the next generation records the "
                "next loop"
            )
            self._finish(previous, None, superseded)
        self.loops += 1
        capture = self._begin(attention_mask=None) if self.tapped else self._begin()
        capture.take_encoder_output(previous)  # the new loop's encoder ran while the previous capture was active
        self.capture, self._state = capture, LoopState()
        return capture

    def end(self, output: Any, error: BaseException | None) -> None:
        """The call returned `output` (None when `error` ended it): end the last loop's generation."""
        if self._state.output is not None and error is None:
            output = self._state.output  # what transformers' loop returned, before the model's own steps
        self._finish(self.capture, output, error)

    def _finish(self, capture: Capture, output: Any, error: BaseException | None) -> None:
        loop = self._state.loop
        if loop is not None:
            capture.set_loop({**loop, "kept_rows": [loop["batch_rows"][index] for index in self._state.kept_prompts()]})
        self.recorder.end_call(capture, output, error)

    # -- the loop taps, for models whose generate() runs the loop several times ---------------------
    def segment_starts(self, batch_rows: list[int]) -> None:
        """A new segment: its first loop decodes `batch_rows` of the call's batch."""
        self._segment += 1
        self._attempt = 0
        self._rows = list(batch_rows)

    def segment_ends(self) -> None:
        """The segment's loops are over: the last one's prompts are kept (those that still fail the
        thresholds at the last temperature too)."""
        if self.capture.started:
            self._state.last_attempt = True

    def loop_returned(self, output: Any) -> None:
        """What transformers' loop returned (before the model reworks it): checked at the loop's end.
        No forward after it belongs to the loop."""
        if self.capture.started:
            self._state.output = output
            self.capture.loop_returned()

    def prompt_verdict(self, index: int, rerun: bool, skipped: bool) -> None:
        """The model's verdict on prompt `index` of the loop that just ran: to be rerun at the next
        temperature (`rerun`), or skipped as silence (`skipped`)."""
        if self.capture.started:
            self._state.verdicts[int(index)] = (bool(rerun), bool(skipped))


# -- the wrappers on a model's loop taps (`_compat.LOOP_TAPS`), installed by `hooks` ----------------------
def loop_tap_wrappers(model_ref: Callable[[], Any]) -> dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]]:
    """Per `_compat.LOOP_TAPS` method name, a function that wraps the instance's method so that it tells
    the model's recorded call (if any, and tapped) where its loops stand; inert otherwise."""

    def tapped_call() -> RecordedCall | None:
        call = active_call(model_ref())
        return call if call is not None and call.tapped else None

    def segment(original: Callable[..., Any]) -> Callable[..., Any]:
        def generate_with_fallback(*args: Any, **kwargs: Any) -> Any:
            call = tapped_call()
            if call is None:
                return original(*args, **kwargs)
            arguments = arguments_of(original, args, kwargs)
            rows, count = arguments.get("batch_idx_map"), arguments.get("cur_bsz")
            with _interrupts.held():
                call.segment_starts([int(rows[i]) for i in range(int(count))] if rows is not None and count else [])
            try:
                return original(*args, **kwargs)
            finally:
                with _interrupts.held():
                    call.segment_ends()

        return generate_with_fallback

    def loop_output(original: Callable[..., Any]) -> Callable[..., Any]:
        def _postprocess_outputs(*args: Any, **kwargs: Any) -> Any:
            call = tapped_call()
            if call is not None:
                call.loop_returned(arguments_of(original, args, kwargs).get("seek_outputs"))
            return original(*args, **kwargs)

        return _postprocess_outputs

    def prompt_verdict(original: Callable[..., Any]) -> Callable[..., Any]:
        def _need_fallback(*args: Any, **kwargs: Any) -> Any:
            verdict = original(*args, **kwargs)
            call = tapped_call()
            index = arguments_of(original, args, kwargs).get("index") if call is not None else None
            if index is not None and isinstance(verdict, tuple) and len(verdict) == 2:
                call.prompt_verdict(int(index), *verdict)
            return verdict

        return _need_fallback

    return {"generate_with_fallback": segment, "_postprocess_outputs": loop_output, "_need_fallback": prompt_verdict}
