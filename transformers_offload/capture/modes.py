"""Which decoding modes the recorder records, checked before `generate()`'s decoding loop starts.

What a transformers release runs in its own loop (and so can be recorded) is in `_compat`; this module
says what the recorder makes of it, with an error that names the mode and what to do instead.
"""

from __future__ import annotations

from typing import Any

from .. import _compat
from ..errors import UnsupportedModeError
from ..store import layout as _layout
from . import layers as _layers

# Modes whose every step is one forward of the recorded model over the running rows: attentions and
# hidden states are recorded there.
LAYER_MODES = ("greedy_search", "sample", "beam_search", "beam_sample")


CONTINUOUS_BATCHING_REFUSED = (
    "`generate(..., cache_implementation=\"paged\")` hands the call to continuous batching, which runs its "
    "own processors on packed requests and leaves the call's `logits_processor` unused (transformers {version}). "
    "Record continuous batching with `model.generate_batch(inputs, logits_processor=[rec])` or "
    "`rec.attach(model.init_continuous_batching())`; or record `model.generate(**batch, logits_processor=[rec])` "
    "without the paged cache."
)


def refuse_continuous_batching() -> None:
    """Raise `UnsupportedModeError`: a recorded call asked for continuous batching."""
    raise UnsupportedModeError(CONTINUOUS_BATCHING_REFUSED.format(version=_compat.TRANSFORMERS_VERSION))


def check_mode(generation_config: Any, assistant_model: Any, streams: tuple[str, ...] = ()) -> str:
    """The decoding mode `generation_config` asks for, or `UnsupportedModeError` naming it (`streams`:
    what the recorder records; attentions and hidden states are recorded in `LAYER_MODES` only)."""
    if getattr(generation_config, "cache_implementation", None) == "paged":
        refuse_continuous_batching()
    mode = _compat.generation_mode(generation_config, assistant_model)
    if mode == _compat.ASSISTED_MODE and getattr(generation_config, "assistant_early_exit", None):
        raise UnsupportedModeError(
            f"transformers-offload does not record assisted decoding with `assistant_early_exit` "
            f"(transformers {_compat.TRANSFORMERS_VERSION}): its drafts run the recorded model itself. "
            "Use an `assistant_model` or `prompt_lookup_num_tokens`, or remove the Recorder for this call."
        )
    if mode not in _compat.SUPPORTED_MODES:
        because = _compat.UNSUPPORTED_BECAUSE.get(mode)
        raise UnsupportedModeError(
            f"transformers-offload cannot record {mode!r} exactly with transformers "
            f"{_compat.TRANSFORMERS_VERSION}{': ' + because if because else ''}. It records "
            f"{', '.join(_compat.SUPPORTED_MODES)} there. Remove the Recorder from `logits_processor` "
            "for this call, or use one of those modes."
        )
    if mode in _layout.BEAM_MODES and _compat.refuses_low_memory_beam_search(generation_config):
        raise UnsupportedModeError(
            f"transformers {_compat.TRANSFORMERS_VERSION} does not run `low_memory=True` beam search "
            "(it was removed in 4.50); pass `low_memory=False`."
        )
    layer_streams = [s for s in streams if s in _layers.STREAMS]
    if layer_streams:
        why = None
        if mode not in LAYER_MODES:
            why = f"{mode!r} does not run one forward per step over the running rows"
        elif getattr(generation_config, "low_memory", False) and mode in _layout.BEAM_MODES:
            why = "`low_memory=True` beam search splits each step's forward in sub-batches"
        elif getattr(generation_config, "prefill_chunk_size", None):
            why = "`prefill_chunk_size` splits the prefill in several forwards"
        if why:
            raise UnsupportedModeError(
                f"transformers-offload records {layer_streams} in {', '.join(LAYER_MODES)} only: {why}. "
                f"Use one of those modes, or a Recorder without {layer_streams} in `streams` for this call."
            )
    return mode


def check_own_loop(model: Any, mode: str) -> None:
    """`UnsupportedModeError` where `model`'s class replaces the decoding loop `mode` runs (CSM's `_sample`,
    whose steps replace `input_ids` with codebook frames instead of appending a token): the recorder
    follows transformers' own loop, one token per row and step, and cannot say what such a loop chose."""
    name = _compat.own_decoding_loop(model, mode)
    if name is not None:
        raise UnsupportedModeError(
            f"{type(model).__name__} runs {mode!r} in a decoding loop of its own ({name} overrides "
            f"transformers'), which the Recorder cannot follow step by step: it records transformers' loop, "
            "which appends one token per row and step. Remove the Recorder from `logits_processor` for this "
            "model, or record a model of its that generates with transformers' loop (its inner decoder's "
            "own `generate()`)."
        )


def sampling_masks(generation_config: Any, vocab_size: int | None = None) -> bool:
    """Whether generate() samples through a warper that sets entries of the scores to -inf: top-k
    (below `vocab_size`, when known), top-p, min-p (above 0), typical, epsilon, eta or top-h, under the
    conditions on which transformers (4.36 to 5.x) builds each. Such a call's processed scores hold
    few finite entries per row (about 4 under top_p 0.9, 50 under top_k 50): the Recorder then stores
    them `"sparse"` by default."""
    if not getattr(generation_config, "do_sample", False):
        return False
    top_k, top_p, min_p, typical_p, epsilon, eta, top_h = (  # min_p and top_h: newer releases only
        getattr(generation_config, name, None)
        for name in ("top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h")
    )
    return bool(
        (top_k is not None and top_k != 0 and (not isinstance(vocab_size, int) or top_k < vocab_size))
        or (top_p is not None and top_p < 1.0) or (min_p is not None and min_p > 0.0)
        or (typical_p is not None and typical_p < 1.0) or (epsilon is not None and 0.0 < epsilon < 1.0)
        or (eta is not None and 0.0 < eta < 1.0) or top_h is not None
    )
