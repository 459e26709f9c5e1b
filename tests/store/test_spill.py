"""Spilling to shards: layout, waits, and what survives a fault (exception, Ctrl-C, SIGKILL, full disk)."""

from __future__ import annotations

import errno
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from transformers_offload import Recorder, SpillError, open_recording
from transformers_offload.store import shard_buffer as _shard_buffer
from transformers_offload.store import shard_writer as _shard_store
from transformers_offload.store.shard_writer import shard_size

from ..helpers import ROOT, Boom, FailAtStep, assert_steps_equal, hf_reference, left_padded_batch, make_tiny

NEW_TOKENS = 12


def _reference(model, **kwargs):
    torch.manual_seed(0)
    return hf_reference(model, **{**left_padded_batch(), "max_new_tokens": NEW_TOKENS, **kwargs})


def _step_bytes(rows: int, vocab: int = 128, *, scores: bool = True) -> int:
    """Bytes a step stores: logits, scores, tokens, finished (`scores=False`: a call with no processor,
    whose scores are stored once, as the logits)."""
    return rows * vocab * 4 * (1 + scores) + rows * (8 + 1)


@pytest.mark.parametrize("steps_per_shard", [1, 5, 12, 50])
def test_shards_hold_the_steps_the_size_allows(gpt2, tmp_path, steps_per_shard):
    with Recorder(gpt2, spill_dir=tmp_path / "run", shard_bytes=steps_per_shard * _step_bytes(3)) as rec:
        torch.manual_seed(0)
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    shards = manifest["generations"][0]["shards"]
    expected = [min(steps_per_shard, NEW_TOKENS - first) for first in range(0, NEW_TOKENS, steps_per_shard)]
    assert [shard["num_steps"] for shard in shards] == expected
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == sorted(
        ["manifest.json", "ledger.jsonl", "g0000-sequences.safetensors", *(shard["file"] for shard in shards)]
    )


def test_default_shard_size_and_several_generations_in_one_directory(gpt2, tmp_path):
    reference = _reference(gpt2)
    with Recorder(gpt2, spill_dir=tmp_path / "run") as rec:
        for _ in range(3):
            torch.manual_seed(0)
            gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=NEW_TOKENS)
    run = open_recording(tmp_path / "run")
    assert len(run) == 3 and [g.index for g in run] == [0, 1, 2]
    for generation in run:
        assert generation.complete and generation.transfer is None
        assert_steps_equal(generation.scores(), reference.scores, "scores")
    assert rec.generation(1).transfer.bytes_written > 0
    assert rec.spill_dir == tmp_path / "run"


def test_a_slow_writer_makes_generate_wait_and_the_waits_are_counted(gpt2, tmp_path, monkeypatch):
    real = _shard_store.save_file

    def slow_save_file(*args, **kwargs):
        time.sleep(0.05)
        real(*args, **kwargs)

    monkeypatch.setattr(_shard_store, "save_file", slow_save_file)
    reference = _reference(gpt2)
    with Recorder(gpt2, spill_dir=tmp_path / "run", shard_bytes=1) as rec:  # one step per shard
        torch.manual_seed(0)
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=NEW_TOKENS)
    assert rec.generation().transfer.waits > 0
    assert_steps_equal(open_recording(tmp_path / "run").logits(), reference.logits, "logits")


def test_a_fast_writer_never_makes_generate_wait(gpt2, tmp_path):
    with Recorder(gpt2, spill_dir=tmp_path / "run") as rec:  # the whole call fits in one shard
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=NEW_TOKENS)
    assert rec.generation().transfer.waits == 0


@pytest.mark.parametrize("error", [Boom("disk on fire"), KeyboardInterrupt()])
@pytest.mark.parametrize("kwargs", [{}, {"num_beams": 3}], ids=["greedy", "beam"])
def test_a_fault_mid_run_leaves_every_step_before_it_readable(gpt2, tmp_path, error, kwargs):
    reference = _reference(gpt2, **kwargs)
    with Recorder(gpt2, spill_dir=tmp_path / "run", shard_bytes=4 * _step_bytes(9)) as rec:
        torch.manual_seed(0)
        with pytest.raises(type(error)):
            gpt2.generate(
                **left_padded_batch(), logits_processor=[rec, FailAtStep(7, error)],
                max_new_tokens=NEW_TOKENS, **kwargs,
            )
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    entry = manifest["generations"][0]
    assert entry["status"] == "failed" and type(error).__name__ in entry["error"]
    run = open_recording(tmp_path / "run")
    generation = run.generation()
    assert not generation.complete and type(error).__name__ in generation.error
    # Step 7 was interrupted inside its processors: steps 0-6 are whole (in beam search step 6's token
    # is known only at step 7, so it is recorded as -1, like the last step of a finished search).
    assert generation.num_steps == 7 and generation.sequences is None
    assert_steps_equal(generation.logits(), reference.logits[:7], "logits")
    assert_steps_equal(generation.scores(), reference.scores[:7], "scores")
    assert not list((tmp_path / "run").glob("*.tmp"))


def _killed_run(tmp_path: Path, kill_at: int, committed: int) -> subprocess.CompletedProcess:
    script = ROOT / "tests" / "scripts" / "spill_then_sigkill.py"
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run"), str(kill_at), str(committed)],
        env=env, capture_output=True, text=True, timeout=300,
    )


def test_sigkill_mid_run_leaves_every_committed_shard_readable(tmp_path):
    done = _killed_run(tmp_path, kill_at=23, committed=12)
    assert done.returncode == -9, done.stderr
    steps_per_shard = 4
    run = open_recording(tmp_path / "run")
    generation = run.generation()
    assert not generation.complete and "stopped before this generation ended" in generation.error
    # By step 23 the writer was handed at least the steps but the ring's 4 slots and the shard being
    # filled (12: three shards of 4), and the killing processor waited until it had committed them.
    assert generation.num_steps % steps_per_shard == 0 and 12 <= generation.num_steps <= 23
    # Compared across processes: on one thread each, so that a busy machine (MKL may use fewer threads
    # then) cannot change the order of a sum.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = _reference(make_tiny("gpt2"), max_new_tokens=30, min_new_tokens=30, do_sample=True)
    finally:
        torch.set_num_threads(threads)
    steps = generation.num_steps
    assert_steps_equal(generation.logits(), reference.logits[:steps], "logits")
    assert_steps_equal(generation.scores(), reference.scores[:steps], "scores")
    prompt = left_padded_batch()["input_ids"].shape[1]
    assert torch.equal(torch.stack(generation.tokens(), 1), reference.sequences[:, prompt : prompt + steps])


@pytest.mark.parametrize("shards_written", [2, 3])  # 3: only the last shard, written after the loop
def test_a_full_disk_gives_a_clear_error_and_keeps_earlier_shards(gpt2, tmp_path, monkeypatch, shards_written):
    real = _shard_store.save_file
    calls = {"n": 0}

    def save_file_until_full(tensors, filename, metadata=None):
        calls["n"] += 1
        if calls["n"] > shards_written:
            raise OSError(errno.ENOSPC, "No space left on device", str(filename))
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(_shard_store, "save_file", save_file_until_full)
    reference = _reference(gpt2)
    with Recorder(gpt2, spill_dir=tmp_path / "run", shard_bytes=3 * _step_bytes(3, scores=False)) as rec:
        torch.manual_seed(0)
        with pytest.raises(SpillError, match="No space left on device.*intact and readable") as raised:
            gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=NEW_TOKENS)
    assert raised.value.errno == errno.ENOSPC
    assert not rec.generation().complete
    generation = open_recording(tmp_path / "run").generation()
    assert not generation.complete and "SpillError" in generation.error
    assert generation.num_steps == 3 * shards_written
    assert_steps_equal(generation.scores(), reference.scores[: 3 * shards_written], "scores")
    assert not list((tmp_path / "run").glob("*.tmp"))


def _mount_tiny_filesystem(path: Path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


def test_a_really_full_filesystem(tmp_path):
    """The same on a real 1 MiB filesystem (needs root to mount one; skipped otherwise)."""
    mount = tmp_path / "small"
    if not _mount_tiny_filesystem(mount, "1m"):
        pytest.skip("cannot mount a tmpfs here (needs root); the monkeypatched full-disk test covers the path")
    try:
        model = make_tiny("gpt2")
        with Recorder(model, spill_dir=mount / "run", shard_bytes=200_000) as rec:
            with pytest.raises(SpillError, match="No space left on device") as raised:
                model.generate(**left_padded_batch((3, 6, 8) * 8), logits_processor=[rec],
                               max_new_tokens=100, min_new_tokens=100)
        assert raised.value.errno == errno.ENOSPC
        generation = open_recording(mount / "run").generation()
        assert not generation.complete and 0 < generation.num_steps < 100
        assert len(generation.logits()) == generation.num_steps
    finally:
        del rec
        gc.collect()  # drop the shard mappings, so that the filesystem can go
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"spill_dir": 5}, TypeError, "`spill_dir` must be a path"),
        ({"shard_bytes": 1000}, ValueError, "pass `spill_dir` too"),
        ({"spill_dir": "X", "shard_bytes": 0}, ValueError, "`shard_bytes` must be at least 1"),
        ({"spill_dir": "X", "shard_bytes": 1.5}, TypeError, "`shard_bytes` must be an int"),
    ],
)
def test_bad_spill_options(gpt2, tmp_path, options, error, match):
    if options.get("spill_dir") == "X":
        options = {**options, "spill_dir": tmp_path / "run"}
    with pytest.raises(error, match=match):
        Recorder(gpt2, **options)


def test_spill_dir_must_be_new_or_empty(gpt2, tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is not empty"):
        Recorder(gpt2, spill_dir=tmp_path / "used")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is not a directory"):
        Recorder(gpt2, spill_dir=tmp_path / "file")
    assert (tmp_path / "used" / "notes.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    with Recorder(gpt2, spill_dir=tmp_path / "empty") as rec:
        with pytest.raises(ValueError, match="stay on disk"):
            rec.clear()
    # An empty recording is readable at once.
    assert len(open_recording(tmp_path / "empty")) == 0


def test_a_call_that_fails_before_its_first_step(gpt2, tmp_path):
    with Recorder(gpt2, spill_dir=tmp_path / "run") as rec:
        with pytest.raises(Boom):
            gpt2.generate(**left_padded_batch(), logits_processor=[rec, FailAtStep(0, Boom())], max_new_tokens=4)
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=4)
    first, second = open_recording(tmp_path / "run")
    assert not first.complete and first.num_steps == 0 and first.logits() == () and first.tokens() == ()
    assert second.complete and second.num_steps == 4


def test_a_huge_shard_size_is_capped_by_the_steps_the_call_can_run(gpt2, tmp_path):
    with Recorder(gpt2, spill_dir=tmp_path / "run", shard_bytes=2**40) as rec:
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=4)
    generation = open_recording(tmp_path / "run").generation()
    assert generation.complete and generation.num_steps == 4


def test_any_failure_of_the_store_closes_the_generation_as_failed(gpt2, tmp_path, monkeypatch):
    """Not only disk errors: e.g. no host memory left for a shard buffer."""
    real = _shard_buffer.ShardBuffer.reset
    calls = {"n": 0}

    def reset_until_out_of_memory(self, index, capacity):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("DefaultCPUAllocator: not enough memory")
        real(self, index, capacity)

    monkeypatch.setattr(_shard_buffer.ShardBuffer, "reset", reset_until_out_of_memory)
    with Recorder(gpt2, spill_dir=tmp_path / "run", shard_bytes=3 * _step_bytes(3, scores=False)) as rec:
        with pytest.raises(RuntimeError, match="not enough memory"):
            gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=NEW_TOKENS)
    assert len(rec.generations) == 1 and not rec.generation().complete
    generation = open_recording(tmp_path / "run").generation()
    assert "not enough memory" in generation.error and generation.num_steps == 6


def test_a_removed_spill_dir_gives_a_spill_error_before_the_next_call_runs(gpt2, tmp_path):
    import shutil

    forwards = {"n": 0}
    handle = gpt2.register_forward_hook(lambda *args: forwards.__setitem__("n", forwards["n"] + 1))
    with Recorder(gpt2, spill_dir=tmp_path / "run") as rec:
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=2)
        shutil.rmtree(tmp_path / "run")
        before = forwards["n"]
        with pytest.raises(SpillError, match="cannot write to `spill_dir`.*still exists"):
            gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=2)
        assert forwards["n"] == before
    handle.remove()


def test_beam_accessors_of_a_beam_generation_without_steps(gpt2, tmp_path):
    with Recorder(gpt2, spill_dir=tmp_path / "run") as rec:
        with pytest.raises(Boom):
            gpt2.generate(**left_padded_batch(), logits_processor=[rec, FailAtStep(0, Boom())], max_new_tokens=4,
                          num_beams=2)
    generation = open_recording(tmp_path / "run").generation()
    assert generation.is_beam and generation.beam_parents() == () and generation.num_steps == 0


@pytest.mark.slow
def test_a_reader_beside_the_writer_sees_the_committed_steps_and_they_never_change(tmp_path):
    """Another process watches a long spilling run: every open of the directory gives a whole manifest,
    the steps committed so far (never fewer than the last open saw), and each step, once read, reads
    the same in every later open, the finished recording included."""
    path = tmp_path / "run"
    script = ROOT / "tests" / "scripts" / "spill_then_sigint.py"  # run to its end: no signal is sent
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}
    writer = subprocess.Popen([sys.executable, str(script), str(path), "120"], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert writer.stdout.readline() == "ready\n"
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # step -> (logits, tokens) as first read
    opens, counts = 0, []
    while True:
        done = writer.poll() is not None
        run = open_recording(path)  # any RecordingError here is a torn or damaged manifest
        opens += 1
        if run.generations:
            generation = run.generation()
            counts.append(generation.num_steps)
            new = range(max(seen, default=-1) + 1, generation.num_steps)
            old = list(seen)[:: max(1, len(seen) // 8)]  # a sample of the steps read before
            for step in [*new, *old]:
                one = range(step, step + 1)
                logits, tokens = generation.logits(steps=one)[0].clone(), generation.tokens(steps=one)[0].clone()
                if step in seen:
                    assert torch.equal(logits, seen[step][0]) and torch.equal(tokens, seen[step][1]), f"step {step} changed"
                else:
                    seen[step] = (logits, tokens)
        run.close()
        if done:
            break
    assert writer.wait() == 0
    writer.stdout.close()
    assert counts == sorted(counts), "the committed steps went backwards"
    assert opens > 10 and len(set(counts)) > 5, f"the reader saw too little of the run ({opens} opens: {counts})"
    final = open_recording(path).generation()
    assert final.complete and final.num_steps == 120 == len(seen)
    for step, (logits, tokens) in seen.items():
        one = range(step, step + 1)
        assert torch.equal(final.logits(steps=one)[0], logits) and torch.equal(final.tokens(steps=one)[0], tokens)


@pytest.mark.parametrize("hard_links", [True, False], ids=["link", "no-hard-links"])
def test_the_first_manifest_appears_whole_and_claims_the_directory_once(tmp_path, monkeypatch, hard_links):
    from transformers_offload.store import files as _files

    if not hard_links:
        def no_link(source, target):
            raise OSError(errno.EPERM, "hard links not supported")

        monkeypatch.setattr(os, "link", no_link)
    _files.create_manifest(tmp_path, {"format": "x", "generations": []})
    assert json.loads((tmp_path / "manifest.json").read_text()) == {"format": "x", "generations": []}
    with pytest.raises(FileExistsError):
        _files.create_manifest(tmp_path, {"format": "y"})
    assert json.loads((tmp_path / "manifest.json").read_text())["format"] == "x"
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]  # no temporary file left


def test_shards_are_sized_by_what_the_call_can_take_unless_shard_bytes_says(tmp_path):
    # Issue 54: the writer's three shard buffers follow the call (`shard_writer.shard_size`: a 128th of its steps'
    # bytes at its max_new_tokens, from 8 MiB to 64 MiB), not 64 MiB whatever the step; `shard_bytes=` sets them.
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    vocab = 49_152  # SmolLM2's: 3 rows of logits take 576 KiB a step
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=vocab, n_positions=128,
                                       bos_token_id=0, eos_token_id=None, pad_token_id=0)).eval()
    batch = left_padded_batch()
    for name, options in (("default", {}), ("given", {"shard_bytes": 3 * 2**20})):
        with Recorder(model, spill_dir=tmp_path / name, **options) as rec:
            model.generate(**batch, logits_processor=[rec], max_new_tokens=40, min_new_tokens=40, do_sample=False,
                           pad_token_id=0)
        run = open_recording(tmp_path / name)
        described = run.describe()["generations"][0]
        assert run.generation().complete and described["num_steps"] == 40
        per_step = {name: stream["bytes"] // 40 for name, stream in described["streams"].items()}
        step_bytes = sum(per_step.values())
        assert per_step["logits"] == 3 * vocab * 4 and step_bytes == 3 * (vocab * 4 + 8 + 1)  # scores are the logits
        shard_bytes = options.get("shard_bytes", shard_size(step_bytes * 40))
        capacity = shard_bytes // step_bytes
        written = [shard["num_steps"] for shard in json.loads((tmp_path / name / "manifest.json").read_text())
                   ["generations"][0]["shards"]]
        assert written == [capacity] * (40 // capacity) + [40 % capacity] * bool(40 % capacity), (name, written)
    assert shard_size(step_bytes * 40) == 8 * 2**20  # 23 MiB of steps: the floor, 14 steps a shard (64 MiB: all 40)
    assert shard_size(0) == 8 * 2**20 and shard_size(2**31) == 16 * 2**20 and shard_size(2**40) == 64 * 2**20
