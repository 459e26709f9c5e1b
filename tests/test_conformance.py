"""The conformance plugin (`tests/conformance/offload_conformance.py`), run in a pytest process of its own
on a few generate() calls whose verdict is known: exact, different, refused, raising without the Recorder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

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
    ]
    assert calls[0]["modes"] == ["greedy_search"] and calls[1]["modes"] == ["sample"]
    assert calls[2]["detail"].startswith("mode greedy_search, scores step 0:")
    assert "assistant_early_exit" in calls[3]["detail"]
    tests = [json.loads(line) for line in (out / "tests-main.jsonl").read_text().splitlines()]
    assert {t["outcome"] for t in tests} == {"passed"}
