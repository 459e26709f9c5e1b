"""Per-token statistics (`streams=(..., "stats")`): each value equals, `torch.equal`, its documented
torch expression applied to Hugging Face's own `out.logits[t]` and `out.scores[t]` (before 4.40, where
`out.logits` is absent or not what the processors receive, to the model's forward logits that
`hf_reference` captures and the recorder's logits equal)."""

from __future__ import annotations

import json

import pytest
import torch

from transformers_offload import Recorder, open_recording

from ..helpers import (
    CASES,
    OTHER_MODES,
    READERS,
    STATS_KEYS,
    TRANSFORMERS,
    assert_stats_equal,
    expected_stats,
    other_mode,
    run_case,
)


def _tokens_and_parents(rec, reference, batch, kwargs):
    if "num_beams" in kwargs:
        return rec.tokens(), rec.beam_parents()
    prompt = batch["input_ids"].shape[1]
    return tuple(reference.sequences[:, prompt + t] for t in range(len(reference.scores))), None


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_stats_equal_their_expressions_on_hugging_face_outputs(gpt2, case, reader, tmp_path):
    spill_dir = None if reader == "memory" else tmp_path / "run"
    batch, kwargs, reference, rec = run_case(gpt2, case, ("logits", "scores", "stats"), spill_dir)
    if reader == "open_recording":
        rec = open_recording(spill_dir)
    tokens, parents = _tokens_and_parents(rec, reference, batch, kwargs)
    assert_stats_equal(rec.stats(), reference, tokens, parents)


@pytest.mark.parametrize("case", ["greedy", "sample_everything", "beam_return_sequences"])
def test_stats_alone_on_every_tiny_model(tiny_model, case, tmp_path):
    batch, kwargs, reference, rec = run_case(tiny_model, case, ("stats",), tmp_path / "run")
    tokens, parents = _tokens_and_parents(rec, reference, batch, kwargs)
    assert_stats_equal(rec.stats(), reference, tokens, parents)
    generation = open_recording(tmp_path / "run").generation()
    assert set(generation.streams) == {"tokens", "finished", "stats"} | ({"beam_parents"} if parents else set())
    with pytest.raises(KeyError, match="logits"):
        generation.logits()


def test_stats_alone_are_36_bytes_per_row_and_step(gpt2, tmp_path):
    _, _, reference, rec = run_case(gpt2, "sample_top_k_top_p", ("stats",), tmp_path / "run")
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    stream = manifest["generations"][0]["streams"]["stats"]
    rows = reference.sequences.shape[0]
    assert stream == {"dtype": "float32", "shape": [rows, 9], "encoding": "dense"}
    described = open_recording(tmp_path / "run").describe()["generations"][0]["streams"]["stats"]
    assert described["bytes"] == 36 * rows * len(reference.scores)


def test_stats_rows_steps_and_numpy(gpt2):
    _, _, _, rec = run_case(gpt2, "sample_temperature", ("stats",))
    whole = rec.stats()
    part = rec.stats(steps=slice(2, 5), rows=[2, 0])
    assert len(part) == 3
    for mine, theirs in zip(part, whole[2:5]):
        for name in STATS_KEYS:
            assert torch.equal(mine[name], theirs[name][[2, 0]])
    arrays = rec.stats(framework="np", steps=range(1))[0]
    assert arrays["token"].dtype.name == "int64" and arrays["logprob_raw"].dtype.name == "float32"


def test_no_stats_recorded_says_how_to_get_them(gpt2):
    _, _, _, rec = run_case(gpt2, "greedy", ("logits",))
    with pytest.raises(KeyError, match="stats"):
        rec.stats()


@pytest.mark.filterwarnings("ignore:`num_hidden_layers` is deprecated:FutureWarning")
@pytest.mark.parametrize("case", sorted(OTHER_MODES))
def test_stats_in_every_other_mode(case, store, tmp_path):
    from transformers_offload import UnsupportedModeError

    model, batch, kwargs = other_mode(case)
    options = store.options(shard_bytes=3_000)
    with Recorder(model, streams=("logits", "scores", "stats"), **options) as rec:
        torch.manual_seed(0)
        try:
            model.generate(**batch, logits_processor=[rec], **kwargs)
        except UnsupportedModeError:
            pytest.skip(f"transformers {TRANSFORMERS} does not run {case} in the library")
    rec = store.reopen(rec)
    generation = rec.generation()
    assert generation.complete and generation.num_steps > 0
    parents = generation.beam_parents() if generation.is_beam else None
    recorded = type("Recorded", (), {"logits": generation.logits(), "scores": generation.scores()})
    assert_stats_equal(rec.stats(), recorded, generation.tokens(), parents)


def test_a_vocabulary_past_float32s_integers_gets_a_float64_record(gpt2, tmp_path, monkeypatch):
    """Float32 holds every integer up to 2**24 only: a larger vocabulary's token ids, ranks and counts
    go into a float64 record (here the bound is lowered below the tiny model's vocabulary)."""
    from transformers_offload.capture import stats as stats_module

    monkeypatch.setattr(stats_module, "FLOAT32_INTEGERS", 8)
    _, _, reference, rec = run_case(gpt2, "sample_top_k_top_p", ("logits", "scores", "stats"), tmp_path / "run")
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["generations"][0]["streams"]["stats"]["dtype"] == "float64"
    tokens = open_recording(tmp_path / "run").generation().tokens()
    assert_stats_equal(rec.stats(), reference, tokens, None)


def _made_up_step(rows: int, vocab: int, dtype: torch.dtype, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's raw logits and processed scores (masked to -inf in places, one row all -inf but one)."""
    generator = torch.Generator().manual_seed(step)
    x = (torch.randn(rows, vocab, generator=generator) * 4).to(dtype)
    s = torch.log_softmax(x.float() / 0.7, -1)
    s[:, ::3] = float("-inf")
    s[-1, 1:] = float("-inf")
    return x, s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beam", [False, True])
def test_stats_reuse_their_buffers_and_equal_the_expressions(dtype, beam):
    """StepStats computes into buffers made in the first steps (a process's peak then does not depend
    on the C library's reuse of freed blocks) and its values still equal the expressions exactly."""
    from transformers_offload.capture.stats import StepStats

    rows, vocab = 4, 1_000
    stats = StepStats()
    made = []
    for step in range(6):
        x, s = _made_up_step(rows, vocab, dtype, step)
        stats.raw(step, x)
        stats.raw(step, x)  # a step written again (assisted decoding) replaces the first write
        stats.processed(step, s)
        tokens = torch.tensor([3, -1, 7, 1])
        parents = torch.tensor([2, 0, -1, 0]) if beam else None
        record = stats.record(step, tokens, parents)
        expected = expected_stats(x, s, tokens, parents)
        for column, name in enumerate(STATS_KEYS):
            mine, theirs = record[:, column], expected[name].to(record.dtype)
            assert torch.equal(mine.isnan(), theirs.isnan()), (step, name)
            assert torch.equal(mine.nan_to_num(0.0), theirs.nan_to_num(0.0)), f"step {step}: {name} differs"
        made.append(stats.buffers.allocations + stats.raw_allocations)
    assert made[-1] == made[1], f"tensors made per step after the first: {made}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_workspace_logsumexp_equals_torchs(dtype):
    """`workspace.logsumexp` follows ATen's own steps: equal to `torch.logsumexp`, infinities included
    (a torch whose logsumexp changed its steps fails here, before any recording differs)."""
    from transformers_offload.codecs.workspace import logsumexp

    x = (torch.randn(6, 3_001, generator=torch.Generator().manual_seed(0)) * 30).to(dtype)
    x[1, ::2] = float("-inf")
    x[2] = float("-inf")
    x[3, 7] = float("inf")
    mine, theirs = logsumexp(x, torch.empty_like(x)), torch.logsumexp(x, -1)
    assert torch.equal(mine.isnan(), theirs.isnan())
    assert torch.equal(mine.nan_to_num(0.0), theirs.nan_to_num(0.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_workspace_logsumexp_of_masked_rows_equals_torchs(dtype):
    """Rows that are mostly -inf (a masked step's scores) or far below their maximum take the path that
    keeps exp off its slow path for them: still equal to `torch.logsumexp`, NaN, +inf and all -inf rows
    included, with and without a row whose maximum is +inf (which takes the plain path)."""
    from transformers_offload.codecs import workspace

    generator = torch.Generator().manual_seed(1)
    x = torch.full((7, 4_099), float("-inf"))
    x[0, :50] = torch.randn(50, generator=generator) * 3
    x[1, 10], x[1, 11] = float("nan"), 5.0
    x[3, :100] = torch.linspace(-800, 0, 100)  # results down to denormals and below
    x[4, 7] = -0.0
    x[5, ::3] = torch.randn(1_367, generator=generator) * 40
    x = x.to(dtype)
    assert workspace._mostly_underflow(x - x.amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0))
    for rows in (x, torch.cat([x, torch.full_like(x[:1], 1.0).index_fill_(1, torch.tensor([3]), float("inf"))])):
        mine, theirs = workspace.logsumexp(rows, torch.empty_like(rows)), torch.logsumexp(rows, -1)
        assert torch.equal(mine.isnan(), theirs.isnan())
        assert torch.equal(mine.nan_to_num(0.0), theirs.nan_to_num(0.0))
