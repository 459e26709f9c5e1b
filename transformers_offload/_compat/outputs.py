"""What depends on the installed transformers release in what a model's forward and `generate()` return: the
raw logits' dtype, the sequences, the KV cache's name, the attention implementations, and where a model
declares the modules that compute each output."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
import transformers
from packaging.version import Version

_RELEASE = Version(transformers.__version__)

def text_config(config: Any) -> Any:
    """The config of the model's text decoder: `get_text_config()` (4.46+) for composite models, else
    the config itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_implementations(model: Any) -> set[str]:
    """The attention implementations `model`'s configs name (`config._attn_implementation`, private but
    present on every release from 4.36; sdpa models fall back to eager for attention weights up to
    4.57 with a warning, and return none from 5.0)."""
    config = getattr(model, "config", None)
    configs = [config, text_config(config)]  # composite models keep their decoder's config apart
    found = {getattr(c, "_attn_implementation", None) for c in configs if c is not None}
    return {str(name) for name in found if name is not None}


def encoder_of(model: Any) -> Any:
    """The encoder module an encoder-decoder model's `generate()` runs once, or None."""
    config = getattr(model, "config", None)
    if not getattr(config, "is_encoder_decoder", False) or not hasattr(model, "get_encoder"):
        return None
    encoder = model.get_encoder()
    return encoder if isinstance(encoder, torch.nn.Module) and encoder is not model else None


# From 4.40 `out.logits` is exactly what the first processor received; in 4.38-4.39 it shares storage
# with the tensor in-place processors modify (and 4.36 has no `output_logits`). The recorder does not
# depend on it; the tests use it to pick their reference.
HF_RAW_LOGITS_EXACT = _RELEASE >= Version("4.40.0")

# From 4.45 the decoding loops copy the next-token logits to float32 before any processor runs, and
# `out.logits` holds that copy; up to 4.44 they keep the model's dtype. Nothing in the API tells the
# two apart, so this one is a version number (as accelerate's `utils/versions.py` does).
UPCASTS_LOGITS = _RELEASE >= Version("4.45.0")
def forward_raw_logits(model_logits: torch.Tensor, *, upcast: bool = UPCASTS_LOGITS) -> torch.Tensor:
    """Raw next-token logits from a forward output, as beam search and DoLa keep them (`out.logits`):
    `logits[:, -1, :]`, copied, in float32 from 4.45 and in the model's dtype before. Group beam
    search keeps the model's dtype on every release (`upcast=False`)."""
    dtype = torch.float32 if upcast else model_logits.dtype
    return model_logits[:, -1, :].to(dtype=dtype, copy=True)


def output_sequences(output: Any) -> torch.Tensor | None:
    """The sequences `generate()` returned: the tensor itself, or `out.sequences` of a ModelOutput."""
    if output is None:
        return None
    if isinstance(output, torch.Tensor):
        return output
    sequences = getattr(output, "sequences", None)
    return sequences if isinstance(sequences, torch.Tensor) else None


# -- where a model computes each output, as transformers itself declares it -----------------------------
# Model classes declare which module computes each output they can return (`_can_record_outputs`):
# Llama from 4.57 (collected by `check_model_inputs`, which patches those modules' forward during a
# call asking for them), GPT-2, T5, BART and most others by 5.24 (`capture_outputs`, with forward
# hooks). An entry is a module class, a class-name suffix, an `OutputRecorder(target_class, index,
# layer_name, class_name[, capture_initial_hidden_state])` or a list of those. Hidden states: the
# first matched module's first positional input (the embeddings), then each matched module's output,
# the last replaced by the model's `last_hidden_state` (unless `config.tie_last_hidden_states` is
# False, 5.x); other outputs: each matched module's output at `index` (1 by default).
@dataclasses.dataclass(frozen=True)
class CapturePoint:
    """One output's capture point in a model's forward, as its class declares it."""

    target_class: Any  # a module class, or None
    class_name: str | None  # a suffix of the module's dotted name, or None
    layer_name: str | None  # a part of the module's dotted name that must match, or None
    index: int  # which element of a tuple output
    capture_initial: bool  # hidden states: the first module's input is entry 0


def capture_points(module: Any) -> dict[str, CapturePoint]:
    """The capture point of each output `module` (a model's base model) declares with one entry; {}
    where its release or class declares none (then the recorder asks the forward for its outputs)."""
    declared = getattr(type(module), "_can_record_outputs", None)
    if not isinstance(declared, dict):
        return {}
    points = {}
    for key, spec in declared.items():
        if isinstance(spec, (list, tuple)):
            continue  # several module types under one key: their order is not the modules' order
        default_index = 0 if "hidden_states" in key else 1
        if isinstance(spec, str):
            points[key] = CapturePoint(None, spec, None, default_index, True)
        elif isinstance(spec, type):
            points[key] = CapturePoint(spec, None, None, default_index, True)
        elif hasattr(spec, "target_class") and hasattr(spec, "index"):
            points[key] = CapturePoint(
                spec.target_class, getattr(spec, "class_name", None), getattr(spec, "layer_name", None),
                int(spec.index), bool(getattr(spec, "capture_initial_hidden_state", True)),
            )
    return points


def matches(point: CapturePoint, dotted_name: str, module: Any) -> bool:
    """Whether `module`, at `dotted_name` (".layers.0.self_attn") inside the declaring model, is one
    that `point` names (5.24's `recursively_install_hooks`; 4.57-5.0 match the same modules)."""
    found = (point.target_class is not None and isinstance(module, point.target_class)) or (
        point.class_name is not None and dotted_name.endswith(point.class_name)
    )
    if found and point.layer_name is not None:
        found = "." + point.layer_name.strip(".") + "." in dotted_name + "."
    return found


def ties_last_hidden_state(config: Any) -> bool:
    """Whether the last hidden state is the model's `last_hidden_state` (every language model; a 5.x
    config may say otherwise)."""
    tie = getattr(config, "tie_last_hidden_states", None)
    return True if tie is None else bool(tie)


def cache_argument(model: Any) -> str:
    """The name a model's forward takes its KV cache by: `cache` from 5.24 (`past_key_values` is
    deprecated there), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def logits_to_keep_argument(model: Any) -> str | None:
    """The name a model's forward takes "compute the logits of the last N positions only" by:
    `logits_to_keep` from 4.50, `num_logits_to_keep` in 4.45-4.49 (the models that had it then); None where
    the forward has neither (older releases, models without it): it computes every position's logits."""
    parameters = inspect.signature(type(model).forward).parameters
    return next((name for name in ("logits_to_keep", "num_logits_to_keep") if name in parameters), None)


def cache_of(output: Any) -> Any:
    """The KV cache a forward returned (`output.cache` from 5.24, `output.past_key_values` before). Where the
    output has a `cache` field, `past_key_values` is not read even when the cache is None: from 5.24 it is a
    deprecated alias that logs a warning."""
    if "cache" in getattr(output, "__dataclass_fields__", ()):
        return output.cache
    return getattr(output, "past_key_values", None)


def _chunked_padded_forward() -> bool:
    # 4.36's SDPA mask expansion (`_unmask_unattended(expanded_mask, attention_mask, unmasked_value)`) indexes
    # out of range for a forward of several new positions over a cache when a row is left-padded; 4.37 rewrote it.
    try:
        from transformers.modeling_attn_mask_utils import AttentionMaskConverter
    except ImportError:  # before 4.36: Llama's rotary table holds only as many positions as keys so far, so a
        return False     # left-padded row's position 1 is out of range in a first chunk of one position
    unmask = getattr(AttentionMaskConverter, "_unmask_unattended", None)
    return unmask is None or "unmasked_value" not in inspect.signature(unmask).parameters


CHUNKED_PADDED_FORWARD = _chunked_padded_forward()  # False up to 4.36 (with SDPA attention on 4.36)
