"""Named quantizations on load, for a candidate model scored or rescored against its base: a short name
(`--quantization torchao:int8-weight-only`) turned into the `quantization_config` that transformers' own
integration takes (`AutoModelForCausalLM.from_pretrained(..., quantization_config=...)`).

A checkpoint saved quantized (GPTQ, AWQ, compressed-tensors, FP8...) needs none of this: its directory
is the `--model`, and transformers reads its quantization from its config.
"""

from __future__ import annotations

from typing import Any, Callable

from .. import _compat

# name -> (the package it needs, the pip extra that installs it, where it runs, the config's builder)
_NAMES: dict[str, tuple[str, str, str, Callable[[], Any]]] = {}


def _torchao(config_name: str) -> Callable[[], Any]:
    def build() -> Any:
        from torchao import quantization
        from transformers import TorchAoConfig

        return TorchAoConfig(quant_type=getattr(quantization, config_name)())
    return build


def _bitsandbytes(bits: int) -> Callable[[], Any]:
    def build() -> Any:
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(**{f"load_in_{bits}bit": True})
    return build


_NAMES.update({
    "torchao:int8-weight-only": ("torchao", "quantization", "CPU and CUDA", _torchao("Int8WeightOnlyConfig")),
    "torchao:int8-dynamic": ("torchao", "quantization", "CPU and CUDA",
                             _torchao("Int8DynamicActivationInt8WeightConfig")),
    "bitsandbytes:8bit": ("bitsandbytes", "quantization-cuda", "CUDA", _bitsandbytes(8)),
    "bitsandbytes:4bit": ("bitsandbytes", "quantization-cuda", "CUDA", _bitsandbytes(4)),
})
NAMES = tuple(_NAMES)


def quantization_config(name: str) -> Any:
    """The `quantization_config` for quantization `name` (one of `NAMES`): torchao's int8 weight-only and
    int8 dynamic-activation (CPU and CUDA, through `TorchAoConfig`), bitsandbytes' 8-bit and 4-bit (CUDA,
    through `BitsAndBytesConfig`).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
        ImportError: the package the quantization needs is not installed, or this transformers has no
            integration for it; the message names the extra that installs it.
    """
    if name not in _NAMES:
        raise ValueError(f"unknown quantization {name!r}; known: {', '.join(NAMES)}. A checkpoint saved quantized "
                         "needs none: pass its directory as the model.")
    package, extra, where, build = _NAMES[name]
    import importlib.util

    if importlib.util.find_spec(package) is None:
        raise ImportError(f"quantization {name!r} needs the {package!r} package (it runs on {where}): "
                          f"pip install 'transformers-offload[{extra}]'")
    if package == "torchao" and not _compat.TORCHAO_CONFIG_OBJECTS:
        raise ImportError(f"quantization {name!r} is built for transformers 5 (TorchAoConfig taking torchao's config "
                          f"objects); this is {_compat.TRANSFORMERS_VERSION}: pip install -U transformers")
    try:
        return build()
    except ImportError as error:
        raise ImportError(f"quantization {name!r}: this transformers or {package} lacks what it needs ({error}); "
                          f"upgrade them: pip install -U transformers 'transformers-offload[{extra}]'") from None


__all__ = ["NAMES", "quantization_config"]
