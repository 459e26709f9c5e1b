"""Attentions and hidden states: equal to Hugging Face's `out.attentions` / `out.hidden_states` (and
an encoder-decoder model's five outputs), selected, stored without padding, and read back."""

from __future__ import annotations

import math

import pytest
import torch

from transformers_offload import Recorder, UnsupportedModeError, _compat, open_recording

from ..helpers import (
    ENCODER_DECODERS,
    TINY_MODELS,
    TRANSFORMERS,
    Boom,
    FailAtStep,
    attention,
    left_padded_batch,
    make_tiny,
    missing_options,
    skip_if_refused,
)

NEW_TOKENS = 7
LAYER_STREAMS = ("logits", "scores", "attentions", "hidden_states")
MODES = {
    "greedy": {},
    "sample": {"do_sample": True, "top_k": 20},
    "num_return_sequences": {"do_sample": True, "num_return_sequences": 2},
    "beam_search": {"num_beams": 3, "num_return_sequences": 2},
    "beam_sample": {"num_beams": 2, "do_sample": True},
}
READERS = ("memory", "spill", "open_recording")
DECODER_ONLY = ("attentions", "hidden_states")
ENCODER_DECODER = ("decoder_attentions", "cross_attentions", "decoder_hidden_states")
ENCODER = ("encoder_attentions", "encoder_hidden_states")


def _reference(model, batch, *, attentions=True, **kwargs):
    torch.manual_seed(0)
    return model.generate(**batch, **kwargs, return_dict_in_generate=True, output_attentions=attentions,
                          output_hidden_states=True, output_scores=True)


def _record(model, batch, reader, tmp_path, *, streams=LAYER_STREAMS, shard_bytes=6_000, options=None, **kwargs):
    spill = {"spill_dir": tmp_path / "run", "shard_bytes": shard_bytes} if reader != "memory" else {}
    with Recorder(model, streams=streams, **spill, **(options or {})) as rec:
        torch.manual_seed(0)
        sequences = model.generate(**batch, logits_processor=[rec], **kwargs)
    return sequences, open_recording(tmp_path / "run") if reader == "open_recording" else rec


def _assert_nested_equal(mine: tuple, theirs: tuple, what: str) -> None:
    assert len(mine) == len(theirs), f"{what}: {len(mine)} steps recorded, {len(theirs)} in HF"
    for step, (layers, reference) in enumerate(zip(mine, theirs)):
        assert len(layers) == len(reference), f"{what}[{step}]: {len(layers)} layers vs {len(reference)}"
        for layer, (a, b) in enumerate(zip(layers, reference)):
            assert a.device.type == "cpu" and a.dtype == b.dtype, f"{what}[{step}][{layer}]: {a.dtype} vs {b.dtype}"
            assert torch.equal(a, b), f"{what}[{step}][{layer}] differs from Hugging Face's"


def _skip_missing(kwargs):
    missing = missing_options(kwargs)
    if missing:
        pytest.skip(f"transformers {TRANSFORMERS} has no {missing}")


def _both(name, mode, reader, tmp_path):
    """An eager tiny model, Hugging Face's outputs of a call in `mode`, and the recording of the same call."""
    skip_if_refused(MODES[mode])
    model = make_tiny(name, attn_implementation="eager")
    batch = left_padded_batch()
    kwargs = dict(MODES[mode], max_new_tokens=NEW_TOKENS)
    reference = _reference(model, batch, **kwargs)
    sequences, rec = _record(model, batch, reader, tmp_path, **kwargs)
    assert torch.equal(sequences, reference.sequences)
    return model, reference, rec


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_decoder_only_attentions_and_hidden_states_equal_hugging_face(name, mode, reader, tmp_path):
    model, reference, rec = _both(name, mode, reader, tmp_path)
    _assert_nested_equal(rec.attentions(), reference.attentions, "attentions")
    _assert_nested_equal(rec.hidden_states(), reference.hidden_states, "hidden_states")
    assert len(rec.scores()) == len(reference.scores)
    assert all(torch.equal(a, b) for a, b in zip(rec.scores(), reference.scores))
    layers = model.config.num_hidden_layers
    assert rec.generation().layer_indices == {
        "attentions": tuple(range(layers)), "hidden_states": tuple(range(layers + 1))
    }


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("mode", ["greedy", "sample", "beam_search"])
@pytest.mark.parametrize("name", sorted(ENCODER_DECODERS))
def test_encoder_decoder_outputs_equal_hugging_face(name, mode, reader, tmp_path):
    _, reference, rec = _both(name, mode, reader, tmp_path)
    for kind in ENCODER_DECODER:
        _assert_nested_equal(getattr(rec, kind)(), getattr(reference, kind), kind)
    for kind in ENCODER:  # once per generation, one row per prompt (as generate() keeps them)
        _assert_nested_equal((getattr(rec, kind)(),), (getattr(reference, kind),), kind)
    with pytest.raises(KeyError, match="decoder_attentions"):
        rec.attentions()


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_selected_layers_come_from_their_modules_where_the_model_declares_them(name, tmp_path, record_property):
    """Where the model's class declares which module computes each output (transformers'
    `_can_record_outputs`), the recorder hooks those modules and asks the forward for nothing, so the
    model never holds every layer's weights; elsewhere it asks the forward. Either way the recording
    equals Hugging Face's (the tests above and below)."""
    model = make_tiny(name, attn_implementation="eager")
    declared = _compat.capture_points(model.base_model)
    hooked = "attentions" in declared and "hidden_states" in declared
    batch = left_padded_batch()
    reference = _reference(model, batch, max_new_tokens=3)
    asked = []
    with Recorder(model, streams=("attentions", "hidden_states"), layers=[-1], spill_dir=tmp_path / "run") as rec:
        spy = model.register_forward_pre_hook(  # after the recorder's own pre-hook: sees what it asks
            lambda module, args, kwargs: asked.append(
                {k for k in ("output_attentions", "output_hidden_states") if kwargs.get(k)}),
            with_kwargs=True,
        )
        model.generate(**batch, logits_processor=[rec], max_new_tokens=3)
        spy.remove()
    assert len(asked) == 3 and all(flags == (set() if hooked else {"output_attentions", "output_hidden_states"})
                                   for flags in asked)
    _assert_nested_equal(rec.attentions(), tuple(step[-1:] for step in reference.attentions), "attentions")
    _assert_nested_equal(rec.hidden_states(), tuple(step[-1:] for step in reference.hidden_states), "hidden_states")
    record_property("outcome", "module hooks" if hooked else "whole forward")


def test_hidden_states_need_no_eager_attention(tmp_path):
    model = make_tiny("llama")  # the release's default attention implementation (sdpa where it exists)
    batch = left_padded_batch()
    # Not asked for attentions: up to 4.57 an sdpa model would compute them with eager attention.
    reference = _reference(model, batch, attentions=False, max_new_tokens=NEW_TOKENS)
    _, rec = _record(model, batch, "spill", tmp_path, streams=("hidden_states",), max_new_tokens=NEW_TOKENS)
    _assert_nested_equal(rec.hidden_states(), reference.hidden_states, "hidden_states")
    assert "logits" not in rec.generation().streams


SELECTIONS = {
    "last_layer": {"layers": [-1]},
    "first_and_last": {"layers": [-1, 0]},
    "heads_range": {"heads": [0, 1]},
    "heads_apart": {"heads": [-1, 1]},
    "newest_position": {"newest_position_only": True},
    "everything": {"layers": [1], "heads": [2], "newest_position_only": True},
}


def _selected(reference: tuple, selection: dict, *, count: int, attention: bool, encoder: bool = False) -> tuple:
    """Hugging Face's nested outputs cut down to `selection`, as the recorder should keep them."""
    layers = sorted({i % count for i in selection.get("layers", range(count))})
    heads = sorted({i % 4 for i in selection["heads"]}) if attention and "heads" in selection else None

    def cut(tensor):
        if heads is not None:
            tensor = tensor[:, heads]
        if selection.get("newest_position_only") and not encoder:
            tensor = tensor[..., -1:, :]
        return tensor

    if encoder:
        return tuple(cut(reference[i]) for i in layers)
    return tuple(tuple(cut(step[i]) for i in layers) for step in reference)


@pytest.mark.parametrize("reader", ["memory", "open_recording"])
@pytest.mark.parametrize("mode", ["greedy", "beam_search"])
@pytest.mark.parametrize("selection", sorted(SELECTIONS))
def test_selection_keeps_the_chosen_layers_heads_and_positions(selection, mode, reader, tmp_path):
    model = make_tiny("llama", attn_implementation="eager")
    batch = left_padded_batch()
    kwargs = dict(MODES[mode], max_new_tokens=NEW_TOKENS)
    reference = _reference(model, batch, **kwargs)
    options = SELECTIONS[selection]
    _, rec = _record(model, batch, reader, tmp_path, options=options, **kwargs)
    _assert_nested_equal(rec.attentions(), _selected(reference.attentions, options, count=2, attention=True), "attentions")
    _assert_nested_equal(rec.hidden_states(), _selected(reference.hidden_states, options, count=3, attention=False),
                         "hidden_states")
    assert rec.generation().layers["newest_position_only"] is options.get("newest_position_only", False)


@pytest.mark.parametrize("selection", ["last_layer", "heads_apart", "everything"])
def test_selection_on_an_encoder_decoder_model(selection, tmp_path):
    model = make_tiny("t5", attn_implementation="eager")
    batch = left_padded_batch()
    reference = _reference(model, batch, max_new_tokens=NEW_TOKENS)
    options = SELECTIONS[selection]
    _, rec = _record(model, batch, "open_recording", tmp_path, options=options, max_new_tokens=NEW_TOKENS)
    for kind in ENCODER_DECODER:
        expected = _selected(getattr(reference, kind), options, count=3 if "hidden" in kind else 2,
                             attention="hidden" not in kind)
        _assert_nested_equal(getattr(rec, kind)(), expected, kind)
    for kind in ENCODER:
        expected = _selected(getattr(reference, kind), options, count=3 if "hidden" in kind else 2,
                             attention="hidden" not in kind, encoder=True)
        _assert_nested_equal((getattr(rec, kind)(),), (expected,), kind)


@pytest.mark.parametrize("reader", ["memory", "open_recording"])
def test_reading_parts_and_numpy(reader, tmp_path):
    model = make_tiny("gpt2", attn_implementation="eager")
    batch = left_padded_batch()
    reference = _reference(model, batch, max_new_tokens=NEW_TOKENS)
    _, rec = _record(model, batch, reader, tmp_path, max_new_tokens=NEW_TOKENS)
    part = rec.attentions(steps=slice(2, 5), rows=[2, 0], layers=[-1])
    expected = tuple((step[1][[2, 0]],) for step in reference.attentions[2:5])
    _assert_nested_equal(part, expected, "attentions part")
    (array, *_) = rec.hidden_states(steps=range(1, 2), rows=1, framework="np")[0]
    assert (array == reference.hidden_states[1][0][1].numpy()).all()


@pytest.mark.parametrize("reader", ["memory", "open_recording"])
@pytest.mark.parametrize("kind", ["attentions", "hidden_states"])
def test_layer_arrays_hold_every_position_with_its_length(kind, reader, tmp_path):
    model = make_tiny("llama", attn_implementation="eager")
    batch = left_padded_batch()
    _, rec = _record(model, batch, reader, tmp_path, max_new_tokens=NEW_TOKENS)
    nested = getattr(rec, kind)(layers=[-1])
    array = rec.layer_array(kind, -1)
    prompt = batch["input_ids"].shape[1]
    assert array.steps.tolist() == [0] * prompt + list(range(1, NEW_TOKENS))
    at = 0
    for (tensor,) in nested:
        count, width = tensor.shape[-2], tensor.shape[-1]
        assert (array.lengths[at : at + count] == width).all()
        assert torch.equal(array.values[..., at : at + count, :width], tensor)
        assert not array.values[..., at : at + count, width:].any()  # zero padding
        at += count
    assert at == array.values.shape[-2]
    if kind == "attentions":  # the causal map of the whole sequence: one more key per position
        assert array.lengths[prompt - 1 :].tolist() == list(range(prompt, prompt + NEW_TOKENS))
    numpy_array = rec.layer_array(kind, -1, rows=0, framework="np")
    assert (numpy_array.values == array.values[0].numpy()).all()
    assert numpy_array.lengths.tolist() == array.lengths.tolist()


def test_encoder_layer_array(tmp_path):
    model = make_tiny("bart", attn_implementation="eager")
    batch = left_padded_batch()
    reference = _reference(model, batch, max_new_tokens=NEW_TOKENS)
    _, rec = _record(model, batch, "open_recording", tmp_path, max_new_tokens=NEW_TOKENS)
    array = rec.layer_array("encoder_attentions", 0, rows=[1])
    assert torch.equal(array.values, reference.encoder_attentions[0][[1]])
    assert array.steps.tolist() == [0] * array.values.shape[-2]
    cross = rec.layer_array("cross_attentions", -1)
    assert cross.lengths.tolist() == [batch["input_ids"].shape[1]] * NEW_TOKENS


def test_stored_without_padding(tmp_path):
    model = make_tiny("llama", attn_implementation="eager")
    batch = left_padded_batch()
    reference = _reference(model, batch, max_new_tokens=NEW_TOKENS)
    _record(model, batch, "spill", tmp_path, max_new_tokens=NEW_TOKENS)
    run = open_recording(tmp_path / "run")
    described = run.describe()["generations"][0]
    for kind in DECODER_ONLY:
        for layer, name in enumerate(n for n in described["streams"] if n.startswith(kind + ".")):
            stream = described["streams"][name]
            assert stream["encoding"] == "ragged"
            exact = sum(step[layer].numel() * step[layer].element_size() for step in getattr(reference, kind))
            assert stream["bytes"] == exact
    shard_values = 0
    from safetensors import safe_open

    for shard in (tmp_path / "run").glob("g0000-s*.safetensors"):
        with safe_open(str(shard), framework="pt") as file:
            shard_values += sum(file.get_slice(k).get_shape()[0] for k in file.keys()
                                if k.startswith("attentions.") and not k.endswith(".shapes"))
    assert shard_values == sum(a.numel() for step in reference.attentions for a in step)
    assert described["num_shards"] > 1  # the steps are spread over shards of about `shard_bytes`


@pytest.mark.parametrize("error", [Boom("disk on fire"), KeyboardInterrupt()])
def test_a_fault_mid_run_keeps_every_earlier_step(error, tmp_path):
    model = make_tiny("llama", attn_implementation="eager")
    batch = left_padded_batch()
    reference = _reference(model, batch, max_new_tokens=NEW_TOKENS, num_beams=2)
    with Recorder(model, streams=LAYER_STREAMS, spill_dir=tmp_path / "run", shard_bytes=6_000) as rec:
        torch.manual_seed(0)
        with pytest.raises(type(error)):
            model.generate(**batch, logits_processor=[rec, FailAtStep(5, error)], max_new_tokens=NEW_TOKENS, num_beams=2)
    generation = open_recording(tmp_path / "run").generation()
    assert not generation.complete and generation.num_steps == 5
    _assert_nested_equal(generation.attentions(), reference.attentions[:5], "attentions")
    _assert_nested_equal(generation.hidden_states(), reference.hidden_states[:5], "hidden_states")


# -- errors, before any work is lost -------------------------------------------------------------------
def test_attentions_need_eager_attention():
    model = make_tiny("llama", attn_implementation="sdpa")
    with pytest.raises(ValueError, match='attn_implementation="eager"'):
        Recorder(model, streams=("attentions",))


def test_an_attention_implementation_changed_after_the_recorder_is_refused_before_generation(monkeypatch):
    model = make_tiny("gpt2", attn_implementation="eager")
    forwards = []
    model.register_forward_hook(lambda *args: forwards.append(1))
    with Recorder(model, streams=("attentions",)) as rec:
        monkeypatch.setattr(_compat, "attention_implementations", lambda model: {"sdpa"})
        with pytest.raises(ValueError, match='attn_implementation="eager"'):
            model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=3)
    assert forwards == [] and rec.generations == ()


REFUSED_MODES = {
    "prompt_lookup": {"prompt_lookup_num_tokens": 2},
    "contrastive_search": {"penalty_alpha": 0.6, "top_k": 4},
    "group_beam_search": {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 0.5},
}


@pytest.mark.parametrize("mode", sorted(REFUSED_MODES))
def test_modes_without_one_forward_per_step_are_refused(mode):
    model = make_tiny("gpt2", attn_implementation="eager")
    kwargs = REFUSED_MODES[mode]
    _skip_missing(kwargs)
    forwards = []
    model.register_forward_hook(lambda *args: forwards.append(1))
    # A mode this release's recorder refuses anyway says so first.
    refused_anyway = mode in ("contrastive_search", "group_beam_search") and mode not in _compat.SUPPORTED_MODES
    with Recorder(model, streams=("scores", "hidden_states")) as rec:
        with pytest.raises(UnsupportedModeError, match="cannot record" if refused_anyway else "hidden_states"):
            model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=3, **kwargs)
    assert forwards == [] and rec.generations == ()


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"streams": ("attentions",), "layers": "1"}, TypeError, "sequence of int"),
        ({"streams": ("attentions",), "layers": []}, ValueError, "empty"),
        ({"streams": ("attentions",), "layers": [True]}, TypeError, "sequence of int"),
        ({"streams": ("attentions",), "layers": [2]}, IndexError, "out of range"),
        ({"streams": ("hidden_states",), "layers": [-4]}, IndexError, "embeddings"),
        ({"streams": ("attentions",), "heads": [4]}, IndexError, "out of range"),
        ({"streams": ("hidden_states",), "heads": [0]}, ValueError, '"attentions" to `streams`'),
        ({"layers": [0]}, ValueError, "add"),
        ({"newest_position_only": True}, ValueError, "add"),
        ({"streams": ("attentions",), "newest_position_only": "yes"}, TypeError, "True or False"),
    ],
)
def test_bad_selection_options(options, error, match):
    model = make_tiny("llama", attn_implementation="eager")
    with pytest.raises(error, match=match):
        Recorder(model, **options)


def test_reading_what_was_not_recorded(tmp_path):
    model = make_tiny("gpt2", attn_implementation="eager")
    _, rec = _record(model, left_padded_batch(), "memory", tmp_path, options={"layers": [-1]}, max_new_tokens=3)
    with pytest.raises(KeyError, match=r"layers \[0\].*recorded: \[1\]"):
        rec.attentions(layers=[0])
    with pytest.raises(KeyError, match="no 'decoder_attentions'"):
        rec.decoder_attentions()
    with pytest.raises(ValueError, match="`kind`"):
        rec.layer_array("logits", 0)
    with Recorder(model) as plain:
        model.generate(**left_padded_batch(), logits_processor=[plain], max_new_tokens=3)
    with pytest.raises(KeyError, match='streams=\\(..., "attentions"'):
        plain.attentions()


def test_asking_generate_for_attentions_too_warns_that_they_stay_on_the_device():
    from transformers_offload import DeviceAccumulationWarning

    model = make_tiny("gpt2", attn_implementation="eager")
    with Recorder(model, streams=("scores", "attentions")) as rec:
        with pytest.warns(DeviceAccumulationWarning, match="`output_attentions`"):
            out = model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=3,
                                 return_dict_in_generate=True, output_attentions=True)
    _assert_nested_equal(rec.attentions(), out.attentions, "attentions")


def test_bytes_per_step_match_the_documented_formula(tmp_path):
    """docs/recording.md: a decode step's attentions take rows x heads x keys x itemsize bytes per layer."""
    model = make_tiny("llama", attn_implementation="eager")
    batch = left_padded_batch()
    _, rec = _record(model, batch, "memory", tmp_path, max_new_tokens=NEW_TOKENS)
    rows, prompt = batch["input_ids"].shape
    attentions = rec.attentions()
    for step in range(1, NEW_TOKENS):
        nbytes = sum(a.numel() * a.element_size() for a in attentions[step])
        assert nbytes == 2 * rows * 4 * (prompt + step) * 4
    assert sum(a.numel() for a in attentions[0]) == 2 * rows * 4 * prompt * prompt
    assert math.prod(rec.hidden_states()[3][0].shape) == rows * 32


def test_generate_keeps_none_of_them_itself():
    """The forward is asked, not generate(): its own outputs stay as the call asked for them."""
    model = make_tiny("llama", attn_implementation="eager")
    with Recorder(model, streams=("scores", "attentions", "hidden_states")) as rec:
        out = model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=4,
                             return_dict_in_generate=True)
    assert out.attentions is None and out.hidden_states is None and out.scores is None
    assert len(rec.attentions()) == 4
    assert model.generation_config.output_attentions is False  # nothing of the recorder's is left behind


@pytest.mark.parametrize("streams", [("attentions",), ("hidden_states",)])
def test_an_encoder_decoder_model_with_one_of_the_two(streams, tmp_path):
    """T5 re-packs the encoder output by position in its forward's output: the encoder's own is kept."""
    model = make_tiny("t5", attn_implementation="eager")
    batch = left_padded_batch()
    torch.manual_seed(0)
    flag = {"output_attentions": True} if streams == ("attentions",) else {"output_hidden_states": True}
    reference = model.generate(**batch, max_new_tokens=NEW_TOKENS, return_dict_in_generate=True, **flag)
    _, rec = _record(model, batch, "open_recording", tmp_path, streams=streams, max_new_tokens=NEW_TOKENS)
    kinds = ("encoder_attentions", "decoder_attentions", "cross_attentions") if streams == ("attentions",) else (
        "encoder_hidden_states", "decoder_hidden_states")
    assert set(rec.generation().layer_indices) == set(kinds)
    for kind in kinds:
        recorded, theirs = getattr(rec, kind)(), getattr(reference, kind)
        if kind in ENCODER:  # once per generation: compare as one step
            recorded, theirs = (recorded,), (theirs,)
        _assert_nested_equal(recorded, theirs, kind)


def test_given_encoder_outputs_record_the_decoder_only():
    model = make_tiny("bart", attn_implementation="eager")
    batch = left_padded_batch()
    encoder_outputs = model.get_encoder()(**batch, return_dict=True)
    with Recorder(model, streams=("attentions",)) as rec:
        model.generate(attention_mask=batch["attention_mask"], encoder_outputs=encoder_outputs,
                       max_new_tokens=3, logits_processor=[rec])
    assert set(rec.generation().layer_indices) == {"decoder_attentions", "cross_attentions"}
    with pytest.raises(KeyError, match="encoder_attentions"):
        rec.encoder_attentions()


@pytest.mark.parametrize("reader", ["memory", "open_recording"])
def test_a_call_that_fails_before_its_first_step_reads_as_empty(reader, tmp_path):
    model = make_tiny("t5", attn_implementation="eager")
    spill = {"spill_dir": tmp_path / "run"} if reader != "memory" else {}
    with Recorder(model, streams=("scores", "attentions"), **spill) as rec:
        with pytest.raises(Boom):
            model.generate(**left_padded_batch(), logits_processor=[rec, FailAtStep(0, Boom())], max_new_tokens=3)
    if reader == "open_recording":
        rec = open_recording(tmp_path / "run")
    assert rec.generation().num_steps == 0
    assert rec.decoder_attentions() == () and rec.cross_attentions(layers=[-1]) == ()
    assert rec.layer_array("decoder_attentions", -1).values.numel() == 0
    with pytest.raises(TypeError, match="`layers`"):
        rec.decoder_attentions(layers="1")


@pytest.mark.parametrize(
    "layers, error, match",
    [("1", TypeError, "`layers` must be"), ([1.0], TypeError, "`layers` must be"), ([True], TypeError, "`layers` must be"),
     ([], ValueError, "empty"), ([5], IndexError, "out of range")],
)
def test_bad_layers_when_reading(layers, error, match):
    model = make_tiny("gpt2", attn_implementation="eager")
    with Recorder(model, streams=("attentions",)) as rec:
        model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=3)
    with pytest.raises(error, match=match):
        rec.attentions(layers=layers)


def test_numpy_integers_are_indices():
    import numpy as np

    model = make_tiny("gpt2", attn_implementation="eager")
    with Recorder(model, streams=("attentions",), layers=np.array([-1]), heads=[np.int64(0)]) as rec:
        model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=3)
    assert rec.generation().layer_indices == {"attentions": (1,)}
    assert len(rec.attentions(layers=np.array([1]))[0]) == 1
    assert rec.layer_array("attentions", np.int64(-1)).values.shape[1] == 1


@pytest.mark.parametrize("mode", ["greedy", "beam_search"])
def test_a_processor_running_the_model_adds_no_step(mode, tmp_path):
    """Classifier-free guidance's processor runs the model once more per step: not a step."""
    if missing_options({"guidance_scale": 1.5}):
        pytest.skip(f"transformers {TRANSFORMERS} has no classifier-free guidance (`guidance_scale`, 4.31)")
    model = make_tiny("llama", attn_implementation="eager")
    batch = left_padded_batch()
    kwargs = dict(MODES[mode], max_new_tokens=NEW_TOKENS, guidance_scale=1.5)
    reference = _reference(model, batch, **kwargs)
    sequences, rec = _record(model, batch, "open_recording", tmp_path, **kwargs)
    assert torch.equal(sequences, reference.sequences)
    _assert_nested_equal(rec.attentions(), reference.attentions, "attentions")
    _assert_nested_equal(rec.hidden_states(), reference.hidden_states, "hidden_states")
    assert all(torch.equal(a, b) for a, b in zip(rec.scores(), reference.scores))


def test_encoder_and_decoder_with_different_head_counts(tmp_path):
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
    )
    torch.manual_seed(0)
    model = BartForConditionalGeneration._from_config(config, **attention("eager")).eval()
    batch = left_padded_batch()
    reference = _reference(model, batch, max_new_tokens=4)
    _, rec = _record(model, batch, "open_recording", tmp_path, options={"heads": [1, -1]}, max_new_tokens=4)
    assert rec.generation().layers["heads"] == {"encoder_attentions": [1, 3], "decoder_attentions": [1],
                                                "cross_attentions": [1]}
    (encoder, *_) = rec.encoder_attentions()
    assert torch.equal(encoder, reference.encoder_attentions[0][:, [1, 3]])
    assert torch.equal(rec.decoder_attentions()[2][0], reference.decoder_attentions[2][0][:, [1]])


def test_a_layer_array_of_no_steps_keeps_the_dtype_and_leading_shape():
    model = make_tiny("gpt2", attn_implementation="eager").to(torch.bfloat16)
    with Recorder(model, streams=("attentions",)) as rec:
        model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=3)
    array = rec.layer_array("attentions", 0, steps=slice(2, 2))
    assert array.values.shape == (3, 2, 0, 0) and array.values.dtype == torch.bfloat16
    assert array.lengths.shape == (0,) and array.steps.shape == (0,)
