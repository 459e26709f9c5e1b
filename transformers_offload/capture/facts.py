"""What one recorded `generate()` call is, fixed when its decoding loop starts: `CallFacts`, made once from
the call's generation config and the Recorder's options, then read by the capture (what it stores, the
generation's header) and by its mode's steps (`steps`), never changed."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import torch

from .. import _compat
from ..codecs.spec import NATIVE, SPARSE
from ..codecs.stats import STATS_STREAM
from ..store.header import jsonable
from ..store.layout import BEAM_MODES
from .modes import check_mode, sampling_masks
from .options import RecorderOptions


@dataclass(frozen=True)
class CallFacts:
    """The call's decoding mode, rows and streams, as its loop runs them.

    Attributes:
        mode (`str`): transformers' `GenerationMode` value (`"greedy_search"`, `"beam_search"`...).
        streams (`tuple[str, ...]`): the Recorder's streams.
        do_sample (`bool`): the generation config's.
        prompt_length (`int`): the prompt's length in tokens (the padded batch's).
        num_beams (`int`): beams per prompt (1 outside beam search).
        num_beam_groups (`int`): beam groups (1 outside group beam search).
        eos_token_id (`tuple[int, ...]`): the config's EOS ids, in order (empty without one).
        pad_token_id: the config's, as JSON holds it (an `int` or None).
        encodings (`Mapping[str, str]`): the encoding of `logits` and `scores` where not dense (`codecs.spec`),
            `"sparse"` scores where a sampling warper masks them on CPU included.
        scores_as_logits (`bool`): greedy search or sampling with no processor: the processed scores are
            the raw logits, the very tensor, and are stored once, as them.
        keeps_forward_logits (`bool`): the raw logits come from the model's forward (beam search, DoLa),
            or group beam search sizes its scores from them.
        kept_on_device (`tuple[str, ...]`): the call's own `output_*` options that keep steps on the device.
    """

    mode: str
    streams: tuple[str, ...]
    do_sample: bool
    prompt_length: int
    num_beams: int
    num_beam_groups: int
    eos_token_id: tuple[int, ...]
    pad_token_id: Any
    encodings: Mapping[str, str]
    scores_as_logits: bool
    keeps_forward_logits: bool
    kept_on_device: tuple[str, ...]

    @property
    def is_beam(self) -> bool:
        return self.mode in BEAM_MODES

    @property
    def is_assisted(self) -> bool:
        return self.mode == _compat.ASSISTED_MODE

    @property
    def is_group(self) -> bool:
        return self.mode == _compat.GROUP_BEAM_MODE

    @property
    def with_stats(self) -> bool:
        """Per-token statistics recorded (`"stats"` in the streams)."""
        return STATS_STREAM in self.streams

    @property
    def records_raw(self) -> bool:
        """Whether a step's raw logits are recorded (`logits`) or needed (per-token statistics)."""
        return "logits" in self.streams or self.with_stats

    @property
    def stores_scores(self) -> bool:
        """Whether the processed scores are a stream of their own (not stored as the logits)."""
        return "scores" in self.streams and not self.scores_as_logits


def call_facts(generation_config: Any, prompt_length: int, options: RecorderOptions, *, assistant_model: Any,
               no_processors: bool, sparse_scores: bool, vocab_size: int | None) -> CallFacts:
    """The facts of a call about to run its loop with `generation_config`.

    Args:
        prompt_length (`int`): the prompt's length, in tokens.
        options (`RecorderOptions`): the Recorder's.
        assistant_model: the call's, or None.
        no_processors (`bool`): the processor list generate() built holds nothing (besides the recorder).
        sparse_scores (`bool`): store the scores `"sparse"` where a sampling warper masks them and no
            encoding was named (on CPU, where measured no slower than dense: bench/encodings_cost.py).
        vocab_size (`int`, *optional*): the model config's.

    Raises:
        UnsupportedModeError: the call's decoding mode cannot be recorded (`modes.check_mode`).
    """
    streams = tuple(options.streams)
    mode = check_mode(generation_config, assistant_model, streams)
    do_sample = bool(generation_config.do_sample)
    is_beam = mode in BEAM_MODES
    is_group = mode == _compat.GROUP_BEAM_MODE
    eos = generation_config.eos_token_id
    eos_ids = () if eos is None else tuple(int(e) for e in torch.as_tensor(eos).flatten().tolist())
    encodings = dict(options.encodings)
    if sparse_scores and "scores" in streams and sampling_masks(generation_config, vocab_size):
        # Sampling through top-k, top-p...: a few finite scores per row, stored as those (lossless).
        encodings["scores"] = SPARSE
    # Greedy search or sampling with no processor (nor, 4.36-4.44, a warper list, not built yet): the
    # processed scores are the raw logits, the very tensor. `scores_once` False: `encodings={"scores":
    # "dense"}` asked for them stored anyway.
    scores_as_logits = (
        options.scores_once and no_processors and mode in ("greedy_search", "sample")
        and not _compat.final_tap_on_warper_list(mode, do_sample)
        and "logits" in streams and "scores" in streams and "scores" not in encodings
        and encodings.get("logits") in (None, NATIVE, SPARSE)  # the logits whole
    )
    # Raw logits come from the forward where the processors get something else (beam search gets
    # log-probs, DoLa a contrast of layers); group beam search also sizes its scores from them.
    from_forward = is_beam or mode == _compat.DOLA_MODE
    return CallFacts(
        mode=mode,
        streams=streams,
        do_sample=do_sample,
        prompt_length=int(prompt_length),
        num_beams=int(generation_config.num_beams or 1) if is_beam else 1,
        num_beam_groups=int(generation_config.num_beam_groups or 1) if is_group else 1,
        eos_token_id=eos_ids,
        pad_token_id=jsonable(generation_config.pad_token_id),
        encodings=MappingProxyType(encodings),
        scores_as_logits=scores_as_logits,
        keeps_forward_logits=is_group or (from_forward and ("logits" in streams or STATS_STREAM in streams)),
        kept_on_device=tuple(_compat.outputs_kept_on_device(generation_config)),
    )
