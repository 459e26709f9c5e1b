"""Prompt logprobs: `Recorder(..., prompt_logprobs=True | k)` scores each prompt token given the tokens
before it, from the prefill's final hidden states, a chunk of positions at a time; the values equal
`log_softmax(model(prompt).logits)` on the unpadded prompt (tiny models, CPU) and the peak is bounded
by the chunk, not the prompt."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from transformers_offload import Recorder, RecordingError, open_recording
from transformers_offload.capture.prompt_logprobs import ChunkBuffers, PromptScoring

from ..helpers import ROOT, left_padded_batch, make_tiny

MODES = {
    "greedy": dict(do_sample=False),
    "sampling": dict(do_sample=True, top_k=5, num_return_sequences=2),
    "beam_search": dict(num_beams=3, num_return_sequences=2),
}


def _reference(model, batch):
    """Per prompt, from a plain forward of the same padded batch with the position ids generate() gives
    it (`cumsum(attention_mask) - 1`): its tokens after the first, their logprobs, ranks and every
    position's log-softmax. The recorder's head runs on a chunk of positions at a time, over generate()'s
    expanded rows: a matrix product over other shapes may sum in another order, so the logprobs may
    differ from it by float rounding (up to 4.8e-7 measured, on AVX-512). A forward of each prompt
    without padding is not the reference: the padding changes the attention's sums."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()[:, :-1]
    found = []
    for row, length in enumerate(mask.sum(-1).tolist()):
        n = length - 1
        x, y = logits[row, -n:], ids[row, -n:]
        found.append({"tokens": y, "logprobs": torch.log_softmax(x, -1).gather(-1, y[:, None])[:, 0],
                      "ranks": (x > x.gather(-1, y[:, None])).sum(-1), "log_softmax": torch.log_softmax(x, -1)})
    return found


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_prompt_logprobs_equal_a_plain_forward_of_each_prompt(name, mode, store, tmp_path):
    model = make_tiny(name)
    batch = left_padded_batch()
    options = store.options()
    with Recorder(model, prompt_logprobs=4, prompt_chunk=3, **options) as rec:
        torch.manual_seed(0)
        model.generate(**batch, logits_processor=[rec], max_new_tokens=3, pad_token_id=0, **MODES[mode])
    run = store.reopen(rec)
    found = run.generation().prompt_tensors()
    width = batch["input_ids"].shape[1]
    assert {k: tuple(v.shape) for k, v in found.items()} == {
        "prompt_tokens": (3, width - 1), "prompt_logprobs": (3, width - 1), "prompt_ranks": (3, width - 1),
        "prompt_top_tokens": (3, width - 1, 4), "prompt_top_logprobs": (3, width - 1, 4)}
    listed = run.prompt_logprobs()
    for prompt, reference in enumerate(_reference(model, batch)):
        n = len(reference["tokens"])
        assert torch.equal(found["prompt_tokens"][prompt, -n:], reference["tokens"])
        # Within the summation order's difference (see `_reference`).
        torch.testing.assert_close(found["prompt_logprobs"][prompt, -n:], reference["logprobs"], rtol=0, atol=1e-5)
        assert torch.equal(found["prompt_ranks"][prompt, -n:], reference["ranks"])
        top = torch.topk(reference["log_softmax"], 4, -1)
        torch.testing.assert_close(found["prompt_top_logprobs"][prompt, -n:], top.values, rtol=0, atol=1e-5)
        assert torch.equal(found["prompt_top_tokens"][prompt, -n:], top.indices)
        # Padding, and the first real token (its context is padding), hold -1 and NaN.
        assert (found["prompt_tokens"][prompt, :-n] == -1).all() and found["prompt_logprobs"][prompt, :-n].isnan().all()
        assert [e["position"] for e in listed[prompt]] == list(range(1, n + 1))
        assert [e["token"] for e in listed[prompt]] == reference["tokens"].tolist()
        assert [e["logprob"] for e in listed[prompt]] == found["prompt_logprobs"][prompt, -n:].tolist()
        assert listed[prompt][0]["top_logprobs"][0] == {"token": int(top.indices[0, 0]),
                                                        "logprob": float(found["prompt_top_logprobs"][prompt, -n, 0])}


def test_prompt_logprobs_without_top_k_and_with_a_tokenizer(tmp_path):
    model = make_tiny("gpt2")
    with Recorder(model, prompt_logprobs=True, spill_dir=tmp_path / "run") as rec:
        model.generate(torch.tensor([[5, 6, 7, 8]]), logits_processor=[rec], max_new_tokens=2, pad_token_id=0)
    run = open_recording(tmp_path / "run", verify=True)
    assert sorted(run.generation().prompt_tensors()) == ["prompt_logprobs", "prompt_ranks", "prompt_tokens"]
    assert (tmp_path / "run" / "g0000-prompt.safetensors").is_file()
    entries = run.prompt_logprobs()[0]
    assert [e["token"] for e in entries] == [6, 7, 8] and "top_logprobs" not in entries[0]

    class Names:
        def convert_ids_to_tokens(self, ids):
            return [f"t{i}" for i in ids]

    assert [e["text"] for e in run.prompt_logprobs(tokenizer=Names())[0]] == ["t6", "t7", "t8"]
    summary = run.describe()["generations"][0]["streams"]
    assert summary["prompt_logprobs"]["shape"] == [1, 3]
    # Without the option there is nothing to read, and the message says how to record them.
    with Recorder(model) as plain:
        model.generate(torch.tensor([[5, 6]]), logits_processor=[plain], max_new_tokens=1, pad_token_id=0)
    with pytest.raises(KeyError, match="prompt_logprobs=True"):
        plain.prompt_logprobs()


def test_prompt_logprobs_sit_under_their_own_manifest_key_and_read_the_same_under_encoder(tmp_path):
    # Written under `prompt`; a format-1 recording that holds them under `encoder` reads them the same.
    model = make_tiny("gpt2")
    with Recorder(model, prompt_logprobs=2, spill_dir=tmp_path / "run") as rec:
        model.generate(torch.tensor([[5, 6, 7, 8]]), logits_processor=[rec], max_new_tokens=2, pad_token_id=0)
    manifest_path = tmp_path / "run" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    entry = manifest["generations"][0]
    assert "encoder" not in entry and entry["prompt"]["file"] == "g0000-prompt.safetensors"
    with open_recording(tmp_path / "run") as run:
        expected = run.generation().prompt_tensors()
    entry["encoder"] = entry.pop("prompt")
    manifest_path.write_text(json.dumps(manifest, indent=1))
    with open_recording(tmp_path / "run", verify=True) as run:
        found = run.generation().prompt_tensors()
        assert sorted(found) == sorted(expected) == ["prompt_logprobs", "prompt_ranks", "prompt_tokens",
                                                     "prompt_top_logprobs", "prompt_top_tokens"]
        assert all(torch.equal(torch.as_tensor(found[name]), torch.as_tensor(expected[name])) for name in found)
    entry["prompt"] = entry["encoder"]  # both: refused, naming them
    manifest_path.write_text(json.dumps(manifest, indent=1))
    with pytest.raises(RecordingError, match="both `encoder` and `prompt`"):
        open_recording(tmp_path / "run")


def test_prompt_logprobs_leave_the_recording_unchanged():
    model = make_tiny("llama")
    batch = left_padded_batch()
    runs = []
    for option in (False, 3):
        with Recorder(model, prompt_logprobs=option) as rec:
            torch.manual_seed(0)
            out = model.generate(**batch, logits_processor=[rec], max_new_tokens=4, do_sample=True, pad_token_id=0)
        runs.append((out, rec))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1].scores(), runs[1][1].scores()))


@pytest.mark.parametrize("options, error, match", [
    ({"prompt_logprobs": "yes"}, ValueError, "must be True or the number of alternatives"),
    ({"prompt_logprobs": -1}, ValueError, "must be True or the number of alternatives"),
    ({"prompt_logprobs": True, "prompt_chunk": 0}, ValueError, "`prompt_chunk` must be a positive"),
])
def test_bad_prompt_options_are_refused(options, error, match):
    with pytest.raises(error, match=match):
        Recorder(make_tiny("gpt2"), **options)


def test_an_encoder_decoder_model_is_refused():
    with pytest.raises(ValueError, match="decoder-only"):
        Recorder(make_tiny("t5"), prompt_logprobs=True)


def _chunk_by_chunk(scoring, hidden, ids):
    """The documented expressions, chunk by chunk as `score` cuts the prompt, each chunk's tensors new."""
    parts = {"ranks": [], "logprobs": [], "top_logprobs": [], "top_tokens": []}
    with torch.no_grad():
        for start in range(0, ids.shape[1] - 1, scoring.chunk):
            end = min(ids.shape[1] - 1, start + scoring.chunk)
            x = scoring.head(hidden[:, start:end]).float()
            if scoring.softcap:
                x = torch.tanh(x / scoring.softcap) * scoring.softcap
            y = ids[:, start + 1:end + 1, None]
            parts["ranks"].append((x > x.gather(-1, y)).sum(-1))
            parts["logprobs"].append(torch.log_softmax(x, -1).gather(-1, y)[..., 0])
            values, indices = torch.topk(torch.log_softmax(x, -1), scoring.top, -1)
            parts["top_logprobs"].append(values)
            parts["top_tokens"].append(indices)
    return {f"prompt_{name}": torch.cat(found, 1) for name, found in parts.items()}


@pytest.mark.parametrize("dtype, softcap, hooked, made", [
    (torch.float32, None, False, 3), (torch.float32, 30.0, False, 3), (torch.bfloat16, None, False, 4),
    (torch.float32, None, True, 1),
])
def test_every_chunk_reuses_the_first_chunks_buffers_and_the_values_are_unchanged(dtype, softcap, hooked, made):
    """11 chunks of 4 positions (the last of 1) over 2 prompts: the buffers are made once (the log-softmax's,
    which also holds the rank's comparison; for a plain `nn.Linear` head, its product and the states it
    reads; for a head that is not float32, the logits' float32 copy), and a head with a hook runs as
    itself; every value equals the documented expressions run on new tensors chunk by chunk."""
    model = make_tiny("llama").to(dtype)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (2, 42), generator=generator)
    hidden = torch.randn(2, 42, model.config.hidden_size, generator=generator).to(dtype)
    calls = []
    if hooked:
        model.get_output_embeddings().register_forward_hook(lambda module, args, output: calls.append(1))
    scoring = PromptScoring(head=model.get_output_embeddings(), top=3, chunk=4, softcap=softcap)
    buffers = ChunkBuffers()
    found = scoring.score(hidden, ids, None, 1, buffers=buffers)
    assert buffers.allocations == made and len(calls) == (11 if hooked else 0)
    expected = _chunk_by_chunk(scoring, hidden, ids)
    assert found["prompt_ranks"].dtype == torch.long and found["prompt_top_tokens"].dtype == torch.long
    for name, tensor in expected.items():
        assert torch.equal(found[name], tensor), name
    assert torch.equal(found["prompt_tokens"], ids[:, 1:])


def test_chunk_buffers_view_one_tensor_in_every_smaller_shape():
    buffers = ChunkBuffers()
    first = buffers.take("x", (2, 4, 8), torch.float32, torch.device("cpu"))
    last = buffers.take("x", (2, 1, 8), torch.float32, torch.device("cpu"))
    assert last.data_ptr() == first.data_ptr() and last.is_contiguous() and buffers.allocations == 1
    assert buffers.take("x", (2, 5, 8), torch.float32, torch.device("cpu")).shape == (2, 5, 8)  # larger: made again
    assert buffers.allocations == 2


def _peak(case: str, **options) -> dict:
    command = [sys.executable, str(ROOT / "bench" / "prompt_peak.py"), "--case", case, "--tokens", "2048",
               "--vocab", "32000", "--top", "5", "--chunk", str(options.get("chunk", 64))]
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        default_env = __import__("_common").default_env
    finally:
        sys.path.remove(str(ROOT / "bench"))
    # A process with the C library's default allocator settings, as users run it.
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=default_env(HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_2048_token_prompt_over_32k_tokens_peaks_by_the_chunk_not_the_prompt():
    """A one-layer Llama with a 32,000-token vocabulary, a 2,048-token prompt, 64 positions a chunk: the
    full `(prompt, vocab)` logits are 250 MiB, a chunk's 7.8 MiB; the extra peak over stock generate()
    stays within 4 chunks + 8 MiB (the chunk's logits, their log-softmax, the results) in a process with
    default allocator settings, and the values equal a full forward's."""
    stock, scored, full = _peak("stock"), _peak("prompt_logprobs"), _peak("full_forward")
    chunk_mib = 64 * 32000 * 4 / 2**20
    print(json.dumps({"stock": stock, "prompt_logprobs": scored, "full_forward": full}))
    assert scored["equal"], scored
    assert scored["growth_mib"] - stock["growth_mib"] <= 4 * chunk_mib + 8, (stock, scored)
    assert full["growth_mib"] >= full["full_logits_mib"], full  # what the chunks avoid
    assert not math.isnan(scored["max_abs_difference"])


def test_prompt_logprobs_under_prompt_lookup_score_the_prompt_alone():
    """Prompt lookup's first forward holds the prompt and its first candidates: only the prompt is scored."""
    from transformers import GenerationConfig

    if not hasattr(GenerationConfig(), "prompt_lookup_num_tokens"):
        pytest.skip("this transformers release has no prompt lookup")
    model = make_tiny("llama")
    prompt = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    with Recorder(model, prompt_logprobs=True) as rec:
        model.generate(prompt, logits_processor=[rec], max_new_tokens=6, prompt_lookup_num_tokens=3, pad_token_id=0)
    found = rec.generation().prompt_tensors()
    reference = _reference(model, {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)})[0]
    assert torch.equal(found["prompt_tokens"][0], reference["tokens"])
    assert torch.equal(found["prompt_logprobs"][0], reference["logprobs"])


def test_a_call_whose_prefill_does_not_see_the_whole_prompt_is_refused():
    """A cache that already holds part of the prompt, or a chunked prefill: the first forward does not
    see every position, so prompt logprobs would be shifted; refused before anything runs."""
    from transformers import GenerationConfig

    model = make_tiny("llama")
    ids = torch.tensor([[5, 9, 11, 40, 7]])
    with torch.no_grad():
        cache = model(ids[:, :1], use_cache=True).past_key_values
    with Recorder(model, prompt_logprobs=True) as rec:
        with pytest.raises(ValueError, match="already holding 1 token"):
            model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=2, logits_processor=[rec], pad_token_id=0)
        if hasattr(GenerationConfig(), "prefill_chunk_size"):
            with pytest.raises(ValueError, match="prefill_chunk_size"):
                model.generate(input_ids=ids, prefill_chunk_size=2, max_new_tokens=2, logits_processor=[rec], pad_token_id=0)


def test_a_causal_lm_calling_its_decoder_directly_is_scored():
    """OPT (and BART's, Marian's `*ForCausalLM`) call `self.model.decoder`, not their base model."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(vocab_size=128, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                     num_attention_heads=2, max_position_embeddings=64, word_embed_proj_dim=16,
                                     pad_token_id=0, bos_token_id=2, eos_token_id=1)).eval()
    ids = torch.tensor([[5, 9, 11, 40, 7]])
    with Recorder(model, prompt_logprobs=True) as rec:
        model.generate(ids, max_new_tokens=2, logits_processor=[rec], pad_token_id=0)
    with torch.no_grad():
        x = model(ids).logits.float()[0, :-1]  # (4.36's OPT takes no position ids)
    expected = torch.log_softmax(x, -1).gather(-1, ids[0, 1:, None])[:, 0]
    assert torch.equal(rec.generation().prompt_tensors()["prompt_logprobs"][0], expected)


def test_padding_without_an_attention_mask_is_inferred_as_generate_does():
    model = make_tiny("gpt2")
    ids = torch.tensor([[5, 9, 11, 40], [0, 0, 0, 7]])
    with Recorder(model, prompt_logprobs=True) as rec:
        model.generate(input_ids=ids, max_new_tokens=1, logits_processor=[rec], pad_token_id=0)
    assert [len(p) for p in rec.prompt_logprobs()] == [3, 0]


@pytest.mark.parametrize("options, match", [
    ({"prompt_chunk": 4}, "pass `prompt_logprobs=True`"),
    ({"prompt_logprobs": 500}, "more alternatives than the vocabulary"),
])
def test_more_bad_prompt_options(options, match):
    with pytest.raises(ValueError, match=match):
        Recorder(make_tiny("gpt2"), **options)


def test_numpy_and_torch_integers_are_taken():
    import numpy as np

    assert Recorder(make_tiny("gpt2"), prompt_logprobs=np.int64(2), prompt_chunk=torch.tensor(3))._options.prompt_scoring.top == 2


def test_the_prompt_table_has_one_row_per_scored_prompt_token(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow", exc_type=ImportError)  # noqa: F841
    from transformers_offload.answers.prompt_table import prompt_arrow
    from transformers_offload.cli import main

    model = make_tiny("gpt2")
    batch = left_padded_batch()
    with Recorder(model, prompt_logprobs=2, spill_dir=tmp_path / "run") as rec:
        rec.set_samples(["a", "b", "c"])
        model.generate(**batch, logits_processor=[rec], max_new_tokens=2, pad_token_id=0)
        model.generate(**batch, logits_processor=[rec], max_new_tokens=2, pad_token_id=0)  # numbered 3, 4, 5
    run = open_recording(tmp_path / "run")
    table = prompt_arrow(run)
    lengths = batch["attention_mask"].sum(-1).tolist()
    assert table.num_rows == 2 * sum(n - 1 for n in lengths)
    assert table.column("sample").to_pylist()[: lengths[0] - 1] == ["a"] * (lengths[0] - 1)
    first = [r for r in table.to_pylist() if r["generation"] == 0 and r["prompt"] == 1]
    listed = run.prompt_logprobs(0)[1]
    assert [r["position"] for r in first] == [e["position"] for e in listed]
    assert [r["token"] for r in first] == [e["token"] for e in listed]
    assert [r["logprob"] for r in first] == pytest.approx([e["logprob"] for e in listed], abs=0)
    assert [len(r["top_tokens"]) for r in first] == [2] * len(first)
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "p.parquet"), "--prompt"]) == 0
    assert "rows %d" % table.num_rows in capsys.readouterr().out
    with Recorder(model) as plain:
        model.generate(torch.tensor([[5, 6]]), logits_processor=[plain], max_new_tokens=1, pad_token_id=0)
    with pytest.raises(ValueError, match="no selected generation holds prompt logprobs"):
        prompt_arrow(plain)
