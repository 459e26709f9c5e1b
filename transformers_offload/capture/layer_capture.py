"""The attentions' and hidden states' part of a call's capture: the selected layers of each step's forward,
taken by module hooks where the model declares its layers (`module_taps`), else from the forward's output,
and put into the ring under their stream names (`layers.LayerTap` picks them)."""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from .. import _interrupts
from .layers import LayerTap


class LayerCapture:
    """One call's layer recording through `tap`.

    Args:
        tap (`layers.LayerTap`): what is selected, and how it is taken from the model.
        put (`Callable[[int, str, torch.Tensor], None]`): puts a step's tensor into the ring.
        add_streams (`Callable[[list[str], list[str], dict], None]`): tells the store the per-step and
            once-per-call streams, and the manifest's `layers` entry.
        in_lists (`Callable[[], bool]`): whether a processor or criterion is running (its forwards are not
            the loop's).
    """

    def __init__(self, tap: LayerTap, *, put: Callable[[int, str, torch.Tensor], None],
                 add_streams: Callable[[list[str], list[str], dict[str, Any]], None], in_lists: Callable[[], bool]) -> None:
        self.tap = tap
        self.names: list[str] = []  # per-step layer streams, known from the first forward
        self.selection: dict[str, Any] | None = None  # the manifest's `layers` entry, once known
        self._put, self._add_streams, self._in_lists = put, add_streams, in_lists
        self._fired = 0  # selected layers the module hooks put in the current forward
        self._forwards = 0  # forwards of the decoding loop so far
        self._thread = threading.get_ident()  # the thread running the call

    def start(self) -> None:
        """Install the module hooks, where the model declares its layers (their streams are known now)."""
        names = self.tap.install(self._on_layer)
        if names is not None:
            self._known(names, [])

    def on_forward(self, output: Any) -> None:
        """A forward of the decoding loop ended: its layers (every forward is one step in the modes
        that record them), from `output` unless the module hooks put them already."""
        step = self._forwards
        self._forwards += 1
        if self.tap.taps is not None:
            fired, self._fired = self._fired, 0
            if fired != len(self.names):
                raise RuntimeError(
                    f"transformers-offload: the hooks on this model's layers ran {fired} times in the "
                    f"forward of step {step}, for {len(self.names)} selected layers; its layers do "
                    "not run as its class declares. Please report this with your transformers version."
                )
            return
        if step == 0:
            self._known(*self.tap.names(output))
        for name, tensor in self.tap.pick(output, first=step == 0):
            self._put(step, name, tensor)
        if step == 0:
            self.tap.drop_encoder_output()  # copied: the capture keeps no reference to it

    def _known(self, per_step: list[str], once: list[str]) -> None:
        self.names = per_step
        self.selection = self.tap.describe()
        self._add_streams(per_step, once, self.selection)

    def _on_layer(self, name: str, tensor: torch.Tensor) -> None:
        """A selected layer's tensor, from its module's hook, in the forward of step `_forwards`."""
        if self._in_lists() or threading.get_ident() != self._thread:
            return  # a forward made by a processor, or another thread's call of the same model
        with _interrupts.held():
            self._fired += 1
            self._put(self._forwards, name, tensor)

    def close(self) -> None:
        """Remove the module hooks (idempotent)."""
        self.tap.remove()
