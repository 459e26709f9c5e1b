"""One finished continuous batching request, checked against the result transformers handed out and
written as a generation of one row.

`continuous` gathers each request's steps on the host (`RequestSteps`); this module checks them against
the request's `GenerationOutput` (its `generated_tokens`, and its `logprobs` where the manager returns
them) and writes them through the recorder's store, in the Recorder's encodings.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from ..codecs.encoders import encoders
from ..codecs.spec import NATIVE, SAME_AS_LOGITS, SPARSE
from ..codecs.stats import STATS_STREAM
from ..store.header import GenerationHeader, jsonable
from .loop_check import RecordingMismatch
from .modes import sampling_masks

MODE = "continuous_batching"  # the generations' `mode`


@dataclass
class RequestSteps:
    """One request's recorded steps, on the host: per step its raw logits and processed scores
    `(vocab,)` float32 (`scores` is None where no processor ran: they are the raw logits), its token,
    and with `"stats"` recorded its `(9,)` statistics record (`capture.stats`)."""

    logits: list[torch.Tensor] = field(default_factory=list)
    scores: list[torch.Tensor | None] = field(default_factory=list)
    tokens: list[torch.Tensor] = field(default_factory=list)
    stats: list[torch.Tensor] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)  # what `add_request` set for it (`request_settings`)


def request_settings(state: Any) -> dict[str, Any]:
    """What a request (transformers' `RequestState`) runs with over its manager's generation config, as
    `add_request` resolved it: `max_new_tokens`, `eos_token_id`, and its processors' keyword arguments."""
    settings = {name: getattr(state, name) for name in ("max_new_tokens", "eos_token_id") if hasattr(state, name)}
    return {**settings, **dict(getattr(state, "logit_processor_kwargs", None) or {})}


@dataclass(frozen=True)
class RequestWriting:
    """What the recorder writes each request with: its `RecorderOptions`, the model's dtype (for the
    `"native"` encoding), its generators of the `"sample:N@T"` draws and its store (`open_store`)."""

    options: Any
    model_dtype: torch.dtype
    generators: dict
    open_store: Callable[..., Any]


def check(result: Any, steps: RequestSteps) -> str | None:
    """What disagrees between a request's recorded steps and its result (None: nothing): its recorded
    tokens against `generated_tokens`; where the manager returned `logprobs`, each against the runner's
    expression over the recorded processed scores `s` and token `y`, `torch.softmax(s, -1)[y].log()`
    (float32, compared bit for bit)."""
    generated = [int(token) for token in result.generated_tokens]
    recorded = [int(token) for token in steps.tokens[: len(generated)]]
    if recorded != generated:
        first = next((t for t, (a, b) in enumerate(zip(recorded, generated)) if a != b),
                     min(len(recorded), len(generated)))
        return (f"request {result.request_id!r} returned {len(generated)} generated token(s) and {len(steps.tokens)} "
                f"were recorded; they differ first at step {first}")
    logprobs = getattr(result, "logprobs", None) or []
    for t, returned in enumerate(logprobs[: len(generated)]):
        scores = steps.logits[t] if steps.scores[t] is None else steps.scores[t]
        mine = torch.softmax(scores[None], dim=-1)[0, generated[t]].log()
        if not torch.equal(mine, torch.tensor(returned, dtype=mine.dtype)):
            return (f"request {result.request_id!r} returned the logprob {returned!r} at step {t}, and the recorded "
                    f"processed scores give {mine.item()!r}")
    return None


def _encodings(options: Any, generation_config: Any, processed: bool, vocab: int) -> dict[str, str]:
    """The streams stored other than dense, as a `generate()` call of `generation_config` stores them on
    the CPU: the Recorder's `encodings`; scores sampled through a masking warper `"sparse"` unless named;
    scores stored once, as the logits, where no processor ran."""
    encodings = dict(options.encodings)
    streams = options.streams
    if processed and options.sparse_scores and "scores" in streams and sampling_masks(generation_config, vocab):
        encodings["scores"] = SPARSE
    once = (not processed and options.scores_once and "logits" in streams and "scores" in streams
            and "scores" not in encodings and encodings.get("logits") in (None, NATIVE, SPARSE))
    if once:
        encodings["scores"] = SAME_AS_LOGITS
    return encodings


def store(result: Any, steps: RequestSteps, generation_config: Any, *, index: int,
          writing: RequestWriting) -> tuple[Any, str | None]:
    """Write one finished request as a generation of one row (its `sample_ids` its request id), checked
    against `result`; returns the store's `StoredGeneration` and what disagreed, if anything (the
    generation is then incomplete)."""
    options = writing.options
    mismatch = check(result, steps)
    error: BaseException | None = None
    if getattr(result, "error", None):
        error = RuntimeError(f"the continuous batching manager failed this request: {result.error}")
    elif mismatch is not None:
        error = RecordingMismatch(mismatch)
    num_steps = len(result.generated_tokens) if mismatch is None else min(len(steps.tokens), len(result.generated_tokens))
    processed = any(kept is not None for kept in steps.scores)
    vocab = int(steps.logits[0].shape[-1]) if steps.logits else 0
    encodings = _encodings(options, generation_config, processed, vocab)
    once = encodings.get("scores") == SAME_AS_LOGITS
    names = [name for name in ("logits", "scores") if name in options.streams and not (name == "scores" and once)]
    names += ["tokens", "finished"] + [STATS_STREAM] * (STATS_STREAM in options.streams)
    config = {key: jsonable(value) for key, value in generation_config.to_diff_dict().items()
              if not key.startswith("_") and key != "num_return_sequences"}  # a request is one row
    config.update({key: jsonable(value) for key, value in steps.settings.items()})  # its own, from add_request
    eos = config.get("eos_token_id")
    header = GenerationHeader(
        index=index, mode=MODE, prompt_length=len(result.prompt_ids), num_beams=1,
        eos_token_id=tuple(e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int) and e >= 0),  # -1: none
        generation_config=config,
        prompt_lengths=(len(result.prompt_ids),), pad_token_id=jsonable(getattr(generation_config, "pad_token_id", None)),
        encodings={name: encodings[name] for name in ("logits", "scores") if name in encodings and name in options.streams},
        sample_ids=(result.request_id,), sample_metadata=None, loop=None,
    )
    coders = encoders({name: encodings[name] for name in names if encodings.get(name, SAME_AS_LOGITS) != SAME_AS_LOGITS},
                      model_dtype=writing.model_dtype, generators=writing.generators, seed=options.encoding_seed)
    stored = writing.open_store(names, header, max(num_steps, 1))
    not_finished = torch.zeros(1, dtype=torch.bool)
    for t in range(num_steps):
        tensors = {"tokens": steps.tokens[t].reshape(1).long(), "finished": not_finished}
        full = {"logits": steps.logits[t], "scores": steps.logits[t] if steps.scores[t] is None else steps.scores[t]}
        for name in ("logits", "scores"):
            if name in names:
                coder = coders.get(name)
                tensors[name] = full[name][None] if coder is None else coder.on_cpu(full[name][None])
        if STATS_STREAM in names:
            tensors[STATS_STREAM] = steps.stats[t][None]
        stored.drain(t, tensors)
    sequences = None
    if error is None:
        sequences = torch.tensor([[*result.prompt_ids, *result.generated_tokens]], dtype=torch.long)
    generation = stored.finish(num_steps, replace(header, num_rows=1), sequences, error, ring_waits=0)
    return generation, mismatch
