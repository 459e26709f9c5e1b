"""The accessors of a recording, written once: `Recording`, `RankedRecording` and the `Recorder` are each a
`Readable`, whose accessors read one generation (default: the latest) through that `Generation`'s own.

A subclass holds its generations, oldest first, in `_generations` and says in `_none_recorded()` what to do
when it holds none.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterator, Sequence

from . import display
from .generation import Generation, pick
from .samples import samples as _samples


class Readable:
    """Accessors shared by `Recorder`, `Recording` and `RankedRecording`: each reads one generation
    (default: the latest)."""

    _generations: Sequence[Generation]  # set by the subclass, oldest first

    def _none_recorded(self) -> str:  # pragma: no cover - overridden
        """The message of the `LookupError` raised when a generation is asked of an empty recording."""
        raise NotImplementedError

    @property
    def generations(self) -> tuple[Generation, ...]:
        """Every generation, oldest first (incomplete ones included)."""
        return tuple(self._generations)

    def generation(self, index: int = -1) -> Generation:
        """One generation by index into `generations` (default: the latest).

        Raises:
            TypeError: `index` is not an int.
            LookupError: there is no generation yet (saying what to do), or `index` is out of range.
        """
        return pick(self._generations, index, self._none_recorded())

    def __iter__(self) -> Iterator[Generation]:
        return iter(self.generations)

    def __len__(self) -> int:
        return len(self._generations)

    def _repr_html_(self) -> str | None:
        """The viewer's page of every generation, for notebooks (`answers.viewer`); None while empty."""
        return display.html(self) if getattr(self, "generations", ()) else None

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


# The accessors of one generation: each is `Generation`'s method of the same name, with the generation's index
# (`generation`, default -1: the latest) after the method's positional parameters.
OF_ONE_GENERATION = (
    "logits", "scores", "tokens", "stats", "finished", "beam_parents", "beam_indices", "logprobs", "prompt_logprobs",
    "transition_scores", "topk", "sampled_targets", "sparse", "attentions", "hidden_states", "decoder_attentions",
    "cross_attentions", "decoder_hidden_states", "encoder_attentions", "encoder_hidden_states", "layer_array",
)


def _of_one_generation(name: str) -> Callable[..., Any]:
    """`Readable`'s accessor `name`: `Generation.<name>` of the generation `generation` picks (`Readable.generation`),
    with that method's parameters, its docstring's first paragraph and a pointer to the rest."""
    method = getattr(Generation, name)
    signature = inspect.signature(method)
    parameters = list(signature.parameters.values())
    positional = [p for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    keyword = [p for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]
    index = inspect.Parameter("generation", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=-1, annotation="int")
    accessor_signature = signature.replace(parameters=[*positional, index, *keyword])

    def accessor(self: Readable, *args: Any, **kwargs: Any) -> Any:
        arguments = accessor_signature.bind(self, *args, **kwargs).arguments
        del arguments["self"]
        generation = self.generation(arguments.pop("generation", -1))
        return getattr(generation, name)(**arguments)

    summary = (inspect.getdoc(method) or "").split("\n\n")[0]
    accessor.__name__ = name
    accessor.__qualname__ = f"Readable.{name}"
    accessor.__module__ = __name__
    accessor.__doc__ = f"{summary}\n\nOf one generation (`generation`: its index, default the latest); see `Generation.{name}`."
    accessor.__signature__ = accessor_signature  # type: ignore[attr-defined]
    return accessor


for _name in OF_ONE_GENERATION:
    setattr(Readable, _name, _of_one_generation(_name))

# Readable's accessors: every public method, each written once here and shared as is by its subclasses.
ACCESSORS = tuple(name for name, value in vars(Readable).items()
                  if callable(value) and not name.startswith("_") and name != "generation")
