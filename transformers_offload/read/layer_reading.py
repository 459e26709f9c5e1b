"""Reading recorded attentions and hidden states: Hugging Face's nested layout, and per-layer arrays.

`LayerReading` gives `Generation` its per-layer accessors (`read.readable` the same on `Recorder` and
`Recording`: one generation, default the latest). Each recorded layer is its own stream
(`attentions.3`, see `store.layout.layer_stream`), stored without padding; these accessors put the layers
back in `generate()`'s layout, or join one layer's steps into one zero-padded array with lengths.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple, Sequence

from .._lazy import torch  # imported when first used: reading a manifest needs no torch (`inspect`, `verify`)
from ..errors import StreamNotRecorded
from ..store import layout as _layout
from .indexing import Rows, Steps, as_framework, check_framework, step_range


class LayerArray(NamedTuple):
    """One recorded layer's steps joined along the positions axis, zero-padded on the last axis.

    The positions are every recorded query position in step order: the prefill's prompt positions
    (step 0; one with `newest_position_only`), then one per decode step. For a causal model's
    self-attention, `values` is the attention map of the whole sequence, row `i` attending to its first
    `lengths[i]` keys. Rows are each step's rows (in beam search the running beams of that step).

    Attributes:
        values (`torch.Tensor` or `np.ndarray`): attentions `(rows, heads, positions, max_keys)`, hidden
            states `(rows, positions, hidden_size)`; in the recorded dtype, on CPU; zero past each
            position's length.
        lengths (int64 `(positions,)`): valid entries of the last axis per position: the width of
            that step's tensor as recorded, i.e. the keys a query attended over (with a static cache,
            the cache's length, which transformers' attention weights span), or the hidden size.
        steps (int64 `(positions,)`): the step each position belongs to (0 for encoder outputs).
    """

    values: Any
    lengths: Any
    steps: Any


class LayerReading:
    """Per-layer accessors of one generation (mixed into `Generation`)."""

    num_steps: int
    layers: dict[str, Any] | None

    def attentions(self, *, steps: Steps = None, rows: Rows = None, layers: Sequence[int] | None = None,
                   framework: str = "pt") -> tuple[tuple[Any, ...], ...]:
        """Attention weights per step and layer, of a decoder-only model.

        Mirrors `out.attentions` of the same call made with `return_dict_in_generate=True,
        output_attentions=True`: a tuple over the selected steps of tuples over the recorded layers
        (in layer order) of tensors `(rows, heads, queries, keys)`, in the model's dtype, on CPU. Step 0
        (the prefill) has one query per prompt position, later steps one (`queries` is 1 throughout
        with `newest_position_only`); `keys` grows by one per step. Recorded with `heads`, the heads
        axis holds those heads only.

        Args:
            steps (`int | slice | range`, *optional*): which steps (an int: that one step); default all.
            rows (`int | slice | Sequence[int]`, *optional*): which rows; an int drops the row axis.
            layers (`Sequence[int]`, *optional*): which recorded layers, as indices into the model's
                layers (negative from the end); default every recorded one.
            framework (`str`): `"pt"` for torch tensors, `"np"` for NumPy arrays.

        Raises:
            KeyError: attentions were not recorded (create the Recorder with `"attentions"` in
                `streams`; an encoder-decoder model's are `decoder_attentions()`...), or a layer in
                `layers` was not recorded.
            IndexError, ValueError, TypeError: as in `Generation.logits()`.

        Example:
            >>> [a.shape for a in gen.attentions(steps=slice(1, 2))[0]]  # doctest: +SKIP
            [torch.Size([1, 9, 1, 24]), ...]
        """
        return self._per_step_layers("attentions", steps, rows, layers, framework)

    def hidden_states(self, *, steps: Steps = None, rows: Rows = None, layers: Sequence[int] | None = None,
                      framework: str = "pt") -> tuple[tuple[Any, ...], ...]:
        """Hidden states per step and layer, of a decoder-only model; mirrors `out.hidden_states`.

        A tuple over steps of tuples over the recorded entries of tensors `(rows, positions,
        hidden_size)`: entry 0 is the embeddings' output, entry `i` layer `i`'s (`layers` indexes these
        `num_hidden_layers + 1` entries). Step 0 has every prompt position, later steps one.
        Arguments and errors as in `attentions()`.
        """
        return self._per_step_layers("hidden_states", steps, rows, layers, framework)

    def decoder_attentions(self, *, steps: Steps = None, rows: Rows = None, layers: Sequence[int] | None = None,
                           framework: str = "pt") -> tuple[tuple[Any, ...], ...]:
        """Encoder-decoder models: the decoder's self-attention weights per step and layer; mirrors
        `out.decoder_attentions`. Shapes, arguments and errors as in `attentions()`."""
        return self._per_step_layers("decoder_attentions", steps, rows, layers, framework)

    def cross_attentions(self, *, steps: Steps = None, rows: Rows = None, layers: Sequence[int] | None = None,
                         framework: str = "pt") -> tuple[tuple[Any, ...], ...]:
        """Encoder-decoder models: the decoder's attention over the encoder output per step and layer,
        `(rows, heads, queries, source_length)`; mirrors `out.cross_attentions`. Arguments and errors
        as in `attentions()`."""
        return self._per_step_layers("cross_attentions", steps, rows, layers, framework)

    def decoder_hidden_states(self, *, steps: Steps = None, rows: Rows = None, layers: Sequence[int] | None = None,
                              framework: str = "pt") -> tuple[tuple[Any, ...], ...]:
        """Encoder-decoder models: the decoder's hidden states per step and entry; mirrors
        `out.decoder_hidden_states`. Shapes as in `hidden_states()`, arguments and errors as in
        `attentions()`."""
        return self._per_step_layers("decoder_hidden_states", steps, rows, layers, framework)

    def encoder_attentions(self, *, rows: Rows = None, layers: Sequence[int] | None = None,
                           framework: str = "pt") -> tuple[Any, ...]:
        """Encoder-decoder models: the encoder's attention weights, recorded once per generation.

        Mirrors `out.encoder_attentions`: a tuple over the recorded layers of tensors `(prompts, heads,
        source_length, source_length)` with one row per prompt (not per returned sequence or beam, as
        `generate()` keeps them). Kept whole (`newest_position_only` does not apply). `rows` indexes
        the prompts. Errors as in `attentions()`.
        """
        return self._encoder_layers("encoder_attentions", rows, layers, framework)

    def encoder_hidden_states(self, *, rows: Rows = None, layers: Sequence[int] | None = None,
                              framework: str = "pt") -> tuple[Any, ...]:
        """Encoder-decoder models: the encoder's hidden states `(prompts, source_length, hidden_size)`
        per recorded entry (0: the embeddings); mirrors `out.encoder_hidden_states`. As in
        `encoder_attentions()`."""
        return self._encoder_layers("encoder_hidden_states", rows, layers, framework)

    def layer_array(self, kind: str, layer: int, *, steps: Steps = None, rows: Rows = None,
                    framework: str = "pt") -> LayerArray:
        """One recorded layer of output `kind` as a single array with its lengths (see `LayerArray`).

        Args:
            kind (`str`): `"attentions"`, `"hidden_states"`, or an encoder-decoder model's
                `"decoder_attentions"`, `"cross_attentions"`, `"decoder_hidden_states"`,
                `"encoder_attentions"`, `"encoder_hidden_states"`.
            layer (`int`): the layer, as an index into the model's layers (negative from the end).
            steps, rows, framework: as in `attentions()` (`steps` does not apply to encoder outputs).

        Raises:
            ValueError: `kind` is not one of those names.
            KeyError: that output or layer was not recorded.

        Example:
            >>> array = gen.layer_array("attentions", -1, rows=0)  # doctest: +SKIP
            >>> array.values.shape, array.lengths[-1]  # (heads, positions, max_keys), keys of the last step
        """
        check_framework(framework)
        if kind not in _layout.LAYER_KINDS:
            raise ValueError(f"`kind` must be one of {_layout.LAYER_KINDS}, got {kind!r}.")
        if isinstance(layer, bool) or not hasattr(layer, "__index__"):
            raise TypeError(f"`layer` must be an int (a layer index), got {layer!r}.")
        if self.num_steps == 0 and kind not in self.layer_indices:  # a call that failed before its first step
            step_range(steps, 0)  # checks the arguments
            array = _join_positions([], [], None)
        else:
            (name,) = self._layer_names(kind, [operator.index(layer)])
            if kind in _layout.ENCODER_KINDS:
                parts, numbers = [self._read_once(name, rows, "pt")], [0]
            else:
                parts, numbers = list(self._get(name, steps, rows, "pt")), list(step_range(steps, self.num_steps))
            # No step selected: an empty array of the recorded dtype and leading shape (read from step 0).
            like = parts[0] if parts else self._get(name, range(0, 1), rows, "pt")[0] if self.num_steps else None
            array = _join_positions(parts, numbers, like)
        return LayerArray(*(as_framework(part, kind, framework) for part in array))

    @property
    def layer_indices(self) -> dict[str, tuple[int, ...]]:
        """The recorded layers of each recorded output, e.g. `{"attentions": (0, 29)}`."""
        found: dict[str, list[int]] = {}
        for name in (*self.streams, *self.once_streams):
            split = _layout.split_layer_stream(name)
            if split is not None:
                found.setdefault(split[0], []).append(split[1])
        return {kind: tuple(sorted(layers)) for kind, layers in found.items()}

    # -- helpers -------------------------------------------------------------------------------------
    def _per_step_layers(self, kind: str, steps: Steps, rows: Rows, layers: Sequence[int] | None,
                         framework: str) -> tuple[tuple[Any, ...], ...]:
        if self.num_steps == 0:  # a call that failed before its first step
            self._get("tokens", steps, rows, framework)  # checks the arguments
            _layout.indices(layers, "layers")
            return ()
        per_layer = [self._get(name, steps, rows, framework) for name in self._layer_names(kind, layers)]
        return tuple(zip(*per_layer))

    def _encoder_layers(self, kind: str, rows: Rows, layers: Sequence[int] | None, framework: str) -> tuple[Any, ...]:
        if self.num_steps == 0 and kind not in self.layer_indices:
            check_framework(framework)
            _layout.indices(layers, "layers")
            return ()  # a call that failed before the encoder's outputs were kept
        return tuple(self._read_once(name, rows, framework) for name in self._layer_names(kind, layers))

    def _layer_names(self, kind: str, layers: Sequence[int] | None) -> list[str]:
        recorded = self.layer_indices.get(kind)
        if not recorded:
            other = [k for k in self.layer_indices if k.endswith(kind.split("_", 1)[-1])]
            hint = f" It holds {other}: read those instead." if other else (
                " Create the Recorder with `streams=(..., \"attentions\", \"hidden_states\")` to record them."
            )
            raise StreamNotRecorded(f"this recording has no {kind!r}.{hint}")
        layers = _layout.indices(layers, "layers")
        if layers is None:
            return [_layout.layer_stream(kind, layer) for layer in recorded]
        count = (self.layers or {}).get("counts", {}).get(kind, max(recorded) + 1)
        chosen = _layout.resolve(layers, count, f"`layers` for {kind}")
        missing = [layer for layer in chosen if layer not in recorded]
        if missing:
            raise StreamNotRecorded(f"layers {missing} of {kind!r} were not recorded; recorded: {list(recorded)}.")
        return [_layout.layer_stream(kind, layer) for layer in chosen]

    # Provided by `Generation`.
    streams: tuple[str, ...]

    def _get(self, name: str, steps: Steps, rows: Rows, framework: str) -> tuple[Any, ...]:  # pragma: no cover
        raise NotImplementedError

    def _read_once(self, name: str, rows: Rows, framework: str) -> Any:  # pragma: no cover
        raise NotImplementedError

    @property
    def once_streams(self) -> tuple[str, ...]:  # pragma: no cover
        raise NotImplementedError


def _join_positions(parts: list[torch.Tensor], steps: list[int], like: torch.Tensor | None) -> LayerArray:
    """Concatenate per-step tensors `(..., positions, width)` along positions, zero-padding widths
    (none: an empty array shaped and typed like `like`, if there is one)."""
    if not parts:
        empty = torch.zeros(0, dtype=torch.int64)
        values = torch.zeros(0) if like is None else torch.zeros((*like.shape[:-2], 0, 0), dtype=like.dtype)
        return LayerArray(values, empty, empty)
    width = max(part.shape[-1] for part in parts)
    positions = sum(part.shape[-2] for part in parts)
    values = torch.zeros((*parts[0].shape[:-2], positions, width), dtype=parts[0].dtype)
    lengths, step_of = [], []
    at = 0
    for step, part in zip(steps, parts):
        count = part.shape[-2]
        values[..., at : at + count, : part.shape[-1]] = part
        lengths += [part.shape[-1]] * count
        step_of += [step] * count
        at += count
    return LayerArray(values, torch.tensor(lengths, dtype=torch.int64), torch.tensor(step_of, dtype=torch.int64))
