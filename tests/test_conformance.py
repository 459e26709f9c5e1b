"""The conformance plugin (`tests/conformance/offload_conformance.py`), run in a pytest process of its own
on a few generate() calls whose verdict is known: exact, different, refused, raising without the Recorder."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .helpers import ROOT

CALLS = textwrap.dedent('''
    import pytest
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


    def tiny(cls=GPT2LMHeadModel):
        torch.manual_seed(0)
        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64,
                            bos_token_id=2, eos_token_id=1, pad_token_id=0)
        model = cls(config).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)
        return model


    class Tampered(GPT2LMHeadModel):
        """A generate() that returns other scores than its loop computed."""

        def generate(self, *args, **kwargs):
            out = super().generate(*args, **kwargs)
            out.scores = tuple(step + 1 for step in out.scores)
            return out


    IDS = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])


    def test_greedy_and_sampling():
        model = tiny()
        plain = model.generate(IDS, max_new_tokens=3, do_sample=False)
        torch.manual_seed(1)
        sampled = model.generate(IDS, max_new_tokens=3, do_sample=True, top_k=5)
        assert plain.shape == sampled.shape == (2, 7)


    def test_tampered_scores():
        out = tiny(Tampered).generate(IDS, max_new_tokens=3, return_dict_in_generate=True, output_scores=True,
                                      output_logits=True)
        assert len(out.scores) == 3


    def test_early_exit_assistance():
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, bos_token_id=2, eos_token_id=1, pad_token_id=0)
        LlamaForCausalLM(config).eval().generate(IDS[:1], max_new_tokens=2, assistant_early_exit=1)


    def test_low_memory_raises_anyway():
        with pytest.raises(ValueError):
            tiny().generate(IDS, max_new_tokens=2, num_beams=2, low_memory=True)


    def test_a_tree_older_than_the_release():
        # What Hugging Face's tests of February 2026 call and 5.25 dropped (the plugin's one shim).
        model = tiny()
        assert model._is_stateful is False
        model.generate(IDS[:1], max_new_tokens=2, cache_implementation="dynamic_full")
''')


@pytest.mark.slow  # a pytest session of its own in a subprocess: the conformance harness runs on the newest release
def test_plugin_gives_each_call_its_verdict_and_leaves_the_tests_outcomes_alone(tmp_path):
    (tmp_path / "test_calls.py").write_text(CALLS)
    out = tmp_path / "out"
    # Its own pytest session, not an xdist worker of this one (the worker's name would name the files).
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_XDIST")}
    env.update({"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "conformance"), str(ROOT)])})
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "offload_conformance", "--conformance-out", str(out), "-q",
         "-p", "no:cacheprovider", "-c", os.devnull, "--rootdir", str(tmp_path), "-W", "ignore", "test_calls.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    calls = [json.loads(line) for line in (out / "calls-main.jsonl").read_text().splitlines()]
    verdicts = [(call["test"].split("::")[1], call["verdict"]) for call in calls]
    assert verdicts == [
        ("test_greedy_and_sampling", "exact"),
        ("test_greedy_and_sampling", "exact"),
        ("test_tampered_scores", "different"),
        ("test_early_exit_assistance", "refused"),
        ("test_low_memory_raises_anyway", "raises"),
        ("test_a_tree_older_than_the_release", "exact"),
    ]
    assert calls[0]["modes"] == ["greedy_search"] and calls[1]["modes"] == ["sample"]
    assert calls[2]["detail"].startswith("mode greedy_search, scores step 0:")
    assert "assistant_early_exit" in calls[3]["detail"]
    tests = [json.loads(line) for line in (out / "tests-main.jsonl").read_text().splitlines()]
    assert {t["outcome"] for t in tests} == {"passed"}


# -- the script's refusals: a run that checked nothing is a failure ------------------------------------
def _script():
    spec = importlib.util.spec_from_file_location("conformance_script", ROOT / "scripts" / "conformance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tree(root: Path, *, without: str | None = None) -> Path:
    """A tree laid out as the transformers repository's, empty files only, less `without`."""
    for part in ("conftest.py", "utils/test_module/__init__.py", "tests/generation/test_utils.py",
                 "tests/models/gpt2/test_modeling_gpt2.py"):
        if without is None or not part.startswith(without):
            (root / part).parent.mkdir(parents=True, exist_ok=True)
            (root / part).write_text("")
    return root


@pytest.mark.release_independent  # the script's check of the tree, before any transformers test runs
@pytest.mark.parametrize("without, missing", [
    ("", "utils/test_module, conftest.py, tests/generation/test_utils.py, tests/models"),  # an empty folder
    ("utils", "utils/test_module"),
    ("conftest.py", "conftest.py"),
])
def test_a_tree_without_what_the_model_tests_need_is_refused_naming_it(tmp_path, without, missing):
    tree = tmp_path / "transformers"
    tree.mkdir()
    if without:
        _tree(tree, without=without)
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "conformance.py"), "--hf-repo", str(tree)],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"it lacks {missing} " in result.stderr


def test_families_the_tree_does_not_hold_are_refused(tmp_path):
    script = _script()
    with pytest.raises(SystemExit) as stopped:
        script._hf_tests("0.0", _tree(tmp_path), ["llama"])
    assert stopped.value.code == 2


@pytest.mark.slow  # a pytest session of its own in a subprocess
def test_a_run_where_a_file_did_not_collect_or_recorded_no_call_is_refused(tmp_path):
    """What the first run on the real tree did (every model test failed to import, 0 calls, exit 0) now
    fails, naming each file; a run where no test ran at all fails too."""
    (tmp_path / "test_broken.py").write_text("import test_module_that_is_not_there\n")
    (tmp_path / "test_quiet.py").write_text("def test_nothing_generates():\n    assert True\n")
    out = tmp_path / "out"
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_XDIST")}
    env.update({"HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "conformance"), str(ROOT)])})
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "offload_conformance", "--conformance-out", str(out), "-q",
         "-p", "no:cacheprovider", "-c", os.devnull, "--rootdir", str(tmp_path), "test_broken.py", "test_quiet.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    (out / "pytest.log").write_text(result.stdout)
    script = _script()
    calls = script._read(out, "calls")
    problems = script._refusals(out, result.returncode, ["test_broken.py", "test_quiet.py"], calls)
    assert result.returncode == 2 and calls == []
    assert problems[0] == f"pytest ended with status 2 (interrupted); see {out / 'pytest.log'}"
    assert problems[1].startswith("test_broken.py failed to collect: E   ModuleNotFoundError: No module named "
                                  "'test_module_that_is_not_there'")
    assert problems[2:] == [f"no test ran (see {out / 'pytest.log'})",
                            "test_broken.py: no generate() call was recorded (its tests ran none, or the plugin did "
                            "not see them)",
                            "test_quiet.py: no generate() call was recorded (its tests ran none, or the plugin did not see them)"]
    assert script._refusals(tmp_path / "nothing", 5, [], None) == [
        f"pytest ended with status 5 (no test collected); see {tmp_path / 'nothing' / 'pytest.log'}",
        f"no test ran (see {tmp_path / 'nothing' / 'pytest.log'})"]


def test_whisper_segments_of_one_loop_are_one_result():
    first, second = {"scores": 1}, {"scores": 2}
    segments = [{"result": first}, {"result": first}, {"result": second}, {"result": first}]
    sys.path.insert(0, str(ROOT / "tests" / "conformance"))
    try:
        from offload_conformance import _loop_results
    finally:
        sys.path.remove(str(ROOT / "tests" / "conformance"))
    assert _loop_results(segments) == [first, second, first]
