"""`transition_scores()` equals Hugging Face's `model.compute_transition_scores(out.sequences,
out.scores, out.beam_indices, normalize_logits)` of the same call, bit for bit, and HF's helper takes
the recording's own tuples."""

from __future__ import annotations

import pytest
import torch

from transformers_offload import Recorder, open_recording
from transformers_offload.read.transition_scores import transition_scores

from ..helpers import left_padded_batch, run_case

MODES = ["greedy", "sample_top_k_top_p", "num_return_sequences", "greedy_rows_finish_early",
         "sample_rows_finish_early", "beam_search", "beam_return_sequences", "beam_rows_finish_early", "beam_sample"]


def _recorded(model, case, spill_dir):
    _, _, reference, rec = run_case(model, case, ("logits", "scores"), spill_dir)
    return reference, rec


@pytest.mark.parametrize("normalize", [False, True], ids=["scores", "normalized"])
@pytest.mark.parametrize("case", MODES)
def test_transition_scores_equal_hugging_face(gpt2, case, normalize, tmp_path):
    reference, rec = _recorded(gpt2, case, tmp_path / "run")
    expected = gpt2.compute_transition_scores(reference.sequences, reference.scores, reference.beam_indices,
                                              normalize_logits=normalize)
    for source in (rec, open_recording(tmp_path / "run")):
        mine = source.transition_scores(normalize_logits=normalize)
        assert mine.dtype == expected.dtype and mine.shape == expected.shape
        assert torch.equal(mine, expected)
    # One row at a time (normalised) reads the rows in groups: the same bits.
    grouped = transition_scores(open_recording(tmp_path / "run").generation(), normalize_logits=normalize,
                                row_group_bytes=1)
    assert torch.equal(grouped, expected)


@pytest.mark.parametrize("case", ["sample_top_k_top_p", "beam_return_sequences"])
def test_hugging_faces_helper_takes_the_recordings_tuples(gpt2, case, tmp_path):
    reference, rec = _recorded(gpt2, case, tmp_path / "run")
    run = open_recording(tmp_path / "run")
    beam_indices = run.beam_indices() if run.generation().is_beam else None
    for normalize in (False, True):
        theirs = gpt2.compute_transition_scores(reference.sequences, reference.scores, reference.beam_indices,
                                                normalize_logits=normalize)
        from_recording = gpt2.compute_transition_scores(run.generation().sequences, run.scores(), beam_indices,
                                                        normalize_logits=normalize)
        assert torch.equal(from_recording, theirs)


def test_transition_scores_refuse_bad_input(gpt2, tmp_path):
    with Recorder(gpt2) as rec:
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=3)
    with pytest.raises(TypeError, match="`normalize_logits` must be True or False"):
        rec.transition_scores(normalize_logits="yes")
    with Recorder(gpt2, streams=("logits",)) as rec:
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=3)
    with pytest.raises(KeyError, match="no 'scores' stream"):
        rec.transition_scores()


def test_an_incomplete_generation_has_no_transition_scores(tmp_path):
    from ..helpers import write_made_up_recording

    write_made_up_recording(tmp_path / "run", steps=3, rows=2, vocab=4, shard_bytes=10**6, complete=False)
    with pytest.raises(ValueError, match="incomplete"):
        open_recording(tmp_path / "run").transition_scores()
