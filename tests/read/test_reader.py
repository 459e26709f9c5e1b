"""Reading recordings back: selections, laziness, the pinned format, damaged or hostile directories."""

from __future__ import annotations

import inspect
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from transformers_offload import Recorder, Recording, RecordingError, open_recording
from transformers_offload.codecs.stats import STATS_COLUMNS
from transformers_offload.read.readable import ACCESSORS, Readable

from ..helpers import (
    GOLDEN,
    ROOT,
    left_padded_batch,
    made_up_layers,
    made_up_native_logits,
    made_up_sparse_scores,
    made_up_stats,
    made_up_step,
    made_up_topk,
    write_made_up_recording,
)

GOLDEN_TINY = GOLDEN / "tiny-recording"
GOLDEN_LAYERS = GOLDEN / "tiny-layers-recording"
GOLDEN_STATS = GOLDEN / "tiny-stats-recording"
GOLDEN_TOPK = GOLDEN / "tiny-topk-recording"
GOLDEN_SPARSE = GOLDEN / "tiny-sparse-recording"
GOLDEN_NATIVE = GOLDEN / "tiny-native-recording"
ROWS, VOCAB, STEPS = 5, 16, 9


@pytest.fixture
def recording(tmp_path) -> Path:
    """A made-up recording of 9 steps in shards of 4 steps."""
    step_bytes = ROWS * VOCAB * 4 * 2 + ROWS * 9
    write_made_up_recording(tmp_path / "run", steps=STEPS, rows=ROWS, vocab=VOCAB, shard_bytes=4 * step_bytes)
    return tmp_path / "run"


def _expected(name, steps, rows):
    return [made_up_step(t, ROWS, VOCAB)[name][rows] for t in steps]


# -- the pinned format ------------------------------------------------------------------------------
def _golden_files(root: Path) -> dict[str, bytes]:
    """Every file's bytes, with what names the writing process (the manifest's and the ledger's `writer`,
    the ledger's `pid` and `host`) replaced by a placeholder: the layout is pinned, not who wrote it."""
    who = re.compile(rb'("writer": |"pid": |"host": )("[^"]*"|\d+)')
    return {path.name: who.sub(rb"\1?", path.read_bytes()) for path in sorted(root.iterdir())}


def test_the_format_is_pinned_byte_for_byte(tmp_path):
    """A change here is a format change: decide on FORMAT_VERSION (tests/golden/make.py says how), update
    docs/format.md, then run tests/golden/make.py."""
    write_made_up_recording(tmp_path / "run", steps=3, rows=2, vocab=4, shard_bytes=164)
    assert _golden_files(tmp_path / "run") == _golden_files(GOLDEN_TINY)


def test_the_ragged_layout_is_pinned_byte_for_byte(tmp_path):
    """Attentions, hidden states and encoder outputs (`"ragged"` streams, the encoder file)."""
    write_made_up_recording(tmp_path / "run", steps=3, rows=2, vocab=4, shard_bytes=164, layers=True)
    assert _golden_files(tmp_path / "run") == _golden_files(GOLDEN_LAYERS)


def test_the_stats_stream_is_pinned_byte_for_byte(tmp_path):
    """Per-token statistics: one `(rows, 9)` float32 record per step, a dense stream named `stats`."""
    write_made_up_recording(tmp_path / "run", steps=3, rows=2, vocab=4, shard_bytes=164, stats=True)
    assert _golden_files(tmp_path / "run") == _golden_files(GOLDEN_STATS)


def test_the_golden_stats_recording_reads_back():
    generation = open_recording(GOLDEN_STATS).generation()
    stats = generation.stats()
    assert len(stats) == 3
    for step, columns in enumerate(stats):
        record = made_up_stats(step, 2, 4)
        assert list(columns) == list(STATS_COLUMNS)
        for i, name in enumerate(STATS_COLUMNS):
            integer = name in ("token", "rank_raw", "rank_processed", "support_processed")
            assert columns[name].dtype == (torch.int64 if integer else torch.float32)
            assert torch.equal(columns[name], record[:, i].to(columns[name].dtype))
    assert torch.equal(stats[1]["token"], generation.tokens()[1])


def test_step_stats_is_stats_under_its_earlier_name_and_says_so():
    # One name for the per-token statistics (issue 54): `stats`, as the stream and the Recorder's accessor; the
    # earlier `Generation.step_stats` still answers, with a FutureWarning naming the new one.
    generation = open_recording(GOLDEN_STATS).generation()
    with pytest.warns(FutureWarning, match=r"`Generation.step_stats` is now `Generation.stats`"):
        earlier = generation.step_stats(steps=1, rows=[1])
    now = generation.stats(steps=1, rows=[1])
    assert len(earlier) == len(now) == 1 and list(earlier[0]) == list(now[0])
    assert all(torch.equal(earlier[0][name], now[0][name]) for name in now[0])


def test_a_recordings_accessor_takes_the_generation_after_the_methods_positional_parameters():
    # The accessors of one generation are made from Generation's methods (`readable.OF_ONE_GENERATION`): the
    # index goes after the method's own positional parameters, as it did when each was written out.
    assert list(inspect.signature(Readable.topk).parameters)[:3] == ["self", "stream", "generation"]
    assert list(inspect.signature(Readable.layer_array).parameters)[:4] == ["self", "kind", "layer", "generation"]
    assert list(inspect.signature(Readable.logits).parameters) == ["self", "generation", "steps", "rows", "framework"]
    run = open_recording(GOLDEN_STATS)
    assert torch.equal(run.stats(0, steps=2)[0]["token"], run.generation(0).stats(steps=2)[0]["token"])
    with pytest.raises(TypeError, match="got an unexpected keyword argument 'step'"):
        run.tokens(step=1)


@pytest.mark.parametrize("options, golden", [({"topk": True}, "tiny-packed-topk-recording"),
                                             ({"sampled": True}, "tiny-sampled-recording")])
def test_the_packed_encodings_are_pinned_byte_for_byte(options, golden, tmp_path):
    """`"topk:2"` logits of a bfloat16 model, `"topk:2:q4"` scores, and `"sample:3@0.5"` scores: one flat
    int32 record per step (store/packed.py has the layouts)."""
    write_made_up_recording(tmp_path / "run", steps=3, rows=2, vocab=4, shard_bytes=164, **options)
    assert _golden_files(tmp_path / "run") == _golden_files(GOLDEN / golden)


def test_the_golden_packed_recordings_read_back():
    generation = open_recording(GOLDEN / "tiny-packed-topk-recording", verify=True).generation()
    assert generation.encodings == {"logits": "topk:2", "scores": "topk:2:q4"}
    for step, columns in enumerate(generation.topk("logits")):
        values, indices = torch.topk(made_up_native_logits(step, 2, 4), 2)
        assert torch.equal(columns["values"], values) and torch.equal(columns["indices"], indices)
    for step, columns in enumerate(generation.topk("scores")):
        values, indices = torch.topk(made_up_step(step, 2, 4)["scores"], 2)
        assert torch.equal(columns["indices"], indices) and torch.equal(columns["values"][:, 0], values[:, 0])
    sampled = open_recording(GOLDEN / "tiny-sampled-recording").generation().sampled_targets()
    assert len(sampled) == 3 and all(bool((step["counts"].sum(-1) == 3).all()) for step in sampled)
    for step, columns in enumerate(sampled):
        assert torch.equal(columns["values"], made_up_step(step, 2, 4)["scores"].gather(-1, columns["indices"]))


def test_the_golden_topk_recording_reads_back():
    """A `topk:K` recording from before the packed records (frozen): float64 `(rows, 2K + 2)` per step."""
    generation = open_recording(GOLDEN_TOPK).generation()
    assert generation.encodings == {"scores": "topk:2"}
    for step, columns in enumerate(generation.topk("scores")):
        record = made_up_topk(step, 2)
        assert torch.equal(columns["values"], record[:, :2].float())
        assert torch.equal(columns["indices"], record[:, 2:4].long())
        assert torch.equal(columns["logsumexp"], record[:, 4].float())
        assert torch.equal(columns["mass_outside"], record[:, 5].float())
        assert torch.equal(columns["logprobs"], record[:, :2].float() - record[:, 4:5].float())
    with pytest.raises(ValueError, match="topk"):
        generation.scores()
    assert torch.equal(generation.logits()[2], made_up_step(2, 2, 4)["logits"])


def test_the_sparse_encoding_is_pinned_byte_for_byte(tmp_path):
    """`encodings={"scores": "sparse"}`: one flat int32 record per step (header, row counts, entries),
    stored like a ragged stream; row 0 sparse, row 1 whole."""
    write_made_up_recording(tmp_path / "run", steps=3, rows=2, vocab=4, shard_bytes=164, sparse=True)
    assert _golden_files(tmp_path / "run") == _golden_files(GOLDEN_SPARSE)


def test_the_native_encoding_and_scores_stored_once_are_pinned_byte_for_byte(tmp_path):
    """`"native"` logits (bf16 at steps 0 and 2, float32 at step 1, which bf16 cannot hold) and scores
    stored as them (`"same_as_logits"`)."""
    write_made_up_recording(tmp_path / "run", steps=3, rows=2, vocab=4, shard_bytes=164, native=True)
    assert _golden_files(tmp_path / "run") == _golden_files(GOLDEN_NATIVE)


def test_the_golden_native_recording_reads_back():
    generation = open_recording(GOLDEN_NATIVE, verify=True).generation()
    assert generation.encodings == {"logits": "native", "scores": "native"}
    for step in range(3):
        expected = made_up_native_logits(step, 2, 4)
        assert torch.equal(generation.logits()[step], expected) and torch.equal(generation.scores()[step], expected)
    records = generation.source.read("logits", range(3), None)
    assert [int(r[3]) for r in records] == [2, 0, 2]  # stored dtype codes: bf16, float32, bf16


def test_the_golden_sparse_recording_reads_back():
    generation = open_recording(GOLDEN_SPARSE).generation()
    assert generation.encodings == {"scores": "sparse"}
    scores = generation.scores()
    for step in range(3):
        assert torch.equal(scores[step], made_up_sparse_scores(step, 2, 4))
        entries = generation.sparse(steps=range(step, step + 1))[0]
        assert entries["indices"].tolist() == [step % 4, 0, 1, 2, 3] and entries["offsets"].tolist() == [0, 1, 5]
    assert torch.equal(generation.logits()[2], made_up_step(2, 2, 4)["logits"])


def test_the_golden_layers_recording_reads_back():
    generation = open_recording(GOLDEN_LAYERS).generation()
    assert generation.layer_indices == {"attentions": (1,), "hidden_states": (2,), "encoder_hidden_states": (0,)}
    for step, (attentions,) in enumerate(generation.attentions()):
        assert torch.equal(attentions, made_up_layers(step, 2)["attentions.1"])
    assert torch.equal(generation.hidden_states(layers=[-1])[2][0], made_up_layers(2, 2)["hidden_states.2"])
    (encoder,) = generation.encoder_hidden_states()
    assert torch.equal(encoder, made_up_layers(0, 2)["encoder_hidden_states.0"])
    array = generation.layer_array("attentions", 1, rows=0)
    assert array.values.shape == (2, 4, 4) and array.lengths.tolist() == [2, 2, 3, 4]


def test_the_golden_recording_reads_back():
    run = open_recording(GOLDEN_TINY)
    assert run.format_version == 1 and run.model["class"] == "MadeUpForCausalLM"
    generation = run.generation()
    assert generation.complete and generation.num_steps == 3 and generation.prompt_lengths == (2, 2)
    for name in ("logits", "scores", "tokens", "finished"):
        values = getattr(generation, name)()
        for step, value in enumerate(values):
            assert torch.equal(value, made_up_step(step, 2, 4)[name])


# -- selections ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "steps", [None, slice(2, 7), slice(3, None), slice(None, None, 2), slice(None, None, -1), range(1, 9, 3), slice(20, 30)]
)
@pytest.mark.parametrize(
    "rows, index",
    [
        (None, slice(None)),
        (3, 3),
        (np.int64(2), 2),
        (slice(1, 4), slice(1, 4)),
        (slice(None, None, -2), [4, 2, 0]),
        ([4, 0, 2], [4, 0, 2]),
        (torch.tensor([1, 1]), [1, 1]),
        ([True, False, True, False, True], [0, 2, 4]),
        ([], []),
    ],
    ids=["all", "int", "numpy-int", "slice", "reversed", "list", "tensor", "mask", "none"],
)
def test_a_selection_equals_the_same_selection_of_everything(recording, steps, rows, index):
    run = open_recording(recording)
    chosen = range(STEPS) if steps is None else (range(STEPS)[steps] if isinstance(steps, slice) else steps)
    for name in ("logits", "scores", "tokens", "finished"):
        got = getattr(run, name)(steps=steps, rows=rows)
        expected = _expected(name, chosen, index)
        assert len(got) == len(expected)
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), name


def test_numpy_selection(recording):
    run = open_recording(recording)
    arrays = run.logits(steps=slice(4, 6), rows=[0], framework="np")
    assert [a.shape for a in arrays] == [(1, VOCAB), (1, VOCAB)]
    assert (arrays[1] == made_up_step(5, ROWS, VOCAB)["logits"][[0]].numpy()).all()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"rows": 5}, IndexError, "out of range for 5 rows"),
        ({"rows": [0, 7]}, IndexError, "outside the 5 rows"),
        ({"rows": "all"}, TypeError, "`rows` must be"),
        ({"rows": [1.5]}, TypeError, "`rows` must be"),
        ({"rows": [True, False]}, IndexError, "mask must have 5 entries"),
        ({"steps": range(5, 12)}, IndexError, "outside the 9 recorded steps"),
        ({"steps": 9}, IndexError, "out of range for 9 recorded steps"),
        ({"steps": -10}, IndexError, "out of range for 9 recorded steps"),
        ({"steps": "3"}, TypeError, "`steps` must be an int, a slice or a range"),
        ({"steps": True}, TypeError, "`steps` must be an int, a slice or a range"),
        ({"framework": "tf"}, ValueError, "`framework`"),
    ],
)
def test_bad_selections(recording, kwargs, error, match):
    with pytest.raises(error, match=match):
        open_recording(recording).logits(**kwargs)


@pytest.mark.parametrize("step", [0, 3, 8, -1, -9])
def test_an_int_step_reads_that_one_step_like_an_int_row(recording, step):
    run = open_recording(recording)
    picked = run.logits(steps=step, rows=2)
    assert len(picked) == 1
    assert torch.equal(picked[0], made_up_step(step % 9, ROWS, VOCAB)["logits"][2])


def test_a_missing_stream_error_reads_as_written(recording):
    with pytest.raises(KeyError) as caught:
        open_recording(recording).generation().attentions()
    assert "\\'" not in str(caught.value) and not str(caught.value).startswith(("'", '"'))
    assert "this recording has no" in str(caught.value)


def test_the_in_memory_recorder_takes_the_same_selections(gpt2):
    with Recorder(gpt2) as rec:
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=6)
    everything = rec.scores()
    picked = rec.scores(steps=slice(1, 5, 2), rows=[2, 0])
    assert len(picked) == 2
    assert torch.equal(picked[1], everything[3][[2, 0]])
    with pytest.raises(TypeError, match="`generation` must be an int"):
        rec.scores("last")


@pytest.mark.parametrize("name", ACCESSORS)
def test_the_recorder_has_each_accessor_of_a_recording(name):
    # One accessor, written once in `Readable`: the Recorder's and a recording's are the same function,
    # with its signature and docstring (what help(Recorder) shows).
    assert getattr(Recorder, name) is getattr(Readable, name) is getattr(Recording, name)
    assert inspect.signature(getattr(Recorder, name)) == inspect.signature(getattr(Recording, name))
    assert inspect.getdoc(getattr(Recorder, name)) == inspect.getdoc(getattr(Recording, name))


def test_an_empty_recorder_says_what_to_do(gpt2):
    with Recorder(gpt2) as rec:
        assert rec.generations == () and rec._repr_html_() is None
        with pytest.raises(LookupError, match=r"recorded no generation yet: pass it to `model.generate"):
            rec.logits()
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=2)
    assert [g.index for g in rec.generations] == [0] and rec.generation() is rec.generations[0]
    assert torch.equal(rec.tokens(0)[1], rec.generation().tokens()[1])
    assert "1 generation(s)" in repr(rec)
    rec.clear()
    assert rec.generations == () and "0 generation(s)" in repr(rec)


def _resident_bytes() -> int:
    """Resident bytes of file-backed mappings (the shards), without the process's own heap noise."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads resident memory from /proc (Linux)")
def test_reading_one_row_of_one_step_reads_only_those_bytes(tmp_path):
    rows, vocab, steps = 8, 32768, 48  # 2 MiB per step, 96 MiB in all, in shards of 16 steps
    write_made_up_recording(tmp_path / "run", steps=steps, rows=rows, vocab=vocab, shard_bytes=16 * 2 * 2**20)
    run = open_recording(tmp_path / "run")
    run.logits(steps=slice(0, 1), rows=[0])  # warm up: the first read sets up allocator and mappings
    before = _resident_bytes()
    one = run.logits(steps=slice(30, 31), rows=[5])
    assert torch.equal(one[0], made_up_step(30, rows, vocab)["logits"][[5]])
    after_one = _resident_bytes()
    total = sum(float(step.sum()) for step in run.logits())  # touches every page of the stream
    after_all = _resident_bytes()
    assert total != 0
    assert after_one - before < 2 * 2**20, "reading one row of one step mapped far more than that row"
    assert after_all - before > 32 * 2**20, "reading every step should map the stream (the test is blind)"


# -- damaged and hostile recordings ------------------------------------------------------------------
def _edit_manifest(root: Path, edit) -> None:
    path = root / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def _truncate(root: Path) -> str:
    path = root / "g0000-s00001.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    return path.name


def _corrupt_header(root: Path) -> str:
    path = root / "g0000-s00000.safetensors"
    data = bytearray(path.read_bytes())
    data[8:24] = b"\xff" * 16
    path.write_bytes(bytes(data))
    return path.name


def _future_version(root: Path) -> str:
    _edit_manifest(root, lambda m: m.update(format_version=99))
    return "manifest.json"


def _shape_disagrees(root: Path) -> str:
    _edit_manifest(root, lambda m: m["generations"][0]["streams"]["logits"].update(shape=[ROWS, VOCAB + 1]))
    return "g0000-s00000.safetensors"


def _escaping_name(root: Path) -> str:
    (root.parent / "outside.safetensors").write_bytes((root / "g0000-s00000.safetensors").read_bytes())
    _edit_manifest(root, lambda m: m["generations"][0]["shards"][0].update(file="../outside.safetensors"))
    return "manifest.json"


def _absolute_name(root: Path) -> str:
    _edit_manifest(root, lambda m: m["generations"][0]["shards"][0].update(file="/etc/passwd"))
    return "manifest.json"


def _move_out_and_link(root: Path, name: str) -> str:
    """Move `name` out of the recording and leave a symbolic link to it in its place."""
    outside = root.parent / f"outside-{name}"
    shutil.move(root / name, outside)
    (root / name).symlink_to(outside)
    return "manifest.json"


def _escaping_symlink(root: Path) -> str:
    return _move_out_and_link(root, "g0000-s00000.safetensors")


def _pickle_as_shard(root: Path) -> str:
    (root / "g0000-s00000.safetensors").write_bytes(pickle.dumps({"logits": [1.0, 2.0]}))
    return "g0000-s00000.safetensors"


def _swapped_shards(root: Path) -> str:
    first, second = root / "g0000-s00000.safetensors", root / "g0000-s00001.safetensors"
    first_bytes = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(first_bytes)
    return "g0000-s00000.safetensors"


def _missing_shard(root: Path) -> str:
    (root / "g0000-s00002.safetensors").unlink()
    return "g0000-s00002.safetensors"


def _not_json(root: Path) -> str:
    (root / "manifest.json").write_text("{ this is not json")
    return "manifest.json"


def _unknown_encoding(root: Path) -> str:
    _edit_manifest(root, lambda m: m["generations"][0]["streams"]["scores"].update(encoding="topk-64"))
    return "manifest.json"


def _more_steps_than_shards(root: Path) -> str:
    _edit_manifest(root, lambda m: m["generations"][0].update(num_steps=STEPS + 5))
    return "manifest.json"


def _set(**fields):
    """Damage: set fields of generation 0 in the manifest."""

    def damage(root: Path) -> str:
        _edit_manifest(root, lambda m: m["generations"][0].update(fields))
        return "manifest.json"

    return damage


def _same_file_twice(root: Path) -> str:
    _edit_manifest(root, lambda m: m["generations"][0]["shards"][1].update(file="g0000-s00000.safetensors"))
    return "manifest.json"


def _deeply_nested(root: Path) -> str:
    (root / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    return "manifest.json"


def _huge_number(root: Path) -> str:
    (root / "manifest.json").write_text('{"format": "transformers-offload", "format_version": ' + "9" * 5000 + "}")
    return "manifest.json"


def _manifest_symlinked_from_outside(root: Path) -> str:
    return _move_out_and_link(root, "manifest.json")


def _wrong_sequences(root: Path) -> str:
    from safetensors.torch import save_file

    save_file({"sequences": torch.zeros(ROWS, 1, dtype=torch.long)}, str(root / "g0000-sequences.safetensors"))
    return "g0000-sequences.safetensors"


def _directory_as_shard(root: Path) -> str:
    (root / "g0000-s00001.safetensors").unlink()
    (root / "g0000-s00001.safetensors").mkdir()
    return "g0000-s00001.safetensors"


DAMAGE = {
    "same file named twice": (_same_file_twice, "twice"),
    "deeply nested JSON": (_deeply_nested, "not valid JSON"),
    "huge number": (_huge_number, "not valid JSON"),
    "manifest symlinked from outside": (_manifest_symlinked_from_outside, "leads outside the recording"),
    "sequences of the wrong width": (_wrong_sequences, "disagree with the manifest"),
    "directory posing as a shard": (_directory_as_shard, "is not a regular file"),
    "eos_token_id not a list": (_set(eos_token_id=5), "`eos_token_id` must be a list"),
    "prompt_lengths not a list": (_set(prompt_lengths="ab"), "`prompt_lengths` must be list or null"),
    "prompt_lengths of strings": (_set(prompt_lengths=["a"]), "must list non-negative integers"),
    "index not an int": (_set(index="x"), "`index` must be a int"),
    "index out of order": (_set(index=3), "generations are listed in order"),
    "generation_config not an object": (_set(generation_config=[1, 2]), "`generation_config` must be a dict"),
    "NUL in a file name": (_set(sequences="a\x00b"), "not a plain file name"),
    "no beams": (_set(num_beams=0), "`num_beams` must be at least 1"),
    "rows disagree with the streams": (_set(num_rows=999), "disagrees with `num_rows` 999"),
    "negative prompt length": (_set(prompt_length=-4), "must not be negative"),
    "beam mode without parents": (_set(mode="beam_search"), "lack \\['beam_parents'\\]"),

    "truncated shard": (_truncate, "damaged"),
    "corrupted header": (_corrupt_header, "damaged"),
    "unknown format version": (_future_version, "format version 99 is newer"),
    "shape disagrees with the manifest": (_shape_disagrees, "the manifest says"),
    "name escaping the directory": (_escaping_name, "not a plain file name"),
    "absolute name": (_absolute_name, "not a plain file name"),
    "symlink leading outside": (_escaping_symlink, "leads outside the recording"),
    "pickle posing as a shard": (_pickle_as_shard, "not a readable safetensors shard"),
    "swapped shards": (_swapped_shards, "not the shard the manifest names"),
    "missing shard": (_missing_shard, "file is not there"),
    "manifest not JSON": (_not_json, "not valid JSON"),
    "unknown encoding": (_unknown_encoding, "encoding 'topk-64'"),
    "steps beyond the shards": (_more_steps_than_shards, "shards hold 9 steps"),
}


# Damage to a data file, not to the manifest: the recording opens, and reading what the file holds raises.
FOUND_WHEN_READ = {
    "truncated shard", "corrupted header", "shape disagrees with the manifest",
    "pickle posing as a shard", "swapped shards", "missing shard", "sequences of the wrong width",
    "directory posing as a shard",
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_or_hostile_recording_gives_a_typed_error_naming_the_file(recording, damage):
    breaks, match = DAMAGE[damage]
    culprit = breaks(recording)
    if damage in FOUND_WHEN_READ:
        run = open_recording(recording)  # a damaged data file hides nothing else
        with pytest.raises(RecordingError, match=match) as raised:
            run.logits(), run.scores(), run.generation().sequences
        assert f"python -m transformers_offload verify {recording}" in str(raised.value)
    else:
        with pytest.raises(RecordingError, match=match) as raised:
            open_recording(recording)
    assert raised.value.path.name == culprit
    assert culprit in str(raised.value)


def test_not_a_recording(tmp_path):
    with pytest.raises(RecordingError, match="no such recording directory"):
        open_recording(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecordingError, match="not a transformers-offload recording"):
        open_recording(tmp_path / "empty")


# -- the command line ------------------------------------------------------------------------------
def _inspect(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}
    return subprocess.run(
        [sys.executable, "-m", "transformers_offload", "inspect", *args], capture_output=True, text=True, env=env
    )


def test_inspect_prints_the_summary(recording):
    done = _inspect(str(recording))
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "format 1" in text and "transformers x" in text and "torch y" in text
    assert "MadeUpForCausalLM 'made-up' (MadeUpConfig), vocabulary 4" in text
    assert "generation 0: sample, complete" in text
    assert f"{STEPS} steps of {ROWS} rows each" in text and "3 shards" in text
    assert "logits        float32   dense     (5, 16)" in text
    assert "2.8 KiB" in text  # 9 steps x 5 rows x 16 x 4 bytes
    assert "prompt lengths (tokens, without padding): [2, 2, 2, 2, 2]" in text
    assert "settings: do_sample=True" in text


def test_inspect_json_and_incomplete(tmp_path):
    write_made_up_recording(tmp_path / "run", steps=4, rows=2, vocab=4, shard_bytes=10**6, complete=False)
    done = _inspect(str(tmp_path / "run"), "--json")
    summary = json.loads(done.stdout)
    generation = summary["generations"][0]
    assert generation["complete"] is False and "KeyboardInterrupt" in generation["error"]
    assert generation["streams"]["scores"]["bytes"] == 4 * 2 * 4 * 4
    assert summary["created_by"]["torch"] == "y"
    assert generation["prompt_lengths"] == [2, 2] and generation["generation_config"] == {"do_sample": True}


def test_inspect_into_a_closed_pipe_and_on_a_file(recording):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}
    done = subprocess.run(
        f"{sys.executable} -m transformers_offload inspect {recording} | head -n 1",
        shell=True, capture_output=True, text=True, env=env,
    )
    assert done.stdout.startswith("recording ") and "Traceback" not in done.stderr
    done = _inspect(str(recording / "manifest.json"))
    assert done.returncode == 1 and "is a file, not a recording directory" in done.stderr


def test_inspect_a_damaged_recording(recording):
    """`inspect` summarises what the manifest says and marks the files it sees damaged without reading
    them (missing, or truncated); `verify` judges every byte. A damaged manifest exits 1."""
    _truncate(recording)
    (recording / "g0000-s00002.safetensors").unlink()
    done = _inspect(str(recording))
    assert done.returncode == 0 and "Traceback" not in done.stderr
    assert "DAMAGED g0000-s00001.safetensors: holds " in done.stdout
    assert "DAMAGED g0000-s00002.safetensors: cannot be found" in done.stdout
    assert f"python -m transformers_offload verify {recording}" in done.stdout
    summary = json.loads(_inspect(str(recording), "--json").stdout)
    assert [d["file"] for d in summary["generations"][0]["damaged_files"]] == [
        "g0000-s00001.safetensors", "g0000-s00002.safetensors"]
    _not_json(recording)
    done = _inspect(str(recording))
    assert done.returncode == 1 and "manifest.json" in done.stderr and "Traceback" not in done.stderr


def _layers_copy(tmp_path: Path) -> Path:
    root = tmp_path / "layers"
    shutil.copytree(GOLDEN_LAYERS, root)
    return root


def _rewrite_shard(root: Path, name: str, change) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = root / name
    with safe_open(str(path), framework="pt") as file:
        tensors = {key: file.get_tensor(key) for key in file.keys()}
        metadata = file.metadata()
    change(tensors)
    save_file(tensors, str(path), metadata=metadata)


def _edit_layers_manifest(root: Path, change) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    change(manifest["generations"][0])
    (root / "manifest.json").write_text(json.dumps(manifest))


LAYER_DAMAGE = {
    # (damage, file named, message, found when reading the stream rather than at open)
    "step shapes that do not add up": (
        lambda root: _rewrite_shard(root, "g0000-s00001.safetensors",
                                    lambda t: t["attentions.1.shapes"].copy_(torch.tensor([[2, 2, 1, 9]]))),
        "g0000-s00001.safetensors", "do not add up", True,
    ),
    "step shapes that disagree with the manifest": (
        lambda root: _edit_layers_manifest(root, lambda g: g["streams"]["attentions.1"].update(shape=[2, 3, None, None])),
        "g0000-s00000.safetensors", "disagree with the manifest", True,
    ),
    "a dense stream called ragged": (
        lambda root: _edit_layers_manifest(root, lambda g: g["streams"]["tokens"].update(encoding="ragged")),
        "manifest.json", "only per-layer streams are ragged", False,
    ),
    "values in another dtype": (
        lambda root: _edit_layers_manifest(root, lambda g: g["streams"]["hidden_states.2"].update(dtype="float16")),
        "g0000-s00000.safetensors", "the manifest says flat float16", True,
    ),
    "missing encoder file": (
        lambda root: (root / "g0000-encoder.safetensors").unlink(),
        "g0000-encoder.safetensors", "file is not there", True,
    ),
    "a layer the counts do not have": (
        lambda root: _edit_layers_manifest(root, lambda g: g["layers"]["counts"].update(attentions=1)),
        "manifest.json", "names a layer that `layers.counts` does not have", False,
    ),
    "more heads kept than recorded": (
        lambda root: _edit_layers_manifest(root, lambda g: g["layers"].update(heads={"attentions": [0, 1, 2]})),
        "manifest.json", "holds 2 heads, `layers.heads` lists \\[0, 1, 2\\]", False,
    ),
    "heads not a list": (
        lambda root: _edit_layers_manifest(root, lambda g: g["layers"].update(heads="all")),
        "manifest.json", "`layers.heads`", False,
    ),
    "an encoder stream that is not one": (
        lambda root: _edit_layers_manifest(root, lambda g: g["encoder"]["streams"].update(
            {"logits": g["encoder"]["streams"].pop("encoder_hidden_states.0")})),
        "manifest.json", "not a stream recorded once per call", False,
    ),
}


@pytest.mark.parametrize("damage", sorted(LAYER_DAMAGE))
def test_a_damaged_layers_recording_gives_a_typed_error_naming_the_file(tmp_path, damage):
    breaks, culprit, match, on_read = LAYER_DAMAGE[damage]
    root = _layers_copy(tmp_path)
    breaks(root)
    with pytest.raises(RecordingError, match=match) as raised:
        run = open_recording(root)
        if on_read:
            run.attentions(), run.hidden_states(), run.encoder_hidden_states()
    assert raised.value.path.name == culprit


def test_inspect_counts_read_as_english():
    from transformers_offload.cli.summary import _count, _steps_and_rows

    assert [_count(n, "shard") for n in (0, 1, 2)] == ["0 shards", "1 shard", "2 shards"]
    assert _steps_and_rows(1, 1) == "1 step of 1 row each"
    assert _steps_and_rows(16, 3) == "16 steps of 3 rows each"
    assert _steps_and_rows(0, 0) == "no step recorded (stopped before its first step)"
