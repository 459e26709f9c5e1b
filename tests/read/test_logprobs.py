"""`logprobs()`: each returned sequence's tokens with their logprob, rank and top alternatives, equal to
the documented expressions on Hugging Face's own `out.logits` / `out.scores` of the same call."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import StoppingCriteriaList

from transformers_offload import Recorder, open_recording

from ..helpers import CASES, EOS, NEW_TOKENS, PAD, FailAtStepCriteria, left_padded_batch, run_case, write_made_up_recording

MODES = ["greedy", "sample_top_k_top_p", "num_return_sequences", "greedy_rows_finish_early",
         "sample_rows_finish_early", "beam_search", "beam_return_sequences", "beam_rows_finish_early"]


def _recorded(model, case, spill_dir, streams=("logits", "scores", "stats")):
    """`test_stats.run_case`, with the end-of-sequence ids the case resolved to."""
    batch, kwargs, reference, rec = run_case(model, case, streams, spill_dir)
    eos = kwargs.get("eos_token_id", EOS)
    return batch, reference, eos if isinstance(eos, list) else [eos], rec


def _expected(reference, prompt, eos, kind, top):
    """The module's expressions on HF's tensors, walked from HF's own sequences and beam indices."""
    steps = reference.logits if kind == "raw" else reference.scores
    sequences = reference.sequences
    out = []
    for j in range(sequences.shape[0]):
        tokens = []
        for t in range(len(steps)):
            if reference.beam_indices is not None:
                row = int(reference.beam_indices[j, t]) if t < reference.beam_indices.shape[1] else -1
                if row < 0:
                    break
            else:
                row = j
                if t > 0 and int(sequences[j, prompt + t - 1]) in eos:
                    break
            x, y = steps[t], int(sequences[j, prompt + t])
            logprobs = torch.log_softmax(x, -1)
            entry = {"step": t, "token": y, "logprob": float(logprobs[row, y].float()),
                     "rank": int((x[row] > x[row, y]).sum())}
            if top:
                best = torch.topk(logprobs[row].float(), top)
                entry["top_logprobs"] = [{"token": int(i), "logprob": float(v)} for i, v in zip(best.indices, best.values)]
            tokens.append(entry)
        out.append(tokens)
    return out


@pytest.mark.parametrize("kind", ["raw", "processed"])
@pytest.mark.parametrize("case", MODES)
def test_logprobs_equal_the_expressions_on_hugging_faces_outputs(gpt2, case, kind, tmp_path):
    batch, reference, eos, rec = _recorded(gpt2, case, tmp_path / "run")
    expected = _expected(reference, batch["input_ids"].shape[1], eos, kind, top=3)
    for source in (rec, open_recording(tmp_path / "run")):
        assert source.logprobs(kind=kind, top=3) == expected
        assert source.logprobs(kind=kind, top=3, chunk_steps=5) == expected
    if "num_beams" not in CASES[case]:
        # The per-token statistics give the same logprob and rank for the chosen token.
        stats_only = source.logprobs(kind=kind)
        assert [[(e["token"], e["logprob"], e["rank"]) for e in row] for row in stats_only] == \
            [[(e["token"], e["logprob"], e["rank"]) for e in row] for row in expected]


def test_a_stats_only_recording_gives_logprobs_without_alternatives(gpt2, tmp_path):
    batch, reference, eos, rec = _recorded(gpt2, "sample_rows_finish_early", None, streams=("stats",))
    expected = _expected(reference, batch["input_ids"].shape[1], eos, "raw", top=0)
    assert rec.logprobs() == expected
    with pytest.raises(ValueError, match="needs the full 'logits' stream.*record `stats` and ask for `top=0`"):
        rec.logprobs(top=2)


def test_finished_rows_leave_out_their_padding(gpt2):
    batch, reference, eos, rec = _recorded(gpt2, "greedy_rows_finish_early", None)
    prompt = batch["input_ids"].shape[1]
    for j, tokens in enumerate(rec.logprobs()):
        generated = reference.sequences[j, prompt:].tolist()
        end = next((t + 1 for t, token in enumerate(generated) if token in eos), len(generated))
        assert [e["token"] for e in tokens] == generated[:end]
    assert any(len(tokens) < NEW_TOKENS for tokens in rec.logprobs()), "no row finished early: the test is blind"


class _Tokenizer:
    def decode(self, ids):
        return f"<{ids[0]}>"

    def convert_ids_to_tokens(self, ids):  # pragma: no cover - only its presence is checked
        return [str(i) for i in ids]


def test_a_tokenizer_adds_the_text(gpt2):
    _, _, _, rec = _recorded(gpt2, "greedy", None)
    first = rec.logprobs(top=2, tokenizer=_Tokenizer())[0][0]
    assert first["text"] == f"<{first['token']}>"
    assert [a["text"] for a in first["top_logprobs"]] == [f"<{a['token']}>" for a in first["top_logprobs"]]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"kind": "softmax"}, ValueError, "`kind` must be 'raw'"),
    ({"top": -1}, ValueError, "`top` must be"),
    ({"top": 1.5}, ValueError, "`top` must be"),
    ({"chunk_steps": 0}, ValueError, "`chunk_steps` must be"),
    ({"tokenizer": object()}, TypeError, "`tokenizer` must be"),
])
def test_bad_arguments_are_refused(gpt2, kwargs, error, match):
    _, _, _, rec = _recorded(gpt2, "greedy", None)
    with pytest.raises(error, match=match):
        rec.logprobs(**kwargs)


def test_an_incomplete_generation_gives_the_logprobs_of_its_recorded_tokens(gpt2, tmp_path):
    batch = left_padded_batch()
    with Recorder(gpt2, spill_dir=tmp_path / "run") as rec:
        with pytest.raises(RuntimeError, match="on purpose"):
            gpt2.generate(**batch, logits_processor=[rec], stopping_criteria=StoppingCriteriaList([FailAtStepCriteria(3)]),
                          max_new_tokens=8, do_sample=True, pad_token_id=PAD)
    generation = open_recording(tmp_path / "run").generation()
    assert not generation.complete and generation.sequences is None and generation.num_steps == 4
    found = generation.logprobs()
    assert [[e["step"] for e in row] for row in found] == [[0, 1, 2, 3]] * 3
    for row, entries in enumerate(found):
        for entry in entries:
            x, y = generation.logits(steps=entry["step"])[0], int(generation.tokens(steps=entry["step"])[0][row])
            assert entry["token"] == y and entry["logprob"] == float(torch.log_softmax(x, -1)[row, y])


def test_an_incomplete_beam_search_has_no_logprobs(tmp_path):
    write_made_up_recording(tmp_path / "run", steps=3, rows=2, vocab=4, shard_bytes=10**6, complete=False)
    generation = open_recording(tmp_path / "run").generation()
    assert generation.logprobs()  # sampling: its recorded tokens
    generation = dataclasses.replace(generation, header=dataclasses.replace(generation.header, num_beams=2,
                                                                             mode="beam_search"))
    with pytest.raises(ValueError, match="beam search need the sequences.*incomplete"):
        generation.logprobs()
