"""Attentions and hidden states: which tensors of a forward output are recorded, and the selection.

`generate()` computes attention weights and hidden states when the model's forward is asked for them
(`output_attentions`, `output_hidden_states`), and keeps them only with `return_dict_in_generate`. The
recorder asks the forward itself (a keyword added by a forward pre-hook on the model and, for an
encoder-decoder model, on its encoder), so `generate()`'s own configuration is left alone and keeps
nothing. Each forward of the decoding loop is one step; its output carries one tensor per layer:

- decoder-only: `attentions` `(rows, heads, queries, keys)` and `hidden_states`
  `(rows, positions, hidden_size)` (entry 0 the embeddings);
- encoder-decoder: `decoder_attentions`, `cross_attentions` and `decoder_hidden_states` per step, and,
  at the first step, the `attentions` and `hidden_states` of the encoder's single run, taken from the
  encoder's own output (the object `generate()` keeps as `out.encoder_attentions`...; one row per
  prompt). A call given `encoder_outputs` runs no encoder: nothing of the encoder is recorded then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from .. import _compat
from ..store import layout as _layout
from ..store.layout import indices, resolve
from .module_taps import ModuleTaps

_NO_WEIGHTS = (
    "the model computed no `{kind}` in its forward; attention weights need eager attention: load the "
    "model with `attn_implementation=\"eager\"`."
)
STREAMS = ("attentions", "hidden_states")  # the Recorder's `streams` names that select these outputs
# Which outputs a Recorder stream records, by model kind.
_KINDS = {
    (False, "attentions"): ("attentions",),
    (False, "hidden_states"): ("hidden_states",),
    (True, "attentions"): ("encoder_attentions", "decoder_attentions", "cross_attentions"),
    (True, "hidden_states"): ("encoder_hidden_states", "decoder_hidden_states"),
}
# What the forward must be asked for, per Recorder stream.
_FLAGS = {"attentions": "output_attentions", "hidden_states": "output_hidden_states"}


def kinds(streams: Sequence[str], is_encoder_decoder: bool) -> tuple[str, ...]:
    """The outputs (`store.layout.LAYER_KINDS`) that `streams` record for this kind of model."""
    return tuple(kind for stream in streams if stream in STREAMS for kind in _KINDS[(is_encoder_decoder, stream)])


@dataclass
class Selection:
    """Which layers and heads to keep, and whether to keep only the newest position.

    Attributes:
        layers (`tuple[int, ...] | None`): indices into each output's tuple of layers (negative from the
            end); None keeps every layer.
        heads (`tuple[int, ...] | None`): indices into the heads axis of attentions; None keeps all.
        newest_position_only (`bool`): keep only the newest query position of decoder attentions and
            the newest position of decoder hidden states (the prefill step shrinks to one position;
            decode steps have one anyway). Encoder outputs are kept whole.
    """

    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    newest_position_only: bool = False


class LayerTap:
    """The selected per-layer tensors of one `generate()` call: taken from hooks on the modules that
    compute them where the model declares those (`module_taps`, installed by `install`), else picked
    out of each forward's output, which the forward is then asked for (`ask`, `names`, `pick`)."""

    def __init__(self, kinds: tuple[str, ...], selection: Selection, streams: Sequence[str], model: Any = None) -> None:
        self.kinds = kinds
        self.selection = selection
        self.model = model
        self.taps: ModuleTaps | None = None  # installed module hooks, for the call
        # The keyword arguments each forward of the call gets (`ask`), set once.
        self.forward_flags = {_FLAGS[stream]: True for stream in streams if stream in _FLAGS}
        self.counts: dict[str, int] = {}  # layers (tuple entries) of each recorded output
        self.heads: dict[str, list[int]] = {}  # per attention output, the selected heads, resolved
        self._layers: dict[str, tuple[int, ...]] = {}
        self._heads: dict[tuple[int, torch.device], Any] = {}  # (head count, device) -> index or slice
        self.encoder_output: Any = None  # what the encoder's forward returned, until the first step

    def _tensors(self, output: Any, kind: str) -> Any:
        if kind in _layout.ENCODER_KINDS:
            # Not the decoder output's `encoder_*` fields: T5 re-packs the encoder output by position
            # there, which puts the attentions in the hidden states' place when only they were asked.
            return getattr(self.encoder_output, kind[len("encoder_") :], None)
        return getattr(output, kind, None)

    def names(self, output: Any) -> tuple[list[str], list[str]]:
        """The per-step and the once-per-generation stream names, from the first forward's output.

        Raises:
            ValueError: the output lacks a requested tensor (the attention implementation returns none).
            IndexError: a selected layer or head is out of range.
        """
        per_step, once = [], []
        for kind in self.kinds:
            if kind in _layout.ENCODER_KINDS and self.encoder_output is None:
                continue  # the call passed `encoder_outputs`: no encoder ran
            tensors = self._tensors(output, kind)
            if not tensors or any(t is None for t in tensors):
                raise ValueError(_NO_WEIGHTS.format(kind=kind))
            self.counts[kind] = len(tensors)
            self._layers[kind] = resolve(self.selection.layers, len(tensors), f"`layers` for {kind}")
            if kind in _layout.ATTENTION_KINDS and self.selection.heads is not None:
                # Resolved per output: an encoder and a decoder may have different head counts.
                self.heads[kind] = list(resolve(self.selection.heads, tensors[0].shape[1], "`heads`"))
            names = [_layout.layer_stream(kind, layer) for layer in self._layers[kind]]
            (once if kind in _layout.ENCODER_KINDS else per_step).extend(names)
        return per_step, once

    def install(self, on_tensor: Callable[[str, torch.Tensor], None]) -> list[str] | None:
        """Hook the modules that compute the selected layers, where the model declares them: then each
        selected tensor reaches `on_tensor(stream, tensor)` (heads and positions selected) as soon as
        its module returns, and the per-step stream names are returned; else None (use `names`/`pick`).

        Raises:
            IndexError: a selected layer or head is out of range.
        """
        def resolved(count: int, kind: str) -> tuple[int, ...]:
            what = f"`layers` for {kind}" + (" (the embeddings are entry 0)" if kind == "hidden_states" else "")
            return resolve(self.selection.layers, count, what)

        head_count = getattr(_compat.text_config(getattr(self.model, "config", None)), "num_attention_heads", None)
        if self.model is None or not isinstance(head_count, int):
            return None
        taps = ModuleTaps.plan(self.model, self.kinds, resolved)
        if taps is None:
            return None
        self.counts = dict(taps.counts)
        self._layers = dict(taps.layers)
        if "attentions" in self.kinds and self.selection.heads is not None:
            self.heads["attentions"] = list(resolve(self.selection.heads, head_count, "`heads`"))

        def take(kind: str, name: str, tensor: Any) -> None:
            if tensor is None:
                raise ValueError(_NO_WEIGHTS.format(kind=kind))
            if kind == "attentions" and tensor.shape[1] != head_count:
                raise RuntimeError(
                    f"transformers-offload: the attention weights have {tensor.shape[1]} heads, the config "
                    f"says {head_count}; please report this with your transformers version."
                )
            on_tensor(name, self.select(kind, tensor, is_encoder=False))

        taps.install(take)
        self.taps = taps
        return list(taps.names)

    def on_encoder(self, output: Any) -> None:
        """The encoder's forward returned `output` (before the decoding loop): kept until the first step."""
        self.encoder_output = output

    def take_encoder_output(self, previous: LayerTap) -> None:
        """A new loop of the same call starts: its encoder ran while `previous`'s capture was active."""
        self.encoder_output, previous.encoder_output = previous.encoder_output, None

    def drop_encoder_output(self) -> None:
        """The encoder's outputs were copied at the first step: no reference to them is kept."""
        self.encoder_output = None

    def remove(self) -> None:
        """Remove the module hooks `install` put in place (idempotent)."""
        if self.taps is not None:
            self.taps.remove()

    def ask(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """A forward's keyword arguments with the outputs the recorder records switched on (none where
        module hooks take them)."""
        if self.taps is not None:
            return kwargs
        return {**kwargs, **self.forward_flags}

    def describe(self) -> dict[str, Any]:
        """The manifest's `layers` entry (once `names` has seen the first output)."""
        return {
            "counts": dict(self.counts),
            "heads": None if self.selection.heads is None else dict(self.heads),
            "newest_position_only": self.selection.newest_position_only,
        }

    def pick(self, output: Any, *, first: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """`(stream name, tensor)` for every selected layer of this forward's output (encoder outputs
        at the `first` forward only). The tensors are views or new tensors on the output's device."""
        for kind in self.kinds:
            is_encoder = kind in _layout.ENCODER_KINDS
            if kind not in self._layers or (is_encoder and not first):
                continue
            tensors = self._tensors(output, kind)
            for layer in self._layers[kind]:
                yield _layout.layer_stream(kind, layer), self.select(kind, tensors[layer], is_encoder=is_encoder)

    def select(self, kind: str, tensor: torch.Tensor, *, is_encoder: bool) -> torch.Tensor:
        """The selected heads and positions of one layer's tensor: a view, or a new tensor on its device."""
        if kind in _layout.ATTENTION_KINDS and self.selection.heads is not None:
            tensor = self._select_heads(tensor)
        if self.selection.newest_position_only and not is_encoder:
            tensor = tensor[..., -1:, :]  # queries (attentions) or positions (hidden states)
        return tensor

    def _select_heads(self, tensor: torch.Tensor) -> torch.Tensor:
        key = (tensor.shape[1], tensor.device)
        index = self._heads.get(key)
        if index is None:
            heads = resolve(self.selection.heads, tensor.shape[1], "`heads`")
            if heads == tuple(range(heads[0], heads[-1] + 1)):
                index = slice(heads[0], heads[-1] + 1)  # a view, no copy
            else:
                # Moved to the device once, from pinned memory: a plain copy from the host would wait.
                host = torch.tensor(heads, dtype=torch.long)
                index = host.pin_memory().to(tensor.device, non_blocking=True) if tensor.is_cuda else host
            self._heads[key] = index
        if isinstance(index, slice):
            return tensor[:, index]
        return tensor.index_select(1, index)


def selection(model: Any, streams: tuple[str, ...], layers: Any, heads: Any, newest: Any) -> Selection:
    """The Recorder's `layers`, `heads` and `newest_position_only`, checked (against the model's config
    where it gives the counts: decoder-only models).

    Raises:
        TypeError, ValueError: an option has the wrong type or value, or selects nothing recorded.
        IndexError: an index is out of range for the model's config.
    """
    records = [s for s in streams if s in STREAMS]
    layers, heads = indices(layers, "layers"), indices(heads, "heads")
    if not isinstance(newest, bool):
        raise TypeError(f"`newest_position_only` must be True or False, got {newest!r}.")
    if not records and (layers is not None or heads is not None or newest):
        raise ValueError(
            "`layers`, `heads` and `newest_position_only` select attentions and hidden states: add "
            "\"attentions\" and/or \"hidden_states\" to `streams`."
        )
    if heads is not None and "attentions" not in streams:
        raise ValueError("`heads` selects attention heads: add \"attentions\" to `streams`.")
    config = getattr(model, "config", None)
    text = _compat.text_config(config)
    if records and not getattr(config, "is_encoder_decoder", False):
        count = getattr(text, "num_hidden_layers", None)
        if isinstance(count, int) and layers is not None:
            if "attentions" in streams:
                resolve(layers, count, "`layers` for attentions")
            if "hidden_states" in streams:
                resolve(layers, count + 1, "`layers` for hidden_states (the embeddings are entry 0)")
        head_count = getattr(text, "num_attention_heads", None)
        if isinstance(head_count, int) and heads is not None:
            resolve(heads, head_count, "`heads`")
    return Selection(layers=layers, heads=heads, newest_position_only=newest)


def require_eager(model: Any) -> None:
    """Attention weights come from eager attention only: refuse anything else before generation."""
    found = _compat.attention_implementations(model)
    if found and found != {"eager"}:
        raise ValueError(
            f"recording \"attentions\" needs eager attention, and this {type(model).__name__} uses "
            f"{sorted(found)}, which does not return attention weights on every transformers release. "
            "Load it with `attn_implementation=\"eager\"` (e.g. `AutoModelForCausalLM.from_pretrained(..., "
            "attn_implementation=\"eager\")`), or drop \"attentions\" from `streams`."
        )
