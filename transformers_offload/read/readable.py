"""The accessors of a recording, written once: `Recording`, `RankedRecording` and the `Recorder` are each a
`Readable`, whose accessors read one generation (default: the latest) through that `Generation`'s own.

A subclass holds its generations, oldest first, in `_generations` and says in `_none_recorded()` what to do
when it holds none.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from .._lazy import torch  # imported when first used: reading a manifest needs no torch (`inspect`, `verify`)
from . import display
from .generation import Generation, pick
from .indexing import Rows, Steps
from .layer_reading import LayerArray
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


# Readable's accessors: every public method, each written once here and shared as is by its subclasses.
ACCESSORS = tuple(name for name, value in vars(Readable).items()
                  if callable(value) and not name.startswith("_") and name != "generation")
