"""The recorder: what a user hands to `generate()`."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch
from transformers import GenerationMixin
from transformers.generation import LogitsProcessor, StoppingCriteria

from . import _hooks
from ._capture import Capture
from .recording import Generation

STREAMS = ("logits", "scores")


class DeviceAccumulationWarning(UserWarning):
    """`generate()` was also asked to return scores or logits, which it keeps on the device."""


class Recorder(LogitsProcessor, StoppingCriteria):
    """Records every step of `model.generate()` and moves it off the device within the step.

    Hand it to a stock call, anywhere in the list: `model.generate(**enc, logits_processor=[rec])`.
    For each generated step it records the raw logits (what `out.logits` holds with
    `output_logits=True`), the processed scores (what `out.scores` holds with `output_scores=True`),
    the token chosen per row and which rows had already finished; in beam search also each running
    beam's parent. Generation itself keeps `output_scores` and `output_logits` off, so nothing of past
    steps stays on the device: each step's tensors are copied into a ring of `ring_slots` host slots
    (pinned memory and non-blocking copies on CUDA), then kept in host memory.

    Each `generate()` call that carries the recorder is one `Generation`, appended to `generations`;
    `logits()`, `scores()`... read the latest one unless `generation=` picks another. Calls of the same
    model without the recorder in `logits_processor` are not recorded and not affected.

    Supported decoding modes: greedy, multinomial sampling (with any processors and warpers), beam
    search and beam sampling. A call in another mode (assisted decoding, prompt lookup, contrastive
    search, group or constrained beam search, DoLa) raises `UnsupportedModeError` before its decoding
    loop starts.

    Args:
        model (`transformers.GenerationMixin`): the model whose `generate()` calls are recorded. The
            recorder wraps a few of this instance's generation methods (never the class) until
            `close()`.
        streams (`tuple[str, ...]`, *optional*, defaults to `("logits", "scores")`): which
            `(rows, vocab_size)` streams to record; tokens and the finished mask are always recorded.
        ring_slots (`int`, *optional*, defaults to 4): host slots in the transfer ring, i.e. steps in
            flight between the device and the store; on CUDA each slot holds
            `rows x vocab_size x 4` bytes per stream of pinned memory.

    Raises:
        TypeError: `model` has no `generate()` from transformers' `GenerationMixin`, or an option has
            the wrong type.
        ValueError: an option has a wrong value.

    Example:
        >>> from transformers_offload import Recorder
        >>> with Recorder(model) as rec:  # doctest: +SKIP
        ...     out = model.generate(**enc, logits_processor=[rec], max_new_tokens=8)
        >>> rec.logits()[0].shape  # doctest: +SKIP
        torch.Size([1, 49152])
    """

    def __init__(self, model: Any, *, streams: tuple[str, ...] = STREAMS, ring_slots: int = 4) -> None:
        if not isinstance(model, GenerationMixin) or not callable(getattr(model, "generate", None)):
            raise TypeError(
                f"`model` must be a transformers model with `generate()` (a `GenerationMixin`, such as "
                f"`AutoModelForCausalLM.from_pretrained(...)`), got {type(model).__name__}."
            )
        if isinstance(streams, str) or not isinstance(streams, (tuple, list)):
            raise TypeError(f"`streams` must be a tuple of names from {STREAMS}, got {streams!r}.")
        unknown = [s for s in streams if s not in STREAMS]
        if unknown:
            raise ValueError(f"`streams` holds unknown names {unknown}; choose from {STREAMS}.")
        if isinstance(ring_slots, bool) or not isinstance(ring_slots, int):
            raise TypeError(f"`ring_slots` must be an int (host slots), got {ring_slots!r}.")
        if ring_slots < 1:
            raise ValueError(f"`ring_slots` must be at least 1, got {ring_slots}.")
        self._model = model
        name_or_path = getattr(model, "name_or_path", "")
        self._model_name = type(model).__name__ + (f" {name_or_path!r}" if name_or_path else "")
        self._streams = tuple(dict.fromkeys(streams))
        self._ring_slots = ring_slots
        self._generations: list[Generation] = []
        self._lock = threading.Lock()
        self._active: Capture | None = None
        self._warned_accumulation = False
        self._closed = False
        _hooks.attach(model, self)

    # -- lifecycle ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove this recorder's hooks from the model; the recordings stay readable. Idempotent."""
        if not self._closed:
            self._closed = True
            _hooks.detach(self._model, self)

    def __enter__(self) -> Recorder:
        if self._closed:
            raise RuntimeError("this Recorder is closed; create a new `Recorder(model)` to use in `with`.")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """True once `close()` ran: the model's hooks are gone, the recordings remain readable."""
        return self._closed

    # -- reading ---------------------------------------------------------------------------------------
    @property
    def generations(self) -> tuple[Generation, ...]:
        """Every recorded `generate()` call, oldest first (incomplete ones included)."""
        return tuple(self._generations)

    def generation(self, index: int = -1) -> Generation:
        """One recorded generation, by index into `generations` (default: the latest).

        Raises:
            LookupError: nothing was recorded yet, or `index` is out of range.
        """
        if not self._generations:
            raise LookupError(
                "this Recorder has recorded no generation yet: pass it to "
                "`model.generate(..., logits_processor=[rec])` first."
            )
        try:
            return self._generations[index]
        except IndexError:
            raise LookupError(
                f"`generation` index {index} is out of range: {len(self._generations)} recorded."
            ) from None

    def logits(self, generation: int = -1, *, framework: str = "pt") -> tuple[Any, ...]:
        """Raw logits per step of one generation; see `Generation.logits` (mirrors `out.logits`)."""
        return self.generation(generation).logits(framework=framework)

    def scores(self, generation: int = -1, *, framework: str = "pt") -> tuple[Any, ...]:
        """Processed scores per step of one generation; see `Generation.scores` (mirrors `out.scores`)."""
        return self.generation(generation).scores(framework=framework)

    def tokens(self, generation: int = -1, *, framework: str = "pt") -> tuple[Any, ...]:
        """Chosen token per row and step; see `Generation.tokens`."""
        return self.generation(generation).tokens(framework=framework)

    def finished(self, generation: int = -1, *, framework: str = "pt") -> tuple[Any, ...]:
        """Rows already finished before each step; see `Generation.finished`."""
        return self.generation(generation).finished(framework=framework)

    def beam_indices(self, generation: int = -1, *, framework: str = "pt") -> Any:
        """Rows behind each returned beam-search sequence; see `Generation.beam_indices`."""
        return self.generation(generation).beam_indices(framework=framework)

    def beam_parents(self, generation: int = -1, *, framework: str = "pt") -> tuple[Any, ...]:
        """Parent row of each running beam, per step; see `Generation.beam_parents`."""
        return self.generation(generation).beam_parents(framework=framework)

    def clear(self) -> None:
        """Forget every recorded generation (frees their host memory)."""
        with self._lock:
            self._generations.clear()

    # -- called by the hooks ---------------------------------------------------------------------------
    def _begin_generation(self, *, assistant_model: Any, custom_generate: Any) -> Capture:
        if custom_generate is not None:
            raise ValueError(
                "`custom_generate` replaces transformers' decoding loop, which the Recorder cannot see "
                "into; remove the Recorder from `logits_processor` or drop `custom_generate`."
            )
        with self._lock:
            if self._active is not None:
                raise RuntimeError(
                    "this Recorder is already recording a generate() call (in another thread, or one "
                    "that has not returned): one Recorder records one call at a time. Give each "
                    "concurrent call its own Recorder."
                )
            self._active = Capture(
                streams=self._streams, ring_slots=self._ring_slots, assistant_model=assistant_model
            )
            return self._active

    def _end_generation(self, capture: Capture, output: Any, error: BaseException | None) -> None:
        try:
            if capture.started:
                if capture.accumulates_on_device and not self._warned_accumulation:
                    self._warned_accumulation = True
                    warnings.warn(
                        "this generate() call ran with `output_scores`/`output_logits` and "
                        "`return_dict_in_generate=True` (from its arguments or the model's "
                        "generation_config), so it kept every step's scores on the device "
                        "as well; the Recorder already has them. Drop those options to keep device "
                        "memory flat.",
                        DeviceAccumulationWarning,
                        stacklevel=3,
                    )
                generation = capture.finish(output, error)
                with self._lock:
                    self._generations.append(generation)
            elif error is None:
                raise RuntimeError(
                    f"{type(self._model).__name__}.generate() returned without building transformers' "
                    "logits-processor list, so nothing was recorded: this model's generate() is not "
                    "supported by transformers-offload."
                )
        finally:
            with self._lock:
                self._active = None

    # -- as a processor, it is never called while the hooks are in place ------------------------------
    def __call__(self, input_ids: torch.LongTensor, scores: Any) -> Any:  # type: ignore[override]
        """Never runs in a recorded call: the hooks take the recorder out of the lists they build.

        Reached only when `generate()` did not go through the model the recorder is attached to.

        Raises:
            RuntimeError: always, saying how to pass the recorder instead.
        """
        raise RuntimeError(
            f"this Recorder was called as an ordinary processor, so the call did not go through the "
            f"generate() of the model it records ({self._model_name}): a different model, "
            "`GenerationMixin.generate(model, ...)` called on the class, or a closed recorder. "
            "Create `Recorder(model)` for the model you call, keep it open, and call "
            "`model.generate(..., logits_processor=[rec])`."
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"Recorder({self._model_name}, streams={self._streams}, ring_slots={self._ring_slots}, "
            f"{len(self._generations)} generation(s), {state})"
        )
