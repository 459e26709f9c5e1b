"""PEFT models (`peft.PeftModel`, LoRA and the other tuners): `PeftModelForCausalLM.generate()` hands the call to
the transformers model it wraps, so the recorder hooks that model and reads the adapters in use at each call.
Duck-typed: nothing here imports peft."""

from __future__ import annotations

from typing import Any

from transformers import GenerationMixin


def unwrap(model: Any) -> tuple[Any, Any | None]:
    """(the transformers model whose `generate()` the call reaches, the PEFT model around it or None).

    A PEFT model is not a `GenerationMixin`; its `get_base_model()` gives the transformers model inside
    (the LoRA layers in place, merged or not), whose `generate()` its own `generate()` calls."""
    get_base_model = getattr(model, "get_base_model", None)
    if isinstance(model, GenerationMixin) or not callable(get_base_model) or not hasattr(model, "peft_config"):
        return model, None
    return get_base_model(), model


def adapters(peft_model: Any | None) -> dict[str, Any] | None:
    """The adapters in use for a call of `peft_model` (None without one), as the generation's header keeps
    them: `active` (the active adapters' names), `merged` (those merged into the base weights) and
    `disabled` (inside `peft_model.disable_adapter()`: the base model alone computed the call); and, for a
    mixed batch (`peft_model.generate(..., adapter_names=[...])`), `per_row`: each row's adapter (`__base__`:
    none), read from the hooks peft puts on its layers for the call (repeated per beam in beam search), which
    then computed the rows instead of the active adapters."""
    if peft_model is None:
        return None
    active = getattr(peft_model, "active_adapters", None)
    if active is None:
        active = getattr(peft_model, "active_adapter", ())
    active = [active] if isinstance(active, str) else list(active)
    tuner_layers = [module for module in peft_model.modules() if hasattr(module, "merged_adapters")]
    merged = sorted({name for layer in tuner_layers for name in layer.merged_adapters})
    disabled = any(bool(getattr(layer, "disable_adapters", False)) for layer in tuner_layers)
    found = {"active": [str(name) for name in active], "merged": merged, "disabled": disabled}
    per_row = _per_row(tuner_layers[-1:])  # the last layer: the decoder's (an encoder's hooks give its own rows)
    if per_row is not None:
        found["per_row"] = per_row
    return found


def _per_row(layers: list[Any]) -> list[str] | None:
    """The `adapter_names` a mixed-batch call of peft hands each of these layers' forwards (peft binds them to
    a forward pre-hook, `functools.partial(..., adapter_names=...)`), or None outside such a call."""
    for layer in layers:
        for hook in getattr(layer, "_forward_pre_hooks", {}).values():
            keywords = getattr(hook, "keywords", None)
            if isinstance(keywords, dict) and keywords.get("adapter_names") is not None:
                return [str(name) for name in keywords["adapter_names"]]
    return None
