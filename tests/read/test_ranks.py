"""Data parallel `record`: each rank records its own block of the prompts into `out/rank-R`, none twice
and none dropped whatever the world size divides, and `open_recording(out)` reads every rank as one
recording in sample order; under torchrun (2 CPU processes, gloo) with a rank killed, then resumed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from transformers_offload import open_recording
from transformers_offload.cli.summary import format_summary
from transformers_offload.errors import RecordingError
from transformers_offload.jobs.claims import claim
from transformers_offload.jobs.parallel import process_rank, share
from transformers_offload.jobs.record import record
from transformers_offload.read.ranks import RankedRecording
from transformers_offload.store.layout import WRITERS

from ..helpers import TESTS, complete_samples, record_model, record_tokenizer, write_prompts

SCRIPT = TESTS / "scripts" / "record_ranks.py"


@pytest.mark.parametrize("count, world_size", [(10, 3), (7, 2), (2, 4), (0, 2), (16, 4)])
def test_shares_cover_every_prompt_once(count, world_size):
    blocks = [share(count, rank, world_size) for rank in range(world_size)]
    assert [p for block in blocks for p in block] == list(range(count))
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


def test_process_rank_reads_torchrun_environment(monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert process_rank() == (0, 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert process_rank() == (1, 3)
    assert process_rank(0, 2) == (0, 2)  # arguments first
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ValueError, match=r"rank 3 of world size 3 \(from the environment"):
        process_rank()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="must be integers"):
        process_rank()
    with pytest.raises(ValueError, match="give both"):
        process_rank(rank=0)


def _record(prompts, out, rank, world_size, **options):
    return record(record_model(), record_tokenizer(), prompts, out, batch_size=2, progress=False, max_new_tokens=3,
                  do_sample=True, rank=rank, world_size=world_size, **options)


def test_ranks_record_their_blocks_and_read_back_as_one_recording(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 9)
    out = tmp_path / "run"
    results = [_record(prompts, out, rank, 2) for rank in (1, 0)]  # the order they run in does not matter
    assert [(r["rank"], r["recorded"], r["generations"]) for r in results] == [(1, 5, 3), (0, 4, 2)]
    assert sorted(p.name for p in out.iterdir()) == ["rank-0", "rank-1"]
    run = open_recording(out, verify=True)
    assert isinstance(run, RankedRecording) and run.ranks == (0, 1)
    assert [s["sample"] for s in run.samples()] == [f"s{i:03d}" for i in range(9)]  # in sample order
    assert [g.index for g in run.generations] == list(range(5))
    assert run.generation_ranks == (0, 0, 1, 1, 1)
    # Each generation reads its own rank's shards: the same tensors as that rank's recording.
    own = open_recording(out / "rank-1")
    assert torch.equal(run.generation(2).sequences, own.generation(0).sequences)
    assert all(torch.equal(a, b) for a, b in zip(run.scores(2), own.scores(0)))
    summary = run.describe()
    assert summary["ranks"] == [0, 1] and [g["rank"] for g in summary["generations"]] == [0, 0, 1, 1, 1]
    assert "5 generation(s) from 2 rank(s)" in format_summary(summary)
    assert "generation 2 (rank 1, its generation 0)" in format_summary(summary)
    table = pytest.importorskip("transformers_offload.answers.table").to_arrow(run)
    assert table.column("sample").to_pylist()[0] == "s000" and table.num_rows == 9 * 3
    # A rerun with another world size records nothing: every sample is complete on some rank.
    assert sum(_record(prompts, out, rank, 3)["recorded"] for rank in range(3)) == 0
    assert complete_samples(out) == Counter(f"s{i:03d}" for i in range(9))


def test_ranks_come_back_in_the_natural_order_of_their_ids(tmp_path):
    lines = [{"id": f"q{i}", "text": f"w{3 + i}"} for i in range(12)]  # q0..q11: "q10" sorts before "q4" as text
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    for rank in (0, 1):
        _record(tmp_path / "p.jsonl", tmp_path / "run", rank, 2)
    assert [s["sample"] for s in open_recording(tmp_path / "run").samples()] == [f"q{i}" for i in range(12)]


def test_a_rerun_with_more_ranks_records_only_what_is_missing(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 10)
    out = tmp_path / "run"
    _record(prompts, out, 0, 2)  # rank 1 never ran: s005..s009 are missing
    assert sum(complete_samples(out).values()) == 5
    results = [_record(prompts, out, rank, 3) for rank in range(3)]
    assert [r["recorded"] for r in results] == [0, 1, 4]  # blocks 0-2, 3-5, 6-9: s005 falls to rank 1
    assert complete_samples(out) == Counter(f"s{i:03d}" for i in range(10))


def test_ranks_refuse_a_single_process_recording_and_another_model(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 4)
    record(record_model(), record_tokenizer(), prompts, tmp_path / "single", batch_size=2, progress=False, max_new_tokens=2)
    with pytest.raises(ValueError, match="holds a recording one process wrote"):
        _record(prompts, tmp_path / "single", 0, 2)
    out = tmp_path / "run"
    _record(prompts, out, 0, 2)
    from transformers import GPT2Config, GPT2LMHeadModel

    other = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=200))
    record(other, record_tokenizer(), prompts, out / "rank-1", batch_size=2, progress=False, max_new_tokens=2)
    with pytest.raises(RecordingError, match="recorded another model"):
        open_recording(out)
    # One process resuming a ranked run writes into rank-0 (the ranks' layout is kept).
    assert _record(prompts, tmp_path / "run2", 1, 2)["recorded"] == 2
    assert record(record_model(), record_tokenizer(), prompts, tmp_path / "run2", batch_size=2, progress=False,
                  max_new_tokens=2)["recorded"] == 2
    assert sorted(p.name for p in (tmp_path / "run2").iterdir()) == ["rank-0", "rank-1"]


def _torchrun(tmp_path: Path, model_dir: Path, prompts: Path, out: Path, kill: str,
              accelerate: bool = False) -> subprocess.CompletedProcess:
    command, env = _torchrun_command(model_dir, prompts, out, KILL_RANK_1_IN_CALL=kill,
                                     USE_ACCELERATE="1" if accelerate else "0")
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)


def _torchrun_command(model_dir: Path, prompts: Path, out: Path, **variables: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment that run `SCRIPT` on 2 gloo ranks, with the script's `variables`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(SCRIPT), str(model_dir), str(prompts), str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **variables,
           "PYTHONPATH": os.pathsep.join([str(SCRIPT.parents[2]), os.environ.get("PYTHONPATH", "")])}
    return command, env


@pytest.mark.slow
def test_two_gloo_ranks_under_torchrun_with_one_killed_then_resumed(tmp_path):
    """24 prompts, batches of 4, 2 ranks: rank 1 SIGKILLs itself in its third call; the rerun (through
    accelerate's PartialState) records only what is missing: every sample complete once."""
    model_dir = tmp_path / "model"
    record_model().save_pretrained(model_dir)
    record_tokenizer().save_pretrained(model_dir)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 24)
    out = tmp_path / "run"
    killed = _torchrun(tmp_path, model_dir, prompts, out, kill="3")  # rank 1 SIGKILLs itself in its 3rd call
    assert killed.returncode != 0, killed.stdout + killed.stderr
    before = complete_samples(out)
    # Rank 1 completed 2 calls of 4 samples (s012..s019) before its kill; rank 0 got all or part of its 12.
    assert sum(count for sample, count in before.items() if sample >= "s012") == 8
    assert max(before.values()) == 1
    failed = [g for g in open_recording(out / "rank-1").generations if not g.complete]
    assert len(failed) == 1 and failed[0].num_steps >= 1  # the killed call's steps stay readable
    for stale in tmp_path.glob("result-*.json"):
        stale.unlink()
    # Resumed with the process group accelerate's PartialState sets up, where accelerate is installed.
    try:
        import accelerate  # noqa: F401
    except ImportError:
        accelerate = None
    resumed = _torchrun(tmp_path, model_dir, prompts, out, kill="", accelerate=accelerate is not None)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    results = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert sum(r["recorded"] for r in results) == 24 - sum(before.values())
    assert sum(r["skipped"] for r in results) == sum(before.values())
    assert complete_samples(out) == Counter(f"s{i:03d}" for i in range(24))  # none twice, none lost
    print(json.dumps({"complete_before": sum(before.values()), "resumed": results}))
    run = open_recording(out, verify=True)
    complete = [s["sample"] for s in run.samples() if run.generation(s["generation"]).complete]
    assert complete == [f"s{i:03d}" for i in range(24)]


def test_a_run_refuses_the_samples_a_running_writer_claims_and_clears_a_stopped_ones(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 4)
    out = tmp_path / "run"
    with claim(out, lambda: ["s002"], rank=1, world_size=2, target=out / "rank-1"):  # a writer still at s002
        with pytest.raises(BlockingIOError, match=rf"1 of the samples this run would record \(s002\) are being "
                           rf"recorded by another process: pid {os.getpid()} on host .*, rank 1 of 2, writing "
                           rf"'.*rank-1' since .*Wait for it to finish \(or stop it\)"):
            record(record_model(), record_tokenizer(), prompts, out, batch_size=2, progress=False, max_new_tokens=2)
        assert _record(prompts, out, 0, 2)["recorded"] == 2  # rank 0's share (s000, s001) is free
    assert not (out / WRITERS).exists()  # the last claim released takes the directory with it
    # A claim nobody holds (its process was killed) is cleared: the samples are recorded.
    (out / WRITERS).mkdir()
    (out / WRITERS / "claim-old.json").write_text(json.dumps({"pid": 1, "samples": ["s002", "s003"]}))
    assert record(record_model(), record_tokenizer(), prompts, out, batch_size=2, progress=False,
                  max_new_tokens=2)["recorded"] == 2
    assert complete_samples(out) == Counter(f"s{i:03d}" for i in range(4)) and not (out / WRITERS).exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match="is not a directory"):
        record(record_model(), record_tokenizer(), prompts, tmp_path / "file", progress=False, max_new_tokens=2)


@pytest.mark.slow
def test_a_resume_started_while_torchrun_ranks_write_refuses_their_samples(tmp_path):
    """16 prompts, batches of 4, 2 ranks: rank 1 stops inside its second call, after rank 0 finished its
    share and closed its directory; a 1-process resume started then is refused, naming rank 1's process,
    and records nothing; once rank 1 goes on, every sample is complete once."""
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "model"
    record_model().save_pretrained(model_dir)
    record_tokenizer().save_pretrained(model_dir)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 16)
    out = tmp_path / "run"
    command, env = _torchrun_command(model_dir, prompts, out, PAUSE_RANK_1_IN_CALL="2")
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()  # the ranks' model
    options = dict(batch_size=4, progress=False, max_new_tokens=24, min_new_tokens=24)
    with open(tmp_path / "torchrun.log", "wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 300  # a hang detector, not a timing: the ranks need seconds
        while time.monotonic() < deadline and process.poll() is None and not (
                (tmp_path / "paused-1.json").is_file() and _complete_samples_or_none(out / "rank-0") == 8):
            time.sleep(0.05)
        assert process.poll() is None, (tmp_path / "torchrun.log").read_text()
        before = complete_samples(out)
        assert sum(before.values()) == 8 + 4  # rank 0's share and rank 1's first call
        pid = json.loads((tmp_path / "paused-1.json").read_text())["pid"]
        with pytest.raises(BlockingIOError, match=rf"4 of the samples .* \(s012, s013, s014, s015\) .* pid {pid} "
                                                  rf"on host .*, rank 1 of 2, writing '.*rank-1'"):
            record(model, record_tokenizer(), prompts, out, **options)
        assert complete_samples(out) == before  # the refused resume wrote nothing
    finally:
        (tmp_path / "resume-1").touch()
        process.wait(timeout=600)
    assert process.returncode == 0, (tmp_path / "torchrun.log").read_text()
    assert complete_samples(out) == Counter(f"s{i:03d}" for i in range(16))  # none twice, none lost
    assert record(model, record_tokenizer(), prompts, out, **options)["recorded"] == 0
    assert sorted(p.name for p in out.iterdir()) == ["rank-0", "rank-1"]  # no claim left behind


def _complete_samples_or_none(directory: Path) -> int | None:
    """How many samples the recording in `directory` holds complete, None before it has a manifest."""
    return sum(complete_samples(directory).values()) if (directory / "manifest.json").is_file() else None
