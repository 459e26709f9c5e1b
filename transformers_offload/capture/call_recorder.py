"""What the hooks ask of a recorder, as a `Protocol` of public names: the hooks never import the recorder."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from .capture import Capture


@runtime_checkable
class CallRecorder(Protocol):
    """What the hooks ask of a recorder (the `Recorder` is one): they find one in a call's
    `logits_processor`, check it, and hand it the call's start and end. They never import the recorder.

    Attributes:
        closed (`bool`): True once the recorder was closed (its calls are refused).
        generations (`tuple`): what it recorded so far (a delegating call must add one).
        streams (`tuple[str, ...]`): what it records (the mode check needs it).
        model_name (`str`): the model it is attached to, for error messages.
        every_call (`bool`): it records the model's calls that were not given it, too.
    """

    closed: bool
    generations: tuple
    streams: tuple[str, ...]
    model_name: str
    every_call: bool

    def begin_call(self, *, assistant_model: Any, custom_generate: Any, attention_mask: torch.Tensor | None,
                   inputs: torch.Tensor | None = None, past_key_values: Any = None) -> Capture:
        """Start recording one call (before its decoding loop); returns the call's capture. `inputs`:
        the call's prompt ids or embeddings (batch first), where it passed them; `past_key_values`: the
        cache it was given."""
        ...

    def end_call(self, capture: Capture, output: Any, error: BaseException | None) -> None:
        """End the call's recording: `output` is what generate() returned (None when `error` ended it)."""
        ...

    def unrecorded_call(self) -> None:
        """The model's `generate()` ran, outside any recorded call, without this recorder in its
        `logits_processor` (the recorder may say so when it closes having recorded nothing)."""
        ...

    def check_call(self, *, custom_generate: Any, attention_mask: torch.Tensor | None,
                   inputs: torch.Tensor | None = None, past_key_values: Any = None) -> None:
        """What `begin_call` would refuse, raised before the call runs, for a call whose capture
        begins only when its own loop starts (a model with generating children)."""
        ...

    def record_batch(self, generate_batch: Any, *args: Any, **kwargs: Any) -> Any:
        """Run `generate_batch(*args, **kwargs)` (the model's continuous batching, given this recorder in
        its `logits_processor`, now taken out) recording each request; returns what it returns."""
        ...
