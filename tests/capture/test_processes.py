"""A Recorder and other processes, with real processes: a forked child (multiprocessing's fork, what
`datasets.map(num_proc=N)` and DataLoader workers do) is refused before its call runs when the recorder
writes a `spill_dir` (nothing overwritten, the parent's recording intact and still its own); an in-memory
recorder records the child's calls in the child; a recorder never pickles (spawn); and the pattern the
refusal names, one recorder per worker in `rank-R` folders, gives every worker's generations as one recording,
from multiprocessing and from `datasets.map(num_proc=2)`."""

from __future__ import annotations

import multiprocessing
import pickle
import traceback

import pytest
import torch

from transformers_offload import Recorder, open_recording

from ..helpers import make_tiny

# The tests compare with `out.scores`, which they ask for; forked children inherit the filter.
pytestmark = pytest.mark.filterwarnings("ignore::transformers_offload.errors.DeviceAccumulationWarning")
PROMPTS = ([10, 20], [30, 40])  # the first token of each child's two prompts


def _generate(model, rec, first: int, **kwargs):
    ids = torch.tensor([[first, 6, 7]])
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), logits_processor=[rec],
                          max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                          output_scores=True, **kwargs)


def _in_child(queue, work, *args) -> None:
    """Run `work` in the child and put ("ok", its result) or ("error", type, message) on the queue."""
    torch.set_num_threads(1)  # a fork of a process whose OpenMP threads ran hangs in its first parallel region
    try:
        queue.put(("ok", work(*args)))
    except BaseException as error:  # noqa: BLE001 - sent to the parent to assert on
        queue.put(("error", type(error).__name__, str(error), traceback.format_exc()))


def _forked(work, *args, timeout: float = 300) -> tuple:
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    process = context.Process(target=_in_child, args=(queue, work, *args))
    process.start()
    result = queue.get(timeout=timeout)
    process.join(timeout=timeout)
    assert process.exitcode == 0, f"the child exited {process.exitcode}"
    return result


def test_a_forked_child_of_a_spilled_recorder_is_refused_before_its_call_and_the_parents_recording_is_intact(tmp_path):
    model = make_tiny("llama")
    rec = Recorder(model, spill_dir=tmp_path / "run")
    _generate(model, rec, 5)  # the parent's own generation, before the fork

    def work(firsts):
        for first in firsts:
            _generate(model, rec, first)

    results = [_forked(work, firsts) for firsts in PROMPTS]
    assert [result[:2] for result in results] == [("error", "RuntimeError")] * 2
    assert all("a fork of it" in result[2] and "nothing was run" in result[2] and "rank-{rank}" in result[2]
               for result in results)
    after = _generate(model, rec, 50)  # the parent records on, its lock held
    rec.close()
    run = open_recording(tmp_path / "run")
    assert len(run.generations) == 2  # the parent's two; nothing of the children
    assert torch.equal(run.scores(generation=1)[0], after.scores[0])
    assert run.verify()["files"] == 4  # two generations' shard and sequences files


def test_a_forked_child_records_into_its_own_memory_with_an_in_memory_recorder():
    model = make_tiny("llama")
    rec = Recorder(model)

    def work(firsts):
        outs = [_generate(model, rec, first) for first in firsts]
        return [(len(rec.generations), all(torch.equal(a, b) for a, b in zip(rec.scores(generation=i), out.scores)))
                for i, out in enumerate(outs)][-1]

    assert _forked(work, PROMPTS[0]) == ("ok", (2, True))
    assert len(rec.generations) == 0  # the parent's recorder never sees the child's calls
    rec.close()


def test_a_recorder_never_pickles_and_a_spawned_process_cannot_be_handed_one(tmp_path):
    model = make_tiny("llama")
    with Recorder(model, spill_dir=tmp_path / "run") as rec:
        with pytest.raises(TypeError, match="create a Recorder inside each worker"):
            pickle.dumps(rec)
        with pytest.raises(TypeError, match="with a transformers-offload Recorder attached, cannot be pickled"):
            pickle.dumps(model)
        process = multiprocessing.get_context("spawn").Process(target=print, args=(rec,))
        with pytest.raises(TypeError, match="cannot be pickled"):
            process.start()  # spawn pickles its arguments in the parent, before the child runs anything


def _record_rank(model, root, rank: int, firsts) -> list[list[int]]:
    with Recorder(model, spill_dir=root / f"rank-{rank}", append=True) as rec:
        sequences = []
        for first in firsts:
            rec.set_samples([f"p{first}"])
            sequences.append(_generate(model, rec, first).sequences[0].tolist())
    return sequences


def test_one_recorder_per_forked_worker_gives_every_generation_as_one_recording(tmp_path):
    model = make_tiny("llama")
    parent = Recorder(model)  # the parent's own recorder, attached when the children fork, stays out of their calls
    returned = {}
    for rank, firsts in enumerate(PROMPTS):
        status, sequences = _forked(_record_rank, model, tmp_path, rank, firsts)
        assert status == "ok"
        returned.update({f"p{first}": sequence for first, sequence in zip(firsts, sequences)})
    parent.close()
    run = open_recording(tmp_path)
    assert run.ranks == (0, 1) and len(run.generations) == 4
    assert [generation.sample_ids[0] for generation in run.generations] == ["p10", "p20", "p30", "p40"]
    for index, generation in enumerate(run.generations):
        prompt = returned[generation.sample_ids[0]][:3]
        tokens = torch.stack(run.tokens(generation=index), dim=1)[0].tolist()
        assert prompt + tokens == returned[generation.sample_ids[0]]


def test_datasets_map_with_two_processes_records_every_batch_once(tmp_path):
    datasets = pytest.importorskip("datasets", exc_type=ImportError)  # an old release's hub is too old for it
    model = make_tiny("llama")
    root = tmp_path / "map"
    prompts = datasets.Dataset.from_dict({"id": [f"q{i}" for i in range(6)], "first": [10 + i for i in range(6)]})

    def generate_batch(batch, rank):
        torch.set_num_threads(1)  # as in _in_child: map's workers are forks
        with Recorder(model, spill_dir=root / f"rank-{rank}", append=True) as rec:
            ids = torch.tensor([[first, 6, 7] for first in batch["first"]])
            rec.set_samples(batch["id"])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), logits_processor=[rec],
                                 max_new_tokens=3, do_sample=False, pad_token_id=0)
        return {"sequence": out.tolist()}

    mapped = prompts.map(generate_batch, batched=True, batch_size=2, num_proc=2, with_rank=True,
                         cache_file_name=str(tmp_path / "cache" / "mapped.arrow"))
    run = open_recording(root)
    assert run.ranks == (0, 1)
    assert sorted(sample for generation in run.generations for sample in generation.sample_ids) == mapped["id"]
    sequences = dict(zip(mapped["id"], mapped["sequence"]))
    for index, generation in enumerate(run.generations):
        tokens = torch.stack(run.tokens(generation=index), dim=1).tolist()
        for sample, row in zip(generation.sample_ids, tokens):
            assert sequences[sample][3:] == row


def test_datasets_map_in_one_process_appends_every_batch_to_one_spilled_recording(tmp_path):
    datasets = pytest.importorskip("datasets", exc_type=ImportError)
    model = make_tiny("llama")
    prompts = datasets.Dataset.from_dict({"id": [f"q{i}" for i in range(5)], "first": [10 + i for i in range(5)]})

    def generate_batch(batch):
        with Recorder(model, spill_dir=tmp_path / "run", append=True) as rec:  # one recording, a generation a batch
            ids = torch.tensor([[first, 6, 7] for first in batch["first"]])
            rec.set_samples(batch["id"])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), logits_processor=[rec],
                                 max_new_tokens=3, do_sample=False, pad_token_id=0)
        return {"sequence": out.tolist()}

    mapped = prompts.map(generate_batch, batched=True, batch_size=2, cache_file_name=str(tmp_path / "mapped.arrow"))
    run = open_recording(tmp_path / "run")
    assert [generation.sample_ids for generation in run.generations] == [("q0", "q1"), ("q2", "q3"), ("q4",)]
    sequences = dict(zip(mapped["id"], mapped["sequence"]))
    for generation in run.generations:
        assert torch.equal(generation.sequences, torch.tensor([sequences[sample] for sample in generation.sample_ids]))
