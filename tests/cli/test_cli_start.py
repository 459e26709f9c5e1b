"""The command line starts at once: the commands that read a recording import neither torch nor
transformers where the recording does not need them (each run in a fresh interpreter, then its
`sys.modules` checked); the console script; `inspect`'s settings; `--model` by the demo model's name."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys

import pytest

import transformers_offload
from transformers_offload import cli, demo_model

from ..helpers import GOLDEN, ROOT

# What each reading command may import on the golden recordings: `inspect` and `verify` read manifests and
# file headers only; `export`, `view` and `plot` compute these recordings' logprobs and entropies with torch
# (they hold no `stats`), but never need transformers.
COMMANDS = {
    "inspect": ([], ("torch", "transformers")),
    "verify": ([], ("torch", "transformers")),
    "export": (["{out}/table.parquet"], ("transformers",)),
    "view": (["-o", "{out}/page.html"], ("transformers",)),
    "plot": (["-o", "{out}/plots"], ("transformers",)),
}
RECORDINGS = ("tiny-recording", "tiny-sparse-recording", "tiny-native-recording", "tiny-topk-recording")
# Every reading command on each, except that the answers (which read the same way) run on the two whose
# records are read through NumPy (sparse, native): fewer fresh interpreters.
CASES = [(command, recording) for command in sorted(COMMANDS) for recording in RECORDINGS
         if command in ("inspect", "verify") or recording in ("tiny-sparse-recording", "tiny-native-recording")]

# Runs `main(argv)` in a fresh interpreter and prints its status and which of the modules it imported.
_PROBE = """
import json, sys
from transformers_offload.cli import main
status = main(json.loads(sys.argv[1]))
print(json.dumps({"status": status, "imported": [m for m in ("torch", "transformers") if m in sys.modules]}))
"""


def _run(argv: list[str]) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argv)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("command, recording", CASES)
def test_reading_commands_import_neither_torch_nor_transformers(tmp_path, command, recording):
    if command == "plot":
        pytest.importorskip("matplotlib")
    if command == "export":
        pytest.importorskip("pyarrow")
    run = tmp_path / "run"
    shutil.copytree(GOLDEN / recording, run)
    extra, kept_out = COMMANDS[command]
    result = _run([command, str(run), *(part.format(out=tmp_path) for part in extra)])
    assert result["status"] == 0
    assert not set(kept_out) & set(result["imported"]), f"`{command}` imported {result['imported']}"


# A recording made by a tiny model with the `stats` stream: every value the answers show is read from it
# (the chosen token's logprob, rank and entropy), so `export`, `view --top 0` and `plot` need no torch; the
# same model without `stats` (dense logits only) needs torch's log-softmax, and imports it.
ANSWERS = {
    "inspect": [], "verify": [], "export": ["{out}/table.parquet"], "view": ["-o", "{out}/page.html", "--top", "0"],
    "plot": ["-o", "{out}/plots"],
}


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """Two recordings of the same sampled `generate()` of a tiny GPT-2: `stats` (with stats) and `dense`."""
    import torch

    from transformers_offload import Recorder

    from ..helpers import PAD, left_padded_batch, make_tiny

    model = make_tiny("gpt2")
    root = tmp_path_factory.mktemp("tiny-runs")
    for name, streams in (("stats", ("logits", "scores", "stats")), ("dense", ("logits", "scores"))):
        with Recorder(model, streams=streams, spill_dir=root / name) as rec:
            torch.manual_seed(0)
            model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=6, do_sample=True,
                           num_return_sequences=2, pad_token_id=PAD)
    return root


@pytest.mark.parametrize("command", sorted(ANSWERS))
def test_every_reading_command_runs_without_torch_on_a_recording_with_stats(tmp_path, tiny_runs, command):
    if command == "plot":
        pytest.importorskip("matplotlib")
    if command == "export":
        pytest.importorskip("pyarrow")
    result = _run([command, str(tiny_runs / "stats"), *(part.format(out=tmp_path) for part in ANSWERS[command])])
    assert result["status"] == 0
    assert result["imported"] == [], f"`{command}` imported {result['imported']}"


def test_a_recording_without_stats_imports_torch_for_its_logprobs_only(tmp_path, tiny_runs):
    pytest.importorskip("pyarrow")
    result = _run(["export", str(tiny_runs / "dense"), str(tmp_path / "table.parquet")])
    assert result["status"] == 0 and result["imported"] == ["torch"]


def test_the_values_read_without_torch_equal_torchs_expressions(tmp_path, tiny_runs):
    """The table exported from `stats` (NumPy only) holds, bit for bit, the torch expressions of the full
    logits and scores (`read.logprobs`), as the table exported from the dense recording does."""
    pa = pytest.importorskip("pyarrow.parquet")
    import torch

    from transformers_offload import open_recording

    tables = {}
    for name in ("stats", "dense"):
        assert cli.main(["export", str(tiny_runs / name), str(tmp_path / f"{name}.parquet")]) == 0
        tables[name] = pa.read_table(tmp_path / f"{name}.parquet").to_pydict()
    recording = open_recording(tiny_runs / "dense")
    generation = recording.generation()
    table = tables["stats"]
    assert len(table["token"]) > 0
    for kind, read in (("raw", generation.logits), ("processed", generation.scores)):
        for i, (j, t, y) in enumerate(zip(table["sequence"], table["step"], table["token"])):
            x = read(steps=t)[0]
            expected = {
                "logprob": torch.log_softmax(x, -1)[j, y].float(),
                "rank": (x[j] > x[j, y]).sum(),
                "entropy": torch.special.entr(torch.softmax(x, -1)).sum(-1)[j].float(),
            }
            for name, value in expected.items():
                got = torch.tensor(table[f"{name}_{kind}"][i], dtype=value.dtype)
                assert torch.equal(got, value), (name, kind, j, t)
    for column in table:
        assert torch.equal(torch.tensor(table[column], dtype=torch.float64),
                           torch.tensor(tables["dense"][column], dtype=torch.float64)) or column == "sample", column


def test_importing_the_package_imports_neither():
    done = subprocess.run(
        [sys.executable, "-c", "import sys, transformers_offload; "
         "print([m for m in ('torch', 'transformers') if m in sys.modules])"],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


# Public names whose module imports an optional library (the `integrations` extra), which may not import with
# an older transformers: those raise ImportError with an install hint instead.
NEEDS_AN_EXTRA = {"RecordedGRPOTrainer": "trl.trainer.grpo_trainer"}


@pytest.mark.parametrize("name", transformers_offload.__all__)
def test_every_public_name_imports(name):
    if name in NEEDS_AN_EXTRA:
        try:
            importlib.import_module(NEEDS_AN_EXTRA[name])
        except Exception as error:  # noqa: BLE001 - any failure to import: skipped, saying why
            pytest.skip(f"{name} needs {NEEDS_AN_EXTRA[name]}, which does not import here: {error}")
    value = getattr(importlib.import_module("transformers_offload"), name)
    assert value is getattr(transformers_offload, name) and name in dir(transformers_offload)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'Recordr'"):
        transformers_offload.Recordr  # noqa: B018


def test_the_console_script_runs_the_same_main():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["transformers-offload"].partition(":")
    assert getattr(importlib.import_module(module), function) is cli.main
    installed = importlib.metadata.entry_points(group="console_scripts", name="transformers-offload")
    for entry in installed:  # where the install has been refreshed since the entry point was added
        assert entry.value == scripts["transformers-offload"]


def test_python_dash_m_runs_the_same_commands():
    done = subprocess.run([sys.executable, "-m", "transformers_offload", "--help"], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0
    assert all(command in done.stdout for command in (*COMMANDS, "record", "rescore", "compare"))
    assert "transformers-offload inspect" in done.stdout


def test_inspect_shows_the_settings_that_choose_tokens(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(GOLDEN / "tiny-recording", run)
    assert cli.main(["inspect", str(run)]) == 0
    short = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("settings:")]
    assert cli.main(["inspect", str(run), "--verbose"]) == 0
    every = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("settings:")]
    shown = {part.split("=")[0] for line in short for part in line.split(": ", 1)[1].split(", ")}
    assert shown and shown <= {"max_length", *cli.summary.SETTINGS}
    assert len(every[0]) >= len(short[0]) and all(f"{key}=" in every[0] for key in shown)


@pytest.mark.parametrize("config, expected", [
    ({"max_new_tokens": 8, "do_sample": False, "temperature": 0.7, "top_k": 50, "num_beams": 1},
     "max_new_tokens=8, do_sample=False"),
    ({"max_new_tokens": 8, "do_sample": True, "temperature": 0.7, "top_p": 1.0, "top_k": 50, "use_cache": True},
     "max_new_tokens=8, do_sample=True, temperature=0.7, top_k=50"),
    ({"max_length": 20, "num_beams": 4, "repetition_penalty": 1.3, "pad_token_id": 0},
     "max_length=20, num_beams=4, repetition_penalty=1.3"),
])
def test_the_short_settings(config, expected):
    assert cli.summary.settings(config) == expected
    assert "use_cache" in cli.summary.settings({**config, "use_cache": True}, verbose=True)


def test_a_result_line_is_one_write_with_its_newline(monkeypatch):
    # Ranks under torchrun share one stdout pipe; with PYTHONUNBUFFERED, `print` wrote the text and the newline
    # apart and two ranks' JSON lines ran together (seen in CI). One write below PIPE_BUF is not interleaved.
    from transformers_offload.cli import options

    writes = []

    class Stdout:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stdout", Stdout())
    options.emit('{"rank": 1}')
    assert writes == ['{"rank": 1}\n']


def test_results_are_rounded_for_people():
    assert (cli.options.human({"wrote": "a.parquet", "rows": 16, "bytes": 3 * 2**20 + 5})
            == "wrote a.parquet, rows 16, bytes 3.0 MiB")
    assert cli.options.human({"recorded": 4, "seconds": 12.34567}) == "recorded 4, seconds 12.3 s"


@pytest.mark.parametrize("name", ["smollm2", "SmolLM2-135M-Instruct", "SMOLLM2"])
def test_model_takes_the_demo_model_by_name(tmp_path, monkeypatch, name):
    monkeypatch.setenv("TRANSFORMERS_OFFLOAD_CACHE", str(tmp_path / "cache"))
    cached = demo_model.model_dir()
    cached.mkdir(parents=True)
    for file in ("model.safetensors", "tokenizer.json"):  # what `is_cached` looks for: nothing is fetched
        (cached / file).write_bytes(b"")
    monkeypatch.chdir(tmp_path)  # no directory of that name here
    assert cli.options.model_directory(name) == str(cached)


def test_a_directory_comes_before_the_demo_models_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()
    assert cli.options.model_directory("smollm2") == str((tmp_path / "smollm2").resolve())  # absolute: the same anywhere


def test_an_unknown_model_name_says_what_model_takes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"`--model` must be a local directory .* or the demo model's name \(smollm2"):
        cli.options.model_directory("gpt5")
    assert "smollm2" in cli.options.MODEL_HELP


def test_every_option_of_every_command_has_help_that_shows_its_default():
    import argparse

    commands = importlib.import_module("transformers_offload.cli.main").COMMANDS
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    for family in commands:
        family.add(subparsers)
    missing, checked = [], 0
    for name, command in subparsers.choices.items():
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            checked += 1
            default = action.default
            shown = default in (None, False, "") or str(default) in (action.help or "")
            if not action.help or not shown:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest} (default {default!r})")
    assert checked > 60 and not missing, missing
