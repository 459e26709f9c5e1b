"""Tiny random models of many families, built from their configs (no network), with inputs to generate from.

The stand-in corpus (`standin_generation.py`) calls `generate()` on each in the modes Hugging Face's
`GenerationTesterMixin` exercises, when the release's own tests are not available.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import transformers

VOCAB = 96
PAD, EOS, BOS = 0, 1, 2
IMAGE = VOCAB - 1  # the image placeholder token of the vision-language models
SIZES = {
    # width
    "hidden_size": 32, "d_model": 32, "n_embd": 32, "embed_dim": 32, "dim": 32, "word_embed_proj_dim": 32,
    # depth
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "encoder_layers": 2,
    "decoder_layers": 2, "num_decoder_layers": 2,
    # heads
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "d_kv": 8,
    # feed-forward
    "intermediate_size": 64, "ffn_dim": 64, "d_ff": 64, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
    "n_inner": 64, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    # lengths
    "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128, "max_source_positions": 64,
    "max_target_positions": 64, "sliding_window": 64,
}
TOKENS = {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD, "decoder_start_token_id": BOS,
          "forced_eos_token_id": None, "forced_bos_token_id": None}


def shrink(config: Any, *, vocab: bool = True) -> Any:
    """`config` with the sizes above wherever it has such an attribute (sub-configs included)."""
    for name, value in SIZES.items():
        if hasattr(config, name) and isinstance(getattr(config, name), int) and not isinstance(getattr(config, name), bool):
            if not isinstance(getattr(type(config), name, None), property):  # derived (Falcon's head_dim)
                setattr(config, name, value)
    if vocab and hasattr(config, "vocab_size"):
        config.vocab_size = VOCAB
        for name, value in TOKENS.items():
            if hasattr(config, name) or value is not None:
                setattr(config, name, value)
    for name in ("text_config", "decoder", "vision_config", "encoder"):
        sub = getattr(config, name, None)
        if isinstance(sub, transformers.PretrainedConfig):
            shrink(sub, vocab=vocab and name in ("text_config", "decoder"))
    return config


@dataclass(frozen=True)
class Family:
    """One model family: its `model_type`, its kind, and how to build it and its inputs."""

    name: str
    kind: str  # "decoder-only", "encoder-decoder", "vision-language", "speech"
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[int], dict[str, torch.Tensor]]  # batch -> generate() inputs


def _text_inputs(batch: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch)
    input_ids = torch.randint(3, VOCAB - 1, (batch, 6), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    if batch > 1:  # left padding on the second prompt
        input_ids[1, :2] = PAD
        attention_mask[1, :2] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def _sharpen(model: torch.nn.Module) -> torch.nn.Module:
    """Random weights give near-uniform logits: sharpen them so greedy and beam choices are not ties."""
    model = model.eval()
    head = model.get_output_embeddings()
    if head is not None:
        with torch.no_grad():
            head.weight.mul_(8.0)
    return model


def _auto(config_name: str, model_name: str, **overrides: Any) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        config = shrink(getattr(transformers, config_name)())
        for name, value in overrides.items():
            target = config
            *path, last = name.split("__")
            for part in path:
                target = getattr(target, part)
            setattr(target, last, value)
        torch.manual_seed(0)
        return _sharpen(getattr(transformers, model_name)(config))

    return build


def _decoder(name: str, config_name: str, model_name: str, **overrides: Any) -> Family:
    return Family(name, "decoder-only", _auto(config_name, model_name, **overrides), _text_inputs)


def _seq2seq(name: str, config_name: str, model_name: str, **overrides: Any) -> Family:
    return Family(name, "encoder-decoder", _auto(config_name, model_name, **overrides), _text_inputs)


def _vision_inputs(image_size: int, image_tokens: int) -> Callable[[int], dict[str, torch.Tensor]]:
    def inputs(batch: int) -> dict[str, torch.Tensor]:
        text = _text_inputs(batch)
        ids = torch.cat([torch.full((batch, image_tokens), IMAGE), text["input_ids"]], dim=1)
        mask = torch.cat([torch.ones(batch, image_tokens, dtype=torch.long), text["attention_mask"]], dim=1)
        if batch > 1:  # keep the padding on the left
            ids[1] = torch.cat([text["input_ids"][1, :2], torch.full((image_tokens,), IMAGE), text["input_ids"][1, 2:]])
            mask[1] = torch.cat([torch.zeros(2, dtype=torch.long), torch.ones(image_tokens + 4, dtype=torch.long)])
        pixels = torch.randn(batch, 3, image_size, image_size, generator=torch.Generator().manual_seed(3))
        return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels}

    return inputs


def _speech_inputs(batch: int, frames: int = 3000) -> dict[str, torch.Tensor]:
    return {"input_features": torch.randn(batch, 8, frames, generator=torch.Generator().manual_seed(1))}


WHISPER_NO_TIMESTAMPS = 200


def _whisper() -> torch.nn.Module:
    """As `tests/capture/test_whisper.py` builds it: a released checkpoint's generation config, minus the languages."""
    config = transformers.WhisperConfig(
        vocab_size=300, num_mel_bins=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, d_model=16, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=1500,
        max_target_positions=64, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=3,
    )
    torch.manual_seed(0)
    model = _sharpen(transformers.WhisperForConditionalGeneration(config))
    model.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=3, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=BOS,
        no_timestamps_token_id=WHISPER_NO_TIMESTAMPS, suppress_tokens=[5, 6], begin_suppress_tokens=[EOS, 7],
        max_initial_timestamp_index=5, is_multilingual=False, max_length=40,
    )
    return model


def _speech_to_text() -> torch.nn.Module:
    config = shrink(transformers.Speech2TextConfig())
    config.input_feat_per_channel = 80
    config.max_source_positions = 1500
    config.conv_channels = 32
    torch.manual_seed(0)
    return _sharpen(transformers.Speech2TextForConditionalGeneration(config))


def _speech2text_inputs(batch: int) -> dict[str, torch.Tensor]:
    features = torch.randn(batch, 40, 80, generator=torch.Generator().manual_seed(1))
    return {"input_features": features, "attention_mask": torch.ones(batch, 40, dtype=torch.long)}


def _vision(config: Any) -> None:
    config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.num_attention_heads = 32, 64, 2, 4
    config.image_size, config.patch_size = 16, 8  # 4 patches


def _vlm(name: str, config_name: str, model_name: str, image_tokens: int, **extra_inputs: Any) -> Family:
    def build() -> torch.nn.Module:
        config = getattr(transformers, config_name)()
        shrink(config.text_config)
        _vision(config.vision_config)
        for name_ in ("projection_dim",):
            for target in (config, config.vision_config):
                if hasattr(target, name_):
                    setattr(target, name_, 32)
        if hasattr(config, "qformer_config"):  # BLIP-2, InstructBLIP
            qformer = config.qformer_config
            qformer.hidden_size, qformer.intermediate_size, qformer.encoder_hidden_size = 32, 64, 32
            qformer.num_hidden_layers, qformer.num_attention_heads, qformer.vocab_size = 2, 4, VOCAB
            config.num_query_tokens = image_tokens
        if hasattr(config, "hidden_size"):
            config.hidden_size = 32
        config.image_token_id = IMAGE
        torch.manual_seed(0)
        return _sharpen(getattr(transformers, model_name)(config))

    vision = _vision_inputs(16, image_tokens)

    def inputs(batch: int) -> dict[str, torch.Tensor]:
        values = vision(batch)
        for key, make in extra_inputs.items():
            values[key] = make(batch)
        return values

    return Family(name, "vision-language", build, inputs)


def _qformer_ids(batch: int) -> torch.Tensor:
    return torch.randint(3, VOCAB - 1, (batch, 4), generator=torch.Generator().manual_seed(5))


def _qformer_mask(batch: int) -> torch.Tensor:
    return torch.ones(batch, 4, dtype=torch.long)


FAMILIES: list[Family] = [
    _decoder("gpt2", "GPT2Config", "GPT2LMHeadModel"),
    _decoder("llama", "LlamaConfig", "LlamaForCausalLM"),
    _decoder("mistral", "MistralConfig", "MistralForCausalLM"),
    _decoder("mixtral", "MixtralConfig", "MixtralForCausalLM"),
    _decoder("qwen2", "Qwen2Config", "Qwen2ForCausalLM"),
    _decoder("qwen3", "Qwen3Config", "Qwen3ForCausalLM"),
    _decoder("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    _decoder("gemma", "GemmaConfig", "GemmaForCausalLM"),
    _decoder("gemma2", "Gemma2Config", "Gemma2ForCausalLM"),
    _decoder("phi", "PhiConfig", "PhiForCausalLM"),
    _decoder("phi3", "Phi3Config", "Phi3ForCausalLM"),
    _decoder("opt", "OPTConfig", "OPTForCausalLM"),
    _decoder("bloom", "BloomConfig", "BloomForCausalLM"),
    _decoder("falcon", "FalconConfig", "FalconForCausalLM"),
    _decoder("gpt_neo", "GPTNeoConfig", "GPTNeoForCausalLM", attention_types=[[["global", "local"], 1]]),
    _decoder("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM"),
    _decoder("gptj", "GPTJConfig", "GPTJForCausalLM", rotary_dim=4),
    _decoder("codegen", "CodeGenConfig", "CodeGenForCausalLM", rotary_dim=4),
    _decoder("olmo", "OlmoConfig", "OlmoForCausalLM"),
    _decoder("olmo2", "Olmo2Config", "Olmo2ForCausalLM"),
    _decoder("stablelm", "StableLmConfig", "StableLmForCausalLM"),
    _decoder("starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM"),
    _decoder("granite", "GraniteConfig", "GraniteForCausalLM"),
    _decoder("cohere", "CohereConfig", "CohereForCausalLM"),
    _decoder("biogpt", "BioGptConfig", "BioGptForCausalLM"),
    _decoder("xglm", "XGLMConfig", "XGLMForCausalLM"),
    _seq2seq("t5", "T5Config", "T5ForConditionalGeneration", decoder_start_token_id=PAD),
    _seq2seq("bart", "BartConfig", "BartForConditionalGeneration"),
    _seq2seq("mbart", "MBartConfig", "MBartForConditionalGeneration"),
    _seq2seq("pegasus", "PegasusConfig", "PegasusForConditionalGeneration"),
    _seq2seq("marian", "MarianConfig", "MarianMTModel", decoder_vocab_size=VOCAB),
    _seq2seq("blenderbot", "BlenderbotConfig", "BlenderbotForConditionalGeneration"),
    _vlm("llava", "LlavaConfig", "LlavaForConditionalGeneration", 4),
    _vlm("paligemma", "PaliGemmaConfig", "PaliGemmaForConditionalGeneration", 4),
    _vlm("blip_2", "Blip2Config", "Blip2ForConditionalGeneration", 3),
    _vlm("instructblip", "InstructBlipConfig", "InstructBlipForConditionalGeneration", 3,
         qformer_input_ids=_qformer_ids, qformer_attention_mask=_qformer_mask),
    Family("whisper", "speech", _whisper, _speech_inputs),
    Family("speech_to_text", "speech", _speech_to_text, _speech2text_inputs),
]
