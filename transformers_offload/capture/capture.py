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
import threading
from dataclasses import replace
from typing import Any, Callable, Iterator

import torch

from .. import _compat, _interrupts
from ..codecs import packed as _packed
from ..codecs.native import Native
from ..codecs.sparse import Sparse
from ..codecs.spec import NATIVE, SAME_AS_LOGITS, SPARSE, is_packed
from ..codecs.stats import STATS_STREAM
from ..store import layout as _layout
from ..store.header import GenerationHeader
from ..store.stored import StoredGeneration
from . import layers as _layers
from .loop_check import RecordingMismatch, StepLog, check_beams, check_loop
from .modes import check_mode, sampling_masks
from .options import RecorderOptions
from .stats import StepStats
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
                 encoding_generators: dict[torch.device, torch.Generator] | None = None) -> None:
        """`options`: the recorder's; `index`: the generation's in its recording; `open_store`: opens its
        store; `threaded`: drain the ring in a thread of its own (a CUDA model); `on_cpu`: a CPU model;
        `encoding_generators`: the recorder's generators of the `"sample:N@T"` draws, per device."""
        self.streams = options.streams
        self.encodings = dict(options.encodings)  # logits/scores not recorded dense (`encodings`)
        self._sparse_encoder = Sparse()
        self._native_encoder = Native(model_dtype)
        # Top-k and sampled encodings, per stream; `encoding_generators`: the recorder's, per device.
        generators = {} if encoding_generators is None else encoding_generators
        self._packed = {
            name: _packed.encoder(encoding, model_dtype=model_dtype, generators=generators, seed=options.encoding_seed)
            for name, encoding in self.encodings.items() if is_packed(encoding)
        }
        self.layer_tap = layer_tap  # attentions and hidden states, when the recorder records them
        self._layer_names: list[str] = []  # per-step layer streams, known from the first forward
        self._layers_fired = 0  # selected layers the module hooks put in the current forward
        self._thread = 0  # the thread running the call
        self._forwards = 0  # forwards of the decoding loop so far
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
        self.do_sample = False
        self.prompt_length = 0
        self.scores_as_logits = False
        self._scores_once = options.scores_once  # False: `encodings={"scores": "dense"}` asked for them stored anyway
        # Scores "sparse" where a warper masks them (no encoding named), where measured no slower than
        # dense (bench/encodings_cost.py): on CPU.
        self._sparse_scores = options.sparse_scores and on_cpu
        self._vocab_size = vocab_size  # the model config's, when known
        self._raw_scores: torch.Tensor | None = None  # this step's raw logits, with `scores_as_logits`
        self.num_beams = 1
        self.num_beam_groups = 1
        self.num_rows = 0
        self.eos_ids: torch.Tensor | None = None
        self.kept_on_device: list[str] = []  # the call's own `output_*` options that keep steps on the device
        # What the generation's header (`GenerationHeader`, made at `start`) takes from the call's set-up:
        # `samples`, its `sample_ids` and `sample_metadata` (Recorder.set_samples), kept as given; `loop`,
        # which loop of its call this is (`loops`, for a model whose generate() runs several).
        self.index = index
        self.samples: dict[str, Any] = dict(samples or {})
        self.loop: dict[str, Any] | None = None
        self.header: GenerationHeader | None = None
        self._step = -1
        self._tokens_until = 0  # steps [0, _tokens_until) have their token recorded
        self._target_forward = False  # assisted decoding: the recorded model ran since the last check
        self._finished: torch.Tensor | None = None
        self._no_beam_finished: torch.Tensor | None = None
        self._forward_logits: list[torch.Tensor] = []
        self._keeps_forward_logits = False  # whether on_forward copies the next-token logits
        self._group_scores: torch.Tensor | None = None
        self._previous_ids: torch.Tensor | None = None
        self._late_error: BaseException | None = None
        # What the loop appended, copied as seen (tiny per-step clones on the device, no host sync), for
        # the end-of-loop check (`loop_check`): the prompt and each step's tokens; in beam search also each
        # step's parents.
        self._seen_prompt: torch.Tensor | None = None
        self._seen_tokens = StepLog()
        self._seen_parents = StepLog()
        self.mismatch: str | None = None  # what `finish` found to disagree with the call, if anything
        # A model whose generate() runs the loop several times (`loops`): this loop's own output, and
        # per prompt whether the model reruns it (fallback) or skips it; whether it was the last attempt.
        self.loop_output: Any = None
        self.prompt_verdicts: dict[int, tuple[bool, bool]] = {}
        self.last_attempt = False
        # Per-token statistics: each step's full tensors, kept on the device until its tokens are known.
        self._stats = StepStats() if STATS_STREAM in self.streams else None
        # Prompt logprobs: the first forward's final hidden states, kept until the first step's processors.
        self.prompt_scoring = options.prompt_scoring
        self._prompt_hidden: torch.Tensor | None = None
        self._prompt_mask: torch.Tensor | None = None
        self._prompt_scored = options.prompt_scoring is None
        self._prompt_pad: int | None = None  # without an attention mask: the pad token id it is inferred from
        self._rows_per_prompt = 1

    # -- set-up, from the processor-list hook, before the decoding loop ------------------------------
    def start(self, generation_config: Any, prompt_length: int, *, no_processors: bool = False) -> None:
        """Set up the call's recording, before its decoding loop: `no_processors` when the processor
        list generate() built holds nothing (besides the recorder)."""
        mode = check_mode(generation_config, self.assistant_model, self.streams)
        self.mode = mode
        self.do_sample = bool(generation_config.do_sample)
        self.prompt_length = int(prompt_length)
        self.num_beams = int(generation_config.num_beams or 1) if mode in _layout.BEAM_MODES else 1
        self.num_beam_groups = int(generation_config.num_beam_groups or 1) if self.is_group else 1
        # Raw logits come from the forward where the processors get something else (beam search gets
        # log-probs, DoLa a contrast of layers); group beam search also sizes its scores from them.
        from_forward = self.is_beam or mode == _compat.DOLA_MODE
        self._keeps_forward_logits = self.is_group or (from_forward and ("logits" in self.streams or bool(self._stats)))
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
        if self.prompt_scoring is not None:
            if getattr(generation_config, "prefill_chunk_size", None):
                raise ValueError(
                    "`prompt_logprobs` scores the prompt from the prefill's one forward, and `prefill_chunk_size` "
                    "splits it into several; nothing was run. Drop one of them for this call."
                )
            self._prompt_mask = mask
            pad = generation_config.pad_token_id
            if mask is None and pad is not None and int(pad) not in eos_list:
                self._prompt_pad = int(pad)  # as generate() infers the mask: padding is the pad token
            self._rows_per_prompt = self.num_beams if self.is_beam else int(generation_config.num_return_sequences or 1)
        self.header = GenerationHeader(
            index=self.index,
            mode=mode,
            prompt_length=self.prompt_length,
            num_beams=self.num_beams,
            eos_token_id=tuple(eos_list),
            generation_config={
                key: _jsonable(value)
                for key, value in generation_config.to_diff_dict().items()
                if not key.startswith("_")
            },
            prompt_lengths=None if mask is None else tuple(int(n) for n in mask.sum(-1).tolist()),
            pad_token_id=_jsonable(generation_config.pad_token_id),
            encodings={**self.encodings, **({"scores": SAME_AS_LOGITS} if self.scores_as_logits else {})},
            sample_ids=self.samples.get("sample_ids"),
            sample_metadata=self.samples.get("sample_metadata"),
            loop=self.loop,
            # `layers` is set at the first forward, when attentions or hidden states are recorded.
        )
        max_length = getattr(generation_config, "max_length", None)
        max_steps = max(1, max_length - self.prompt_length) if isinstance(max_length, int) else 2**31
        self.store = self.open_store(self.names, self.header, max_steps)
        # Beam search adds a step's token and parent one step later, while its slot is still held.
        slots = max(self.ring_slots, 2) if self.is_beam else self.ring_slots
        self.ring = HostRing(slots, self.store.drain, threaded=self.threaded, keep=getattr(self.store, "keep", None))
        if self.layer_tap is not None:
            self._thread = threading.get_ident()
            names = self.layer_tap.install(self._on_layer)  # module hooks, where the model declares them
            if names is not None:
                self.header = replace(self.header, layers=self.layer_tap.describe())
                self.store.add_streams(names, [], self.header.layers)
                self._layer_names = names
        self.started = True

    @property
    def names(self) -> list[str]:
        """Every stream this call records, in the order they are stored."""
        names = [*(s for s in ("logits", "scores") if s in self.streams and not (s == "scores" and self.scores_as_logits)),
                 "tokens", "finished"]
        names += ["beam_parents"] * self.is_beam + [STATS_STREAM] * bool(self._stats)
        return names + self._layer_names

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
            self._target_forward = True
        if self.layer_tap is not None:
            self._record_layers(output)
        if not self._keeps_forward_logits:
            return
        logits = getattr(output, "logits", None)  # generate() always asks for a ModelOutput
        if logits is not None:
            # low_memory beam search (4.38-4.49) runs one forward per sub-batch: joined in on_raw.
            upcast = _compat.UPCASTS_LOGITS and not self.is_group
            self._forward_logits.append(_compat.forward_raw_logits(logits, upcast=upcast))

    def _record_layers(self, output: Any) -> None:
        step = self._forwards  # in the modes that record them, every forward is one step
        self._forwards += 1
        if self.layer_tap.taps is not None:  # the module hooks put this step's layers already
            fired, self._layers_fired = self._layers_fired, 0
            if fired != len(self._layer_names):
                raise RuntimeError(
                    f"transformers-offload: the hooks on this model's layers ran {fired} times in the "
                    f"forward of step {step}, for {len(self._layer_names)} selected layers; its layers do "
                    "not run as its class declares. Please report this with your transformers version."
                )
            return
        if step == 0:
            per_step, once = self.layer_tap.names(output)
            self.header = replace(self.header, layers=self.layer_tap.describe())
            self.store.add_streams(per_step, once, self.header.layers)
            self._layer_names = per_step
        for name, tensor in self.layer_tap.pick(output, first=step == 0):
            self.ring.put(step, name, tensor)
        if step == 0:
            self.layer_tap.encoder_output = None  # copied: the capture keeps no reference to it

    def _on_layer(self, name: str, tensor: torch.Tensor) -> None:
        """A selected layer's tensor, from its module's hook, in the forward of step `_forwards`."""
        if self._in_lists or threading.get_ident() != self._thread:
            return  # a forward made by a processor, or another thread's call of the same model
        with _interrupts.held():
            self._layers_fired += 1
            self.ring.put(self._forwards, name, tensor)

    def close_taps(self) -> None:
        """Remove the module hooks of the call (idempotent)."""
        if self.layer_tap is not None:
            self.layer_tap.remove()

    def on_base_output(self, output: Any) -> None:
        """The decoder's own output (the head's input) in a forward: the first one's final hidden
        states are kept for the prompt logprobs."""
        if self._prompt_scored or self._prompt_hidden is not None or self._in_lists or not self.started:
            return
        hidden = getattr(output, "last_hidden_state", None)
        if hidden is None and isinstance(output, (tuple, list)) and output:
            hidden = output[0]
        if isinstance(hidden, torch.Tensor) and hidden.dim() == 3:
            self._prompt_hidden = hidden.detach()

    def _score_prompt(self, input_ids: torch.Tensor) -> None:
        """At the first step's processors: the prompt logprobs, put into the ring as step 0 streams
        recorded once per call."""
        hidden, self._prompt_hidden = self._prompt_hidden, None
        self._prompt_scored = True
        if hidden is None:
            raise RuntimeError(
                f"transformers-offload saw no decoder output before the first {self.mode!r} step, so it cannot "
                f"score the prompt (`prompt_logprobs`): this {self.prompt_scoring.model_name}'s forward does not "
                "call its base model (or decoder). Record without `prompt_logprobs`, and please report it."
            )
        if hidden.shape[1] < self.prompt_length:
            raise RuntimeError(
                f"transformers-offload: the call's first forward saw {hidden.shape[1]} of the prompt's "
                f"{self.prompt_length} positions (a cache or a chunked prefill), so `prompt_logprobs` cannot "
                "score the prompt. Record without it, or score the whole prompt in one forward."
            )
        prompt = input_ids[:, : self.prompt_length]
        mask = self._prompt_mask
        if mask is None and self._prompt_pad is not None:
            mask = (prompt[:: self._rows_per_prompt] != self._prompt_pad).long()
        found = self.prompt_scoring.score(hidden, prompt, mask, self._rows_per_prompt)
        self._prompt_mask = None
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
        if not self._prompt_scored and (self._target_forward or not self.is_assisted):
            self._score_prompt(input_ids)  # (not at prompt lookup's probes, before the model's first forward)
        if self.is_group:
            if not group:  # the first group of a step
                self._step += 1
                raw = self._take_forward_logits()
                self.num_rows = raw.shape[0]
                if "logits" in self.streams:
                    self._put_full(self._step, "logits", raw)
                if self._stats is not None:
                    self._stats.raw(self._step, raw)
                # out.scores of a step: every group's processed scores, in the model's dtype.
                self._group_scores = torch.zeros_like(raw)
                self._put_running_beams_finished(self._step, self.num_rows)
            return
        if self.is_beam:
            self._step += 1
            step = self._step
            # The previous step's token first: this step's first put may wait for a slot.
            self._record_ancestry(step, input_ids)
            if "logits" in self.streams or self._stats is not None:
                raw = self._take_forward_logits()
                if "logits" in self.streams:
                    self._put_full(step, "logits", raw)
                if self._stats is not None:
                    self._stats.raw(step, raw)
            self._put_running_beams_finished(step, input_ids.shape[0])
            return
        if self.is_assisted and not self._target_forward:
            return  # an assistant's draft, or prompt lookup probing its candidates with made-up scores
        # Assisted decoding calls the list once per candidate position; a rejected position is
        # written again later (the last write of a step wins) or has no token and is dropped.
        self._step = input_ids.shape[-1] - self.prompt_length
        self.num_rows = input_ids.shape[0]
        if self._finished is None:
            self._finished = torch.zeros(self.num_rows, dtype=torch.bool, device=input_ids.device)
        if "logits" in self.streams or self._stats is not None:
            if self.mode == _compat.DOLA_MODE:
                # DoLa hands the processors its contrast of layers; `out.logits` is the final layer's.
                scores = self._take_forward_logits()
            if "logits" in self.streams:
                self._put_full(self._step, "logits", scores)
            if self._stats is not None:
                self._stats.raw(self._step, scores)
        if self.scores_as_logits:
            self._raw_scores = scores
        self.ring.put(self._step, "finished", self._finished)

    def _put_running_beams_finished(self, step: int, rows: int) -> None:
        # Running beams never finish (finished hypotheses leave them): known on the host.
        if self._no_beam_finished is None:
            self._no_beam_finished = torch.zeros(rows, dtype=torch.bool)
        self.ring.put(step, "finished", self._no_beam_finished)

    def _put_full(self, step: int, name: str, tensor: torch.Tensor) -> None:
        """Put a `(rows, vocab)` stream (`logits`, `scores`) into the ring, encoded on its device first
        where the Recorder's `encodings` say so."""
        encoding = self.encodings.get(name)
        if encoding is None:
            self.ring.put(step, name, tensor)
        elif encoding == SPARSE:
            self.ring.put(step, name, tensor, encoder=self._sparse_encoder)
        elif encoding == NATIVE:
            self.ring.put(step, name, tensor, encoder=self._native_encoder)
        else:
            self.ring.put(step, name, tensor, encoder=self._packed[name])

    def _take_forward_logits(self) -> torch.Tensor:
        parts, self._forward_logits = self._forward_logits, []
        if not parts:
            raise RuntimeError(
                f"transformers-offload saw no model forward before this {self.mode!r} step, so it cannot "
                "record the raw logits; please report this with your transformers version."
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def on_processed(self, input_ids: torch.Tensor, scores: torch.Tensor, group: int | None = None) -> None:
        """Called with what the last processor or warper returned."""
        if self.is_group:
            size = self.num_beams // self.num_beam_groups
            start = (group or 0) * size
            end = min(start + size, self.num_beams)
            beams = self._group_scores.view(-1, self.num_beams, self._group_scores.shape[-1])
            beams[:, start:end] = scores.view(beams.shape[0], end - start, -1)
            if end == self.num_beams and "scores" in self.streams:
                self._put_full(self._step, "scores", self._group_scores)
            if end == self.num_beams and self._stats is not None:
                self._stats.processed(self._step, self._group_scores)
            return
        if self.is_assisted and not self._target_forward:
            return
        # 4.36-4.44 assisted decoding runs the warpers after all positions went through the processors.
        step = self._step if self.is_beam else input_ids.shape[-1] - self.prompt_length
        if self.scores_as_logits:
            raw, self._raw_scores = self._raw_scores, None
            if raw is not scores:
                raise RuntimeError(
                    "transformers-offload stored this call's scores as its logits (no processor ran), but the "
                    f"decoding loop's processed scores at step {step} are another tensor; please report this with "
                    "your transformers version (record with `encodings={'scores': 'dense'}` meanwhile)."
                )
        elif "scores" in self.streams:
            self._put_full(step, "scores", scores)
        if self._stats is not None:
            self._stats.processed(step, scores)

    def on_stopping(self, input_ids: torch.Tensor, is_done: Any) -> None:
        """Called after the step's token was appended, with the stopping criteria's verdict (None when
        a criterion raised: the token is recorded all the same, the call ends)."""
        if self.is_group:
            # Every row, after every group appended its tokens: the rows the next step starts from.
            if self._previous_ids is None:
                self._previous_ids = input_ids[:, :-1]  # the prompt, the same in every beam
            # A copy: the next step reorders these rows in place, group by group.
            self._record_ancestry(self._step + 1, input_ids.clone())
            return
        if self.is_beam or self._finished is None:
            return  # beam search passes candidate rows here, not running beams
        if self.is_assisted:
            if not self._target_forward:
                return  # 4.40+ also check the unverified candidates, before the recorded model runs
            self._target_forward = False
        token = input_ids[:, -1]
        if self.eos_ids is not None and not isinstance(is_done, torch.Tensor) and self.eos_ids.device != token.device:
            # Up to 4.38 EOS is checked here (`rows_done`). Once, and from pinned memory: a plain copy
            # from the host would wait for the device.
            eos = self.eos_ids.pin_memory() if token.is_cuda else self.eos_ids
            self.eos_ids = eos.to(token.device, non_blocking=True)
        if self._seen_prompt is None:
            self._seen_prompt = input_ids[:, : self.prompt_length].clone()
        last = input_ids.shape[-1] - self.prompt_length
        for step in range(self._tokens_until, last):  # assisted decoding accepts several tokens at once
            chosen = token if step == last - 1 else input_ids[:, self.prompt_length + step]
            self._seen_tokens.append(chosen)
            self.ring.put(step, "tokens", chosen)
            if self._stats is not None and self._stats.has(step):
                self.ring.put(step, STATS_STREAM, self._stats.record(step, chosen))
        self._tokens_until = last
        if is_done is not None:
            self._finished = self._finished | _compat.rows_done(is_done, token, self.eos_ids)

    def _record_ancestry(self, step: int, input_ids: torch.Tensor) -> None:
        rows = input_ids.shape[0]
        self.num_rows = rows
        previous = self._previous_ids
        self._previous_ids = input_ids
        if self._seen_prompt is None:
            self._seen_prompt = (input_ids if previous is None else previous)[:, : self.prompt_length].clone()
        if previous is None:
            return
        # Row r of this step extends the row of the previous step that holds the same sequence. Only
        # beams of one prompt are compared, and only the generated part (the prompt is shared).
        batch = rows // self.num_beams
        new = input_ids[:, self.prompt_length : -1].reshape(batch, self.num_beams, 1, -1)
        old = previous[:, self.prompt_length :].reshape(batch, 1, self.num_beams, -1)
        same = (new == old).all(dim=-1)  # (batch, new beam, old beam)
        first = same.to(torch.int8).argmax(dim=-1)  # first matching old beam
        offset = torch.arange(batch, device=input_ids.device).unsqueeze(1) * self.num_beams
        # The ancestry of step t's rows is known at step t + 1: it is stored under step t.
        parents = (first + offset).reshape(rows)
        if not self.is_group:  # group beam search is checked by its length only
            self._seen_tokens.append(input_ids[:, -1])
            self._seen_parents.append(parents)
        self.ring.put(step - 1, "beam_parents", parents)
        self.ring.put(step - 1, "tokens", input_ids[:, -1])
        if self._stats is not None and self._stats.has(step - 1):
            self.ring.put(step - 1, STATS_STREAM, self._stats.record(step - 1, input_ids[:, -1], parents))

    # -- the end ---------------------------------------------------------------------------------------
    def finish(self, output: Any, error: BaseException | None) -> StoredGeneration:
        self.close_taps()
        steps = self._step + 1
        if self.is_beam and steps > 0:
            # After the last step no running beam continues.
            last = torch.full((self.num_rows,), -1, dtype=torch.long)
            self.ring.put(steps - 1, "beam_parents", last)
            self.ring.put(steps - 1, "tokens", last)
            if self._stats is not None and self._stats.has(steps - 1):
                self.ring.put(steps - 1, STATS_STREAM, self._stats.record(steps - 1, last, last))
        try:
            self.ring.flush()
        except Exception as late:  # noqa: BLE001 - kept, and raised once the recording is closed
            self._late_error = late
            error = error if error is not None else late
        if error is None and _interrupts.pending():
            error = KeyboardInterrupt()  # Ctrl-C held while the call ended: it is raised next
        self._previous_ids = None
        self._group_scores = None
        self._forward_logits = []
        self._finished = None
        if self._stats is not None:
            self._stats.clear()
        sequences = _compat.output_sequences(output) if error is None else None
        complete_steps = _complete_steps(self.store, self.names, steps)
        if self.is_beam:
            # Group beam search (up to 4.56) reorders its rows group by group: its returned sequences are
            # checked by their length only (no ancestry, no prompt).
            verdict = check_beams(
                complete_steps=complete_steps, sequences=sequences, prompt=self._seen_prompt,
                tokens=self._seen_tokens.steps(), parents=self._seen_parents.steps(), check_paths=not self.is_group,
                num_beams=self.num_beams,
                fill_ids=tuple(i for i in (self.header.pad_token_id, *self.header.eos_token_id) if isinstance(i, int)),
            )
        else:
            seen = None
            if self._seen_prompt is not None:
                seen = self._seen_prompt
                if len(self._seen_tokens):
                    seen = torch.cat([seen, self._seen_tokens.values()], dim=1)
            verdict = check_loop(complete_steps=complete_steps, sequences=sequences, seen_ids=seen,
                                 prompt_length=self.prompt_length)
        self._seen_prompt, self._seen_tokens, self._seen_parents = None, StepLog(), StepLog()
        num_steps = verdict.num_steps
        if verdict.problem is not None and error is None:
            self.mismatch = verdict.problem
            error = RecordingMismatch(verdict.problem)
            sequences = None  # an incomplete generation has none
        if sequences is not None:
            sequences = sequences.detach().to("cpu", copy=True)
        header = replace(self.header, num_rows=self.num_rows, loop=self.loop, nested_calls=self.nested_calls)
        return self.store.finish(num_steps, header, sequences, error, ring_waits=self.ring.waits)


def _complete_steps(store: Any, names: list[str], steps: int) -> int:
    """Number of leading steps for which every stream has a record (an interrupted step is dropped)."""
    for t in range(steps):
        if not all(store.has(name, t) for name in names):
            return t
    return steps


def _jsonable(value: Any) -> Any:
    """`value` as plain JSON types (generate() keeps some config fields as tensors)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)
