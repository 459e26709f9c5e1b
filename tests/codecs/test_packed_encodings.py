"""The packed top-k and sampled encodings: `"topk:K"` (compact, what it keeps bit for bit), `"topk:K:qB"`
(lossy by choice, bounded errors) and `"sample:N@T"` (unbiased distillation targets)."""

from __future__ import annotations

import math

import pytest
import torch

from transformers_offload import Recorder, open_recording
from transformers_offload.codecs.bits import elias_fano, elias_fano_ids
from transformers_offload.codecs.packed import PackedRecord, QuantisedTopK, Sampled, TopK, row_bytes

from ..helpers import TOPK_KEYS, assert_topk_equal, left_padded_batch, make_tiny


def _bytes_per_row(record: torch.Tensor, rows: int) -> float:
    return (record.numel() * 4 - 20) / rows  # less the 20-byte header of the step


@pytest.mark.parametrize("vocab", [200, 49_152, 152_064])
@pytest.mark.parametrize("k", [20, 128])
def test_compact_topk_sizes_and_exactness(vocab, k):
    x = torch.randn(3, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
    ids = 1 if vocab <= 256 else 2 if vocab <= 65536 else 3
    for source, model_dtype, value_bytes in ((x, torch.float32, 4), (x.bfloat16().float(), torch.bfloat16, 2),
                                             (x.bfloat16(), torch.bfloat16, 2)):
        record = TopK(f"topk:{k}", model_dtype).on_cpu(source)
        assert _bytes_per_row(record, 3) == pytest.approx((value_bytes + ids) * k + 8, abs=1)
        assert (value_bytes + ids) * k + 8 <= (value_bytes + 3) * k + 16  # the bound
        columns = PackedRecord(record, f"topk:{k}").columns()
        values, indices = torch.topk(source, k)
        assert torch.equal(columns["values"], values.float()) and torch.equal(columns["indices"], indices)


def test_a_bf16_step_that_does_not_convert_back_keeps_float32():
    x = torch.randn(2, 300).bfloat16().float() / 0.7  # a temperature: not bfloat16 values any more
    record = TopK("topk:9", torch.bfloat16).on_cpu(x)
    parsed = PackedRecord(record, "topk:9")
    assert parsed.stored == torch.float32 and torch.equal(parsed.columns()["values"], torch.topk(x, 9).values)


@pytest.mark.parametrize("vocab, n", [(4, 3), (128, 5), (49_152, 64), (152_064, 128), (1000, 1000)])
def test_elias_fano_round_trips(vocab, n):
    ids = torch.randint(0, vocab, (3, n), generator=torch.Generator().manual_seed(n)).sort(-1).values
    ids[0, -1] = vocab - 1
    assert torch.equal(elias_fano_ids(elias_fano(ids, vocab), n, vocab), ids)


def _quantised_errors(x: torch.Tensor, encoding: str) -> tuple[torch.Tensor, dict]:
    k = int(encoding.split(":")[1])
    columns = PackedRecord(QuantisedTopK(encoding).on_cpu(x), encoding).columns()
    values, indices = torch.topk(x, k)
    exact = values - torch.logsumexp(x, -1, keepdim=True)
    # The same ids (in another order among equal codes): the error per id.
    got = torch.full_like(x, float("nan")).scatter(-1, columns["indices"], columns["logprobs"]).gather(-1, indices)
    return (got - exact).abs(), columns


@pytest.mark.parametrize("encoding", ["topk:20:q8", "topk:128:q5", "topk:128:q8", "topk:20:q4"])
def test_quantised_topk_keeps_the_ids_and_bounds_the_error(encoding):
    x = torch.randn(4, 152_064, generator=torch.Generator().manual_seed(1)) * 3
    k, bits = int(encoding.split(":")[1]), int(encoding[-1])
    errors, columns = _quantised_errors(x, encoding)
    values = torch.topk(x, k).values
    scale = (values[:, 0] - values[:, -1]) / (2**bits - 2)
    assert bool((errors <= scale[:, None] * 1.0001 + 1e-5).all())  # at most one step, half a step but near the top
    assert torch.equal(columns["indices"][:, 0], torch.topk(x, 1).indices[:, 0])  # the top token first, exact
    assert torch.equal(columns["values"][:, 0], values[:, 0])
    assert torch.equal(columns["logsumexp"], torch.logsumexp(x, -1))
    assert tuple(columns) == TOPK_KEYS
    assert row_bytes("topk:128:q5", 152_064, torch.float32) <= 300


def test_quantised_topk_keeps_minus_infinity():
    x = torch.full((2, 1000), float("-inf"))
    x[0, :3] = torch.tensor([1.0, 0.5, -2.0])
    x[1, 7] = 4.0
    columns = PackedRecord(QuantisedTopK("topk:5:q4").on_cpu(x), "topk:5:q4").columns()
    assert torch.equal(columns["values"][0, 3:], torch.full((2,), float("-inf")))
    assert torch.equal(columns["values"][1, 1:], torch.full((4,), float("-inf")))
    assert columns["indices"][1, 0] == 7 and columns["values"][1, 0] == 4.0
    assert columns["values"][0, 2] == -2.0  # the smallest finite value is exact too


@pytest.mark.parametrize("reader", ["memory", "open_recording"])
def test_packed_topk_and_samples_through_generate(gpt2, reader, tmp_path):
    encodings = {"logits": "topk:5:q6", "scores": "sample:16@0.7"}
    options = {"spill_dir": tmp_path / "run", "shard_bytes": 2000} if reader == "open_recording" else {}
    batch = left_padded_batch()
    with Recorder(gpt2) as dense:
        torch.manual_seed(0)
        reference = gpt2.generate(**batch, logits_processor=[dense], do_sample=True, top_k=30, max_new_tokens=6)
    with Recorder(gpt2, encodings=encodings, **options) as rec:
        torch.manual_seed(0)
        sequences = gpt2.generate(**batch, logits_processor=[rec], do_sample=True, top_k=30, max_new_tokens=6)
    assert torch.equal(sequences, reference), "the sampled targets changed generate()'s own draws"
    source = open_recording(tmp_path / "run") if reader == "open_recording" else rec
    assert source.generation().encodings == encodings
    for columns, scores in zip(source.sampled_targets("scores"), dense.scores()):
        assert bool((columns["counts"].sum(-1) == 16).all())
        assert torch.equal(columns["values"], scores.gather(-1, columns["indices"]))
        assert torch.equal(columns["logsumexp"], torch.logsumexp(scores.float() / 0.7, -1))
        assert bool((columns["values"] > float("-inf")).all()), "a token top_k ruled out was drawn"
    for columns, logits in zip(source.topk("logits"), dense.logits()):
        assert torch.equal(columns["indices"][:, 0], logits.argmax(-1))
    part = source.sampled_targets("scores", steps=slice(1, 3), rows=[2, 0], framework="np")
    assert len(part) == 2 and part[0]["indices"].shape == (2, 16)
    with pytest.raises(ValueError, match=r"sampled_targets\('scores'\)"):
        source.scores()
    with pytest.raises(ValueError, match="not as \"sample:N@T\""):
        source.sampled_targets("logits")


def test_the_recorder_draws_the_same_samples_for_the_same_seed(gpt2):
    runs = []
    for seed in (0, 0, 1):
        with Recorder(gpt2, encodings={"logits": "sample:8"}, encoding_seed=seed) as rec:
            gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=3)
        runs.append(torch.stack([step["indices"] for step in rec.sampled_targets("logits")]))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    with pytest.raises(TypeError, match="`encoding_seed` must be an int"):
        Recorder(gpt2, encoding_seed="1")


def test_compact_topk_of_a_bfloat16_model_is_stored_in_bfloat16(tmp_path):
    model = make_tiny("llama").to(torch.bfloat16)
    with Recorder(model, encodings={"logits": "topk:5"}, streams=("logits", "scores"), spill_dir=tmp_path / "run") as rec:
        model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=4)
    with Recorder(model) as dense:
        model.generate(**left_padded_batch(), logits_processor=[dense], max_new_tokens=4)
    assert_topk_equal(open_recording(tmp_path / "run").topk("logits"), dense.logits(), 5)
    # Per step a 20-byte header and per row 5 bfloat16 values, 5 one-byte ids, logsumexp and mass.
    described = open_recording(tmp_path / "run").describe()["generations"][0]["streams"]["logits"]
    assert described["bytes"] == 4 * (20 + 4 * -(-3 * (3 * 5 + 8) // 4))


# -- unbiasedness of the sampled targets' loss -------------------------------------------------------
def _estimate(columns: dict, student_logprobs: torch.Tensor, n: int) -> torch.Tensor:
    """The documented estimator of the cross-entropy E_p[-log q] per row."""
    return (columns["counts"] / n * -student_logprobs.gather(-1, columns["indices"])).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_the_sampled_cross_entropy_is_unbiased(temperature):
    generator = torch.Generator().manual_seed(3)
    teacher = torch.randn(4, 60, generator=generator) * 2
    student = torch.log_softmax(torch.randn(4, 60, generator=generator) * 2, -1)
    p = torch.softmax(teacher / temperature, -1)
    dense = -(p * student).sum(-1)  # the dense cross-entropy per row
    n, seeds = 8, 400
    encoding = f"sample:{n}@{temperature}"
    estimates = torch.stack([
        _estimate(PackedRecord(Sampled(encoding, {}, seed).on_cpu(teacher), encoding).columns(), student, n)
        for seed in range(seeds)
    ])
    mean, error = estimates.mean(0), estimates.std(0) / math.sqrt(seeds)
    assert bool(((mean - dense).abs() < 4 * error).all()), (mean, dense, error)
    # The forward KL too: E_p[log p - log q], with the recorded teacher log-probabilities.
    columns = PackedRecord(Sampled(encoding, {}, 0).on_cpu(teacher), encoding).columns()
    assert torch.allclose(columns["logprobs"], torch.log_softmax(teacher / temperature, -1).gather(-1, columns["indices"]),
                          atol=1e-5)


# -- top-k with a tail: the K largest and N draws from the rest ----------------------------------------
def test_topk_with_a_tail_keeps_the_k_bit_for_bit_and_draws_from_the_rest():
    x = torch.randn(4, 152_064, generator=torch.Generator().manual_seed(7)) * 3
    record = TopK("topk:32+tail:48", torch.float32, _seeded(0)).on_cpu(x)
    # 32 x (4 value bytes + 3 id bytes) + 8, then 48 Elias-Fano ids (66 + 16 bytes) and 48 float32 values.
    assert row_bytes("topk:32+tail:48", 152_064, torch.float32) == 232 + 82 + 192 == 506
    assert _bytes_per_row(record, 4) == pytest.approx(506, abs=1)
    columns = PackedRecord(record, "topk:32+tail:48").columns()
    values, indices = torch.topk(x, 32)
    assert torch.equal(columns["values"], values) and torch.equal(columns["indices"], indices)
    drawn = columns["tail_indices"]
    assert drawn.shape == (4, 48) and torch.equal(drawn, drawn.sort(-1).values)
    assert not (drawn[:, :, None] == indices[:, None, :]).any(), "a kept id was drawn"
    assert torch.equal(columns["tail_values"], x.gather(-1, drawn))
    assert torch.equal(columns["tail_logprobs"], columns["tail_values"] - columns["logsumexp"][:, None])
    again = PackedRecord(TopK("topk:32+tail:48", torch.float32, _seeded(0)).on_cpu(x), "topk:32+tail:48").columns()
    assert torch.equal(again["tail_indices"], drawn), "the same seed draws the same ids"


def test_the_tail_draws_follow_the_distribution_outside_the_k():
    # Row 0: two kept ids, then three tail ids of probabilities 1/2, 1/3, 1/6 of the tail; row 1 has no tail.
    tail = torch.tensor([1 / 2, 1 / 3, 1 / 6]).log()
    x = torch.full((2, 8), float("-inf"))
    x[0, :2] = 10.0
    x[0, [3, 5, 6]] = tail
    x[1, [0, 4]] = torch.tensor([1.0, 2.0])
    columns = PackedRecord(TopK("topk:2+tail:6000", torch.float32, _seeded(1)).on_cpu(x), "topk:2+tail:6000").columns()
    counts = torch.bincount(columns["tail_indices"][0], minlength=8).double() / 6000
    assert counts[[0, 1, 2, 4, 7]].sum() == 0
    torch.testing.assert_close(counts[[3, 5, 6]], torch.tensor([1 / 2, 1 / 3, 1 / 6], dtype=torch.float64), rtol=0, atol=0.02)
    assert columns["mass_outside"][1] == 0  # drawn uniformly, weightless: compare adds nothing for it


def test_a_bfloat16_models_top_k_and_tail_are_stored_in_bfloat16():
    x = torch.randn(3, 5000).bfloat16().float()
    record = TopK("topk:8+tail:16", torch.bfloat16, _seeded(0)).on_cpu(x)
    parsed = PackedRecord(record, "topk:8+tail:16")
    assert parsed.stored == torch.bfloat16 and parsed.row_bytes == row_bytes("topk:8+tail:16", 5000, torch.bfloat16)
    columns = parsed.columns()
    assert torch.equal(columns["values"], torch.topk(x, 8).values)
    assert torch.equal(columns["tail_values"], x.gather(-1, columns["tail_indices"]))
    narrow = x.bfloat16()  # a bfloat16 step: its tail's weights computed in float32 apart from the top-k's
    columns = PackedRecord(TopK("topk:8+tail:16", torch.bfloat16, _seeded(0)).on_cpu(narrow), "topk:8+tail:16").columns()
    assert torch.equal(columns["tail_values"], narrow.gather(-1, columns["tail_indices"]).float())
    assert not (columns["tail_indices"][:, :, None] == columns["indices"][:, None, :]).any()
    wide = x / 0.7  # no longer bfloat16 values: stored as recorded
    parsed = PackedRecord(TopK("topk:8+tail:16", torch.bfloat16, _seeded(0)).on_cpu(wide), "topk:8+tail:16")
    assert parsed.stored == torch.float32
    assert torch.equal(parsed.columns()["tail_values"], wide.gather(-1, parsed.columns()["tail_indices"]))


def test_topk_with_a_tail_through_generate_and_a_spilled_recording(gpt2, tmp_path):
    batch = left_padded_batch()
    with Recorder(gpt2) as dense:
        gpt2.generate(**batch, logits_processor=[dense], max_new_tokens=5)
    with Recorder(gpt2, encodings={"logits": "topk:5+tail:8"}, spill_dir=tmp_path / "run", shard_bytes=2000) as rec:
        gpt2.generate(**batch, logits_processor=[rec], max_new_tokens=5)
    steps = open_recording(tmp_path / "run").topk("logits")
    assert len(steps) == 5
    for columns, logits in zip(steps, dense.logits()):
        assert torch.equal(columns["values"], torch.topk(logits, 5).values)
        assert torch.equal(columns["tail_values"], logits.gather(-1, columns["tail_indices"]))
        assert not (columns["tail_indices"][:, :, None] == columns["indices"][:, None, :]).any()


def _seeded(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return lambda device: generator
