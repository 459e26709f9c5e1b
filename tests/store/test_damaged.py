"""Damaged recordings: `verify` checks every file and lists every damaged one; `open_recording` opens a
directory with damaged shards, its intact steps read exactly as before, and reading a step a damaged file
holds raises `RecordingError` naming the file and the `verify` command. Real recordings of a tiny model,
damaged on disk the ways disks and people damage them."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transformers_offload import Recorder, RecordingError, open_recording
from transformers_offload.cli import main as cli
from transformers_offload.read.ranks import RankedRecording
from transformers_offload.store import open_files as _open_files

from ..helpers import left_padded_batch, make_tiny

STREAMS = ("logits", "scores", "tokens", "finished")
VERIFY = "python -m transformers_offload verify"


def _generate(model, rec, seed: int) -> None:
    torch.manual_seed(seed)
    model.generate(**left_padded_batch(), logits_processor=[rec], do_sample=True, max_new_tokens=8)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """Two generations of 8 steps, each in shards of 2 steps, and a run of two ranks of one each."""
    root = tmp_path_factory.mktemp("pristine")
    model = make_tiny("gpt2")
    with Recorder(model, spill_dir=root / "run", shard_bytes=7_000) as rec:
        for seed in (0, 1):
            _generate(model, rec, seed)
    for rank in (0, 1):
        with Recorder(model, spill_dir=root / "ranks" / f"rank-{rank}", shard_bytes=7_000) as rec:
            rec.set_samples([f"r{rank}p{i}" for i in range(3)])
            _generate(model, rec, 10 + rank)
    manifest = json.loads((root / "run" / "manifest.json").read_text())
    assert [len(g["shards"]) for g in manifest["generations"]] == [4, 4]  # 2 steps a shard
    return root


@pytest.fixture
def run(pristine, tmp_path) -> Path:
    shutil.copytree(pristine / "run", tmp_path / "run")
    return tmp_path / "run"


@pytest.fixture
def ranks(pristine, tmp_path) -> Path:
    shutil.copytree(pristine / "ranks", tmp_path / "ranks")
    return tmp_path / "ranks"


# -- the damage -------------------------------------------------------------------------------------
def _truncate(path: Path) -> str:
    path.write_bytes(path.read_bytes()[:-7])
    return "bytes"


def _flip_header(path: Path) -> str:
    data = bytearray(path.read_bytes())
    for i in range(8, 24):  # inside the safetensors JSON header, which follows its 8-byte length
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    return "checksum"


def _flip_data(path: Path) -> str:
    """One byte flipped in the middle of the `logits` tensor's data: the header stays whole."""
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    start, stop = json.loads(data[8 : 8 + length])["logits"]["data_offsets"]
    data[8 + length + (start + stop) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    return "checksum"


def _delete(path: Path) -> str:
    path.unlink()
    return "not there"


DAMAGE = {"truncated": _truncate, "header flipped": _flip_header, "data flipped": _flip_data, "deleted": _delete}
SEEN_WHEN_READ = ("truncated", "header flipped", "deleted")  # a plain read checks headers, not data


def _shard(root: Path, generation: int, shard: int) -> Path:
    return root / f"g{generation:04d}-s{shard:05d}.safetensors"


def _assert_reads_as(recording, reference, generation: int, steps: slice | None = None) -> None:
    for stream in STREAMS:
        mine = getattr(recording, stream)(generation, steps=steps)
        theirs = getattr(reference, stream)(generation, steps=steps)
        assert len(mine) == len(theirs) > 0 and all(torch.equal(a, b) for a, b in zip(mine, theirs)), stream


def _assert_names_file_and_verify(error: RecordingError, path: Path, root: Path) -> None:
    assert error.path == path and path.name in str(error)
    assert f"`{VERIFY} {root}`" in str(error)


# -- verify -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_verify_names_the_damaged_file_and_what_is_wrong(run, damage):
    path = _shard(run, 1, 2)
    found = DAMAGE[damage](path)
    with pytest.raises(RecordingError, match=found) as raised:
        open_recording(run).verify()
    assert raised.value.path == path and raised.value.damaged == (raised.value,)


def test_verify_lists_every_damaged_file_in_both_generations(run):
    damaged = {_shard(run, 0, 1): _truncate, _shard(run, 0, 3): _flip_data, _shard(run, 1, 0): _flip_header,
               _shard(run, 1, 2): _delete}
    found = {path: damage(path) for path, damage in damaged.items()}
    with pytest.raises(RecordingError) as raised:
        open_recording(run).verify()
    error = raised.value
    assert error.path == run and "4 of its 10 file(s) are damaged" in str(error)
    assert [each.path for each in error.damaged] == list(damaged)  # in the manifest's order
    for each in error.damaged:
        assert found[each.path] in each.problem and f"\n  {each}" in str(error)
    with pytest.raises(RecordingError) as again:
        open_recording(run, verify=True)
    assert [each.path for each in again.value.damaged] == list(damaged)


def test_verify_checks_each_header_against_the_manifest_as_a_read_does(run):
    """Files whose bytes match their checksums but not what the manifest says of them (a hand-edited
    manifest): each is listed, as reading it would refuse it."""
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["generations"][1]["streams"]["logits"]["dtype"] = "float16"
    (run / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RecordingError) as raised:
        open_recording(run).verify()
    assert [each.path for each in raised.value.damaged] == [_shard(run, 1, shard) for shard in range(4)]
    assert all("the manifest says [2, 3, 128] float16" in each.problem for each in raised.value.damaged)


def test_verify_from_the_shell_lists_every_damaged_file(run, capsys):
    damaged = [_shard(run, 0, 0), _shard(run, 1, 3)]
    _truncate(damaged[0]), _delete(damaged[1])
    assert cli(["verify", str(run)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "2 of its 10 file(s) are damaged" in captured.err
    lines = captured.err.splitlines()
    assert any(str(damaged[0]) in line and "bytes" in line for line in lines)
    assert any(str(damaged[1]) in line and "not there" in line for line in lines)
    assert cli(["verify", str(run), "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is False and result["file"] == str(run)
    assert [d["file"] for d in result["damaged"]] == [str(p) for p in damaged]
    assert "bytes" in result["damaged"][0]["error"] and "not there" in result["damaged"][1]["error"]


def test_verify_as_a_module_exits_1_and_names_the_file(run):
    path = _shard(run, 0, 2)
    _flip_data(path)
    done = subprocess.run([sys.executable, "-m", "transformers_offload", "verify", str(run), "--json"],
                          capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert [d["file"] for d in json.loads(done.stdout)["damaged"]] == [str(path)]


# -- reading what is intact -------------------------------------------------------------------------
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_shard_hides_nothing_else(pristine, run, damage):
    path = _shard(run, 1, 2)  # steps 4 and 5 of generation 1
    DAMAGE[damage](path)
    reference, recording = open_recording(pristine / "run"), open_recording(run)
    _assert_reads_as(recording, reference, 0)
    _assert_reads_as(recording, reference, 1, slice(0, 4))
    _assert_reads_as(recording, reference, 1, slice(6, None))
    assert torch.equal(recording.generation(1).sequences, reference.generation(1).sequences)
    if damage in SEEN_WHEN_READ:
        with pytest.raises(RecordingError) as raised:
            recording.logits(1, steps=slice(3, 6))
        _assert_names_file_and_verify(raised.value, path, run)
    else:  # the header is whole: a plain read returns the flipped value, as documented
        mine, theirs = recording.logits(1, steps=slice(4, 6)), reference.logits(1, steps=slice(4, 6))
        assert not all(torch.equal(a, b) for a, b in zip(mine, theirs))
    with pytest.raises(RecordingError):
        recording.verify()
    with pytest.raises(RecordingError, match="found by `verify`") as raised:  # from now on, whatever the damage
        recording.scores(1, steps=5)
    _assert_names_file_and_verify(raised.value, path, run)
    _assert_reads_as(recording, reference, 1, slice(6, None))


def test_several_damaged_shards_in_two_generations(pristine, run):
    for path, damage in ((_shard(run, 0, 0), _delete), (_shard(run, 0, 3), _flip_header), (_shard(run, 1, 1), _truncate)):
        damage(path)
    reference, recording = open_recording(pristine / "run"), open_recording(run)
    _assert_reads_as(recording, reference, 0, slice(2, 6))
    _assert_reads_as(recording, reference, 1, slice(0, 2))
    _assert_reads_as(recording, reference, 1, slice(4, None))
    for generation, step, shard in ((0, 0, 0), (0, 7, 3), (1, 3, 1)):
        with pytest.raises(RecordingError) as raised:
            recording.tokens(generation, steps=step)
        _assert_names_file_and_verify(raised.value, _shard(run, generation, shard), run)
    assert recording.describe()["generations"][0]["damaged_files"] == [
        {"file": _shard(run, 0, 0).name, "error": "cannot be found (No such file or directory)"}]


def test_a_damaged_sequences_file_raises_when_the_sequences_are_read(pristine, run):
    path = run / "g0000-sequences.safetensors"
    _flip_header(path)
    reference, recording = open_recording(pristine / "run"), open_recording(run)
    _assert_reads_as(recording, reference, 0)
    assert torch.equal(recording.generation(1).sequences, reference.generation(1).sequences)
    with pytest.raises(RecordingError) as raised:
        _ = recording.generation(0).sequences
    _assert_names_file_and_verify(raised.value, path, run)


def test_open_reads_no_shard(run, monkeypatch):
    """The reader stays lazy: opening a recording opens none of its safetensors files."""
    opened = []
    real = _open_files.safe_open
    monkeypatch.setattr(_open_files, "safe_open", lambda path, *a, **k: opened.append(path) or real(path, *a, **k))
    for path in run.glob("g0001-*.safetensors"):
        _flip_header(path)
    recording = open_recording(run)
    assert opened == [] and len(recording) == 2
    recording.logits(0, steps=0)
    assert set(opened) == {str(_shard(run, 0, 0))}  # its header through NumPy's view, its tensors through torch's


def test_a_damaged_manifest_still_raises_at_open(run, capsys):
    (run / "manifest.json").write_text((run / "manifest.json").read_text()[:-40])
    with pytest.raises(RecordingError, match="not valid JSON.*the manifest is damaged") as raised:
        open_recording(run)
    assert raised.value.path == run / "manifest.json"
    assert cli(["verify", str(run), "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["damaged"] == [{"file": str(run / "manifest.json"), "error": raised.value.problem}]


# -- a data-parallel run ----------------------------------------------------------------------------
def test_a_rank_directory_with_damaged_shards(pristine, ranks, capsys):
    damaged = [_shard(ranks / "rank-0", 0, 1), _shard(ranks / "rank-1", 0, 2)]
    _flip_header(damaged[0]), _truncate(damaged[1])
    with pytest.raises(RecordingError) as raised:
        open_recording(ranks).verify()
    assert raised.value.path == ranks and "2 of its 10 file(s) are damaged" in str(raised.value)
    assert [each.path for each in raised.value.damaged] == damaged
    assert cli(["verify", str(ranks), "--json"]) == 1
    assert [d["file"] for d in json.loads(capsys.readouterr().out)["damaged"]] == [str(p) for p in damaged]
    reference, recording = open_recording(pristine / "ranks"), open_recording(ranks)
    assert isinstance(recording, RankedRecording)
    for generation, intact in ((0, (slice(0, 2), slice(4, None))), (1, (slice(0, 4), slice(6, None)))):
        for steps in intact:
            _assert_reads_as(recording, reference, generation, steps)
        with pytest.raises(RecordingError) as caught:
            recording.logits(generation)
        _assert_names_file_and_verify(caught.value, damaged[generation], damaged[generation].parent)


def test_exporting_a_recording_with_a_damaged_shard_names_generations_and_the_intact_ones_export(run, tmp_path, capsys):
    _delete(_shard(run, 1, 2))
    assert cli(["export", str(run), str(tmp_path / "all.parquet")]) == 1
    err = capsys.readouterr().err
    assert "g0001-s00002.safetensors" in err and "name them with `--generations`" in err
    assert not (tmp_path / "all.parquet").exists()
    assert cli(["export", str(run), str(tmp_path / "intact.parquet"), "--generations", "0"]) == 0
    assert cli(["export", str(tmp_path / "missing"), str(tmp_path / "none.parquet")]) == 1
    assert "--generations" not in capsys.readouterr().err  # no recording at all: no generation to name
