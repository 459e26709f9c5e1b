"""rescore(): the recorded tokens replayed through a model, its logits recorded on them.

The test of the method: the same model, dtype and device give logits `torch.equal` to the recording's,
in every replayed mode, in memory and spilled; forward mode equals one plain forward of the whole
sequence; what cannot be replayed is refused before any work."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor

from transformers_offload import Recorder, _compat, open_recording
from transformers_offload.errors import RescoreError
from transformers_offload.rescoring.decode import _distinct_parents, rescore

from ..helpers import EOS, PAD, left_padded_batch, make_tiny, skip_if_refused

MODES = {
    "greedy": {"do_sample": False},
    "sample": {"do_sample": True, "top_k": 20, "temperature": 0.8, "num_return_sequences": 2},
    "beam": {"num_beams": 3, "num_return_sequences": 2},
    "beam_sample": {"num_beams": 3, "do_sample": True},
    "beam_early_stop": {"num_beams": 4, "early_stopping": True, "length_penalty": 0.5},
}


class FavourEos(LogitsProcessor):
    """Raises EOS's score from step `start` on, so that rows finish (and beams leave) mid-run."""

    def __init__(self, start: int) -> None:
        self.start = start

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[-1] >= self.start:
            scores = scores.clone()
            scores[1::2, EOS] += 30.0  # every other row
        return scores


def _record(model, kwargs, *, spill_dir=None, prompts=(3, 6, 8), steps=10, extra=(), **recorder):
    skip_if_refused(kwargs)
    torch.manual_seed(1)
    with Recorder(model, spill_dir=spill_dir, **recorder) as rec:
        model.generate(**left_padded_batch(prompts), logits_processor=[rec, *extra], max_new_tokens=steps,
                       pad_token_id=PAD, eos_token_id=EOS, **kwargs)
    return rec


def _assert_logits_equal(a, b):
    assert (a.num_steps, a.num_rows) == (b.num_steps, b.num_rows)
    for step, (x, y) in enumerate(zip(a.logits(), b.logits())):
        assert torch.equal(x, y), f"step {step}: rescored logits differ (max {float((x - y).abs().max())})"


@pytest.mark.parametrize("name", sorted(MODES))
@pytest.mark.parametrize("model_name", ["gpt2", "llama"])
def test_decode_replays_the_recorded_logits_exactly(model_name, name):
    model = make_tiny(model_name)
    rec = _record(model, MODES[name])
    original = rec.generation()
    rescored = rescore(rec, model).generation()
    _assert_logits_equal(original, rescored)
    for a, b in zip(original.tokens(), rescored.tokens()):
        assert torch.equal(a, b)
    if original.is_beam:
        for a, b in zip(original.beam_parents(), rescored.beam_parents()):
            assert torch.equal(a, b)
    assert rescored.complete


def test_a_pair_named_twice_moves_to_a_beam_holding_the_same_hypothesis():
    # Beam sampling extended the prompt's three (identical) beams by the same token: the recorder names
    # beam 0 as the parent of all three; step 1 extends two identical hypotheses (rows 0 and 1) by token 7.
    tokens = torch.tensor([[9, 9, 9], [7, 7, 5], [-1, -1, -1]])
    parents = torch.tensor([[0, 0, 0], [0, 0, 2], [-1, -1, -1]])
    distinct = _distinct_parents(tokens, parents, num_beams=3)
    assert distinct[:2].tolist() == [[0, 1, 2], [0, 1, 2]]


@pytest.mark.parametrize("name", ["greedy", "sample", "beam"])
def test_rows_that_finish_and_beams_that_leave_are_replayed(name):
    model = make_tiny("gpt2")
    rec = _record(model, MODES[name], extra=[FavourEos(start=10)], steps=12)
    original = rec.generation()
    if not original.is_beam:
        assert bool(original.finished()[-1].any()), "no row finished: the test does not test finishing"
    rescored = rescore(rec, model).generation()
    _assert_logits_equal(original, rescored)
    for a, b in zip(original.finished(), rescored.finished()):
        assert torch.equal(a, b)


def test_spilled_in_and_out_with_samples_and_encodings(tmp_path):
    model = make_tiny("llama")
    torch.manual_seed(1)
    with Recorder(model, spill_dir=tmp_path / "a") as rec:
        for ids, kwargs in ((["x", "y", "z"], MODES["greedy"]), (["u", "v", "w"], MODES["beam"])):
            rec.set_samples(ids)
            model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=6, pad_token_id=PAD,
                           eos_token_id=EOS, **kwargs)
    original = open_recording(tmp_path / "a")
    rescored = rescore(tmp_path / "a", model, tmp_path / "b")
    assert rescored.samples() == original.samples()
    for a, b in zip(original.generations, rescored.generations):
        _assert_logits_equal(a, b)
    top = rescore(original, model, tmp_path / "c", encodings={"logits": "topk:5"}, streams=("logits", "stats"))
    for a, b in zip(original.generations, top.generations):
        for x, record in zip(a.logits(), b.topk("logits")):
            assert torch.equal(x.topk(5).values, record["values"])


def test_prompt_logprobs_are_rescored():
    model = make_tiny("gpt2")
    rec = _record(model, MODES["greedy"], prompt_logprobs=2)
    rescored = rescore(rec, model)
    a, b = rec.generation().prompt_tensors(), rescored.generation().prompt_tensors()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key].nan_to_num(), b[key].nan_to_num()), key


def test_another_dtype_follows_the_tokens_and_differs_by_rounding():
    model = make_tiny("llama")
    rec = _record(model, MODES["greedy"])
    other = make_tiny("llama").to(torch.bfloat16)
    rescored = rescore(rec, other).generation()
    assert rescored.encodings == ({"logits": "native"} if _compat.UPCASTS_LOGITS else {})
    difference = max(float((a - b).abs().max()) for a, b in zip(rec.generation().logits(), rescored.logits()))
    assert 0 < difference < 1.0


def test_encoder_decoder_needs_and_takes_its_inputs():
    model = make_tiny("t5")
    batch = left_padded_batch()
    rec = _record(model, MODES["beam"])
    with pytest.raises(ValueError, match="encoder-decoder.*`inputs`"):
        rescore(rec, model)
    rescored = rescore(rec, model, inputs=[batch]).generation()
    _assert_logits_equal(rec.generation(), rescored)


def test_assisted_decoding_is_rescored_one_token_per_forward():
    skip_if_refused({"prompt_lookup_num_tokens": 1})
    model, assistant = make_tiny("llama"), make_tiny("llama", seed=3)
    torch.manual_seed(0)
    with Recorder(model) as rec:
        model.generate(**left_padded_batch((5,)), logits_processor=[rec], assistant_model=assistant,
                       max_new_tokens=10, pad_token_id=PAD, eos_token_id=EOS)
    original = rec.generation()
    rescored = rescore(rec, model).generation()
    assert rescored.mode == "greedy_search"
    for a, b in zip(original.tokens(), rescored.tokens()):
        assert torch.equal(a, b)
    # The replay's one-token forwards against one clean forward of the whole sequence: rounding only. (The
    # original's own candidate forwards are off by up to 1.0 on 4.40, Hugging Face's `out.logits` included:
    # a transformers bug that rescoring shows, docs/rescore.md.)
    with torch.no_grad():
        clean = model(original.sequences).logits[0].float()
    for step, got in enumerate(rescored.logits()):
        assert float((got[0] - clean[original.prompt_length - 1 + step]).abs().max()) < 1e-4


@pytest.mark.parametrize("chunk_size", [1, 3, 512])
def test_forward_mode_is_one_chunked_forward_of_the_sequence(chunk_size):
    if chunk_size < 512 and not _compat.CHUNKED_PADDED_FORWARD:
        pytest.skip("this release's SDPA mask fails on a multi-position forward over a cache with left padding")
    model = make_tiny("llama")
    rec = _record(model, MODES["sample"])
    original = rec.generation()
    rescored = rescore(rec, model, mode="forward", chunk_size=chunk_size).generation()
    assert rescored.complete and rescored.num_steps == original.num_steps
    # The definition: the logits at positions prompt_length - 1 + t of the forward over the sequence, with
    # generate()'s attention mask and position ids, fed chunk_size positions at a time with the KV cache.
    batch = left_padded_batch()
    mask = torch.cat([batch["attention_mask"].repeat_interleave(2, 0),
                      torch.ones(original.num_rows, original.num_steps, dtype=torch.long)], 1)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    sequences = original.sequences
    length, end = original.prompt_length, original.prompt_length + original.num_steps - 1
    with torch.no_grad():
        if chunk_size >= end:
            logits = model(input_ids=sequences[:, :end], attention_mask=mask[:, :end],
                           position_ids=positions[:, :end]).logits.float()
            for step, got in enumerate(rescored.logits()):
                assert torch.equal(got, logits[:, length - 1 + step])
    difference = max(float((a - b).abs().max()) for a, b in zip(original.logits(), rescored.logits()))
    assert difference < 1e-4  # against decode: rounding only


def test_refusals_come_before_any_work(tmp_path):
    model = make_tiny("gpt2")
    rec = _record(model, MODES["greedy"])
    with pytest.raises(ValueError, match="Processed scores"):
        rescore(rec, model, streams=("logits", "scores"))
    with pytest.raises(ValueError, match="`mode`"):
        rescore(rec, model, mode="fast")
    with pytest.raises(ValueError, match="beam search"):
        rescore(_record(model, MODES["beam"]), model, mode="forward")
    with pytest.raises(ValueError, match="vocabulary of 128"):
        from transformers import GPT2Config, GPT2LMHeadModel

        rescore(rec, GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=99)).eval())
    with pytest.raises(ValueError, match="`generations` holds 5"):
        rescore(rec, model, generations=[5])

    class Stop(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[-1] > 10:
                raise KeyboardInterrupt
            return scores

    failed = Recorder(model)
    with pytest.raises(KeyboardInterrupt):
        model.generate(**left_padded_batch(), logits_processor=[failed, Stop()], max_new_tokens=5, pad_token_id=PAD)
    with pytest.raises(ValueError, match="incomplete"):
        rescore(failed, model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_replay_that_does_not_follow_raises():
    model = make_tiny("gpt2")
    rec = _record(model, MODES["greedy"])

    original_generate = model.generate

    def generate(*args, **kwargs):  # a model whose generate() changes the choice after the forcing
        kwargs["logits_processor"] = [*kwargs["logits_processor"], _Shift()]
        return original_generate(*args, **kwargs)

    class _Shift(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores.roll(1, dims=-1)

    model.generate = generate
    with pytest.raises(RescoreError, match="other tokens than recorded at step 0"):
        rescore(rec, model)


def test_the_package_name_stays_the_function_once_every_module_is_loaded():
    # A submodule named like a public function would replace the package's lazily loaded name on import
    # (`from transformers_offload import rescore` once gave the module, after rescore_run imported it).
    import importlib
    import pkgutil
    import sys
    import types

    import transformers_offload

    for module in pkgutil.walk_packages(transformers_offload.__path__, "transformers_offload."):
        if module.name.endswith("__main__"):  # that one runs the command line
            continue
        try:
            importlib.import_module(module.name)
        except ImportError as error:  # only a module that needs an extra, which does not import here (TRL)
            assert module.name == "transformers_offload.trainers.grpo", f"{module.name}: {error}"
    loaded = set(sys.modules)
    names = [name for name in transformers_offload.__all__  # a name whose extra does not import here is no module
             if name != "RecordedGRPOTrainer" or "transformers_offload.trainers.grpo" in loaded]
    shadowed = [name for name in names if isinstance(getattr(transformers_offload, name), types.ModuleType)]
    assert shadowed == []
