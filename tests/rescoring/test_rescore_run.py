"""`python -m transformers_offload rescore`: a recording directory rescored by real processes, resumed, and
split over ranks (as torchrun sets RANK and WORLD_SIZE)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from transformers_offload import Recorder, open_recording
from transformers_offload.rescoring.run import rescore_recording

from ..helpers import EOS, PAD, left_padded_batch, make_tiny

GENERATIONS = 4
# Real processes (40 s here): the newest release runs them; the version matrix runs the in-process tests
# of test_rescore.py and test_rescore_releases.py, which replay on each release.
pytestmark = pytest.mark.slow


@pytest.fixture
def source(tmp_path):
    """A tiny model saved to disk and a recording of 4 calls of it, each with named samples."""
    model = make_tiny("llama")
    model.save_pretrained(tmp_path / "model")
    with Recorder(model, spill_dir=tmp_path / "run") as rec:
        for call in range(GENERATIONS):
            rec.set_samples([f"s{call}-{row}" for row in range(3)])
            torch.manual_seed(call)
            model.generate(**left_padded_batch(seed=call), logits_processor=[rec], max_new_tokens=5, pad_token_id=PAD,
                           eos_token_id=EOS, do_sample=call % 2 == 1, num_beams=2 if call == 2 else 1)
    return tmp_path, model


def _cli(*args, env=None):
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "transformers_offload", "rescore", *map(str, args), "--no-progress", "--json"],
                          capture_output=True, text=True, env=environment, timeout=600)


def _assert_same_logits(a, b):
    by_samples = {tuple(map(str, g.sample_ids)): g for g in open_recording(b).generations}
    originals = open_recording(a).generations
    assert sorted(by_samples) == sorted(tuple(map(str, g.sample_ids)) for g in originals)
    for original in originals:
        rescored = by_samples[tuple(map(str, original.sample_ids))]
        assert rescored.complete
        for x, y in zip(original.logits(), rescored.logits()):
            assert torch.equal(x, y)


def test_the_command_rescores_every_generation_and_resumes(source):
    tmp_path, _ = source
    done = _cli(tmp_path / "run", "--model", tmp_path / "model", "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rescored"] == GENERATIONS
    _assert_same_logits(tmp_path / "run", tmp_path / "out")
    again = _cli(tmp_path / "run", "--model", tmp_path / "model", "--out", tmp_path / "out")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) | {"seconds": 0} == {"rescored": 0, "skipped": GENERATIONS, "steps": 0, "seconds": 0,
                                                         "rank": 0, "world_size": 1}


def test_a_resume_rescores_only_what_is_missing(source):
    tmp_path, _ = source
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()  # as the command loads it: same name
    first = rescore_recording(tmp_path / "run", model, tmp_path / "out", rank=0, world_size=2, progress=False)
    assert first["rescored"] == GENERATIONS // 2
    rest = _cli(tmp_path / "run", "--model", tmp_path / "model", "--out", tmp_path / "out")
    assert rest.returncode == 0, rest.stderr
    assert json.loads(rest.stdout)["rescored"] == GENERATIONS - GENERATIONS // 2
    _assert_same_logits(tmp_path / "run", tmp_path / "out")


def test_two_ranks_share_the_generations(source):
    tmp_path, _ = source
    ranks = [subprocess.Popen([sys.executable, "-m", "transformers_offload", "rescore", str(tmp_path / "run"), "--model",
                               str(tmp_path / "model"), "--out", str(tmp_path / "out"), "--no-progress", "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "RANK": str(rank),
                                   "WORLD_SIZE": "2"})
             for rank in range(2)]
    results = [rank.communicate(timeout=600) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], [err for _, err in results]
    assert sum(json.loads(out)["rescored"] for out, _ in results) == GENERATIONS
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("rank-")) == ["rank-0", "rank-1"]
    _assert_same_logits(tmp_path / "run", tmp_path / "out")


def test_bad_input_is_refused_before_the_model_loads(source, tmp_path):
    base, _ = source
    assert _cli(base / "run", "--model", base / "model", "--out", tmp_path / "x", "--dtype", "int8").returncode == 2
    missing = _cli(base / "nothing", "--model", base / "model", "--out", tmp_path / "x")
    assert missing.returncode == 1 and "error:" in missing.stderr
    scores = _cli(base / "run", "--model", base / "model", "--out", tmp_path / "y", "--streams", "logits,scores")
    assert scores.returncode == 1 and "Processed scores" in scores.stderr


def test_a_source_without_sample_ids_goes_to_a_new_out_with_one_process(tmp_path):
    model = make_tiny("gpt2")
    with Recorder(model, spill_dir=tmp_path / "run") as rec:
        model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=3, pad_token_id=PAD)
    rescore_recording(tmp_path / "run", model, tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="no sample ids"):
        rescore_recording(tmp_path / "run", model, tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="no sample ids"):
        rescore_recording(tmp_path / "run", model, tmp_path / "other", rank=1, world_size=2, progress=False)


def test_the_jobs_print_no_deprecation_of_transformers(source):
    """`record`, `score` and `rescore` (both modes), each in a fresh process (transformers logs a deprecation once
    per process), print none of transformers' deprecation warnings: what they call is each release's current API
    (5.24 renamed `past_key_values` to `cache`, and logs when the old name is passed or read)."""
    from ..helpers import record_tokenizer, write_prompts

    tmp_path, _ = source
    record_tokenizer().save_pretrained(tmp_path / "model")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"w{3 + (i * 37) % 120}" for i in range(40)), encoding="utf-8")
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}
    commands = {
        "record": ["record", "--model", tmp_path / "model", "--prompts", write_prompts(tmp_path / "p.jsonl", 3),
                   "--max-new-tokens", "3", "--out", tmp_path / "recorded"],
        "score": ["score", "--model", tmp_path / "model", "--text", corpus, "--context", "16", "--out", tmp_path / "scored"],
        "rescore decode": ["rescore", tmp_path / "run", "--model", tmp_path / "model", "--out", tmp_path / "decode"],
        "rescore forward": ["rescore", tmp_path / "recorded", "--model", tmp_path / "model", "--mode", "forward", "--out",
                            tmp_path / "forward"],  # of `record`'s greedy recording (forward mode refuses beam search)
    }
    for name, command in commands.items():
        done = subprocess.run([sys.executable, "-m", "transformers_offload", *map(str, command), "--no-progress"],
                              capture_output=True, text=True, env=environment, timeout=600)
        assert done.returncode == 0, (name, done.stderr)
        said = [line for line in done.stderr.splitlines() if "deprecat" in line.lower() and "transformers" in line.lower()]
        assert not said, (name, said)
