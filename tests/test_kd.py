"""Distillation: the table of teacher targets (`export --kd`: top-K ids, logprobs and the tail's log-mass,
from generated steps or prompt logprobs), `kd_loss` against the dense loss over the whole vocabulary,
`KDCollator` and `group_sequences`, and `examples/distill.py` end to end."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transformers_offload import KDCollator, Recorder, group_sequences, kd_loss, open_recording, write_kd_parquet
from transformers_offload.answers.kd_table import kd_arrow
from transformers_offload.cli import main

from .helpers import PAD, ROOT, VOCAB, left_padded_batch, make_tiny


def _record(tmp_path: Path, *, encodings: dict | None = None, prompt_logprobs: int | bool | None = None,
            streams: tuple[str, ...] = ("logits",), seed: int = 0) -> Path:
    """A spilled recording of the tiny Llama: three left-padded prompts, sampled, two sequences each."""
    model = make_tiny("llama")
    path = tmp_path / f"run-{seed}-{'-'.join(sorted((encodings or {}).values()))}-{prompt_logprobs}"
    options = {"encodings": encodings} if encodings else {}
    if prompt_logprobs is not None:
        options["prompt_logprobs"] = prompt_logprobs
    with Recorder(model, spill_dir=path, streams=streams, **options) as rec:
        torch.manual_seed(seed)
        model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=5, do_sample=True, top_k=20,
                       num_return_sequences=2, pad_token_id=PAD)
    return path


def _dense_kl(teacher_logprobs: torch.Tensor, student_logits: torch.Tensor, kind: str) -> torch.Tensor:
    """The loss over the whole vocabulary, per position: the reference `kd_loss` approximates."""
    log_p = teacher_logprobs
    log_q = torch.log_softmax(student_logits, -1)
    p, q = log_p.exp(), log_q.exp()
    if kind == "forward":
        return (p * (log_p - log_q)).sum(-1)
    if kind == "reverse":
        return (q * (log_q - log_p)).sum(-1)
    log_m = torch.logaddexp(log_p, log_q) - math.log(2.0)
    return 0.5 * ((p * (log_p - log_m)).sum(-1) + (q * (log_q - log_m)).sum(-1))


def _targets(teacher_logprobs: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Top-k targets and the tail's log-mass, as the table computes them from dense logits."""
    best = torch.topk(teacher_logprobs, k, -1)
    rest = teacher_logprobs.scatter(-1, best.indices, float("-inf"))
    return {"top_ids": best.indices, "top_logprobs": best.values, "tail_logmass": torch.logsumexp(rest, -1)}


def _logits(seed: int, shape: tuple[int, ...], scale: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype) * scale


# -- the table ----------------------------------------------------------------------------------------

def test_the_table_holds_each_tokens_context_and_the_teachers_top_k_from_its_logits(tmp_path):
    path = _record(tmp_path)
    run = open_recording(path)
    generation = run.generation()
    rows = kd_arrow(run, top=8).to_pylist()
    sequences, logits = generation.sequences, generation.logits()
    prompt_length, lengths = generation.prompt_length, generation.prompt_lengths
    assert rows and {row["sequence"] for row in rows} == set(range(sequences.shape[0]))
    for row in rows:
        j = row["sequence"]
        prompt = sequences[j, prompt_length - lengths[j // 2]:prompt_length].tolist()
        step = row["position"] - len(prompt)
        assert row["input_ids"] == prompt + sequences[j, prompt_length:prompt_length + step].tolist()
        assert len(row["input_ids"]) == row["position"] and row["token"] == int(sequences[j, prompt_length + step])
        expected = _targets(torch.log_softmax(logits[step][j].float(), -1), 8)
        assert row["top_ids"] == expected["top_ids"].tolist()
        assert torch.equal(torch.tensor(row["top_logprobs"]), expected["top_logprobs"])
        assert row["tail_logmass"] == pytest.approx(float(expected["tail_logmass"]), abs=1e-6)
    run.close()


def test_a_finished_row_stops_at_its_end_of_sequence_token(tmp_path):
    path = _record(tmp_path)
    with open_recording(path) as run:
        generation = run.generation()
        finished = torch.stack(generation.finished(), 1)
        rows = kd_arrow(run, top=2).to_pylist()
    per_sequence = {j: sum(1 for row in rows if row["sequence"] == j) for j in range(finished.shape[0])}
    for j, count in per_sequence.items():
        done = finished[j].nonzero()
        assert count == (int(done[0]) if done.numel() else finished.shape[1])


def test_k_equal_to_the_vocabulary_leaves_no_tail(tmp_path):
    with open_recording(_record(tmp_path)) as run:
        rows = kd_arrow(run, top=VOCAB).to_pylist()
    assert all(row["tail_logmass"] == float("-inf") and sorted(row["top_ids"]) == list(range(VOCAB)) for row in rows)


@pytest.mark.parametrize("top", [3, 6])
def test_a_topk_recording_gives_the_dense_recordings_targets(tmp_path, top):
    dense = kd_arrow(open_recording(_record(tmp_path)), top=top).to_pylist()
    # top=None takes the recorded K (6); top=3 drops three of them, whose mass joins the tail.
    encoded = kd_arrow(open_recording(_record(tmp_path, encodings={"logits": "topk:6"})),
                       top=None if top == 6 else top).to_pylist()
    assert len(encoded) == len(dense)
    for a, b in zip(dense, encoded):
        assert {k: a[k] for k in ("sequence", "position", "token", "input_ids", "top_ids")} == \
            {k: b[k] for k in ("sequence", "position", "token", "input_ids", "top_ids")}
        assert b["top_logprobs"] == pytest.approx(a["top_logprobs"], abs=1e-6)
        assert b["tail_logmass"] == pytest.approx(a["tail_logmass"], abs=1e-6)


@pytest.mark.parametrize("bits", [2, 5, 8])
def test_a_lossy_topk_recording_gives_targets_that_sum_to_one_with_its_exact_tail(tmp_path, bits):
    """`topk:K:qB` quantises the K log-probabilities and keeps the mass outside them exactly: the export
    rescales the K probabilities by one factor per row so that the row sums to 1 (the expression in
    `kd_table._from_topk`), and `kd_loss` takes them."""
    run = open_recording(_record(tmp_path, encodings={"logits": f"topk:6:q{bits}"}))
    rows = kd_arrow(run, top=4).to_pylist()
    records = {}
    for generation in run:
        for step, record in enumerate(generation.topk("logits")):
            records[step] = record
    assert rows
    for row in rows:
        mass = math.fsum(math.exp(v) for v in row["top_logprobs"]) + math.exp(row["tail_logmass"])
        assert abs(mass - 1.0) < 1e-6
    # The expression, on one record: decoded logprobs shifted by log((1 - mass_outside) / sum(exp(logprobs))).
    record = records[0]
    from transformers_offload.answers.kd_table import _from_topk

    ids, logprobs, tail = _from_topk(record, 4, lossy=True)
    decoded, outside = record["logprobs"].double(), record["mass_outside"].double()
    expected = decoded + torch.log1p(-outside)[:, None] - torch.logsumexp(decoded, -1, keepdim=True)
    assert torch.equal(logprobs, expected[:, :4].float())
    assert torch.equal(tail, torch.logaddexp(torch.log(outside), torch.logsumexp(expected[:, 4:], -1)).float())
    batch = KDCollator(pad_token_id=PAD)(group_sequences(rows))
    assert torch.isfinite(kd_loss(torch.randn(*batch["input_ids"].shape, VOCAB), batch))


def test_targets_in_bfloat16_are_checked_within_bfloat16s_precision():
    teacher = torch.log_softmax(_logits(15, (2, 3, VOCAB), 3.0), -1)
    targets = {name: value.to(torch.bfloat16) if value.is_floating_point() else value
               for name, value in _targets(teacher, 8).items()}
    assert torch.isfinite(kd_loss(_logits(16, (2, 3, VOCAB), 2.0, torch.float32), targets))


def test_top_above_the_recorded_k_is_refused(tmp_path):
    with open_recording(_record(tmp_path, encodings={"logits": "topk:6"})) as run:
        with pytest.raises(ValueError, match=r"`top` must be at most the recorded K \(6"):
            kd_arrow(run, top=7)


def test_prompt_rows_hold_the_teachers_scores_on_the_prompts_text(tmp_path):
    model = make_tiny("llama")
    batch = left_padded_batch()
    with open_recording(_record(tmp_path, prompt_logprobs=6)) as run:
        rows = kd_arrow(run, prompt=True).to_pylist()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert len(rows) == int(mask.sum()) - ids.shape[0]  # every prompt token after each prompt's first
    for row in rows:
        p = row["sequence"] // 2
        prompt = ids[p][mask[p].bool()].tolist()
        assert row["input_ids"] == prompt[:row["position"]] and row["token"] == prompt[row["position"]]
        with torch.no_grad():
            x = model(torch.tensor([row["input_ids"]])).logits[0, -1].float()
        expected = _targets(torch.log_softmax(x, -1), 6)
        assert row["top_ids"] == expected["top_ids"].tolist()
        assert row["top_logprobs"] == pytest.approx(expected["top_logprobs"].tolist(), abs=1e-5)
        assert row["tail_logmass"] == pytest.approx(float(expected["tail_logmass"]), abs=1e-5)


def test_a_rescored_recording_gives_the_teachers_targets_on_another_models_completions(tmp_path):
    from transformers_offload import rescore

    teacher = make_tiny("llama", seed=1)
    with open_recording(_record(tmp_path)) as run:  # the student's completions
        rows = kd_arrow(rescore(run, teacher), top=5).to_pylist()
        assert [r["input_ids"] for r in rows] == [r["input_ids"] for r in kd_arrow(run, top=5).to_pylist()]
    for row in rows:
        with torch.no_grad():
            x = teacher(torch.tensor([row["input_ids"]])).logits[0, -1].float()
        expected = _targets(torch.log_softmax(x, -1), 5)
        assert row["top_ids"] == expected["top_ids"].tolist()
        assert row["top_logprobs"] == pytest.approx(expected["top_logprobs"].tolist(), abs=1e-5)
        assert row["tail_logmass"] == pytest.approx(float(expected["tail_logmass"]), abs=1e-5)


def test_the_cli_writes_tables_that_load_in_datasets(tmp_path, capsys):
    datasets = pytest.importorskip("datasets", exc_type=ImportError)  # an old release's hub is too old for it
    path = _record(tmp_path, prompt_logprobs=4)
    assert main(["export", str(path), str(tmp_path / "kd.parquet"), "--kd", "--top", "5"]) == 0
    assert main(["export", str(path), str(tmp_path / "kd_prompt.parquet"), "--kd", "--prompt", "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{"):])["rows"] > 0
    rows = datasets.Dataset.from_parquet(str(tmp_path / "kd.parquet"), cache_dir=str(tmp_path / "cache"))
    assert rows.column_names == ["generation", "sample", "sequence", "position", "token", "input_ids", "top_ids",
                                 "top_logprobs", "tail_logmass"]
    assert all(len(ids) == 5 for ids in rows["top_ids"])
    prompt_rows = datasets.Dataset.from_parquet(str(tmp_path / "kd_prompt.parquet"), cache_dir=str(tmp_path / "cache"))
    assert all(len(ids) == 4 for ids in prompt_rows["top_ids"])
    examples = group_sequences(datasets.concatenate_datasets([prompt_rows, rows]))
    assert len(examples) == 6  # 3 prompts x 2 sequences; the prompt rows join each prompt's first sequence
    for example in examples:
        assert example["position"] == sorted(example["position"])
        assert len(example["input_ids"]) == example["position"][-1] + 1


@pytest.mark.parametrize("arguments, match", [
    (["--kd", "--top", "0"], "`top` must be an int of at least 1"),
    (["--kd", "--prompt"], "no selected generation holds top-k prompt logprobs"),
])
def test_export_kd_refuses_bad_options_with_a_clean_message(tmp_path, capsys, arguments, match):
    path = _record(tmp_path)
    assert main(["export", str(path), str(tmp_path / "kd.parquet"), *arguments]) == 1
    assert match in capsys.readouterr().err
    assert not (tmp_path / "kd.parquet").exists()


def test_a_recording_without_logits_is_refused(tmp_path):
    with open_recording(_record(tmp_path, streams=("scores",))) as run:
        with pytest.raises(ValueError, match="no selected generation holds the `logits` stream"):
            write_kd_parquet(run, tmp_path / "kd.parquet")


# -- the loss -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["forward", "reverse", "jsd"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_with_k_equal_to_the_vocabulary_the_loss_is_the_dense_loss(kind, dtype, tolerance):
    teacher = torch.log_softmax(_logits(0, (6, 9, VOCAB), 3.0), -1)
    student = _logits(1, (6, 9, VOCAB), 2.0)
    targets = {name: value.to(dtype) if value.is_floating_point() else value
               for name, value in _targets(teacher, VOCAB).items()}
    found = kd_loss(student.to(dtype), targets, kind=kind, reduction="none")
    assert found.dtype == dtype and torch.allclose(found.double(), _dense_kl(teacher, student, kind), rtol=0, atol=tolerance)


@pytest.mark.parametrize("kind", ["forward", "reverse", "jsd"])
def test_with_temperature_and_k_equal_to_the_vocabulary_both_sides_are_tempered(kind):
    logits = _logits(2, (7, VOCAB), 4.0)
    student = _logits(3, (7, VOCAB), 2.0)
    found = kd_loss(student, _targets(torch.log_softmax(logits, -1), VOCAB), temperature=2.5, kind=kind,
                    reduction="none")
    assert torch.allclose(found, _dense_kl(torch.log_softmax(logits / 2.5, -1), student / 2.5, kind), atol=1e-12)


@pytest.mark.parametrize("k", [1, 8, 64])
def test_below_the_vocabulary_the_loss_is_the_dense_loss_less_what_the_tails_disagree_on(k):
    teacher = torch.log_softmax(_logits(4, (20, VOCAB), 3.0), -1)
    student = _logits(5, (20, VOCAB), 2.0)
    targets = _targets(teacher, k)
    log_q = torch.log_softmax(student, -1)
    outside = torch.ones_like(teacher, dtype=torch.bool).scatter(-1, targets["top_ids"], False)
    # The chain rule of KL: dense = bucketed + p_tail * KL(p_rest || q_rest), the tails each normalised.
    p_rest = torch.log_softmax(teacher.masked_fill(~outside, float("-inf")), -1)
    q_rest = torch.log_softmax(log_q.masked_fill(~outside, float("-inf")), -1)
    inside_kl = torch.where(outside, p_rest.exp() * (p_rest - q_rest), torch.zeros_like(p_rest)).sum(-1)
    gap = targets["tail_logmass"].exp() * inside_kl
    found = kd_loss(student, targets, reduction="none")
    assert torch.allclose(found + gap, _dense_kl(teacher, student, "forward"), atol=1e-12)
    for kind in ("forward", "reverse", "jsd"):  # merging tokens never raises a divergence
        assert (kd_loss(student, targets, kind=kind, reduction="none") <= _dense_kl(teacher, student, kind) + 1e-12).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_the_gradient_is_the_gradient_of_the_expression(temperature):
    student = _logits(6, (3, 4, 16), 2.0).requires_grad_()
    teacher = torch.log_softmax(_logits(7, (3, 4, 16), 3.0), -1)
    targets = _targets(teacher, 5)
    targets["top_logprobs"][0, 1, 3:] = float("-inf")  # padding alternatives (a row with fewer than K)
    targets["top_ids"][0, 1, 3:] = 0
    targets["tail_logmass"][0, 1] = torch.log1p(-targets["top_logprobs"][0, 1].exp().sum())  # the mass outside the 3
    targets["target_mask"] = torch.ones((3, 4), dtype=torch.bool)
    targets["target_mask"][2, 2:] = False
    for kind in ("forward", "reverse", "jsd"):
        assert torch.autograd.gradcheck(lambda z, kind=kind: kd_loss(z, targets, temperature, kind), (student,))


def _tail(logprobs: list[float]) -> float:
    """The tail a table row holds: log(1 - sum(exp(logprobs)))."""
    return math.log1p(-math.fsum(math.exp(value) for value in logprobs))


def test_padding_positions_give_no_nan_and_no_gradient():
    student = _logits(8, (2, 5, VOCAB), 2.0, torch.float32).requires_grad_()
    rows = [{"input_ids": [3, 4, 5], "position": 3, "top_ids": [7, 8], "top_logprobs": [-0.5, -1.5],
             "tail_logmass": _tail([-0.5, -1.5])},
            {"input_ids": [3, 4, 5, 6, 9], "position": 2, "top_ids": [9], "top_logprobs": [-0.1], "tail_logmass": _tail([-0.1])}]
    batch = KDCollator(pad_token_id=PAD)(rows)
    loss = kd_loss(student, batch, kind="reverse")
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(student.grad).all()
    nonzero = student.grad.abs().sum(-1) > 0
    assert nonzero.tolist() == batch["target_mask"].tolist()
    assert batch["target_mask"].nonzero().tolist() == [[0, 2], [1, 1]]


def test_kd_loss_refuses_bad_arguments():
    student = torch.zeros((2, VOCAB))
    targets = _targets(torch.log_softmax(torch.zeros((2, VOCAB)), -1), 3)
    with pytest.raises(ValueError, match="`kind` must be one of"):
        kd_loss(student, targets, kind="kl")
    with pytest.raises(ValueError, match="`temperature` must be a positive number"):
        kd_loss(student, targets, temperature=0)
    with pytest.raises(ValueError, match="`targets` lacks \\['tail_logmass'\\]"):
        kd_loss(student, {k: v for k, v in targets.items() if k != "tail_logmass"})
    with pytest.raises(ValueError, match="must match `student_logits`"):
        kd_loss(torch.zeros((3, VOCAB)), targets)


# -- collator and examples ----------------------------------------------------------------------------

def test_a_batch_of_sequences_gives_the_loss_of_each_row_alone(tmp_path):
    with open_recording(_record(tmp_path, prompt_logprobs=8)) as run:
        rows = kd_arrow(run, top=8).to_pylist() + kd_arrow(run, prompt=True).to_pylist()
    examples = group_sequences(rows)
    student = make_tiny("gpt2", seed=3)
    collate = KDCollator(pad_token_id=PAD)
    batch = collate(examples)
    assert batch["input_ids"].shape[0] == 6 and int(batch["target_mask"].sum()) == len(rows)
    with torch.no_grad():
        together = kd_loss(student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double(),
                           batch, reduction="sum")
        one_by_one = 0.0
        for row in rows:  # each table row alone: its context, one target at its last position
            alone = collate([row])
            one_by_one += float(kd_loss(student(input_ids=alone["input_ids"]).logits.double(), alone, reduction="sum"))
    assert float(together) == pytest.approx(one_by_one, rel=1e-5)


def test_the_collator_refuses_rows_it_cannot_place():
    collate = KDCollator()
    with pytest.raises(ValueError, match="lacks \\['tail_logmass'\\]"):
        collate([{"input_ids": [1], "position": 1, "top_ids": [1], "top_logprobs": [0.0]}])
    with pytest.raises(ValueError, match="needs 1 <= position <= len\\(input_ids\\)"):
        collate([{"input_ids": [1], "position": 2, "top_ids": [1], "top_logprobs": [0.0], "tail_logmass": -1.0}])
    with pytest.raises(ValueError, match="`pad_token_id` must be an int"):
        KDCollator(pad_token_id=None)


@pytest.mark.parametrize("kind", ["forward", "reverse", "jsd"])
def test_a_tail_of_zero_mass_with_every_id_kept_gives_the_dense_loss_exactly_as_before(kind, monkeypatch):
    teacher = torch.log_softmax(_logits(11, (3, 4, VOCAB), 3.0), -1)
    student = _logits(12, (3, 4, VOCAB), 2.0)
    targets = _targets(teacher, VOCAB)
    targets["tail_logmass"] = torch.full_like(targets["tail_logmass"], float("-inf"))  # every id kept
    found = kd_loss(student, targets, kind=kind, reduction="none")
    assert torch.allclose(found, _dense_kl(teacher, student, kind), rtol=0, atol=1e-12)
    from transformers_offload import distill

    monkeypatch.setattr(distill, "_check_mass", lambda *arguments: None)  # the loss as it was before the check
    assert torch.equal(found, kd_loss(student, targets, kind=kind, reduction="none"))


def test_targets_whose_mass_is_not_one_are_refused_saying_where_and_how_much():
    teacher = torch.log_softmax(_logits(13, (2, 3, VOCAB), 3.0), -1)
    student = _logits(14, (2, 3, VOCAB), 2.0)
    targets = _targets(teacher, VOCAB)
    targets["tail_logmass"] = torch.zeros_like(targets["tail_logmass"])  # a tail of 0 with every id kept
    targets["tail_logmass"][0, 1] = float("-inf")  # this one is right
    with pytest.raises(ValueError, match=r"5 target\(s\) whose kept probability plus tail mass is not 1 \(within 0.001\): "
                                         r"position \(0, 0\): 2, \(0, 2\): 2, \(1, 0\): 2"):
        kd_loss(student, targets)
    # The tail's mass counted twice: refused too; positions the mask leaves out are not checked.
    targets = _targets(teacher, 4)
    assert (targets["tail_logmass"].exp() > 0.01).all()
    targets["tail_logmass"] = targets["tail_logmass"] + math.log(2.0)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    assert torch.isfinite(kd_loss(student, {**targets, "target_mask": mask}))
    with pytest.raises(ValueError, match="not 1"):
        kd_loss(student, {**targets, "target_mask": ~mask})
    # Within the tolerance (float32 rounding): accepted.
    close = _targets(teacher, 4)
    close["tail_logmass"] = close["tail_logmass"] + 1e-5
    assert torch.isfinite(kd_loss(student, close))


def test_the_collator_refuses_a_target_whose_mass_is_not_one():
    row = {"input_ids": [3, 4, 5], "position": 2, "top_ids": [7, 8], "top_logprobs": [-0.5, -1.5]}
    with pytest.raises(ValueError, match=r"feature 0: the target at position 2 holds a kept probability plus tail mass "
                                         r"of 1\.8296\d*, not 1"):
        KDCollator()([{**row, "tail_logmass": 0.0}])
    batch = KDCollator()([{**row, "tail_logmass": _tail([-0.5, -1.5])}])
    assert batch["target_mask"].tolist() == [[False, True, False]]


def test_max_length_cuts_sequences_and_their_targets():
    example = {"input_ids": [5, 6, 7, 8], "position": [1, 2, 3], "top_ids": [[6], [7], [8]],
               "top_logprobs": [[-0.1], [-0.2], [-0.3]], "tail_logmass": [_tail([-0.1]), _tail([-0.2]), _tail([-0.3])]}
    batch = KDCollator(max_length=2)([example])
    assert batch["input_ids"].tolist() == [[5, 6]] and batch["target_mask"].tolist() == [[True, True]]


# -- the example, on the real model --------------------------------------------------------------------

@pytest.mark.slow
def test_the_example_distils_the_real_models_targets_and_the_loss_falls(real_model, tmp_path):
    pytest.importorskip("datasets", exc_type=ImportError)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "datasets-cache"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "distill.py"), "--prompts", "2", "--new-tokens", "12", "--steps", "15",
         "--held-out", "0",
         "--json", str(tmp_path / "curve.json")],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "curve.json").read_text())
    assert len(result["curve"]) == 15 and result["after"] < 0.7 * result["before"], result
    assert "completion rows" in done.stdout and "prompt rows" in done.stdout
