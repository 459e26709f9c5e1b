"""Reinforcement learning over two real processes under `accelerate launch` (torchrun underneath, gloo on CPU):
each process records its own rollouts to `OUT/rank-R`, and `open_recording(OUT)` reads them back as one; the
plain PyTorch loop (examples/rl_loop.py) and TRL's GRPO (`RecordedGRPOTrainer`) both replay the policy over the
kept sets, so each process's trainer/sampler log ratio stays within float32 rounding of 0."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from transformers_offload import kept_sets, open_recording

from ..helpers import TRANSFORMERS

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # two processes each import torch and transformers


def _launch(script: Path, *arguments: str, cwd: Path) -> list[dict]:
    with socket.socket() as probe:  # a free port: accelerate's default (29500) is shared by tests running at once
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--main_process_port", str(port), "--mixed_precision", "no",
               "--dynamo_backend", "no", str(script), *arguments]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=cwd)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    # each process prints JSON lines (two processes' lines can share a line of the merged output); TRL's own
    # logs are Python dicts (`{'loss': ...}`), not JSON
    return [json.loads(found) for found in re.findall(r'\{"[^{}]*\}', done.stdout)]


def test_the_plain_loop_under_accelerate_launch_records_each_rank_and_replays(tmp_path):
    out = tmp_path / "rl"
    lines = _launch(ROOT / "examples" / "rl_loop.py", "--tiny", "--steps", "2", "--out", str(out), cwd=tmp_path)
    steps = [line for line in lines if "step" in line]
    assert sorted((line["rank"], line["step"]) for line in steps) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(line["tokens"] > 0 and line["max_abs_log_ratio"] <= 1e-5 for line in steps), steps
    run = open_recording(out)
    assert sorted(path.name for path in out.iterdir()) == ["rank-0", "rank-1"]
    assert len(run.generations) == 4 and sorted(set(run.generation_ranks)) == [0, 1]
    kept = kept_sets(run)  # every rank's rollouts in one layout
    assert kept.rows == sum(generation.num_rows for generation in run.generations) == 4 * 8


def test_trl_grpo_under_accelerate_launch_records_each_rank_and_replays(tmp_path):
    try:
        import trl.trainer.grpo_trainer  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any failure to import: skipped, saying why
        pytest.skip(f"TRL does not import with transformers {TRANSFORMERS}: {error}")
    out = tmp_path / "grpo"
    lines = _launch(ROOT / "tests" / "integrations" / "scripts" / "grpo_two_ranks.py", str(out), cwd=tmp_path)
    assert sorted(line["rank"] for line in lines) == [0, 1] and {line["processes"] for line in lines} == {2}
    for line in lines:  # TRL gathers its metrics over both processes: replayed, the ratio is 1 within rounding
        assert len(line["ratio_mean"]) == 2 and all(abs(mean - 1) <= 1e-5 for mean in line["ratio_mean"]), line
        assert all(value <= 1e-5 for value in line["logp_difference_max"]), line
    run = open_recording(out)
    assert sorted(path.name for path in out.iterdir()) == ["rank-0", "rank-1"]
    assert sorted(set(run.generation_ranks)) == [0, 1] and len(run.generations) == 4  # a rollout call per step and rank
    assert kept_sets(run).rows == 4 * 2  # each call: one prompt's 2 completions
