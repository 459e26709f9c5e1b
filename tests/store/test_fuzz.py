"""Hostile and damaged recordings, generated (hypothesis): a mutated manifest (types, ranges, missing
and extra keys, huge numbers, deep nesting, file names leading out) or a mutated or truncated shard
header. Opening the recording and reading every stream raises nothing but `RecordingError`, never
hangs, and never opens a file outside the directory.

In CI: 800 mutated manifests, 200 deeply nested ones and 800 mutated shard files, with the 400 byte
flips of test_checksums.py 2,200 examples, the same ones every run; `TRANSFORMERS_OFFLOAD_FUZZ=large`
runs ten times as many, from a random seed.
"""

from __future__ import annotations

import faulthandler
import json
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from transformers_offload import Recorder, RecordingError, open_recording
from transformers_offload.capture import layers as _layers
from transformers_offload.store import files as _files
from transformers_offload.store import layout as _layout
from transformers_offload.store import open_files as _open_files

from ..helpers import FUZZ_SCALE, GOLDEN, left_padded_batch, make_tiny, write_made_up_recording

# The fixtures hold no state between examples: each example copies its recording afresh, and
# `_survives` starts the list of opened files over.
# A deadline per example stands for "never hangs" (and a watchdog below ends the run if one does).
BASES = ["dense", "layers", "beam", "stats", "topk", "sparse"]  # the recordings `bases` makes
FUZZ = settings(max_examples=800 * FUZZ_SCALE, deadline=10_000, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """Small recordings of every layout: dense, ragged with an encoder file, a beam search, stats, top-k,
    sparse."""
    beam = tmp_path_factory.mktemp("beam") / "run"
    model = make_tiny("gpt2")
    with Recorder(model, spill_dir=beam, shard_bytes=3_000) as rec:
        model.generate(**left_padded_batch(), logits_processor=[rec], num_beams=2, max_new_tokens=4)
    return {"dense": GOLDEN / "tiny-recording", "layers": GOLDEN / "tiny-layers-recording", "beam": beam,
            "stats": GOLDEN / "tiny-stats-recording", "topk": GOLDEN / "tiny-topk-recording",
            "sparse": GOLDEN / "tiny-sparse-recording"}


@pytest.fixture(autouse=True, scope="module")
def no_hang():
    faulthandler.dump_traceback_later(900, exit=True)  # a hang dumps every stack and ends the run
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def opened(monkeypatch) -> list[Path]:
    """Every path the reader opens (safetensors files, and files read whole by `verify`)."""
    paths: list[Path] = []
    real_safe_open = _open_files.safe_open

    def safe_open(path, *args, **kwargs):
        paths.append(Path(path))
        return real_safe_open(path, *args, **kwargs)

    def tracked_open(path, *args, **kwargs):
        paths.append(Path(path))
        return open(path, *args, **kwargs)

    monkeypatch.setattr(_open_files, "safe_open", safe_open)
    monkeypatch.setattr(_files, "open", tracked_open, raising=False)
    return paths


def read_everything(path: Path) -> None:
    """Open the recording and read every stream of every generation, every way a user can."""
    run = open_recording(path)
    run.describe()
    for generation in run:
        for stream in generation.streams:
            if _layout.split_layer_stream(stream) is None:
                generation._get(stream, None, None, "pt")
        for kind, layers in generation.layer_indices.items():
            getattr(generation, kind)(layers=list(layers))
            for layer in layers:
                generation.layer_array(kind, layer)
        if generation.is_beam and generation.sequences is not None:
            generation.beam_indices()
        if "stats" in generation.streams:
            generation.stats()
        for stream, encoding in generation.encodings.items():
            if encoding == "sparse":
                generation.sparse(stream)
                getattr(generation, stream)()
            else:
                generation.topk(stream)
        if generation.num_rows and generation.num_steps and "tokens" in generation.streams:
            generation.tokens(steps=slice(generation.num_steps - 1, None), rows=[generation.num_rows - 1], framework="np")
    _note("every stream read")
    run.verify()


def _note(what: str) -> None:
    """Count `what` in hypothesis' statistics (`--hypothesis-show-statistics`): how deep examples get."""
    if currently_in_test_context():
        event(what)


def _survives(path: Path, root: Path, opened: list[Path]) -> None:
    """Reading `path` succeeds or raises RecordingError, and opens nothing outside `root`."""
    opened.clear()
    try:
        read_everything(path)
        _note("verified")
    except RecordingError as error:
        _note(f"RecordingError: {'manifest' if error.path.name == _layout.MANIFEST else 'a data file'}")
    outside = [p for p in opened if p.resolve().parent != root.resolve()]
    assert not outside, f"opened files outside the recording: {outside}"


@pytest.fixture
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="fuzz-") as directory:
        yield Path(directory)


def _copy(base: Path, scratch: Path) -> Path:
    target = Path(tempfile.mkdtemp(dir=scratch)) / "run"
    shutil.copytree(base, target)
    return target


# -- the manifest --------------------------------------------------------------------------------------
LEAVES = (
    st.none() | st.booleans()
    | st.integers(min_value=-3, max_value=8)
    | st.sampled_from([2**31, 2**53 + 1, 2**63, 2**64 + 7, -(2**63), 10**30, 10**400])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(["", ".", "..", "../manifest.json", "/etc/passwd", "a/b", "x\x00y", "manifest.json",
                      "g0000-s00000.safetensors", "g0000-s00001.safetensors", "g0000-sequences.safetensors",
                      "float32", "bfloat16", "int64", "bool", "F32", "dense", "ragged", "sparse", "recording",
                      "complete", "failed", "beam_search", "sample", "attentions.1", "crc32:00000000", "crc32:zz"])
    | st.text(max_size=12)
)
JSON = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)


def _paths(value: Any, prefix: tuple = ()) -> Iterator[tuple]:
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*prefix, index))


def _mutate(manifest: Any, path: tuple, how: str, value: Any, key: str) -> Any:
    if not path:
        return value if how == "replace" else manifest
    parent = manifest
    for part in path[:-1]:
        parent = parent[part]
    last = path[-1]
    if how == "replace":
        parent[last] = value
    elif how == "delete":
        del parent[last]
    elif how == "extra" and isinstance(parent[last], dict):
        parent[last][key] = value
    elif how == "extra" and isinstance(parent[last], list):
        parent[last].append(value)
    elif how == "duplicate" and isinstance(parent, list):
        parent.insert(last, json.loads(json.dumps(parent[last])))
    return manifest


@FUZZ
@given(data=st.data(), base=st.sampled_from(BASES),
       how=st.sampled_from(["replace", "replace", "delete", "extra", "duplicate"]), value=JSON, key=st.text(max_size=8))
def test_a_mutated_manifest_gives_recording_error_or_reads(bases, scratch, opened, data, base, how, value, key):
    root = _copy(bases[base], scratch)
    manifest = json.loads((root / "manifest.json").read_text())
    path = data.draw(st.sampled_from(list(_paths(manifest))), label="path")
    manifest = _mutate(manifest, path, how, value, key)
    (root / "manifest.json").write_text(json.dumps(manifest))
    _survives(root, root, opened)


@settings(FUZZ, max_examples=200 * FUZZ_SCALE)
@given(base=st.sampled_from(BASES), depth=st.integers(min_value=1, max_value=200_000),
       where=st.sampled_from(["top", "generations", "streams", "files"]))
def test_a_manifest_nested_deeply_or_not_json(bases, scratch, opened, base, depth, where):
    root = _copy(bases[base], scratch)
    nested = "[" * depth + "]" * depth
    text = (root / "manifest.json").read_text()
    if where == "top":
        text = nested
    else:
        text = text.replace(f'"{where}": ', f'"{where}": {nested}, "_": ', 1)
    (root / "manifest.json").write_text(text)
    _survives(root, root, opened)


# -- shard headers ------------------------------------------------------------------------------------
def _split(data: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


@FUZZ
@given(data=st.data(), base=st.sampled_from(BASES),
       how=st.sampled_from(["header", "header", "length", "truncate", "flip", "tensor"]), value=JSON, key=st.text(max_size=8),
       length=st.sampled_from([0, 1, 7, 8, 2**31, 2**63, 2**64 - 1]) | st.integers(min_value=0, max_value=4096))
def test_a_mutated_or_truncated_shard_header_gives_recording_error_or_reads(bases, scratch, opened, data, base, how,
                                                                          value, key, length):
    root = _copy(bases[base], scratch)
    files = sorted(p.name for p in root.glob("*.safetensors"))
    target = root / data.draw(st.sampled_from(files), label="file")
    raw = target.read_bytes()
    header, body = _split(raw)
    if how == "header":
        path = data.draw(st.sampled_from(list(_paths(header))), label="path")
        header = _mutate(header, path, data.draw(st.sampled_from(["replace", "delete", "extra"])), value, key)
        text = json.dumps(header).encode()
        keep_length = data.draw(st.booleans(), label="keep the old length")
        size = struct.unpack("<Q", raw[:8])[0] if keep_length else len(text)
        raw = struct.pack("<Q", size) + text + body
    elif how == "length":
        raw = struct.pack("<Q", length) + raw[8:]
    elif how == "truncate":
        raw = raw[: data.draw(st.integers(min_value=0, max_value=len(raw) - 1), label="cut")]
    elif how == "flip":  # a byte of the header
        end = 8 + struct.unpack("<Q", raw[:8])[0]
        at = data.draw(st.integers(min_value=0, max_value=end - 1), label="at")
        raw = raw[:at] + bytes([raw[at] ^ data.draw(st.integers(1, 255), label="mask")]) + raw[at + 1 :]
    else:  # values of one tensor (a ragged stream's step shapes, above all): the reader uses them
        names = sorted((n for n in header if n != "__metadata__"), key=lambda n: (not n.endswith(".shapes"), n))
        name = data.draw(st.sampled_from(names[:1] * 3 + names), label="tensor")
        start, stop = header[name]["data_offsets"]
        if stop > start:
            at = 8 + struct.unpack("<Q", raw[:8])[0] + data.draw(st.integers(start, stop - 1), label="at")
            new = data.draw(st.sampled_from([0x00, 0x7F, 0x80, 0xFF]) | st.integers(0, 255), label="byte")
            raw = raw[:at] + bytes([new]) + raw[at + 1 :]
    target.write_bytes(raw)
    _survives(root, root, opened)


# -- files that lead out ------------------------------------------------------------------------------
@pytest.mark.parametrize("base", BASES)
def test_a_file_replaced_by_a_link_leading_out_is_refused_without_reading_it(bases, scratch, opened, base):
    root = _copy(bases[base], scratch)
    outside = scratch / "outside.safetensors"
    for name in sorted(p.name for p in root.glob("*.safetensors")):
        shutil.copy(root / name, outside)
        (root / name).unlink()
        (root / name).symlink_to(outside)
        with pytest.raises(RecordingError, match="leads outside"):
            read_everything(root)
        assert not [p for p in opened if p.resolve().parent != root.resolve()]
        (root / name).unlink()
        shutil.copy(outside, root / name)


def test_the_bases_read_whole(bases):
    for base in bases.values():
        read_everything(base)
    assert _layers  # imported for the layer accessors' errors
    assert torch  # (keeps the import list honest for readers of this file)


def test_step_shapes_whose_product_wraps_around_64_bits_are_refused(scratch, opened):
    """A crafted ragged shard: one step's shape (2, 2, 2**31, 2**31) holds 2**64 values, 0 in int64;
    step 0 takes over its true count, so int64 sums would add up to the tensor's length."""
    root = scratch / "run"
    write_made_up_recording(root, steps=3, rows=2, vocab=4, shard_bytes=2**20, layers=True)  # one shard
    target = root / "g0000-s00000.safetensors"
    raw = target.read_bytes()
    header, _ = _split(raw)
    start, stop = header["attentions.1.shapes"]["data_offsets"]
    offset = 8 + struct.unpack("<Q", raw[:8])[0] + start
    shapes = torch.frombuffer(bytearray(raw[offset : offset + stop - start]), dtype=torch.int64).view(-1, 4).clone()
    assert shapes.shape[0] >= 2 and shapes[:, :2].tolist() == [[2, 2]] * shapes.shape[0]
    moved = int(shapes[-1].prod())
    shapes[0, 2:] = torch.tensor([1, int(shapes[0].prod() + moved) // 4])
    shapes[-1, 2:] = 2**31
    target.write_bytes(raw[:offset] + shapes.numpy().tobytes() + raw[offset + stop - start :])
    with pytest.raises(RecordingError, match="do not add up"):
        read_everything(root)


@pytest.mark.parametrize("key", ["shard", "sequences", "files"])
def test_a_file_name_too_long_for_the_file_system_is_refused(scratch, opened, key):
    root = _copy(GOLDEN / "tiny-recording", scratch)
    manifest = json.loads((root / "manifest.json").read_text())
    long = "x" * 300 + ".safetensors"
    if key == "shard":
        manifest["generations"][0]["shards"][0]["file"] = long
    elif key == "sequences":
        manifest["generations"][0]["sequences"] = long
    else:
        manifest["files"][long] = {"bytes": 1, "checksum": "crc32c:00000000"}
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RecordingError, match="not a plain file name"):
        read_everything(root)


@pytest.mark.parametrize("sequences", [None, "absent"])
def test_a_complete_generation_without_sequences_is_refused(scratch, opened, sequences):
    root = _copy(GOLDEN / "tiny-recording", scratch)
    manifest = json.loads((root / "manifest.json").read_text())
    if sequences is None:
        manifest["generations"][0]["sequences"] = None
    else:
        del manifest["generations"][0]["sequences"]
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RecordingError, match="complete but names no `sequences`"):
        open_recording(root)

