"""The capture of one `generate()` call: what each tap sees, turned into per-step records.

`generate()` reaches the capture through three taps that `hooks` puts in place for a call that
carries a recorder: the processor list (raw logits before the first processor, processed scores after
the last one), the stopping-criteria list (the token appended at the end of each step and which rows
are done), and the model's forward: in beam search for the raw logits (the processor list there
receives `log_softmax(logits)`), and for attentions and hidden states (`layers`), which, where the
model declares the modules that compute them, come instead from hooks the capture puts on the selected
layers' modules for the call (`module_taps`). The records go through the ring (`transfer`) to the
store the recorder opened; the store hands back plain data (`store.stored`) when the call ends.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Callable, Iterator

import torch

from .. import _compat, _interrupts
from ..codecs.encoders import encoders
from ..codecs.spec import NATIVE, SAME_AS_LOGITS, SPARSE
from ..codecs.stats import STATS_STREAM
from ..store import layout as _layout
from ..store.header import GenerationHeader, jsonable
from ..store.stored import StoredGeneration
from . import layers as _layers
from .layer_capture import LayerCapture
from .loop_check import RecordingMismatch, StepLog
from .modes import check_mode, sampling_masks
from .options import RecorderOptions
from .prompt_capture import PromptCapture
from .stats import StepStats
from .steps import BeamSteps, PlainSteps, steps_for
from .transfer import HostRing

# Opens the store of one call: given the stream names, the generation's header and the most steps it can
# run, returns an object with `drain(step, tensors)`, `has(name, step)`, `finish(...) -> StoredGeneration`
# and `failure`.
OpenStore = Callable[[list[str], GenerationHeader, int], Any]


class Capture:
    """Records one `generate()` call into a ring and a store, which hands back its recording when it ends."""

    def __init__(self, options: RecorderOptions, *, index: int, open_store: OpenStore, assistant_model: Any,
                 attention_mask: Any = None, layer_tap: _layers.LayerTap | None = None,
                 samples: dict[str, Any] | None = None, threaded: bool = False, on_cpu: bool = False,
                 vocab_size: int | None = None,
                 model_dtype: torch.dtype = torch.float32,
                 encoding_generators: dict[torch.device, torch.Generator] | None = None,
                 adapters: dict[str, Any] | None = None) -> None:
        """`options`: the recorder's; `index`: the generation's in its recording; `open_store`: opens its
        store; `threaded`: drain the ring in a thread of its own (a CUDA model); `on_cpu`: a CPU model;
        `encoding_generators`: the recorder's generators of the `"sample:N@T"` draws, per device;
        `adapters`: a PEFT model's adapters in use (`capture.peft.adapters`), for the header."""
        self.adapters = adapters
        self.streams = options.streams
        self.encodings = dict(options.encodings)  # logits/scores not recorded dense (`encodings`)
        self._encoding = {"model_dtype": model_dtype, "seed": options.encoding_seed,
                          "generators": {} if encoding_generators is None else encoding_generators}
        self.encoders: dict[str, Any] = {}  # per stream in `encodings`, from `start`
        self.layer_tap = layer_tap  # attentions and hidden states, when the recorder records them
        self.layers: LayerCapture | None = None  # their recording, from `start`
        self._in_lists = 0  # > 0 while the processor or criteria list runs
        self.ring_slots = options.ring_slots
        self.threaded = threaded
        self.open_store = open_store
        self.store: Any = None
        self.ring: HostRing | None = None
        self.assistant_model = assistant_model
        self.attention_mask = attention_mask
        self.started = False
        self.wants_forward = True
        self.nested_calls = 0  # generate() calls made inside this loop (an inner decoder's), not recorded
        self.mode = ""
        self.steps: PlainSteps | BeamSteps | None = None  # the mode's step handling, from `start`
        self.do_sample = False
        self.prompt_length = 0
        self.scores_as_logits = False
        self._scores_once = options.scores_once  # False: `encodings={"scores": "dense"}` asked for them stored anyway
        # Scores "sparse" where a warper masks them (no encoding named), where measured no slower than
        # dense (bench/encodings_cost.py): on CPU.
        self._sparse_scores = options.sparse_scores and on_cpu
        self._vocab_size = vocab_size  # the model config's, when known
        self.raw_scores: torch.Tensor | None = None  # this step's raw logits, with `scores_as_logits`
        self.num_beams = 1
        self.num_beam_groups = 1
        self.num_rows = 0  # the loop's rows (batch x beams or return sequences)
        self.eos_ids: torch.Tensor | None = None
        self.kept_on_device: list[str] = []  # the call's own `output_*` options that keep steps on the device
        # What the generation's header (`GenerationHeader`, made at `start`) takes from the call's set-up:
        # `samples`, its `sample_ids` and `sample_metadata` (Recorder.set_samples), kept as given; `loop`,
        # which loop of its call this is (`loops`, for a model whose generate() runs several).
        self.index = index
        self.samples: dict[str, Any] = dict(samples or {})
        self.loop: dict[str, Any] | None = None
        self.header: GenerationHeader | None = None
        self.step = -1
        self._tokens_until = 0  # steps [0, _tokens_until) have their token recorded
        self.target_forward = False  # assisted decoding: the recorded model ran since the last check
        self.finished: torch.Tensor | None = None
        self._forward_logits: list[torch.Tensor] = []
        self._keeps_forward_logits = False  # whether on_forward copies the next-token logits
        self._late_error: BaseException | None = None
        # What the loop appended, copied as seen (tiny per-step clones on the device, no host sync), for
        # the end-of-loop check (`loop_check`): the prompt and each step's tokens; in beam search also each
        # step's parents.
        self.seen_prompt: torch.Tensor | None = None
        self.seen_tokens = StepLog()
        self.seen_parents = StepLog()
        self.mismatch: str | None = None  # what `finish` found to disagree with the call, if anything
        # A model whose generate() runs the loop several times (`loops`): this loop's own output, and
        # per prompt whether the model reruns it (fallback) or skips it; whether it was the last attempt.
        self.loop_output: Any = None
        self.prompt_verdicts: dict[int, tuple[bool, bool]] = {}
        self.last_attempt = False
        # Per-token statistics: each step's full tensors, kept on the device until its tokens are known.
        self.stats = StepStats() if STATS_STREAM in self.streams else None
        # Prompt logprobs: the first forward's final hidden states, kept until the first step's processors.
        self.prompt = None if options.prompt_scoring is None else PromptCapture(options.prompt_scoring)

    # -- set-up, from the processor-list hook, before the decoding loop ------------------------------
    def start(self, generation_config: Any, prompt_length: int, *, no_processors: bool = False) -> None:
        """Set up the call's recording, before its decoding loop: `no_processors` when the processor
        list generate() built holds nothing (besides the recorder)."""
        mode = check_mode(generation_config, self.assistant_model, self.streams)
        self.mode = mode
        self.steps = steps_for(mode, self)
        self.do_sample = bool(generation_config.do_sample)
        self.prompt_length = int(prompt_length)
        self.num_beams = int(generation_config.num_beams or 1) if mode in _layout.BEAM_MODES else 1
        self.num_beam_groups = int(generation_config.num_beam_groups or 1) if self.is_group else 1
        # Raw logits come from the forward where the processors get something else (beam search gets
        # log-probs, DoLa a contrast of layers); group beam search also sizes its scores from them.
        from_forward = self.is_beam or mode == _compat.DOLA_MODE
        self._keeps_forward_logits = self.is_group or (from_forward and ("logits" in self.streams or bool(self.stats)))
        # Whether `on_forward` has anything to do in this call (else the forward hook returns at once).
        self.wants_forward = self._keeps_forward_logits or self.is_assisted or self.layer_tap is not None
        eos = generation_config.eos_token_id
        eos_list = [] if eos is None else [int(e) for e in torch.as_tensor(eos).flatten().tolist()]
        if eos_list:
            self.eos_ids = torch.tensor(eos_list)
        self.kept_on_device = _compat.outputs_kept_on_device(generation_config)
        if (self._sparse_scores and "scores" in self.streams
                and sampling_masks(generation_config, self._vocab_size)):
            # Sampling through top-k, top-p...: a few finite scores per row, stored as those (lossless).
            self.encodings["scores"] = SPARSE
        self.encoders = encoders(self.encodings, **self._encoding)
        # Greedy search or sampling with no processor (nor, 4.36-4.44, a warper list, not built yet):
        # the processed scores are the raw logits, the very tensor: `scores` is stored once, as them.
        self.scores_as_logits = (
            self._scores_once and no_processors and mode in ("greedy_search", "sample")
            and not _compat.final_tap_on_warper_list(mode, self.do_sample)
            and "logits" in self.streams and "scores" in self.streams and "scores" not in self.encodings
            and self.encodings.get("logits") in (None, NATIVE, SPARSE)  # the logits whole
        )
        mask = self.attention_mask
        self.attention_mask = None
        if self.prompt is not None:
            rows_per_prompt = self.num_beams if self.is_beam else int(generation_config.num_return_sequences or 1)
            self.prompt.start(generation_config, mask, eos_list, rows_per_prompt)
        self.header = self._header(generation_config, mask, eos_list)
        max_length = getattr(generation_config, "max_length", None)
        max_steps = max(1, max_length - self.prompt_length) if isinstance(max_length, int) else 2**31
        self.store = self.open_store(self.names, self.header, max_steps)
        # Beam search adds a step's token and parent one step later, while its slot is still held.
        slots = max(self.ring_slots, 2) if self.is_beam else self.ring_slots
        self.ring = HostRing(slots, self.store.drain, threaded=self.threaded, keep=getattr(self.store, "keep", None))
        if self.layer_tap is not None:
            self.layers = LayerCapture(self.layer_tap, put=self.ring.put, add_streams=self.store.add_streams,
                                       in_lists=lambda: self._in_lists > 0)
            self.layers.start()
        self.started = True

    def _header(self, generation_config: Any, mask: torch.Tensor | None, eos: list[int]) -> GenerationHeader:
        """The generation's header as known when its loop starts (`finish` adds the rest)."""
        return GenerationHeader(
            index=self.index,
            mode=self.mode,
            prompt_length=self.prompt_length,
            num_beams=self.num_beams,
            eos_token_id=tuple(eos),
            generation_config={
                key: jsonable(value)
                for key, value in generation_config.to_diff_dict().items()
                if not key.startswith("_")
            },
            prompt_lengths=None if mask is None else tuple(int(n) for n in mask.sum(-1).tolist()),
            pad_token_id=jsonable(generation_config.pad_token_id),
            encodings={**self.encodings, **({"scores": SAME_AS_LOGITS} if self.scores_as_logits else {})},
            sample_ids=self.samples.get("sample_ids"),
            sample_metadata=self.samples.get("sample_metadata"),
            loop=self.loop,
            adapters=self.adapters,
            # `layers` is set at the first forward, when attentions or hidden states are recorded.
        )

    @property
    def names(self) -> list[str]:
        """Every stream this call records, in the order they are stored."""
        names = [*(s for s in ("logits", "scores") if s in self.streams and not (s == "scores" and self.scores_as_logits)),
                 "tokens", "finished"]
        names += ["beam_parents"] * self.is_beam + [STATS_STREAM] * bool(self.stats)
        return names + ([] if self.layers is None else self.layers.names)

    @property
    def failure(self) -> BaseException | None:
        """What failed while the call's recording was closed (a shard that could not be written...):
        raised once the manifest says how the call ended."""
        if self.store is not None and self.store.failure is not None:
            return self.store.failure
        return self._late_error

    @property
    def is_beam(self) -> bool:
        return self.mode in _layout.BEAM_MODES

    @property
    def is_assisted(self) -> bool:
        return self.mode == _compat.ASSISTED_MODE

    @property
    def is_group(self) -> bool:
        return self.mode == _compat.GROUP_BEAM_MODE

    # -- taps, inside the decoding loop --------------------------------------------------------------
    @contextlib.contextmanager
    def inside_a_list(self) -> Iterator[None]:
        """While the processor or stopping-criteria list runs: a forward of the model there is not the
        decoding loop's (classifier-free guidance's processor runs one per step, a user's may too)."""
        self._in_lists += 1
        try:
            yield
        finally:
            self._in_lists -= 1

    def on_forward(self, output: Any) -> None:
        """Record the selected attentions and hidden states of this step's forward. Beam search: keep
        its next-token logits as transformers takes them. Assisted decoding: note that the recorded
        model (not the assistant) ran. Forwards made by a processor or criterion are ignored."""
        if self._in_lists:
            return
        if self.is_assisted:
            self.target_forward = True
        if self.layers is not None:
            self.layers.on_forward(output)
        if not self._keeps_forward_logits:
            return
        logits = getattr(output, "logits", None)  # generate() always asks for a ModelOutput
        if logits is not None:
            # low_memory beam search (4.38-4.49) runs one forward per sub-batch: joined in on_raw.
            upcast = _compat.UPCASTS_LOGITS and not self.is_group
            self._forward_logits.append(_compat.forward_raw_logits(logits, upcast=upcast))

    def close_taps(self) -> None:
        """Remove the module hooks of the call (idempotent)."""
        if self.layers is not None:
            self.layers.close()
        elif self.layer_tap is not None:
            self.layer_tap.remove()

    def on_base_output(self, output: Any) -> None:
        """The decoder's own output (the head's input) in a forward, for the prompt logprobs."""
        if self.prompt is not None and not self._in_lists and self.started:
            self.prompt.on_base_output(output)

    def _score_prompt(self, input_ids: torch.Tensor) -> None:
        """At the first step's processors: the prompt logprobs, put into the ring as step 0 streams
        recorded once per call."""
        found = self.prompt.score(input_ids, self.prompt_length, self.mode)
        self.store.add_once(list(found))
        for name, tensor in found.items():
            self.ring.put(0, name, tensor)

    def on_encoder(self, output: Any) -> None:
        """An encoder-decoder model's encoder ran (before the decoding loop): its outputs are recorded
        at the first step, when the ring exists."""
        if self.layer_tap is not None:
            self.layer_tap.encoder_output = output

    def on_raw(self, input_ids: torch.Tensor, scores: torch.Tensor, group: int | None = None) -> None:
        """Called with what the first processor receives, before it runs (once per beam group, with
        that group's rows only, in group beam search)."""
        if self.prompt is not None and not self.prompt.scored and (self.target_forward or not self.is_assisted):
            self._score_prompt(input_ids)  # (not at prompt lookup's probes, before the model's first forward)
        if self.steps is not None:  # None once the loop finished
            self.steps.on_raw(input_ids, scores, group)

    @property
    def records_raw(self) -> bool:
        """Whether a step's raw logits are recorded (`logits`) or needed (per-token statistics)."""
        return "logits" in self.streams or self.stats is not None

    def put_full(self, step: int, name: str, tensor: torch.Tensor) -> None:
        """Put a `(rows, vocab)` stream (`logits`, `scores`) into the ring, encoded on its device first
        where the Recorder's `encodings` say so."""
        self.ring.put(step, name, tensor, encoder=self.encoders.get(name))

    def take_forward_logits(self) -> torch.Tensor:
        parts, self._forward_logits = self._forward_logits, []
        if not parts:
            raise RuntimeError(
                f"transformers-offload saw no model forward before this {self.mode!r} step, so it cannot "
                "record the raw logits; please report this with your transformers version."
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def on_processed(self, input_ids: torch.Tensor, scores: torch.Tensor, group: int | None = None) -> None:
        """Called with what the last processor or warper returned."""
        if self.steps is not None:  # None once the loop finished
            self.steps.on_processed(input_ids, scores, group)

    def put_processed(self, step: int, scores: torch.Tensor) -> None:
        """Record step `step`'s processed scores (and their statistics)."""
        if self.scores_as_logits:
            raw, self.raw_scores = self.raw_scores, None
            if raw is not scores:
                raise RuntimeError(
                    "transformers-offload stored this call's scores as its logits (no processor ran), but the "
                    f"decoding loop's processed scores at step {step} are another tensor; please report this with "
                    "your transformers version (record with `encodings={'scores': 'dense'}` meanwhile)."
                )
        elif "scores" in self.streams:
            self.put_full(step, "scores", scores)
        if self.stats is not None:
            self.stats.processed(step, scores)

    def on_stopping(self, input_ids: torch.Tensor, is_done: Any) -> None:
        """Called after the step's token was appended, with the stopping criteria's verdict (None when
        a criterion raised: the token is recorded all the same, the call ends)."""
        if self.steps is not None:  # None once the loop finished
            self.steps.on_stopping(input_ids, is_done)

    def record_tokens(self, input_ids: torch.Tensor, is_done: Any) -> None:
        """Record the tokens appended since the last call (assisted decoding accepts several at once)
        and which rows are finished."""
        token = input_ids[:, -1]
        if self.eos_ids is not None and not isinstance(is_done, torch.Tensor) and self.eos_ids.device != token.device:
            # Up to 4.38 EOS is checked here (`rows_done`). Once, and from pinned memory: a plain copy
            # from the host would wait for the device.
            eos = self.eos_ids.pin_memory() if token.is_cuda else self.eos_ids
            self.eos_ids = eos.to(token.device, non_blocking=True)
        if self.seen_prompt is None:
            self.seen_prompt = input_ids[:, : self.prompt_length].clone()
        last = input_ids.shape[-1] - self.prompt_length
        for step in range(self._tokens_until, last):
            chosen = token if step == last - 1 else input_ids[:, self.prompt_length + step]
            self.seen_tokens.append(chosen)
            self.ring.put(step, "tokens", chosen)
            if self.stats is not None and self.stats.has(step):
                self.ring.put(step, STATS_STREAM, self.stats.record(step, chosen))
        self._tokens_until = last
        if is_done is not None:
            self.finished = self.finished | _compat.rows_done(is_done, token, self.eos_ids)

    # -- the end ---------------------------------------------------------------------------------------
    def finish(self, output: Any, error: BaseException | None) -> StoredGeneration:
        self.close_taps()
        steps = self.step + 1
        self.steps.at_end(steps)
        if error is None and _compat.SKIPS_STOPPING_ONCE_ALL_FINISHED:
            self.steps.at_loop_end(output)
        try:
            self.ring.flush()
        except Exception as late:  # noqa: BLE001 - kept, and raised once the recording is closed
            self._late_error = late
            error = error if error is not None else late
        if error is None and _interrupts.pending():
            error = KeyboardInterrupt()  # Ctrl-C held while the call ended: it is raised next
        self._forward_logits = []
        self.finished = None
        if self.stats is not None:
            self.stats.clear()
        sequences = _compat.output_sequences(output) if error is None else None
        complete_steps = _complete_steps(self.store, self.names, steps)
        verdict = self.steps.verdict(complete_steps, sequences)
        self.steps = None  # it refers back to this capture: dropped, so that the capture is freed by its count
        self.seen_prompt, self.seen_tokens, self.seen_parents = None, StepLog(), StepLog()
        num_steps = verdict.num_steps
        if verdict.problem is not None and error is None:
            self.mismatch = verdict.problem
            error = RecordingMismatch(verdict.problem)
            sequences = None  # an incomplete generation has none
        if sequences is not None:
            sequences = sequences.detach().to("cpu", copy=True)
        layers = None if self.layers is None else self.layers.selection
        self.layers = None  # it refers back to this capture (`in_lists`): dropped, as `steps`
        header = replace(self.header, num_rows=self.num_rows, layers=layers, loop=self.loop, nested_calls=self.nested_calls)
        return self.store.finish(num_steps, header, sequences, error, ring_waits=self.ring.waits)


def _complete_steps(store: Any, names: list[str], steps: int) -> int:
    """Number of leading steps for which every stream has a record (an interrupted step is dropped)."""
    for t in range(steps):
        if not all(store.has(name, t) for name in names):
            return t
    return steps
