"""Comparisons used across tests: exact, never with a tolerance."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers
from transformers import GenerationConfig, LogitsProcessor

from transformers_offload import _compat

TRANSFORMERS = transformers.__version__  # for messages; release facts live in _compat
# `output_logits` exists from 4.38, but Hugging Face's own raw logits are exact only from 4.40 (see
# `_compat.HF_RAW_LOGITS_EXACT`); before that the reference is a clean capture of the forward output.
HAS_OUTPUT_LOGITS = hasattr(GenerationConfig(), "output_logits")
HF_LOGITS_EXACT = _compat.HF_RAW_LOGITS_EXACT


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
    from transformers_offload.capture.encodings import Sparse

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
    from transformers_offload.store.shards import Spill

    spill = Spill(root, shard_bytes=shard_bytes, model_info=FIXED_MODEL, created_by=FIXED_CREATED_BY)
    header = {
        "index": 0, "mode": "sample", "prompt_length": 2, "prompt_lengths": tuple([2] * rows), "num_beams": 1,
        "pad_token_id": 0, "eos_token_id": (1,), "generation_config": {"do_sample": True},
    }
    names = ["logits", *(["scores"] * (not native)), "tokens", "finished"] + ["stats"] * stats
    if native:
        header["encodings"] = {"logits": "native", "scores": "same_as_logits"}
    if topk:
        header["encodings"] = {"logits": "topk:2", "scores": "topk:2:q4"}
    if sampled:
        header["encodings"] = {"scores": "sample:3@0.5"}
    if sparse:
        header["encodings"] = {"scores": "sparse"}
    store = spill.open_store(names, header, max_steps=steps)
    generators: dict = {}  # the `sampled` draws', one CPU generator seeded 0
    if layers:
        store.add_streams(["attentions.1", "hidden_states.2"], ["encoder_hidden_states.0"], MADE_UP_LAYERS)
    for step in range(steps):
        tensors = {**made_up_step(step, rows, vocab), **(made_up_layers(step, rows) if layers else {})}
        if stats:
            tensors["stats"] = made_up_stats(step, rows, vocab)
        if topk or sampled:
            from transformers_offload.capture.packed_encodings import QuantisedTopK, Sampled, TopK

            if topk:
                tensors["logits"] = TopK("topk:2", torch.bfloat16).on_cpu(made_up_native_logits(step, rows, vocab))
                tensors["scores"] = QuantisedTopK("topk:2:q4").on_cpu(made_up_step(step, rows, vocab)["scores"])
            else:
                tensors["scores"] = Sampled("sample:3@0.5", generators, 0).on_cpu(made_up_step(step, rows, vocab)["scores"])
        if sparse:
            tensors["scores"] = made_up_sparse_record(step, rows, vocab)
        if native:
            from transformers_offload.capture.encodings import Native

            del tensors["scores"]
            tensors["logits"] = Native(torch.bfloat16).on_cpu(made_up_native_logits(step, rows, vocab))
        store.drain(step, tensors)
    sequences = torch.arange(rows * (2 + steps)).reshape(rows, 2 + steps) % vocab if complete else None
    error = None if complete else KeyboardInterrupt()
    return store.finish(steps, {**header, "num_rows": rows}, sequences, error, ring_waits=0)


@dataclass
class Reference:
    """What Hugging Face computed for a call: the tensors a recording must equal (`torch.equal`)."""

    sequences: torch.Tensor
    scores: tuple
    logits: tuple  # out.logits where exact (4.40+), else the model's forward output per step
    beam_indices: torch.Tensor | None  # (returned, generated length): 4.50's layout on every release


def hf_reference(model, **kwargs) -> Reference:
    """Run `model.generate(**kwargs)` with Hugging Face's own per-step outputs, as the reference.

    The model's next-token logits are also captured from its forward output, which is what a
    processor list receives before any processor runs; from 4.40 they must equal `out.logits`.
    """
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
