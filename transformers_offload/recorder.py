"""The recorder: what a user hands to `generate()`."""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers.generation import LogitsProcessor

from .capture import continuous as _continuous
from .capture import continuous_requests as _requests
from .capture import hooks as _hooks
from .capture import layers as _layers
from .capture import peft as _peft
from .capture import refusals as _refusals
from .capture.capture import Capture
from .capture.loop_check import RecordingMismatch
from .capture.options import DEFAULT_STREAMS, RecorderOptions, check_samples, created_by, device_type, model_info
from .errors import DeviceAccumulationWarning, RecordingMismatchWarning, UnrecordedCallWarning
from .read.generation import Generation, generation_of
from .read.readable import Readable
from .store.header import GenerationHeader, Samples
from .store.memory import MemoryStore
from .store.spill import Spill


class Recorder(Readable, LogitsProcessor):
    """Records every step of `model.generate()` and moves it off the device within the step.

    Hand it to a stock call, anywhere in the list: `model.generate(**enc, logits_processor=[rec])`.
    For each generated step it records the raw logits (what `out.logits` holds with
    `output_logits=True`), the processed scores (what `out.scores` holds with `output_scores=True`),
    the token chosen per row and which rows had already finished; in beam search also each running
    beam's parent. Each step's tensors leave the device within the step (a ring of `ring_slots` host
    slots), into host memory or, with `spill_dir`, safetensors shards (`open_recording(spill_dir)`).

    Each `generate()` call that carries the recorder is one `Generation` in `generations`; `logits()`,
    `scores()`... read the latest unless `generation=` picks another. Calls without it are neither
    recorded nor affected. Continuous batching: `generate_batch(..., logits_processor=[rec])`, `attach`.

    A mode it cannot record raises `UnsupportedModeError` before its loop starts (docs/support.md lists
    each mode and model family). When a loop ends, the recording is checked against what it returned:
    a disagreement marks the generation incomplete and warns `RecordingMismatchWarning`.

    Args:
        model (`transformers.GenerationMixin` or `peft.PeftModel`): the model whose `generate()` calls are
            recorded. The recorder wraps a few of this instance's generation methods (never the class)
            until `close()`. A PEFT model's (LoRA...) are those of the transformers model inside it
            (`get_base_model()`), which its `generate()` calls; each generation's `adapters` names the
            adapters in use.
        streams (`tuple[str, ...]`, *optional*, defaults to `("logits", "scores")`): what to record besides
            the tokens and the finished mask: `"logits"`, `"scores"` (`(rows, vocab_size)` per step),
            `"attentions"` (eager attention), `"hidden_states"` (as `output_attentions` /
            `output_hidden_states` add them), `"stats"` (per-token statistics); see docs/recording.md.
        layers (`Sequence[int]`, *optional*), heads (`Sequence[int]`, *optional*): with attentions or
            hidden states, the layers (hidden states count the embeddings as entry 0) and heads to keep,
            negative from the end; default all.
        newest_position_only (`bool`, *optional*, defaults to False): keep only the newest position of
            each step's attentions or hidden states (the prefill's shrinks to one row).
        ring_slots (`int`, *optional*, defaults to 4): steps in flight between the device and the store
            (at least 2 in beam search); on CUDA each slot holds `rows x vocab_size x 4` bytes a stream of
            pinned host memory and as much device memory (docs/how-it-works.md).
        spill_dir (`str | os.PathLike`, *optional*): a new or empty directory to write the recording to
            (a manifest and safetensors shards); without it the recording stays in host memory.
        shard_bytes (`int`, *optional*): with `spill_dir`, the target size of a shard in bytes; by default a
            128th of what a call's steps can take (every stream, at the most steps it can run), at least 8 MiB and
            at most 64 MiB. `generate()` waits when three shard buffers are being filled or written (counted in
            `Generation.transfer.waits`), so they bound the host memory the writer holds (docs/limits.md).
        encodings (`dict[str, str]`, *optional*): how to store `"logits"` and `"scores"`: `"dense"`,
            `"sparse"`, `"native"` (lossless), `"topk:K"`, `"topk:K:qB"`, `"topk:K+tail:N"`, `"sample:N@T"`
            (lossy, by your choice), e.g. `{"scores": "sparse"}`; unnamed streams get a lossless default. docs/recording.md
            describes each encoding, its size, its reader and the defaults.
        encoding_seed (`int`, *optional*, defaults to 0): the seed of the recorder's own generators of the
            `"sample:N@T"` and `"topk:K+tail:N"` draws; generate()'s random stream is left alone.
        append (`bool`, *optional*, defaults to False): add this recorder's generations after those of
            the recording of the same model in `spill_dir` (never touching them).
        prompt_logprobs (`bool | int`, *optional*, defaults to False): also score each call's prompt: per
            position the logprob and rank of the prompt's next token (an int `k` adds the top-k), read
            with `prompt_logprobs()`. Decoder-only models.
        prompt_chunk (`int`, *optional*): with `prompt_logprobs`, prompt positions scored at once (about
            `9 x prompts x prompt_chunk x vocab_size` bytes of device memory); default: one chunk's
            logits within 2**24 values.
        every_call (`bool`, *optional*, defaults to False): also record the model's `generate()` and
            `generate_batch()` calls that were not given the recorder (code you do not call yourself).

    Raises:
        TypeError, ValueError: an option of the wrong type or value (`generate()` raises ValueError too,
            before it runs, when `"attentions"` meets a model whose attention is not eager).
        IndexError: `layers` or `heads` out of range for the model's config.
        FileExistsError: `spill_dir` exists and is neither empty nor (with `append`) a recording.
        RecordingError, BlockingIOError, OSError: with `append`, the recording in `spill_dir` is damaged;
            another process writes it; it cannot be created or written.
        UnsupportedModeError: raised by a `generate()` call it cannot record, before the call runs.
        RuntimeError: raised by a `generate()` call in a forked child process of the one that created a
            recorder with `spill_dir`, before the call runs (an in-memory recorder records a child's calls in
            the child's memory); TypeError: pickling or copying a recorder (a spawned process creates its own).

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
        encoding_seed: int = 0,
        every_call: bool = False,
    ) -> None:
        model, self._peft_model = _peft.unwrap(model)  # a PEFT model's generate() reaches the model inside
        options = RecorderOptions.check(
            model, streams=streams, layers=layers, heads=heads, newest_position_only=newest_position_only,
            ring_slots=ring_slots, spill_dir=spill_dir, shard_bytes=shard_bytes, encodings=encodings, append=append,
            prompt_logprobs=prompt_logprobs, prompt_chunk=prompt_chunk, encoding_seed=encoding_seed,
            every_call=every_call,
        )
        self._options = options
        self._encoding_generators: dict[torch.device, torch.Generator] = {}  # per device, made on first use
        self._spill: Spill | None = None
        if options.spill_dir is not None:
            self._spill = Spill(
                options.spill_dir,
                shard_bytes=options.shard_bytes,
                model_info=model_info(model),
                created_by=created_by(),
                append=options.append,
            )
        self._model = model
        self._pid = os.getpid()  # the process that opened `spill_dir`: a forked child may not write to it
        name_or_path = getattr(model, "name_or_path", "")
        self.model_name = type(model).__name__ + (f" {name_or_path!r}" if name_or_path else "")
        self.streams = options.streams
        self.every_call = options.every_call
        self._generations: list[Generation] = []  # oldest first
        self._lock = threading.Lock()
        self._active: Capture | None = None
        self._warned_accumulation = False
        self._pending_samples: Samples | None = None  # from set_samples, for the next call
        self._closed = False
        self._began = 0  # generate() calls that carried this recorder
        self._ran_without = 0  # the model's generate() calls that did not
        self._continuous = _continuous.ContinuousCapture(self._on_request)
        self._request_writing = _requests.RequestWriting(  # each continuous batching request's
            self._options, getattr(model, "dtype", torch.float32), self._encoding_generators, self._open_store)
        _hooks.attach(model, self)

    # -- lifecycle ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove this recorder's hooks from the model; the recordings stay readable. Idempotent."""
        if not self._closed:
            self._closed = True
            _hooks.detach(self._model, self)
            self._continuous.close()
            if self._spill is not None:
                self._spill.close()
            if not self._began and self._ran_without:
                warnings.warn(UnrecordedCallWarning(
                    f"this Recorder closed having recorded nothing, while {type(self._model).__name__}.generate() "
                    f"ran {self._ran_without} time(s) without it: a Recorder records only the calls it is handed; "
                    "pass it as `model.generate(..., logits_processor=[rec])`."), stacklevel=2)

    # -- what the hooks call (`capture.call_recorder.CallRecorder`); not for user code -----------------------------
    def unrecorded_call(self) -> None:
        """The model's `generate()` ran without this recorder in its `logits_processor`."""
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
    def __bool__(self) -> bool:
        # Truthy however many generations it holds (`len()` counts them): code that tests a processor
        # with `logits_processor or default`, transformers' included, must keep it.
        return True

    def _none_recorded(self) -> str:
        return "this Recorder has recorded no generation yet: pass it to `model.generate(..., logits_processor=[rec])` first."

    @property
    def spill_dir(self) -> Path | None:
        """The recording directory (`spill_dir`), or None for an in-memory recorder."""
        return None if self._spill is None else self._spill.root

    def clear(self) -> None:
        """Forget every recorded generation, freeing their host memory once you hold none of their tensors
        (a step you keep holds its block of up to 64 MiB: `.clone()` it to hold only its own bytes).

        Raises:
            ValueError: the recorder writes to `spill_dir`, whose recording stays on disk.
        """
        if self._spill is not None:
            raise ValueError(
                f"this Recorder writes to `spill_dir` {str(self._spill.root)!r}; its generations stay on "
                "disk. Delete that directory to remove them."
            )
        with self._lock:
            self._generations.clear()

    def set_samples(self, ids: Sequence[str | int], *, metadata: Sequence[dict[str, Any]] | None = None) -> None:
        """Name the prompts of the next recorded `generate()` call (which takes them, also when it fails):
        your ids and, optionally, metadata per prompt, kept in the manifest; `samples()`, the table's `sample`
        column and the viewer show them. A call without them numbers its prompts by their position among
        the recording's prompts (docs/answers.md#your-ids-and-a-per-token-table).

        Args:
            ids (`Sequence[str | int]`): one id per prompt of the call's batch, in batch order, distinct.
            metadata (`Sequence[dict]`, *optional*): one JSON-serialisable dict per prompt.

        Raises:
            TypeError: `ids` or `metadata` are not lists of the types above, or metadata is not JSON.
            ValueError: repeated ids, a metadata list of another length, or ids still waiting for a call;
                the next `generate()` raises ValueError, before it runs, when its batch has another size.
        """
        samples = check_samples(ids, metadata)
        with self._lock:
            if self._pending_samples is not None:
                raise ValueError(
                    f"`set_samples` was already called with {list(self._pending_samples.ids)!r}, and no "
                    "generate() call has taken them yet: call generate() between two `set_samples`."
                )
            self._pending_samples = samples

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise _refusals.not_pickled(f"a transformers-offload Recorder of {type(self._model).__name__}")

    # -- called by the hooks ---------------------------------------------------------------------------
    def check_call(self, *, custom_generate: Any, attention_mask: Any, inputs: Any = None,
                   past_key_values: Any = None) -> None:
        """What `begin_call` refuses, checked without starting anything (before a call whose capture
        begins later, with its loop)."""
        _refusals.check_process(self.spill_dir, self._pid)
        problem = _refusals.samples_mismatch(self._pending_samples, attention_mask, inputs)
        if problem is not None:
            with self._lock:
                self._pending_samples = None  # dropped, as the message says: name them again
            raise ValueError(problem)
        _refusals.refuse(prompt_scoring=self._options.prompt_scoring, past_key_values=past_key_values,
                       custom_generate=custom_generate)
        if self._active is not None:
            raise RuntimeError(_BUSY)

    def begin_call(self, *, assistant_model: Any, custom_generate: Any, attention_mask: Any,
                   inputs: Any = None, past_key_values: Any = None) -> Capture:
        """Start recording one `generate()` call, before its decoding loop; returns its capture."""
        self.check_call(custom_generate=custom_generate, attention_mask=attention_mask, inputs=inputs,
                        past_key_values=past_key_values)
        with self._lock:
            self._began += 1
            samples, self._pending_samples = self._pending_samples, None
        if "attentions" in self.streams:
            _layers.require_eager(self._model)
        is_encoder_decoder = bool(getattr(self._model.config, "is_encoder_decoder", False))
        kinds = _layers.kinds(self.streams, is_encoder_decoder)
        with self._lock:
            if self._active is not None:
                raise RuntimeError(_BUSY)
            self._active = Capture(
                self._options,
                index=self._spill.next_index if self._spill is not None else len(self._generations),
                open_store=self._open_store,
                assistant_model=assistant_model,
                attention_mask=attention_mask,
                layer_tap=_layers.LayerTap(kinds, self._options.selection, self.streams, self._model) if kinds else None,
                samples=samples,
                threaded=_on_cuda(self._model),
                on_cpu=device_type(self._model) == "cpu",
                vocab_size=model_info(self._model)["vocab_size"],
                model_dtype=getattr(self._model, "dtype", torch.float32),
                encoding_generators=self._encoding_generators,
                adapters=_peft.adapters(self._peft_model),
            )
            return self._active

    def end_call(self, capture: Capture, output: Any, error: BaseException | None) -> None:
        """End a call's recording: `output` is what it returned (None when `error` ended it)."""
        try:
            if capture.started:
                kept_on_device = list(capture.facts.kept_on_device)
                if kept_on_device and not self._warned_accumulation:
                    self._warned_accumulation = True
                    warnings.warn(DeviceAccumulationWarning.about(kept_on_device), stacklevel=3)
                generation = generation_of(capture.finish(output, error))
                with self._lock:
                    self._generations.append(generation)
                mismatch = capture.mismatch or (str(error) if isinstance(error, RecordingMismatch) else None)
                if mismatch is not None:
                    warnings.warn(RecordingMismatchWarning.about(generation.index, mismatch), stacklevel=3)
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

    def attach(self, manager: Any) -> None:
        """Record the requests of a continuous batching manager (`model.init_continuous_batching()`), each
        as a `Generation` of one row whose sample id is its request id, when `manager.get_result()` hands
        out its finished result (until `close()`); `generate_batch(..., logits_processor=[rec])` attaches itself.
        docs/recording.md#continuous-batching says what is recorded.

        Raises:
            TypeError: `manager` is not one; RuntimeError: this recorder is closed, the manager runs already,
                or another recorder is attached to it (attaching again is a no-op).
            UnsupportedModeError: the manager batches asynchronously, replays CUDA graphs or compiles its
                forward, or this recorder records attentions, hidden states or prompt logprobs.
        """
        _refusals.check_process(self.spill_dir, self._pid)
        self._continuous.attach(manager, self._options)
        self._began += 1

    def record_batch(self, generate_batch: Any, *args: Any, **kwargs: Any) -> Any:  # `generate_batch(..., [rec])`
        return _continuous.run_recorded(self._model, generate_batch, args, kwargs, self.attach)

    def _on_request(self, result: Any, steps: Any, generation_config: Any) -> None:
        with self._lock:
            index = self._spill.next_index if self._spill is not None else len(self._generations)
            stored, mismatch = _requests.store(result, steps, generation_config, index=index, writing=self._request_writing)
            self._generations.append(generation := generation_of(stored))
        if mismatch is not None:
            warnings.warn(RecordingMismatchWarning.about(generation.index, mismatch), stacklevel=4)

    def _open_store(self, names: list[str], header: GenerationHeader, max_steps: int) -> Any:
        if self._spill is None:
            return MemoryStore(names)
        return self._spill.open_store(names, header, max_steps)

    # -- as a processor, it is never called while the hooks are in place ------------------------------
    def __call__(self, input_ids: torch.LongTensor, scores: Any) -> Any:  # type: ignore[override]
        """Never records: the hooks take the recorder out of the lists they build.

        Inside a recorded call it passes `scores` through unchanged (4.38-4.56 hand it to the assistant
        model's `generate()`, whose drafts are not recorded); elsewhere `generate()` did not go through
        the model it is attached to.

        Raises:
            RuntimeError: called outside a recorded call, saying how to pass the recorder instead.
        """
        if _hooks.records_now(self._model):
            return scores  # an assistant model drafting inside the recorded call
        raise RuntimeError(
            f"this Recorder was called as an ordinary processor, so the call did not go through the "
            f"generate() of the model it records ({self.model_name}): a different model, "
            "`GenerationMixin.generate(model, ...)` called on the class, or a closed recorder. "
            "Create `Recorder(model)` for the model you call, keep it open, and call "
            "`model.generate(..., logits_processor=[rec])`."
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"Recorder({self.model_name}, streams={self.streams}, ring_slots={self._options.ring_slots}, "
            f"{len(self._generations)} generation(s), {state})"
        )


_BUSY = ("this Recorder is already recording a generate() call (in another thread, or one that has not returned): "
         "one Recorder records one call at a time. Give each concurrent call its own Recorder.")


def _on_cuda(model: Any) -> bool:
    """Whether `model` computes on CUDA: then the ring drains in its own thread."""
    return device_type(model) == "cuda"
