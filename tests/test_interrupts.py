"""Ctrl-C (a real SIGINT) anywhere in a recorded call: the call ends at once, every step whose token
was appended stays readable, and the generation is marked failed with the interrupt."""

from __future__ import annotations

import faulthandler
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import LogitsProcessor, StoppingCriteria

from transformers_offload import Recorder, _interrupts, open_recording
from transformers_offload import recorder as recorder_module
from transformers_offload.store import files as _files
from transformers_offload.store import memory as _memory_store
from transformers_offload.store import shard_writer as _shard_store

from .helpers import ROOT, assert_steps_equal, hf_reference, left_padded_batch

STEPS = 12
# The subprocess sweep: a dozen runs in CI; more on demand (the issue asks for at least 50).
SWEEP_RUNS = int(os.environ.get("TRANSFORMERS_OFFLOAD_SIGINT_RUNS", "12"))
# A hang detector for one child after its SIGINT, not a time limit: ten times the slowest exit seen
# (11.6 s on a fresh 2-core machine under load; 4.9 s at most over 6 runs with a load average of 4).
SIGINT_HANG_SECONDS = 120


@pytest.fixture(autouse=True)
def no_hang():
    """A test that hangs (a wait nothing ends) dumps every thread's stack and ends the run."""
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def sigint() -> None:
    os.kill(os.getpid(), signal.SIGINT)


class Completed(StoppingCriteria):
    """A user's criterion: counts the steps whose token was appended; optionally sends SIGINT."""

    def __init__(self, interrupt_at: int | None = None) -> None:
        self.steps, self.interrupt_at = 0, interrupt_at

    def __call__(self, input_ids, scores, **kwargs):
        self.steps += 1
        if self.steps - 1 == self.interrupt_at:
            sigint()
        return False


class InterruptAt(LogitsProcessor):
    def __init__(self, step: int) -> None:
        self.step, self.calls = step, 0

    def __call__(self, input_ids, scores):
        if self.calls == self.step:
            sigint()
        self.calls += 1
        return scores


def _slow_writer(monkeypatch) -> None:
    real = _shard_store.save_file

    def slow_save_file(*args, **kwargs):
        time.sleep(0.02)
        real(*args, **kwargs)

    monkeypatch.setattr(_shard_store, "save_file", slow_save_file)


def _hold_the_store(monkeypatch, kind: str) -> threading.Event:
    """Keep the store from taking anything (the writer's files, or the memory store's drains) until
    the returned event is set: generate() then has to wait for it, however fast this machine is."""
    release = threading.Event()
    if kind == "spill":
        real_save = _shard_store.save_file

        def held_save_file(*args, **kwargs):
            release.wait(60)
            real_save(*args, **kwargs)

        monkeypatch.setattr(_shard_store, "save_file", held_save_file)
    else:
        real_drain = _memory_store.MemoryStore.drain

        def held_drain(self, step, tensors):
            release.wait(60)
            real_drain(self, step, tensors)

        monkeypatch.setattr(_memory_store.MemoryStore, "drain", held_drain)
    return release


def _interrupt_at_wait(monkeypatch, where: str, release: threading.Event | None = None) -> list[int]:
    """Send SIGINT the first time the recorder waits at `where` (from whichever thread waits), then
    let a held store go on."""
    real = _interrupts.waiting
    seen = [0]

    def waiting(label):
        if label == where:
            seen[0] += 1
            if seen[0] == 1:
                sigint()
                if release is not None:
                    release.set()
        return real(label)

    monkeypatch.setattr(_interrupts, "waiting", waiting)
    return seen


def _interrupt_at_manifest_write(monkeypatch, which: str) -> None:
    """Send SIGINT inside the main thread's first ("start") or last ("end") manifest write of a call."""
    real = _files.write_manifest
    calls, sent = [0], []

    def write_manifest(root, manifest):
        if threading.current_thread() is threading.main_thread() and not sent:
            calls[0] += 1
            last = manifest["generations"] and manifest["generations"][-1]["status"] != "recording"
            if (which == "start" and calls[0] == 2) or (which == "end" and last):  # call 1: Spill creates the directory
                sent.append(True)
                sigint()
        real(root, manifest)

    monkeypatch.setattr(_files, "write_manifest", write_manifest)


def _forward_interrupt(model, step: int):
    calls = [0]

    def hook(module, args, output):
        if calls[0] == step:
            sigint()
        calls[0] += 1

    return model.register_forward_hook(hook)


# (where, kind of store, threaded): every wait point, both ring paths, and the user's code around them.
CASES = [
    ("shard buffer", "spill", False),
    ("shard buffer", "spill", True),
    ("ring slot", "spill", True),
    ("ring slot", "memory", True),
    ("flush", "spill", True),
    ("flush", "memory", True),
    ("writer", "spill", False),
    ("writer", "spill", True),
    ("manifest start", "spill", False),
    ("manifest end", "spill", False),
    ("forward", "spill", False),
    ("forward", "memory", False),
    ("processor", "spill", False),
    ("processor", "memory", True),
    ("criterion", "spill", False),
    ("criterion", "memory", False),
]


@pytest.mark.parametrize("where, kind, threaded", CASES, ids=[f"{w}-{s}-{'threaded' if t else 'inline'}" for w, s, t in CASES])
def test_a_ctrl_c_anywhere_keeps_every_completed_step(gpt2, tmp_path, monkeypatch, where, kind, threaded):
    batch = left_padded_batch()
    torch.manual_seed(0)
    reference = hf_reference(gpt2, **batch, max_new_tokens=STEPS, min_new_tokens=STEPS)
    if threaded:
        monkeypatch.setattr(recorder_module, "_on_cuda", lambda model: True)
    spill = kind == "spill"
    release = None
    if where in ("shard buffer", "ring slot"):  # waits inside a step: the store is made to lag
        release = _hold_the_store(monkeypatch, kind)
    elif spill:
        _slow_writer(monkeypatch)
    completed = Completed(interrupt_at=5 if where == "criterion" else None)
    processors, handle = [], None
    if where in ("shard buffer", "ring slot", "flush", "writer"):
        seen = _interrupt_at_wait(monkeypatch, where, release)
    elif where.startswith("manifest"):
        _interrupt_at_manifest_write(monkeypatch, where.split()[1])
    elif where == "forward":
        handle = _forward_interrupt(gpt2, 6)
    elif where == "processor":
        processors = [InterruptAt(4)]
    options = {"spill_dir": tmp_path / "run", "shard_bytes": 1} if spill else {}
    with Recorder(gpt2, ring_slots=2, **options) as rec:
        torch.manual_seed(0)
        with pytest.raises(KeyboardInterrupt):
            gpt2.generate(
                **batch, logits_processor=[rec, *processors], stopping_criteria=[completed],
                max_new_tokens=STEPS, min_new_tokens=STEPS,
            )
        if handle is not None:
            handle.remove()
        if where in ("shard buffer", "ring slot", "flush", "writer"):
            assert seen[0] >= 1, f"the recorder never waited at {where!r}: the test does not test it"
        generation = open_recording(tmp_path / "run").generation() if spill else rec.generation()
        assert not generation.complete and "KeyboardInterrupt" in generation.error
        # Every step whose token was appended is readable (one more where the interrupt came inside
        # the criteria list after the token was appended but before the user's criterion counted it).
        assert completed.steps <= generation.num_steps <= completed.steps + 1, (completed.steps, generation.num_steps)
        steps = generation.num_steps
        assert_steps_equal(generation.logits(), reference.logits[:steps], "logits")
        assert_steps_equal(generation.scores(), reference.scores[:steps], "scores")
        prompt = batch["input_ids"].shape[1]
        tokens = torch.stack(generation.tokens(), 1) if steps else torch.zeros(3, 0, dtype=torch.long)
        assert torch.equal(tokens, reference.sequences[:, prompt : prompt + steps])
        # Nothing is left waiting or marked busy: the recorder takes the next call.
        monkeypatch.undo()
        gpt2.generate(**batch, logits_processor=[rec], max_new_tokens=2)
        assert rec.generation().complete
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_inside_the_recorders_own_code_waits_for_the_end_of_that_code():
    calls = []

    def previous(signum, frame):
        calls.append(signum)

    old = signal.signal(signal.SIGINT, previous)
    try:
        with _interrupts.call():
            assert signal.getsignal(signal.SIGINT) != previous
            with _interrupts.held():
                sigint()
                time.sleep(0.01)
                assert calls == [] and _interrupts.pending()
            assert calls == [signal.SIGINT] and not _interrupts.pending()
            sigint()  # outside: at once
            time.sleep(0.01)
            assert calls == [signal.SIGINT] * 2
        assert signal.getsignal(signal.SIGINT) is previous
    finally:
        signal.signal(signal.SIGINT, old)


def test_a_second_ctrl_c_gets_out_at_once():
    with _interrupts.call():
        with pytest.raises(KeyboardInterrupt):
            with _interrupts.ending():
                sigint()
                time.sleep(0.01)
                assert _interrupts.pending()
                sigint()  # the second one is not held
                time.sleep(1)
                pytest.fail("the second SIGINT was held")


def test_after_a_ctrl_c_that_went_through_the_next_one_is_not_held():
    """The first Ctrl-C ended the step at once (in the forward, say); a second one while the call
    writes what it has gets out at once too."""
    with _interrupts.call():
        with pytest.raises(KeyboardInterrupt):
            sigint()
            time.sleep(1)
        with pytest.raises(KeyboardInterrupt):
            with _interrupts.ending():
                sigint()
                time.sleep(1)
                pytest.fail("the second SIGINT of the call was held")


def test_a_wait_lets_ctrl_c_through_except_while_the_call_ends():
    with _interrupts.call():  # each case is the first SIGINT of a call
        with _interrupts.held():
            sigint()
            time.sleep(0.01)
            with pytest.raises(KeyboardInterrupt), _interrupts.waiting("ring slot"):
                pytest.fail("a held SIGINT was not raised when the wait began")
    with _interrupts.call():
        with pytest.raises(KeyboardInterrupt):
            with _interrupts.held(), _interrupts.waiting("ring slot"):
                threading.Event().wait(0.01)
                sigint()
                threading.Event().wait(5)
                pytest.fail("a SIGINT during a wait was not raised at once")
    with _interrupts.call():
        with pytest.raises(KeyboardInterrupt):
            with _interrupts.ending(), _interrupts.waiting("writer"):
                sigint()
                time.sleep(0.01)
                assert _interrupts.pending()  # held until the end of the call's ending


def test_nothing_is_installed_outside_the_main_thread_or_over_an_ignored_sigint():
    seen = []
    thread = threading.Thread(target=lambda: seen.append(_enter_call()))
    thread.start()
    thread.join()
    assert seen == [signal.default_int_handler]
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert _enter_call() is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)


def _enter_call():
    with _interrupts.call(), _interrupts.held():
        return signal.getsignal(signal.SIGINT)


def _sigint_run(path: Path, delay: float, threaded: bool) -> dict:
    """One child spilling with one-step shards, sent SIGINT `delay` seconds after it starts generate()."""
    script = ROOT / "tests" / "scripts" / "spill_then_sigint.py"
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}
    with open(path.with_suffix(".stderr"), "w+") as stderr:
        child = subprocess.Popen([sys.executable, str(script), str(path), "1000", *["threaded"] * threaded], env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=stderr)
        assert child.stdout.readline() == "ready\n", stderr.seek(0) or stderr.read()
        time.sleep(delay)
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        try:
            out, _ = child.communicate(timeout=SIGINT_HANG_SECONDS)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            return {"delay": delay, "threaded": threaded, "hang": True}
        ended = time.monotonic() - sent
        stderr.seek(0)
        assert child.returncode == 0, stderr.read()[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    generations = open_recording(path).generations
    readable = generations[-1].num_steps if generations else 0
    return {"delay": delay, "threaded": threaded, "hang": False, "exit_seconds": ended, "completed": len(result["tokens"]),
            "readable": readable, "state": result["state"], "tokens": result["tokens"],
            "recorded": [t.tolist() for t in generations[-1].tokens()] if generations else []}


@pytest.mark.slow(minutes=1)
def test_a_sweep_of_sigints_at_random_times_never_loses_a_completed_step_nor_hangs(tmp_path):
    rng = random.Random(13)
    delays = [0.0] + [rng.uniform(0.0, 3.0) for _ in range(SWEEP_RUNS - 1)]
    faulthandler.cancel_dump_traceback_later()  # each child has its own timeout
    with ThreadPoolExecutor(max_workers=2) as pool:
        # Every other run drains the ring in its own thread (the CUDA path's structure).
        runs = list(pool.map(lambda item: _sigint_run(tmp_path / f"run{item[0]}", item[1], item[0] % 2 == 1), enumerate(delays)))
    for run in runs:
        assert not run["hang"], f"the process did not end within {SIGINT_HANG_SECONDS} s of SIGINT (sent {run['delay']:.2f} s in)"
        # SIGINT ended generate() (1,000 steps would take far longer than the 3 s before it is sent);
        # how fast is reported below, not asserted: it depends on the machine's load (see SIGINT_HANG_SECONDS).
        assert run["state"] == "interrupted" and run["completed"] < 1000, run
        assert run["completed"] <= run["readable"] <= run["completed"] + 1, run
        assert run["recorded"][: run["completed"]] == run["tokens"], "a readable step holds another token"
    summary = {
        "runs": len(runs),
        "interrupted": sum(run["state"] == "interrupted" for run in runs),
        "steps_completed": sum(run["completed"] for run in runs),
        "steps_readable": sum(run["readable"] for run in runs),
        "max_exit_seconds": round(max(run["exit_seconds"] for run in runs), 2),
    }
    print("SIGINT sweep:", json.dumps(summary))
