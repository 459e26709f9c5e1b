"""scripts/check.sh, CI's test command, with its stages replaced by stand-ins (CHECK_LINT, CHECK_PACKAGE, CHECK_SUITE,
CHECK_MATRIX, CHECK_SUPPORT, CHECK_CONFORMANCE): every stage runs even after one fails, the summary lists them all,
and the exit status says whether any failed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from .helpers import ROOT

STAGES = ("lint", "package", "suite", "matrix", "support", "conformance")


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
    outcomes = [line.split()[:2] for line in summary[:6]]
    assert outcomes == [[name, "FAILED" if name == stage else "passed"] for name in STAGES]
    assert "FAILED (exit 3)" in summary[STAGES.index(stage)]
    assert summary[6] == f"check: 1 of 6 stages failed: {stage} (rerun them: bash scripts/check.sh {stage})"


def test_every_failed_stage_is_named(tmp_path):
    done = _check(tmp_path, failing={"suite": 1, "support": 2})
    assert done.returncode == 1 and _ran(tmp_path) == list(STAGES)
    assert _summary(done.stdout)[-1] == (
        "check: 2 of 6 stages failed: suite support (rerun them: bash scripts/check.sh suite support)")


def test_all_stages_passing_exit_zero(tmp_path):
    done = _check(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _ran(tmp_path) == list(STAGES)
    assert _summary(done.stdout)[-1] == "check: all 6 stages passed"


def test_named_stages_run_alone_and_an_unknown_one_is_refused(tmp_path):
    done = _check(tmp_path, "support", "matrix", failing={"suite": 1})
    assert done.returncode == 0 and _ran(tmp_path) == ["support", "matrix"]
    refused = _check(tmp_path / "none", "tests")
    assert refused.returncode == 2
    assert "unknown stage 'tests' (stages: lint package suite matrix support conformance)" in refused.stderr


def test_a_stage_that_exits_77_is_reported_skipped_not_passed(tmp_path):
    done = _check(tmp_path, failing={"conformance": 77})
    assert done.returncode == 0, done.stdout + done.stderr
    summary = _summary(done.stdout)
    assert summary[5].split()[:2] == ["conformance", "skipped"]
    assert summary[-1] == "check: 5 of 6 stages passed; skipped: conformance"


@pytest.mark.parametrize("ci, status, said", [
    ("", 77, "conformance: skipped: no tree of Hugging Face's generation tests given"),
    ("true", 1, "conformance: FAILED: CI=true and no tree of Hugging Face's generation tests was given"),
])
def test_the_conformance_stage_without_a_tree_is_skipped_on_a_users_machine_and_fails_in_ci(ci, status, said):
    env = {key: value for key, value in os.environ.items() if key not in ("CI", "TRANSFORMERS_OFFLOAD_HF_TESTS")}
    if ci:
        env["CI"] = ci
    done = subprocess.run(["bash", str(ROOT / "scripts" / "conformance.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == status
    assert said in done.stdout + done.stderr


def test_ci_gives_the_conformance_stage_the_shared_tree():
    text = (ROOT / ".ci" / "run").read_text()
    assert "TRANSFORMERS_OFFLOAD_HF_TESTS" in text and "../shared/hf-generation-tests/transformers" in text
