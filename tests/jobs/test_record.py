"""`record`: a prompts file through generate() with a Recorder, keyed by sample id, resumable after an
exception or a SIGKILL: every sample ends up in exactly one complete generation."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, StoppingCriteria, StoppingCriteriaList

from transformers_offload import Recorder, RecordingError, open_recording
from transformers_offload.cli import main
from transformers_offload.jobs.record import read_prompts, record

from ..helpers import complete_samples, record_model, record_tokenizer, write_prompts

VOCAB = 128


def test_record_keys_every_row_by_its_sample_id(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 7)
    result = record(record_model(), record_tokenizer(), prompts, tmp_path / "run", batch_size=3, progress=False,
                    max_new_tokens=4, do_sample=True)
    assert (result["recorded"], result["skipped"], result["generations"]) == (7, 0, 3)
    run = open_recording(tmp_path / "run")
    assert [s["sample"] for s in run.samples()] == [f"s{i:03d}" for i in range(7)]
    assert [len(g.sample_ids) for g in run.generations] == [3, 3, 1]
    # Without an id column, a prompt's id is its line number.
    record(record_model(), record_tokenizer(), write_prompts(tmp_path / "plain.jsonl", 4, ids=False), tmp_path / "plain",
           batch_size=4, progress=False, max_new_tokens=2)
    assert [s["sample"] for s in open_recording(tmp_path / "plain").samples()] == [0, 1, 2, 3]


class _FailOnCall(StoppingCriteria):
    """Raises in the given generate() call (counted over calls), at its second step."""

    calls = 0

    def __init__(self, call):
        self.call, self.steps = call, 0
        type(self).calls += 1
        self.mine = type(self).calls

    def __call__(self, input_ids, scores, **kwargs):
        self.steps += 1
        if self.mine == self.call and self.steps == 2:
            raise RuntimeError("failed on purpose")
        return False  # transformers 4.36 wants a bool; later releases broadcast it over the rows


def test_an_interrupted_run_resumes_and_records_each_sample_once(tmp_path, monkeypatch):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 10)
    model, tokenizer = record_model(), record_tokenizer()
    original = model.generate
    calls = []

    def failing_second_call(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            kwargs["stopping_criteria"] = StoppingCriteriaList([_FailOnCall(_FailOnCall.calls + 1)])
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "generate", failing_second_call)
    with pytest.raises(RuntimeError, match="on purpose"):
        record(model, tokenizer, prompts, tmp_path / "run", batch_size=4, progress=False, max_new_tokens=4)
    monkeypatch.setattr(model, "generate", original)
    assert complete_samples(tmp_path / "run") == Counter(f"s{i:03d}" for i in range(4))
    result = record(model, tokenizer, prompts, tmp_path / "run", batch_size=4, progress=False, max_new_tokens=4)
    assert (result["recorded"], result["skipped"]) == (6, 4)
    assert complete_samples(tmp_path / "run") == Counter(f"s{i:03d}" for i in range(10))  # each once
    statuses = [g.complete for g in open_recording(tmp_path / "run").generations]
    assert statuses == [True, False, True, True]  # the failed call stays, readable, beside its redo
    # A third run finds nothing to do.
    assert record(model, tokenizer, prompts, tmp_path / "run", batch_size=4, progress=False,
                  max_new_tokens=4)["recorded"] == 0


def test_a_resumed_batch_samples_as_the_first_run_would(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 6)
    options = dict(batch_size=3, progress=False, max_new_tokens=5, do_sample=True)
    record(record_model(), record_tokenizer(), prompts, tmp_path / "whole", **options)
    lines = prompts.read_text().splitlines()
    (tmp_path / "first.jsonl").write_text("\n".join(lines[:3]) + "\n")
    record(record_model(), record_tokenizer(), tmp_path / "first.jsonl", tmp_path / "resumed", **options)
    record(record_model(), record_tokenizer(), prompts, tmp_path / "resumed", **options)
    whole, resumed = open_recording(tmp_path / "whole"), open_recording(tmp_path / "resumed")
    assert all(torch.equal(a.sequences, b.sequences) for a, b in zip(whole.generations, resumed.generations))


@pytest.mark.slow
def test_a_sigkilled_run_resumes_from_the_command_line(tmp_path):
    model_dir = tmp_path / "model"
    record_model().save_pretrained(model_dir)
    record_tokenizer().save_pretrained(model_dir)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 40)
    command = [sys.executable, "-m", "transformers_offload", "record", "--model", str(model_dir), "--prompts",
               str(prompts), "--out", str(tmp_path / "run"), "--batch-size", "4", "--max-new-tokens", "48",
               "--no-progress", "--json"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with open(tmp_path / "first.log", "wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=log)
    deadline = time.monotonic() + 600  # a hang detector: seconds alone, a minute under load
    while time.monotonic() < deadline and process.poll() is None:
        manifest = tmp_path / "run" / "manifest.json"
        if manifest.is_file():
            entries = json.loads(manifest.read_text())["generations"]
            if sum(e["status"] == "complete" for e in entries) >= 2:
                break
        time.sleep(0.02)
    assert process.poll() is None, f"the run ended before it could be killed: {(tmp_path / 'first.log').read_text()}"
    process.send_signal(signal.SIGKILL)
    process.wait()
    before = complete_samples(tmp_path / "run")
    assert 8 <= sum(before.values()) < 40
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    after = complete_samples(tmp_path / "run")
    assert after == Counter(f"s{i:03d}" for i in range(40))  # none twice, none lost
    assert result["skipped"] == sum(before.values()) and result["recorded"] == 40 - sum(before.values())
    open_recording(tmp_path / "run", verify=True)


@pytest.mark.slow
def test_ctrl_c_prints_the_exact_command_that_resumes_the_run(tmp_path):
    model_dir = tmp_path / "model"
    record_model().save_pretrained(model_dir)
    record_tokenizer().save_pretrained(model_dir)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 40)
    out = tmp_path / "it's my run"  # a quote and a space: the printed command must quote them
    command = [sys.executable, "-m", "transformers_offload", "record", "--model", str(model_dir), "--prompts",
               str(prompts), "--out", str(out), "--batch-size", "4", "--max-new-tokens", "48", "--no-progress"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    def a_batch_is_complete() -> bool:
        # A complete generation followed by the next one: its call has returned. A Ctrl-C between the
        # manifest's "complete" and that return fails the call (it raises KeyboardInterrupt), and the
        # generation is rewritten as failed.
        manifest = out / "manifest.json"
        statuses = [g["status"] for g in json.loads(manifest.read_text())["generations"]] if manifest.is_file() else []
        return "complete" in statuses[:-1]

    # A hang detector, not a timing: the first batch takes seconds alone, a minute on a loaded machine.
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None and not a_batch_is_complete():
        time.sleep(0.02)
    assert process.poll() is None, "the run ended before Ctrl-C"
    assert a_batch_is_complete(), "no batch was complete after 600 s"
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    printed = stderr.splitlines()[stderr.splitlines().index("interrupted: every complete batch is kept in "
                                                            f"{str(out)!r}; to record the rest, run:") + 1].strip()
    assert printed == shlex.join(command)
    before = complete_samples(out)
    assert 4 <= sum(before.values()) < 40
    resumed = subprocess.run(printed, shell=True, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert complete_samples(out) == Counter(f"s{i:03d}" for i in range(40))  # none twice, none lost


@pytest.mark.parametrize("lines, options, match", [
    (['{"prompt": "w3"}'], {}, r"no `text` or `messages` column \(columns: \['prompt'\]\)"),
    (['{"id": 1, "text": "w3"}', '{"id": "1", "text": "w4"}'], {}, r"repeats sample ids \['1'\]"),
    (['{"text": ""}'], {}, "has no text or chat"),
    (["[1, 2]"], {}, "must be a JSON object"),
    (["not json"], {}, "line 1 is not JSON"),
    ([], {}, "holds no prompts"),
])
def test_bad_prompts_are_refused_before_anything_runs(tmp_path, lines, options, match):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=match):
        record(record_model(), record_tokenizer(), path, tmp_path / "run", progress=False, **options)
    assert not (tmp_path / "run").exists()


def test_read_prompts_takes_parquet_chats_and_lists(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", exc_type=ImportError)
    pa = pytest.importorskip("pyarrow", exc_type=ImportError)
    pq.write_table(pa.table({"key": ["a", "b"], "body": ["w3 w4", "w5"]}), tmp_path / "p.parquet")
    assert read_prompts(tmp_path / "p.parquet", text_column="body", id_column="key") == [("a", "w3 w4"), ("b", "w5")]
    chats = [{"messages": [{"role": "user", "content": "hi"}]}]
    assert read_prompts(chats) == [(0, chats[0]["messages"])]
    with pytest.raises(ValueError, match=r"expected a \.jsonl"):
        (tmp_path / "p.csv").write_text("id,text\n")
        read_prompts(tmp_path / "p.csv")


def test_append_refuses_another_model_and_a_second_writer(tmp_path):
    model = record_model()
    with Recorder(model, spill_dir=tmp_path / "run") as rec:
        model.generate(torch.tensor([[3, 4]]), logits_processor=[rec], max_new_tokens=2, pad_token_id=0)
        with pytest.raises(BlockingIOError, match="being written by another Recorder"):
            Recorder(model, spill_dir=tmp_path / "run", append=True)
    other = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="another model"):
        Recorder(other, spill_dir=tmp_path / "run", append=True)
    with Recorder(model, spill_dir=tmp_path / "run", append=True) as rec:
        model.generate(torch.tensor([[3, 4]]), logits_processor=[rec], max_new_tokens=2, pad_token_id=0)
        assert [g.index for g in rec.generations] == [1]
    assert len(open_recording(tmp_path / "run", verify=True).generations) == 2
    with pytest.raises(ValueError, match="pass `spill_dir` too"):
        Recorder(model, append=True)


def test_record_on_the_command_line(tmp_path, capsys):
    model_dir = tmp_path / "model"
    record_model().save_pretrained(model_dir)
    record_tokenizer().save_pretrained(model_dir)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 5)
    argv = ["record", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(tmp_path / "run"),
            "--batch-size", "2", "--max-new-tokens", "3", "--streams", "scores,stats", "--encodings", "scores=sparse",
            "--do-sample", "--top-k", "5", "--prompt-logprobs", "2", "--no-progress", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["recorded"], result["generations"]) == (5, 3)
    generation = open_recording(tmp_path / "run").generation(0)
    assert generation.encodings == {"scores": "sparse"} and "stats" in generation.streams
    assert len(generation.prompt_logprobs()[0][0]["top_logprobs"]) == 2
    assert main([*argv[:-1], "--json"]) == 0 and json.loads(capsys.readouterr().out)["skipped"] == 5
    assert main(["record", "--model", str(tmp_path / "nope"), "--prompts", str(prompts), "--out", str(tmp_path / "x")]) == 1
    assert "must be a local directory" in capsys.readouterr().err


def test_record_reads_a_saved_dataset(tmp_path):
    datasets = pytest.importorskip("datasets", exc_type=ImportError)
    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"id": f"d{i}", "text": f"w{3 + i} w{4 + i}"} for i in range(5)]).save_to_disk(str(saved))
    assert read_prompts(saved)[1] == ("d1", "w4 w5")
    result = record(record_model(), record_tokenizer(), saved, tmp_path / "run", batch_size=2, progress=False, max_new_tokens=2)
    assert result["recorded"] == 5
    assert [s["sample"] for s in open_recording(tmp_path / "run").samples()] == [f"d{i}" for i in range(5)]


def test_a_named_column_that_is_not_there_is_refused(tmp_path):
    path = write_prompts(tmp_path / "p.jsonl", 2)
    with pytest.raises(ValueError, match=r"no id column 'uid' \(columns: \['id', 'text'\]\)"):
        read_prompts(path, id_column="uid")
    with pytest.raises(ValueError, match=r"no column 'txt' \(columns: \['id', 'text'\]\)"):
        read_prompts(path, text_column="txt")


def test_append_refuses_another_checkpoint_of_the_same_architecture(tmp_path):
    model = record_model()
    with Recorder(model, spill_dir=tmp_path / "run") as rec:
        model.generate(torch.tensor([[3, 4]]), logits_processor=[rec], max_new_tokens=1, pad_token_id=0)
    other = record_model()
    other.name_or_path = "/somewhere/else"
    with pytest.raises(ValueError, match="another model \\(name_or_path"):
        Recorder(other, spill_dir=tmp_path / "run", append=True)


def test_new_tokens_count_each_sequence_through_its_end_of_sequence_token():
    from transformers_offload.jobs.record import _new_tokens

    generated = torch.tensor([[5, 0, 1, 1, 1], [5, 6, 7, 8, 9], [1, 1, 1, 1, 1]])  # 0 is a sampled token, 1 EOS
    assert _new_tokens(generated, (1,)) == 3 + 5 + 1
    assert _new_tokens(generated, ()) == 15


def test_a_resume_over_damaged_shards_is_refused_before_it_records(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 6)
    model, tokenizer = record_model(), record_tokenizer()
    record(model, tokenizer, tmp_path / "prompts.jsonl", tmp_path / "run", batch_size=3, progress=False, max_new_tokens=3)
    shard = sorted((tmp_path / "run").glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-5])  # truncated: its samples would count as recorded
    before = (tmp_path / "run" / "manifest.json").read_text()
    with pytest.raises(RecordingError, match="damaged.*verify"):
        record(model, tokenizer, prompts, tmp_path / "run", batch_size=3, progress=False, max_new_tokens=3)
    assert (tmp_path / "run" / "manifest.json").read_text() == before


def test_record_and_score_check_their_inputs_before_the_model_loads(tmp_path, monkeypatch, capsys):
    import transformers

    model_dir, bare = tmp_path / "model", tmp_path / "bare"
    record_model().save_pretrained(model_dir)
    record_tokenizer().save_pretrained(model_dir)
    record_model().save_pretrained(bare)  # weights, no tokenizer
    prompts = write_prompts(tmp_path / "prompts.jsonl", 3)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("w3 w4 w5")

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the inputs were checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loaded)
    cases = [
        (["record", "--model", str(model_dir), "--prompts", str(tmp_path / "missing.jsonl")], 1, "missing.jsonl"),
        (["record", "--model", str(bare), "--prompts", str(prompts)], 2, "holds no tokenizer"),
        (["score", "--model", str(bare), "--text", str(tmp_path / "short.txt")], 2, "pass `--tokenizer DIR`"),
        (["score", "--model", str(model_dir), "--text", str(tmp_path / "empty.txt")], 2, "holds no tokens"),
        (["score", "--model", str(model_dir), "--text", str(tmp_path / "short.txt"), "--context", "8"], 2,
         "holds 3 tokens, fewer than one window of `--context` 8"),
    ]
    for argv, status, said in cases:
        assert main([*argv, "--out", str(tmp_path / "out")]) == status, argv
        assert said in capsys.readouterr().err, argv
    assert not (tmp_path / "out").exists()


# (the command line's flags, what it says; the API's options, what it says): counts are refused as the command line
# is read (argparse), values by transformers' own checks (`check_generate_options`), both before anything is written.
BAD_GENERATE_OPTIONS = [
    (["--do-sample", "--temperature", "-1"], "`--temperature` -1.0 is refused by transformers' TemperatureLogitsWarper",
     {"do_sample": True, "temperature": -1.0}, "`temperature` -1.0 is refused"),
    (["--max-new-tokens", "0"], "--max-new-tokens: must be at least 1, got 0",
     {"max_new_tokens": 0}, "`max_new_tokens` must be a positive int, got 0"),
    (["--num-beams", "0"], "--num-beams: must be at least 1, got 0", {"num_beams": 0}, "`num_beams` must be a positive int"),
    (["--batch-size", "0"], "--batch-size: must be at least 1, got 0", {"batch_size": 0}, "`batch_size` must be a positive int"),
    (["--do-sample", "--top-p", "1.5"], "`--top-p` 1.5 is refused", {"do_sample": True, "top_p": 1.5}, "`top_p` 1.5 is refused"),
    (["--top-k", "-2"], "--top-k: must be at least 0, got -2", {"top_k": -2}, "`top_k` -2 is refused"),
    (["--repetition-penalty", "-1"], "`--repetition-penalty` -1.0 is refused", {"repetition_penalty": -1.0},
     "`repetition_penalty` -1.0 is refused"),
    (["--num-return-sequences", "3", "--num-beams", "2"], "`--num-return-sequences` 3 is more than `--num-beams` 2",
     {"num_return_sequences": 3, "num_beams": 2}, "`num_return_sequences` 3 is more than `num_beams` 2"),
]


@pytest.mark.parametrize(("argv", "said", "kwargs", "api_said"), BAD_GENERATE_OPTIONS, ids=lambda value: None)
def test_bad_generate_options_are_refused_before_anything_is_written(tmp_path, monkeypatch, capsys, argv, said, kwargs,
                                                                     api_said):
    import transformers

    model_dir = tmp_path / "model"
    record_model().save_pretrained(model_dir)
    record_tokenizer().save_pretrained(model_dir)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 3)
    with monkeypatch.context() as patch:
        patch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                      lambda *args, **kwargs: pytest.fail("the model was loaded before the options were checked"))
        try:
            status = main(["record", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(tmp_path / "out"),
                           *argv])
        except SystemExit as exit_:  # argparse's refusal, as the command line is read
            status = exit_.code
    assert status == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=re.escape(api_said)):
        record(record_model(), record_tokenizer(), prompts, tmp_path / "api", progress=False, **kwargs)
    assert not (tmp_path / "api").exists()


def test_score_refuses_bad_counts_and_unreadable_texts_before_anything_is_written(tmp_path, monkeypatch, capsys):
    import transformers

    from transformers_offload.rescoring.corpus import score_run
    from transformers_offload.rescoring.corpus_windows import SMALLEST_CONTEXT

    model_dir = tmp_path / "model"
    record_model().save_pretrained(model_dir)
    record_tokenizer().save_pretrained(model_dir)
    text = tmp_path / "short.txt"
    text.write_text("w3 w4 w5 w6 w7 w8 w9 w10")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00 not text")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *args, **kwargs: pytest.fail("the model was loaded before the inputs were checked"))
    cases = [
        (["--text", str(text), "--context", str(SMALLEST_CONTEXT - 1)], f"must be at least {SMALLEST_CONTEXT}, got 3"),
        (["--text", str(text), "--batch-size", "0"], "--batch-size: must be at least 1, got 0"),
        (["--text", str(text), "--chunk-size", "-1"], "--chunk-size: must be at least 1, got -1"),
        (["--text", str(text), "--max-windows", "two"], "--max-windows: expected a whole number, got 'two'"),
        (["--text", str(tmp_path / "missing.txt")], f"`--text` '{tmp_path / 'missing.txt'}' cannot be read (No such file"),
        (["--text", str(tmp_path)], "cannot be read (Is a directory)"),
        (["--text", str(tmp_path / "binary.txt")], "is not UTF-8 text (byte 0"),
    ]
    for argv, said in cases:
        try:
            status = main(["score", "--model", str(model_dir), "--out", str(tmp_path / "out"), *argv])
        except SystemExit as exit_:  # argparse's refusal, as the command line is read
            status = exit_.code
        assert status == 2 and said in capsys.readouterr().err, argv
        assert not (tmp_path / "out").exists(), argv
    with pytest.raises(ValueError, match=f"`context` must be an int of at least {SMALLEST_CONTEXT}, got 3"):
        score_run(record_model(), ["w3 w4 w5 w6 w7 w8"], tmp_path / "api", tokenizer=record_tokenizer(), context=3)


def test_record_refuses_an_out_holding_generations_without_sample_ids(tmp_path, capsys):
    # Their default ids are the prompts' running count (0, 1, ...), which record's own (line numbers) would repeat.
    model, tokenizer = record_model(), record_tokenizer()
    with Recorder(model, spill_dir=tmp_path / "out") as rec:
        model.generate(torch.tensor([[3, 4, 5]]), logits_processor=[rec], max_new_tokens=2, do_sample=False,
                       pad_token_id=tokenizer.pad_token_id)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 3, ids=False)
    files = sorted(path.name for path in (tmp_path / "out").iterdir())
    with pytest.raises(ValueError, match="holds 1 generation.s. recorded without sample ids .generation 0"):
        record(model, tokenizer, prompts, tmp_path / "out", progress=False, max_new_tokens=2)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    assert main(["record", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(tmp_path / "out")]) == 1
    assert "recorded without sample ids" in capsys.readouterr().err
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == files  # nothing written, .job.json neither
    assert [s["sample"] for s in open_recording(tmp_path / "out").samples()] == [0]


def test_options_transformers_takes_as_off_are_not_refused():
    from transformers_offload.jobs.record import check_generate_options

    check_generate_options({"top_k": 0, "top_p": 1.0, "temperature": 1.0, "repetition_penalty": 1.0, "num_beams": 1,
                            "num_return_sequences": 2, "do_sample": True, "max_new_tokens": 1})


def test_the_resume_command_of_the_console_script_is_short(tmp_path, monkeypatch):
    from transformers_offload.cli import options

    script = tmp_path / "bin" / "transformers-offload"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.setattr(sys, "argv", [str(script), "record", "--out", "my run"])
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    assert options.command_line(None) == "transformers-offload record --out 'my run'"
    monkeypatch.setenv("PATH", str(tmp_path / "elsewhere"))  # not on PATH: the path it was run by
    assert options.command_line(None) == f"{script} record --out 'my run'"


def test_a_resume_with_other_settings_is_refused_before_the_model_loads_naming_each_difference(tmp_path, monkeypatch,
                                                                                                 capsys):
    import transformers

    model_dir = tmp_path / "model"
    record_model().save_pretrained(model_dir)
    record_tokenizer().save_pretrained(model_dir)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 3)
    first = ["record", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(tmp_path / "run"),
             "--do-sample", "--top-p", "0.9", "--max-new-tokens", "4", "--no-progress"]
    assert main(first) == 0
    write_prompts(prompts, 4)  # a prompt added
    other = [*first[:5], "--out", str(tmp_path / "run"), "--num-beams", "2", "--max-new-tokens", "3", "--no-progress"]
    load = transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("the model was loaded before the settings were compared"))
    assert main(other) == 1
    err = capsys.readouterr().err
    for difference in ("do_sample True (now False)", "max_new_tokens 4 (now 3)", "num_beams None (now 2)",
                       "top_p 0.9 (now None)", "--allow-other-settings"):
        assert difference in err, difference
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load)
    assert main([*first, "--json"]) == 0  # like with like: the added prompt only
    assert json.loads(capsys.readouterr().out)["recorded"] == 1
    write_prompts(prompts, 5)
    assert main([*other, "--allow-other-settings", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recorded"] == 1
    run = open_recording(tmp_path / "run")
    assert [g.generation_config.get("num_beams", 1) for g in run.generations][-1] == 2  # its own header
    assert not (tmp_path / "run" / "manifest.json").read_text().count(".job.json")
    assert run.verify()["files"] > 0


def test_a_resume_names_the_model_directory_any_way_and_never_mixes_two_models(tmp_path, monkeypatch, capsys):
    import shutil

    model_dir = tmp_path / "model"
    record_model().save_pretrained(model_dir)
    record_tokenizer().save_pretrained(model_dir)
    shutil.copytree(model_dir, tmp_path / "copy")
    write_prompts(tmp_path / "prompts.jsonl", 2)
    monkeypatch.chdir(tmp_path)
    base = ["record", "--prompts", "prompts.jsonl", "--out", "run", "--max-new-tokens", "2", "--no-progress", "--json"]
    assert main([*base, "--model", "model", "--streams", "logits,scores"]) == 0
    write_prompts(tmp_path / "prompts.jsonl", 3)
    assert main([*base, "--model", "./model/", "--streams", "scores,logits"]) == 0  # the same directory, the same set
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["recorded"] == 1
    write_prompts(tmp_path / "prompts.jsonl", 4)
    assert main([*base, "--model", "copy", "--allow-other-settings"]) == 1  # another model, whatever is allowed
    assert "a recording holds one model's generations" in capsys.readouterr().err
    assert main([*base, "--model", str(model_dir), "--id-column", "text"]) == 1  # other ids: other samples
    assert "id_column None (now 'text')" in capsys.readouterr().err
    assert main([*base, "--model", str(model_dir)]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["recorded"] == 1


def test_rescore_refuses_to_write_into_the_recording_it_rescores(tmp_path, capsys):
    write_prompts(tmp_path / "prompts.jsonl", 2)
    record(record_model(), record_tokenizer(), tmp_path / "prompts.jsonl", tmp_path / "run", progress=False,
           max_new_tokens=2)
    assert main(["rescore", str(tmp_path / "run"), "--model", "smollm2", "--out", str(tmp_path / "run" / ".")]) == 2
    assert "is the recording to rescore" in capsys.readouterr().err
