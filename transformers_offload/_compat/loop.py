"""What depends on the installed transformers release in its generation loop: the list builders the hooks
wrap, the decoding modes and where each runs, how the stopping criteria answer, and which list the
processed scores come out of."""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers import GenerationMixin

# Where the list classes live, re-exported so that no other module imports transformers' internals.
from transformers.generation import LogitsProcessorList, StoppingCriteriaList  # noqa: F401

TRANSFORMERS_VERSION = transformers.__version__

# The private `GenerationMixin` methods the recorder wraps, per model instance, while it is attached.
# `_get_logits_processor` and `_get_stopping_criteria` exist in every release from 4.36 on.
# `_get_logits_warper` is a separate warper list in 4.36-4.44 (gone from 4.45, when the warpers joined
# the processor list).
HAS_SEPARATE_WARPER_LIST = hasattr(GenerationMixin, "_get_logits_warper")
# Continuous batching's entry point that takes (and, through `**kwargs`, silently drops) a
# `logits_processor` (4.53+ among the tested releases, `ContinuousMixin`): wrapped only to refuse a Recorder passed to it.
CONTINUOUS_BATCHING_ENTRIES = tuple(name for name in ("generate_batch",) if hasattr(GenerationMixin, name))
# The methods Whisper's `generate()` calls on the instance around each run of transformers' decoding
# loop (once per 30-second segment and per fallback temperature; `capture.loops`): where a segment
# starts, what the loop returned, and whether a prompt is rerun at the next temperature. A release
# without all three has no taps: its Whisper loops are each recorded, and marked when unverifiable.
LOOP_TAPS = ("generate_with_fallback", "_postprocess_outputs", "_need_fallback")


def loop_taps(model: Any) -> tuple[str, ...]:
    """The `LOOP_TAPS` `model`'s class has (all of them, or none)."""
    return LOOP_TAPS if all(callable(getattr(type(model), name, None)) for name in LOOP_TAPS) else ()


def generation_delegates(model: Any) -> list[Any]:
    """The submodules whose own `generate()` `model`'s `generate()` calls instead of running the loop
    itself (BLIP-2's and InstructBLIP's `language_model`, BLIP's `text_decoder`, Kosmos-2's
    `text_model`): the children that generate, of a class that overrides `generate()`. Empty for a
    model that runs transformers' loop itself (its children do not generate)."""
    if getattr(type(model), "generate", None) is GenerationMixin.generate:
        return []
    return [child for child in model.children()
            if isinstance(child, GenerationMixin) and callable(getattr(child, "can_generate", None)) and child.can_generate()]


# The GenerationMixin methods that run each mode's decoding loop, under their names across releases
# (4.36-4.38 `greedy_search`/`sample`, 4.39-4.4x `_greedy_search`/`_sample`, 4.45+ `_sample` for both...).
_LOOP_METHODS = {"greedy_search": ("_sample", "_greedy_search", "greedy_search"), "sample": ("_sample", "sample"),
                 "beam_search": ("_beam_search", "beam_search"), "beam_sample": ("_beam_search", "_beam_sample", "beam_sample"),
                 "assisted_generation": ("_assisted_decoding", "assisted_decoding")}


def own_decoding_loop(model: Any, mode: str) -> str | None:
    """The name of the method by which `model`'s class replaces the GenerationMixin loop that runs `mode`
    (CSM's `_sample`), or None where it runs transformers' own."""
    for name in _LOOP_METHODS.get(mode, ()):
        ours = getattr(GenerationMixin, name, None)
        theirs = getattr(type(model), name, None)
        if ours is not None and theirs is not None and theirs is not ours:
            return name
    return None


LIST_BUILDERS = ("_get_logits_processor", "_get_stopping_criteria") + (
    ("_get_logits_warper",) if HAS_SEPARATE_WARPER_LIST else ()
)

# Generation modes this release of the recorder records exactly. Other modes are refused before the
# decoding loop starts (see `capture.modes.check_mode`).
# Contrastive search and DoLa run inside the library up to 4.56; 4.57 moved them to the Hub
# (`custom_generate`), whose decoding loop the recorder cannot see.
CONTRASTIVE_IN_LIBRARY = hasattr(GenerationMixin, "_contrastive_search") or hasattr(GenerationMixin, "contrastive_search")
DOLA_IN_LIBRARY = hasattr(GenerationMixin, "_dola_decoding")  # 4.43-4.56
GROUP_BEAM_IN_LIBRARY = hasattr(GenerationMixin, "_group_beam_search") or hasattr(GenerationMixin, "group_beam_search")
_VERSION = Version(TRANSFORMERS_VERSION)
# Before 4.30 (4.28.1 seen; 4.30.2 calls both) greedy search, sampling and contrastive search end with
# `if unfinished_sequences.max() == 0 or stopping_criteria(...)`: at the step where every row finished, the
# criteria (and the recorder's tap in them) are not called.
SKIPS_STOPPING_ONCE_ALL_FINISHED = _VERSION < Version("4.30.0")
# Before 4.35 beam sampling samples from the warpers run on the processed scores plus the running beam
# scores, and returns in `out.scores` the warpers run again on the processed scores alone (a second call,
# made only with `output_scores`); before 4.36 assisted decoding's recorded scores differed from
# `out.scores` by up to 4.8e-7 (4.34.1, a tiny Llama): neither is recorded there.
BEAM_SAMPLE_RECORDED = _VERSION >= Version("4.35.0")
ASSISTED_RECORDED = _VERSION >= Version("4.36.0")
SUPPORTED_MODES = (
    ("greedy_search", "sample", "beam_search")
    + (("beam_sample",) if BEAM_SAMPLE_RECORDED else ())
    + (("assisted_generation",) if ASSISTED_RECORDED else ())
    + (("contrastive_search",) if CONTRASTIVE_IN_LIBRARY else ())
    + (("dola_generation",) if DOLA_IN_LIBRARY else ())
    + (("group_beam_search",) if GROUP_BEAM_IN_LIBRARY else ())
)
DOLA_MODE = "dola_generation"
GROUP_BEAM_MODE = "group_beam_search"
# Why a mode is not recorded, for the error message.
_FROM_THE_HUB = "this release runs it from the Hub (`custom_generate`), whose decoding loop the recorder cannot see"
UNSUPPORTED_BECAUSE = {
    "contrastive_search": _FROM_THE_HUB, "dola_generation": _FROM_THE_HUB, "group_beam_search": _FROM_THE_HUB,
    "beam_sample": "before 4.35 it samples from the warpers run on the scores plus each beam's running score, "
    "and returns in `out.scores` the warpers run again without them, a call the loop does not make while recording",
    "assisted_generation": "before 4.36 its recorded scores are not bit-equal to `out.scores`",
    "constrained_beam_search": "its `out.scores` add each beam's running score to the processed scores, "
    "which the recorder cannot see",
}
# `generate(custom_generate=...)` (4.52+) runs a decoding loop from the Hub: refused by the recorder.
ACCEPTS_CUSTOM_GENERATE = "custom_generate" in inspect.signature(GenerationMixin.generate).parameters
# Assisted decoding (an assistant model) and prompt lookup share this mode on every release.
ASSISTED_MODE = "assisted_generation"


def generation_mode(generation_config: Any, assistant_model: Any) -> str:
    """The decoding mode `generate()` will run, as the string value of transformers' `GenerationMode`.

    `GenerationConfig.get_generation_mode` exists from 4.39; older releases decide the mode inside
    `generate()` from the same fields, which this mirrors.
    """
    if hasattr(generation_config, "get_generation_mode"):  # transformers 4.39+
        return str(generation_config.get_generation_mode(assistant_model).value)
    return _legacy_generation_mode(generation_config, assistant_model)


def _legacy_generation_mode(config: Any, assistant_model: Any) -> str:
    # transformers 4.36-4.38: the same decision, written out in `generate()` itself.
    if getattr(config, "constraints", None) is not None or getattr(config, "force_words_ids", None) is not None:
        return "constrained_beam_search"
    num_beams = config.num_beams or 1
    if num_beams == 1:
        if config.do_sample is not True:
            if (config.top_k or 0) > 1 and (config.penalty_alpha or 0) > 0:
                mode = "contrastive_search"
            else:
                mode = "greedy_search"
        else:
            mode = "sample"
    elif (config.num_beam_groups or 1) > 1:
        mode = "group_beam_search"
    elif config.do_sample is True:
        mode = "beam_sample"
    else:
        mode = "beam_search"
    if assistant_model is not None or getattr(config, "prompt_lookup_num_tokens", None) is not None:
        if mode in ("greedy_search", "sample"):
            mode = "assisted_generation"
    return mode


def provisional_generation_config(model: Any, generation_config: Any, kwargs: dict) -> Any:
    """The generation config a `generate()` call will run with, as far as the decoding mode goes.

    Built from public API only (a copy of the call's or the model's `GenerationConfig`, updated with
    the call's keyword arguments), so that an unsupported mode is refused before `generate()` does
    any work; the recorder checks again on the final config inside `generate()`.
    """
    base = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    # Up to 4.32 a composite model (BLIP-2) has none of its own: its generate() hands the call on.
    config = copy.deepcopy(base) if base is not None else transformers.GenerationConfig()
    config.update(**{k: v for k, v in kwargs.items() if hasattr(config, k)})
    return config


# `low_memory=True` beam search runs each step's forward in sub-batches (4.38-4.49; the recorder joins
# their logits); from 4.50 transformers refuses it itself, after building the processor list.
REFUSES_LOW_MEMORY_BEAM_SEARCH = Version(TRANSFORMERS_VERSION) >= Version("4.50.0")


def refuses_low_memory_beam_search(generation_config: Any) -> bool:
    """Whether transformers will refuse this beam search for `low_memory=True` (4.50+)."""
    return REFUSES_LOW_MEMORY_BEAM_SEARCH and bool(getattr(generation_config, "low_memory", False))


def rows_done(is_done: Any, token: torch.Tensor, eos_ids: torch.Tensor | None) -> torch.Tensor:
    """Which rows the end of this step finishes, as a `(rows,)` bool tensor on `token`'s device.

    From 4.39 the `StoppingCriteriaList` returns a bool tensor `[rows]` that already includes
    end-of-sequence (`EosTokenCriteria`), so nothing is added per step. Up to 4.38 it returns one
    Python bool for the whole batch and EOS is handled outside the list: it is checked here against
    the chosen `token`s.
    """
    if isinstance(is_done, torch.Tensor):
        return is_done.to(dtype=torch.bool)
    done = torch.full(token.shape, bool(is_done), dtype=torch.bool, device=token.device)
    if eos_ids is not None:
        done |= torch.isin(token, eos_ids)
    return done


def outputs_kept_on_device(generation_config: Any) -> list[str]:
    """The `output_*` options with which `generate()` will also keep per-step tensors on the device
    until it returns (with `return_dict_in_generate`; `output_logits` exists from 4.38)."""
    if not generation_config.return_dict_in_generate:
        return []
    flags = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
    return [flag for flag in flags if getattr(generation_config, flag, False)]


# Up to 4.38 a stopping criterion answers for the whole batch with one bool and the list stops at the
# first that says done; from 4.39 (which added `EosTokenCriteria`) each answers per row.
CRITERIA_ANSWER_PER_ROW = hasattr(transformers.generation, "EosTokenCriteria")

def final_tap_on_warper_list(mode: str, do_sample: bool) -> bool:
    """Whether the processed scores come out of a separate warper list rather than the processor list.

    4.36-4.44 keep the sampling warpers in a list of their own, applied after the processors when
    sampling (also in assisted decoding); from 4.45 they are appended to the processor list (before
    `LogitNormalization`).
    """
    return HAS_SEPARATE_WARPER_LIST and (mode == "sample" or (mode == ASSISTED_MODE and bool(do_sample)))
