"""`kept_sets`: each sampled token's kept set (the ids the processors left finite) from a recording, as CSR,
exactly `isfinite(out.scores[t][r])`; refused where the recording cannot give it, or where a replay over it
would not be the sampler's distribution."""

from __future__ import annotations

import pytest
import torch

from transformers_offload import KeptSets, Recorder, kept_sets, open_recording

from ..helpers import make_tiny

# The tests compare with `out.scores`, which they ask for.
pytestmark = pytest.mark.filterwarnings("ignore::transformers_offload.errors.DeviceAccumulationWarning")
def test_the_kept_sets_are_the_finite_scores_of_each_sampled_token(tmp_path, sample):
    model = make_tiny("llama")
    with Recorder(model, streams=("logits", "scores"), spill_dir=tmp_path / "run") as rec:
        out = sample(model, rec)
    for source in (rec, open_recording(tmp_path / "run"), rec.generation()):
        kept = kept_sets(source)
        assert isinstance(kept, KeptSets) and (kept.rows, kept.steps) == (4, len(out.scores))
        assert kept.offsets.dtype == torch.int64 and kept.ids.dtype == torch.int32
        assert kept.offsets.shape == (kept.rows * kept.steps + 1,) and int(kept.offsets[-1]) == kept.ids.numel()
        checked = 0
        for t, scores in enumerate(out.scores):
            for r in range(4):
                assert int(kept.tokens[r, t]) == int(out.sequences[r, 4 + t])
                if not kept.valid[r, t]:
                    continue
                expected = torch.isfinite(scores[r]).nonzero().flatten()
                assert 1 <= expected.numel() <= 20  # top-k 20 and top-p 0.8 kept a few
                assert not kept.full[r, t] and torch.equal(kept.ids_at(r, t).long(), expected)
                assert int(kept.tokens[r, t]) in expected.tolist()
                checked += 1
        assert checked == int(kept.valid.sum()) > 0
        assert torch.all(kept.temperature == 0.7) and not kept.greedy.any()
    moved = kept.to("meta")
    assert moved.ids.device.type == "meta" and moved.vocab_size == kept.vocab_size
    assert kept.nbytes == sum(getattr(kept, n).numel() * getattr(kept, n).element_size()
                              for n in ("offsets", "ids", "tokens", "valid", "full", "greedy", "temperature"))


def test_a_step_that_masks_nothing_is_full_and_stores_no_ids(sample):
    model = make_tiny("llama")
    with Recorder(model, streams=("logits", "scores")) as rec:
        sample(model, rec, top_p=1.0, top_k=0, temperature=1.0)
    kept = kept_sets(rec)
    assert kept.full[kept.valid].all() and kept.ids.numel() == 0 and kept.ids_at(0, 0) is None


def test_finished_rows_and_several_generations_line_up_as_rows(sample):
    model = make_tiny("llama")
    with Recorder(model, streams=("logits", "scores")) as rec:
        sample(model, rec, max_new_tokens=3)
        sample(model, rec, max_new_tokens=5, eos_token_id=[3, 4, 5, 6, 7, 8, 9])
    kept = kept_sets(rec)
    assert (kept.rows, kept.steps) == (8, 5) and kept.generations == (0,) * 4 + (1,) * 4
    assert not kept.valid[:4, 3:].any()  # the first generation's padding steps
    finished = torch.stack(rec.generation(1).finished(), 1)
    assert torch.equal(kept.valid[4:, : finished.shape[1]], ~finished)


def test_what_cannot_give_the_exact_sets_is_refused(sample, prompts):
    model = make_tiny("llama")
    with Recorder(model, streams=("logits",)) as rec:
        sample(model, rec)
    with pytest.raises(ValueError, match="recorded no processed scores"):
        kept_sets(rec)
    with Recorder(model, streams=("scores",), encodings={"scores": "topk:4:q4"}) as rec:
        sample(model, rec)
    with pytest.raises(ValueError, match="does not keep every finite entry exactly"):
        kept_sets(rec)
    with Recorder(model, streams=("scores",), encodings={"scores": "topk:2"}) as rec:
        sample(model, rec)
    with pytest.raises(ValueError, match="larger than K"):
        kept_sets(rec)
    with Recorder(model, streams=("logits", "scores")) as rec:
        sample(model, rec, repetition_penalty=1.3)
    with pytest.raises(ValueError, match="repetition_penalty, which change the scores' finite values"):
        kept_sets(rec)
    assert kept_sets(rec, mask_only=True).ids.numel() > 0
    with Recorder(model, streams=("logits", "scores")) as rec:
        model.generate(**prompts, logits_processor=[rec], num_beams=2, max_new_tokens=3, pad_token_id=0)
    with pytest.raises(ValueError, match="beam search"):
        kept_sets(rec)
    with pytest.raises(TypeError, match="expected a Generation"):
        kept_sets(object())


def test_a_processor_the_config_does_not_name_is_caught_by_the_raw_logits(prompts):
    from transformers import LogitsProcessor

    class Bias(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores + 0.5  # finite values changed, nothing in the generation config says so

    model = make_tiny("llama")
    with Recorder(model, streams=("logits", "scores")) as rec:
        torch.manual_seed(0)
        model.generate(**prompts, logits_processor=[Bias(), rec], do_sample=True, top_k=20, max_new_tokens=3, pad_token_id=0)
    with pytest.raises(ValueError, match="step 0: the kept scores are not the raw logits"):
        kept_sets(rec)


def test_a_topk_record_wide_enough_gives_the_same_sets(sample):
    model = make_tiny("llama")
    with Recorder(model, streams=("logits", "scores")) as dense:
        sample(model, dense)
    with Recorder(model, streams=("logits", "scores"), encodings={"scores": "topk:24"}) as compact:
        sample(model, compact)
    a, b = kept_sets(dense), kept_sets(compact)
    assert torch.equal(a.offsets, b.offsets) and torch.equal(a.ids, b.ids) and torch.equal(a.tokens, b.tokens)


@pytest.mark.slow  # continuous batching's manager on CPU: 20 s
def test_continuous_batching_requests_are_rows_of_their_own_and_replay_is_their_processed_logprob():
    from transformers import GenerationConfig

    from transformers_offload import replay_logprobs
    from transformers_offload.capture import continuous

    if not continuous.runner_known():
        pytest.skip("this release's continuous batching is refused by the recorder")
    model = make_tiny("llama")
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12], [13, 14]]
    torch.manual_seed(0)
    with Recorder(model, streams=("logits", "scores")) as rec:
        model.generate_batch(prompts, generation_config=GenerationConfig(max_new_tokens=5, do_sample=True, top_k=5,
                                                                          temperature=0.7, eos_token_id=None, pad_token_id=0),
                             logits_processor=[rec], progress_bar=False)
    assert [g.mode for g in rec.generations] == ["continuous_batching"] * 3
    kept = kept_sets(rec)
    assert (kept.rows, kept.steps) == (3, 5) and bool(kept.valid.all()) and kept.generations == (0, 1, 2)
    assert torch.all(kept.offsets[1:] - kept.offsets[:-1] == 5)  # top-k 5 at every step
    for r, generation in enumerate(rec.generations):
        raw = torch.stack(generation.logits(), 1)
        processed = torch.stack([torch.log_softmax(s, -1).gather(-1, t[:, None])[:, 0]
                                 for s, t in zip(generation.scores(), generation.tokens())], 1)
        assert (replay_logprobs(raw, kept_sets(generation)) - processed).abs().max() <= 1e-6
        assert torch.equal(kept.tokens[r], torch.cat(generation.tokens()))
