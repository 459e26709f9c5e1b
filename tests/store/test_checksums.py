"""Checksums: every file a recording names carries its size and CRC-32C in the manifest; `verify`
reads every byte and names the damaged file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import google_crc32c
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transformers_offload import Recorder, RecordingError, open_recording
from transformers_offload.cli import main as cli
from transformers_offload.store import files as _files

from ..helpers import FUZZ_SCALE, GOLDEN, left_padded_batch, make_tiny

FILES = {  # the golden layers recording: every kind of file a recording holds
    "g0000-s00000.safetensors", "g0000-s00001.safetensors", "g0000-s00002.safetensors",
    "g0000-encoder.safetensors", "g0000-sequences.safetensors",
}


@pytest.fixture
def recording(tmp_path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(GOLDEN / "tiny-layers-recording", target)
    return target


def test_every_file_carries_its_size_and_checksum_and_verifies(recording):
    manifest = json.loads((recording / "manifest.json").read_text())
    assert set(manifest["files"]) == FILES
    for name, record in manifest["files"].items():
        assert record["bytes"] == (recording / name).stat().st_size
        assert record["checksum"].startswith("crc32c:") and len(record["checksum"]) == len("crc32c:") + 8
    assert open_recording(recording, verify=True).verify() == {
        "files": 5, "bytes": sum(r["bytes"] for r in manifest["files"].values()),
        "ledger": 1,  # its one generation's line (tests/store/test_ledger.py)
    }


def test_a_spilled_call_verifies(tmp_path):
    model = make_tiny("t5", attn_implementation="eager")
    batch = left_padded_batch()
    with Recorder(model, streams=("logits", "scores", "attentions"), spill_dir=tmp_path / "run", shard_bytes=10_000) as rec:
        model.generate(**batch, logits_processor=[rec], max_new_tokens=6)
    result = open_recording(tmp_path / "run").verify()
    assert result["files"] == len(list((tmp_path / "run").glob("*.safetensors"))) > 3


def _flip(path: Path, offset: int, mask: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= mask
    path.write_bytes(bytes(data))


@settings(max_examples=400 * FUZZ_SCALE, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(FILES)), offset=st.integers(min_value=0, max_value=10**6),
       mask=st.integers(min_value=1, max_value=255))
def test_one_flipped_byte_anywhere_in_any_file_is_found_and_named(tmp_path_factory, name, offset, mask):
    recording = tmp_path_factory.mktemp("flip") / "run"
    shutil.copytree(GOLDEN / "tiny-layers-recording", recording)
    _flip(recording / name, offset, mask)
    with pytest.raises(RecordingError) as caught:
        open_recording(recording, verify=True)
    assert caught.value.path == recording / name


def test_a_truncated_file_and_an_unknown_algorithm(recording):
    path = recording / "g0000-s00001.safetensors"
    manifest = json.loads((recording / "manifest.json").read_text())
    record = dict(manifest["files"][path.name])
    manifest["files"][path.name]["checksum"] = "sha999:00ff"
    (recording / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RecordingError, match="'sha999'.*upgrade transformers-offload"):
        open_recording(recording).verify()
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(RecordingError) as caught:
        open_recording(recording, verify=True)  # safetensors itself sees that the data is short
    assert caught.value.path == path
    with pytest.raises(RecordingError, match=f"holds {record['bytes'] - 1} bytes, the manifest says {record['bytes']}"):
        _files.verify_file(path, record)


def test_a_recording_from_before_checksums_reads_the_same_and_says_it_carries_none():
    old, new = open_recording(GOLDEN / "tiny-recording-before-checksums"), open_recording(GOLDEN / "tiny-recording")
    for stream in ("logits", "scores", "tokens", "finished"):
        assert all(torch.equal(a, b) for a, b in zip(getattr(old, stream)(), getattr(new, stream)()))
    assert torch.equal(old.generation().sequences, new.generation().sequences)
    with pytest.raises(RecordingError, match="carries no checksum for 3 of its 3 file"):
        old.verify()


def test_verify_from_the_shell(recording, capsys):
    assert cli(["verify", str(recording)]) == 0
    assert capsys.readouterr().out.startswith("ok: 5 file(s)")
    assert cli(["verify", str(recording), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    _flip(recording / "g0000-encoder.safetensors", -3, 0x40)
    assert cli(["verify", str(recording)]) == 1
    err = capsys.readouterr().err
    assert "g0000-encoder.safetensors" in err and "checksum" in err
    assert cli(["verify", str(recording), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["file"].endswith("g0000-encoder.safetensors")
    assert cli(["verify", str(GOLDEN / "tiny-recording-before-checksums")]) == 1
    assert "no checksum" in capsys.readouterr().err


def test_verify_as_a_module_exits_with_its_status(recording):
    done = subprocess.run([sys.executable, "-m", "transformers_offload", "verify", str(recording)],
                          capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("ok:"), done.stderr


def test_both_algorithms_check_the_same_bytes(recording):
    """CRC-32C where google-crc32c is compiled (everywhere it has a wheel), zlib's CRC-32 elsewhere."""
    path = recording / "g0000-sequences.safetensors"
    with open(path, "rb") as file:
        crc32c, crc32 = _files.file_checksum(file, "crc32c"), _files.file_checksum(file, "crc32")
    data = path.read_bytes()
    assert crc32c == f"crc32c:{google_crc32c.value(data):08x}" and crc32 == f"crc32:{zlib.crc32(data):08x}"
    _files.verify_file(path, {"bytes": len(data), "checksum": crc32})
    assert _files.CHECKSUM_ALGORITHM == "crc32c"  # this machine has the compiled extension


def test_a_safetensors_files_checksum_from_its_tensors_equals_reading_it(tmp_path):
    """The writer's checksum, from the tensors a shard was written from and its header, is the file's
    (`file_checksum`); tensors that are not the file's give None (the writer then reads the file)."""
    from safetensors.torch import save_file

    tensors = {"logits": torch.randn(3, 2, 5), "tokens": torch.arange(6).reshape(3, 2), "empty": torch.zeros(0, 4),
               "finished": torch.tensor([True, False]), "half": torch.ones(3, dtype=torch.bfloat16)}
    path = tmp_path / "shard.safetensors"
    save_file(tensors, path, metadata={"generation": "0"})
    contents = {name: t.contiguous().reshape(-1).view(torch.uint8).numpy() for name, t in tensors.items()}
    with open(path, "rb") as file:
        assert _files.safetensors_checksum(file, contents) == _files.file_checksum(file)
        assert _files.safetensors_checksum(file, {k: v for k, v in contents.items() if k != "tokens"}) is None
        assert _files.safetensors_checksum(file, {**contents, "logits": contents["logits"][:-4]}) is None
