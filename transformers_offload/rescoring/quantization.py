"""Named quantizations on load, for a candidate model scored or rescored against its base: a short name
(`--quantization torchao:int8-weight-only`) turned into the `quantization_config` that transformers' own
integration takes (`AutoModelForCausalLM.from_pretrained(..., quantization_config=...)`).

A checkpoint saved quantized (GPTQ, AWQ, compressed-tensors, FP8...) needs none of this: its directory
is the `--model`, and transformers reads its quantization from its config (compressed-tensors and
auto-round checkpoints load on CPU with the `quantization` extra; tests/rescoring/test_score.py scores
one of each).

Tried on CPU with transformers 5.25 (2 cores): torchao's int8 quantizations and optimum-quanto's int8
and int4 weights run there (quanto's int4 compiles its C++ extension at the first forward of a process
that has none built: about 40 s, once). Not named here: HQQ (`HqqConfig`: transformers 5.25 cannot
quantize on load with it, `NotImplementedError` from its quantizer), SINQ (its package pulls a CUDA
build of torch), MXFP4 (converts GPT-OSS experts only, with kernels fetched from the Hub). GPTQ and AWQ
checkpoints load through gptqmodel, whose package pulls a CUDA build of torch (tested CUDA-marked only).
"""

from __future__ import annotations

from typing import Any, Callable

from .. import _compat

# name -> (the module it needs, the pip extra that installs it, where it runs, the config's builder)
_NAMES: dict[str, tuple[str, str, str, Callable[[], Any]]] = {}
_DISTRIBUTIONS = {"optimum.quanto": "optimum-quanto"}  # a module whose pip name differs


def _torchao(config_name: str) -> Callable[[], Any]:
    def build() -> Any:
        from torchao import quantization
        from transformers import TorchAoConfig

        return TorchAoConfig(quant_type=getattr(quantization, config_name)())
    return build


def _quanto(weights: str) -> Callable[[], Any]:
    def build() -> Any:
        from transformers import QuantoConfig

        return QuantoConfig(weights=weights)
    return build


def _fp8() -> Any:
    from transformers import FineGrainedFP8Config

    return FineGrainedFP8Config()


def _bitsandbytes(bits: int) -> Callable[[], Any]:
    def build() -> Any:
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(**{f"load_in_{bits}bit": True})
    return build


_NAMES.update({
    "torchao:int8-weight-only": ("torchao", "quantization", "CPU and CUDA", _torchao("Int8WeightOnlyConfig")),
    "torchao:int8-dynamic": ("torchao", "quantization", "CPU and CUDA",
                             _torchao("Int8DynamicActivationInt8WeightConfig")),
    "quanto:int8": ("optimum.quanto", "quantization", "CPU and CUDA", _quanto("int8")),
    "quanto:int4": ("optimum.quanto", "quantization", "CPU and CUDA", _quanto("int4")),
    "bitsandbytes:8bit": ("bitsandbytes", "quantization-cuda", "CUDA", _bitsandbytes(8)),
    "bitsandbytes:4bit": ("bitsandbytes", "quantization-cuda", "CUDA", _bitsandbytes(4)),
    "fp8": ("torch", "quantization-cuda", "CUDA (compute capability 8.9 or more) and XPU", _fp8),
})
NAMES = tuple(_NAMES)


def quantization_config(name: str) -> Any:
    """The `quantization_config` for quantization `name` (one of `NAMES`): torchao's int8 weight-only and
    int8 dynamic-activation (CPU and CUDA, through `TorchAoConfig`), optimum-quanto's int8 and int4
    weights (CPU and CUDA, `QuantoConfig`), bitsandbytes' 8-bit and 4-bit (CUDA, `BitsAndBytesConfig`),
    transformers' own fine-grained FP8 (CUDA and XPU, `FineGrainedFP8Config`: weights in float8_e4m3
    blocks of 128 x 128, activations quantized dynamically).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
        ImportError: the package the quantization needs is not installed, or this transformers has no
            integration for it; the message names the extra that installs it.
    """
    if name not in _NAMES:
        raise ValueError(f"unknown quantization {name!r}; known: {', '.join(NAMES)}. A checkpoint saved quantized "
                         "needs none: pass its directory as the model.")
    package, extra, where, build = _NAMES[name]
    if not _installed(package):
        distribution = _DISTRIBUTIONS.get(package, package)
        raise ImportError(f"quantization {name!r} needs the {distribution!r} package (it runs on {where}): "
                          f"pip install 'transformers-offload[{extra}]'")
    if package == "torchao" and not _compat.TORCHAO_CONFIG_OBJECTS:
        raise ImportError(f"quantization {name!r} is built for transformers 5 (TorchAoConfig taking torchao's config "
                          f"objects); this is {_compat.TRANSFORMERS_VERSION}: pip install -U transformers")
    try:
        return build()
    except ImportError as error:
        raise ImportError(f"quantization {name!r}: this transformers or {package} lacks what it needs ({error}); "
                          f"upgrade them: pip install -U transformers 'transformers-offload[{extra}]'") from None


def _installed(package: str) -> bool:
    """Whether `package` (dotted: its parent too) can be imported, without importing it."""
    import importlib.util

    try:
        return importlib.util.find_spec(package) is not None
    except ImportError:  # a dotted name whose parent is missing
        return False


__all__ = ["NAMES", "quantization_config"]
