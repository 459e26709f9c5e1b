"""scripts/check.sh, CI's test command, with its stages replaced by stand-ins (CHECK_SUITE,
CHECK_MATRIX, CHECK_SUPPORT): every stage runs even after one fails, the summary lists them all,
and the exit status says whether any failed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("suite", "matrix", "support")


def _check(tmp_path: Path, *arguments: str, failing: dict[str, int] | None = None) -> subprocess.CompletedProcess:
    """Run check.sh with stand-in stages that append their name to tmp_path/ran and exit as `failing` says."""
    failing = failing or {}
    env = dict(os.environ)
    for stage in STAGES:
        env[f"CHECK_{stage.upper()}"] = f"echo {stage} >>'{tmp_path / 'ran'}'; exit {failing.get(stage, 0)}"
    return subprocess.run(["bash", str(ROOT / "scripts" / "check.sh"), *arguments], env=env, capture_output=True,
                          text=True, timeout=60)


def _ran(tmp_path: Path) -> list[str]:
    return (tmp_path / "ran").read_text().split() if (tmp_path / "ran").exists() else []


def _summary(stdout: str) -> list[str]:
    return stdout.split("== check: summary\n", 1)[1].splitlines()


@pytest.mark.parametrize("stage", STAGES)
def test_a_failed_stage_does_not_stop_the_others_and_the_summary_lists_every_stage(tmp_path, stage):
    done = _check(tmp_path, failing={stage: 3})
    assert done.returncode == 1, done.stdout + done.stderr
    assert _ran(tmp_path) == list(STAGES)
    summary = _summary(done.stdout)
    outcomes = [line.split()[:2] for line in summary[:3]]
    assert outcomes == [[name, "FAILED" if name == stage else "passed"] for name in STAGES]
    assert "FAILED (exit 3)" in summary[STAGES.index(stage)]
    assert summary[3] == f"check: 1 of 3 stages failed: {stage} (rerun them: bash scripts/check.sh {stage})"


def test_every_failed_stage_is_named(tmp_path):
    done = _check(tmp_path, failing={"suite": 1, "support": 2})
    assert done.returncode == 1 and _ran(tmp_path) == list(STAGES)
    assert _summary(done.stdout)[-1] == (
        "check: 2 of 3 stages failed: suite support (rerun them: bash scripts/check.sh suite support)")


def test_all_stages_passing_exit_zero(tmp_path):
    done = _check(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _ran(tmp_path) == list(STAGES)
    assert _summary(done.stdout)[-1] == "check: all 3 stages passed"


def test_named_stages_run_alone_and_an_unknown_one_is_refused(tmp_path):
    done = _check(tmp_path, "support", "matrix", failing={"suite": 1})
    assert done.returncode == 0 and _ran(tmp_path) == ["support", "matrix"]
    refused = _check(tmp_path / "none", "tests")
    assert refused.returncode == 2 and "unknown stage 'tests' (stages: suite matrix support)" in refused.stderr
