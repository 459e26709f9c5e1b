"""Shared fixtures: tiny models built from configs (no network), the real model when it is cached."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# hypothesis keeps caches in a directory of its own: not in the checkout.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "transformers-offload-hypothesis"))

from hypothesis import settings  # noqa: E402

# Property-based tests (hypothesis): the same examples on every run, nothing written to the checkout.
# `TRANSFORMERS_OFFLOAD_FUZZ=large` runs ten times as many, from a random seed, on demand.
settings.register_profile("ci", database=None, derandomize=True, deadline=None, print_blob=True)
settings.register_profile("large", database=None, deadline=None, print_blob=True)
FUZZ_SCALE = 10 if os.environ.get("TRANSFORMERS_OFFLOAD_FUZZ") == "large" else 1
settings.load_profile("large" if FUZZ_SCALE > 1 else "ci")

from transformers import (  # noqa: E402
    BartConfig,
    BartForConditionalGeneration,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

VOCAB = 128
PAD = 0
EOS = 1


def _tiny_gpt2() -> torch.nn.Module:
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=128,
        bos_token_id=2, eos_token_id=EOS, pad_token_id=PAD,
    )
    return GPT2LMHeadModel(config)


def _tiny_llama() -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=2, eos_token_id=EOS, pad_token_id=PAD,
    )
    return LlamaForCausalLM(config)


def _tiny_t5() -> torch.nn.Module:
    config = T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        decoder_start_token_id=PAD, pad_token_id=PAD, eos_token_id=EOS,
    )
    return T5ForConditionalGeneration(config)


def _tiny_bart() -> torch.nn.Module:
    config = BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=PAD, eos_token_id=EOS, bos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
    )
    return BartForConditionalGeneration(config)


TINY_MODELS = {"gpt2": _tiny_gpt2, "llama": _tiny_llama}
ENCODER_DECODERS = {"t5": _tiny_t5, "bart": _tiny_bart}


def make_tiny(name: str, seed: int = 0, attn_implementation: str | None = None) -> torch.nn.Module:
    """A tiny model from `TINY_MODELS` or `ENCODER_DECODERS`, seeded; `attn_implementation` as in
    `from_pretrained` (default: the release's own default)."""
    build = {**TINY_MODELS, **ENCODER_DECODERS}[name]
    torch.manual_seed(seed)
    model = build()
    if attn_implementation is not None:
        torch.manual_seed(seed)
        model = type(model)._from_config(model.config, attn_implementation=attn_implementation)
    model = model.eval()
    # Random weights give near-uniform logits; sharpen them so greedy and beam choices are not ties.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


@pytest.fixture(params=sorted(TINY_MODELS))
def tiny_model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return make_tiny(request.param)


@pytest.fixture
def gpt2() -> torch.nn.Module:
    return make_tiny("gpt2")


def left_padded_batch(lengths: tuple[int, ...] = (3, 6, 8), seed: int = 7) -> dict[str, torch.Tensor]:
    """Prompts of different lengths, left-padded with PAD, with their attention mask."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    attention_mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(3, VOCAB, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


@pytest.fixture(scope="session")
def real_model():
    """SmolLM2-135M-Instruct and its tokenizer, from the cache `scripts/setup.sh` fills."""
    from transformers_offload import demo_model

    if not demo_model.is_cached():
        reason = (
            f"the real model is not cached in {demo_model.model_dir()}: run `bash scripts/test.sh` "
            "(or `python -m transformers_offload.demo_model`) once"
        )
        if os.environ.get("TRANSFORMERS_OFFLOAD_REQUIRE_REAL_MODEL") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return demo_model.load()


# Test modules whose subject does not depend on the transformers release: the store, the reader, the
# checksums, the command line's imports, the viewer. They make their recordings with a tiny model, but
# what they check is how the files are written and read, the same under every release. The version
# matrix (scripts/matrix.sh) runs them only on the releases whose entry also pins other packages (numpy,
# safetensors, pyarrow: what they do depend on), which saves about a third of its time.
RELEASE_INDEPENDENT = frozenset({
    "test_check_script",
    "test_checksums",
    "test_cli_start",
    "test_damaged",
    "test_fuzz",
    "test_layout",
    "test_memory_store",
    "test_plots",
    "test_reader",
    "test_transfer",
    "test_viewer",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The slow tests (a minute or two each, some) first, so that the workers of `-n auto` share them
    # and the short ones fill in after; last, one worker ran the long ones while the other sat idle
    # (the whole suite took 757 s on 2 workers for 1,038 s of tests).
    items.sort(key=lambda item: "slow" not in item.keywords)
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__.rpartition(".")[2] in RELEASE_INDEPENDENT:
            item.add_marker(pytest.mark.release_independent)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
