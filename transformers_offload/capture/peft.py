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
    `disabled` (inside `peft_model.disable_adapter()`: the base model alone computed the call)."""
    if peft_model is None:
        return None
    active = getattr(peft_model, "active_adapters", None)
    if active is None:
        active = getattr(peft_model, "active_adapter", ())
    active = [active] if isinstance(active, str) else list(active)
    tuner_layers = [module for module in peft_model.modules() if hasattr(module, "merged_adapters")]
    merged = sorted({name for layer in tuner_layers for name in layer.merged_adapters})
    disabled = any(bool(getattr(layer, "disable_adapters", False)) for layer in tuner_layers)
    return {"active": [str(name) for name in active], "merged": merged, "disabled": disabled}
