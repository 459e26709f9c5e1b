"""The accessors of a recording: `Recording`, `RankedRecording` and the `Recorder` read one generation
(default: the latest) through these, each a thin call of that `Generation`'s own accessor.

`Readable` asks its subclass for `generations` and `generation(index)`. `MemoryRecording` holds
generations in memory; the `Recorder` owns one and reads through it (`reads_through`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, Sequence, TypeVar

from .._lazy import torch  # imported when first used: reading a manifest needs no torch (`inspect`, `verify`)

from . import display
from .generation import Generation, pick
from .indexing import Rows, Steps
from .layer_reading import LayerArray
from .samples import samples as _samples

T = TypeVar("T")


class Readable:
    """Accessors shared by `Recorder` and `Recording`: each reads one generation (default: the latest)."""

    generations: Sequence[Generation]  # provided by the subclass, oldest first

    def generation(self, index: int = -1) -> Generation:  # pragma: no cover - overridden
        raise NotImplementedError

    def _repr_html_(self) -> str | None:
        """The viewer's page of every generation, for notebooks (`answers.viewer`); None while empty."""
        return display.html(self) if getattr(self, "generations", ()) else None

    def logits(self, generation: int = -1, *, steps: Steps = None, rows: Rows = None,
               framework: str = "pt") -> tuple[Any, ...]:
        """Raw logits per step of one generation; see `Generation.logits` (mirrors `out.logits`)."""
        return self.generation(generation).logits(steps=steps, rows=rows, framework=framework)

    def scores(self, generation: int = -1, *, steps: Steps = None, rows: Rows = None,
               framework: str = "pt") -> tuple[Any, ...]:
        """Processed scores per step of one generation; see `Generation.scores` (mirrors `out.scores`)."""
        return self.generation(generation).scores(steps=steps, rows=rows, framework=framework)

    def tokens(self, generation: int = -1, *, steps: Steps = None, rows: Rows = None,
               framework: str = "pt") -> tuple[Any, ...]:
        """Chosen token per row and step; see `Generation.tokens`."""
        return self.generation(generation).tokens(steps=steps, rows=rows, framework=framework)

    def stats(self, generation: int = -1, *, steps: Steps = None, rows: Rows = None,
              framework: str = "pt") -> tuple[dict[str, Any], ...]:
        """Per-token statistics per step of one generation: a dict of `(rows,)` tensors per step; see
        `Generation.step_stats`."""
        return self.generation(generation).step_stats(steps=steps, rows=rows, framework=framework)

    def finished(self, generation: int = -1, *, steps: Steps = None, rows: Rows = None,
                 framework: str = "pt") -> tuple[Any, ...]:
        """Rows already finished before each step; see `Generation.finished`."""
        return self.generation(generation).finished(steps=steps, rows=rows, framework=framework)

    def beam_parents(self, generation: int = -1, *, steps: Steps = None, rows: Rows = None,
                     framework: str = "pt") -> tuple[Any, ...]:
        """Parent row of each running beam, per step; see `Generation.beam_parents`."""
        return self.generation(generation).beam_parents(steps=steps, rows=rows, framework=framework)

    def beam_indices(self, generation: int = -1, *, framework: str = "pt") -> Any:
        """Rows behind each returned beam-search sequence; see `Generation.beam_indices`."""
        return self.generation(generation).beam_indices(framework=framework)

    def logprobs(self, generation: int = -1, *, kind: str = "raw", top: int = 0, tokenizer: Any = None,
                 chunk_steps: int = 16) -> list[list[dict[str, Any]]]:
        """Per returned sequence and token: logprob, rank and top alternatives; see `Generation.logprobs`."""
        return self.generation(generation).logprobs(kind=kind, top=top, tokenizer=tokenizer, chunk_steps=chunk_steps)

    def prompt_logprobs(self, generation: int = -1, *, tokenizer: Any = None) -> list[list[dict[str, Any]]]:
        """Per prompt and prompt token: logprob, rank and top alternatives; see `Generation.prompt_logprobs`."""
        return self.generation(generation).prompt_logprobs(tokenizer=tokenizer)

    def samples(self) -> list[dict[str, Any]]:
        """Every prompt of every generation, in order, mapped to its rows and returned sequences.

        Returns:
            `list[dict]`, one per prompt: `sample` (its id: what `Recorder.set_samples` gave, else its
            position among every prompt of the recording, an int), `generation` and `prompt` (its
            position in that call's batch), `rows` (its rows in each step: `num_beams` or
            `num_return_sequences` of them), `sequences` (its rows of `out.sequences`; empty for an
            incomplete generation), `prompt_length` (tokens without padding, or None without an
            attention mask), `metadata` (what `set_samples` gave with it, or None) and `complete` (its
            generation's: after a resumed `record`, keep the complete entries for one per sample).

        Example:
            >>> run.samples()[0]  # doctest: +SKIP
            {'sample': 'q1', 'generation': 0, 'prompt': 0, 'rows': [0], 'sequences': [0], 'prompt_length': 9, 'metadata': None}
        """
        return _samples(self.generations)

    def transition_scores(self, generation: int = -1, *, normalize_logits: bool = False) -> torch.Tensor:
        """Each returned sequence's token score per step; see `Generation.transition_scores` (equals
        `model.compute_transition_scores(out.sequences, out.scores, out.beam_indices, normalize_logits)`)."""
        return self.generation(generation).transition_scores(normalize_logits=normalize_logits)

    def topk(self, stream: str = "scores", generation: int = -1, *, steps: Steps = None, rows: Rows = None,
             framework: str = "pt") -> tuple[dict[str, Any], ...]:
        """The top-k record of `stream` per step of one generation; see `Generation.topk`."""
        return self.generation(generation).topk(stream, steps=steps, rows=rows, framework=framework)

    def sampled_targets(self, stream: str = "scores", generation: int = -1, *, steps: Steps = None,
                        rows: Rows = None, framework: str = "pt") -> tuple[dict[str, Any], ...]:
        """The tokens sampled from `stream` per step of one generation; see `Generation.sampled_targets`."""
        return self.generation(generation).sampled_targets(stream, steps=steps, rows=rows, framework=framework)

    def sparse(self, stream: str = "scores", generation: int = -1, *, steps: Steps = None, rows: Rows = None,
               framework: str = "pt") -> tuple[dict[str, Any], ...]:
        """The entries of `stream` that are not -inf, per step of one generation; see `Generation.sparse`."""
        return self.generation(generation).sparse(stream, steps=steps, rows=rows, framework=framework)

    def attentions(self, generation: int = -1, *, steps: Steps = None, rows: Rows = None,
                   layers: Sequence[int] | None = None, framework: str = "pt") -> tuple[tuple[Any, ...], ...]:
        """Attention weights per step and layer; see `Generation.attentions` (mirrors `out.attentions`)."""
        return self.generation(generation).attentions(steps=steps, rows=rows, layers=layers, framework=framework)

    def hidden_states(self, generation: int = -1, *, steps: Steps = None, rows: Rows = None,
                      layers: Sequence[int] | None = None, framework: str = "pt") -> tuple[tuple[Any, ...], ...]:
        """Hidden states per step and layer; see `Generation.hidden_states` (mirrors `out.hidden_states`)."""
        return self.generation(generation).hidden_states(steps=steps, rows=rows, layers=layers, framework=framework)

    def decoder_attentions(self, generation: int = -1, *, steps: Steps = None, rows: Rows = None,
                           layers: Sequence[int] | None = None, framework: str = "pt") -> tuple[tuple[Any, ...], ...]:
        """See `Generation.decoder_attentions` (mirrors `out.decoder_attentions`)."""
        return self.generation(generation).decoder_attentions(steps=steps, rows=rows, layers=layers, framework=framework)

    def cross_attentions(self, generation: int = -1, *, steps: Steps = None, rows: Rows = None,
                         layers: Sequence[int] | None = None, framework: str = "pt") -> tuple[tuple[Any, ...], ...]:
        """See `Generation.cross_attentions` (mirrors `out.cross_attentions`)."""
        return self.generation(generation).cross_attentions(steps=steps, rows=rows, layers=layers, framework=framework)

    def decoder_hidden_states(self, generation: int = -1, *, steps: Steps = None, rows: Rows = None,
                              layers: Sequence[int] | None = None, framework: str = "pt") -> tuple[tuple[Any, ...], ...]:
        """See `Generation.decoder_hidden_states` (mirrors `out.decoder_hidden_states`)."""
        return self.generation(generation).decoder_hidden_states(steps=steps, rows=rows, layers=layers, framework=framework)

    def encoder_attentions(self, generation: int = -1, *, rows: Rows = None, layers: Sequence[int] | None = None,
                           framework: str = "pt") -> tuple[Any, ...]:
        """See `Generation.encoder_attentions` (mirrors `out.encoder_attentions`)."""
        return self.generation(generation).encoder_attentions(rows=rows, layers=layers, framework=framework)

    def encoder_hidden_states(self, generation: int = -1, *, rows: Rows = None, layers: Sequence[int] | None = None,
                              framework: str = "pt") -> tuple[Any, ...]:
        """See `Generation.encoder_hidden_states` (mirrors `out.encoder_hidden_states`)."""
        return self.generation(generation).encoder_hidden_states(rows=rows, layers=layers, framework=framework)

    def layer_array(self, kind: str, layer: int, generation: int = -1, *, steps: Steps = None, rows: Rows = None,
                    framework: str = "pt") -> LayerArray:
        """One recorded layer as one zero-padded array with lengths; see `Generation.layer_array`."""
        return self.generation(generation).layer_array(kind, layer, steps=steps, rows=rows, framework=framework)


class MemoryRecording(Readable):
    """Generations held in host memory, read with a `Recording`'s accessors: what a `Recorder` reads
    through. It holds them in the order appended, oldest first.

    Args:
        empty (`str`): the message of the `LookupError` raised when a generation is asked of it while
            it holds none (say what to do).
    """

    def __init__(self, *, empty: str) -> None:
        self._generations: list[Generation] = []
        self._empty = empty

    @property
    def generations(self) -> tuple[Generation, ...]:
        """Every generation, oldest first (incomplete ones included)."""
        return tuple(self._generations)

    def generation(self, index: int = -1) -> Generation:
        """One generation by index (default: the latest).

        Raises:
            LookupError: it holds no generation (with the `empty` message), or `index` is out of range.
        """
        return pick(self._generations, index, self._empty)

    def append(self, generation: Generation) -> None:
        """Add the newest generation."""
        self._generations.append(generation)

    def clear(self) -> None:
        """Forget every generation."""
        self._generations.clear()

    def __iter__(self) -> Iterator[Generation]:
        return iter(self._generations)

    def __len__(self) -> int:
        return len(self._generations)


# Readable's accessors that `reads_through` forwards: all but `generation`, which a reader defines itself.
ACCESSORS = tuple(name for name, value in vars(Readable).items()
                  if callable(value) and not name.startswith("__") and name != "generation")


def reads_through(attribute: str) -> Callable[[type[T]], type[T]]:
    """A class decorator: give the class every `Readable` accessor (`logits()`, `scores()`, `topk()`,
    `attentions()`...) as a method that calls the same accessor of the `Readable` its instances hold in
    `attribute`, with the accessor's name, signature and docstring (as `help()` shows them). A name the
    class defines itself is left alone.

    Example:
        >>> @reads_through("_recording")  # doctest: +SKIP
        ... class Recorder: ...
    """

    def decorate(cls: type[T]) -> type[T]:
        for name in ACCESSORS:
            if name not in vars(cls):
                setattr(cls, name, _forward(cls, attribute, name))
        return cls

    return decorate


def _forward(cls: type, attribute: str, name: str) -> Callable[..., Any]:
    @functools.wraps(getattr(Readable, name))
    def accessor(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(getattr(self, attribute), name)(*args, **kwargs)

    accessor.__qualname__ = f"{cls.__qualname__}.{name}"
    return accessor
