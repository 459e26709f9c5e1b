"""Per-token statistics (`streams=(..., "stats")`): each value equals, `torch.equal`, its documented
torch expression applied to Hugging Face's own `out.logits[t]` and `out.scores[t]` (before 4.40, where
`out.logits` is absent or not what the processors receive, to the model's forward logits that
`hf_reference` captures and the recorder's logits equal)."""

from __future__ import annotations

import json

import pytest
import torch

from transformers_offload import Recorder, open_recording

from .conftest import left_padded_batch
from .helpers import TRANSFORMERS
from .test_exactness import CASES, NEW_TOKENS, READERS, SEED, SMALL_SHARD_BYTES, _resolve_eos, hf_reference, missing_options

KEYS = ("token", "logprob_raw", "logprob_processed", "rank_raw", "rank_processed", "entropy_raw",
        "entropy_processed", "logsumexp_raw", "support_processed")


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
        assert tuple(step) == KEYS
        expected = expected_stats(reference.logits[t], reference.scores[t], tokens[t], None if parents is None else parents[t])
        for name in KEYS:
            mine, theirs = step[name], expected[name].cpu()
            assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, (t, name, mine.dtype, theirs.dtype)
            assert torch.equal(mine.isnan(), theirs.isnan()), (t, name)
            assert torch.equal(mine.nan_to_num(0.0), theirs.nan_to_num(0.0)), f"step {t}: {name} differs"


def _run(model, case, streams, spill_dir=None):
    batch = left_padded_batch()
    kwargs, _ = _resolve_eos(model, batch, CASES[case])
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


def _tokens_and_parents(rec, reference, batch, kwargs):
    if "num_beams" in kwargs:
        return rec.tokens(), rec.beam_parents()
    prompt = batch["input_ids"].shape[1]
    return tuple(reference.sequences[:, prompt + t] for t in range(len(reference.scores))), None


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_stats_equal_their_expressions_on_hugging_face_outputs(gpt2, case, reader, tmp_path):
    spill_dir = None if reader == "memory" else tmp_path / "run"
    batch, kwargs, reference, rec = _run(gpt2, case, ("logits", "scores", "stats"), spill_dir)
    if reader == "open_recording":
        rec = open_recording(spill_dir)
    tokens, parents = _tokens_and_parents(rec, reference, batch, kwargs)
    assert_stats_equal(rec.stats(), reference, tokens, parents)


@pytest.mark.parametrize("case", ["greedy", "sample_everything", "beam_return_sequences"])
def test_stats_alone_on_every_tiny_model(tiny_model, case, tmp_path):
    batch, kwargs, reference, rec = _run(tiny_model, case, ("stats",), tmp_path / "run")
    tokens, parents = _tokens_and_parents(rec, reference, batch, kwargs)
    assert_stats_equal(rec.stats(), reference, tokens, parents)
    generation = open_recording(tmp_path / "run").generation()
    assert set(generation.streams) == {"tokens", "finished", "stats"} | ({"beam_parents"} if parents else set())
    with pytest.raises(KeyError, match="logits"):
        generation.logits()


def test_stats_alone_are_36_bytes_per_row_and_step(gpt2, tmp_path):
    _, _, reference, rec = _run(gpt2, "sample_top_k_top_p", ("stats",), tmp_path / "run")
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    stream = manifest["generations"][0]["streams"]["stats"]
    rows = reference.sequences.shape[0]
    assert stream == {"dtype": "float32", "shape": [rows, 9], "encoding": "dense"}
    described = open_recording(tmp_path / "run").describe()["generations"][0]["streams"]["stats"]
    assert described["bytes"] == 36 * rows * len(reference.scores)


def test_stats_rows_steps_and_numpy(gpt2):
    _, _, _, rec = _run(gpt2, "sample_temperature", ("stats",))
    whole = rec.stats()
    part = rec.stats(steps=slice(2, 5), rows=[2, 0])
    assert len(part) == 3
    for mine, theirs in zip(part, whole[2:5]):
        for name in KEYS:
            assert torch.equal(mine[name], theirs[name][[2, 0]])
    arrays = rec.stats(framework="np", steps=range(1))[0]
    assert arrays["token"].dtype.name == "int64" and arrays["logprob_raw"].dtype.name == "float32"


def test_no_stats_recorded_says_how_to_get_them(gpt2):
    _, _, _, rec = _run(gpt2, "greedy", ("logits",))
    with pytest.raises(KeyError, match="stats"):
        rec.stats()


# Every other mode: the stats equal the expressions on the recording's own logits and scores, which
# the mode's own tests show equal to Hugging Face's.
def _other_modes() -> dict:
    from .test_assisted import CONFIGS, PROMPT, SOURCES
    from .test_modes import GROUP_BEAM, IN_LIBRARY, MODES

    cases = {}
    for source in SOURCES:
        for config in ("greedy", "sampling"):
            cases[f"assisted_{source}_{config}"] = ("llama", PROMPT, dict(CONFIGS[config][0], max_new_tokens=16), source)
    for name, kwargs in {**IN_LIBRARY, **GROUP_BEAM}.items():
        cases[name] = ("llama", None, dict(kwargs, max_new_tokens=8), None)
    for model in ("t5", "bart"):
        for mode, kwargs in MODES.items():
            cases[f"{model}_{mode}"] = (model, None, dict(kwargs, max_new_tokens=8), None)
    cases["low_memory_beam_search"] = ("gpt2", None, dict(num_beams=3, low_memory=True, max_new_tokens=6), None)
    cases["static_cache_sample"] = ("llama", None, dict(do_sample=True, top_k=20, cache_implementation="static", max_new_tokens=8), None)
    return cases


OTHER_MODES = _other_modes()


def other_mode(case: str, dtype: torch.dtype | None = None) -> tuple:
    """OTHER_MODES[`case`]'s model (cast to `dtype`, if given), batch and generate() options; skips
    where the release lacks them."""
    from .conftest import make_tiny
    from .test_assisted import _source

    name, prompt, kwargs, source = OTHER_MODES[case]
    if missing_options(kwargs):
        pytest.skip(f"transformers {TRANSFORMERS} has no {missing_options(kwargs)}")
    model = make_tiny(name)
    if dtype is not None:
        model = model.to(dtype)
    if source is not None:
        extra = _source(source)
        if missing_options(extra):
            pytest.skip(f"transformers {TRANSFORMERS} has no {missing_options(extra)}")
        kwargs = dict(kwargs, **extra)
    return model, prompt if prompt is not None else left_padded_batch(), kwargs


def record_other_mode(case: str, tmp_path, variants: list[dict], dtype: torch.dtype | None = None) -> list:
    """Run OTHER_MODES[`case`] (its model cast to `dtype`, if given) once per Recorder options in
    `variants` (each spilled, small shards) and return the generations read back with `open_recording`;
    skips where the release lacks the mode."""
    from transformers_offload import UnsupportedModeError

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


@pytest.mark.filterwarnings("ignore:`num_hidden_layers` is deprecated:FutureWarning")
@pytest.mark.parametrize("reader", ["memory", "spill"])
@pytest.mark.parametrize("case", sorted(OTHER_MODES))
def test_stats_in_every_other_mode(case, reader, tmp_path):
    from transformers_offload import UnsupportedModeError

    model, batch, kwargs = other_mode(case)
    options = {"spill_dir": tmp_path / "run", "shard_bytes": 3_000} if reader == "spill" else {}
    with Recorder(model, streams=("logits", "scores", "stats"), **options) as rec:
        torch.manual_seed(0)
        try:
            model.generate(**batch, logits_processor=[rec], **kwargs)
        except UnsupportedModeError:
            pytest.skip(f"transformers {TRANSFORMERS} does not run {case} in the library")
    if reader == "spill":
        rec = open_recording(tmp_path / "run")
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
    _, _, reference, rec = _run(gpt2, "sample_top_k_top_p", ("logits", "scores", "stats"), tmp_path / "run")
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
        for column, name in enumerate(KEYS):
            mine, theirs = record[:, column], expected[name].to(record.dtype)
            assert torch.equal(mine.isnan(), theirs.isnan()), (step, name)
            assert torch.equal(mine.nan_to_num(0.0), theirs.nan_to_num(0.0)), f"step {step}: {name} differs"
        made.append(stats.buffers.allocations + stats.raw_allocations)
    assert made[-1] == made[1], f"tensors made per step after the first: {made}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_workspace_logsumexp_equals_torchs(dtype):
    """`workspace.logsumexp` follows ATen's own steps: equal to `torch.logsumexp`, infinities included
    (a torch whose logsumexp changed its steps fails here, before any recording differs)."""
    from transformers_offload.capture.workspace import logsumexp

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
    from transformers_offload.capture import workspace

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
