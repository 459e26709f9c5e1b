"""`kept_sets`, `sampler_logprobs` and `KeptSets.select` at rollout scale are whole-step tensor work (no loop
over rows): on recordings with every kind of row (sets of one id to most of the vocabulary, rows stored
whole, steps that keep everything, NaN and +inf scores, rows with nothing, finished rows), sparse and dense,
they equal their definitions computed row by row from `scores()`; the packed `log_softmax` equals the dense one
bit for bit over vocabularies and dtypes. None of it depends on the transformers release (no generate())."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from transformers_offload import kept_sets, open_recording, sampler_logprobs
from transformers_offload.codecs.sparse import Sparse, SparseRecord, ranges
from transformers_offload.store.header import GenerationHeader
from transformers_offload.store.spill import Spill

ROWS, STEPS, VOCAB = 24, 7, 600


def _scores(generator: torch.Generator, step: int) -> torch.Tensor:
    """One step's processed scores: every kind of row the module docstring names."""
    logits = torch.randn(ROWS, VOCAB, generator=generator) * 3
    sizes = torch.randint(1, 40, (ROWS,), generator=generator)
    sizes[1], sizes[2], sizes[3] = VOCAB, VOCAB - 5, 0  # the whole vocabulary, most of it (stored whole), nothing
    sizes[4] = VOCAB // 2 + step  # about half: stored whole or sparse by the step
    rank = torch.rand(ROWS, VOCAB, generator=generator).argsort(-1).argsort(-1)
    scores = torch.where(rank < sizes[:, None], logits, float("-inf"))
    scores[5, (rank[5] == 0).nonzero()[0]] = float("nan")  # one NaN kept entry
    scores[6, (rank[6] == 1).nonzero()[0]] = float("inf")
    return scores


def _record(root, encoding: str, seed: int):
    """A made-up sampled generation (the store driven directly), its scores recorded `encoding`."""
    generator = torch.Generator().manual_seed(seed)
    spill = Spill(root, shard_bytes=None, model_info={"class": "MadeUp", "name_or_path": "made-up",
                                                      "config_class": "MadeUpConfig", "vocab_size": VOCAB},
                  created_by={"package": "tests"})
    header = GenerationHeader(index=0, mode="sample", prompt_length=2, prompt_lengths=(2,) * ROWS, num_beams=1,
                              pad_token_id=0, eos_token_id=(1,), generation_config={"do_sample": True, "temperature": 0.5},
                              encodings={"scores": "sparse"} if encoding == "sparse" else {})
    store = spill.open_store(["scores", "tokens", "finished"], header, max_steps=STEPS)
    finished = torch.zeros(ROWS, dtype=torch.bool)
    sampled, every = [], []
    for step in range(STEPS):
        scores = _scores(generator, step)
        kept = scores != float("-inf")
        tokens = torch.where(finished, 0, (kept.float() + torch.rand(ROWS, VOCAB, generator=generator)).argmax(-1))
        store.drain(step, {"scores": Sparse().on_cpu(scores) if encoding == "sparse" else scores,
                           "tokens": tokens, "finished": finished.clone()})
        sampled.append(tokens)
        every.append(scores)
        finished = finished | (torch.arange(ROWS) % 5 == step)
    sequences = torch.cat([torch.zeros(ROWS, 2, dtype=torch.long), torch.stack(sampled, 1)], 1)
    store.finish(STEPS, replace(header, num_rows=ROWS), sequences, None, ring_waits=0)
    spill.close()
    return every


@pytest.mark.parametrize("encoding", ["sparse", "dense"])
def test_kept_sets_and_sampler_logprobs_equal_their_row_by_row_definitions(tmp_path, encoding):
    every = _record(tmp_path / "run", encoding, seed=3)
    recording = open_recording(tmp_path / "run")
    generation = recording.generation(0)
    if encoding == "sparse":  # rows stored whole and rows stored as entries both ran
        records = generation._get("scores", None, None, "pt")  # noqa: SLF001 - the stored layout
        marks = torch.cat([record[3 : 3 + ROWS] for record in records])
        assert (marks == -1).any() and (marks > 0).any()
    kept, found = kept_sets(recording, mask_only=True), sampler_logprobs(recording, raw=False)
    checked = 0
    for t, scores in enumerate(generation.scores()):
        assert torch.equal(scores.nan_to_num(), every[t].nan_to_num())
        expected = torch.log_softmax(scores.float(), -1).gather(-1, kept.tokens[:, t, None])[:, 0]
        for r in range(ROWS):
            valid = bool(kept.valid[r, t])
            finite = torch.isfinite(scores[r]).nonzero().flatten()
            full = valid and finite.numel() == VOCAB
            assert bool(kept.full[r, t]) == full
            ids = kept.ids[int(kept.offsets[r * STEPS + t]) : int(kept.offsets[r * STEPS + t + 1])]
            assert torch.equal(ids.long(), finite if valid and not full else finite[:0])
            value = expected[r] if valid else torch.tensor(0.0)
            mine = found["sampled"][r, t]
            if value.isnan():  # a row with nothing kept, or a NaN and the token outside: NaN (its sign may differ)
                assert mine.isnan()
            else:
                assert torch.equal(mine.view(torch.int32), value.view(torch.int32))
            checked += 1
    assert checked == ROWS * STEPS and int(kept.valid.sum()) < checked  # finished rows ran too
    assert bool(kept.full.any())


def test_select_equals_its_row_by_row_definition(tmp_path):
    _record(tmp_path / "run", "sparse", seed=4)
    kept = kept_sets(open_recording(tmp_path / "run"), mask_only=True)
    for rows, steps in (([5, 0, 5, 23], None), ([], 3), ([2, 7], STEPS + 2), ([9], 0)):
        part = kept.select(rows, steps)
        width = STEPS if steps is None else steps
        assert (part.rows, part.steps) == (len(rows), width)
        for i, r in enumerate(rows):
            for t in range(width):
                mine = part.ids[int(part.offsets[i * width + t]) : int(part.offsets[i * width + t + 1])]
                theirs = (kept.ids[int(kept.offsets[r * STEPS + t]) : int(kept.offsets[r * STEPS + t + 1])]
                          if t < STEPS else kept.ids[:0])
                assert torch.equal(mine, theirs)
    for rows, steps in ((None, None), ("01", None), (1, None), (torch.tensor(1), None), ([0], 2.0), ([0], True)):
        with pytest.raises(TypeError, match="must be"):
            kept.select(rows, steps)


def test_ranges_and_a_record_read_whole_or_in_part():
    starts, lengths = torch.tensor([5, 0, 9, 3, 7, 2]), torch.tensor([0, 3, 0, 2, 0, 0])
    assert ranges(starts, lengths).tolist() == [0, 1, 2, 3, 4]
    assert ranges(starts[:0], lengths[:0]).tolist() == [] and ranges(starts[:1], lengths[:1]).tolist() == []
    scores = _scores(torch.Generator().manual_seed(5), 0)
    record = SparseRecord(Sparse().on_cpu(scores))
    for rows in (range(ROWS), [4, 1, 4, 0], [], [3]):
        dense = record.dense(rows)
        assert torch.equal(dense.nan_to_num(), scores[list(rows)].nan_to_num())
        entries = record.entries(rows)
        for i, r in enumerate(rows):
            ids = entries["indices"][int(entries["offsets"][i]) : int(entries["offsets"][i + 1])]
            assert torch.equal(ids, (scores[r] != float("-inf")).nonzero().flatten())


def _random_step(generator: torch.Generator, rows: int, vocab: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's scores with kept sets of every size (none, one, a few, clustered, most, all), -inf elsewhere,
    some rows with ties, NaN or +inf, and sampled tokens mostly inside their sets."""
    logits = (torch.randn(rows, vocab, generator=generator) * 4).to(dtype)
    logits[rows // 3] = logits[rows // 3].round()  # ties
    sizes = torch.randint(0, vocab + 1, (rows,), generator=generator)
    sizes[: rows // 2] = torch.randint(0, max(2, vocab // 50), (rows // 2,), generator=generator)
    rank = torch.rand(rows, vocab, generator=generator).argsort(-1).argsort(-1)
    clustered = torch.arange(vocab)[None, :] - torch.randint(0, vocab, (rows, 1), generator=generator)
    rank[1::5] = clustered[1::5].remainder(vocab)  # sets of neighbouring ids
    scores = torch.where(rank < sizes[:, None], logits, torch.tensor(float("-inf"), dtype=dtype))
    if rows > 8:
        scores[7, 0], scores[8, vocab - 1] = float("nan"), float("inf")
    kept = torch.isfinite(scores) | scores.isnan() | (scores == float("inf"))
    chosen = torch.where(kept.any(-1), (kept.float() + 1e-3 * torch.rand(rows, vocab, generator=generator)).argmax(-1), 0)
    outside = torch.rand(rows, generator=generator) < 0.1
    return scores, torch.where(outside, torch.randint(0, vocab, (rows,), generator=generator), chosen)


@pytest.mark.parametrize("vocab", [5, 63, 64, 100, 1000, 4097, 49152])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("layout", ["packed", "dense"])  # dense: where no block reproduces this torch
def test_the_packed_log_softmax_is_the_dense_one_bit_for_bit(vocab, dtype, layout, monkeypatch):
    from transformers_offload.codecs.sparse import sparse_entries
    from transformers_offload.rl import sampler
    from transformers_offload.rl.entries import StepEntries

    assert sampler.packing_block() is not None  # this machine's torch sums as the module docstring says
    if layout == "dense":
        monkeypatch.setattr(sampler, "packing_block", lambda: None)
    generator, checked, packed_rows = torch.Generator().manual_seed(vocab), 0, 0
    for _ in range(3):
        scores, tokens = _random_step(generator, 64, vocab, dtype)
        entries = StepEntries.of(sparse_entries(scores), vocab)
        expected = torch.log_softmax(scores.float(), -1).gather(-1, tokens[:, None])[:, 0]
        mine = sampler.packed_log_softmax(entries, tokens)
        # every number and infinity bit for bit; NaN where the dense row gives NaN (a NaN's sign bit may differ)
        assert torch.equal(mine.isnan(), expected.isnan()), (vocab, dtype)
        assert torch.equal(mine.nan_to_num(0.0).view(torch.int32), expected.nan_to_num(0.0).view(torch.int32)), (vocab, dtype)
        checked += tokens.numel()
        packed_rows += int(((entries.counts > 0) & (entries.counts < vocab // 64)).sum())
    assert checked == 192 and (vocab < 4097 or packed_rows > 50)  # the packed layout ran, not only the dense one
