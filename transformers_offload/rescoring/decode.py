"""`transformers_offload.rescore`: replay a recording's tokens through another model (dtype, quantization,
attention kernel, transformers release) and record that model's logits on them, teacher-forced. (The
module is named apart from the function: importing a submodule `rescore` would hide the package's lazily
loaded function of that name.)

`mode="decode"` replays each generation with a stock `generate()` call of the original's decoding mode,
batch and padding, adding a processor that forces the recorded choice at every step: in greedy search
and sampling the recorded token of each row; in beam search the recorded `(parent, token)` of each
running beam, in the recorded order (scores chosen so that the beams' accumulated scores rank them
so). The model therefore runs the same forwards, on the same inputs and KV cache, as the original call:
the same model, dtype and device give logits bit for bit equal to the recording's. `mode="forward"`
scores each generation's prompt and tokens with chunked forward passes instead (`rescoring.forward`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from transformers import GenerationConfig, LogitsProcessor

from ..errors import RescoreError
from ..read.generation import Generation
from ..read.reader import open_recording
from ..recorder import Recorder

MODES = ("decode", "forward")
STREAMS = ("logits", "stats", "attentions", "hidden_states")
# Settings of the original call that shape its forwards (not its processors), carried into the replay.
_FORWARD_SETTINGS = ("use_cache", "cache_implementation", "cache_config", "pad_token_id", "bos_token_id",
                     "decoder_start_token_id")
# Decoding modes replayed, by the mode the replay runs: beam sampling's forwards are beam search's.
_REPLAY_MODES = {"greedy_search": "greedy_search", "sample": "sample", "beam_search": "beam_search",
                 "beam_sample": "beam_search", "assisted_generation": "greedy_search"}


def rescore(
    recording: Any,
    model: Any,
    out: str | os.PathLike | None = None,
    *,
    mode: str = "decode",
    streams: Sequence[str] = ("logits",),
    encodings: dict[str, str] | None = None,
    generations: Iterable[int] | None = None,
    inputs: Sequence[dict[str, Any] | None] | Callable[[Generation], dict[str, Any] | None] | None = None,
    append: bool = False,
    chunk_size: int = 512,
    progress: bool = False,
) -> Any:
    """Replay a recording's tokens through `model` (teacher forcing) and record its logits on them.

    The result has the recording's generations (or those in `generations`), in order, each with the same
    rows, steps, tokens, finished masks and sample ids (and, in beam search, beam parents), and `model`'s
    raw logits (what `out.logits` would hold) at every step: in beam search the running beams' logits,
    as recorded. Compare the two with `transformers_offload.compare(recording, rescored)`.

    `mode="decode"` replays each generation as `generate()` ran it: a stock `generate()` of the same
    decoding mode (beam sampling and assisted decoding run as beam search and greedy search, whose
    forwards are the same), the same batch, padding and number of steps, with a processor that forces
    the recorded choice: the same model, dtype and device give logits `torch.equal` to the recording's.
    Assisted decoding's original forwards (several candidate positions at once) are not replayed: its
    rescored logits come from one-token forwards and differ from the original's by float rounding
    (docs/rescore.md states the measured difference). `mode="forward"` scores the prompt and all
    tokens with chunked forward passes (`chunk_size` positions each, with the KV cache): fewer, larger
    forwards, whose logits differ from decode's by float rounding (docs/rescore.md); beam search and
    encoder-decoder generations are not scored this way (ValueError).

    Prompts come from each generation's `sequences` (the first `prompt_length` ids of each prompt's
    rows) with its attention mask rebuilt from `prompt_lengths` as left padding, as generate() takes a
    batch of decoder-only prompts. Anything else the original call was given (an encoder's inputs,
    pixel values, input features, a right-padded or other attention mask) must come in `inputs`.
    Prompt logprobs are rescored too where the recording has them.

    Args:
        recording: what to rescore: a `Recording` or `RankedRecording` (`open_recording(path)`), a
            `Recorder`, a `Generation`, or a recording directory's path.
        model (`transformers.GenerationMixin`): the model to score with (any dtype, device, attention
            implementation, quantization); its tokenizer must be the recording's (same vocabulary size).
        out (`str | os.PathLike`, *optional*): a new or empty directory to write the rescored recording
            to; default: in host memory.
        mode (`str`, *optional*, defaults to `"decode"`): `"decode"` or `"forward"` (above).
        streams (`Sequence[str]`, *optional*, defaults to `("logits",)`): what to record of the replay,
            from `"logits"`, `"stats"` (whose processed-score columns describe the forced choice, not a
            distribution), `"attentions"`, `"hidden_states"` (decode mode only). Processed scores are not
            rescored: they depend on the original call's processors, not on the model alone.
        encodings (`dict[str, str]`, *optional*): how to store the logits, as `Recorder(encodings=...)`
            (`{"logits": "topk:20"}`...); default: as the Recorder does.
        generations (`Iterable[int]`, *optional*): indices into the recording's `generations` to rescore,
            in order; default: all. An incomplete generation (no returned sequences) cannot be replayed:
            leave it out.
        inputs (`Sequence[dict] | Callable`, *optional*): per rescored generation (a list in the order
            rescored, or a function of the `Generation`), the keyword arguments of the original
            `generate()` call that carried its prompts (`input_ids`, `attention_mask`, `input_features`,
            `pixel_values`...), or None to rebuild them from the recording. Needed for encoder-decoder
            and multimodal models, and for prompts not left-padded.
        append (`bool`, *optional*, defaults to False): with `out` holding a recording of the same model,
            add the rescored generations after those there (how the command line resumes).
        chunk_size (`int`, *optional*, defaults to 512): forward mode: positions per forward.
        progress (`bool`, *optional*, defaults to False): show a progress bar (tqdm) over generations.

    Returns:
        `Recording` (read back from `out`) or, in memory, the closed `Recorder` that holds the rescored
        generations (both have `generations`, `logits()`, `tokens()`...).

    Raises:
        ValueError: a bad option; a generation that cannot be replayed (incomplete, a mode not replayed,
            a Whisper loop, an encoder-decoder or multimodal generation without `inputs`); a model whose
            vocabulary differs from the recording's.
        RescoreError: a replay did not follow the recorded tokens (it stopped at another step, or the
            model's `generate()` changed the batch): nothing of that generation is returned as rescored.
        FileExistsError: `out` exists and is not an empty directory (nor, with `append`, a recording).

    Example:
        >>> from transformers_offload import open_recording, rescore, compare  # doctest: +SKIP
        >>> rescored = rescore(open_recording("run"), model.to(torch.bfloat16), "run-bf16")  # doctest: +SKIP
        >>> print(compare("run", rescored))  # the summary, as text  # doctest: +SKIP
    """
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}.")
    if isinstance(streams, str) or not all(isinstance(s, str) for s in streams):
        raise TypeError(f"`streams` must be a sequence of names from {STREAMS}, got {streams!r}.")
    unknown = [s for s in streams if s not in STREAMS]
    if unknown:
        hint = " Processed scores depend on the original call's processors: they are not rescored." \
            if "scores" in unknown else ""
        raise ValueError(f"`streams` holds {unknown}; rescore records {STREAMS}.{hint}")
    if mode == "forward" and set(streams) - {"logits"}:
        raise ValueError(f"`mode='forward'` records logits only; got `streams={tuple(streams)!r}`. Use mode='decode'.")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"`chunk_size` must be a positive int (positions), got {chunk_size!r}.")
    source = _generations_of(recording)
    picked = list(range(len(source))) if generations is None else [int(i) for i in generations]
    for i in picked:
        if not -len(source) <= i < len(source):
            raise ValueError(f"`generations` holds {i}, but the recording has {len(source)} generation(s).")
    chosen = [source[i] for i in picked]
    if inputs is not None and not callable(inputs) and len(inputs) != len(chosen):
        raise ValueError(f"`inputs` holds {len(inputs)} entries for {len(chosen)} generation(s) to rescore; give "
                         "one per rescored generation (None to rebuild it from the recording), or a function.")
    vocab = _vocab_size(model)
    calls = []
    for n, gen in enumerate(chosen):
        extra = inputs(gen) if callable(inputs) else (None if inputs is None else inputs[n])
        calls.append((gen, _call_inputs(gen, model, extra, mode)))  # every refusal before any work
    for gen in chosen:
        if gen.num_steps and "logits" in gen.streams and vocab is not None:
            width = _recorded_vocab(gen)
            if width is not None and width != vocab:
                raise ValueError(f"generation {gen.index} was recorded with a vocabulary of {width}, but `model` "
                                 f"scores {vocab}: rescore with a model that shares the recording's tokenizer.")
    prompt_logprobs = max((_prompt_top(gen) for gen in chosen), default=False) if mode == "decode" else False
    rec = Recorder(model, streams=tuple(streams), spill_dir=out, encodings=encodings, append=append,
                   prompt_logprobs=prompt_logprobs)
    try:
        bar = _progress(len(calls), progress)
        for gen, call in calls:
            if mode == "decode":
                _replay(gen, model, rec, call)
            else:
                from . import forward as rescore_forward
                rescore_forward.score(gen, model, rec, call, chunk_size)
            _check_follows(gen, rec.generation())
            bar.update(1)
        bar.close()
    finally:
        rec.close()
    return rec if out is None else open_recording(out)


# -- the replay ------------------------------------------------------------------------------------------
class ForceTokens(LogitsProcessor):
    """Greedy search and sampling: the scores of step `t` become 0 at each row's recorded token and -inf
    elsewhere, so `generate()` appends the recorded token whatever it decides by (argmax, a warper,
    multinomial sampling). One `(rows, vocab_size)` buffer is allocated at the first step and reused.

    Args:
        tokens (`torch.LongTensor` of shape `(steps, rows)`): the recorded tokens, on the model's device.
        prompt_length (`int`): the prompt's length in tokens (step `t` sees `prompt_length + t` ids).
    """

    def __init__(self, tokens: torch.Tensor, prompt_length: int) -> None:
        self._tokens = tokens
        self._prompt_length = prompt_length
        self._buffer: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = input_ids.shape[-1] - self._prompt_length
        if self._buffer is None or self._buffer.shape != scores.shape or self._buffer.dtype != scores.dtype:
            self._buffer = torch.empty_like(scores)
        out = self._buffer.fill_(-math.inf)
        return out.scatter_(1, self._tokens[min(step, self._tokens.shape[0] - 1)].unsqueeze(1), 0.0)


class ForceBeams(LogitsProcessor):
    """Beam search: at step `t` the only finite scores are the recorded `(parent, token)` pairs, each
    valued so that its accumulated beam score is about `-GAP x j` for the `j`-th running beam of its
    prompt: beam search then keeps exactly the recorded beams, in the recorded order, and reorders the
    KV cache by the recorded parents. It tracks the running beams' accumulated scores as beam search
    computes them (the float32 sum of what the processors return and the parent's score; at the start
    0 for each prompt's first beam and -1e9 for the others, whose rounding GAP leaves far behind). After the last recorded
    choice (the last step's
    tokens are not recorded: they left the running beams) each beam continues itself.

    Args:
        tokens (`torch.LongTensor` of shape `(steps, rows)`), parents (same shape): the recorded tokens
            and beam parents (rows index the step's running beams, all prompts), on the model's device.
        num_beams (`int`), prompt_length (`int`).
    """

    GAP = 1024.0  # between the accumulated scores of consecutive beams: beyond float32 rounding at 1e9

    def __init__(self, tokens: torch.Tensor, parents: torch.Tensor, num_beams: int, prompt_length: int) -> None:
        rows = tokens.shape[1]
        self._tokens = tokens
        self._parents = parents
        self._prompt_length = prompt_length
        rank = torch.arange(rows, device=tokens.device).remainder(num_beams)
        self._target = rank.to(torch.float32) * -self.GAP
        # The running beams' accumulated scores, as beam search starts them: only each prompt's first beam counts.
        self._running = torch.where(rank == 0, 0.0, -1e9).to(torch.float32)
        self._identity = torch.arange(rows, device=tokens.device)
        self._buffer: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = input_ids.shape[-1] - self._prompt_length
        if self._buffer is None or self._buffer.shape != scores.shape or self._buffer.dtype != scores.dtype:
            self._buffer = torch.empty_like(scores)
            self._running = self._running.to(scores.dtype)
            self._target = self._target.to(scores.dtype)
        recorded = step < self._tokens.shape[0] - 1
        parents = self._parents[step] if recorded else self._identity
        tokens = self._tokens[step] if recorded else self._tokens.new_zeros(self._identity.shape)
        out = self._buffer.fill_(-math.inf)
        # Parent p's candidate token v gets target - running[p]: beam search adds running[p] back.
        running = self._running.index_select(0, parents)
        values = self._target - running
        out.index_put_((parents, tokens), values)
        self._running = values + running  # what beam search computes as the new beams' scores
        return out


def _replay(gen: Generation, model: Any, rec: Recorder, call: dict[str, Any]) -> None:
    device = _device_of(model)
    tokens = torch.stack(gen.tokens()).to(device) if gen.num_steps else torch.zeros(0, gen.num_rows, dtype=torch.long)
    replay_mode = _REPLAY_MODES[gen.mode]
    config = _replay_config(gen, replay_mode)
    if replay_mode == "beam_search":
        parents = _distinct_parents(torch.stack(gen.tokens()), torch.stack(gen.beam_parents()), gen.num_beams).to(device)
        force: LogitsProcessor = ForceBeams(tokens, parents, gen.num_beams, gen.prompt_length)
    else:
        force = ForceTokens(tokens, gen.prompt_length)
    if gen.sample_ids is not None:
        rec.set_samples(list(gen.sample_ids), metadata=None if gen.sample_metadata is None else list(gen.sample_metadata))
    call = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in call.items()}
    with torch.no_grad():
        model.generate(**call, generation_config=config, logits_processor=[rec, force])


def _distinct_parents(tokens: torch.Tensor, parents: torch.Tensor, num_beams: int) -> torch.Tensor:
    """The recorded parents `(steps, rows)`, with each `(parent, token)` pair made distinct within a step.

    The recorder names as a row's parent the first running beam that held the same hypothesis; beam
    sampling can extend two beams holding the same hypothesis by the same token, which that names as one
    pair twice, and beam search keeps one candidate per pair. A repeated pair is moved to another beam
    of the step that holds the very same hypothesis (the same tokens: the same forward inputs and cache).
    """
    steps, rows = tokens.shape
    parents = parents.clone()
    history = [row // num_beams for row in range(rows)]  # per running row, an id of the hypothesis it holds
    ids: dict[tuple[int, int], int] = {}
    for step in range(steps - 1):
        holders: dict[int, list[int]] = {}
        for row, h in enumerate(history):
            holders.setdefault(h, []).append(row)
        taken: set[tuple[int, int]] = set()
        step_tokens, step_parents = tokens[step].tolist(), parents[step].tolist()
        for row, (token, parent) in enumerate(zip(step_tokens, step_parents)):
            if (parent, token) in taken:
                parent = next((p for p in holders[history[parent]] if (p, token) not in taken), parent)
                parents[step, row] = parent
            taken.add((parent, token))
        history = [ids.setdefault((history[p], t), len(ids) + rows) for p, t in zip(parents[step].tolist(), step_tokens)]
    return parents


def _replay_config(gen: Generation, replay_mode: str) -> GenerationConfig:
    original = gen.generation_config
    settings = {key: original[key] for key in _FORWARD_SETTINGS if original.get(key) is not None}
    beam = replay_mode == "beam_search"
    eos = list(gen.eos_token_id) if gen.eos_token_id and not beam else None
    if gen.pad_token_id is not None:
        settings["pad_token_id"] = gen.pad_token_id
    if beam:  # every running beam kept to the last step (no EOS), as recorded
        settings.update(num_beams=gen.num_beams, early_stopping=False, length_penalty=1.0)
    # Greedy search and sampling keep the original's EOS ids, so rows finish (their tokens become padding)
    # at the same steps.
    return GenerationConfig(**settings, max_new_tokens=gen.num_steps, do_sample=replay_mode == "sample",
                            num_return_sequences=gen.num_return_sequences, eos_token_id=eos)


def _call_inputs(gen: Generation, model: Any, extra: dict[str, Any] | None, mode: str) -> dict[str, Any]:
    where = f"generation {gen.index}"
    if gen.loop is not None:
        raise ValueError(f"{where} is one loop of a `generate()` that runs its decoding loop several times "
                         "(Whisper's segments and fallback): rescore replays one loop per call and cannot "
                         "rebuild that loop's inputs. Leave it out with `generations=`.")
    if not gen.complete or gen.sequences is None:
        raise ValueError(f"{where} is incomplete ({gen.error or 'no returned sequences'}): its prompts are not "
                         "in the recording, so it cannot be replayed. Leave it out with `generations=`.")
    if gen.mode not in _REPLAY_MODES:
        raise ValueError(f"{where} ran {gen.mode!r}, which rescore does not replay (it replays "
                         f"{sorted(_REPLAY_MODES)}). Leave it out with `generations=`.")
    if mode == "forward" and gen.is_beam:
        raise ValueError(f"{where} is a beam search, whose running beams change rows every step: score it with "
                         "mode='decode'.")
    encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    if mode == "forward" and encoder_decoder:
        raise ValueError(f"`model` is an encoder-decoder model: score {where} with mode='decode'.")
    if extra is not None:
        if not isinstance(extra, dict):
            raise TypeError(f"`inputs` for {where} must be a dict of generate() keyword arguments, got {extra!r}.")
        return dict(extra)
    if encoder_decoder:
        raise ValueError(f"{where}: `model` is an encoder-decoder model, whose encoder inputs are not in the "
                         "recording: pass them in `inputs` (the original call's `input_ids`/`attention_mask`...).")
    prompt_rows = gen.sequences[:: gen.num_return_sequences, : gen.prompt_length]
    call: dict[str, Any] = {"input_ids": prompt_rows}
    if gen.prompt_lengths is not None:
        lengths = torch.tensor(gen.prompt_lengths)
        positions = torch.arange(gen.prompt_length)
        call["attention_mask"] = (positions >= gen.prompt_length - lengths.unsqueeze(1)).to(torch.long)
    return call


def _check_follows(original: Generation, rescored: Generation) -> None:
    where = f"generation {original.index} (rescored as {rescored.index})"
    if not rescored.complete:
        raise RescoreError(f"the replay of {where} did not complete: {rescored.error}")
    if (rescored.num_steps, rescored.num_rows) != (original.num_steps, original.num_rows):
        raise RescoreError(
            f"the replay of {where} ran {rescored.num_steps} step(s) of {rescored.num_rows} row(s), the "
            f"original {original.num_steps} of {original.num_rows}: the model's generate() did not follow the "
            "recording (a stopping criterion or processor of the model's own config?)."
        )
    for step, (a, b) in enumerate(zip(original.tokens(), rescored.tokens())):
        if not torch.equal(a, b):
            raise RescoreError(f"the replay of {where} appended other tokens than recorded at step {step}.")


# -- small helpers ---------------------------------------------------------------------------------------
def _generations_of(recording: Any) -> list[Generation]:
    if isinstance(recording, Generation):
        return [recording]
    if isinstance(recording, (str, os.PathLike)):
        recording = open_recording(Path(recording))
    generations = getattr(recording, "generations", None)
    if generations is None:
        raise TypeError(f"`recording` must be a Recording, Recorder, Generation or a recording's path, got "
                        f"{type(recording).__name__}.")
    return list(generations)


def _prompt_top(gen: Generation) -> bool | int:
    if "prompt_logprobs" not in gen.once_streams:
        return False
    if "prompt_top_tokens" in gen.once_streams:
        return int(gen.prompt_tensors()["prompt_top_tokens"].shape[-1])
    return True


def _recorded_vocab(gen: Generation) -> int | None:
    if gen.encodings.get("logits", "dense") != "dense":
        return None
    return int(gen.logits(steps=range(1))[0].shape[-1])


def _vocab_size(model: Any) -> int | None:
    config = getattr(model, "config", None)
    getter = getattr(config, "get_text_config", None)
    text = getter() if callable(getter) else config
    size = getattr(text, "vocab_size", None)
    output = getattr(model, "get_output_embeddings", lambda: None)()
    weight = getattr(output, "weight", None)
    return int(weight.shape[0]) if weight is not None else (int(size) if size else None)


def _device_of(model: Any) -> torch.device:
    return next(model.parameters()).device


def _progress(total: int, show: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="generation", desc="rescore", disable=not show)
