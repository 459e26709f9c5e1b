"""Attentions and hidden states taken from the modules that compute them, one selected layer at a time.

Asking a forward for `output_attentions=True` makes every layer return its attention weights and the
model hold all of them until the forward returns: for SmolLM2 and a 1,000-token prompt, about 1 GiB
at the prefill, whatever part of them the recorder then keeps. Where a model's class declares which
module computes each output (`_compat.capture_points`: transformers' own capture points), the recorder
asks the forward for nothing and instead, for the duration of a recorded call, puts forward hooks on
the selected layers' modules only. Each hook hands its tensor (the module's output at the declared
index; for hidden-state entry 0 the first layer's input; for the last entry the model's
`last_hidden_state`) to the capture as soon as the module returns, which copies the selected heads and
positions into the ring; the model keeps computing one layer's weights at a time, as without the
recorder, and frees them. The values are the very tensors transformers would have collected.

A model whose class declares no capture point for an output (releases before 4.57, most classes before
5.x), an encoder-decoder model, or one nesting another model inside its base model is recorded the
older way (`layers.LayerTap` asks its forward for every layer and keeps the selected ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .. import _compat
from ..store import layout as _layout

# The Recorder's kinds that module taps can record, and the declared output each comes from.
_DECLARED = {"attentions": "attentions", "hidden_states": "hidden_states"}

OnTensor = Callable[[str, str, torch.Tensor], None]  # (kind, stream name, tensor)


@dataclass(frozen=True)
class _Tap:
    kind: str
    name: str  # the stream, e.g. "attentions.29"
    module: torch.nn.Module
    take: str  # "output" (at `index`), "input" (the first positional argument) or "last_hidden_state"
    index: int


class ModuleTaps:
    """The hooks of one recorded call on the modules that compute its selected layers.

    Attributes:
        counts (`dict[str, int]`): the layers (tuple entries) of each output, as `out.attentions` /
            `out.hidden_states` would hold them.
        layers (`dict[str, tuple[int, ...]]`): the selected layers of each output, in order.
        names (`list[str]`): the per-step stream names, in layer order per kind.
    """

    def __init__(self, taps: list[_Tap], counts: dict[str, int], layers: dict[str, tuple[int, ...]]) -> None:
        self._taps = taps
        self.counts = counts
        self.layers = layers
        self.names = [tap.name for tap in taps]
        self._handles: list[Any] = []

    @classmethod
    def plan(cls, model: Any, kinds: tuple[str, ...], layers: Callable[[int, str], tuple[int, ...]]) -> ModuleTaps | None:
        """The taps for `kinds` on `model`, keeping the layers `layers(count, kind)` resolves; None
        where the model does not declare where every kind is computed (the forward is asked instead).

        Raises:
            IndexError: a selected layer is out of range (from `layers`).
        """
        if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            return None
        base = getattr(model, "base_model", None)
        points = _compat.capture_points(base) if isinstance(base, torch.nn.Module) else {}
        if not all(kind in _DECLARED and _DECLARED[kind] in points for kind in kinds):
            return None
        found: dict[str, list[torch.nn.Module]] = {kind: [] for kind in kinds}
        for name, module in base.named_modules():
            if module is not base and _is_model(module):
                return None  # a model inside the model: its own declarations would apply
            for kind in kinds:
                if _compat.matches(points[_DECLARED[kind]], "." + name if name else "", module):
                    found[kind].append(module)
        if not all(found.values()):
            return None
        taps, counts, selected = [], {}, {}
        for kind in kinds:
            point, modules = points[_DECLARED[kind]], found[kind]
            if kind == "hidden_states":
                entries = _hidden_state_entries(base, modules, point)
            else:
                entries = [(module, "output", point.index) for module in modules]
            counts[kind] = len(entries)
            selected[kind] = layers(len(entries), kind)
            for layer in selected[kind]:
                module, take, index = entries[layer]
                taps.append(_Tap(kind, _layout.layer_stream(kind, layer), module, take, index))
        return cls(taps, counts, selected)

    def install(self, on_tensor: OnTensor) -> None:
        """Hook every tap's module; each hook calls `on_tensor(kind, stream, tensor)` when it runs."""
        try:
            for tap in self._taps:
                self._handles.append(tap.module.register_forward_hook(_hook(tap, on_tensor)))
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Remove every hook (idempotent)."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()


def _hidden_state_entries(base: torch.nn.Module, modules: list[torch.nn.Module],
                          point: _compat.CapturePoint) -> list[tuple[torch.nn.Module, str, int]]:
    """Where each entry of `out.hidden_states` comes from, in order."""
    entries = [(modules[0], "input", 0)] if point.capture_initial else []
    entries += [(module, "output", point.index) for module in modules]
    if _compat.ties_last_hidden_state(getattr(base, "config", None)):
        entries[-1] = (base, "last_hidden_state", 0)
    return entries


def _hook(tap: _Tap, on_tensor: OnTensor) -> Callable[..., None]:
    def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
        if tap.take == "input":
            if not args or not isinstance(args[0], torch.Tensor):
                raise RuntimeError(
                    f"transformers-offload: {type(module).__name__} was not given its hidden states as its "
                    "first positional argument, so the recorder cannot take hidden-state entry 0 there; "
                    "please report this with your transformers version."
                )
            tensor = args[0]
        elif tap.take == "last_hidden_state":
            tensor = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        else:
            tensor = output[tap.index] if isinstance(output, tuple) else output
        on_tensor(tap.kind, tap.name, tensor)

    return hook


def _is_model(module: torch.nn.Module) -> bool:
    from transformers import PreTrainedModel

    return isinstance(module, PreTrainedModel)
