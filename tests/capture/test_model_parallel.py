"""Model parallel: a model spread by `device_map` over several devices (accelerate's hooks move each
layer's weights, or its inputs, where they run). Logits, scores, each layer's attentions and hidden
states and the prompt logprobs are copied from the device they are on, and equal Hugging Face's. On a
CPU machine the split is between host memory and disk offload; the CUDA case needs two GPUs."""

from __future__ import annotations

import pytest
import torch

from transformers_offload import Recorder, open_recording

from ..helpers import HF_LOGITS_EXACT, assert_steps_equal, attention, left_padded_batch, make_tiny

STREAMS = ("logits", "scores", "attentions", "hidden_states")


def _split(tmp_path, first, second):
    """The tiny Llama with its layer 1, final norm and head on `second`, the rest on `first`."""
    from transformers import AutoModelForCausalLM

    tiny = make_tiny("llama", attn_implementation="eager")
    tiny.save_pretrained(tmp_path / "model")
    device_map = {f"model.{name}": first for name, _ in tiny.model.named_children() if name != "layers"}
    device_map.update({"model.layers.0": first, "model.layers.1": second, "model.norm": second, "lm_head": second})
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map, **attention("eager"),
                                                 offload_folder=str(tmp_path / "offload"), local_files_only=True)
    return model.eval()


def _check(model, batch, tmp_path, **kwargs):
    torch.manual_seed(0)
    reference = model.generate(**batch, max_new_tokens=5, return_dict_in_generate=True, output_scores=True,
                               output_attentions=True, output_hidden_states=True,
                               **({"output_logits": True} if HF_LOGITS_EXACT else {}), **kwargs)
    with Recorder(model, streams=STREAMS, spill_dir=tmp_path / "run", prompt_logprobs=2) as rec:
        torch.manual_seed(0)
        sequences = model.generate(**batch, logits_processor=[rec], max_new_tokens=5, **kwargs)
    run = open_recording(tmp_path / "run")
    assert torch.equal(sequences.cpu(), reference.sequences.cpu())
    if HF_LOGITS_EXACT:  # (before 4.40, out.logits is not the raw logits, or absent)
        assert_steps_equal(run.logits(), tuple(t.cpu() for t in reference.logits), "logits")
    assert_steps_equal(run.scores(), tuple(t.cpu() for t in reference.scores), "scores")
    for kind in ("attentions", "hidden_states"):
        for step, (mine, theirs) in enumerate(zip(getattr(run, kind)(), getattr(reference, kind))):
            assert all(torch.equal(a, b.cpu()) for a, b in zip(mine, theirs)), f"{kind}[{step}]"
    assert run.generation().prompt_tensors()["prompt_logprobs"].shape == (3, batch["input_ids"].shape[1] - 1)
    return run


@pytest.mark.parametrize("kwargs", [dict(), dict(num_beams=2)], ids=["greedy", "beam_search"])
def test_a_model_split_between_memory_and_disk_records_exactly(tmp_path, kwargs):
    pytest.importorskip("accelerate", exc_type=ImportError)
    model = _split(tmp_path, "cpu", "disk")
    assert getattr(model, "hf_device_map", {}).get("model.layers.1") == "disk"
    _check(model, left_padded_batch(), tmp_path, **kwargs)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("kwargs", [dict(), dict(do_sample=True, top_k=20), dict(num_beams=2)])
def test_a_model_split_over_two_gpus_records_each_layer_from_its_device(tmp_path, kwargs):
    model = _split(tmp_path, 0, 1)
    batch = {k: v.to("cuda:0") for k, v in left_padded_batch().items()}
    run = _check(model, batch, tmp_path, **kwargs)
    assert run.generation().num_steps == 5
