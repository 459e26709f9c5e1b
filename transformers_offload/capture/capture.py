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
from typing import Any, Callable, Iterator, Protocol

import torch

from .. import _compat, _interrupts
from ..codecs.encoders import encoders
from ..codecs.spec import SAME_AS_LOGITS
from ..codecs.stats import STATS_STREAM
from ..store.header import GenerationHeader, Samples, jsonable
from ..store.stored import StoredGeneration
from . import layers as _layers
from .facts import CallFacts, call_facts
from .layer_capture import LayerCapture
from .loop_check import RecordingMismatch
from .options import RecorderOptions
from .prompt_capture import PromptCapture
from .steps import Put, Steps, steps_for
from .transfer import HostRing, Keep


class CallStore(Protocol):
    """Where one call's steps go (`store.memory.MemoryStore`, `store.shard_writer.ShardStore`), as the capture
    uses it: the ring drains each step into it (whole, or tensor by tensor through `keep` where it has one),
    and `finish` closes it with the generation's header, handing back its recording."""

    keep: Keep | None  # takes each tensor as the ring puts it (in memory, on CPU), or None: whole steps
    failure: BaseException | None  # what failed while it wrote, once known

    def drain(self, step: int, tensors: dict[str, torch.Tensor]) -> None: ...

    def has(self, name: str, step: int) -> bool: ...

    def add_once(self, once: list[str]) -> None: ...

    def add_streams(self, names: list[str], once: list[str], layers: dict[str, Any]) -> None: ...

    def finish(self, num_steps: int, header: GenerationHeader, sequences: torch.Tensor | None,
               error: BaseException | None, *, ring_waits: int) -> StoredGeneration: ...


# Opens the store of one call, given the stream names, the generation's header and the most steps it can run.
OpenStore = Callable[[list[str], GenerationHeader, int], CallStore]


class Capture:
    """Records one `generate()` call into a ring and a store, which hands back its recording when it ends.

    It owns the call's set-up (`facts`, fixed at `start`), its ring, store and header, and the taps' entry
    points; its mode's `steps` own what changes from step to step and hand back what to store.
    """

    def __init__(self, options: RecorderOptions, *, index: int, open_store: OpenStore, assistant_model: Any,
                 attention_mask: Any = None, layer_tap: _layers.LayerTap | None = None,
                 samples: Samples | None = None, threaded: bool = False, on_cpu: bool = False,
                 vocab_size: int | None = None,
                 model_dtype: torch.dtype = torch.float32,
                 encoding_generators: dict[torch.device, torch.Generator] | None = None,
                 adapters: dict[str, Any] | None = None) -> None:
        """`options`: the recorder's; `index`: the generation's in its recording; `open_store`: opens its
        store; `threaded`: drain the ring in a thread of its own (a CUDA model); `on_cpu`: a CPU model;
        `encoding_generators`: the recorder's generators of the `"sample:N@T"` draws, per device;
        `adapters`: a PEFT model's adapters in use (`capture.peft.adapters`), for the header."""
        self._options = options
        self._adapters = adapters
        self._encoding = {"model_dtype": model_dtype, "seed": options.encoding_seed,
                          "generators": {} if encoding_generators is None else encoding_generators}
        # Scores "sparse" where a warper masks them (no encoding named), where measured no slower than
        # dense (bench/encodings_cost.py): on CPU.
        self._sparse_scores = options.sparse_scores and on_cpu
        self._vocab_size = vocab_size  # the model config's, when known
        self._assistant_model = assistant_model
        self._attention_mask = attention_mask  # until `start`: the header's prompt lengths
        self._threaded = threaded
        self._open_store = open_store
        self.layer_tap = layer_tap  # attentions and hidden states, when the recorder records them
        self.index = index
        # What the header takes from the call's set-up: `samples`, its `sample_ids` and `sample_metadata`
        # (Recorder.set_samples), kept as given; `loop`, which loop of its call this is (`loops`, for a
        # model whose generate() runs several). Both set by `loops` through `set_samples` and `set_loop`.
        self.samples = samples
        self.loop: dict[str, Any] | None = None
        # Prompt logprobs: the first forward's final hidden states, kept until the first step's processors.
        self.prompt = None if options.prompt_scoring is None else PromptCapture(options.prompt_scoring)
        # From `start`:
        self.facts: CallFacts | None = None
        self.steps: Steps | None = None  # the mode's step handling, until the loop ends
        self.header: GenerationHeader | None = None
        self.store: CallStore | None = None
        self.ring: HostRing | None = None
        self.layers: LayerCapture | None = None  # the recording of attentions and hidden states
        self._encoders: dict[str, Any] = {}  # per stream encoded (`facts.encodings`)
        self.started = False
        self.wants_forward = True  # whether `on_forward` has anything to do in this call
        self.nested_calls = 0  # generate() calls made inside this loop (an inner decoder's), not recorded
        self.mismatch: str | None = None  # what `finish` found to disagree with the call, if anything
        self._in_lists = 0  # > 0 while the processor or criteria list runs
        self._late_error: BaseException | None = None

    # -- what `loops` tells a capture about its call ---------------------------------------------------
    def set_samples(self, samples: Samples | None) -> None:
        """The sample ids (and metadata) of the rows this loop decodes (None: numbered), before `start`."""
        self.samples = samples

    def set_loop(self, loop: dict[str, Any]) -> None:
        """Which loop of its call this is (the manifest's `loop` entry), before `start` and again, with
        its kept rows, before `finish`."""
        self.loop = loop

    def loop_returned(self) -> None:
        """transformers' loop returned: no later forward belongs to it."""
        self.wants_forward = False

    def count_nested_call(self) -> None:
        """A generate() call made inside this loop (an inner decoder's): not recorded, counted in the manifest."""
        self.nested_calls += 1

    def take_encoder_output(self, previous: Capture) -> None:
        """This loop's encoder ran before it started, while `previous` (the call's last loop) was active."""
        if previous.layer_tap is not None and self.layer_tap is not None:
            self.layer_tap.take_encoder_output(previous.layer_tap)

    # -- set-up, from the processor-list hook, before the decoding loop ------------------------------
    def start(self, generation_config: Any, prompt_length: int, *, no_processors: bool = False) -> None:
        """Set up the call's recording, before its decoding loop: `no_processors` when the processor
        list generate() built holds nothing (besides the recorder)."""
        facts = call_facts(generation_config, prompt_length, self._options, assistant_model=self._assistant_model,
                           no_processors=no_processors, sparse_scores=self._sparse_scores, vocab_size=self._vocab_size)
        self.facts = facts
        self.steps = steps_for(facts)
        self.wants_forward = facts.keeps_forward_logits or facts.is_assisted or self.layer_tap is not None
        self._encoders = encoders(facts.encodings, **self._encoding)
        mask, self._attention_mask = self._attention_mask, None
        if self.prompt is not None:
            rows_per_prompt = facts.num_beams if facts.is_beam else int(generation_config.num_return_sequences or 1)
            self.prompt.start(generation_config, mask, list(facts.eos_token_id), rows_per_prompt)
        self.header = self._header(generation_config, mask)
        max_length = getattr(generation_config, "max_length", None)
        max_steps = max(1, max_length - facts.prompt_length) if isinstance(max_length, int) else 2**31
        self.store = self._open_store(self.names, self.header, max_steps)
        # Beam search adds a step's token and parent one step later, while its slot is still held.
        slots = max(self._options.ring_slots, 2) if facts.is_beam else self._options.ring_slots
        self.ring = HostRing(slots, self.store.drain, threaded=self._threaded, keep=self.store.keep)
        if self.layer_tap is not None:
            self.layers = LayerCapture(self.layer_tap, put=self.ring.put, add_streams=self.store.add_streams,
                                       in_lists=lambda: self._in_lists > 0)
            self.layers.start()
        self.started = True

    def _header(self, generation_config: Any, mask: torch.Tensor | None) -> GenerationHeader:
        """The generation's header as known when its loop starts (`finish` adds the rest)."""
        facts = self.facts
        return GenerationHeader(
            index=self.index,
            mode=facts.mode,
            prompt_length=facts.prompt_length,
            num_beams=facts.num_beams,
            eos_token_id=facts.eos_token_id,
            generation_config={
                key: jsonable(value)
                for key, value in generation_config.to_diff_dict().items()
                if not key.startswith("_")
            },
            prompt_lengths=None if mask is None else tuple(int(n) for n in mask.sum(-1).tolist()),
            pad_token_id=facts.pad_token_id,
            encodings={**facts.encodings, **({"scores": SAME_AS_LOGITS} if facts.scores_as_logits else {})},
            sample_ids=None if self.samples is None else self.samples.ids,
            sample_metadata=None if self.samples is None else self.samples.metadata,
            loop=self.loop,
            adapters=self._adapters,
            # `layers` is set at the first forward, when attentions or hidden states are recorded.
        )

    @property
    def names(self) -> list[str]:
        """Every stream this call records, in the order they are stored."""
        facts = self.facts
        names = [*(["logits"] if "logits" in facts.streams else []), *(["scores"] if facts.stores_scores else []),
                 "tokens", "finished"]
        names += ["beam_parents"] * facts.is_beam + [STATS_STREAM] * facts.with_stats
        return names + ([] if self.layers is None else self.layers.names)

    @property
    def failure(self) -> BaseException | None:
        """What failed while the call's recording was closed (a shard that could not be written...):
        raised once the manifest says how the call ended."""
        if self.store is not None and self.store.failure is not None:
            return self.store.failure
        return self._late_error

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

    def _put(self, puts: list[Put]) -> None:
        """Put what a step handed back into the ring, in order; `logits` and `scores` encoded on their
        device first where the Recorder's `encodings` say so."""
        for step, name, tensor in puts:
            self.ring.put(step, name, tensor, encoder=self._encoders.get(name))

    def on_forward(self, output: Any) -> None:
        """Record the selected attentions and hidden states of this step's forward, and hand the steps
        its next-token logits (beam search and DoLa take them from there; assisted decoding notes that
        the recorded model, not the assistant, ran). Forwards made by a processor or criterion are ignored."""
        if self._in_lists or self.steps is None:
            return
        self.steps.on_forward(getattr(output, "logits", None))  # generate() always asks for a ModelOutput
        if self.layers is not None:
            self.layers.on_forward(output)

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

    def on_encoder(self, output: Any) -> None:
        """An encoder-decoder model's encoder ran (before the decoding loop): its outputs are recorded
        at the first step, when the ring exists."""
        if self.layer_tap is not None:
            self.layer_tap.on_encoder(output)

    def on_raw(self, input_ids: torch.Tensor, scores: torch.Tensor, group: int | None = None) -> None:
        """Called with what the first processor receives, before it runs (once per beam group, with
        that group's rows only, in group beam search)."""
        if self.steps is None:
            return  # the loop finished
        if self.prompt is not None and not self.prompt.scored and self.steps.recorded_model_ran:
            # At the first step's processors (not at prompt lookup's probes, before the model's first forward):
            # the prompt logprobs, step 0 streams recorded once per call.
            found = self.prompt.score(input_ids, self.facts.prompt_length, self.facts.mode)
            self.store.add_once(list(found))
            self._put([(0, name, tensor) for name, tensor in found.items()])
        self._put(self.steps.on_raw(input_ids, scores, group))

    def on_processed(self, input_ids: torch.Tensor, scores: torch.Tensor, group: int | None = None) -> None:
        """Called with what the last processor or warper returned."""
        if self.steps is not None:  # None once the loop finished
            self._put(self.steps.on_processed(input_ids, scores, group))

    def on_stopping(self, input_ids: torch.Tensor, is_done: Any) -> None:
        """Called after the step's token was appended, with the stopping criteria's verdict (None when
        a criterion raised: the token is recorded all the same, the call ends)."""
        if self.steps is not None:  # None once the loop finished
            self._put(self.steps.on_stopping(input_ids, is_done))

    # -- the end ---------------------------------------------------------------------------------------
    def finish(self, output: Any, error: BaseException | None) -> StoredGeneration:
        """Close the call's recording: the last steps put, the ring flushed, what was recorded checked
        against `output` (what the loop returned; None when `error` ended it), the store closed with the
        generation's header. Returns what the store hands back."""
        self.close_taps()
        steps, self.steps = self.steps, None  # no tap records from here on
        count = steps.step + 1
        self._put(steps.at_end(count))
        if error is None and _compat.SKIPS_STOPPING_ONCE_ALL_FINISHED:
            self._put(steps.at_loop_end(output))
        try:
            self.ring.flush()
        except Exception as late:  # noqa: BLE001 - kept, and raised once the recording is closed
            self._late_error = late
            error = error if error is not None else late
        if error is None and _interrupts.pending():
            error = KeyboardInterrupt()  # Ctrl-C held while the call ended: it is raised next
        sequences = _compat.output_sequences(output) if error is None else None
        verdict = steps.verdict(_complete_steps(self.store, self.names, count), sequences)
        steps.clear()
        if verdict.problem is not None and error is None:
            self.mismatch = verdict.problem
            error = RecordingMismatch(verdict.problem)
            sequences = None  # an incomplete generation has none
        if sequences is not None:
            sequences = sequences.detach().to("cpu", copy=True)
        layers = None if self.layers is None else self.layers.selection
        self.layers = None  # it refers back to this capture (`in_lists`): dropped, so that it is freed by its count
        header = replace(self.header, num_rows=steps.num_rows, layers=layers, loop=self.loop, nested_calls=self.nested_calls)
        return self.store.finish(verdict.num_steps, header, sequences, error, ring_waits=self.ring.waits)


def _complete_steps(store: CallStore, names: list[str], steps: int) -> int:
    """Number of leading steps for which every stream has a record (an interrupted step is dropped)."""
    for t in range(steps):
        if not all(store.has(name, t) for name in names):
            return t
    return steps
