"""Where a recording lives: a local path or a `file://` URL; an object-store URL (`s3://`, `memory://`...) is
refused before anything runs, never taken as a local folder named after it (`s3:/bucket/run`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from transformers_offload import Recorder, open_recording
from transformers_offload.cli import main as cli
from transformers_offload.jobs import settings as job_settings
from transformers_offload.jobs.record import record
from transformers_offload.rescoring.run import rescore_recording
from transformers_offload.store.location import local_directory

from ..helpers import make_tiny

URLS = ["s3://bucket/run", "gs://bucket/run", "memory://run", "hf://datasets/me/run", "S3://bucket/run",
        "simplecache::s3://bucket/run", Path("s3://bucket/run")]  # a chained URL; one a Path collapsed to s3:/


@pytest.fixture
def here(tmp_path, monkeypatch):
    """The test's working directory: where a URL taken as a path would have made its folder."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("url", URLS)
def test_an_object_store_url_is_refused_before_anything_runs(here, url, capsys):
    model = make_tiny("gpt2")
    with pytest.raises(ValueError, match=r"`spill_dir` .* is an object-store URL \(`[a-z0-9]+(://|::)`\).*verify DIR"):
        Recorder(model, spill_dir=url)
    with pytest.raises(ValueError, match="the recording .* is an object-store URL"):
        open_recording(url)
    with pytest.raises(ValueError, match="`out` .* is an object-store URL"):
        record(model, None, [{"id": "a", "prompt": [1, 2]}], out=url)
    with pytest.raises(ValueError, match="`out` .* is an object-store URL"):
        rescore_recording(here / "nowhere", model, url)
    with pytest.raises(ValueError, match="`--out` .* is an object-store URL"):  # the command line's first write
        job_settings.check(url, "record", {"model": "m"})
    assert cli(["verify", str(url)]) != 0 and "object-store URL" in capsys.readouterr().err
    assert list(here.iterdir()) == []  # no `s3:` folder


def test_a_file_url_is_the_local_directory(tmp_path):
    model = make_tiny("gpt2")
    target = tmp_path / "a run"
    url = "file://" + str(target).replace(" ", "%20")
    with Recorder(model, spill_dir=url) as rec:
        model.generate(torch.tensor([[1, 2, 3]]), logits_processor=[rec], max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert (target / "manifest.json").is_file()
    for where in (url, "file://localhost" + str(target), "file://LOCALHOST" + str(target), "file:" + str(target),
                  target, str(target)):
        assert open_recording(where).generation(0).num_steps == 2
    assert local_directory(Path("run"), "x") == Path("run")
    with pytest.raises(ValueError, match="names host 'elsewhere'"):
        open_recording("file://elsewhere/run")
    with pytest.raises(TypeError, match="must be a path"):
        open_recording(3)
    with pytest.raises(ValueError, match="is empty"):
        Recorder(model, spill_dir="")
    assert local_directory("run:1/x", "x") == Path("run:1/x")  # a colon, no scheme fsspec knows: a folder name
