"""Rows back to the user's data (`set_samples`, `samples()`), and the per-token table (`to_arrow`,
`to_pandas`, `write_parquet`, `export`): its values are `logprobs()`'s, a chunk of steps at a time."""

from __future__ import annotations

import json
import math

import pytest
import torch

from transformers_offload import Generation, Recorder, open_recording
from transformers_offload.answers import table as _table
from transformers_offload.cli import main

from ..helpers import PAD, left_padded_batch, make_tiny, run_case

pa = pytest.importorskip("pyarrow", exc_type=ImportError)
pq = pytest.importorskip("pyarrow.parquet", exc_type=ImportError)

MODES = ["sample_rows_finish_early", "num_return_sequences", "beam_return_sequences"]


def _two_calls(model, spill_dir=None, streams=("logits", "scores", "stats")):
    """A sampled call with ids and metadata (2 sequences per prompt), then a beam search without ids."""
    batch = left_padded_batch()
    options = {} if spill_dir is None else {"spill_dir": spill_dir}
    rec = Recorder(model, streams=streams, **options)
    rec.set_samples(["q-a", "q-b", "q-c"], metadata=[{"row": 10}, {"row": 11}, {"row": 12, "tags": ["x"]}])
    torch.manual_seed(0)
    model.generate(**batch, logits_processor=[rec], max_new_tokens=5, do_sample=True, num_return_sequences=2,
                   pad_token_id=PAD)
    model.generate(**batch, logits_processor=[rec], max_new_tokens=4, num_beams=2, pad_token_id=PAD)
    rec.close()
    return rec


@pytest.mark.parametrize("reader", ["memory", "open_recording"])
def test_samples_map_rows_and_sequences_back_to_the_users_ids(gpt2, reader, tmp_path, capsys):
    rec = _two_calls(gpt2, None if reader == "memory" else tmp_path / "run")
    source = rec if reader == "memory" else open_recording(tmp_path / "run")
    found = source.samples()
    assert [s["sample"] for s in found] == ["q-a", "q-b", "q-c", 3, 4, 5]  # then the recording's running count
    assert found[1] == {"sample": "q-b", "generation": 0, "prompt": 1, "rows": [2, 3], "sequences": [2, 3],
                        "prompt_length": 6, "metadata": {"row": 11}, "complete": True}
    assert found[5] == {"sample": 5, "generation": 1, "prompt": 2, "rows": [4, 5], "sequences": [2],
                        "prompt_length": 8, "metadata": None, "complete": True}
    first = source.generation(0)
    assert first.sample_ids == ("q-a", "q-b", "q-c") and first.sample_metadata[2] == {"row": 12, "tags": ["x"]}
    assert (first.num_prompts, first.num_return_sequences, first.rows_per_prompt) == (3, 2, 2)
    assert source.generation(1).sample_ids is None
    if reader == "open_recording":
        assert main(["inspect", str(tmp_path / "run")]) == 0
        assert "  samples: [q-a, q-b, q-c]" in capsys.readouterr().out


def test_set_samples_refuses_bad_input_before_anything_runs(gpt2):
    rec = Recorder(gpt2)
    with pytest.raises(TypeError, match="list of str or int"):
        rec.set_samples([1.5])
    with pytest.raises(TypeError, match="list of str or int"):
        rec.set_samples([True])
    with pytest.raises(ValueError, match="distinct.*'a'"):
        rec.set_samples(["a", "a"])
    with pytest.raises(ValueError, match="1 metadata dicts were given for 2"):
        rec.set_samples(["a", "b"], metadata=[{}])
    with pytest.raises(TypeError, match="JSON-serialisable"):
        rec.set_samples(["a"], metadata=[{"t": torch.zeros(1)}])
    rec.set_samples(["a", "b"])
    with pytest.raises(ValueError, match="already called with .*'a', 'b'.*call generate"):
        rec.set_samples(["c"])
    batch = left_padded_batch()
    with pytest.raises(ValueError, match="named 2 prompt.*batch of 3; nothing was run"):
        gpt2.generate(**batch, logits_processor=[rec], max_new_tokens=2, pad_token_id=PAD)
    assert rec.generations == ()
    # The failed call took them: the next call numbers its prompts.
    gpt2.generate(**batch, logits_processor=[rec], max_new_tokens=2, pad_token_id=PAD)
    assert [s["sample"] for s in rec.samples()] == [0, 1, 2]


def test_a_damaged_sample_list_in_the_manifest_is_refused(gpt2, tmp_path):
    _two_calls(gpt2, tmp_path / "run")
    manifest = tmp_path / "run" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["generations"][0]["sample_ids"] = ["q-a", "q-a", "q-c"]
    manifest.write_text(json.dumps(data))
    with pytest.raises(Exception, match="distinct"):
        open_recording(tmp_path / "run", verify=False).samples()


def _rows(table):
    return table.to_pylist()


@pytest.mark.parametrize("case", MODES)
def test_the_table_holds_logprobs_values_of_each_returned_sequence(gpt2, case, tmp_path):
    batch, kwargs, reference, rec = run_case(gpt2, case, ("logits", "scores", "stats"), tmp_path / "run")
    run = open_recording(tmp_path / "run")
    rows = _rows(_table.to_arrow(run, top=3, chunk_steps=5))
    for kind in ("raw", "processed"):
        expected = run.logprobs(kind=kind, top=3)
        got = [[] for _ in expected]
        for row in rows:
            got[row["sequence"]].append({
                "step": row["step"], "token": row["token"], "logprob": row[f"logprob_{kind}"], "rank": row[f"rank_{kind}"],
                "top_logprobs": [{"token": t, "logprob": v}
                                 for t, v in zip(row[f"top_tokens_{kind}"], row[f"top_logprobs_{kind}"])],
            })
        for entries in got:
            entries.sort(key=lambda entry: entry["step"])
        assert got == expected
    # Rows come by step, then sequence; the prompt and sample follow the sequence.
    assert [(r["step"], r["sequence"]) for r in rows] == sorted((r["step"], r["sequence"]) for r in rows)
    per_prompt = rec.generation().num_return_sequences
    assert all(r["prompt"] == r["sequence"] // per_prompt == r["sample"] for r in rows)
    assert _rows(_table.to_arrow(rec, top=3, chunk_steps=5)) == rows


def test_entropy_and_logprobs_come_from_the_stats_where_recorded(gpt2):
    batch, kwargs, reference, rec = run_case(gpt2, "sample_rows_finish_early", ("stats",))
    rows = _rows(_table.to_arrow(rec))
    stats = rec.stats()
    assert rows, "the table is empty"
    for row in rows:
        step = stats[row["step"]]
        for name in ("logprob_raw", "logprob_processed", "rank_raw", "rank_processed", "entropy_raw", "entropy_processed"):
            assert row[name] == step[name][row["sequence"]].item()
    # A stats-only recording has no alternatives: their columns hold nulls.
    assert all(r["top_tokens_raw"] is None for r in _rows(_table.to_arrow(rec, top=2)))


def test_entropy_from_the_full_tensors_is_the_stats_expression(gpt2):
    batch, kwargs, reference, rec = run_case(gpt2, "beam_return_sequences", ("logits", "scores"))
    rows = _rows(_table.to_arrow(rec))
    indices = rec.beam_indices()
    for row in rows[:20]:
        x = reference.logits[row["step"]]
        r = int(indices[row["sequence"], row["step"]])
        assert row["entropy_raw"] == torch.special.entr(torch.softmax(x, -1)).sum(-1)[r].float().item()


def test_top_alternatives_come_from_a_topk_stream(gpt2):
    batch, kwargs, reference, rec = run_case(gpt2, "sample_top_k_top_p", ("logits", "scores", "stats"))
    with Recorder(gpt2, streams=("logits", "scores", "stats"), encodings={"logits": "topk:4", "scores": "topk:4"}) as topk:
        torch.manual_seed(1234)
        gpt2.generate(**batch, logits_processor=[topk], max_new_tokens=12, **kwargs)
    rows = _rows(_table.to_arrow(topk, top=3))
    records = topk.topk("logits")
    for row in rows:
        record = records[row["step"]]
        assert row["top_tokens_raw"] == record["indices"][row["sequence"], :3].tolist()
        assert row["top_logprobs_raw"] == record["logprobs"][row["sequence"], :3].tolist()
    full = _rows(_table.to_arrow(rec, top=3))
    assert [r["logprob_raw"] for r in rows] == [r["logprob_raw"] for r in full]  # from the stats either way
    # More alternatives than the top-k stream holds: the K it holds.
    assert _rows(_table.to_arrow(topk, top=5))[0]["top_tokens_raw"] == records[0]["indices"][0].tolist()
    assert topk.logprobs(top=4)[0][0]["top_logprobs"][0]["token"] == records[0]["indices"][0, 0].item()


def test_write_parquet_reads_a_chunk_of_steps_at_a_time_and_loads_back(gpt2, tmp_path, monkeypatch):
    rec = _two_calls(gpt2, tmp_path / "run")
    run = open_recording(tmp_path / "run")
    widths = []
    original = Generation.logits

    def counting(self, **kwargs):
        widths.append(len(kwargs["steps"]))
        return original(self, **kwargs)

    monkeypatch.setattr(Generation, "logits", counting)
    result = _table.write_parquet(run, tmp_path / "tokens.parquet", top=2, chunk_steps=2)
    assert widths and max(widths) <= 2
    loaded = pq.read_table(tmp_path / "tokens.parquet")
    assert loaded.num_rows == result["rows"] == sum(len(s) for g in (0, 1) for s in rec.logprobs(g))
    assert loaded.equals(_table.to_arrow(run, top=2, chunk_steps=2))
    assert json.loads(loaded.column("metadata")[0].as_py()) == {"row": 10}
    assert set(loaded.column("sample").to_pylist()) == {"q-a", "q-b", "q-c", "3", "4", "5"}
    frame = _table.to_pandas(run)
    assert list(frame.columns[:6]) == ["generation", "sample", "prompt", "sequence", "step", "token"]
    assert len(frame) == loaded.num_rows and not frame["logprob_raw"].isna().any()


def test_the_export_loads_in_hugging_face_datasets(gpt2, tmp_path):
    datasets = pytest.importorskip("datasets", exc_type=ImportError)  # an old release's hub is too old for it
    _two_calls(gpt2, tmp_path / "run")
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "tokens.parquet"), "--top", "2"]) == 0
    dataset = datasets.Dataset.from_parquet(str(tmp_path / "tokens.parquet"), cache_dir=str(tmp_path / "cache"))
    assert dataset.num_rows == pq.read_table(tmp_path / "tokens.parquet").num_rows
    assert {"generation", "sample", "sequence", "step", "token", "logprob_raw", "logprob_processed", "rank_raw",
            "entropy_raw", "top_tokens_raw"} <= set(dataset.column_names)
    assert all(math.isfinite(value) for value in dataset["logprob_raw"])


def test_a_failed_export_leaves_no_file(gpt2, tmp_path, monkeypatch):
    _two_calls(gpt2, tmp_path / "run")
    run = open_recording(tmp_path / "run")

    def broken(self, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Generation, "stats", broken)
    with pytest.raises(OSError, match="No space"):
        _table.write_parquet(run, tmp_path / "tokens.parquet")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_the_table_refuses_bad_options(gpt2, tmp_path):
    rec = _two_calls(gpt2)
    with pytest.raises(TypeError, match="must be a Recorder, a Recording"):
        _table.to_arrow("not a recording")
    with pytest.raises(ValueError, match="`generations` must list indices.*0 to 1"):
        _table.to_arrow(rec, generations=[2])
    with pytest.raises(ValueError, match="`top` must be an int"):
        _table.to_arrow(rec, top=-1)
    with pytest.raises(ValueError, match="`chunk_steps` must be an int"):
        _table.to_arrow(rec, chunk_steps=0)
    assert main(["export", str(tmp_path / "missing"), str(tmp_path / "out.parquet")]) == 1
    assert not (tmp_path / "out.parquet").exists()


@pytest.mark.parametrize("command", [
    ["export", "{run}", "{run}/manifest.json"],
    ["view", "{run}", "-o", "{run}/page.html"],
    ["plot", "{run}", "-o", "{run}/plots"],
])
def test_nothing_is_written_inside_the_recording(gpt2, tmp_path, command, capsys):
    _two_calls(gpt2, tmp_path / "run")
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    assert main([part.format(run=tmp_path / "run") for part in command]) == 1
    assert "inside the recording" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == before
    open_recording(tmp_path / "run", verify=True)


@pytest.mark.parametrize("arguments, match", [
    (["--generations", "0,0"], "lists generation 0 twice"),
    (["--generations", ""], "at least one generation"),
    (["--tokenizer", "/nonexistent"], "must be a local directory (save_pretrained) or the demo model's name"),
])
def test_export_refuses_bad_options_with_a_clean_message(gpt2, tmp_path, arguments, match, capsys):
    _two_calls(gpt2, tmp_path / "run")
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out" / "t.parquet"), *arguments]) == 1
    assert match in capsys.readouterr().err
    assert not (tmp_path / "out" / "t.parquet").exists()


@pytest.mark.parametrize("ids, match", [
    ([2**70], "fit in 64 bits"), ([1, "1"], "1 and '1' count as the same"), ([], "at least one prompt"),
])
def test_set_samples_refuses_ids_a_table_cannot_hold(gpt2, ids, match):
    with pytest.raises((TypeError, ValueError), match=match):
        Recorder(gpt2).set_samples(ids)


def test_an_interrupted_call_gives_the_rows_of_its_recorded_steps(gpt2, tmp_path):
    from transformers import StoppingCriteriaList

    from ..helpers import FailAtStepCriteria

    with Recorder(gpt2, spill_dir=tmp_path / "run") as rec:
        rec.set_samples(["a", "b", "c"])
        with pytest.raises(RuntimeError):
            gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=8, do_sample=True,
                          pad_token_id=PAD, stopping_criteria=StoppingCriteriaList([FailAtStepCriteria(2)]))
    rows = _rows(_table.to_arrow(open_recording(tmp_path / "run")))
    assert sorted((r["sample"], r["step"]) for r in rows) == [(s, t) for s in "abc" for t in range(3)]
    assert not any(r["complete"] for r in rows)
    assert main(["plot", str(tmp_path / "run"), "-o", str(tmp_path / "png")]) == 0


def test_a_generation_stopped_before_its_first_step_exports_as_no_rows(tmp_path):
    """A process killed before a call's first shard leaves a generation of 0 steps: the table and the
    viewer take the others and give it no row."""
    from transformers_offload.answers.table import to_arrow

    model = make_tiny("gpt2")
    with Recorder(model, spill_dir=tmp_path / "run") as rec:
        model.generate(torch.tensor([[5, 6]]), logits_processor=[rec], max_new_tokens=2, pad_token_id=0)
        handle = model.register_forward_hook(lambda *args: (_ for _ in ()).throw(RuntimeError("killed in the prefill")))
        with pytest.raises(RuntimeError, match="killed in the prefill"):
            model.generate(torch.tensor([[5, 6]]), logits_processor=[rec], max_new_tokens=2, pad_token_id=0)
        handle.remove()
    run = open_recording(tmp_path / "run")
    assert run.generation(1).num_steps == 0 and not run.generation(1).complete
    table = to_arrow(run)
    assert set(table.column("generation").to_pylist()) == {0} and table.num_rows == 2
    assert run.logprobs(1) == []  # no row was recorded
    assert "<html" in pytest.importorskip("transformers_offload.answers.viewer").render(run)[:200].lower()


def test_export_writes_the_format_its_file_name_asks_for_and_refuses_others(gpt2, tmp_path, capsys):
    import pyarrow.csv as pcsv

    _two_calls(gpt2, tmp_path / "run")
    for name in ("t.parquet", "t.csv", "t.jsonl"):
        assert main(["export", str(tmp_path / "run"), str(tmp_path / name)]) == 0
    table = pq.read_table(tmp_path / "t.parquet")
    assert (tmp_path / "t.parquet").read_bytes()[:4] == b"PAR1"
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert rows == table.to_pylist()
    csv = pcsv.read_csv(tmp_path / "t.csv", convert_options=pcsv.ConvertOptions(
        column_types=table.schema, strings_can_be_null=True))  # CSV writes a missing value as an empty cell
    assert csv.column_names == table.column_names
    for name in table.column_names:  # read back as the table's types: every value as written (float32 round trips)
        assert csv.column(name).to_pylist() == table.column(name).to_pylist(), name
    for name, said in (("t.txt", "name the file .parquet (Parquet), .csv (CSV) or .jsonl"),
                       ("t", "from its extension '(none)'")):
        assert main(["export", str(tmp_path / "run"), str(tmp_path / name)]) == 1
        assert said in capsys.readouterr().err and not (tmp_path / name).exists()
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "top.csv"), "--top", "2"]) == 1
    assert "hold lists: write it as" in capsys.readouterr().err and not (tmp_path / "top.csv").exists()
