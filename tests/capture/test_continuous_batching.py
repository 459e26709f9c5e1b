"""Continuous batching recorded per request: `generate_batch(..., logits_processor=[rec])` and a manager
given to `rec.attach`. Each request is one generation of one row, keyed by its request id, checked
against the result transformers returns; what the runner does past the Recorder's taps is refused."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import GenerationConfig, TemperatureLogitsWarper, TopKLogitsWarper

from transformers_offload import Recorder, RecordingMismatchWarning, UnsupportedModeError, _compat
from transformers_offload.capture import continuous, continuous_requests

from ..helpers import STATS_KEYS, assert_steps_equal, assert_topk_equal, expected_stats, make_tiny

pytestmark = [
    pytest.mark.skipif(not _compat.CONTINUOUS_BATCHING_ENTRIES,
                       reason=f"transformers {_compat.TRANSFORMERS_VERSION} has no continuous batching"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
RECORDED = pytest.mark.skipif(not continuous.runner_known(),
                              reason=f"transformers {_compat.TRANSFORMERS_VERSION}'s continuous batching is refused")

PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12], [13, 14]]
GREEDY = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
SAMPLED = dict(max_new_tokens=6, do_sample=True, top_k=5, temperature=0.7, eos_token_id=None, pad_token_id=0)


def _batch(model, rec, options, **config):
    torch.manual_seed(0)
    if config:  # a ContinuousBatchingConfig (5.x)
        from transformers import ContinuousBatchingConfig

        config = {"continuous_batching_config": ContinuousBatchingConfig(**config)}
    return model.generate_batch(PROMPTS, generation_config=GenerationConfig(**options), logits_processor=[rec],
                                progress_bar=False, **config)


def _by_request(generations) -> dict:
    return {generation.sample_ids[0]: generation for generation in generations}


@RECORDED
def test_each_request_is_a_generation_of_its_own_equal_to_its_result(store):
    model = make_tiny("llama")
    with Recorder(model, **store.options()) as rec:
        results = _batch(model, rec, GREEDY)
    recording = _by_request(store.reopen(rec).generations)
    assert sorted(recording) == sorted(results) and len(results) == len(PROMPTS)
    for request_id, result in results.items():
        generation = recording[request_id]
        assert generation.complete and generation.error is None and generation.mode == "continuous_batching"
        assert generation.num_steps == len(result.generated_tokens) == GREEDY["max_new_tokens"]
        assert [int(t) for t in torch.cat(generation.tokens())] == result.generated_tokens
        assert generation.sequences.tolist() == [[*result.prompt_ids, *result.generated_tokens]]
        assert not torch.cat(generation.finished()).any()
        # No processor runs on greedy decoding: what it takes the argmax of are the raw logits.
        assert all(torch.equal(a, b) for a, b in zip(generation.logits(), generation.scores()))
        assert [int(step.argmax()) for step in generation.scores()] == result.generated_tokens


@RECORDED
def test_greedy_requests_choose_the_tokens_generate_chooses_for_each_prompt_alone():
    model = make_tiny("llama")
    with Recorder(model) as rec:
        results = _batch(model, rec, GREEDY)
    for request_id, result in results.items():
        alone = model.generate(torch.tensor([result.prompt_ids]), max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert alone[0, len(result.prompt_ids):].tolist() == result.generated_tokens, request_id
    assert len(rec.generations) == len(PROMPTS)


@RECORDED
def test_sampled_scores_are_the_warpers_applied_to_the_recorded_logits_and_give_the_returned_logprobs():
    model = make_tiny("llama")
    with Recorder(model) as rec:
        results = _batch(model, rec, SAMPLED, return_logprobs=True)
    warpers = [TemperatureLogitsWarper(SAMPLED["temperature"]), TopKLogitsWarper(SAMPLED["top_k"])]
    recording = _by_request(rec.generations)
    checked = 0
    for request_id, result in results.items():
        generation = recording[request_id]
        assert [int(t) for t in torch.cat(generation.tokens())] == result.generated_tokens
        for step, (logits, scores, token) in enumerate(zip(generation.logits(), generation.scores(), generation.tokens())):
            expected = logits.clone()
            for warper in warpers:
                expected = warper(None, expected)
            assert torch.equal(scores, expected), (request_id, step)
            assert int((scores > float("-inf")).sum()) == SAMPLED["top_k"]
            # The runner's logprob: log of the softmax of what it samples from, at the chosen token.
            logprob = torch.softmax(scores, dim=-1).gather(1, token[:, None].long()).log()
            assert torch.equal(logprob.flatten(), torch.tensor([result.logprobs[step]])), (request_id, step)
            checked += 1
    assert checked == len(PROMPTS) * SAMPLED["max_new_tokens"]


@RECORDED
def test_the_logprobs_rl_needs_are_their_expressions_and_near_a_float64_computation_over_the_kept_tokens():
    """docs/recording.md's recipe: the sampled token's logprob under the distribution sampled from
    (renormalised over the tokens top-k kept) and under the unprocessed one."""
    model = make_tiny("llama")
    with Recorder(model) as rec:
        _batch(model, rec, SAMPLED)
    worst, checked = 0.0, 0
    for generation in rec.generations:
        sampled, unprocessed = generation.logprobs(kind="processed")[0], generation.logprobs(kind="raw")[0]
        for step, (scores, logits, token) in enumerate(zip(generation.scores(), generation.logits(), generation.tokens())):
            y = int(token)
            assert sampled[step]["logprob"] == torch.log_softmax(scores, -1)[0, y].float().item()
            assert unprocessed[step]["logprob"] == torch.log_softmax(logits, -1)[0, y].float().item()
            kept = scores[0] > float("-inf")
            renormalised = scores[0, y].double() - torch.logsumexp(scores[0, kept].double(), 0)
            whole = logits[0, y].double() - torch.logsumexp(logits[0].double(), 0)
            worst = max(worst, abs(sampled[step]["logprob"] - renormalised.item()),
                        abs(unprocessed[step]["logprob"] - whole.item()))
            checked += 1
    assert checked == len(PROMPTS) * SAMPLED["max_new_tokens"]
    assert worst < 1e-5, worst  # float32 against float64: 1.7e-7 at most measured (docs/recording.md)


@RECORDED
@pytest.mark.parametrize("options", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_stats_are_their_expressions_on_the_recorded_logits_scores_and_tokens(options, store):
    model = make_tiny("llama")
    with Recorder(model, streams=("logits", "scores", "stats"), **store.options()) as rec:
        results = _batch(model, rec, options)
    checked = 0
    for generation in store.reopen(rec).generations:
        assert generation.complete and generation.num_steps == len(results[generation.sample_ids[0]].generated_tokens)
        for t, (step, x, s, y) in enumerate(zip(generation.stats(), generation.logits(), generation.scores(),
                                                 generation.tokens())):
            expected = expected_stats(x, s, y, None)
            for name in STATS_KEYS:
                assert step[name].dtype == expected[name].dtype, (t, name)
                assert torch.equal(step[name], expected[name]), (generation.sample_ids, t, name)
            checked += 1
    assert checked == len(PROMPTS) * options["max_new_tokens"]


@RECORDED
def test_the_encodings_hold_what_a_dense_recording_of_the_same_batch_holds(store):
    model = make_tiny("llama")
    with Recorder(model, encodings={"scores": "dense"}) as dense:
        _batch(model, dense, SAMPLED)
    encodings = {"logits": "topk:4", "scores": "sparse"}
    with Recorder(model, encodings=encodings, **store.options()) as rec:
        _batch(model, rec, SAMPLED)
    with Recorder(model) as default:  # sampled through top-k: scores sparse by default on the CPU
        _batch(model, default, SAMPLED)
    reference, encoded = _by_request(dense.generations), _by_request(store.reopen(rec).generations)
    assert sorted(encoded) == sorted(reference) and len(reference) == len(PROMPTS)
    for request_id, generation in encoded.items():
        assert generation.encodings == encodings and torch.equal(generation.sequences, reference[request_id].sequences)
        assert_topk_equal(generation.topk("logits"), reference[request_id].logits(), 4)
        assert_steps_equal(generation.scores(), reference[request_id].scores(), "scores")
    for generation in default.generations:
        assert generation.encodings == {"scores": "sparse"}
        assert_steps_equal(generation.scores(), reference[generation.sample_ids[0]].scores(), "scores")
    assert all(not g.encodings for g in dense.generations)


@RECORDED
def test_a_returned_logprob_that_disagrees_with_the_recorded_scores_marks_the_request_incomplete(monkeypatch):
    model = make_tiny("llama")
    original = continuous_requests.check

    def off_by_one_ulp(result, steps):
        result.logprobs[1] = float(torch.nextafter(torch.tensor(result.logprobs[1]), torch.tensor(0.0)))
        return original(result, steps)

    monkeypatch.setattr(continuous_requests, "check", off_by_one_ulp)
    with Recorder(model) as rec:
        with pytest.warns(RecordingMismatchWarning, match="logprob"):
            _batch(model, rec, SAMPLED, return_logprobs=True)
    assert len(rec.generations) == len(PROMPTS)
    assert not any(generation.complete for generation in rec.generations)


@RECORDED
def test_a_manager_attached_by_hand_records_each_request_it_hands_out():
    model = make_tiny("llama")
    with Recorder(model) as rec:
        manager = model.init_continuous_batching(generation_config=GenerationConfig(**GREEDY))
        rec.attach(manager)
        manager.start()
        try:
            ids = [manager.add_request(prompt, request_id=f"q{i}", max_new_tokens=2 + i, eos_token_id=[100 + i])
                   for i, prompt in enumerate(PROMPTS)]
            results = {}
            while len(results) < len(ids):
                result = manager.get_result(timeout=5)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
        finally:
            manager.stop(block=True)
    recording = _by_request(rec.generations)
    assert sorted(recording) == ["q0", "q1", "q2"]
    for request_id, result in results.items():
        assert [int(t) for t in torch.cat(recording[request_id].tokens())] == result.generated_tokens
    for i in range(len(PROMPTS)):  # what add_request set, over the manager's config
        generation = recording[f"q{i}"]
        assert generation.generation_config["max_new_tokens"] == 2 + i >= generation.num_steps
        assert generation.generation_config["eos_token_id"] == [100 + i] and generation.eos_token_id == (100 + i,)


@RECORDED
def test_what_continuous_batching_does_not_give_is_refused_before_it_runs():
    model = make_tiny("llama", attn_implementation="eager")
    with Recorder(model, streams=("logits", "scores", "attentions")) as rec:
        with pytest.raises(UnsupportedModeError, match="attentions"):
            _batch(model, rec, GREEDY)
    assert rec.generations == ()
    with Recorder(model) as rec:
        with pytest.raises(UnsupportedModeError, match="use_async_batching=False"):
            _batch(model, rec, GREEDY, use_async_batching=True)
    assert rec.generations == ()


@RECORDED
def test_processors_continuous_batching_drops_are_refused_before_it_runs():
    """transformers builds the manager's processors from the generation config and drops those it marks
    unsupported (a logged warning): its requests would not be sampled as the config says."""
    model = make_tiny("llama")
    with Recorder(model) as rec:
        with pytest.raises(UnsupportedModeError, match="RepetitionPenaltyLogitsProcessor.*drops"):
            _batch(model, rec, {**SAMPLED, "repetition_penalty": 1.3})
    assert rec.generations == ()
    from transformers import ContinuousBatchingConfig

    config = GenerationConfig(**SAMPLED, repetition_penalty=1.3)
    assert continuous.dropped_processors(model.init_continuous_batching(generation_config=config)) == [
        "RepetitionPenaltyLogitsProcessor"]
    kept = model.init_continuous_batching(generation_config=config, continuous_batching_config=ContinuousBatchingConfig(
        drop_unsupported_processors=False))
    assert continuous.dropped_processors(kept) == []  # transformers runs it: recorded as it ran


@pytest.mark.skipif(continuous.runner_known(), reason="this release's continuous batching is recorded")
def test_a_release_whose_runner_the_capture_does_not_know_is_refused_before_it_runs():
    model = make_tiny("llama")
    with Recorder(model) as rec:
        with pytest.raises(UnsupportedModeError, match="does not know"):
            _batch(model, rec, GREEDY)
    assert rec.generations == ()


def test_generate_with_a_paged_cache_is_refused_before_it_runs():
    model = make_tiny("llama")
    with Recorder(model) as rec:
        # UnsupportedModeError is a ValueError; releases whose generate() does not switch to continuous
        # batching on a paged cache (4.54-4.5x) refuse the value themselves, as without a Recorder.
        with pytest.raises(ValueError, match="continuous batching|paged") as caught:
            model.generate(torch.tensor([[3, 4, 5]]), logits_processor=[rec], cache_implementation="paged",
                           max_new_tokens=3)
    if isinstance(caught.value, UnsupportedModeError):
        assert "generate_batch(inputs, logits_processor=[rec])" in str(caught.value)  # says what works
    assert rec.generations == ()


def test_generate_batch_without_a_recorder_is_left_alone_and_unwrapped_after_close():
    model = make_tiny("llama")
    with Recorder(model) as rec:
        assert "generate_batch" in vars(model)
        torch.manual_seed(0)
        results = model.generate_batch(PROMPTS[:1], generation_config=GenerationConfig(**GREEDY), progress_bar=False)
        assert rec.generations == () and (len(results) == 1 or not continuous.runner_known())  # 5.0 fails it itself
    assert "generate_batch" not in vars(model) and "init_continuous_batching" not in vars(model)


@RECORDED
def test_every_call_records_calls_that_were_not_given_the_recorder_leaving_their_arguments_alone():
    """As TRL's GRPO trainer generates: `generate_batch` called by code that passes no processor."""
    model = make_tiny("llama")
    config = GenerationConfig(**SAMPLED)
    processors = []
    with Recorder(model, every_call=True) as rec:
        for step in range(2):  # a training-style loop: generate, then (here) nothing to update
            torch.manual_seed(step)
            results = model.generate_batch(PROMPTS, generation_config=config, progress_bar=False)
            alone = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=3, do_sample=False, pad_token_id=0,
                                   logits_processor=processors)
    assert processors == []  # the caller's list is not touched
    modes = [generation.mode for generation in rec.generations]
    assert modes == ["continuous_batching"] * 3 + ["greedy_search"] + ["continuous_batching"] * 3 + ["greedy_search"]
    assert torch.equal(rec.generations[-1].sequences, alone)
    recording = _by_request(rec.generations[4:7])
    for request_id, result in results.items():
        assert [int(t) for t in torch.cat(recording[request_id].tokens())] == result.generated_tokens


def test_every_call_must_be_a_bool():
    with pytest.raises(TypeError, match="every_call"):
        Recorder(make_tiny("llama"), every_call="yes")


@RECORDED
@pytest.mark.cuda
def test_on_cuda_each_step_leaves_the_device_without_a_synchronising_call(monkeypatch):
    from transformers import ContinuousBatchingConfig

    def strict(x):
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return to_host(x)
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    to_host = continuous._to_host
    monkeypatch.setattr(continuous, "_to_host", strict)
    model = make_tiny("llama").to("cuda")
    config = ContinuousBatchingConfig(use_cuda_graph=False, use_async_batching=False)
    with Recorder(model) as rec:
        torch.manual_seed(0)
        results = model.generate_batch(PROMPTS, generation_config=GenerationConfig(**SAMPLED), logits_processor=[rec],
                                       progress_bar=False, continuous_batching_config=config)
    recording = _by_request(rec.generations)
    assert sorted(recording) == sorted(results)
    for request_id, result in results.items():
        generation = recording[request_id]
        assert generation.complete and [int(t) for t in torch.cat(generation.tokens())] == result.generated_tokens
        assert all(not step.is_cuda for step in generation.logits() + generation.scores())


@RECORDED
def test_a_persistent_manager_is_recorded_once_per_request_and_left_untapped_when_the_recorder_closes():
    model = make_tiny("llama")
    config = GenerationConfig(**GREEDY)
    with Recorder(model) as rec:
        for _ in range(3):  # the same manager each time: attaching again is a no-op
            results = model.generate_batch(PROMPTS[:2], generation_config=config, logits_processor=[rec],
                                           progress_bar=False, persistent_manager=True)
    assert len(rec.generations) == 6 and all(g.complete and g.num_steps == 5 for g in rec.generations)
    with Recorder(model) as again:  # the first recorder's taps are gone: the next one records the same manager
        results = model.generate_batch(PROMPTS[:2], generation_config=config, logits_processor=[again],
                                       progress_bar=False, persistent_manager=True)
    assert len(again.generations) == 2 and all(g.complete for g in again.generations)
    for request_id, result in results.items():
        assert [int(t) for t in torch.cat(_by_request(again.generations)[request_id].tokens())] == result.generated_tokens


@RECORDED
def test_a_manager_is_recorded_by_one_recorder_attached_before_it_starts():
    model = make_tiny("llama")
    manager = model.init_continuous_batching(generation_config=GenerationConfig(**GREEDY))
    with Recorder(model) as first, Recorder(model) as second:
        first.attach(manager)
        first.attach(manager)  # no-op
        with pytest.raises(RuntimeError, match="another Recorder"):
            second.attach(manager)
        manager.start()
        try:
            with pytest.raises(RuntimeError, match="before `manager.start\\(\\)`"):
                Recorder(model).attach(manager)
            manager.add_request(PROMPTS[0], request_id="q")
            result = None
            while result is None:
                result = manager.get_result(timeout=5)
        finally:
            manager.stop(block=True)
    assert len(first.generations) == 1 and first.generations[0].complete and second.generations == ()
    with pytest.raises(RuntimeError, match="closed"):
        first.attach(manager)
    with pytest.raises(TypeError, match="continuous batching manager"):
        Recorder(model).attach(object())


@RECORDED
def test_num_return_sequences_gives_a_one_row_generation_per_returned_sequence():
    model = make_tiny("llama")
    with Recorder(model) as rec:
        results = _batch(model, rec, {**SAMPLED, "num_return_sequences": 2})
    assert len(results) == 2 * len(PROMPTS) == len(rec.generations)
    for sample in rec.samples():
        assert sample["rows"] == [0] and sample["sequences"] == [0] and sample["prompt_length"] > 0
    for request_id, result in results.items():
        assert [int(t) for t in torch.cat(_by_request(rec.generations)[request_id].tokens())] == result.generated_tokens


@RECORDED
def test_a_bare_recorder_is_refused_and_other_processors_are_named_as_not_run():
    from transformers import LogitsProcessor

    class Boost(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores + 100 * (torch.arange(scores.shape[-1]) == 7)

    model = make_tiny("llama")
    config = GenerationConfig(**GREEDY)
    with Recorder(model) as rec:
        with pytest.raises(TypeError, match="must be a list"):
            model.generate_batch(PROMPTS[:1], generation_config=config, logits_processor=rec, progress_bar=False)
        with pytest.warns(UserWarning, match="does not run the `logits_processor` it is given \\(Boost\\)"):
            model.generate_batch(PROMPTS[:1], generation_config=config, logits_processor=[Boost(), rec],
                                 progress_bar=False)
    (generation,) = rec.generations
    assert generation.complete and all(torch.equal(a, b) for a, b in zip(generation.logits(), generation.scores()))


@RECORDED
def test_requests_not_handed_out_before_close_are_named_and_their_steps_dropped():
    from transformers_offload.errors import UnrecordedCallWarning

    model = make_tiny("llama")
    manager = model.init_continuous_batching(generation_config=GenerationConfig(**{**GREEDY, "max_new_tokens": 3}))
    rec = Recorder(model)
    rec.attach(manager)
    manager.start()
    try:
        manager.add_request(PROMPTS[0], request_id="never-read")
        deadline = time.monotonic() + 60
        while not rec._continuous._pending and time.monotonic() < deadline:  # noqa: SLF001 - a step recorded
            time.sleep(0.01)
    finally:
        manager.stop(block=True)
    with pytest.warns(UnrecordedCallWarning, match="never-read"):
        rec.close()
    assert rec.generations == () and not rec._continuous._pending  # noqa: SLF001
    assert "get_result" not in vars(manager)
