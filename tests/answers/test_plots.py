"""`plot`: PNG files of the logprob and entropy per step, and of an attention map (matplotlib)."""

from __future__ import annotations

import sys

import pytest
import torch

from transformers_offload import Recorder, open_recording
from transformers_offload.answers import plots
from transformers_offload.cli import main

from ..helpers import PAD, left_padded_batch, make_tiny

pytest.importorskip("matplotlib", exc_type=ImportError)
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def recorded(tmp_path):
    model = make_tiny("gpt2", attn_implementation="eager")
    with Recorder(model, streams=("logits", "scores", "attentions"), heads=[1], spill_dir=tmp_path / "run") as rec:
        torch.manual_seed(0)
        model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=6, do_sample=True, pad_token_id=PAD)
    with Recorder(model, spill_dir=tmp_path / "plain") as rec:
        model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=4, num_beams=2, pad_token_id=PAD)
    return tmp_path


def test_plot_writes_the_steps_and_the_attention_map(recorded, tmp_path, monkeypatch):
    shown = {}
    original = plots.plot_attention

    def keep(generation, path, **options):
        shown["array"] = generation.layer_array("attentions", options["layer"], rows=options["row"])
        return original(generation, path, **options)

    monkeypatch.setattr(plots, "plot_attention", keep)
    assert main(["plot", str(recorded / "run"), "-o", str(tmp_path / "png"), "--head", "1", "--sequence", "2"]) == 0
    files = sorted(p.name for p in (tmp_path / "png").iterdir())
    assert files == ["attention-g0-layer-1-head1.png", "steps-g0.png"]
    assert all((tmp_path / "png" / name).read_bytes()[:8] == PNG for name in files)
    # The map of row 2: the prompt's 8 positions, then one per decode step, over that many keys.
    assert shown["array"].values.shape == (1, 8 + 5, 8 + 5)
    assert main(["plot", str(recorded / "plain"), "-o", str(tmp_path / "beam")]) == 0
    assert sorted(p.name for p in (tmp_path / "beam").iterdir()) == ["steps-g0.png"]


def test_plot_refuses_a_head_that_was_not_recorded(recorded, capsys):
    run = open_recording(recorded / "run")
    with pytest.raises(ValueError, match=r"head 0 was not recorded; the recording kept heads \[1\]"):
        plots.plot_attention(run.generation(), recorded / "x.png", head=0)
    assert main(["plot", str(recorded / "run"), "-o", str(recorded / "png"), "--head", "0"]) == 1
    assert "head 0 was not recorded" in capsys.readouterr().err


def test_plot_says_how_to_install_matplotlib(recorded, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'transformers-offload\[plot\]'"):
        plots.plot_steps(open_recording(recorded / "run").generation(), recorded / "x.png")
