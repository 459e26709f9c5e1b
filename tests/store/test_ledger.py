"""The ledger (`ledger.jsonl`, `store.ledger`) lets `verify` find, after the fact, two processes that wrote one
recording at once, with real processes: the shared-recorder fork of issue 46's reproduction (with the fork
refusal taken away, as on releases before it) and two recorders appending to one directory on a file system
without `flock` (the lock taken away). In both, every file the manifest names is intact and only the ledger
shows the loss. A recording written by one process at a time verifies with one ledger line per generation,
a ledger's last line cut short is not counted, and a recording made before the ledger verifies with 0 lines."""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch

from transformers_offload import Recorder, RecordingError, open_recording
from transformers_offload.capture import refusals
from transformers_offload.cli.main import main
from transformers_offload.store import files

from ..helpers import make_tiny

PROMPTS = ([10, 20], [30, 40])  # the first token of each child's two prompts


def _generate(model, rec, first: int) -> None:
    ids = torch.tensor([[first, 6, 7]])
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), logits_processor=[rec], max_new_tokens=3,
                   do_sample=False, pad_token_id=0)


def _run_forked(target, *args) -> None:
    process = multiprocessing.get_context("fork").Process(target=target, args=args)
    process.start()
    process.join(timeout=300)
    assert process.exitcode == 0, f"the child exited {process.exitcode}"


def test_verify_finds_forked_children_that_shared_one_spilled_recorder(tmp_path, monkeypatch):
    model = make_tiny("llama")
    rec = Recorder(model, spill_dir=tmp_path / "run")
    monkeypatch.setattr(refusals, "check_process", lambda *_: None)  # as before the fork refusal

    def work(firsts):
        torch.set_num_threads(1)  # a fork of a process whose OpenMP threads ran hangs in its first parallel region
        for first in firsts:
            _generate(model, rec, first)

    for firsts in PROMPTS:
        _run_forked(work, firsts)
    rec.close()
    run = open_recording(tmp_path / "run")
    assert len(run.generations) == 2  # of 4 made: the second child's replaced the first's
    with pytest.raises(RecordingError, match=r"two processes wrote this recording at once \(2 generation") as caught:
        run.verify()
    assert str(caught.value).count("added by 2 writers") == 2
    assert "ledger.jsonl" in str(caught.value.path)
    lines = [json.loads(line) for line in (tmp_path / "run" / "ledger.jsonl").read_text().splitlines()]
    assert [line["index"] for line in lines] == [0, 1, 0, 1] and len({line["pid"] for line in lines}) == 2
    assert main(["verify", str(tmp_path / "run")]) == 1


def test_verify_finds_two_recorders_that_appended_to_one_directory_without_flock(tmp_path, monkeypatch):
    model = make_tiny("llama")
    with Recorder(model, spill_dir=tmp_path / "run") as rec:
        _generate(model, rec, 5)
    monkeypatch.setattr(files, "lock_directory", lambda root: None)  # a file system without flock
    context = multiprocessing.get_context("fork")
    opened, turn = context.Barrier(2), [context.Event(), context.Event()]

    def work(which, firsts):
        torch.set_num_threads(1)
        with Recorder(model, spill_dir=tmp_path / "run", append=True) as mine:
            opened.wait(timeout=120)  # both read the manifest of one generation before either adds one
            turn[which].wait(timeout=120)
            for first in firsts:
                _generate(model, mine, first)
            if which == 0:
                turn[1].set()

    children = [context.Process(target=work, args=(which, firsts)) for which, firsts in enumerate(PROMPTS[:1] + ([30],))]
    for child in children:
        child.start()
    turn[0].set()
    for child in children:
        child.join(timeout=300)
        assert child.exitcode == 0
    run = open_recording(tmp_path / "run")
    assert len(run.generations) == 2  # the parent's, and the second writer's; the first's two are gone
    with pytest.raises(RecordingError) as caught:
        run.verify()
    message = str(caught.value)
    assert "generation 1 was added by 2 writers" in message and "generation 2, added by pid" in message
    assert "is not in the manifest" in message


def test_one_writer_at_a_time_verifies_with_a_ledger_line_per_generation(tmp_path, capsys):
    model = make_tiny("llama")
    with Recorder(model, spill_dir=tmp_path / "run") as rec:
        _generate(model, rec, 5)
        _generate(model, rec, 6)
    with Recorder(model, spill_dir=tmp_path / "run", append=True) as rec:
        _generate(model, rec, 7)
    run = open_recording(tmp_path / "run")
    assert run.verify()["ledger"] == 3
    writers = [entry["writer"] for entry in json.loads((tmp_path / "run" / "manifest.json").read_text())["generations"]]
    assert writers[0] == writers[1] != writers[2]
    assert main(["verify", str(tmp_path / "run")]) == 0
    assert "3 generation(s) each added by one writer" in capsys.readouterr().out
    with (tmp_path / "run" / "ledger.jsonl").open("a") as ledger:
        ledger.write('{"index": 3, "wri')  # the disk filled mid-line: not a line
    assert open_recording(tmp_path / "run").verify()["ledger"] == 3
    (tmp_path / "run" / "ledger.jsonl").unlink()  # as a recording made before the ledger
    assert open_recording(tmp_path / "run").verify()["ledger"] == 0
    assert main(["verify", str(tmp_path / "run")]) == 0
    assert "no ledger" in capsys.readouterr().out
