"""Encodings of logits and scores (`Recorder(..., encodings=...)`): `"topk:K"` keeps per row the K
largest values, their indices, the logsumexp and the mass outside them, each equal (`torch.equal`) to
its documented expression of Hugging Face's `out.logits[t]` / `out.scores[t]`."""

from __future__ import annotations

import json

import pytest
import torch

from transformers_offload import Recorder, open_recording

from ..helpers import (
    CASES,
    NEW_TOKENS,
    OTHER_MODES,
    READERS,
    SEED,
    SMALL_SHARD_BYTES,
    TRANSFORMERS,
    assert_topk_equal,
    hf_reference,
    left_padded_batch,
    missing_options,
    record_other_mode,
    resolve_eos,
)

ENCODINGS = {"logits": "topk:5", "scores": "topk:7"}


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_topk_equals_its_expressions_on_hugging_face_outputs(gpt2, case, reader, tmp_path):
    batch = left_padded_batch()
    kwargs, _ = resolve_eos(gpt2, batch, CASES[case])
    if missing_options(kwargs):
        pytest.skip(f"transformers {TRANSFORMERS} has no {missing_options(kwargs)}")
    torch.manual_seed(SEED)
    reference = hf_reference(gpt2, **batch, max_new_tokens=NEW_TOKENS, **kwargs)
    spill = reader != "memory"
    options = {"spill_dir": tmp_path / "run", "shard_bytes": SMALL_SHARD_BYTES} if spill else {}
    with Recorder(gpt2, encodings=ENCODINGS, **options) as rec:
        torch.manual_seed(SEED)
        sequences = gpt2.generate(**batch, logits_processor=[rec], max_new_tokens=NEW_TOKENS, **kwargs)
    assert torch.equal(sequences, reference.sequences), "the recorder changed the generated tokens"
    if reader == "open_recording":
        rec = open_recording(tmp_path / "run")
    assert rec.generation().encodings == ENCODINGS
    assert_topk_equal(rec.topk("logits"), reference.logits, 5)
    assert_topk_equal(rec.topk("scores"), reference.scores, 7)


@pytest.mark.filterwarnings("ignore:`num_hidden_layers` is deprecated:FutureWarning")
@pytest.mark.parametrize("case", sorted(OTHER_MODES))
def test_topk_in_every_other_mode(case, tmp_path):
    """Against a dense recording of the same call (whose equality with Hugging Face the modes' own
    tests show)."""
    dense, top = record_other_mode(case, tmp_path, [{}, {"encodings": ENCODINGS}])
    assert torch.equal(top.sequences, dense.sequences)
    assert_topk_equal(top.topk("logits"), dense.logits(), 5)
    assert_topk_equal(top.topk("scores"), dense.scores(), 7)


def test_a_topk_recording_is_small_and_says_its_encoding(gpt2, tmp_path):
    with Recorder(gpt2, streams=("scores",), encodings={"scores": "topk:3"}, spill_dir=tmp_path / "run") as rec:
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=6, min_new_tokens=6)
    entry = json.loads((tmp_path / "run" / "manifest.json").read_text())["generations"][0]
    assert entry["streams"]["scores"] == {"dtype": "int32", "shape": [None], "encoding": "topk:3",
                                          "dense": {"dtype": "float32", "shape": [3, 128]}}
    described = open_recording(tmp_path / "run").describe()["generations"][0]["streams"]["scores"]
    # Per step a 20-byte header, then per row 3 float32 values, 3 one-byte ids, logsumexp and mass.
    assert described["encoding"] == "topk:3" and described["bytes"] == 6 * (20 + 4 * -(-3 * (3 * 5 + 8) // 4))


def test_full_accessors_point_to_topk(gpt2, tmp_path):
    with Recorder(gpt2, encodings={"scores": "topk:3"}, spill_dir=tmp_path / "run") as rec:
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=4)
    for source in (rec, open_recording(tmp_path / "run")):
        with pytest.raises(ValueError, match=r"'scores' was recorded as 'topk:3'.*topk\('scores'\)"):
            source.scores()
        with pytest.raises(ValueError, match=r"recorded dense.*logits\(\)"):
            source.topk("logits")
        assert len(source.logits()) == 4 and len(source.topk()) == 4
        part = source.topk(steps=slice(1, 3), rows=[2, 0], framework="np")
        assert len(part) == 2 and part[0]["values"].shape == (2, 3) and part[0]["indices"].dtype.name == "int64"
    with pytest.raises(ValueError, match="must be one of"):
        rec.topk("tokens")


@pytest.mark.parametrize(
    "encodings, error, match",
    [
        ("topk:3", TypeError, "must be a dict"),
        ({"scores": 3}, TypeError, "must be a dict"),
        ({"tokens": "topk:3"}, ValueError, "only \\('logits', 'scores'\\) can be encoded"),
        ({"attentions": "topk:3"}, ValueError, "only"),
        ({"scores": "fp8"}, ValueError,
         "the encodings are \"dense\", \"sparse\", \"native\", \"topk:K\", \"topk:K:qB\", \"topk:K\\+tail:N\" and "
         "\"sample:N@T\""),
        ({"scores": "topk:3+tail:0"}, ValueError, "N must be at least 1"),
        ({"scores": "topk:3:q4+tail:2"}, ValueError, r"topk:K\+tail:N"),
        ({"scores": "topk:3:q9"}, ValueError, "B 2 to 8 bits"),
        ({"scores": "sample:0"}, ValueError, "N must be at least 1"),
        ({"scores": "sample:4@0"}, ValueError, "T above 0"),
        ({"scores": "sample:4@-1"}, ValueError, "sample:N@T"),
        ({"scores": "Sparse"}, ValueError, "the encodings are"),
        ({"scores": "topk:0"}, ValueError, "K must be at least 1"),
        ({"scores": "topk:1e3"}, ValueError, "written in digits"),
        ({"scores": "topk:-2"}, ValueError, "topk:K"),
        ({"scores": "top-k:3"}, ValueError, "topk:K"),
        ({"scores": "topk:999999"}, ValueError, "vocabulary of 128"),
    ],
)
def test_bad_encodings_are_refused_before_generation(gpt2, encodings, error, match):
    with pytest.raises(error, match=match):
        Recorder(gpt2, encodings=encodings)


def test_an_encoding_of_a_stream_not_recorded_is_refused(gpt2):
    with pytest.raises(ValueError, match="does not record: add it to `streams`"):
        Recorder(gpt2, streams=("logits",), encodings={"scores": "topk:3"})


def test_dense_is_the_default_and_can_be_named(gpt2):
    with Recorder(gpt2, encodings={"scores": "dense"}) as rec:
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=2)
    assert rec.generation().encodings == {} and len(rec.scores()) == 2


@pytest.mark.parametrize("encoding", ["sparse", "native", "topk:5"])
def test_cpu_encodings_reuse_their_buffers_step_after_step(encoding):
    """On the host an encoding's `(rows, vocab)` work goes into buffers made at the first step (so a
    process's peak does not depend on how the C library reuses freed blocks), and every step's record
    equals the one a fresh encoder makes."""
    from transformers_offload.codecs import native as native_codec
    from transformers_offload.codecs import packed as packed_encodings
    from transformers_offload.codecs import sparse as sparse_codec

    def made_up(step: int) -> torch.Tensor:
        x = torch.randn(3, 500, generator=torch.Generator().manual_seed(step)).bfloat16().float()
        x[0, ::2] = float("-inf")  # row 0 sparse, row 1 whole, row 2 one entry
        x[2, 1:] = float("-inf")
        return x

    def encoder():
        if encoding == "sparse":
            sparse = sparse_codec.Sparse()
            return sparse.on_cpu, sparse.buffers
        if encoding == "native":
            native = native_codec.Native(torch.bfloat16)
            return native.on_cpu, native.buffers
        topk = packed_encodings.TopK(encoding)
        return topk.on_cpu, topk.buffers

    encode, buffers = encoder()
    made = []
    for step in range(4):
        x = made_up(step)
        fresh, _ = encoder()
        assert torch.equal(encode(x), fresh(x)), f"step {step}"
        made.append(buffers.allocations)
    assert made[0] > 0 and made[-1] == made[0], made
