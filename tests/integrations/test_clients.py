"""The libraries users call `generate()` from, each checked against what the client itself returned: a
text-generation `pipeline` (batched; the recorder handed in, and `every_call=True` without it), a
`TextIteratorStreamer` with generate in a thread, accelerate's `cpu_offload` and `disk_offload`, and a
compiled forward over a static cache (`CompileConfig(fullgraph=True)`). docs/integrations.md says how
to use each. (`device_map` with disk offload: tests/capture/test_model_parallel.py; PEFT:
tests/capture/test_peft.py; processes and `datasets.map`: tests/capture/test_processes.py.)"""

from __future__ import annotations

import threading

import pytest
import torch
import transformers

from transformers_offload import Recorder

from ..helpers import (
    HAS_OUTPUT_LOGITS,
    HF_LOGITS_EXACT,
    TRANSFORMERS,
    assert_steps_equal,
    make_tiny,
    record_model,
    record_tokenizer,
)

# The reference calls ask for Hugging Face's own per-step outputs.
pytestmark = pytest.mark.filterwarnings("ignore::transformers_offload.errors.DeviceAccumulationWarning")
TEXTS = ["w3 w4", "w5 w6 w7 w8 w9", "w10"]


def _reference(model, input_ids, attention_mask, **kwargs):
    return model.generate(input_ids=input_ids, attention_mask=attention_mask, return_dict_in_generate=True,
                          output_scores=True, **({"output_logits": True} if HAS_OUTPUT_LOGITS else {}), **kwargs)


def _pipeline():
    model, tokenizer = record_model(), record_tokenizer()
    tokenizer.padding_side = "left"
    return transformers.pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu"), model


@pytest.mark.skipif(not HF_LOGITS_EXACT, reason=f"transformers {TRANSFORMERS}: out.logits is not the raw logits")
@pytest.mark.parametrize("every_call", [False, True], ids=["logits_processor", "every_call"])
def test_a_batched_text_generation_pipeline_is_recorded_exactly(every_call):
    pipe, model = _pipeline()
    with Recorder(model, every_call=every_call) as rec:
        handed = {} if every_call else {"logits_processor": [rec]}
        results = pipe(TEXTS, batch_size=2, max_new_tokens=4, do_sample=False, return_tensors=True, **handed)
    assert [g.num_rows for g in rec.generations] == [2, 1]  # two batches, as the pipeline made them
    returned = [result[0]["generated_token_ids"] for result in results]
    for generation, batch in zip(rec.generations, (returned[:2], returned[2:])):
        sequences = torch.tensor(batch)
        assert torch.equal(generation.sequences, sequences)  # what the pipeline handed back, padding included
        prompt = sequences[:, : generation.prompt_length]
        out = _reference(model, prompt, (prompt != 0).long(), max_new_tokens=4, do_sample=False)
        assert torch.equal(out.sequences, sequences)
        assert_steps_equal(rec.logits(generation=generation.index), out.logits, "logits")
        assert_steps_equal(rec.scores(generation=generation.index), out.scores, "scores")


@pytest.mark.skipif(not hasattr(transformers, "TextIteratorStreamer"), reason=f"transformers {TRANSFORMERS} has no streamers")
def test_a_streamer_in_a_thread_sees_the_recorded_tokens():
    model, tokenizer = record_model(), record_tokenizer()
    streamer = transformers.TextIteratorStreamer(tokenizer, skip_prompt=True)
    enc = tokenizer(["w3 w4 w5"], return_tensors="pt")
    with Recorder(model) as rec:
        worker = threading.Thread(target=model.generate, kwargs=dict(
            **enc, logits_processor=[rec], streamer=streamer, max_new_tokens=6, do_sample=False))
        worker.start()
        streamed = "".join(streamer)
        worker.join()
    tokens = torch.stack(rec.tokens(), dim=1)[0]
    assert streamed.split() == tokenizer.convert_ids_to_tokens(tokens.tolist())
    out = model.generate(**enc, max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True)
    assert torch.equal(out.sequences[0, enc["input_ids"].shape[1]:], tokens)
    assert_steps_equal(rec.scores(), out.scores, "scores")


@pytest.mark.parametrize("offload", ["cpu_offload", "disk_offload"])
# transformers up to 4.3x warns that the offloaded model's weights are on the meta device (accelerate's placeholder).
@pytest.mark.filterwarnings("ignore:You are calling .generate.. with the `input_ids` being on a device type:UserWarning")
def test_accelerates_offloaded_model_is_recorded_exactly(tmp_path, offload):
    accelerate = pytest.importorskip("accelerate", exc_type=ImportError)
    model = make_tiny("llama")
    if offload == "cpu_offload":
        accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    else:
        accelerate.disk_offload(model, str(tmp_path / "offload"), execution_device=torch.device("cpu"))
    ids = torch.tensor([[5, 6, 7, 8], [0, 9, 10, 11]])
    with Recorder(model) as rec:
        torch.manual_seed(0)
        model.generate(input_ids=ids, attention_mask=(ids != 0).long(), logits_processor=[rec], max_new_tokens=4,
                       do_sample=True, top_p=0.9, pad_token_id=0)
    torch.manual_seed(0)
    out = _reference(model, ids, (ids != 0).long(), max_new_tokens=4, do_sample=True, top_p=0.9, pad_token_id=0)
    assert torch.equal(rec.generations[-1].sequences, out.sequences)
    if HF_LOGITS_EXACT:
        assert_steps_equal(rec.logits(), out.logits, "logits")
    assert_steps_equal(rec.scores(), out.scores, "scores")


@pytest.mark.slow  # torch.compile on CPU: inductor compiles C++ kernels
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's own
@pytest.mark.skipif(not hasattr(transformers, "CompileConfig"), reason=f"transformers {TRANSFORMERS} has no CompileConfig")
def test_a_compiled_forward_with_a_static_cache_is_recorded_exactly():
    model = make_tiny("llama")
    ids = torch.tensor([[5, 6, 7, 8], [0, 9, 10, 11]])
    compile_config = transformers.CompileConfig(fullgraph=True)
    compile_config._compile_all_devices = True  # generate() compiles on CUDA only, else (as Hugging Face's tests do)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation="static",
                  compile_config=compile_config)
    with Recorder(model) as rec:
        model.generate(input_ids=ids, attention_mask=(ids != 0).long(), logits_processor=[rec], **kwargs)
    assert getattr(model, "_compiled_call", None) is not None  # the decoding steps ran the compiled forward
    out = _reference(model, ids, (ids != 0).long(), **kwargs)
    assert torch.equal(rec.generations[-1].sequences, out.sequences)
    assert_steps_equal(rec.logits(), out.logits, "logits")
    assert_steps_equal(rec.scores(), out.scores, "scores")
