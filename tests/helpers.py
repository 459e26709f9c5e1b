"""What tests share: tiny models and prompts, the cases and runners several test modules use, and the
comparisons (exact, never with a tolerance). Fixtures live in `conftest.py`; test modules import from
here, never from one another."""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import transformers
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LogitsProcessor,
    PreTrainedTokenizerFast,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
    T5Config,
    T5ForConditionalGeneration,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from transformers_offload import (
    Recorder,
    UnsupportedModeError,
    _compat,
    open_recording,
)
from transformers_offload.store.header import GenerationHeader

TESTS = Path(__file__).resolve().parent  # this directory
ROOT = TESTS.parent  # the checkout
GOLDEN = TESTS / "golden"  # the byte-exact recordings
TRANSFORMERS = transformers.__version__  # for messages; release facts live in _compat

# Test modules whose subject does not depend on the transformers release: the store, the reader, the
# checksums, the comparison, the jobs, the command line's imports, the viewer. They make their recordings
# with a tiny model, but what they check is how the files are written, read and answered from, the same
# under every release. The version matrix (scripts/matrix.sh) runs them once per set of other packages an
# entry pins (numpy, safetensors, pyarrow: what they do depend on), not on every release. Every other test
# depends on the release and runs on each. A module listed here consults no release fact (`_compat`, the
# release, the helpers that skip or branch on it): tests/test_ci_environment.py fails when one does.
# tests/conftest.py marks them.
RELEASE_INDEPENDENT = frozenset({
    "test_check_script",
    "test_checksums",
    "test_ci_environment",
    "test_cli_start",
    "test_compare",
    "test_damaged",
    "test_demo_model_names",
    "test_docs",
    "test_file_modes",
    "test_fuzz",
    "test_head",
    "test_kd",
    "test_layout",
    "test_ledger",
    "test_location",
    "test_memory_store",
    "test_packed_encodings",
    "test_ranks",
    "test_reader",
    "test_rollout_scale",
    "test_record",
    "test_viewer",
})

# `output_logits` exists from 4.38, but Hugging Face's own raw logits are exact only from 4.40 (see
# `_compat.HF_RAW_LOGITS_EXACT`); before that the reference is a clean capture of the forward output.
HAS_OUTPUT_LOGITS = hasattr(GenerationConfig(), "output_logits")
HF_LOGITS_EXACT = _compat.HF_RAW_LOGITS_EXACT
# Llama arrives in 4.28; `attn_implementation` (eager, sdpa...) in 4.36, before which these families'
# attention is eager (the weights are returned) with no other to choose.
HAS_LLAMA = hasattr(transformers, "LlamaConfig")
HAS_ATTN_IMPLEMENTATION = _compat.Version(TRANSFORMERS) >= _compat.Version("4.36.0")


def missing_options(kwargs: dict) -> list[str]:
    """Generation options in `kwargs` that this transformers release does not know (e.g. `min_p`)."""
    known = GenerationConfig()
    extra = {"eos_token_id", "pad_token_id", "logits_processor", "max_new_tokens", "tokenizer", "assistant_model"}
    return [name for name in kwargs if name not in extra and not hasattr(known, name)]


def assert_steps_equal(recorded: tuple, reference: tuple, what: str) -> None:
    assert len(recorded) == len(reference), f"{what}: {len(recorded)} steps recorded, {len(reference)} in HF"
    for step, (mine, theirs) in enumerate(zip(recorded, reference)):
        assert mine.device.type == "cpu", f"{what}[{step}] is on {mine.device}"
        assert mine.dtype == theirs.dtype, f"{what}[{step}]: dtype {mine.dtype} vs {theirs.dtype}"
        assert torch.equal(mine, theirs.cpu()), f"{what}[{step}] differs from Hugging Face's"


def assert_same_beam_rows(mine: torch.Tensor, theirs: torch.Tensor, tokens: tuple, parents: tuple) -> None:
    """`beam_indices()` against `out.beam_indices`: equal, or, where they name different rows, rows
    that hold the very same hypothesis at that step (the same generated tokens, rebuilt from the
    recorded ancestry). A search with identical hypotheses in several rows may name any of them, and
    CPU kernels need not give such rows bit-identical scores, so nothing else can tell them apart."""
    assert mine.shape == theirs.shape, f"beam_indices shape {tuple(mine.shape)} vs {tuple(theirs.shape)}"
    assert torch.equal(mine == -1, theirs == -1), "beam_indices end at different steps"
    hypotheses = beam_hypotheses(tokens, parents)
    for sequence, step in (mine != theirs).nonzero().tolist():
        a, b = int(mine[sequence, step]), int(theirs[sequence, step])
        assert hypotheses[step][a] == hypotheses[step][b], (
            f"beam_indices[{sequence}, {step}]: row {a} vs Hugging Face's row {b}, which hold different hypotheses"
        )


def beam_hypotheses(tokens: tuple, parents: tuple) -> list[list[tuple[int, ...]]]:
    """Per step, per running row: the generated tokens it holds, rebuilt from the recorded ancestry."""
    hypotheses = [[()] * tokens[0].shape[0]]
    for step_tokens, step_parents in zip(tokens[:-1], parents[:-1]):
        previous = hypotheses[-1]
        hypotheses.append([previous[int(p)] + (int(t),) for t, p in zip(step_tokens, step_parents)])
    return hypotheses


def finished_from_sequences(sequences: torch.Tensor, prompt_length: int, eos: list[int]) -> list[torch.Tensor]:
    """Rows finished before each step, from the generated tokens: after their first EOS."""
    eos_ids = torch.tensor(eos)
    generated = sequences[:, prompt_length:]
    finished = torch.zeros(sequences.shape[0], dtype=torch.bool)
    out = []
    for t in range(generated.shape[1]):
        out.append(finished.clone())
        finished |= torch.isin(generated[:, t], eos_ids)
    return out


class Boom(Exception):
    pass


class FailAtStep(LogitsProcessor):
    """A user processor that raises `error` when called for step `step` (0-based)."""

    def __init__(self, step: int, error: BaseException) -> None:
        self.step, self.error, self.calls = step, error, 0

    def __call__(self, input_ids, scores):
        if self.calls == self.step:
            raise self.error
        self.calls += 1
        return scores


FIXED_CREATED_BY = {"transformers_offload": "0.1.0", "transformers": "x", "torch": "y", "safetensors": "z", "python": "3"}
FIXED_MODEL = {"class": "MadeUpForCausalLM", "name_or_path": "made-up", "config_class": "MadeUpConfig", "vocab_size": 4}


def made_up_step(step: int, rows: int, vocab: int) -> dict[str, torch.Tensor]:
    """One step's tensors with values that depend only on (step, row, token): no RNG involved."""
    grid = torch.arange(rows * vocab, dtype=torch.float32).reshape(rows, vocab)
    return {
        "logits": grid / 8 + step,
        "scores": -(grid / 16) - step,
        "tokens": (torch.arange(rows) + step) % vocab,
        "finished": (torch.arange(rows) + step) % 3 == 0,
    }


def made_up_native_logits(step: int, rows: int, vocab: int) -> torch.Tensor:
    """Float32 logits that bfloat16 holds exactly, except at step 1 (one value 1/1024 off: stored float32)."""
    logits = made_up_step(step, rows, vocab)["logits"].clone()
    if step == 1:
        logits[0, 0] += 1 / 1024
    return logits


MADE_UP_LAYERS = {"counts": {"attentions": 2, "hidden_states": 3, "encoder_hidden_states": 3},
                  "heads": None, "newest_position_only": False}


def made_up_layers(step: int, rows: int, prompt: int = 2) -> dict[str, torch.Tensor]:
    """One step's per-layer tensors (attentions of layer 1, hidden states of entry 2; the encoder's
    hidden states of entry 0 at step 0), shaped as a 2-head, 3-wide model's, without RNG."""
    queries, keys = (prompt, prompt) if step == 0 else (1, prompt + step)
    count = rows * 2 * queries * keys
    tensors = {
        "attentions.1": (torch.arange(count, dtype=torch.float32) / count + step).reshape(rows, 2, queries, keys),
        "hidden_states.2": (torch.arange(rows * queries * 3, dtype=torch.float32) - step).reshape(rows, queries, 3),
    }
    if step == 0:
        tensors["encoder_hidden_states.0"] = torch.arange(rows * 4 * 3, dtype=torch.float32).reshape(rows, 4, 3)
    return tensors


def made_up_stats(step: int, rows: int, vocab: int) -> torch.Tensor:
    """One step's `(rows, 9)` float32 stats record (what the recorder writes) (columns in `STATS_COLUMNS` order), without RNG."""
    row = torch.arange(rows, dtype=torch.float32)
    return torch.stack([
        (row + step) % vocab,  # token
        -0.25 * (row + 1) - step,  # logprob_raw
        -0.125 * (row + 1),  # logprob_processed
        row % 3,  # rank_raw
        torch.zeros(rows, dtype=torch.float32),  # rank_processed
        0.5 + row + step,  # entropy_raw
        0.0625 * row,  # entropy_processed
        3.0 + step - row,  # logsumexp_raw
        torch.full((rows,), float(vocab), dtype=torch.float32) - row,  # support_processed
    ], dim=-1)


def made_up_topk(step: int, rows: int, k: int = 2) -> torch.Tensor:
    """One step's `(rows, 2K + 2)` float64 top-k record (values, indices, logsumexp, mass outside), as
    recordings made before the packed records hold it (tests/golden/tiny-topk-recording, frozen)."""
    row = torch.arange(rows, dtype=torch.float64)[:, None]
    rank = torch.arange(k, dtype=torch.float64)[None, :]
    values = 2.0 - rank - 0.5 * row + step
    indices = (row + rank + step) % (2 * k)
    return torch.cat([values, indices, values[:, :1] + 0.25, torch.full((rows, 1), 0.125)], dim=-1)


def made_up_sparse_scores(step: int, rows: int, vocab: int) -> torch.Tensor:
    """`made_up_step`'s scores with row 0 cut to one entry (token `step % vocab`) and the others whole."""
    scores = made_up_step(step, rows, vocab)["scores"].clone()
    keep = scores[0, step % vocab].clone()
    scores[0] = float("-inf")
    scores[0, step % vocab] = keep
    return scores


def made_up_sparse_record(step: int, rows: int, vocab: int) -> torch.Tensor:
    """`made_up_sparse_scores` as the `"sparse"` encoding stores it (one flat int32 record)."""
    from transformers_offload.codecs.sparse import Sparse

    scores = made_up_sparse_scores(step, rows, vocab)
    encoder = Sparse()
    return encoder.on_host(encoder.on_device(scores), vocab=vocab, dtype=scores.dtype,
                           fetch=lambda picked: scores.index_select(0, picked))


def write_made_up_recording(root, *, steps: int, rows: int, vocab: int, shard_bytes: int, complete: bool = True,
                            layers: bool = False, stats: bool = False, topk: bool = False, sparse: bool = False,
                            native: bool = False, sampled: bool = False):
    """Drive the shard store directly (no model): the layer below `generate()`. Returns what the store
    hands back (`StoredGeneration`). With `layers`, the steps also carry `made_up_layers`; with `stats`,
    a `made_up_stats` record; with `topk`, the logits are `made_up_native_logits` recorded `"topk:2"` for a
    bfloat16 model and the scores `"topk:2:q4"`; with `sampled`, the scores are recorded `"sample:3@0.5"`
    (seed 0); with
    `sparse`, a `made_up_sparse_record` (`"sparse"`); with `native`, the logits are `made_up_native_logits`
    recorded `"native"` for a bfloat16 model and the scores stored as them (`"same_as_logits"`)."""
    from transformers_offload.store.spill import Spill

    spill = Spill(root, shard_bytes=shard_bytes, model_info=FIXED_MODEL, created_by=FIXED_CREATED_BY)
    encodings = {}
    if native:
        encodings = {"logits": "native", "scores": "same_as_logits"}
    if topk:
        encodings = {"logits": "topk:2", "scores": "topk:2:q4"}
    if sampled:
        encodings = {"scores": "sample:3@0.5"}
    if sparse:
        encodings = {"scores": "sparse"}
    header = GenerationHeader(
        index=0, mode="sample", prompt_length=2, prompt_lengths=tuple([2] * rows), num_beams=1, pad_token_id=0,
        eos_token_id=(1,), generation_config={"do_sample": True}, encodings=encodings,
    )
    names = ["logits", *(["scores"] * (not native)), "tokens", "finished"] + ["stats"] * stats
    store = spill.open_store(names, header, max_steps=steps)
    generators: dict = {}  # the `sampled` draws', one CPU generator seeded 0
    if layers:
        store.add_streams(["attentions.1", "hidden_states.2"], ["encoder_hidden_states.0"], MADE_UP_LAYERS)
    for step in range(steps):
        tensors = {**made_up_step(step, rows, vocab), **(made_up_layers(step, rows) if layers else {})}
        if stats:
            tensors["stats"] = made_up_stats(step, rows, vocab)
        if topk or sampled:
            from transformers_offload.codecs.packed import QuantisedTopK, Sampled, TopK

            if topk:
                tensors["logits"] = TopK("topk:2", torch.bfloat16).on_cpu(made_up_native_logits(step, rows, vocab))
                tensors["scores"] = QuantisedTopK("topk:2:q4").on_cpu(made_up_step(step, rows, vocab)["scores"])
            else:
                tensors["scores"] = Sampled("sample:3@0.5", generators, 0).on_cpu(made_up_step(step, rows, vocab)["scores"])
        if sparse:
            tensors["scores"] = made_up_sparse_record(step, rows, vocab)
        if native:
            from transformers_offload.codecs.native import Native

            del tensors["scores"]
            tensors["logits"] = Native(torch.bfloat16).on_cpu(made_up_native_logits(step, rows, vocab))
        store.drain(step, tensors)
    sequences = torch.arange(rows * (2 + steps)).reshape(rows, 2 + steps) % vocab if complete else None
    error = None if complete else KeyboardInterrupt()
    return store.finish(steps, replace(header, num_rows=rows), sequences, error, ring_waits=0)


@dataclass
class Reference:
    """What Hugging Face computed for a call: the tensors a recording must equal (`torch.equal`)."""

    sequences: torch.Tensor
    scores: tuple
    logits: tuple  # out.logits where exact (4.40+), else the model's forward output per step
    beam_indices: torch.Tensor | None  # (returned, generated length): 4.50's layout on every release


def refused_here(kwargs: dict) -> str | None:
    """The mode `generate(**kwargs)` runs, where this release's Recorder refuses it (beam sampling before
    4.35, assisted decoding before 4.36: `_compat.SUPPORTED_MODES`); None where it is recorded."""
    if kwargs.get("num_beams", 1) > 1 and kwargs.get("do_sample") and "beam_sample" not in _compat.SUPPORTED_MODES:
        return "beam_sample"
    assisted = kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens")
    if assisted and "assisted_generation" not in _compat.SUPPORTED_MODES:
        return "assisted_generation"
    return None


def skip_if_refused(kwargs: dict) -> None:
    """Skip the test where this release's Recorder refuses the mode `generate(**kwargs)` runs (`refused_here`)."""
    refused = refused_here(kwargs)
    if refused:
        pytest.skip(f"transformers {TRANSFORMERS}: the Recorder refuses {refused!r} (its refusal is tested)")


def hf_reference(model, **kwargs) -> Reference:
    """Run `model.generate(**kwargs)` with Hugging Face's own per-step outputs, as the reference.

    The model's next-token logits are also captured from its forward output, which is what a
    processor list receives before any processor runs; from 4.40 they must equal `out.logits`.
    A mode this release's Recorder refuses skips the test (`refused_here`; the main tests check the
    refusal itself).
    """
    skip_if_refused(kwargs)
    captured = []

    def capture(module, args, output):
        captured.append(output.logits[:, -1, :].detach().clone())

    handle = model.register_forward_hook(capture)
    try:
        out = model.generate(
            **kwargs, return_dict_in_generate=True, output_scores=True,
            **({"output_logits": True} if HAS_OUTPUT_LOGITS else {}),
        )
    finally:
        handle.remove()
    steps = len(out.scores)
    if len(captured) > steps and len(captured) % steps == 0:
        # low_memory beam search (4.38-4.49): one forward per sub-batch, in row order.
        parts = len(captured) // steps
        captured = [torch.cat(captured[i : i + parts]) for i in range(0, len(captured), parts)]
    logits = tuple(captured[:steps])
    if HF_LOGITS_EXACT:
        upcast = tuple(step.to(theirs.dtype) for step, theirs in zip(logits, out.logits))  # 4.45+: float32
        assert_steps_equal(upcast, out.logits, "the model's forward logits against out.logits")
        logits = out.logits
    beam_indices = getattr(out, "beam_indices", None)
    if beam_indices is not None:
        # Up to 4.49 padded with -1 to max_length; from 4.50 cut to the generated length.
        prompt = 1 if model.config.is_encoder_decoder else kwargs["input_ids"].shape[1]  # decoder start
        generated = out.sequences.shape[1] - prompt
        assert (beam_indices[:, generated:] == -1).all()
        beam_indices = beam_indices[:, :generated]
    return Reference(out.sequences, out.scores, logits, beam_indices)


# -- tiny models built from configs (no network), and their prompts --------------------------------------
FUZZ_SCALE = 10 if os.environ.get("TRANSFORMERS_OFFLOAD_FUZZ") == "large" else 1


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
    if not HAS_LLAMA:
        pytest.skip(f"transformers {TRANSFORMERS} has no Llama (it arrives in 4.28)")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=2, eos_token_id=EOS, pad_token_id=PAD,
    )
    return transformers.LlamaForCausalLM(config)


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


def attention(attn_implementation: str | None) -> dict[str, str]:
    """The keywords that load a model with `attn_implementation` on this release: none before 4.36,
    where attention is eager only (the test is skipped for any other)."""
    if attn_implementation is None or HAS_ATTN_IMPLEMENTATION:
        return {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if attn_implementation != "eager":
        pytest.skip(f"transformers {TRANSFORMERS} has eager attention only (`attn_implementation` arrives in 4.36)")
    return {}


def make_tiny(name: str, seed: int = 0, attn_implementation: str | None = None) -> torch.nn.Module:
    """A tiny model from `TINY_MODELS` or `ENCODER_DECODERS`, seeded; `attn_implementation` as in
    `from_pretrained` (default: the release's own default)."""
    build = {**TINY_MODELS, **ENCODER_DECODERS}[name]
    torch.manual_seed(seed)
    model = build()
    if attention(attn_implementation):
        torch.manual_seed(seed)
        model = type(model)._from_config(model.config, **attention(attn_implementation))
    model = model.eval()
    # Random weights give near-uniform logits; sharpen them so greedy and beam choices are not ties.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


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


# -- shared from test_exactness --------------------------------------------------------------------------
CASES = {
    "greedy": {},
    "greedy_penalties": dict(repetition_penalty=1.5, no_repeat_ngram_size=2, min_new_tokens=5, bad_words_ids=[[7], [8, 9]]),
    "sample_temperature": dict(do_sample=True, temperature=0.7),
    "sample_top_k_top_p": dict(do_sample=True, top_k=20, top_p=0.9),
    "sample_min_p": dict(do_sample=True, min_p=0.1),
    "sample_typical_p": dict(do_sample=True, typical_p=0.8),
    "sample_repetition_ngram": dict(do_sample=True, repetition_penalty=1.3, no_repeat_ngram_size=3),
    "sample_min_new_tokens_bad_words": dict(do_sample=True, min_new_tokens=6, bad_words_ids=[[5], [10, 11]]),
    "sample_renormalize": dict(do_sample=True, temperature=1.3, top_k=40, renormalize_logits=True),
    "sample_everything": dict(
        do_sample=True, temperature=0.8, top_k=30, top_p=0.95, min_p=0.02, typical_p=0.95,
        repetition_penalty=1.3, no_repeat_ngram_size=3, min_new_tokens=4, bad_words_ids=[[7]],
        renormalize_logits=True,
    ),
    "num_return_sequences": dict(do_sample=True, num_return_sequences=3, top_k=50),
    "greedy_rows_finish_early": dict(eos="early"),
    "sample_rows_finish_early": dict(do_sample=True, eos="many"),
    "beam_search": dict(num_beams=3),
    "beam_return_sequences": dict(num_beams=4, num_return_sequences=2, length_penalty=0.5),
    "beam_penalties_renormalize": dict(num_beams=3, repetition_penalty=1.2, no_repeat_ngram_size=2, renormalize_logits=True),
    "beam_rows_finish_early": dict(num_beams=3, num_return_sequences=3, eos="early"),
    "beam_sample": dict(num_beams=3, do_sample=True, temperature=0.9, top_k=30),
}


NEW_TOKENS = 12


# Where the recording is read from: the in-memory recorder, a spilling recorder (shards of about five
# steps, so that shard boundaries fall inside every case), and `open_recording` on that directory.
READERS = ("memory", "spill", "open_recording")


SEED = 1234


SMALL_SHARD_BYTES = 16_000


class Store:
    """Where a test's recording goes: kept in memory, or spilled to `directory` and read back from disk.

    The `store` fixture (conftest.py) runs a test once per kind. `options()` are the `Recorder`
    keywords that choose the store; `reopen(rec)` is what a user reads after the call: the recorder
    itself, or the spilled files opened with `open_recording`."""

    def __init__(self, kind: str, directory: Path) -> None:
        self.kind = kind
        self.directory = directory

    @property
    def spill(self) -> bool:
        return self.kind == "spill"

    def options(self, directory: Path | None = None, **spill_options) -> dict:
        """The Recorder keywords: none for memory; `spill_dir` (this directory, or `directory`) and
        `spill_options` (such as `shard_bytes`) for spill."""
        return {"spill_dir": directory or self.directory, **spill_options} if self.spill else {}

    def reopen(self, rec, directory: Path | None = None, **open_options):
        """`rec` for memory; for spill, the files opened again from disk (`open_options` such as `verify`)."""
        return open_recording(directory or self.directory, **open_options) if self.spill else rec

    def __repr__(self) -> str:
        return self.kind


@dataclass
class Recorded:
    """One call recorded beside Hugging Face's own outputs for it (the `recorded` fixture)."""

    reference: Reference
    sequences: torch.Tensor  # what the recorded call returned
    recording: object  # the Recorder, or the spilled recording opened from disk


def record_with_reference(model, store: Store | None = None, *, seed: int = SEED, recorder: dict | None = None,
                          spill: dict | None = None, **generate_kwargs) -> Recorded:
    """Run `generate(**generate_kwargs)` twice from the same seed: once for Hugging Face's reference,
    once with a Recorder (`recorder` keywords, in `store` when given, `spill` its spill options); assert
    the tokens are the same and return both."""
    torch.manual_seed(seed)
    reference = hf_reference(model, **generate_kwargs)
    options = store.options(**(spill or {})) if store is not None else {}
    with Recorder(model, **(recorder or {}), **options) as rec:
        torch.manual_seed(seed)
        sequences = model.generate(**generate_kwargs, logits_processor=[rec])
    assert torch.equal(sequences, reference.sequences), "the recorder changed the generated tokens"
    return Recorded(reference, sequences, store.reopen(rec) if store is not None else rec)


def resolve_eos(model, batch, kwargs):
    """Pick EOS ids that make some rows finish early, from a plain run of the same call."""
    kwargs = dict(kwargs)
    eos = kwargs.pop("eos", None)
    if eos is None:
        return kwargs, [EOS]
    if eos == "many":
        if _compat.Version(TRANSFORMERS) < _compat.Version("4.28.0"):
            # 4.26.1 marks a row unfinished with a sum over the EOS ids instead of a product: with several,
            # rows count up past 1 and its own generate() indexes past the vocabulary (fixed by 4.28.1).
            pytest.skip(f"transformers {TRANSFORMERS}'s generate() fails with several EOS ids")
        ids = list(range(3, 40))
        return {**kwargs, "eos_token_id": ids, "pad_token_id": PAD}, ids
    torch.manual_seed(SEED)
    plain = model.generate(**batch, max_new_tokens=NEW_TOKENS, **kwargs)
    prompt = batch["input_ids"].shape[1]
    chosen = int(plain[0, prompt + 2])
    return {**kwargs, "eos_token_id": chosen, "pad_token_id": PAD}, [chosen]


# -- shared from test_assisted ---------------------------------------------------------------------------
# Batch 1 (assisted decoding's limit), with repeated n-grams for prompt lookup to find.
ASSISTED_PROMPT = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]]),
                   "attention_mask": torch.ones(1, 12, dtype=torch.long)}


# Options, and the processors (and warpers) generate() builds for them, in the order it applies them.
ASSISTED_CONFIGS = {
    "greedy": ({}, []),
    "repetition_penalty": ({"repetition_penalty": 1.3}, [RepetitionPenaltyLogitsProcessor(1.3)]),
    "sampling": ({"do_sample": True, "temperature": 0.7, "top_k": 20}, [TemperatureLogitsWarper(0.7), TopKLogitsWarper(20)]),
}


ASSISTED_SOURCES = ("assistant_model", "prompt_lookup")


def assisted_source(name: str) -> dict:
    if name == "prompt_lookup":
        return {"prompt_lookup_num_tokens": 4}
    assistant = make_tiny("llama", seed=3)
    # Always draft 4 tokens: a random assistant is never confident enough to draft by default (4.42+).
    assistant.generation_config.num_assistant_tokens = 4
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    if hasattr(assistant.generation_config, "assistant_confidence_threshold"):
        assistant.generation_config.assistant_confidence_threshold = 0.0
    return {"assistant_model": assistant}


# -- shared from test_modes ------------------------------------------------------------------------------
MODE_CASES = {
    "greedy": {},
    "sample": {"do_sample": True, "top_k": 20},
    "beam_search": {"num_beams": 3, "num_return_sequences": 2},
}


# Contrastive search and DoLa run inside the library up to 4.56 (DoLa from 4.43); 4.57 moved them to
# the Hub, where the recorder refuses them.
IN_LIBRARY = {
    "contrastive_search": {"penalty_alpha": 0.6, "top_k": 4},
    "contrastive_search_penalty": {"penalty_alpha": 0.6, "top_k": 4, "repetition_penalty": 1.3},
    "dola_generation": {"dola_layers": "low", "repetition_penalty": 1.2},
}


GROUP_BEAM = {
    "group_beam_search": {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0},
    "group_beam_return_penalty": {"num_beams": 6, "num_beam_groups": 3, "diversity_penalty": 0.5,
                                  "num_return_sequences": 2, "repetition_penalty": 1.3},
}


# -- shared from test_stats ------------------------------------------------------------------------------
STATS_KEYS = ("token", "logprob_raw", "logprob_processed", "rank_raw", "rank_processed", "entropy_raw",
        "entropy_processed", "logsumexp_raw", "support_processed")


# Every other mode: the stats equal the expressions on the recording's own logits and scores, which
# the mode's own tests show equal to Hugging Face's.
def _other_modes() -> dict:
    cases = {}
    for source in ASSISTED_SOURCES:
        for config in ("greedy", "sampling"):
            cases[f"assisted_{source}_{config}"] = ("llama", ASSISTED_PROMPT,
                                                    dict(ASSISTED_CONFIGS[config][0], max_new_tokens=16), source)
    for name, kwargs in {**IN_LIBRARY, **GROUP_BEAM}.items():
        cases[name] = ("llama", None, dict(kwargs, max_new_tokens=8), None)
    for model in ("t5", "bart"):
        for mode, kwargs in MODE_CASES.items():
            cases[f"{model}_{mode}"] = (model, None, dict(kwargs, max_new_tokens=8), None)
    cases["low_memory_beam_search"] = ("gpt2", None, dict(num_beams=3, low_memory=True, max_new_tokens=6), None)
    cases["static_cache_sample"] = ("llama", None,
                                    dict(do_sample=True, top_k=20, cache_implementation="static", max_new_tokens=8), None)
    return cases


OTHER_MODES = _other_modes()


def other_mode(case: str, dtype: torch.dtype | None = None) -> tuple:
    """OTHER_MODES[`case`]'s model (cast to `dtype`, if given), batch and generate() options; skips
    where the release lacks them."""
    name, prompt, kwargs, source = OTHER_MODES[case]
    if missing_options(kwargs):
        pytest.skip(f"transformers {TRANSFORMERS} has no {missing_options(kwargs)}")
    model = make_tiny(name)
    if dtype is not None:
        model = model.to(dtype)
    if source is not None:
        extra = assisted_source(source)
        if missing_options(extra):
            pytest.skip(f"transformers {TRANSFORMERS} has no {missing_options(extra)}")
        kwargs = dict(kwargs, **extra)
    return model, prompt if prompt is not None else left_padded_batch(), kwargs


def record_other_mode(case: str, tmp_path, variants: list[dict], dtype: torch.dtype | None = None) -> list:
    """Run OTHER_MODES[`case`] (its model cast to `dtype`, if given) once per Recorder options in
    `variants` (each spilled, small shards) and return the generations read back with `open_recording`;
    skips where the release lacks the mode."""

    model, batch, kwargs = other_mode(case, dtype)
    generations = []
    for index, options in enumerate(variants):
        with Recorder(model, spill_dir=tmp_path / str(index), shard_bytes=3_000, **options) as rec:
            torch.manual_seed(0)
            try:
                model.generate(**batch, logits_processor=[rec], **kwargs)
            except UnsupportedModeError:
                pytest.skip(f"transformers {TRANSFORMERS} does not run {case} in the library")
        generations.append(open_recording(tmp_path / str(index)).generation())
    return generations


def run_case(model, case, streams, spill_dir=None):
    batch = left_padded_batch()
    kwargs, _ = resolve_eos(model, batch, CASES[case])
    if missing_options(kwargs):
        pytest.skip(f"transformers {TRANSFORMERS} has no {missing_options(kwargs)}")
    torch.manual_seed(SEED)
    reference = hf_reference(model, **batch, max_new_tokens=NEW_TOKENS, **kwargs)
    options = {} if spill_dir is None else {"spill_dir": spill_dir, "shard_bytes": SMALL_SHARD_BYTES}
    with Recorder(model, streams=streams, **options) as rec:
        torch.manual_seed(SEED)
        sequences = model.generate(**batch, logits_processor=[rec], max_new_tokens=NEW_TOKENS, **kwargs)
    assert torch.equal(sequences, reference.sequences), "the recorder changed the generated tokens"
    return batch, kwargs, reference, rec


def expected_stats(x: torch.Tensor, s: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor | None) -> dict:
    """docs/recording.md's expressions, on one step's raw logits `x` and processed scores `s`."""
    tokens = tokens.to(x.device)
    rows = torch.arange(tokens.shape[0], device=x.device)
    continues = tokens >= 0
    if parents is not None:
        parents = parents.to(x.device)
        continues = continues & (parents >= 0)
        rows = torch.where(parents >= 0, parents, rows)
    y = torch.where(continues, tokens, 0)
    values = {
        "token": torch.where(continues, tokens, -1),
        "logprob_raw": torch.log_softmax(x, -1)[rows, y].float(),
        "logprob_processed": torch.log_softmax(s, -1)[rows, y].float(),
        "rank_raw": (x[rows] > x[rows, y][:, None]).sum(-1),
        "rank_processed": (s[rows] > s[rows, y][:, None]).sum(-1),
        "entropy_raw": torch.special.entr(torch.softmax(x, -1)).sum(-1)[rows].float(),
        "entropy_processed": torch.special.entr(torch.softmax(s, -1)).sum(-1)[rows].float(),
        "logsumexp_raw": torch.logsumexp(x, -1)[rows].float(),
        "support_processed": torch.isfinite(s).sum(-1)[rows],
    }
    for name in ("logprob_raw", "logprob_processed"):
        values[name] = torch.where(continues, values[name], float("nan"))
    for name in ("rank_raw", "rank_processed"):
        values[name] = torch.where(continues, values[name], -1)
    return values


def assert_stats_equal(recorded: tuple, reference, tokens: tuple, parents: tuple | None) -> None:
    assert len(recorded) == len(reference.scores) > 0
    for t, step in enumerate(recorded):
        assert tuple(step) == STATS_KEYS
        expected = expected_stats(reference.logits[t], reference.scores[t], tokens[t], None if parents is None else parents[t])
        for name in STATS_KEYS:
            mine, theirs = step[name], expected[name].cpu()
            assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, (t, name, mine.dtype, theirs.dtype)
            assert torch.equal(mine.isnan(), theirs.isnan()), (t, name)
            assert torch.equal(mine.nan_to_num(0.0), theirs.nan_to_num(0.0)), f"step {t}: {name} differs"


# -- shared from test_encodings --------------------------------------------------------------------------
TOPK_KEYS = ("values", "indices", "logsumexp", "mass_outside", "logprobs")


def expected_topk(x: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """The documented expressions, on one step's `(rows, vocab)` tensor."""
    values, indices = torch.topk(x, k, dim=-1)
    logsumexp = torch.logsumexp(x, -1)
    mass_outside = torch.exp(torch.logsumexp(x.scatter(-1, indices, float("-inf")), -1) - logsumexp)
    return {
        "values": values.float(), "indices": indices, "logsumexp": logsumexp.float(),
        "mass_outside": mass_outside.float(), "logprobs": values.float() - logsumexp.float()[:, None],
    }


def assert_topk_equal(recorded: tuple, reference: tuple, k: int) -> None:
    assert len(recorded) == len(reference) > 0
    for t, (step, dense) in enumerate(zip(recorded, reference)):
        assert tuple(step) == TOPK_KEYS
        expected = expected_topk(dense, k)
        for name in TOPK_KEYS:
            mine, theirs = step[name], expected[name].cpu()
            assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, (t, name)
            assert torch.equal(mine.isnan(), theirs.isnan()), (t, name)
            assert torch.equal(mine.nan_to_num(0.0, posinf=1e30, neginf=-1e30),
                               theirs.nan_to_num(0.0, posinf=1e30, neginf=-1e30)), \
                f"step {t}: {name} differs"


# -- shared from test_record -----------------------------------------------------------------------------
def complete_samples(out: Path) -> Counter:
    with open_recording(out) as run:
        return Counter(str(s) for g in run.generations if g.complete for s in g.sample_ids)


def record_model():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=256,
                                      bos_token_id=2, eos_token_id=1, pad_token_id=0)).eval()


def write_prompts(path: Path, count: int, *, ids: bool = True) -> Path:
    lines = [{**({"id": f"s{i:03d}"} if ids else {}), "text": " ".join(f"w{3 + (i * 7 + k) % 120}" for k in range(2 + i % 5))}
             for i in range(count)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def record_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "[EOS]": 1, "[BOS]": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="[PAD]"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="[PAD]", eos_token="[EOS]", bos_token="[BOS]",
                                   clean_up_tokenization_spaces=False)  # 4.44 warns when it is not set


# -- shared from test_sparse -----------------------------------------------------------------------------
def assert_dense_equal(recorded: tuple, reference: tuple) -> None:
    assert len(recorded) == len(reference) > 0
    for t, (mine, theirs) in enumerate(zip(recorded, reference)):
        theirs = theirs.cpu()
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, t
        assert torch.equal(mine.isnan(), theirs.isnan()), t
        assert torch.equal(mine.nan_to_num(0.0), theirs.nan_to_num(0.0)), f"step {t} differs"


# -- shared from test_logprobs ---------------------------------------------------------------------------
class FailAtStepCriteria(StoppingCriteria):
    def __init__(self, step):
        self.step, self.calls = step, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls > self.step:
            raise RuntimeError("stopped on purpose")
        return False  # transformers 4.36 wants a bool; later releases broadcast it over the rows


# -- host syncs, caught without a GPU ---------------------------------------------------------------------
class HostSyncGuard:
    """A `TorchDispatchMode` that notes every op which, on a CUDA tensor, makes the host wait for the device,
    issued while it is active (entered only around this package's per-step code: `guarded`), so that the CPU
    suite catches what the CUDA sync-debug test (tests/capture/test_cuda.py) would.

    The ops: `_local_scalar_dense` (behind `.item()`, `.tolist()`, `bool()`, `int()`, `float()` of a tensor),
    `is_nonzero`, `equal` (`torch.equal` returns a bool), `nonzero`, `masked_select`, `_unique`, `_unique2`,
    `unique_dim`, `unique_consecutive`, `repeat_interleave` without `output_size`, indexing or `index_put_`
    with a boolean index (`aten.index.Tensor`, `aten.index_put(_)`), and `_to_copy` / `copy_` to the CPU
    from another device (nothing on a CPU-only run: the transfer ring's own CPU path stands in for it, so the
    guard is paused inside `HostRing.put`, whose CUDA path the CUDA test guards). `ops` counts the ops it saw,
    `found` the offending ones with this package's innermost frame, but those in `cpu_only`, functions
    (`"file.py:function"`) that read values only on the CPU branch of a device test a CUDA tensor never takes."""

    def __init__(self, cpu_only: tuple[str, ...] = ()) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        guard = self
        self.ops, self.found, self.paused, self.cpu_only = 0, [], 0, cpu_only
        aten = torch.ops.aten
        always = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default,
                  aten.nonzero.default, aten.masked_select.default, aten._unique.default, aten._unique2.default,
                  aten.unique_dim.default, aten.unique_consecutive.default}

        def bool_index(indices) -> bool:
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())

        def syncs(func, args, kwargs) -> bool:
            if func in always:
                return True
            packet = func.overloadpacket
            if packet is aten.repeat_interleave and func is aten.repeat_interleave.Tensor:
                return kwargs.get("output_size") is None and (len(args) < 2 or args[1] is None)
            if packet in (aten.index, aten.index_put, aten.index_put_):
                return bool_index(args[1] if len(args) > 1 else kwargs.get("indices"))
            if packet in (aten._to_copy, aten.copy_):
                source = args[1] if packet is aten.copy_ else args[0]
                target = args[0].device if packet is aten.copy_ else kwargs.get("device")
                return (isinstance(source, torch.Tensor) and source.device.type != "cpu"
                        and target is not None and torch.device(target).type == "cpu")
            return False

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if not guard.paused:
                    guard.ops += 1
                    if syncs(func, args, kwargs):
                        where = _innermost_own_frame()
                        if not any(where.startswith(f"{name.split(':')[0]}:") and where.endswith(f"({name.split(':')[1]})")
                                   for name in guard.cpu_only):
                            guard.found.append(f"{func} at {where}")
                return func(*args, **kwargs)

        self.mode = Mode()

    def guarded(self, function):
        """`function`, run with the guard active."""
        import functools

        @functools.wraps(function)
        def run(*args, **kwargs):
            with self.mode:
                return function(*args, **kwargs)

        return run

    def paused_in(self, function):
        """`function`, run with the guard not noting (its CPU work stands in for a device path guarded elsewhere)."""
        import functools

        @functools.wraps(function)
        def run(*args, **kwargs):
            self.paused += 1
            try:
                return function(*args, **kwargs)
            finally:
                self.paused -= 1

        return run


def _innermost_own_frame() -> str:
    """`file:line (function)` of this package's innermost frame on the stack."""
    import traceback

    frames = [f for f in traceback.extract_stack() if "transformers_offload" in f.filename and "/tests/" not in f.filename]
    if not frames:
        return "?"
    frame = frames[-1]
    return f"{frame.filename.split('transformers_offload/')[-1]}:{frame.lineno} ({frame.name})"


# -- shared by the TRL tests ---------------------------------------------------------------------------------
# The share of memory continuous batching may take for its cache in tests (tests/conftest.py caps transformers'
# default with it; TRL sets its own 0.5, so its tests pass this through `transformers_continuous_batching_config`).
TEST_CB_MEMORY_PERCENT = 0.04


def keep_trl_batches(trainer) -> list:
    """The list each rollout batch TRL's `_generate_and_score_completions` returns is appended to (before TRL
    shuffles and splits it)."""
    batches = []
    generate_and_score = trainer._generate_and_score_completions

    def kept(*args, **kwargs):
        batches.append(generate_and_score(*args, **kwargs))
        return batches[-1]

    trainer._generate_and_score_completions = kept
    return batches


# -- shared by the CUDA tests --------------------------------------------------------------------------------
def cuda_strict(function):
    """`function`, run with CUDA's sync debug mode set to raise on any synchronising call."""

    def strict(*args, **kwargs):
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return function(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    return strict


# -- shared by the tests that run a benchmark ----------------------------------------------------------------
def bench_module(name: str):
    """A module of bench/ (its scripts import each other by name)."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "bench"))
