"""What one `generate()` call recorded: per-step tensors in Hugging Face's layout.

A `Generation` reads its per-step tensors from a source a store hands over (`store.stored`): host
memory (the in-memory store) or the shards of a recording directory. `read.readable` gives the
recorder and the reader the same accessors.
"""

from __future__ import annotations

import dataclasses
import operator
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy

from .._lazy import torch  # imported when first used: reading a manifest needs no torch (`inspect`, `verify`)
from ..codecs.spec import read_encodings
from ..codecs.stats import STATS_STREAM, stats_columns
from ..errors import StreamNotRecorded
from ..store.header import GenerationHeader
from ..store.stored import StepSource, StoredGeneration, TransferStats
from . import display
from .beams import BeamReading
from .encoded_reading import EncodedReading
from .indexing import Rows, Steps, as_framework, check_framework, row_index, step_range
from .layer_reading import LayerReading
from .logprobs import logprobs as _logprobs
from .prompt_logprobs import prompt_logprobs as _prompt_logprobs
from .prompt_logprobs import prompt_tensors as _prompt_tensors
from .transition_scores import transition_scores as _transition_scores

_STEP_STREAMS = ("logits", "scores", "tokens", "finished", "beam_parents", STATS_STREAM)


@dataclass(frozen=True, eq=False)
class Generation(LayerReading, EncodedReading, BeamReading):
    """The recording of one `generate()` call.

    Every per-step accessor returns a tuple with one entry per selected step (step 0 comes from the
    prefill forward). A row is one running sequence: `batch x num_return_sequences`, or
    `batch x num_beams` in beam search. Tensors are CPU tensors owned by the recording (read from a
    recording directory, they map the shard files lazily, copy-on-write): copy them before keeping
    them past `close()`.

    Every per-step accessor takes `steps=` (a `slice` or `range` of steps, default all) and `rows=`
    (an int, a slice, or a sequence of row indices, default all); from a recording directory only the
    selected bytes are read.

    Attributes:
        index (`int`): position of this call among the recording's generations.
        mode (`str`): the decoding mode, as transformers' `GenerationMode` value (`"greedy_search"`,
            `"sample"`, `"beam_search"`, `"beam_sample"`).
        prompt_length (`int`): length of the (left-padded) prompt `input_ids` given to the decoding loop,
            in tokens; for encoder-decoder models, of the decoder's start ids.
        prompt_lengths (`tuple[int, ...] | None`): tokens of each input prompt that are not padding
            (the call's `attention_mask` sums); None when the call passed no `attention_mask`.
        num_rows (`int`): rows per step.
        num_beams (`int`): beams per prompt (1 outside beam search).
        num_steps (`int`): number of recorded steps.
        complete (`bool`): False when `generate()` raised (or was interrupted, or the process stopped)
            mid-run; the steps recorded before that are kept.
        error (`str | None`): why an incomplete generation ended, as the exception's `repr`.
        sequences (`torch.LongTensor | None`): what `generate()` returned as sequences (`out.sequences`
            or the plain tensor), on CPU; None for an incomplete generation. Where the model's own
            `generate()` reworks what transformers' loop returned (Whisper, which strips the decoder's
            start ids; BLIP-2 up to 4.4x, which puts a BOS id before them), the loop's own sequences. From a
            recording directory read when first asked for (`RecordingError` naming the file if it is missing
            or damaged).
        pad_token_id (`int | None`), eos_token_id (`tuple[int, ...]`): from the call's generation config.
        generation_config (`dict`): the call's generation config, as `GenerationConfig.to_diff_dict()`.
        transfer (`TransferStats | None`): how the recording process moved the data (waits, bytes
            written); None when read back from a directory.
        layers (`dict | None`): with attentions or hidden states, what was selected: `counts` (layers
            of each output in the model), `heads` (per attention output, the kept heads; None: all) and
            `newest_position_only`; else None.
            `layer_indices` lists the recorded layers.
        encodings (`dict[str, str]`): the streams not recorded dense, with their encoding (`{"scores":
            "sparse"}`, `{"scores": "topk:20"}`); empty when every stream is dense.
        sample_ids (`tuple[str | int, ...] | None`): the call's prompts' ids, as given to
            `Recorder.set_samples` before it (one per prompt); None when none were given (the recording's
            `samples()` then numbers the prompts).
        sample_metadata (`tuple[dict, ...] | None`): each prompt's metadata given with them, or None.
        loop (`dict | None`): None when the call ran transformers' decoding loop once. A model whose
            `generate()` runs it several times in one call (Whisper's segments and temperature fallback)
            gives one generation per loop, each checked against that loop's output: `call`, `loop`,
            `segment`, `attempt`, `batch_rows`, `kept_rows` (docs/recording.md, "Several loops in one call").
        nested_calls (`int`): unrecorded `generate()` calls of the recorded model's children made during
            this generation's call (Moshi's depth decoder, once per step); 0 for a stock `generate()`.
        adapters (`dict | None`): for a PEFT model (`Recorder(peft_model)`), the adapters in use at the call:
            `active` (their names), `merged` (those merged into the base weights), `disabled` (inside
            `disable_adapter()`), and for a mixed batch (`generate(..., adapter_names=[...])`) `per_row`, each
            row's adapter (`__base__`: none); None for a model without adapters.
        source (`StepSource`): where its steps are read from (the store's: memory or the shard files).
    """

    header: GenerationHeader = field(repr=False)  # what the call was: the attributes it holds read through it
    num_steps: int
    complete: bool
    error: str | None
    _sequences: Any = field(repr=False)  # the tensor, None, or a function that reads it (once)
    transfer: TransferStats | None = field(repr=False)
    source: StepSource = field(repr=False)
    encodings: dict[str, str] = field(default_factory=dict, repr=False)

    def __repr__(self) -> str:
        shown = {"index": self.index, "mode": self.mode, "prompt_length": self.prompt_length,
                 "prompt_lengths": self.prompt_lengths, "num_rows": self.num_rows, "num_beams": self.num_beams,
                 "num_steps": self.num_steps, "complete": self.complete, "error": self.error}
        return "Generation(" + ", ".join(f"{key}={value!r}" for key, value in shown.items()) + ")"

    @property
    def sequences(self) -> torch.Tensor | None:
        """What `generate()` returned as sequences (see the class's attributes)."""
        value = self._returned()
        if isinstance(value, numpy.ndarray):  # read from a directory: the tensor shares its memory
            value = torch.from_numpy(value)
            object.__setattr__(self, "_sequences", value)
        return value

    def sequences_array(self) -> numpy.ndarray | None:
        """`sequences` as an int64 NumPy array `(num_returned_sequences, length)`, read from a recording
        directory without importing torch; None for an incomplete generation.

        Raises:
            RecordingError: the sequences file is missing or damaged.
        """
        value = self._returned()
        return value if value is None or isinstance(value, numpy.ndarray) else value.numpy()

    @property
    def has_sequences(self) -> bool:
        """Whether `generate()` returned (the generation is complete): `sequences` is not None, known
        without reading them."""
        return self._sequences is not None

    def _returned(self) -> Any:
        value = self._sequences
        if callable(value):  # from a recording directory: read on first use
            value = value()
            object.__setattr__(self, "_sequences", value)
        return value

    def _repr_html_(self) -> str | None:
        """The viewer's page of this generation, for notebooks (`answers.viewer`)."""
        return display.html(self)

    @property
    def num_return_sequences(self) -> int:
        """Returned sequences per prompt (`out.sequences` has `num_prompts x num_return_sequences` rows)."""
        return int(self.generation_config.get("num_return_sequences") or 1)

    @property
    def rows_per_prompt(self) -> int:
        """Rows per prompt in each step: `num_beams` in beam search, else `num_return_sequences`."""
        return self.num_beams if self.is_beam else self.num_return_sequences

    @property
    def num_prompts(self) -> int:
        """Prompts in the call's batch (from its sample ids, attention mask, sequences or rows)."""
        if self.sample_ids is not None:
            return len(self.sample_ids)
        if self.prompt_lengths is not None:
            return len(self.prompt_lengths)
        if self.has_sequences:
            return int(self.sequences_array().shape[0]) // self.num_return_sequences
        return self.num_rows // max(1, self.rows_per_prompt)

    @property
    def streams(self) -> tuple[str, ...]:
        """Names of the per-step streams this generation holds."""
        return self.source.streams

    def logits(self, *, steps: Steps = None, rows: Rows = None, framework: str = "pt") -> tuple[Any, ...]:
        """Raw next-token logits per step, before any processor or warper.

        Mirrors `out.logits` of the same call made with `return_dict_in_generate=True,
        output_logits=True` (copied before the first processor runs: where a processor edits the scores
        in place, which transformers' `out.logits` then shows too, these stay the model's own), a tuple
        of tensors of shape `(num_rows, vocab_size)` (fewer rows with `rows=`), one per selected step, in
        the dtype transformers gives them (float32 from 4.45), on CPU.

        Args:
            steps (`int | slice | range`, *optional*): which steps, e.g. `3` (a one-step tuple), `-1` (the
                last) or `slice(10, 20)`; default all.
            rows (`int | slice | Sequence[int]`, *optional*): which rows; an int drops the row axis.
            framework (`str`): `"pt"` for torch tensors, `"np"` for NumPy arrays.

        Raises:
            KeyError: the recorder was created without the `"logits"` stream.
            ValueError: the logits were recorded as top-k (`encodings={"logits": "topk:K"}`): read them
                with `topk("logits")`.
            IndexError: `steps` or `rows` is out of range.
            ValueError: `framework` is not `"pt"` or `"np"`.
            TypeError: `framework="np"` for bfloat16 values (NumPy has no bfloat16).
            RecordingError: (from a recording directory) a selected step is held by a missing or damaged
                shard; the error names the file and `python -m transformers_offload verify PATH`.

        Example:
            >>> gen.logits(steps=slice(0, 2), rows=[0])[0].shape  # doctest: +SKIP
            torch.Size([1, 49152])
        """
        return self._get_full("logits", steps, rows, framework)

    def scores(self, *, steps: Steps = None, rows: Rows = None, framework: str = "pt") -> tuple[Any, ...]:
        """Processed scores per step, after every processor and warper (`LogitNormalization` included).

        Mirrors `out.scores` with `return_dict_in_generate=True, output_scores=True`: a tuple of
        float32 tensors of shape `(num_rows, vocab_size)` on CPU, one per selected step. In beam search
        these are the processed log-probabilities of each running beam, without the cumulative beam
        score. `steps`, `rows` and `framework` as in `logits()`.

        Raises:
            KeyError: the recorder was created without the `"scores"` stream.
            ValueError: the scores were recorded as top-k: read them with `topk("scores")`.
            IndexError, ValueError, TypeError, RecordingError: as in `logits()`.
        """
        return self._get_full("scores", steps, rows, framework)

    def tokens(self, *, steps: Steps = None, rows: Rows = None, framework: str = "pt") -> tuple[Any, ...]:
        """The token chosen at each step, per row: a tuple of int64 tensors `(num_rows,)`.

        Outside beam search, `tokens()[t]` equals `out.sequences[:, prompt_length + t]` (a finished row
        gets the pad token, as in `out.sequences`). In beam search, `tokens()[t][r]` is the token that
        extended row `beam_parents()[t][r]` of step `t` into running beam `r` of step `t + 1`; after the
        last step no running beam continues, so its entries are -1 (see `beam_indices()` for how the
        returned sequences map to rows).
        """
        return self._get("tokens", steps, rows, framework)

    def stats(self, *, steps: Steps = None, rows: Rows = None, framework: str = "pt") -> tuple[dict[str, Any], ...]:
        """Per-token statistics of each step (recorded with `"stats"` in the Recorder's `streams`).

        A tuple with one dict per selected step, of `(num_rows,)` tensors (fewer rows with `rows=`), on
        CPU, keyed `token`, `logprob_raw`, `logprob_processed`, `rank_raw`, `rank_processed`,
        `entropy_raw`, `entropy_processed`, `logsumexp_raw`, `support_processed`. Tokens, ranks
        (0 = the most likely) and support (finite processed entries) are int64; logprobs, entropies
        (nats) and logsumexp are float32. Each equals, `torch.equal` on the device it was recorded on,
        a torch expression of this step's `out.logits[t]` and `out.scores[t]` (docs/recording.md's "Per-token
        statistics" gives them). In beam search row `r` describes the token that running beam `r`
        continues with (`tokens()[t][r]`) under its parent's row (`beam_parents()[t][r]`); after the last
        step no beam continues: token and ranks are -1, logprobs NaN. A finished row keeps its pad
        token's values (see `finished()`).

        Raises:
            KeyError: the recording has no stats (record with `streams=(..., "stats")`).
        """
        records = self._get(STATS_STREAM, steps, rows, framework)
        return tuple(
            {name: as_framework(value, name, framework) for name, value in stats_columns(record).items()}
            for record in records
        )

    def step_stats(self, *, steps: Steps = None, rows: Rows = None,
                   framework: str = "pt") -> tuple[dict[str, Any], ...]:
        """`stats` under its earlier name, kept for code written against it.

        Raises:
            FutureWarning (a warning): always; call `stats` (the stream's name, as `Recorder.stats` and
                `Recording.stats` have it).
        """
        warnings.warn("`Generation.step_stats` is now `Generation.stats` (the stream's name, as on a Recorder or "
                      "a recording); `step_stats` will be removed in a later release.", FutureWarning, stacklevel=2)
        return self.stats(steps=steps, rows=rows, framework=framework)

    def finished(self, *, steps: Steps = None, rows: Rows = None, framework: str = "pt") -> tuple[Any, ...]:
        """Rows that had already finished before each step: a tuple of bool tensors `(num_rows,)`.

        A row is finished once a stopping criterion marked it done (its end-of-sequence token, a stop
        string...): from the next step on its scores are still finite and recorded, and its token is
        forced to the pad token. With `pad_token_id == eos_token_id` only the first EOS ends a row.
        In beam search, finished hypotheses leave the running beams, so every entry is False.
        """
        return self._get("finished", steps, rows, framework)

    def transition_scores(self, *, normalize_logits: bool = False) -> torch.Tensor:
        """The score of each returned sequence's token at each step.

        Equals (`torch.equal`) `model.compute_transition_scores(out.sequences, out.scores,
        out.beam_indices, normalize_logits=normalize_logits)` on the CPU tensors of the same call: a
        tensor of shape `(num_returned_sequences, steps)`, in the scores' dtype (float32), on CPU, 0
        after a beam-search sequence's last token. Outside beam search row `i` is row `i` of
        `out.sequences`; `steps` is the number of recorded steps (in beam search, of the longest
        returned sequence). With `normalize_logits`, each step's scores are first log-softmaxed over
        the vocabulary (the scores' width, where Hugging Face takes the config's `vocab_size`).

        Read a step at a time, or (normalised) a group of rows at a time over every step (about
        256 MiB), never the whole recording at once.

        Raises:
            ValueError: the generation is incomplete (no sequences), or its scores were recorded as
                top-k.
            KeyError: the recording has no `scores` stream.
            TypeError: `normalize_logits` is not a bool.

        Example:
            >>> rec.generation().transition_scores().shape  # doctest: +SKIP
            torch.Size([3, 64])
        """
        return _transition_scores(self, normalize_logits=normalize_logits)

    def logprobs(self, *, kind: str = "raw", top: int = 0, tokenizer: Any = None,
                 chunk_steps: int = 16) -> list[list[dict[str, Any]]]:
        """Per returned sequence, per generated token: its logprob and rank, and the `top` most likely
        alternatives, under the raw logits (`kind="raw"`, `out.logits`) or the processed scores
        (`kind="processed"`, `out.scores`); plain Python objects, as serving APIs give `logprobs`.

        A list with one list per returned sequence (row `j` of `sequences`), of one dict per token
        through its end-of-sequence token (a finished row's padding is left out; in beam search, each
        sequence's own length): `step` (int), `token` (int id), `logprob` (float, nats), `rank` (int,
        0 = the most likely), with `top > 0` `top_logprobs` (a list of `{"token", "logprob"}`, most
        likely first), and with a `tokenizer` the decoded `text` of each token. Each value is the
        torch expression `read.logprobs` gives (the per-token statistics' own, `torch.equal`), in
        beam search on the row `beam_indices()` names. Read a chunk of `chunk_steps` steps at a time.

        Raises:
            ValueError: `kind` is not "raw" or "processed", `top` is negative, the generation is
                incomplete, or the stream is missing or top-k (only `stats` recorded: ask for `top=0`).
            TypeError: `tokenizer` has no `convert_ids_to_tokens`.

        Example:
            >>> rec.generation().logprobs(top=2)[0][0]  # doctest: +SKIP
            {'step': 0, 'token': 3681, 'logprob': -0.21, 'rank': 0, 'top_logprobs': [...]}
        """
        return _logprobs(self, kind=kind, top=top, tokenizer=tokenizer, chunk_steps=chunk_steps)

    def prompt_logprobs(self, *, tokenizer: Any = None) -> list[list[dict[str, Any]]]:
        """Per prompt (batch order), per prompt token after the first: `position`, `token`, `logprob`
        (nats), `rank` (0 = the most likely) and, when recorded with top-k, `top_logprobs`; with a
        `tokenizer`, `text`. Recorded with `Recorder(..., prompt_logprobs=True | k)`; equal to
        `log_softmax(model(input_ids).logits)` where the model computes its head the same way (see
        `capture.prompt_logprobs` for the expressions).

        Raises:
            KeyError: recorded without `prompt_logprobs`.
            TypeError: `tokenizer` has no `convert_ids_to_tokens`.

        Example:
            >>> rec.generation().prompt_logprobs()[0][:1]  # doctest: +SKIP
            [{'position': 1, 'token': 1812, 'logprob': -7.9, 'rank': 112}]
        """
        return _prompt_logprobs(self, tokenizer=tokenizer)

    def prompt_tensors(self, *, framework: str = "pt") -> dict[str, Any]:
        """The prompt logprobs as tensors of the padded prompt: `prompt_tokens`, `prompt_logprobs`,
        `prompt_ranks` `(prompts, prompt_length - 1)` (int64, float32, int64; position p scores the
        prompt's token p + 1; -1 / NaN where it or its context is padding) and, with top-k,
        `prompt_top_tokens` and `prompt_top_logprobs` `(prompts, prompt_length - 1, k)`; on CPU.

        Raises:
            KeyError: recorded without `prompt_logprobs`.
        """
        return _prompt_tensors(self, framework)

    @property
    def once_streams(self) -> tuple[str, ...]:
        """The streams recorded once per generation (prompt logprobs, an encoder's outputs)."""
        return getattr(self.source, "once_streams", ())

    def _read_once(self, name: str, rows: Rows, framework: str) -> Any:
        check_framework(framework)
        value = self.source.read_once(name)
        index = row_index(rows, value.shape[0])
        return as_framework(value if index is None else value[index], name, framework)

    def _get(self, name: str, steps: Steps, rows: Rows, framework: str) -> tuple[Any, ...]:
        check_framework(framework)
        if name not in self.streams and self.num_steps == 0 and name in _STEP_STREAMS:
            return ()  # a call that failed before its first step left no stream behind
        if name not in self.streams:
            raise StreamNotRecorded(
                f"this recording has no {name!r} stream (it holds {sorted(self.streams)}); create the "
                f"Recorder with {name!r} in `streams` to record it."
            )
        values = self.source.read(name, step_range(steps, self.num_steps), row_index(rows, self.num_rows),
                                   numpy=framework == "np")
        return tuple(as_framework(value, name, framework) for value in values)


def generation_of(stored: StoredGeneration) -> Generation:
    """The `Generation` over what a store handed back (in memory, or a manifest entry's shards)."""
    return Generation(
        header=stored.header, num_steps=stored.num_steps, complete=stored.complete, error=stored.error,
        _sequences=stored.sequences,  # a tensor, None, or (from a directory) a function that reads it
        transfer=stored.transfer, source=stored.source, encodings=read_encodings(stored.header.encodings),
    )


# The attributes a `Generation` reads from its header (`GenerationHeader`'s fields but `encodings`, which it
# gives as a reader reads them), each a read-only property documented in the class's docstring.
FROM_HEADER = tuple(f.name for f in dataclasses.fields(GenerationHeader) if f.name != "encodings")
for _name in FROM_HEADER:
    setattr(Generation, _name, property(operator.attrgetter(f"header.{_name}"),
                                        doc=f"The call's `{_name}` (see the class's attributes)."))


def pick(generations: Sequence[Generation], index: int, empty: str) -> Generation:
    """`generations[index]`, or `LookupError` (`empty` says what to do when there is none)."""
    if isinstance(index, bool) or not isinstance(index, int):
        raise TypeError(f"`generation` must be an int index, got {index!r}.")
    if not generations:
        raise LookupError(empty)
    try:
        return generations[index]
    except IndexError:
        raise LookupError(f"`generation` index {index} is out of range: {len(generations)} recorded.") from None


