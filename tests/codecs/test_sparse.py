"""The lossless `"sparse"` encoding (`Recorder(..., encodings={"scores": "sparse"})`): per row only the
entries that are not -inf, computed where the tensor is; `logits()` / `scores()` give back tensors equal
(`torch.equal`) to Hugging Face's `out.logits` / `out.scores`, and `sparse()` their entries."""

from __future__ import annotations

import json
import re

import pytest
import torch

from transformers_offload import Recorder, RecordingError, _compat, open_recording
from transformers_offload.cli.summary import format_summary
from transformers_offload.codecs import sparse as _encodings
from transformers_offload.codecs.sparse import SparseRecord

from ..helpers import (
    CASES,
    NEW_TOKENS,
    OTHER_MODES,
    READERS,
    SEED,
    SMALL_SHARD_BYTES,
    TRANSFORMERS,
    assert_dense_equal,
    hf_reference,
    left_padded_batch,
    make_tiny,
    missing_options,
    record_other_mode,
    resolve_eos,
)

BOTH = {"logits": "sparse", "scores": "sparse"}
NEG_INF = float("-inf")


def assert_entries_equal(entries: tuple, reference: tuple) -> None:
    """`sparse()` scattered over -inf gives the dense step; no -inf entry is listed."""
    assert len(entries) == len(reference)
    for step, dense in zip(entries, reference):
        dense = dense.cpu().reshape(-1, dense.shape[-1])
        rebuilt = torch.full_like(dense, NEG_INF)
        offsets = step["offsets"].tolist()
        for r in range(dense.shape[0]):
            ids = step["indices"][offsets[r] : offsets[r + 1]]
            rebuilt[r, ids] = step["values"][offsets[r] : offsets[r + 1]]
            assert bool((ids[1:] > ids[:-1]).all())
        assert not bool((step["values"] == NEG_INF).any())
        assert torch.equal(rebuilt.nan_to_num(0.0), dense.nan_to_num(0.0))


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_sparse_equals_hugging_face(gpt2, case, reader, tmp_path):
    batch = left_padded_batch()
    kwargs, _ = resolve_eos(gpt2, batch, CASES[case])
    if missing_options(kwargs):
        pytest.skip(f"transformers {TRANSFORMERS} has no {missing_options(kwargs)}")
    torch.manual_seed(SEED)
    reference = hf_reference(gpt2, **batch, max_new_tokens=NEW_TOKENS, **kwargs)
    options = {"spill_dir": tmp_path / "run", "shard_bytes": SMALL_SHARD_BYTES} if reader != "memory" else {}
    with Recorder(gpt2, encodings=BOTH, **options) as rec:
        torch.manual_seed(SEED)
        sequences = gpt2.generate(**batch, logits_processor=[rec], max_new_tokens=NEW_TOKENS, **kwargs)
    assert torch.equal(sequences, reference.sequences), "the recorder changed the generated tokens"
    if reader == "open_recording":
        rec = open_recording(tmp_path / "run")
    assert rec.generation().encodings == BOTH
    assert_dense_equal(rec.logits(), reference.logits)
    assert_dense_equal(rec.scores(), reference.scores)
    assert_entries_equal(rec.sparse("scores"), reference.scores)


@pytest.mark.filterwarnings("ignore:`num_hidden_layers` is deprecated:FutureWarning")
@pytest.mark.parametrize("case", sorted(OTHER_MODES))
def test_sparse_in_every_other_mode(case, tmp_path):
    """Against a dense recording of the same call (whose equality with Hugging Face the modes' own
    tests show)."""
    dense, sparse = record_other_mode(case, tmp_path, [{}, {"encodings": BOTH}])
    assert torch.equal(sparse.sequences, dense.sequences)
    assert_dense_equal(sparse.logits(), dense.logits())
    assert_dense_equal(sparse.scores(), dense.scores())


def test_rows_over_the_capacity_are_fetched_whole_and_stay_exact(gpt2, recorded, monkeypatch):
    """With room for 3 entries per row on the device, top_p rows hold 1 to many entries: those with
    more than 3 are fetched whole (and stored sparse from there), the others come from the device part,
    in the same step."""
    monkeypatch.setattr(_encodings, "SPARSE_CAPACITY", 3)
    call = recorded(gpt2, recorder=dict(streams=("scores",), encodings={"scores": "sparse"}), spill=dict(shard_bytes=2_000),
                    **left_padded_batch(), do_sample=True, top_p=0.5, max_new_tokens=8, min_new_tokens=8)
    reference, rec = call.reference, call.recording
    assert_dense_equal(rec.scores(), reference.scores)
    assert_entries_equal(rec.sparse(), reference.scores)
    counts = [int(c) for step in reference.scores for c in (step != NEG_INF).sum(-1)]
    if not any(c > 3 for c in counts) and _compat.Version(TRANSFORMERS) < _compat.Version("4.28.0"):
        pytest.skip(f"transformers {TRANSFORMERS}'s top-p kept at most 3 entries in every row here: no row to fetch whole")
    assert any(c > 3 for c in counts) and any(c <= 3 for c in counts), counts  # both kinds of row ran
    records = rec.generation()._get("scores", None, None, "pt")  # noqa: SLF001 - the stored layout
    marks = torch.cat([record[3 : 3 + len(call.sequences)] for record in records]).tolist()
    assert marks == [-1 if 2 * c >= 128 else c for c in counts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_record_keeps_every_bit(dtype):
    """NaN, +inf, -0.0, subnormals and the extremes survive; only -inf entries are left out."""
    x = torch.full((4, 40), NEG_INF)
    x[0, [3, 7, 39]] = torch.tensor([float("nan"), float("inf"), -0.0])
    x[1, 0] = torch.finfo(dtype).tiny / 4 if dtype != torch.bfloat16 else 1e-40
    x[1, 39] = torch.finfo(dtype).max
    x[2] = torch.linspace(-3, 3, 40)  # whole: every entry finite
    x = x.to(dtype)  # row 3: all -inf
    encoder = _encodings.Sparse(capacity=8)
    flat = encoder.on_host(encoder.on_device(x), vocab=40, dtype=dtype, fetch=lambda rows: x.index_select(0, rows))
    record = SparseRecord(flat)
    assert (record.rows, record.vocab, record.dtype) == (4, 40, dtype)
    assert flat[3:7].tolist() == [3, 2, -1, 0]
    dense = record.dense(range(4))
    wide = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[dtype]
    assert torch.equal(dense.view(wide), x.view(wide))
    entries = record.entries([0, 3])
    assert entries["indices"].tolist() == [3, 7, 39] and entries["offsets"].tolist() == [0, 3, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("capacity", [1, 4, 64])
@pytest.mark.parametrize("kept", ["few", "mixed", "all"])
def test_the_cpu_record_is_the_device_and_host_parts_record(dtype, capacity, kept):
    """`on_cpu` (the ring's CPU path) makes the very record the CUDA path's two parts make."""
    generator = torch.Generator().manual_seed(capacity)
    x = torch.randn(6, 40, generator=generator).to(dtype)
    share = {"few": [0.1] * 6, "mixed": [0.05, 0.6, 1.0, 0.0, 0.3, 0.9], "all": [1.0] * 6}[kept]
    for r, p in enumerate(share):
        x[r, torch.rand(40, generator=generator) >= p] = NEG_INF
    encoder = _encodings.Sparse(capacity=capacity)
    parts = encoder.on_host(encoder.on_device(x), vocab=40, dtype=dtype, fetch=lambda rows: x.index_select(0, rows))
    assert torch.equal(encoder.on_cpu(x), parts)
    assert torch.equal(SparseRecord(parts).dense(range(6)).float().nan_to_num(), x.float().nan_to_num())


def test_a_sparse_recording_is_small_and_says_its_encoding(gpt2, tmp_path):
    with Recorder(gpt2, streams=("scores",), encodings={"scores": "sparse"}, spill_dir=tmp_path / "run") as rec:
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], do_sample=True, top_k=3, max_new_tokens=6,
                      min_new_tokens=6)
    entry = json.loads((tmp_path / "run" / "manifest.json").read_text())["generations"][0]
    assert entry["streams"]["scores"] == {"dtype": "int32", "shape": [None], "encoding": "sparse",
                                          "dense": {"dtype": "float32", "shape": [3, 128]}}
    # `inspect` shows the tensors the readers give back, and the records' own dtype in its JSON.
    summary = open_recording(tmp_path / "run").describe()
    described = summary["generations"][0]["streams"]["scores"]
    assert (described["dtype"], described["shape"], described["stored_dtype"]) == ("float32", [3, 128], "int32")
    assert re.search(r"\n  scores +float32 +sparse +\(3, 128\) ", format_summary(summary))
    described = open_recording(tmp_path / "run").describe()["generations"][0]["streams"]["scores"]
    # Per step: the header (3), 3 row counts, and 3 ids and 3 values per row.
    assert described["bytes"] == 6 * (3 + 3 + 3 * 6) * 4
    assert described["dense_bytes"] == 6 * 3 * 128 * 4


def test_a_step_whose_rows_are_finite_costs_dense_plus_a_header(gpt2, tmp_path):
    with Recorder(gpt2, encodings=BOTH, spill_dir=tmp_path / "run") as rec:
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=4, min_new_tokens=4)
    described = open_recording(tmp_path / "run").describe()["generations"][0]["streams"]
    for name in ("logits", "scores"):
        assert described[name]["bytes"] == described[name]["dense_bytes"] + 4 * (3 + 3) * 4


@pytest.mark.filterwarnings("ignore:`torch_dtype` is deprecated:FutureWarning")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sparse_in_a_half_precision_model(dtype, tmp_path):
    model = make_tiny("llama").to(dtype)
    batch = left_padded_batch()
    kwargs = dict(do_sample=True, top_k=4, max_new_tokens=6)
    torch.manual_seed(SEED)
    reference = hf_reference(model, **batch, **kwargs)
    with Recorder(model, encodings=BOTH, spill_dir=tmp_path / "run2", shard_bytes=2_000) as rec:
        torch.manual_seed(SEED)
        model.generate(**batch, logits_processor=[rec], **kwargs)
    for source in (rec, open_recording(tmp_path / "run2")):
        assert_dense_equal(source.logits(), reference.logits)
        assert_dense_equal(source.scores(), reference.scores)


def test_sparse_of_a_dense_stream_and_bad_requests(gpt2):
    with Recorder(gpt2, encodings={"scores": "sparse"}) as rec:
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], do_sample=True, top_k=2, max_new_tokens=3)
    assert_entries_equal(rec.sparse("logits"), rec.logits())  # recorded dense: computed from it
    part = rec.sparse(steps=slice(1, 3), rows=[2, 0], framework="np")
    assert len(part) == 2 and part[0]["offsets"].tolist() == [0, 2, 4] and part[0]["indices"].dtype.name == "int64"
    one = rec.scores(rows=1)
    assert one[0].shape == (128,) and torch.equal(one[0], rec.scores()[0][1])
    assert torch.equal(rec.scores(rows=[2, 0])[1], rec.scores()[1][[2, 0]])
    with pytest.raises(ValueError, match="must be one of"):
        rec.sparse("tokens")
    with pytest.raises(ValueError, match="recorded sparse, not as top-k"):
        rec.topk("scores")


def test_a_damaged_record_raises_recording_error(gpt2, tmp_path):
    from safetensors.torch import load_file, save_file

    with Recorder(gpt2, streams=("scores",), encodings={"scores": "sparse"}, spill_dir=tmp_path / "run") as rec:
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], do_sample=True, top_k=2, max_new_tokens=3)
    shard = tmp_path / "run" / "g0000-s00000.safetensors"
    tensors = load_file(shard)
    tensors["scores"][3] = 999  # a row count past the vocabulary
    save_file(tensors, shard, metadata=__import__("safetensors").safe_open(str(shard), "pt").metadata())
    with pytest.raises(RecordingError, match="scores step 0: .*damaged"):
        open_recording(tmp_path / "run").scores()


def test_sparse_of_a_float64_stream_keeps_every_bit(tmp_path):
    """float64 values take two words each (transformers 4.45+ hands float32 logits even from a float64
    model; older releases hand float64)."""
    x = torch.full((3, 50), NEG_INF, dtype=torch.float64)
    x[0, [1, 4]] = torch.tensor([1e-310, 1 / 3], dtype=torch.float64)
    x[1] = torch.linspace(-1, 1, 50, dtype=torch.float64) / 7
    encoder = _encodings.Sparse(capacity=4)
    flat = encoder.on_host(encoder.on_device(x), vocab=50, dtype=torch.float64, fetch=lambda rows: x.index_select(0, rows))
    record = SparseRecord(flat)
    assert record.dtype == torch.float64 and flat[3:6].tolist() == [2, -1, 0]
    assert torch.equal(record.dense(range(3)).view(torch.int64), x.view(torch.int64))


def test_sparse_in_a_float64_model(tmp_path):
    model = make_tiny("gpt2").double()
    kwargs = dict(do_sample=True, top_k=4, max_new_tokens=4)
    torch.manual_seed(SEED)
    try:
        reference = hf_reference(model, **left_padded_batch(), **kwargs)
    except RuntimeError as error:  # 4.42's causal mask overflows in float64 ("cannot be converted")
        pytest.skip(f"transformers {TRANSFORMERS} cannot generate with a float64 GPT-2 itself: {error}")
    with Recorder(model, encodings=BOTH, spill_dir=tmp_path / "run") as rec:
        torch.manual_seed(SEED)
        model.generate(**left_padded_batch(), logits_processor=[rec], **kwargs)
    for source in (rec, open_recording(tmp_path / "run")):
        assert_dense_equal(source.scores(), reference.scores)
        assert_dense_equal(source.logits(), reference.logits)


def test_rows_over_the_capacity_but_short_are_stored_sparse(gpt2, monkeypatch):
    """A row with more entries than the device part keeps is fetched whole, yet stored sparse when its
    entries take less room than the row: no size cliff at the capacity."""
    monkeypatch.setattr(_encodings, "SPARSE_CAPACITY", 3)
    with Recorder(gpt2, streams=("scores",), encodings={"scores": "sparse"}) as rec:
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], do_sample=True, top_k=10, max_new_tokens=3)
    for record in rec.generation()._get("scores", None, None, "pt"):  # noqa: SLF001 - the stored layout
        assert record[3:6].tolist() == [10, 10, 10] and record.numel() == 3 + 3 + 3 * 20


@pytest.mark.parametrize("where, flip, match", [(1, 1, "the manifest"), (2, 1, "the manifest"), (5, 1, "damaged")])
def test_a_flipped_record_header_or_token_id_is_refused(gpt2, tmp_path, where, flip, match):
    """The record's vocabulary and dtype must agree with the manifest's `dense`; a token id must lie in
    the vocabulary (here `where` 5: the first row's first id)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with Recorder(gpt2, streams=("scores",), encodings={"scores": "sparse"}, spill_dir=tmp_path / "run") as rec:
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], do_sample=True, top_k=2, max_new_tokens=3)
    shard = tmp_path / "run" / "g0000-s00000.safetensors"
    metadata = safe_open(str(shard), "pt").metadata()
    tensors = load_file(shard)
    tensors["scores"][6 if where == 5 else where] += 1000 * flip if where == 5 else flip
    save_file(tensors, shard, metadata=metadata)
    with pytest.raises(RecordingError, match=match):
        open_recording(tmp_path / "run").scores()


DEFAULT_CASES = {  # generate() options: whether the Recorder stores the scores sparse by default
    "top_k": (dict(do_sample=True, top_k=5), True),
    "top_p": (dict(do_sample=True, top_p=0.5), True),
    "min_p": (dict(do_sample=True, min_p=0.1), True),
    "typical_p": (dict(do_sample=True, typical_p=0.5), True),
    "epsilon": (dict(do_sample=True, top_k=0, epsilon_cutoff=0.01), True),
    "eta": (dict(do_sample=True, top_k=0, eta_cutoff=0.01), True),
    "beam_sample_top_k": (dict(do_sample=True, num_beams=2, top_k=5), True),
    "temperature_no_top_k": (dict(do_sample=True, top_k=0, temperature=0.7), False),
    "top_k_over_the_vocabulary": (dict(do_sample=True, top_k=1000), False),  # masks nothing
    "min_p_zero": (dict(do_sample=True, top_k=0, min_p=0.0), False),  # masks nothing
    "greedy_repetition_penalty": (dict(repetition_penalty=1.3), False),
}


@pytest.mark.parametrize("case", sorted(DEFAULT_CASES))
def test_sampling_through_a_masking_warper_stores_scores_sparse_by_default(gpt2, case, tmp_path):
    """With no encoding named for the scores, a CPU call that samples through top-k, top-p, min-p,
    typical, epsilon or eta stores them `"sparse"`; every other call dense (a warper that masks
    nothing too: top-k over the vocabulary, min-p 0). Which calls mask is read from what generate()
    computed (its scores hold -inf), on every release; the scores stay exact."""
    kwargs, sparse = DEFAULT_CASES[case]
    if missing_options(kwargs):
        pytest.skip(f"transformers {TRANSFORMERS} has no {missing_options(kwargs)}")
    batch = left_padded_batch()
    kwargs = dict(kwargs, max_new_tokens=6)
    torch.manual_seed(SEED)
    reference = hf_reference(gpt2, **batch, **kwargs)
    assert any(bool((step == NEG_INF).any()) for step in reference.scores) == sparse
    with Recorder(gpt2, spill_dir=tmp_path / "run") as rec:
        torch.manual_seed(SEED)
        gpt2.generate(**batch, logits_processor=[rec], **kwargs)
    run = open_recording(tmp_path / "run")
    assert run.generation().encodings.get("scores") == ("sparse" if sparse else None)
    assert_dense_equal(run.scores(), reference.scores)
    assert_dense_equal(run.logits(), reference.logits)
    if sparse:
        assert_entries_equal(run.sparse("scores"), reference.scores)


def test_scores_named_dense_stay_dense_when_a_warper_masks(gpt2):
    with Recorder(gpt2, encodings={"scores": "dense"}) as rec:
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], do_sample=True, top_k=5, max_new_tokens=3)
    assert "scores" not in rec.generation().encodings
    assert len(rec.scores()) == 3


def test_the_word_wise_nonzero_equals_nonzero():
    """`encodings._nonzero` (words of 8 mask bytes first) gives `nonzero()`'s rows and order."""
    from transformers_offload.codecs.sparse import _nonzero

    generator = torch.Generator().manual_seed(0)
    for shape in ((8, 4_096), (3, 4_099), (1, 8), (0, 16)):
        for share in (0.0, 0.001, 0.3, 1.0):
            mask = torch.rand(shape, generator=generator) < share
            assert torch.equal(_nonzero(mask), mask.nonzero())
