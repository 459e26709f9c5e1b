"""compare(a, b): a recording against itself gives exactly 0 and full agreement; every per-token value
equals an independent float64 computation from the dense tensors (written here, row by row); sparse and
native recordings give the same values as dense; top-k ones a lower-bound estimate, flagged; what does
not line up is refused; the steps are read a chunk at a time; the CLI and the compare page."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from transformers_offload import CompareError, Comparison, Generation, Recorder, compare, open_recording, rescore, write_html
from transformers_offload.cli import main

from ..helpers import EOS, PAD, bench_module, left_padded_batch, make_tiny

MODES = {
    "greedy": {"do_sample": False},
    "sample": {"do_sample": True, "top_k": 20, "temperature": 0.8, "num_return_sequences": 2},
    "beam": {"num_beams": 3, "num_return_sequences": 2},
}


class FavourEos:
    """A logits processor raising EOS from step `start` on in every other row: rows finish mid-run."""

    def __init__(self, start: int) -> None:
        self.start = start

    def __call__(self, input_ids, scores):
        if input_ids.shape[-1] >= self.start:
            scores = scores.clone()
            scores[1::2, EOS] += 30.0
        return scores


def _record(model, kwargs, *, spill_dir=None, steps=8, samples=None, **recorder):
    torch.manual_seed(1)
    with Recorder(model, spill_dir=spill_dir, **recorder) as rec:
        if samples is not None:
            rec.set_samples(samples)
        model.generate(**left_padded_batch(), logits_processor=[rec, FavourEos(11)], max_new_tokens=steps,
                       pad_token_id=PAD, eos_token_id=EOS, **kwargs)
    return rec if spill_dir is None else open_recording(spill_dir)


def _perturbed(name="gpt2", mix=0.3):
    """The tiny model with its weights moved `mix` of the way towards another seed's: another
    distribution at every step, and another top-1 at some."""
    model, other = make_tiny(name), make_tiny(name, seed=1)
    with torch.no_grad():
        for mine, theirs in zip(model.parameters(), other.parameters()):
            mine.lerp_(theirs, mix)
    return model


def _reference(a: Generation, b: Generation, stream: str = "logits") -> list[dict]:
    """Every per-token value, computed row by row from the dense tensors in float64, without
    `answers.compare_metrics`."""
    read = (lambda g: g.logits()) if stream == "logits" else (lambda g: g.scores())
    xs_a, xs_b, tokens = read(a), read(b), a.tokens()
    finished = a.finished() if not a.is_beam else [torch.zeros(a.num_rows, dtype=torch.bool)] * a.num_steps
    parents = a.beam_parents() if a.is_beam else None
    rows = []
    for t in range(a.num_steps):
        for r in range(a.num_rows):
            if bool(finished[t][r]):
                continue
            xa, xb = xs_a[t][r].to(torch.float64), xs_b[t][r].to(torch.float64)
            la, lb = torch.log_softmax(xa, 0), torch.log_softmax(xb, 0)
            kl_ab = kl_ba = 0.0
            for i in range(xa.shape[0]):  # 0 * log(0 / q) = 0
                if la[i] > -math.inf:
                    kl_ab += math.exp(la[i]) * float(la[i] - lb[i])
                if lb[i] > -math.inf:
                    kl_ba += math.exp(lb[i]) * float(lb[i] - la[i])
            order_a = sorted(range(xa.shape[0]), key=lambda i: -float(xa[i]))[:5]
            order_b = sorted(range(xb.shape[0]), key=lambda i: -float(xb[i]))[:5]
            finite = torch.isfinite(xa) | torch.isfinite(xb)
            diff = (xa[finite] - xb[finite]).abs().max() if bool(finite.any()) else torch.tensor(0.0)
            q, y = r, int(tokens[t][r])
            if parents is not None:
                q = int(parents[t][r])
                y = y if q >= 0 else -1
            row = {"generation": a.index, "row": r, "step": t, "token": y, "kl_ab": kl_ab, "kl_ba": kl_ba,
                   "top1_a": order_a[0], "top1_b": order_b[0], "same_top1": order_a[0] == order_b[0],
                   "max_logit_diff": float(diff),
                   **{f"top_overlap_{k}": len(set(order_a[:k]) & set(order_b[:k])) / k for k in range(1, 6)}}
            if y >= 0:
                qa, qb = torch.log_softmax(xs_a[t][q].double(), 0), torch.log_softmax(xs_b[t][q].double(), 0)
                row.update(logprob_a=float(qa[y]), logprob_b=float(qb[y]),
                           prob_change=math.exp(qb[y]) - math.exp(qa[y]),
                           rank_b=int(sum(1 for v in xs_b[t][q].tolist() if v > float(xs_b[t][q][y]))))
            else:
                row.update(logprob_a=None, logprob_b=None, prob_change=None, rank_b=None)
            rows.append(row)
    return rows


def _relative(x: float, y: float) -> float:
    if x == y:
        return 0.0
    return abs(x - y) / max(abs(x), abs(y))


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("encoding", ["dense", "sparse"])
def test_a_recording_against_itself_gives_exactly_zero_and_full_agreement(mode, encoding, tmp_path):
    model = make_tiny("gpt2")
    run = _record(model, MODES[mode], spill_dir=tmp_path / "run", encodings={"logits": encoding})
    for stream in ("logits", "scores"):
        cmp = compare(run, tmp_path / "run", stream=stream)
        c = cmp.columns
        assert len(cmp) > 0 and not cmp.estimate
        assert (c["kl_ab"] == 0).all() and (c["kl_ba"] == 0).all() and (c["max_logit_diff"] == 0).all()
        known = c["chosen_known"]
        assert (c["prob_change"][known] == 0).all() and (c["logprob_a"][known] == c["logprob_b"][known]).all()
        assert c["same_top1"].all() and (c["top_overlap"] == 1).all()
        summary = cmp.summary()
        assert summary["kl_ab"]["max"] == 0 and summary["kl_ba"]["max"] == 0
        assert summary["prob_change_percent"]["max"] == 0 and summary["prob_change_rms_percent"]["value"] == 0
        assert summary["same_top1_percent"]["value"] == 100.0
        assert all(s["first_top1_difference"] is None and s["kl_ab_mean"] == 0 for s in cmp.samples())
    if MODES[mode].get("num_beams"):  # the last step: no beam continues, the chosen token is unknown
        last = c["step"] == run.generation().num_steps - 1
        assert (c["token"][last] == -1).all() and not known[last].any()


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("model_name", ["gpt2", "llama"])
def test_every_value_equals_an_independent_float64_computation(model_name, mode, capsys):
    # (The tiny GPT-2 ties its head to its embeddings: its top-1 is the last token whatever the weights;
    # the tiny Llama's top-1 differs under the other weights at some steps.)
    model = make_tiny(model_name)
    rec = _record(model, MODES[mode])
    b = rescore(rec, _perturbed(model_name))
    cmp = compare(rec, b)
    expected = _reference(rec.generation(), b.generation())
    got = cmp.to_arrow().to_pylist()
    assert len(got) == len(expected)
    largest = 0.0
    for row, want in zip(got, expected):
        for key, value in want.items():
            if isinstance(value, float) and row[key] is not None:
                largest = max(largest, _relative(row[key], value))
                assert row[key] == pytest.approx(value, rel=1e-9, abs=1e-15), (key, row, want)
            else:
                assert row[key] == value, (key, row, want)
    # Per sample: the first step a row of the sample's top-1 differs, and its mean KL.
    for entry in cmp.samples():
        mine = [w for w in expected if w["row"] // rec.generation().rows_per_prompt == entry["prompt"]]
        differs = [w["step"] for w in mine if not w["same_top1"]]
        assert entry["first_top1_difference"] == (min(differs) if differs else None)
        assert entry["kl_ab_mean"] == pytest.approx(np.mean([w["kl_ab"] for w in mine]), rel=1e-12)
    if model_name == "llama":
        assert not cmp.columns["same_top1"].all(), "the other weights should change some top-1"
    with capsys.disabled():
        print(f"\n[{model_name} {mode}] largest relative difference from the independent float64 computation: {largest:.3g}")
    assert largest < 1e-9


def test_the_summary_is_the_documented_statistics_of_the_columns():
    model = make_tiny("llama")
    rec = _record(model, MODES["sample"])
    cmp = compare(rec, rescore(rec, _perturbed("llama")))
    kl = cmp.columns["kl_ab"]
    summary = cmp.summary()
    assert summary["kl_ab"]["mean"] == pytest.approx(kl.mean(), rel=1e-12)
    assert summary["kl_ab"]["stderr"] == pytest.approx(kl.std(ddof=1) / math.sqrt(len(kl)), rel=1e-12)
    assert summary["kl_ab"]["percentiles"]["99.9"] == pytest.approx(np.percentile(kl, 99.9), rel=1e-12)
    change = cmp.columns["prob_change"][cmp.columns["chosen_known"]]
    assert summary["prob_change_rms_percent"]["value"] == pytest.approx(100 * math.sqrt((change ** 2).mean()))
    assert summary["same_top1_percent"]["value"] == pytest.approx(100 * cmp.columns["same_top1"].mean())
    la, lb = cmp.columns["logprob_a"][cmp.columns["chosen_known"]], cmp.columns["logprob_b"][cmp.columns["chosen_known"]]
    na, nb, n = -la, -lb, len(la)
    ppl = summary["perplexity"]
    assert ppl["count"] == n > 1
    assert ppl["ppl_a"]["value"] == math.exp(na.mean()) and ppl["ppl_b"]["value"] == math.exp(nb.mean())
    assert ppl["ppl_b"]["stderr"] == math.exp(nb.mean()) * (nb.std(ddof=1) / math.sqrt(n))
    assert ppl["log_ratio"]["value"] == (nb - na).mean()
    assert ppl["log_ratio"]["stderr"] == (nb - na).std(ddof=1) / math.sqrt(n)
    assert ppl["ratio"]["value"] == math.exp((nb - na).mean())
    assert ppl["correlation_percent"] == pytest.approx(100 * np.corrcoef(na, nb)[0, 1], rel=1e-12)
    assert ppl["difference"]["value"] == math.exp(nb.mean()) - math.exp(na.mean())
    text = cmp.summary_text()
    for line in ("====== Perplexity statistics (of the chosen tokens; Q: b, base: a) ======", "Mean PPL(Q)        ",
                 "Mean PPL(base)     ", "Cor(ln(PPL(Q)), ln(PPL(base))):", "Mean ln(PPL(Q)/PPL(base))     :",
                 "Mean PPL(Q)/PPL(base)         :", "Mean PPL(Q)-PPL(base)         :",
                 "====== KL divergence statistics, KL(a||b) ======", "Mean    KLD:", "99.9%   KLD:", "Median  KLD:",
                 " 0.1%   KLD:", "Minimum KLD:", "====== Token probability statistics ======", "RMS Δp    :",
                 "Same top p:"):
        assert line in text, line
    assert str(cmp) == text and "ESTIMATE" not in text


def test_sparse_and_native_recordings_give_the_dense_values(tmp_path):
    model = make_tiny("gpt2").to(torch.bfloat16)
    runs = {encoding: _record(model, MODES["sample"], spill_dir=tmp_path / encoding,
                              encodings={"logits": encoding, "scores": encoding})
            for encoding in ("dense", "sparse", "native")}
    b = rescore(runs["dense"], make_tiny("gpt2"))
    base = compare(runs["dense"], b).columns
    for encoding in ("sparse", "native"):
        other = compare(runs[encoding], b).columns
        for name, values in base.items():
            assert np.array_equal(values, other[name], equal_nan=values.dtype.kind == "f"), (encoding, name)
    # The processed scores (top-k sampling: -inf outside the 20 kept) against themselves, every encoding.
    for encoding in ("sparse", "native"):
        scores = compare(runs["dense"], runs[encoding], stream="scores").columns
        assert (scores["kl_ab"] == 0).all() and (scores["max_logit_diff"] == 0).all()


@pytest.mark.parametrize("mode", ["greedy", "beam"])
def test_topk_gives_a_flagged_lower_bound_exact_when_the_tail_is_empty(mode, tmp_path):
    model = make_tiny("gpt2")
    dense = _record(model, MODES[mode], spill_dir=tmp_path / "dense")
    b = rescore(dense, _perturbed())
    exact = compare(dense, b).columns
    for k in (3, 20, 128):
        top = _record(model, MODES[mode], spill_dir=tmp_path / f"top{k}", encodings={"logits": f"topk:{k}"})
        b_top = rescore(dense, _perturbed(), encodings={"logits": f"topk:{k}"})
        for pair in ((top, b), (dense, b_top), (top, b_top)):
            cmp = compare(*pair)
            c = cmp.columns
            assert cmp.estimate and c["estimate"].all() and "ESTIMATE" in cmp.summary_text()
            assert cmp.summary()["estimate"] is True
            for name in ("kl_ab", "kl_ba"):
                assert (c[name] <= exact[name] + 1e-6).all() and (c[name] >= -1e-6).all()
                if k == 128:  # every id kept: the partition is the vocabulary
                    np.testing.assert_allclose(c[name], exact[name], rtol=1e-3, atol=1e-6)
            assert np.array_equal(c["top1_a"], exact["top1_a"]) and np.array_equal(c["same_top1"], exact["same_top1"])
            assert np.isnan(c["max_logit_diff"]).all() and not c["logit_known"].any()
            known = c["chosen_known"]
            np.testing.assert_allclose(c["prob_change"][known], exact["prob_change"][known], rtol=1e-4, atol=1e-6)
            assert np.array_equal(c["rank_b"][known], exact["rank_b"][known])
            width = min(k, 5)
            assert c["overlap_known"][:, :width].all() and not c["overlap_known"][:, width:].any()
            np.testing.assert_array_equal(c["top_overlap"][:, :width], exact["top_overlap"][:, :width])
            rows = cmp.to_arrow().to_pylist()
            assert all(r["max_logit_diff"] is None for r in rows)
            if k < 5:
                assert all(r["top_overlap_5"] is None for r in rows)


def test_what_does_not_line_up_is_refused(tmp_path):
    model = make_tiny("gpt2")
    a = _record(model, MODES["sample"])
    torch.manual_seed(99)
    with Recorder(model) as other:  # other sampled tokens
        model.generate(**left_padded_batch(), logits_processor=[other], max_new_tokens=8, pad_token_id=PAD,
                       eos_token_id=EOS, **MODES["sample"])
    with pytest.raises(CompareError, match="differ in their tokens from step 0.*rescore"):
        compare(a, other)
    greedy = _record(model, MODES["greedy"])
    prompt_length = left_padded_batch()["input_ids"].shape[-1]
    chosen = int(greedy.generation().tokens()[3][1])
    other = (chosen + 1) % model.config.vocab_size

    def another_token_at_step_3(input_ids, scores):  # row 1 of step 3 only
        if input_ids.shape[-1] == prompt_length + 3:
            scores = scores.clone()
            scores[1, other] = scores[1].max() + 10.0
        return scores

    with Recorder(model) as forced:
        model.generate(**left_padded_batch(), logits_processor=[another_token_at_step_3, forced], max_new_tokens=8,
                       pad_token_id=PAD, eos_token_id=EOS, do_sample=False)
    with pytest.raises(CompareError, match=f"from step 3: row 1 chose {chosen} in `a` and {other} in `b`"):
        compare(greedy, forced)
    shorter = _record(model, MODES["sample"], steps=5)
    with pytest.raises(CompareError, match="differ in steps: 8 and 5"):
        compare(a, shorter)
    with pytest.raises(CompareError, match="differ in decoding mode"):
        compare(_record(model, MODES["beam"]), _record(model, MODES["greedy"]))
    named = _record(model, MODES["greedy"], samples=["x", "y", "z"])
    renamed = _record(model, MODES["greedy"], samples=["x", "y", "w"])
    with pytest.raises(CompareError, match=r"other samples.*\['x', 'y', 'z'\]"):
        compare(named, renamed)
    with pytest.raises(CompareError, match="holds 1 generation.*and `b` 2"):
        compare(shorter, _two_generations(model))
    with pytest.raises(ValueError, match="`stream` must be one of"):
        compare(a, a, stream="attentions")
    with pytest.raises(TypeError, match="`a` must be a Recording"):
        compare(3, a)
    with pytest.raises(ValueError, match="has no 'scores' stream"):
        compare(_record(model, {}, streams=("logits",)), _record(model, {}, streams=("logits",)), stream="scores")


def _two_generations(model):
    with Recorder(model) as rec:
        for _ in range(2):
            model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=3, pad_token_id=PAD)
    return rec


def test_generations_pair_by_sample_id(tmp_path):
    model = make_tiny("gpt2")
    with Recorder(model) as rec:
        for ids in (["p", "q", "r"], ["s", "t", "u"]):
            rec.set_samples(ids)
            model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=4, pad_token_id=PAD)
    b = rescore(rec, model, generations=[1, 0])  # the other order
    cmp = compare(rec, b)
    assert cmp.pairs == [(0, 1), (1, 0)] and (cmp.columns["kl_ab"] == 0).all()
    assert cmp.to_arrow().column("sample").to_pylist()[:1] == ["p"]
    assert [s["sample"] for s in cmp.samples()] == ["p", "q", "r", "s", "t", "u"]


def test_nothing_to_compare_is_a_compare_error(tmp_path, capsys):
    model = make_tiny("gpt2")
    with Recorder(model, spill_dir=tmp_path / "empty"):
        pass  # no call: a recording without generations
    with pytest.raises(CompareError, match="nothing to compare: `a` and `b` hold no generation"):
        compare(tmp_path / "empty", tmp_path / "empty")
    with pytest.raises(CompareError, match="nothing to compare: `b` holds no generation"):
        compare(_record(model, MODES["greedy"]), tmp_path / "empty")
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "empty"), str(tmp_path / "empty")]) != 0
    assert capsys.readouterr().err.startswith("error: nothing to compare: `a` and `b` hold no generation")


def test_largest_and_count_above_are_a_stable_sort_and_a_count_on_ties_inf_and_nan():
    from transformers_offload.answers.largest import count_above, largest, tile_maxima

    generator = torch.Generator().manual_seed(5)
    checked = 0
    for vocab in (3, 700, 4097, 152_064):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for scale in (0.01, 1.0, 40.0):  # rounded: from every entry tied to a few ties
                x = (torch.randn(3, vocab, generator=generator) * scale).round().to(dtype)
                x[1, ::5] = float("-inf")
                x[2, :] = float("-inf")
                if vocab > 3:
                    x[1, vocab // 3] = float("nan")  # counts largest, as in torch.sort
                for k in (1, 5, 20):
                    want = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
                    assert torch.equal(largest(x, k), want), (vocab, dtype, scale, k)
                    checked += 1
                for chosen in (x.nan_to_num(nan=-1.0).argmax(-1), torch.randint(0, vocab, (3,), generator=generator)):
                    picked = x.gather(-1, chosen[:, None])  # a likely token (few tiles above it), any token
                    assert torch.equal(count_above(x, picked, tile_maxima(x)), (x > picked).sum(-1))
                    checked += 1
    assert checked == 4 * 3 * 3 * 5


def test_a_recording_on_disk_keeps_one_shard_open_while_compared(tmp_path, monkeypatch):
    from transformers_offload.store.open_files import OpenFiles

    model = make_tiny("gpt2")
    run = _record(model, MODES["greedy"], spill_dir=tmp_path / "run", steps=12, shard_bytes=1)  # a shard a step
    shards = len(run.generation().source._shards)
    assert shards >= 4
    most = []
    original = OpenFiles.get

    def counting(self, name, opener):
        found = original(self, name, opener)
        most.append(len(self._open))
        return found

    monkeypatch.setattr(OpenFiles, "get", counting)
    cmp = compare(tmp_path / "run", run, chunk_steps=2)
    assert len(cmp) > 0 and most and max(most) == 1
    most.clear()
    run.generation().logits()  # outside compare: up to 512 MiB of shards stay open
    assert max(most) == shards


def test_the_steps_are_read_a_chunk_at_a_time(tmp_path, monkeypatch):
    model = make_tiny("gpt2")
    run = _record(model, MODES["greedy"], spill_dir=tmp_path / "run", steps=12)
    reads = []
    original = Generation.logits

    def counting(self, **kwargs):
        steps = kwargs.get("steps")
        reads.append(len(steps) if steps is not None else self.num_steps)  # compare reads ranges
        return original(self, **kwargs)

    monkeypatch.setattr(Generation, "logits", counting)
    compare(run, run, chunk_steps=5)
    assert reads and max(reads) <= 5


def test_compare_on_the_command_line(tmp_path, capsys):
    model = make_tiny("gpt2")
    _record(model, MODES["greedy"], spill_dir=tmp_path / "a")
    rescore(open_recording(tmp_path / "a"), _perturbed(), tmp_path / "b")
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["tokens"] == len(compare(tmp_path / "a", tmp_path / "b"))
    assert printed["kl_ab"]["mean"] > 0 and "samples" in printed
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--html", str(tmp_path / "cmp.html")]) == 0
    out = capsys.readouterr().out
    assert "====== KL divergence statistics, KL(a||b) ======" in out and (tmp_path / "cmp.html").stat().st_size > 1000
    assert out.rstrip().endswith(f"wrote {tmp_path / 'cmp.html'}")
    before = (tmp_path / "b" / "manifest.json").read_bytes()
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--html", str(tmp_path / "b" / "manifest.json")]) == 2
    assert "inside the recording" in capsys.readouterr().err and (tmp_path / "b" / "manifest.json").read_bytes() == before
    _record(model, MODES["greedy"], spill_dir=tmp_path / "c", steps=4)
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "c")]) == 2
    assert "differ in steps" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "missing")]) == 1
    assert "error:" in capsys.readouterr().err


def test_several_candidates_against_one_reference_on_the_command_line(tmp_path, capsys):
    model = make_tiny("gpt2")
    _record(model, MODES["greedy"], spill_dir=tmp_path / "a")
    rescore(open_recording(tmp_path / "a"), _perturbed(mix=0.1), tmp_path / "near")
    rescore(open_recording(tmp_path / "a"), _perturbed(mix=0.5), tmp_path / "far")
    paths = [str(tmp_path / name) for name in ("a", "near", "far")]
    assert main(["compare", *paths, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["reference"] == paths[0] and [c["candidate"] for c in printed["candidates"]] == paths[1:]
    for candidate, path in zip(printed["candidates"], paths[1:]):
        alone = compare(paths[0], path).summary()
        assert candidate["kl_ab"] == alone["kl_ab"] and candidate["perplexity"] == alone["perplexity"]
    near, far = printed["candidates"]
    assert 0 < near["kl_ab"]["mean"] < far["kl_ab"]["mean"]
    assert main(["compare", *paths]) == 0
    out = capsys.readouterr().out
    table = out[out.index("====== 2 candidates against one reference ======"):].splitlines()
    assert table[1].split()[:3] == ["candidate", "tokens", "mean"] and len(table) == 4
    assert table[2].split()[0] == paths[1] and table[2].split()[2] == f"{near['kl_ab']['mean']:.6f}"
    assert out.count("====== KL divergence statistics, KL(a||b) ======") == 2
    assert main(["compare", *paths, "--html", str(tmp_path / "x.html")]) == 2
    assert "one candidate at a time" in capsys.readouterr().err and not (tmp_path / "x.html").exists()


def test_a_comparison_is_exported():
    assert Comparison.__name__ == "Comparison" and callable(compare)


def _page_data(page: str) -> dict:
    found = re.search(r"const DATA = (.*?);\n", page)
    assert found, "the page carries no data"
    return json.loads(found.group(1).replace("<\\/", "</"))


def test_the_compare_page_holds_the_comparisons_values_and_needs_no_network(tmp_path):
    model = make_tiny("llama")
    rec = _record(model, MODES["beam"])
    cmp = compare(rec, rescore(rec, _perturbed("llama")))
    write_html(cmp, tmp_path / "page.html", max_rows=4, max_steps=5)
    page = (tmp_path / "page.html").read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page), "the page loads something from the network"
    data = _page_data(page)
    rows = {(r["row"], r["step"]): r for r in cmp.to_arrow().to_pylist()}
    shown = data["generations"][0]["rows"]
    assert [r["row"] for r in shown] == [0, 1, 2, 3] and data["generations"][0]["hidden_rows"] == 5
    for row in shown:
        assert [t[0] for t in row["tokens"]] == list(range(5))
        for token in row["tokens"]:
            want = rows[(row["row"], token[0])]
            assert token[1] == want["token"] and token[3] == want["kl_ab"] and token[4] == want["kl_ba"]
            assert token[5] == want["prob_change"] and token[7] == want["rank_b"]
            assert [a[0] for a in token[8][0]] == want["top_tokens_a"] and [a[2] for a in token[8][1]] == want["top_logprobs_b"]
    assert "KL divergence statistics" in data["summary"]


def test_in_chromium_the_compare_page_colours_by_kl_and_a_click_shows_both_sides(browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    model = make_tiny("llama")
    rec = _record(model, MODES["sample"])
    cmp = compare(rec, rescore(rec, _perturbed("llama")))
    write_html(cmp, tmp_path / "page.html")
    browser.get((tmp_path / "page.html").as_uri())
    data = _page_data((tmp_path / "page.html").read_text())
    spans = browser.find_elements(By.CSS_SELECTOR, ".tok")
    tokens = [t for g in data["generations"] for r in g["rows"] for t in r["tokens"]]
    assert len(spans) == len(tokens) == len(cmp)
    edges = [1e-4, 1e-3, 1e-2, 1e-1]

    def bucket(value):
        return f"k{next((i for i, edge in enumerate(edges) if value < edge), 4)}"

    for span, token in zip(spans, tokens):
        assert bucket(token[3]) in span.get_attribute("class").split()
    target, token = spans[3], tokens[3]
    target.click()
    details = browser.find_element(By.ID, "details")
    assert f"step {token[0]}: token {token[1]}" in details.text and "selected" in target.get_attribute("class")
    for side, alternatives in zip(("a", "b"), token[8]):
        cells = [row.find_elements(By.TAG_NAME, "td")
                 for row in details.find_elements(By.CSS_SELECTOR, f'table[data-side="{side}"] tr')][1:]
        assert [int(c[0].text) for c in cells] == [a[0] for a in alternatives]
        assert [c[3].text for c in cells] == [f"{a[2]:.4f}" for a in alternatives]
    Select(browser.find_element(By.ID, "colour")).select_by_value("4")
    assert bucket(token[4]) in target.get_attribute("class").split()
    browser.save_screenshot(str(tmp_path / "compare.png"))
    assert (tmp_path / "compare.png").stat().st_size > 10_000
    errors = [entry for entry in browser.get_log("browser") if entry["level"] in ("SEVERE", "ERROR")]
    assert errors == []


def test_the_fast_path_for_finite_logits_is_its_documented_expression_bit_for_bit():
    from transformers_offload.answers.compare_metrics import Side, step_values

    generator = torch.Generator().manual_seed(3)
    xa = torch.randn(6, 1000, generator=generator) * 8
    xb = xa + torch.randn(6, 1000, generator=generator)
    xa[0, :5] = -800.0  # probabilities that underflow to 0 in float64
    rows = torch.arange(6)
    y = torch.tensor([0, 1, 2, 3, 4, 999])
    values = step_values(Side(full=xa), Side(full=xb), rows, rows, y)
    a, b = xa.double(), xb.double()
    ma, mb = a.amax(-1, keepdim=True), b.amax(-1, keepdim=True)
    ea, eb = (a - ma).exp(), (b - mb).exp()
    za, zb = ea.sum(-1), eb.sum(-1)
    d = a - b
    shift = (ma - mb)[:, 0] + (za.log() - zb.log())
    dot = lambda e: torch.stack([torch.dot(e[i], d[i]) for i in range(6)])  # noqa: E731
    assert torch.equal(values["kl_ab"], dot(ea) / za - shift)
    assert torch.equal(values["kl_ba"], shift - dot(eb) / zb)
    assert torch.equal(values["max_logit_diff"], d.abs().amax(-1))
    assert torch.equal(values["logprob_a"], (a.gather(-1, y[:, None]) - ma)[:, 0] - za.log())
    # Against the log-softmax expressions (the `where` path, for entries -inf): float64 rounding.
    la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    pa, pb = la.exp(), lb.exp()
    assert torch.allclose(values["kl_ab"], torch.where(pa > 0, pa * (la - lb), 0.0).sum(-1), rtol=1e-12, atol=1e-15)
    assert torch.allclose(values["kl_ba"], torch.where(pb > 0, pb * (lb - la), 0.0).sum(-1), rtol=1e-12, atol=1e-15)
    assert torch.allclose(values["logprob_a"], la.gather(-1, y[:, None])[:, 0], rtol=0, atol=1e-13)
    assert torch.equal(values["max_logit_diff"], torch.where(xa == xb, 0.0, (a - b).abs()).amax(-1))



def _memory_peak(case: str, tokens: int, vocab: int, work) -> float:
    """`bench/rescore_cost.py --part memory --cases CASE` at `tokens` x `vocab`: the case's anonymous peak
    in MiB, measured in fresh processes with the C library's default allocator settings: the largest of three
    runs, the peak the case reaches (a sampled peak can only fall short of it, and one run can stay a shard
    buffer lower: at 512 tokens and 131,072 entries a row, 692 MiB in most runs on a busy machine, 755.5 in
    each of three on a quiet one, where 1,024 tokens gave 755.8)."""
    import argparse

    memory_part = bench_module("rescore_cost").memory_part
    out = work / f"out-{tokens}"
    memory_part(argparse.Namespace(tokens=tokens, vocab=vocab, runs=3, cases=[case], work_dir=str(work), out=out))
    runs = json.loads((out / "rescore_memory.json").read_text())["runs"][case]
    assert len(runs) == 3
    return max(run["anon_peak_mib"] for run in runs)


@pytest.mark.slow(minutes=1)
@pytest.mark.parametrize("case, vocab, short_tokens", [("compare", 32000, 512), ("rescore-forward", 131072, 1024)])
def test_compare_and_forward_rescore_peaks_do_not_grow_with_the_length(case, vocab, short_tokens, tmp_path):
    """A tiny Llama, one row, greedy tokens recorded (dense, spilled), then twice as many; in a process of its
    own with default allocator settings, `compare` of the recording and its forward rescore (512 then 1,024
    tokens, 32,000-token vocabulary: the added steps' logits are 62 MiB), or the forward rescore itself
    (1,024 then 2,048 tokens, 131,072: 512 positions a forward; 8 shards of 128 steps fill the store's 3 shard
    buffers). Doubling the length moves the anonymous peak by at most 16 MiB (measured +1.2 and +3.4 MiB).
    Before compare filled columns made once and forward mode reused one logits buffer, the C library's heap
    kept growing: +29 and +373 MiB. The forward rescore starts at 1,024 tokens: at 512 (4 shards) whether the
    writer lags enough for a third shard buffer is timing, and on CI's busy machine all three runs stayed one
    buffer (64 MiB) lower (689 MiB, against 758 at 1,024), which read as growth."""
    short, long = (_memory_peak(case, tokens, vocab, tmp_path) for tokens in (short_tokens, 2 * short_tokens))
    print(json.dumps({"case": case, str(short_tokens): short, str(2 * short_tokens): long}))
    assert long - short <= 16, (case, short, long)


def _tail_reference(x: torch.Tensor, encoding: str, seed: int = 0):
    from transformers_offload.answers.compare_metrics import Side
    from transformers_offload.codecs.packed import PackedRecord, TopK

    generator = torch.Generator().manual_seed(seed)
    record = TopK(encoding, torch.float32, lambda device: generator).on_cpu(x)
    return Side(topk=PackedRecord(record, encoding).columns())


def test_a_tail_sample_adds_its_documented_estimate_of_the_tails_divergence():
    from transformers_offload.answers.compare_metrics import Side, step_values

    generator = torch.Generator().manual_seed(5)
    xa = torch.randn(6, 400, generator=generator) * 3
    xb = xa + 0.3 * torch.randn(6, 400, generator=generator)
    rows, y = torch.arange(6), torch.zeros(6, dtype=torch.long)
    tail, bound = _tail_reference(xa, "topk:8+tail:16"), _tail_reference(xa, "topk:8")
    for order in ("ab", "ba"):
        sides = (tail, Side(full=xb)) if order == "ab" else (Side(full=xb), tail)
        plain = (bound, Side(full=xb)) if order == "ab" else (Side(full=xb), bound)
        got, coarse = step_values(*sides, rows, rows, y), step_values(*plain, rows, rows, y)
        t = tail.topk
        lf = torch.log_softmax(xb.double(), -1)
        p_tail = t["mass_outside"].double()
        q_tail = torch.logsumexp(lf.scatter(-1, t["indices"], float("-inf")), -1).exp()
        log_r = ((lf.gather(-1, t["tail_indices"]) - q_tail.log()[:, None])
                 - ((t["tail_values"].double() - t["logsumexp"].double()[:, None]) - p_tail.log()[:, None]))
        r = log_r.exp()
        within_t = p_tail * (r - 1 - log_r).mean(-1)
        within_f = q_tail * (torch.where(r > 0, r * log_r, 0.0) - r + 1).mean(-1)
        names = ("kl_ab", "kl_ba") if order == "ab" else ("kl_ba", "kl_ab")  # (KL(t||f), KL(f||t))
        assert torch.equal(got[names[0]], coarse[names[0]] + within_t)
        assert torch.equal(got[names[1]], coarse[names[1]] + within_f)
        assert got["estimate"].all() and bool((within_t > 0).all()) and bool((within_f > 0).all())


def test_a_tail_sample_makes_the_mean_kl_estimate_close_where_the_bound_falls_short():
    from transformers_offload.answers.compare_metrics import Side, step_values

    generator = torch.Generator().manual_seed(11)
    xa = torch.randn(300, 2000, generator=generator) * 2.5
    xb = xa + 0.2 * torch.randn(300, 2000, generator=generator)
    rows, y = torch.arange(300), torch.zeros(300, dtype=torch.long)
    exact = step_values(Side(full=xa), Side(full=xb), rows, rows, y)
    bound = step_values(_tail_reference(xa, "topk:32"), Side(full=xb), rows, rows, y)
    estimate = step_values(_tail_reference(xa, "topk:32+tail:48"), Side(full=xb), rows, rows, y)
    for name in ("kl_ab", "kl_ba"):
        mean = float(exact[name].mean())
        assert float(bound[name].mean()) < 0.9 * mean  # the one-bucket bound: well short
        assert abs(float(estimate[name].mean()) / mean - 1) < 0.02, name
        assert bool((estimate[name] >= bound[name]).all())


@pytest.mark.parametrize("where", ["-inf in a", "-inf in both", "+inf in b", "nan in a"])
def test_an_entry_not_finite_in_any_row_takes_the_where_expressions(where):
    """The fast path tells finite rows by their largest |xa - xb| (finite iff every entry of both is): a
    row with an infinite or nan entry, whichever row and side, sends the block to the documented `where`
    expressions (their values bit for bit)."""
    from transformers_offload.answers.compare_metrics import Side, step_values

    generator = torch.Generator().manual_seed(5)
    xa = torch.randn(4, 1000, generator=generator) * 8
    xb = xa + torch.randn(4, 1000, generator=generator)
    side, value = {"-inf in a": ((xa,), float("-inf")), "-inf in both": ((xa, xb), float("-inf")),
                   "+inf in b": ((xb,), float("inf")), "nan in a": ((xa,), float("nan"))}[where]
    for x in side:
        x[2, 17] = value  # the third row: rows before it are finite
    rows = torch.arange(4)
    values = step_values(Side(full=xa), Side(full=xb), rows, rows, torch.tensor([0, 1, 2, 3]))
    la, lb = torch.log_softmax(xa.double(), -1), torch.log_softmax(xb.double(), -1)
    pa, pb = la.exp(), lb.exp()
    # allclose with no tolerance: equal bit for bit, nan equal to nan (torch.equal has no equal_nan).
    assert torch.allclose(values["kl_ab"], torch.where(pa > 0, pa * (la - lb), 0.0).sum(-1), rtol=0, atol=0,
                          equal_nan=True)
    assert torch.allclose(values["kl_ba"], torch.where(pb > 0, pb * (lb - la), 0.0).sum(-1), rtol=0, atol=0,
                          equal_nan=True)
    wide_a, wide_b = xa.double(), xb.double()
    assert torch.allclose(values["max_logit_diff"], torch.where(wide_a == wide_b, 0.0, (wide_a - wide_b).abs()).amax(-1),
                          rtol=0, atol=0, equal_nan=True)
    # The finite rows' fast expressions differ from these by float64 rounding: the check tells the paths apart.
    finite = step_values(Side(full=xa[:2]), Side(full=xb[:2]), rows[:2], rows[:2], torch.tensor([0, 1]))
    assert not torch.equal(finite["kl_ab"], values["kl_ab"][:2])


def test_a_group_of_rows_larger_than_a_block_takes_the_where_expressions_a_block_at_a_time(monkeypatch):
    """Full sides are taken GROUP entries at a time (the fast path holds one row's float64 buffers); where
    an entry is not finite the `where` expressions run BLOCK entries at a time: the same values as one
    block at a time, every column."""
    from transformers_offload.answers import compare_metrics
    from transformers_offload.answers.compare_metrics import Side, step_values

    generator = torch.Generator().manual_seed(11)
    xa = torch.randn(7, 1000, generator=generator) * 8
    xb = xa + torch.randn(7, 1000, generator=generator)
    xa[5, 3] = xb[5, 3] = float("-inf")
    rows, tokens = torch.arange(7), torch.tensor([0, 1, 2, 3, 4, 5, 999])
    whole = step_values(Side(full=xa), Side(full=xb), rows, rows, tokens)  # one block of 7 rows
    monkeypatch.setattr(compare_metrics, "BLOCK", 2000)  # 2 rows a `where` block
    monkeypatch.setattr(compare_metrics, "GROUP", 7000)  # the 7 rows in one call
    calls = []
    original = compare_metrics._block_values
    monkeypatch.setattr(compare_metrics, "_block_values",
                        lambda *args, **kwargs: calls.append(int(args[2].shape[0])) or original(*args, **kwargs))
    blocks = step_values(Side(full=xa), Side(full=xb), rows, rows, tokens)
    assert calls == [7, 2, 2, 2, 1]  # the group, then its `where` blocks
    assert blocks.keys() == whole.keys()
    for name in whole:
        assert torch.equal(blocks[name].isnan(), whole[name].isnan()) if blocks[name].is_floating_point() else True
        assert torch.equal(blocks[name].nan_to_num(0.0) if blocks[name].is_floating_point() else blocks[name],
                           whole[name].nan_to_num(0.0) if whole[name].is_floating_point() else whole[name]), name
