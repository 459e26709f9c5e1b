"""What the recorder hooks: per model instance, inert without it, undone by close(), thread-safe."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
from transformers import GenerationMixin, LogitsProcessor, StoppingCriteria, StoppingCriteriaList

from transformers_offload import Recorder, UnrecordedCallWarning, _compat
from transformers_offload.capture.hooks import is_hooked

from ..helpers import hf_reference, left_padded_batch, make_tiny

HOOKED = ("generate", "_get_logits_processor", "_get_stopping_criteria")


def test_importing_the_package_changes_nothing_in_transformers():
    script = (
        "import transformers, torch\n"
        "from transformers import GenerationMixin\n"
        "from transformers.generation import LogitsProcessorList, StoppingCriteriaList\n"
        "def snap():\n"
        "    return {c.__name__: dict(vars(c)) for c in (GenerationMixin, LogitsProcessorList,\n"
        "            StoppingCriteriaList, torch.nn.Module)}\n"
        "before = snap()\n"
        "import transformers_offload\n"
        "after = snap()\n"
        "assert before == after, [k for k in before if before[k] != after[k]]\n"
        "print('unchanged')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "unchanged" in done.stdout


def test_hooks_are_per_instance_and_undone_by_close(gpt2):
    other = make_tiny("gpt2", seed=1)
    class_before = dict(vars(GenerationMixin))
    rec = Recorder(gpt2)
    assert all(name in vars(gpt2) for name in HOOKED)
    assert len(gpt2._forward_hooks) == 1
    assert not any(name in vars(other) for name in HOOKED)
    assert dict(vars(GenerationMixin)) == class_before
    rec.close()
    assert not any(name in vars(gpt2) for name in HOOKED)
    assert len(gpt2._forward_hooks) == 0
    assert not is_hooked(gpt2)
    rec.close()  # idempotent


def test_with_block_undoes_hooks_and_keeps_the_recording(gpt2):
    with Recorder(gpt2) as rec:
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=3)
    assert rec.closed and not is_hooked(gpt2)
    assert len(rec.logits()) == 3


def test_calls_without_the_recorder_are_untouched(gpt2):
    batch = left_padded_batch()
    torch.manual_seed(0)
    plain = gpt2.generate(**batch, do_sample=True, max_new_tokens=6, return_dict_in_generate=True, output_scores=True)
    with pytest.warns(UnrecordedCallWarning, match="ran 1 time"), Recorder(gpt2) as rec:
        torch.manual_seed(0)
        hooked = gpt2.generate(
            **batch, do_sample=True, max_new_tokens=6, return_dict_in_generate=True, output_scores=True
        )
    assert torch.equal(plain.sequences, hooked.sequences)
    assert all(torch.equal(a, b) for a, b in zip(plain.scores, hooked.scores))
    assert rec.generations == ()


def test_two_recorders_on_one_model(gpt2):
    batch = left_padded_batch()
    first, second = Recorder(gpt2), Recorder(gpt2)
    gpt2.generate(**batch, logits_processor=[first], max_new_tokens=2)
    gpt2.generate(**batch, logits_processor=[second], max_new_tokens=3)
    first.close()
    assert is_hooked(gpt2), "closing one recorder removed the other's hooks"
    gpt2.generate(**batch, logits_processor=[second], max_new_tokens=4)
    second.close()
    assert not is_hooked(gpt2)
    assert [g.num_steps for g in first.generations] == [2]
    assert [g.num_steps for g in second.generations] == [3, 4]


def test_several_calls_are_several_generations(gpt2):
    batch = left_padded_batch()
    with Recorder(gpt2) as rec:
        gpt2.generate(**batch, logits_processor=[rec], max_new_tokens=2)
        gpt2.generate(batch["input_ids"][:1], logits_processor=[rec], max_new_tokens=5, do_sample=True)
    assert len(rec.generations) == 2
    assert len(rec.logits()) == 5 and rec.logits()[0].shape[0] == 1  # the latest
    assert len(rec.logits(0)) == 2 and rec.logits(0)[0].shape[0] == 3
    assert rec.generation(0).mode == "greedy_search" and rec.generation().mode == "sample"
    rec.clear()
    assert rec.generations == ()


def test_two_models_in_two_threads():
    models = [make_tiny("gpt2", seed=0), make_tiny("llama", seed=0)]
    batch = left_padded_batch()
    references = []
    for model in models:
        references.append(hf_reference(model, **batch, max_new_tokens=24))
    recorders = [Recorder(model) for model in models]
    barrier = threading.Barrier(2)
    errors = []

    def work(index: int) -> None:
        try:
            barrier.wait()
            for _ in range(3):
                models[index].generate(**batch, logits_processor=[recorders[index]], max_new_tokens=24)
        except BaseException as error:  # reported below, in the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for rec, reference in zip(recorders, references):
        assert len(rec.generations) == 3
        for generation in rec.generations:
            assert all(torch.equal(a, b) for a, b in zip(generation.logits(), reference.logits))
            assert all(torch.equal(a, b) for a, b in zip(generation.scores(), reference.scores))
        rec.close()


class _SeeStepInRing(StoppingCriteria):
    """Checks, at the end of each step, that the step's tensors already sit in a host slot."""

    def __init__(self, rec: Recorder) -> None:
        self.rec, self.seen = rec, []

    def __call__(self, input_ids, scores, **kwargs):
        capture = self.rec._active
        ring = capture.ring
        step = input_ids.shape[-1] - capture.facts.prompt_length - 1
        slot = ring._slots[ring._current]
        # In a slot, or (in host memory on CPU) already in the store, which takes each put at once.
        held = set(slot.written) if slot.step == step else set()
        held |= {name for name in ("logits", "scores", "finished") if capture.store.has(name, step)}
        self.seen.append((step, sorted(held), len(ring._slots)))
        if not _compat.CRITERIA_ANSWER_PER_ROW:
            return False  # up to 4.38 a criterion answers for the whole batch
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_each_step_is_copied_within_the_step_and_the_ring_stays_bounded(gpt2, store, tmp_path):
    batch = left_padded_batch()
    with Recorder(gpt2, ring_slots=3, **(store.options())) as rec:
        probe = _SeeStepInRing(rec)
        gpt2.generate(
            **batch, logits_processor=[rec], stopping_criteria=StoppingCriteriaList([probe]),
            max_new_tokens=40, min_new_tokens=40,
        )
    # Up to 4.38 the criteria list stops at the first criterion that says done: at the last step the
    # max-length criterion answers before the probe is asked.
    assert len(probe.seen) == (40 if _compat.CRITERIA_ANSWER_PER_ROW else 39)
    for step, (slot_step, written, slots) in enumerate(probe.seen):
        assert slot_step == step
        assert {"logits", "scores", "finished"} <= set(written)
        assert slots == 3
    assert len(rec.logits()) == 40


def test_an_instance_override_made_before_the_recorder_is_restored(gpt2):
    calls = []
    original = gpt2.generate

    def user_generate(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    gpt2.generate = user_generate
    with Recorder(gpt2) as rec:
        gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=2)
    assert gpt2.generate is user_generate and calls == [1]
    assert len(rec.logits()) == 2


def test_a_nested_call_without_the_recorder_is_not_recorded(gpt2):
    """A processor that calls generate() on the same model mid-run: the inner call is not recorded
    and the outer recording stays exact."""
    batch = left_padded_batch()
    inner = {"done": False}

    class PeekAhead(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if not inner["done"]:
                inner["done"] = True
                gpt2.generate(torch.full((1, 8), 9), max_new_tokens=2)
            return scores

    inner["done"] = True  # the reference run makes no nested call: it would not change the outer one
    reference = hf_reference(gpt2, **batch, max_new_tokens=5, logits_processor=[PeekAhead()])
    inner["done"] = False
    with Recorder(gpt2) as rec:
        gpt2.generate(**batch, max_new_tokens=5, logits_processor=[rec, PeekAhead()])
    assert inner["done"] and len(rec.generations) == 1
    assert rec.generation().prompt_length == batch["input_ids"].shape[1]
    assert all(torch.equal(a, b) for a, b in zip(rec.logits(), reference.logits))
    assert len(rec.logits()) == 5


def test_generations_compare_by_identity(gpt2):
    with Recorder(gpt2) as rec:
        for _ in range(2):
            gpt2.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=2)
    first, second = rec.generations
    assert first != second and first == first
    assert rec.generations.index(second) == 1 and len({first, second}) == 2
