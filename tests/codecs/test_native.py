"""The native encoding (`encodings={"logits": "native"}`), lossless: a bfloat16/float16 model's float32
logits (transformers upcasts them from 4.45) stored in the model's dtype for each step whose every value
converts back bit for bit, else as they are; read back equal (`torch.equal`) to `out.logits` /
`out.scores`, from memory and from disk."""

from __future__ import annotations

import json

import pytest
import torch

from transformers_offload import Recorder, open_recording
from transformers_offload.codecs.native import native_dense

from ..helpers import (
    HF_LOGITS_EXACT,
    OTHER_MODES,
    VOCAB,
    assert_dense_equal,
    assert_steps_equal,
    left_padded_batch,
    make_tiny,
    record_other_mode,
)

CALLS = {"greedy": dict(do_sample=False), "top_k": dict(do_sample=True, top_k=20),
         "temperature": dict(do_sample=True, temperature=0.7), "beam_search": dict(num_beams=3)}


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_native_equals_hugging_face(dtype, call, store, tmp_path):
    model = make_tiny("llama").to(dtype)
    batch = left_padded_batch()
    torch.manual_seed(0)
    reference = model.generate(**batch, max_new_tokens=5, return_dict_in_generate=True, output_scores=True,
                               pad_token_id=0, **({"output_logits": True} if HF_LOGITS_EXACT else {}), **CALLS[call])
    options = store.options()
    with Recorder(model, encodings={"logits": "native", "scores": "native"}, **options) as rec:
        torch.manual_seed(0)
        model.generate(**batch, logits_processor=[rec], max_new_tokens=5, pad_token_id=0, **CALLS[call])
    run = store.reopen(rec, verify=True)
    assert_steps_equal(run.scores(), reference.scores, "scores")
    if HF_LOGITS_EXACT:
        assert_steps_equal(run.logits(), reference.logits, "logits")
    assert run.generation().encodings == {"logits": "native", "scores": "native"}
    assert torch.equal(run.scores(rows=[0, 2])[1], reference.scores[1][[0, 2]])


@pytest.mark.filterwarnings("ignore:`num_hidden_layers` is deprecated:FutureWarning")
@pytest.mark.parametrize("case", sorted(OTHER_MODES))
def test_native_in_every_other_mode(case, tmp_path):
    """A bfloat16 model in every other mode, against a dense recording of the same call (whose equality
    with Hugging Face the modes' own tests show)."""
    dense, native = record_other_mode(case, tmp_path, [{"encodings": {"logits": "dense", "scores": "dense"}},
                                                       {"encodings": {"logits": "native", "scores": "native"}}],
                                      dtype=torch.bfloat16)
    assert torch.equal(native.sequences, dense.sequences)
    assert native.encodings == {"logits": "native", "scores": "native"}
    assert_dense_equal(native.logits(), dense.logits())
    assert_dense_equal(native.scores(), dense.scores())


def test_a_bf16_models_logits_take_half_the_bytes_and_a_temperatures_scores_do_not(tmp_path):
    model = make_tiny("llama").to(torch.bfloat16)
    with Recorder(model, encodings={"logits": "native", "scores": "native"}, spill_dir=tmp_path / "run") as rec:
        model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=4, do_sample=True,
                       temperature=0.7, pad_token_id=0)
    streams = open_recording(tmp_path / "run").describe()["generations"][0]["streams"]
    steps, rows, header = 4, 3, 4 * 4
    upcast = rec.generation().logits()[0].dtype == torch.float32  # 4.45+: float32 logits of a bf16 model
    if upcast:
        assert streams["logits"]["bytes"] == steps * (header + rows * VOCAB * 2)  # stored as bf16
    # Dividing by 0.7 gives float32 values bf16 cannot hold: those steps are stored as they are.
    assert streams["scores"]["bytes"] == steps * (header + rows * VOCAB * (4 if upcast else 2))
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    entry = manifest["generations"][0]["streams"]["logits"]
    assert entry["encoding"] == "native" and entry["dtype"] == "int32" and entry["dense"]["shape"] == [rows, VOCAB]


def test_a_damaged_native_record_is_refused():
    x = torch.randn(2, 5).to(torch.bfloat16).float()
    from transformers_offload.codecs.native import Native

    record = Native(torch.bfloat16).on_cpu(x)
    assert record[3] == 2 and torch.equal(native_dense(record), x)  # stored as bf16, read back exactly
    with pytest.raises(ValueError, match="holds 4 words, not 5"):
        native_dense(record[:-1])
    with pytest.raises(ValueError, match="header"):
        native_dense(torch.tensor([2, 5, 9, 2, 0], dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_16_bit_models_logits_are_native_by_default_and_scores_still_stored_once(dtype, tmp_path):
    from transformers_offload import _compat

    model = make_tiny("llama").to(dtype)
    batch = left_padded_batch()
    reference = model.generate(**batch, max_new_tokens=3, return_dict_in_generate=True, output_scores=True, pad_token_id=0)
    with Recorder(model, spill_dir=tmp_path / "run") as rec:
        model.generate(**batch, logits_processor=[rec], max_new_tokens=3, pad_token_id=0)
    streams = json.loads((tmp_path / "run" / "manifest.json").read_text())["generations"][0]["streams"]
    native = dtype == torch.bfloat16 and _compat.UPCASTS_LOGITS
    assert streams["logits"]["encoding"] == ("native" if native else "dense")
    assert streams["scores"]["encoding"] == "same_as_logits"  # greedy, no processor
    for run in (rec, open_recording(tmp_path / "run", verify=True)):
        assert_steps_equal(run.scores(), reference.scores, "scores")
        assert all(torch.equal(a, b) for a, b in zip(run.logits(), run.scores()))
    with Recorder(model, encodings={"logits": "dense"}) as dense:
        model.generate(**batch, logits_processor=[dense], max_new_tokens=1, pad_token_id=0)
    assert dense.generation().encodings == {}
