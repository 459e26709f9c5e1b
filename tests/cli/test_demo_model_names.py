"""One name for the demo model wherever a model or a tokenizer is named: `--model`, `--tokenizer` of every
command, and the `tokenizer` argument of the Python helpers. The demo model's cached copy is stood in for
by a tiny tokenizer in a tmp cache (`TRANSFORMERS_OFFLOAD_CACHE`): nothing is fetched."""

from __future__ import annotations

import pytest

from transformers_offload import demo_model, open_recording, write_html
from transformers_offload.cli import main

from ..helpers import write_made_up_recording


@pytest.fixture
def cached_demo(tmp_path, monkeypatch):
    """A cache whose demo model directory holds a word-level tokenizer of 32 ids (`t0`..`t31`)."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    monkeypatch.setenv("TRANSFORMERS_OFFLOAD_CACHE", str(tmp_path / "cache"))
    folder = demo_model.model_dir()
    vocab = {f"t{i}": i for i in range(32)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", clean_up_tokenization_spaces=False).save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"")  # `is_cached` looks for it
    assert demo_model.is_cached()
    return folder


@pytest.mark.parametrize("name", ["smollm2", "SmolLM2", "SmolLM2-135M-Instruct"])
def test_the_demo_models_names_resolve_to_its_cached_copy(cached_demo, name):
    assert demo_model.resolve(name) == str(cached_demo)
    assert demo_model.load_tokenizer(name).decode([5]) == "t5"


def test_a_directory_resolves_to_itself_and_anything_else_is_refused_saying_what_works(tmp_path):
    assert demo_model.resolve(tmp_path) == str(tmp_path)
    with pytest.raises(ValueError, match=r"`--tokenizer` must be a local directory \(save_pretrained\) or the demo "
                                         r"model's name \(smollm2 or smollm2-135m-instruct\), got 'gpt2'"):
        demo_model.resolve("gpt2", what="`--tokenizer`")
    with pytest.raises(TypeError, match="must be a Hugging Face tokenizer"):
        demo_model.load_tokenizer(3)


def test_view_and_export_take_the_demo_models_name_as_tokenizer(cached_demo, tmp_path):
    write_made_up_recording(tmp_path / "run", steps=3, rows=2, vocab=32, shard_bytes=1 << 20)
    assert main(["view", str(tmp_path / "run"), "-o", str(tmp_path / "page.html"), "--tokenizer", "smollm2"]) == 0
    assert "t5" in (tmp_path / "page.html").read_text() or "t1" in (tmp_path / "page.html").read_text()
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "table.parquet"), "--tokenizer", "SmolLM2"]) == 0
    import pyarrow.parquet as pq

    assert pq.read_table(tmp_path / "table.parquet").column("text").to_pylist()[0].startswith("t")
    with open_recording(tmp_path / "run") as recording:
        write_html(recording, tmp_path / "again.html", tokenizer="smollm2")
    assert (tmp_path / "again.html").read_text() == (tmp_path / "page.html").read_text()
