"""The CUDA path: pinned host slots, copies on a side stream, no host synchronisation in the step,
exact values, flat device memory. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from transformers_offload import Recorder, open_recording
from transformers_offload.capture import capture as _capture
from transformers_offload.capture import transfer as _transfer
from transformers_offload.capture.transfer import HostRing

from ..helpers import assert_steps_equal, cuda_strict, left_padded_batch, make_tiny

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("threaded", [False, True])
def test_ring_uses_pinned_slots_and_waits_only_on_reuse(threaded):
    kept = []
    ring = HostRing(2, lambda step, tensors: kept.append((step, tensors["x"].clone())), threaded=threaded)
    for step in range(5):
        ring.put(step, "x", torch.full((4, 8), float(step), device="cuda"))
    assert all(slot.buffers["x"].is_pinned() for slot in ring._slots)
    ring.flush()
    assert [step for step, _ in kept] == list(range(5))
    assert all(torch.equal(t, torch.full((4, 8), float(s))) for s, t in kept)
    assert 0 <= ring.waits <= 5  # counted only when a copy was still in flight (3 reuses + 2 at the flush)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kwargs", [dict(), dict(do_sample=True, top_k=20), dict(num_beams=3)])
def test_recording_on_cuda_equals_hugging_face(kwargs, store, dtype, tmp_path):
    model = make_tiny("llama").to("cuda", dtype)
    batch = {k: v.to("cuda") for k, v in left_padded_batch().items()}
    torch.manual_seed(0)
    reference = model.generate(
        **batch, max_new_tokens=16, return_dict_in_generate=True, output_scores=True, output_logits=True, **kwargs
    )
    options = store.options(shard_bytes=20_000)
    with Recorder(model, **options) as rec:
        torch.manual_seed(0)
        sequences = model.generate(**batch, logits_processor=[rec], max_new_tokens=16, **kwargs)
    rec = store.reopen(rec)
    assert torch.equal(sequences, reference.sequences)
    assert_steps_equal(rec.logits(), reference.logits, "logits")
    assert_steps_equal(rec.scores(), reference.scores, "scores")


# Each encoding, and the stats, on a float32 model and (native) a bfloat16 one.
FLAT_OPTIONS = {
    "dense": (torch.float32, {}),
    "sparse scores": (torch.float32, {"encodings": {"scores": "sparse"}}),
    "topk": (torch.float32, {"encodings": {"logits": "topk:5", "scores": "topk:5"}}),
    "topk q and samples": (torch.float32, {"encodings": {"logits": "topk:5:q4", "scores": "sample:8@0.7"}}),
    "topk bf16": (torch.bfloat16, {"encodings": {"logits": "topk:5", "scores": "topk:5"}}),
    "topk and tail bf16": (torch.bfloat16, {"encodings": {"logits": "topk:5+tail:8", "scores": "topk:3+tail:4"}}),
    "stats": (torch.float32, {"streams": ("logits", "scores", "stats")}),
    "native bf16": (torch.bfloat16, {"encodings": {"logits": "native", "scores": "native"}}),
}


@pytest.mark.parametrize("flat", sorted(FLAT_OPTIONS))
@pytest.mark.parametrize("kwargs", [dict(), dict(do_sample=True, top_k=20), dict(num_beams=3)])
def test_device_memory_does_not_grow_with_steps(kwargs, store, flat, tmp_path):
    dtype, recorder_options = FLAT_OPTIONS[flat]
    model = make_tiny("llama").to("cuda", dtype)
    batch = {k: v.to("cuda") for k, v in left_padded_batch().items()}
    peaks = []
    for steps in (16, 96):
        options = store.options(tmp_path / str(steps))
        with Recorder(model, **options, **recorder_options) as rec:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            model.generate(**batch, logits_processor=[rec], max_new_tokens=steps, min_new_tokens=steps, **kwargs)
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - base)
    # The KV cache grows with steps (a few KB per step for this model); the recorder adds nothing per step.
    assert peaks[1] - peaks[0] < 512 * 1024, peaks


def test_an_in_place_edit_after_the_put_does_not_reach_the_recording():
    # The copy to the host runs on a side stream; the staging copy on the compute stream comes first.
    kept = {}
    ring = HostRing(2, lambda step, tensors: kept.update({step: tensors["x"].clone()}), threaded=True)
    sources = [torch.full((64, 50_000), float(step + 1), device="cuda") for step in range(6)]
    for step, source in enumerate(sources):
        ring.put(step, "x", source)
        source.mul_(0)
    ring.flush()
    assert all(torch.equal(kept[s], torch.full((64, 50_000), float(s + 1))) for s in range(6))


def test_the_memory_store_keeps_pageable_copies_of_the_pinned_slots():
    model = make_tiny("llama").to("cuda")
    batch = {k: v.to("cuda") for k, v in left_padded_batch().items()}
    with Recorder(model) as rec:
        model.generate(**batch, logits_processor=[rec], max_new_tokens=4)
    assert not any(step.is_pinned() for step in rec.logits() + rec.scores())


def test_sync_debug_mode_catches_a_synchronising_call():
    with pytest.raises(RuntimeError, match="synchroniz"):
        cuda_strict(lambda: torch.ones(1, device="cuda").item())()


@pytest.mark.parametrize("encodings", [None, {"logits": "topk:5", "scores": "topk:5:q4"}, {"logits": "sample:8@0.7"},
                                       {"logits": "topk:5+tail:8"}])
@pytest.mark.parametrize("kwargs", [dict(), dict(do_sample=True, top_k=20), dict(num_beams=3)])
def test_the_recorder_makes_no_synchronising_call_in_the_step_path(kwargs, store, encodings, tmp_path, monkeypatch):
    # generate() itself synchronises every step; only the recorder's own per-step code runs strict.
    for name in ("on_forward", "on_raw", "on_processed", "on_stopping"):
        monkeypatch.setattr(_capture.Capture, name, cuda_strict(getattr(_capture.Capture, name)))
    monkeypatch.setattr(_transfer.HostRing, "put", cuda_strict(_transfer.HostRing.put))
    model = make_tiny("llama").to("cuda")
    batch = {k: v.to("cuda") for k, v in left_padded_batch().items()}
    options = store.options(shard_bytes=20_000)
    with Recorder(model, encodings=encodings, **options) as rec:
        model.generate(**batch, logits_processor=[rec], max_new_tokens=24, min_new_tokens=24, **kwargs)
    assert rec.generation().num_steps == 24
    assert rec.generation().complete


def test_the_compute_stream_never_waits_for_a_host_copy(monkeypatch):
    waiting = []
    original = torch.cuda.Stream.wait_event

    def spy(stream, event):
        waiting.append(stream)
        return original(stream, event)

    monkeypatch.setattr(torch.cuda.Stream, "wait_event", spy)
    ring = HostRing(2, lambda step, tensors: None, threaded=True)
    for step in range(6):
        for name in ("logits", "finished", "scores", "tokens"):
            ring.put(step, name, torch.ones(8, 1000, device="cuda"))
    ring.flush()
    compute = torch.cuda.current_stream()
    assert waiting and not any(stream == compute for stream in waiting)  # only the side stream waits


def test_a_step_written_twice_on_cuda_keeps_the_last_value():
    kept = {}
    ring = HostRing(2, lambda step, tensors: kept.update({step: tensors["x"].clone()}), threaded=True)
    ring.put(0, "x", torch.zeros(64, 50_000, device="cuda"))
    ring.put(0, "x", torch.ones(64, 50_000, device="cuda"))
    ring.flush()
    assert torch.equal(kept[0], torch.ones(64, 50_000))


LAYER_OPTIONS = {
    "all": {},
    "heads_apart_newest": {"layers": [-1], "heads": [-1, 1], "newest_position_only": True},
}


@pytest.mark.parametrize("options", sorted(LAYER_OPTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kwargs", [dict(), dict(num_beams=3)])
def test_attentions_and_hidden_states_on_cuda_equal_hugging_face(kwargs, store, dtype, options, tmp_path):
    model = make_tiny("llama", attn_implementation="eager").to("cuda", dtype)
    batch = {k: v.to("cuda") for k, v in left_padded_batch().items()}
    torch.manual_seed(0)
    reference = model.generate(**batch, max_new_tokens=12, return_dict_in_generate=True, output_attentions=True,
                               output_hidden_states=True, **kwargs)
    spill = store.options(shard_bytes=20_000)
    selection = LAYER_OPTIONS[options]
    with Recorder(model, streams=("scores", "attentions", "hidden_states"), **spill, **selection) as rec:
        torch.manual_seed(0)
        sequences = model.generate(**batch, logits_processor=[rec], max_new_tokens=12, **kwargs)
    rec = store.reopen(rec)
    assert torch.equal(sequences, reference.sequences)
    layers = [1] if selection else [0, 1]
    heads = [1, 3] if selection else slice(None)
    for kind, entries in (("attentions", layers), ("hidden_states", [2] if selection else [0, 1, 2])):
        recorded = getattr(rec, kind)()
        assert len(recorded) == len(getattr(reference, kind))
        for step, (mine, theirs) in enumerate(zip(recorded, getattr(reference, kind))):
            for got, entry in zip(mine, entries):
                expected = theirs[entry][:, heads] if kind == "attentions" else theirs[entry]
                if selection:
                    expected = expected[..., -1:, :]
                assert got.device.type == "cpu" and not got.is_pinned()
                assert torch.equal(got, expected.cpu()), f"{kind}[{step}][{entry}]"


@pytest.mark.parametrize("options", sorted(LAYER_OPTIONS))
def test_recording_attentions_makes_no_synchronising_call_in_the_step_path(options, store, tmp_path, monkeypatch):
    for name in ("on_forward", "on_raw", "on_processed", "on_stopping", "_on_layer"):  # _on_layer: module hooks
        monkeypatch.setattr(_capture.Capture, name, cuda_strict(getattr(_capture.Capture, name)))
    monkeypatch.setattr(_transfer.HostRing, "put", cuda_strict(_transfer.HostRing.put))
    model = make_tiny("llama", attn_implementation="eager").to("cuda")
    batch = {k: v.to("cuda") for k, v in left_padded_batch().items()}
    spill = store.options(shard_bytes=20_000)
    with Recorder(model, streams=("attentions", "hidden_states"), **spill, **LAYER_OPTIONS[options]) as rec:
        model.generate(**batch, logits_processor=[rec], max_new_tokens=24, min_new_tokens=24, num_beams=2)
    assert rec.generation().num_steps == 24 and rec.generation().complete


def test_device_memory_does_not_grow_with_steps_when_recording_attentions(store, tmp_path):
    """Eager attention's own working memory grows with the keys, with or without the recorder: the
    recorder may add its ring's staging buffers, nothing per step."""
    model = make_tiny("llama", attn_implementation="eager").to("cuda")
    batch = {k: v.to("cuda") for k, v in left_padded_batch().items()}
    growth = {}
    for recorded in (False, True):
        peaks = []
        for steps in (16, 96):
            spill = store.options(tmp_path / f"{recorded}-{steps}")
            rec = Recorder(model, streams=("attentions", "hidden_states"), **spill)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            model.generate(**batch, logits_processor=[rec] if recorded else [], max_new_tokens=steps, min_new_tokens=steps)
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - base)
            rec.close()
        growth[recorded] = peaks[1] - peaks[0]
    assert growth[True] - growth[False] < 512 * 1024, growth


@pytest.mark.parametrize("selection", [{"layers": [-1]}, {"layers": [-1], "newest_position_only": True}])
def test_one_selected_layer_over_a_long_prompt_costs_the_device_at_most_twice_its_own_bytes(selection):
    """A 1,000-token prompt, the last of 8 layers of 8 heads: the device peak over stock generate() stays
    within 2 x that layer's prefill weights + 32 MiB. Asking the forward for every layer's weights, as
    the recorder did before module hooks, held all 8 layers' (256 MB) until the forward returned."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048,
                         bos_token_id=2, eos_token_id=1, pad_token_id=0)
    model = LlamaForCausalLM._from_config(config, attn_implementation="eager").eval().to("cuda")
    input_ids = torch.randint(3, 128, (1, 1000), device="cuda")
    common = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=2, min_new_tokens=2)
    layer_bytes = 8 * 1000 * 1000 * 4

    def peak(processors) -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model.generate(**common, logits_processor=processors)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    peak([])  # warm-up
    stock = peak([])
    with Recorder(model, streams=("attentions",), **selection) as rec:
        recorded = peak([rec])
    assert rec.generation().attentions()[0][0].shape[-2:] == (
        (1, 1000) if selection.get("newest_position_only") else (1000, 1000))
    assert recorded - stock <= 2 * layer_bytes + 32 * 2**20, (stock, recorded)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kwargs", [dict(), dict(do_sample=True, top_k=20), dict(num_beams=3)])
def test_stats_on_cuda_equal_their_expressions_on_the_device(kwargs, store, dtype, tmp_path):
    from ..helpers import assert_stats_equal

    model = make_tiny("llama").to("cuda", dtype)
    batch = {k: v.to("cuda") for k, v in left_padded_batch().items()}
    torch.manual_seed(0)
    reference = model.generate(
        **batch, max_new_tokens=16, return_dict_in_generate=True, output_scores=True, output_logits=True, **kwargs
    )
    options = store.options(shard_bytes=20_000)
    with Recorder(model, streams=("stats",), **options) as rec:
        torch.manual_seed(0)
        sequences = model.generate(**batch, logits_processor=[rec], max_new_tokens=16, **kwargs)
    rec = store.reopen(rec)
    assert torch.equal(sequences, reference.sequences)
    generation = rec.generation()
    prompt = batch["input_ids"].shape[1]
    if generation.is_beam:
        tokens, parents = generation.tokens(), generation.beam_parents()
    else:
        tokens, parents = tuple(sequences[:, prompt + t] for t in range(generation.num_steps)), None
    # The expressions run on the GPU, on Hugging Face's own out.logits / out.scores there.
    assert_stats_equal(rec.stats(), reference, tokens, parents)


@pytest.mark.parametrize("kwargs", [dict(), dict(do_sample=True, top_k=20), dict(num_beams=3)])
def test_recording_stats_makes_no_synchronising_call_in_the_step_path(kwargs, store, tmp_path, monkeypatch):
    for name in ("on_forward", "on_raw", "on_processed", "on_stopping"):
        monkeypatch.setattr(_capture.Capture, name, cuda_strict(getattr(_capture.Capture, name)))
    monkeypatch.setattr(_transfer.HostRing, "put", cuda_strict(_transfer.HostRing.put))
    model = make_tiny("llama").to("cuda")
    batch = {k: v.to("cuda") for k, v in left_padded_batch().items()}
    options = store.options(shard_bytes=20_000)
    with Recorder(model, streams=("logits", "stats"), **options) as rec:
        model.generate(**batch, logits_processor=[rec], max_new_tokens=24, min_new_tokens=24, **kwargs)
    assert rec.generation().num_steps == 24
    assert rec.generation().complete and len(rec.stats()) == 24



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kwargs", [dict(), dict(do_sample=True, top_k=20), dict(num_beams=3)])
def test_topk_on_cuda_equals_its_expressions_on_the_device(kwargs, store, dtype, tmp_path):
    from ..helpers import assert_topk_equal

    model = make_tiny("llama").to("cuda", dtype)
    batch = {k: v.to("cuda") for k, v in left_padded_batch().items()}
    torch.manual_seed(0)
    reference = model.generate(
        **batch, max_new_tokens=16, return_dict_in_generate=True, output_scores=True, output_logits=True, **kwargs
    )
    options = store.options(shard_bytes=20_000)
    with Recorder(model, encodings={"logits": "topk:5", "scores": "topk:7"}, **options) as rec:
        torch.manual_seed(0)
        sequences = model.generate(**batch, logits_processor=[rec], max_new_tokens=16, **kwargs)
    rec = store.reopen(rec)
    assert torch.equal(sequences, reference.sequences)
    # The expressions run on the GPU, on Hugging Face's own out.logits / out.scores there.
    assert_topk_equal(rec.topk("logits"), reference.logits, 5)
    assert_topk_equal(rec.topk("scores"), reference.scores, 7)


@pytest.mark.parametrize("capacity", [256, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kwargs", [dict(), dict(do_sample=True, top_k=20), dict(do_sample=True, top_p=0.5),
                                    dict(num_beams=3)])
def test_sparse_on_cuda_equals_hugging_face(kwargs, store, dtype, capacity, tmp_path, monkeypatch):
    """The device part on the side stream, the host part in the drainer; with room for 3 entries per
    row, rows over it are fetched whole from the staging copy."""
    from transformers_offload.codecs import sparse as _encodings

    monkeypatch.setattr(_encodings, "SPARSE_CAPACITY", capacity)
    model = make_tiny("llama").to("cuda", dtype)
    batch = {k: v.to("cuda") for k, v in left_padded_batch().items()}
    torch.manual_seed(0)
    reference = model.generate(
        **batch, max_new_tokens=16, return_dict_in_generate=True, output_scores=True, output_logits=True, **kwargs
    )
    options = store.options(shard_bytes=20_000)
    with Recorder(model, encodings={"logits": "sparse", "scores": "sparse"}, **options) as rec:
        torch.manual_seed(0)
        sequences = model.generate(**batch, logits_processor=[rec], max_new_tokens=16, **kwargs)
    rec = store.reopen(rec)
    assert torch.equal(sequences, reference.sequences)
    assert_steps_equal(rec.logits(), reference.logits, "logits")
    assert_steps_equal(rec.scores(), reference.scores, "scores")


@pytest.mark.parametrize("encoding", ["sparse", "topk:5", "native"])
@pytest.mark.parametrize("kwargs", [dict(do_sample=True, top_k=20), dict(num_beams=3)])
def test_encodings_make_no_synchronising_call_in_the_step_path(kwargs, encoding, tmp_path, monkeypatch):
    for name in ("on_forward", "on_raw", "on_processed", "on_stopping"):
        monkeypatch.setattr(_capture.Capture, name, cuda_strict(getattr(_capture.Capture, name)))
    monkeypatch.setattr(_transfer.HostRing, "put", cuda_strict(_transfer.HostRing.put))
    model = make_tiny("llama").to("cuda")
    batch = {k: v.to("cuda") for k, v in left_padded_batch().items()}
    with Recorder(model, encodings={"logits": encoding, "scores": encoding}, spill_dir=tmp_path / "run",
                  shard_bytes=20_000) as rec:
        model.generate(**batch, logits_processor=[rec], max_new_tokens=24, min_new_tokens=24, **kwargs)
    assert rec.generation().num_steps == 24
    assert len(rec.topk("scores") if encoding.startswith("topk") else rec.scores()) == 24


@pytest.mark.parametrize("kwargs", [dict(), dict(do_sample=True, top_k=20, num_return_sequences=2), dict(num_beams=3)])
def test_prompt_logprobs_on_cuda_make_no_synchronising_call_and_equal_a_plain_forward(kwargs, tmp_path, monkeypatch):
    for name in ("on_forward", "on_base_output", "on_raw", "on_processed", "on_stopping"):
        monkeypatch.setattr(_capture.Capture, name, cuda_strict(getattr(_capture.Capture, name)))
    monkeypatch.setattr(_transfer.HostRing, "put", cuda_strict(_transfer.HostRing.put))
    model = make_tiny("llama").to("cuda")
    batch = {k: v.to("cuda") for k, v in left_padded_batch().items()}
    with Recorder(model, prompt_logprobs=3, prompt_chunk=2, spill_dir=tmp_path / "run", shard_bytes=20_000) as rec:
        model.generate(**batch, logits_processor=[rec], max_new_tokens=8, min_new_tokens=8, **kwargs)
    found = open_recording(tmp_path / "run").generation().prompt_tensors()
    for prompt, (ids, mask) in enumerate(zip(batch["input_ids"], batch["attention_mask"])):
        real = ids[mask.bool()][None]
        with torch.no_grad():
            x = model(real).logits.float()[0, :-1]
        expected = torch.log_softmax(x, -1).gather(-1, real[0, 1:, None])[:, 0].cpu()
        n = expected.shape[0]
        # A forward of one prompt against the batch's prefill: on CUDA the kernels may differ by a few ulps.
        assert torch.allclose(found["prompt_logprobs"][prompt, -n:], expected, rtol=0, atol=1e-5)
        assert torch.equal(found["prompt_tokens"][prompt, -n:], real[0, 1:].cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kwargs", [dict(), dict(do_sample=True, top_k=20), dict(do_sample=True, temperature=0.7),
                                    dict(num_beams=3)])
def test_native_on_cuda_equals_hugging_face(kwargs, store, dtype, tmp_path):
    """bf16/fp16 logits stored in the model's dtype where they round-trip, float32 where they do not
    (a temperature's scores): equal to HF's float32 tensors either way."""
    model = make_tiny("llama").to("cuda", dtype)
    batch = {k: v.to("cuda") for k, v in left_padded_batch().items()}
    torch.manual_seed(0)
    reference = model.generate(
        **batch, max_new_tokens=16, return_dict_in_generate=True, output_scores=True, output_logits=True, **kwargs
    )
    options = store.options(shard_bytes=20_000)
    with Recorder(model, encodings={"logits": "native", "scores": "native"}, **options) as rec:
        torch.manual_seed(0)
        sequences = model.generate(**batch, logits_processor=[rec], max_new_tokens=16, **kwargs)
    rec = store.reopen(rec)
    assert torch.equal(sequences, reference.sequences)
    assert_steps_equal(rec.logits(), reference.logits, "logits")
    assert_steps_equal(rec.scores(), reference.scores, "scores")
