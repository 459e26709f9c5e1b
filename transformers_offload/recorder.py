"""The recorder: what a user hands to `generate()`."""

from __future__ import annotations

import json
import os
import platform
import threading
import warnings
from pathlib import Path
from typing import Any, Sequence

import safetensors
import torch
import transformers
from transformers import GenerationMixin
from transformers.generation import LogitsProcessor, StoppingCriteria

from . import _compat
from .capture import encodings as _encodings
from .capture import hooks as _hooks
from .capture import layers as _layers
from .capture import prompt_logprobs as _prompt_logprobs
from .capture.capture import Capture
from .capture.hooks import CallRecorder
from .capture.modes import UnsupportedModeError
from .capture.verify import RecordingMismatch
from .read.generation import Generation, generation_of
from .read.readable import MemoryRecording, reads_through
from .store import manifest as _manifest
from .store.format import NATIVE
from .store.memory import MemoryStore
from .store.shards import DEFAULT_SHARD_BYTES, Spill

DEFAULT_STREAMS = ("logits", "scores")
STREAMS = (*DEFAULT_STREAMS, *_layers.STREAMS, "stats")


class RecordingMismatchWarning(UserWarning):
    """What a `generate()` call recorded disagrees with what the call computed or returned (its decoding
    loop ran more than once, a step's processors never ran, the returned sequences are not the recorded
    tokens): the generation is marked incomplete (`complete=False`) with the disagreement as its `error`."""


class DeviceAccumulationWarning(UserWarning):
    """`generate()` was also asked to return per-step outputs (scores, logits, attentions, hidden
    states), which it keeps on the device until it returns."""


class UnrecordedCallWarning(UserWarning):
    """A Recorder closed having recorded nothing, while its model's `generate()` ran without it in
    `logits_processor`: a recorder only records the calls it is handed (`logits_processor=[rec]`)."""


@reads_through("_recording")  # logits(), scores(), topk()...: those of the `MemoryRecording` it owns
class Recorder(CallRecorder, LogitsProcessor, StoppingCriteria):
    """Records every step of `model.generate()` and moves it off the device within the step.

    Hand it to a stock call, anywhere in the list: `model.generate(**enc, logits_processor=[rec])`.
    For each generated step it records the raw logits (what `out.logits` holds with
    `output_logits=True`), the processed scores (what `out.scores` holds with `output_scores=True`),
    the token chosen per row and which rows had already finished; in beam search also each running
    beam's parent. Generation itself keeps `output_scores` and `output_logits` off, so nothing of past
    steps stays on the device: each step's tensors are copied into a ring of `ring_slots` host slots
    (pinned memory and non-blocking copies on CUDA), then kept in host memory, or, with `spill_dir`,
    written to safetensors shards there by a background thread (read them back with
    `transformers_offload.open_recording(spill_dir)`; the recorder's own accessors read the same files).

    With `"attentions"` or `"hidden_states"` in `streams` it also records, per step, what
    `output_attentions=True` / `output_hidden_states=True` would add to `generate()`'s output
    (`out.attentions`, `out.hidden_states`; for encoder-decoder models `out.encoder_attentions`,
    `out.decoder_attentions`, `out.cross_attentions`, `out.encoder_hidden_states`,
    `out.decoder_hidden_states`): the recorder asks the model's forward for them itself, so the call
    needs neither those options nor `return_dict_in_generate`. `layers`, `heads` and
    `newest_position_only` keep a part of them (docs/recording.md gives the bytes per step of each choice).
    They are recorded in greedy search, sampling, beam search and beam sampling.

    Each `generate()` call that carries the recorder is one `Generation`, appended to `generations`;
    `logits()`, `scores()`... read the latest one unless `generation=` picks another. Calls of the same
    model without the recorder in `logits_processor` are not recorded and not affected.

    Supported decoding modes: greedy, multinomial sampling (with any processors and warpers), beam
    search and beam sampling (`low_memory=True` included, where transformers runs it), assisted
    decoding with an `assistant_model` and prompt lookup (`prompt_lookup_num_tokens`: one step per
    accepted token, as `out.scores`; rejected candidates and the assistant's drafts are not
    recorded), and, where transformers runs them itself (up to 4.56), contrastive search, DoLa and
    group beam search; for decoder-only and encoder-decoder models. A call in another mode
    (constrained beam search, those three from 4.57, early-exit assistance, continuous batching)
    raises `UnsupportedModeError` before its decoding loop starts.

    A model whose `generate()` runs transformers' loop several times in one call (Whisper: per
    30-second segment and per fallback temperature) gives one generation per loop (`Generation.loop`
    names its segment, attempt and the prompts the call kept); one whose `generate()` calls an inner
    model's (BLIP-2's language model) is recorded through that inner call. When each loop ends, the
    recording is checked against what the loop returned (its sequences, its steps): a disagreement
    marks the generation incomplete (`complete=False`, `error` naming it) and warns
    `RecordingMismatchWarning`; it is never `complete=True` with content that differs from the call.

    Args:
        model (`transformers.GenerationMixin`): the model whose `generate()` calls are recorded. The
            recorder wraps a few of this instance's generation methods (never the class) until
            `close()`.
        streams (`tuple[str, ...]`, *optional*, defaults to `("logits", "scores")`): what to record
            besides the tokens and the finished mask (always recorded): `"logits"`, `"scores"` (both
            `(rows, vocab_size)` per step), `"attentions"` (needs a model loaded with
            `attn_implementation="eager"`), `"hidden_states"`, and `"stats"`: per row and step the chosen
            token, its logprob and rank under the raw logits and the processed scores, both
            distributions' entropy, the raw logsumexp and the processed support, computed on the device
            from the full tensors (36 bytes per row and step; read with `stats()`).
        layers (`Sequence[int]`, *optional*): with attentions or hidden states, the layers to keep, as
            indices into each output's tuple of layers (negative from the end; hidden states count the
            embeddings as entry 0, so `[-1]` is the last layer of both); default all. Kept in layer
            order, each once.
        heads (`Sequence[int]`, *optional*): with attentions, the heads to keep (negative from the
            end); default all. Kept in head order, each once (`Generation.layers["heads"]` lists them).
        newest_position_only (`bool`, *optional*, defaults to False): with attentions or hidden states,
            keep only the newest position of each step: the prefill's attentions shrink from
            `(rows, heads, prompt, prompt)` to `(rows, heads, 1, prompt)` and its hidden states to
            `(rows, 1, hidden_size)`; decode steps have one position anyway. Encoder outputs are kept whole.
        ring_slots (`int`, *optional*, defaults to 4): host slots in the transfer ring, i.e. steps in
            flight between the device and the store (at least 2 in beam search); on CUDA each slot
            holds `rows x vocab_size x 4` bytes per stream of pinned host memory and as much device
            memory (its staging buffer): the recorder's whole device footprint.
        spill_dir (`str | os.PathLike`, *optional*): a new or empty directory to write the recording to
            (a manifest and safetensors shards; one generation per `generate()` call). Without it the
            recording stays in host memory.
        shard_bytes (`int`, *optional*, defaults to 64 MiB): with `spill_dir`, the target size of one
            shard in bytes; a shard holds at least one step. Host memory for shards is bounded by three
            shard buffers: `generate()` waits only when all three are taken (counted in
            `Generation.stats.waits`).
        encodings (`dict[str, str]`, *optional*): how to store `"logits"` and `"scores"`, applied on the
            device inside the step, before the copy: `"dense"` (the whole `(rows, vocab_size)`
            tensor), `"sparse"` (lossless: per row only the entries that are not -inf, 4
            bytes a row plus 8 a kept entry, never more than dense plus `12 + 4 x rows` bytes a step;
            `logits()`/`scores()` return the dense tensors, `sparse()` the entries), `"native"` (lossless:
            a bfloat16/float16 model's float32 logits stored in the model's dtype, 2 bytes a value, for
            each step whose every value converts back bit for bit; other steps as they are), `"topk:K"`
            (lossy, by your choice: per row the K largest values bit for bit and their token ids, the
            logsumexp over the whole vocabulary and the probability mass outside the K, `(value bytes +
            id bytes) x K + 8` bytes per row and step, ids in 1 to 3 bytes as the vocabulary needs; read
            with `topk()`, which `logits()` and `scores()` then point to), `"topk:K:qB"` (the same, lossier:
            ids Elias-Fano coded, log-probabilities in B bits, 2 to 8; 291 bytes at K = 128, B = 5 on a
            152k vocabulary) or `"sample:N@T"` (N tokens drawn from `softmax(x / T)`, T default 1, with
            their counts and values and the logsumexp: unbiased distillation targets; read with
            `sampled_targets()`). E.g.
            `{"scores": "sparse"}`. A stream named nowhere here is stored dense, except by default:
            a bfloat16/float16 model's logits are recorded `"native"` from 4.45 (name `{"logits":
            "dense"}` for dense float32); on CPU, a call that samples through a warper that masks
            entries to -inf (top_k below the vocabulary size, top_p, min_p above 0, typical_p,
            epsilon_cutoff, eta_cutoff, top_h; `do_sample=True` alone brings top_k=50) records its
            scores `"sparse"` (on CUDA dense, until that path has run on a GPU); a call with no
            processor (greedy search, or sampling without any processor or warper) stores `scores`
            once with the logits, whose very tensor they are (`"same_as_logits"` in the manifest). The
            readers return the same tensors either way; naming any encoding for `"scores"`
            (`{"scores": "dense"}`...) stores them so.
        sample_seed (`int`, *optional*, defaults to 0): the seed of the recorder's own generator (one
            per device) that draws the `"sample:N@T"` tokens; generate()'s random stream is left alone.
        append (`bool`, *optional*, defaults to False): with `spill_dir` holding a recording of the same
            model, add this recorder's generations after those already there (never touching them; a
            generation a stopped process left `"recording"` is marked `"failed"`). `generations` then
            lists this recorder's own, whose `index` counts on from the directory's.
        prompt_logprobs (`bool | int`, *optional*, defaults to False): score each call's prompt too: per
            prompt and position, the logprob and rank of the prompt's own next token (an int `k` adds
            the top-k alternatives), computed on the device from the prefill forward's final hidden
            states, `prompt_chunk` positions at a time (`capture.prompt_logprobs` gives the
            expressions); read with `prompt_logprobs()`. Decoder-only models.
        prompt_chunk (`int`, *optional*): with `prompt_logprobs`, prompt positions scored at once (the
            extra device memory is about `9 x prompts x prompt_chunk x vocab_size` bytes); default: as
            many as keep one chunk's logits within 2**24 values (64 MiB).

    Raises:
        TypeError: `model` has no `generate()` from transformers' `GenerationMixin`, or an option has
            the wrong type.
        ValueError: an option has a wrong value, or `"attentions"` is asked of a model whose attention
            implementation is not eager (also raised by `generate()`, before it runs, if that changed).
        IndexError: `layers` or `heads` is out of range for the model's config.
        FileExistsError: `spill_dir` exists and is not an empty directory (nor, with `append`, a recording).
        RecordingError: with `append`, the recording in `spill_dir` is damaged.
        BlockingIOError: another process is writing the recording in `spill_dir`.
        OSError: `spill_dir` cannot be created or written.
        UnsupportedModeError: raised by a `generate()` call in a mode it cannot record (see above),
            before the call runs.

    Warns:
        RecordingMismatchWarning: a call's recording disagrees with what it returned (above).
        DeviceAccumulationWarning: the call also asked generate() to keep per-step outputs on the device.

    Example:
        >>> from transformers_offload import Recorder
        >>> with Recorder(model) as rec:  # doctest: +SKIP
        ...     out = model.generate(**enc, logits_processor=[rec], max_new_tokens=8)
        >>> rec.logits()[0].shape  # doctest: +SKIP
        torch.Size([1, 49152])
    """

    def __init__(
        self,
        model: Any,
        *,
        streams: tuple[str, ...] = DEFAULT_STREAMS,
        ring_slots: int = 4,
        spill_dir: str | os.PathLike | None = None,
        shard_bytes: int | None = None,
        layers: Sequence[int] | None = None,
        heads: Sequence[int] | None = None,
        newest_position_only: bool = False,
        encodings: dict[str, str] | None = None,
        append: bool = False,
        prompt_logprobs: bool | int = False,
        prompt_chunk: int | None = None,
        sample_seed: int = 0,
    ) -> None:
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
        if spill_dir is not None and not isinstance(spill_dir, (str, os.PathLike)):
            raise TypeError(f"`spill_dir` must be a path (str or os.PathLike), got {spill_dir!r}.")
        if append and spill_dir is None:
            raise ValueError("`append` adds generations to the recording in `spill_dir`; pass `spill_dir` too.")
        if shard_bytes is not None:
            if spill_dir is None:
                raise ValueError("`shard_bytes` sizes the shards written to `spill_dir`; pass `spill_dir` too.")
            if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int):
                raise TypeError(f"`shard_bytes` must be an int (bytes), got {shard_bytes!r}.")
            if shard_bytes < 1:
                raise ValueError(f"`shard_bytes` must be at least 1 (byte), got {shard_bytes}.")
        if isinstance(sample_seed, bool) or not isinstance(sample_seed, int):
            raise TypeError(f"`sample_seed` must be an int (the seed of the `sample:N` draws), got {sample_seed!r}.")
        self._sample_seed = sample_seed
        self._sample_generators: dict[torch.device, torch.Generator] = {}  # per device, made on first use
        self._selection = _layers.selection(model, tuple(streams), layers, heads, newest_position_only)
        self._encodings = _encodings.check(encodings, tuple(streams), _model_info(model)["vocab_size"])
        if ("logits" in streams and not (isinstance(encodings, dict) and "logits" in encodings)
                and _compat.UPCASTS_LOGITS and getattr(model, "dtype", None) in (torch.bfloat16, torch.float16)):
            # A 16-bit model's logits, upcast to float32 by transformers: stored in the model's dtype where
            # they convert back exactly (lossless; half the bytes, and less time than dense: bench/native_cost.py).
            self._encodings["logits"] = NATIVE
        self._prompt_scoring = _prompt_logprobs.scoring_for(model, prompt_logprobs, prompt_chunk)
        # Scores equal to the logits (no processor) are stored once, unless asked for dense by name.
        self._scores_once = not (isinstance(encodings, dict) and encodings.get("scores") == "dense")
        # Scores with no encoding named: "sparse" in calls that sample through a masking warper.
        self._sparse_scores = not (isinstance(encodings, dict) and "scores" in encodings)
        if "attentions" in streams:
            _layers.require_eager(model)
        self._spill: Spill | None = None
        if spill_dir is not None:
            self._spill = Spill(
                Path(spill_dir),
                shard_bytes=shard_bytes or DEFAULT_SHARD_BYTES,
                model_info=_model_info(model),
                created_by=_created_by(),
                append=append,
            )
        self._model = model
        name_or_path = getattr(model, "name_or_path", "")
        self._model_name = type(model).__name__ + (f" {name_or_path!r}" if name_or_path else "")
        self._streams = tuple(dict.fromkeys(streams))
        self._ring_slots = ring_slots
        self._recording = MemoryRecording(
            empty="this Recorder has recorded no generation yet: pass it to "
            "`model.generate(..., logits_processor=[rec])` first."
        )
        self._lock = threading.Lock()
        self._active: Capture | None = None
        self._warned_accumulation = False
        self._pending_samples: dict[str, Any] | None = None  # from set_samples, for the next call
        self._closed = False
        self._began = 0  # generate() calls that carried this recorder
        self._ran_without = 0  # the model's generate() calls that did not
        _hooks.attach(model, self)

    # -- lifecycle ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove this recorder's hooks from the model; the recordings stay readable. Idempotent."""
        if not self._closed:
            self._closed = True
            _hooks.detach(self._model, self)
            if self._spill is not None:
                self._spill.close()
            if not self._began and self._ran_without:
                warnings.warn(UnrecordedCallWarning(
                    f"this Recorder closed having recorded nothing, while {type(self._model).__name__}.generate() "
                    f"ran {self._ran_without} time(s) without it: a Recorder records only the calls it is handed; "
                    "pass it as `model.generate(..., logits_processor=[rec])`."), stacklevel=2)

    def _ran_without_it(self) -> None:
        self._ran_without += 1

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
        return self._recording.generations

    def generation(self, index: int = -1) -> Generation:
        """One recorded generation, by index into `generations` (default: the latest).

        Raises:
            LookupError: nothing was recorded yet, or `index` is out of range.
        """
        return self._recording.generation(index)

    @property
    def spill_dir(self) -> Path | None:
        """The recording directory (`spill_dir`), or None for an in-memory recorder."""
        return None if self._spill is None else self._spill.root

    def clear(self) -> None:
        """Forget every recorded generation, freeing their host memory: all of it once you hold none of
        their tensors. A step's tensor you keep keeps the block of neighbouring steps it was stored in
        (up to 64 MiB) until you drop it; `.clone()` the steps you keep to hold only their own bytes.

        Raises:
            ValueError: the recorder writes to `spill_dir`, whose recording stays on disk.
        """
        if self._spill is not None:
            raise ValueError(
                f"this Recorder writes to `spill_dir` {str(self._spill.root)!r}; its generations stay on "
                "disk. Delete that directory to remove them."
            )
        with self._lock:
            self._recording.clear()

    def set_samples(self, ids: Sequence[str | int], *, metadata: Sequence[dict[str, Any]] | None = None) -> None:
        """Name the prompts of the next recorded `generate()` call: your ids (dataset row ids, say) and,
        optionally, metadata per prompt, kept in the recording's manifest.

        The next call that carries this recorder takes them (also when it then fails); `samples()`,
        the per-token table's `sample` column and the viewer show them. A call without them numbers
        its prompts by their position among the recording's prompts (which can repeat an int id given
        to another call: name every call's prompts, or none).

        Args:
            ids (`Sequence[str | int]`): one id per prompt of the call's batch, in batch order, distinct.
            metadata (`Sequence[dict]`, *optional*): one JSON-serialisable dict per prompt.

        Raises:
            TypeError: `ids` or `metadata` are not lists of the types above, or metadata is not JSON.
            ValueError: repeated ids, a metadata list of another length, or ids still waiting for a call;
                the next `generate()` raises ValueError, before it runs, when its batch has another size.

        Example:
            >>> rec.set_samples(["q1", "q2"], metadata=[{"split": "test"}, {"split": "test"}])  # doctest: +SKIP
            >>> model.generate(**batch_of_two, logits_processor=[rec])  # doctest: +SKIP
            >>> [s["sample"] for s in rec.samples()]  # doctest: +SKIP
            ['q1', 'q2']
        """
        ids = list(ids) if isinstance(ids, (list, tuple)) else ids
        metadata = list(metadata) if isinstance(metadata, (list, tuple)) else metadata
        problem = _manifest.check_sample_ids(ids, metadata)
        if problem is not None:
            kind = ValueError if "distinct" in problem or "one per id" in problem else TypeError
            raise kind(f"`set_samples`: {problem}.")
        try:
            metadata = None if metadata is None else json.loads(json.dumps(metadata, allow_nan=False))
        except (TypeError, ValueError) as error:
            raise TypeError(f"`metadata` must be JSON-serialisable (str keys; str, numbers, lists, dicts): {error}") from None
        with self._lock:
            if self._pending_samples is not None:
                raise ValueError(
                    f"`set_samples` was already called with {self._pending_samples['sample_ids']!r}, and no "
                    "generate() call has taken them yet: call generate() between two `set_samples`."
                )
            self._pending_samples = {"sample_ids": tuple(ids), "sample_metadata": None if metadata is None else tuple(metadata)}

    # -- called by the hooks ---------------------------------------------------------------------------
    def _check_generation(self, *, custom_generate: Any, attention_mask: Any, inputs: Any = None,
                          past_key_values: Any = None) -> None:
        """What `_begin_generation` refuses, checked without starting anything (before a call whose capture
        begins later, with its loop)."""
        samples = self._pending_samples
        if samples is not None:
            batch = next((int(t.shape[0]) for t in (attention_mask, inputs) if t is not None and t.dim() >= 1), None)
            if batch is not None and batch != len(samples["sample_ids"]):
                with self._lock:
                    self._pending_samples = None  # dropped, as the message says: name them again
                raise ValueError(
                    f"`set_samples` named {len(samples['sample_ids'])} prompt(s), but this generate() call has a "
                    f"batch of {batch}; nothing was run. Call `set_samples` again with one id per prompt."
                )
        cached = _prompt_logprobs.cache_length(past_key_values) if self._prompt_scoring is not None else 0
        if cached:
            raise ValueError(
                f"`prompt_logprobs` scores the prompt from the call's own prefill, but this call was given a "
                f"`past_key_values` already holding {cached} token(s), whose forward ran before it; nothing was run. "
                "Score the whole prompt in one call (without the cache), or record this one without `prompt_logprobs`."
            )
        if custom_generate is not None:
            raise UnsupportedModeError(
                "`custom_generate` replaces transformers' decoding loop, which the Recorder cannot see "
                "into; remove the Recorder from `logits_processor` or drop `custom_generate`."
            )
        if self._active is not None:
            raise RuntimeError(
                "this Recorder is already recording a generate() call (in another thread, or one "
                "that has not returned): one Recorder records one call at a time. Give each "
                "concurrent call its own Recorder."
            )

    def _begin_generation(self, *, assistant_model: Any, custom_generate: Any, attention_mask: Any,
                          inputs: Any = None, past_key_values: Any = None) -> Capture:
        self._check_generation(custom_generate=custom_generate, attention_mask=attention_mask, inputs=inputs,
                               past_key_values=past_key_values)
        with self._lock:
            self._began += 1
            samples, self._pending_samples = self._pending_samples, None
        if "attentions" in self._streams:
            _layers.require_eager(self._model)
        is_encoder_decoder = bool(getattr(self._model.config, "is_encoder_decoder", False))
        kinds = _layers.kinds(self._streams, is_encoder_decoder)
        with self._lock:
            if self._active is not None:
                raise RuntimeError(
                    "this Recorder is already recording a generate() call (in another thread, or one "
                    "that has not returned): one Recorder records one call at a time. Give each "
                    "concurrent call its own Recorder."
                )
            self._active = Capture(
                streams=self._streams,
                ring_slots=self._ring_slots,
                assistant_model=assistant_model,
                open_store=self._open_store,
                index=self._spill.next_index if self._spill is not None else len(self._recording),
                attention_mask=attention_mask,
                threaded=_on_cuda(self._model),
                layer_tap=_layers.LayerTap(kinds, self._selection, self._streams, self._model) if kinds else None,
                encodings=self._encodings,
                samples=samples,
                prompt_scoring=self._prompt_scoring,
                scores_once=self._scores_once,
                # Sparse scores by default where measured no slower than dense (bench/encodings_cost.py):
                # on CPU. On CUDA their two-part path has yet to run on a GPU (scripts/device_checks.sh).
                sparse_scores=self._sparse_scores and _on_cpu(self._model),
                vocab_size=_model_info(self._model)["vocab_size"],
                model_dtype=getattr(self._model, "dtype", torch.float32),
                sample_generators=self._sample_generators,
                sample_seed=self._sample_seed,
            )
            return self._active

    def _end_generation(self, capture: Capture, output: Any, error: BaseException | None) -> None:
        try:
            if capture.started:
                if capture.kept_on_device and not self._warned_accumulation:
                    self._warned_accumulation = True
                    flags = ", ".join(f"`{flag}`" for flag in capture.kept_on_device)
                    warnings.warn(
                        f"this generate() call ran with `return_dict_in_generate=True` and {flags} (from its "
                        "arguments, the model's generation_config, or the model's own generate(): Whisper asks "
                        "for them with `logprob_threshold` or `return_token_timestamps`), so generate() also "
                        "kept those outputs of every step on the device until it returned. The Recorder "
                        "records what its `streams` name without them: drop those options where they are "
                        "yours to keep device memory flat.",
                        DeviceAccumulationWarning,
                        stacklevel=3,
                    )
                generation = generation_of(capture.finish(output, error))
                with self._lock:
                    self._recording.append(generation)
                mismatch = capture.mismatch or (str(error) if isinstance(error, RecordingMismatch) else None)
                if mismatch is not None:
                    warnings.warn(
                        f"transformers-offload: generation {generation.index} of this Recorder is marked "
                        f"incomplete: {mismatch}. Its recorded steps stay readable; they may not be "
                        "what this call returned (docs/support.md lists the paths recorded exactly).",
                        RecordingMismatchWarning,
                        stacklevel=3,
                    )
                if error is None and capture.failure is not None:
                    raise capture.failure
            elif error is None:
                raise RuntimeError(
                    f"{type(self._model).__name__}.generate() returned without building transformers' "
                    "logits-processor list, so nothing was recorded: this model's generate() is not "
                    "supported by transformers-offload."
                )
        finally:
            capture.close_taps()
            with self._lock:
                self._active = None

    def _open_store(self, names: list[str], header: dict[str, Any], max_steps: int) -> Any:
        if self._spill is None:
            return MemoryStore(names)
        return self._spill.open_store(names, header, max_steps)

    # -- as a processor, it is never called while the hooks are in place ------------------------------
    def __call__(self, input_ids: torch.LongTensor, scores: Any) -> Any:  # type: ignore[override]
        """Never records: the hooks take the recorder out of the lists they build.

        Inside a recorded call it passes `scores` through unchanged: 4.38-4.56 hand the call's
        `logits_processor` (this recorder included) to the assistant model's own `generate()`, whose
        drafts are not recorded. Anywhere else it is reached only when `generate()` did not go
        through the model the recorder is attached to.

        Raises:
            RuntimeError: called outside a recorded call, saying how to pass the recorder instead.
        """
        if _hooks.records_now(self._model):
            return scores  # an assistant model drafting inside the recorded call
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
            f"{len(self._recording)} generation(s), {state})"
        )


def _on_cuda(model: Any) -> bool:
    """Whether `model` computes on CUDA: then the ring drains in its own thread."""
    device = getattr(model, "device", None)
    return isinstance(device, torch.device) and device.type == "cuda"


def _on_cpu(model: Any) -> bool:
    device = getattr(model, "device", None)
    return isinstance(device, torch.device) and device.type == "cpu"


def _model_info(model: Any) -> dict[str, Any]:
    config = getattr(model, "config", None)
    text_config = _compat.text_config(config)
    return {
        "class": type(model).__name__,
        "name_or_path": str(getattr(model, "name_or_path", "") or ""),
        "config_class": type(config).__name__,
        "vocab_size": getattr(text_config, "vocab_size", None),
    }


def _created_by() -> dict[str, str]:
    from . import __version__

    return {
        "transformers_offload": __version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "python": platform.python_version(),
    }
