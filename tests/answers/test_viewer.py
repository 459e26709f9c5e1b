"""The viewer: one self-contained HTML page whose values are the per-token table's, of bounded size,
reading only what it shows; loaded in a real headless Chromium, where a click shows the alternatives."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from transformers_offload import Generation, Recorder, open_recording
from transformers_offload.answers import table as _table
from transformers_offload.answers import viewer
from transformers_offload.cli import main

from ..helpers import PAD, left_padded_batch


def _record(model, spill_dir, *, steps=6):
    """A sampled call of two sequences per prompt, then a beam search returning two of three beams."""
    batch = left_padded_batch()
    with Recorder(model, spill_dir=spill_dir) as rec:
        rec.set_samples(["a", "b", "c"])
        torch.manual_seed(0)
        model.generate(**batch, logits_processor=[rec], max_new_tokens=steps, do_sample=True, top_k=8,
                       num_return_sequences=2, pad_token_id=PAD)
        model.generate(**batch, logits_processor=[rec], max_new_tokens=steps, num_beams=3, num_return_sequences=2,
                       pad_token_id=PAD)
    return open_recording(spill_dir)


def _data(page: str) -> dict:
    found = re.search(r"const DATA = (.*?);\n", page)
    assert found, "the page carries no data"
    return json.loads(found.group(1).replace("<\\/", "</"))


def test_the_page_shows_the_tables_values_and_needs_no_network(gpt2, tmp_path):
    run = _record(gpt2, tmp_path / "run")
    page = viewer.render(run, top=3)
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page), "the page loads something from the network"
    data = _data(page)
    rows = _table.to_arrow(run, top=3).to_pylist()
    by_key = {(r["generation"], r["sequence"], r["step"]): r for r in rows}
    shown = 0
    for generation in data["generations"]:
        for sequence in generation["sequences"]:
            for token in sequence["tokens"]:
                row = by_key[(generation["index"], sequence["sequence"], token[0])]
                assert token[1] == row["token"] and token[2] == f"#{row['token']}"
                assert token[3:9] == [row["logprob_raw"], row["rank_raw"], row["entropy_raw"],
                                      row["logprob_processed"], row["rank_processed"], row["entropy_processed"]]
                raw, processed = token[9]
                assert [a[0] for a in raw] == row["top_tokens_raw"] and [a[2] for a in raw] == row["top_logprobs_raw"]
                # Top-k sampling removed tokens: their processed logprob is -inf, shown as null.
                assert [a[2] for a in processed] == [v if v != float("-inf") else None for v in row["top_logprobs_processed"]]
                shown += 1
    assert shown == len(rows)
    assert [s["sample"] for s in data["generations"][0]["sequences"]] == ["a", "a", "b", "b", "c", "c"]
    tree = data["generations"][1]["tree"]
    assert tree["num_beams"] == 3 and len(tree["paths"]) == 6
    assert tree["paths"]["0"] == run.beam_indices(1)[0, : len(tree["steps"])].tolist()


def test_a_long_recording_gives_a_page_of_bounded_size(tmp_path):
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=1100,
                                       bos_token_id=2, eos_token_id=1, pad_token_id=PAD)).eval()
    sizes = {}
    for steps in (600, 1000):
        with Recorder(model, spill_dir=tmp_path / str(steps)) as rec:
            model.generate(torch.tensor([[5, 6, 7]]), attention_mask=torch.ones(1, 3, dtype=torch.long),
                           logits_processor=[rec], max_new_tokens=steps, min_new_tokens=steps, do_sample=True,
                           pad_token_id=PAD)
        page = viewer.render(open_recording(tmp_path / str(steps)))
        assert len(_data(page)["generations"][0]["sequences"][0]["tokens"]) == 512
        sizes[steps] = len(page)
    assert sizes[1000] == pytest.approx(sizes[600], rel=0.02), sizes
    assert sizes[1000] < 400_000, sizes


def test_the_page_reads_only_the_generations_and_rows_it_shows(gpt2, tmp_path, monkeypatch):
    run = _record(gpt2, tmp_path / "run")
    reads = []
    original = Generation.logits

    def counting(self, **kwargs):
        reads.append((self.index, tuple(kwargs.get("rows") or ())))
        return original(self, **kwargs)

    monkeypatch.setattr(Generation, "logits", counting)
    data = _data(viewer.render(run, generations=[0], sequences=[3]))
    assert [s["sequence"] for s in data["generations"][0]["sequences"]] == [3]
    assert reads and all(read == (0, (3,)) for read in reads)


def test_notebooks_get_the_page_in_an_iframe(gpt2, tmp_path):
    run = _record(gpt2, tmp_path / "run")
    for source in (run, run.generation(0)):
        fragment = source._repr_html_()
        assert fragment.startswith('<iframe srcdoc="&lt;!DOCTYPE html&gt;') and 'sandbox="allow-scripts"' in fragment
    assert Recorder(gpt2)._repr_html_() is None


def test_view_on_the_command_line(gpt2, tmp_path, capsys):
    _record(gpt2, tmp_path / "run")
    assert main(["view", str(tmp_path / "run"), "-o", str(tmp_path / "page.html"), "--generations", "1",
                 "--top", "2", "--max-steps", "3"]) == 0
    data = _data((tmp_path / "page.html").read_text())
    assert [g["index"] for g in data["generations"]] == [1]
    assert max(len(s["tokens"]) for s in data["generations"][0]["sequences"]) == 3
    assert main(["view", str(tmp_path / "run"), "-o", str(tmp_path / "bad.html"), "--max-steps", "0"]) == 1
    assert "`max_steps` must be an int of at least 1" in capsys.readouterr().err
    assert not (tmp_path / "bad.html").exists()


def test_in_chromium_the_page_loads_cleanly_and_a_click_shows_the_alternatives(browser, gpt2, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    run = _record(gpt2, tmp_path / "run")
    viewer.write_html(run, tmp_path / "page.html", top=3)
    browser.get((tmp_path / "page.html").as_uri())
    data = _data((tmp_path / "page.html").read_text())
    tokens = browser.find_elements(By.CSS_SELECTOR, ".tok")
    assert len(tokens) == sum(len(s["tokens"]) for g in data["generations"] for s in g["sequences"])
    target = tokens[4]  # generation 0, sequence 0, its fifth token
    token = data["generations"][0]["sequences"][0]["tokens"][4]
    target.click()
    details = browser.find_element(By.ID, "details")
    assert f"step {token[0]}:" in details.text and "selected" in target.get_attribute("class")
    for kind, alternatives in zip(("raw", "processed"), token[9]):
        cells = [row.find_elements(By.TAG_NAME, "td")
                 for row in details.find_elements(By.CSS_SELECTOR, f'table[data-kind="{kind}"] tr:not(.removed)')][1:]
        kept = [a for a in alternatives if a[2] is not None]  # tokens the processors removed are counted, not listed
        assert [int(c[0].text) for c in cells] == [a[0] for a in kept]
        assert [c[2].text for c in cells] == [f"{a[2]:.4f}" for a in kept]
    Select(browser.find_element(By.ID, "colour")).select_by_value("rank_processed")
    bucket = "b0" if token[7] == 0 else "b1" if token[7] == 1 else "b2" if token[7] <= 10 else "b3"
    assert bucket in target.get_attribute("class").split()
    assert browser.find_elements(By.CSS_SELECTOR, "svg.tree polyline"), "the beam search's tree is missing"
    browser.save_screenshot(str(tmp_path / "viewer.png"))
    assert (tmp_path / "viewer.png").stat().st_size > 10_000
    errors = [entry for entry in browser.get_log("browser") if entry["level"] in ("SEVERE", "ERROR")]
    assert errors == []
