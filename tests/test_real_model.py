"""End to end on the real SmolLM2-135M-Instruct: the recording equals Hugging Face's outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from transformers_offload import Recorder, open_recording

from .helpers import ROOT, assert_steps_equal, bench_module, finished_from_sequences, hf_reference

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Name two primary colours.", "Say hello."]
MODES = {
    "greedy": dict(do_sample=False),
    "sampling": dict(do_sample=True, temperature=0.7, top_p=0.9, repetition_penalty=1.1),
    "beam_search": dict(num_beams=2, num_return_sequences=2),
}


@pytest.fixture(scope="module")
def chat_batch(real_model):
    _, tokenizer = real_model
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in PROMPTS
    ]
    return tokenizer(texts, return_tensors="pt", padding=True)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_real_model_recording_is_exact(real_model, chat_batch, mode, store, tmp_path):
    model, tokenizer = real_model
    kwargs = dict(MODES[mode], max_new_tokens=40, min_new_tokens=32, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    reference = model.generate(
        **chat_batch, return_dict_in_generate=True, output_scores=True, output_logits=True, **kwargs
    )
    options = store.options(shard_bytes=2**20)
    with Recorder(model, **options) as rec:
        torch.manual_seed(0)
        sequences = model.generate(**chat_batch, logits_processor=[rec], **kwargs)
    rec = store.reopen(rec)
    assert torch.equal(sequences, reference.sequences)
    assert len(rec.logits()) >= 32
    assert_steps_equal(rec.logits(), reference.logits, "logits")
    assert_steps_equal(rec.scores(), reference.scores, "scores")
    prompt = chat_batch["input_ids"].shape[1]
    if mode == "beam_search":
        assert torch.equal(rec.beam_indices(), reference.beam_indices)
    else:
        assert torch.equal(torch.stack(rec.tokens(), dim=1), reference.sequences[:, prompt:])
        eos = [tokenizer.eos_token_id]
        for mine, theirs in zip(rec.finished(), finished_from_sequences(reference.sequences, prompt, eos)):
            assert torch.equal(mine, theirs)


@pytest.fixture(scope="module")
def eager_model(real_model):
    from transformers_offload import demo_model

    return demo_model.load(attn_implementation="eager")[0]


@pytest.mark.parametrize("mode", ["greedy", "beam_search"])
def test_real_model_attentions_and_hidden_states_are_exact(eager_model, real_model, chat_batch, mode, store, tmp_path):
    _, tokenizer = real_model
    kwargs = dict(MODES[mode], max_new_tokens=12, min_new_tokens=12, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    reference = eager_model.generate(
        **chat_batch, return_dict_in_generate=True, output_attentions=True, output_hidden_states=True, **kwargs
    )
    options = store.options()
    with Recorder(eager_model, streams=("attentions", "hidden_states"), **options) as rec:
        torch.manual_seed(0)
        sequences = eager_model.generate(**chat_batch, logits_processor=[rec], **kwargs)
    rec = store.reopen(rec)
    assert torch.equal(sequences, reference.sequences)
    for kind in ("attentions", "hidden_states"):
        recorded, theirs = getattr(rec, kind)(), getattr(reference, kind)
        assert len(recorded) == len(theirs) == 12
        for step, (mine, hf) in enumerate(zip(recorded, theirs)):
            assert len(mine) == len(hf) == (30 if kind == "attentions" else 31)
            assert all(torch.equal(a, b) for a, b in zip(mine, hf)), f"{kind}[{step}] differs from Hugging Face's"


def test_real_model_answers_the_capital_question(real_model, chat_batch):
    model, tokenizer = real_model
    with Recorder(model) as rec:
        sequences = model.generate(
            **chat_batch, logits_processor=[rec], max_new_tokens=12, pad_token_id=tokenizer.pad_token_id
        )
    answer = tokenizer.decode(sequences[0, chat_batch["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
    paris = tokenizer.encode(" Paris")[0]
    step = [int(t[0]) for t in rec.tokens()].index(paris)
    assert int(rec.logits()[step][0].argmax()) == paris


STEPS, CHECKPOINT, BATCH, SHARD_MIB = 256, 64, 4, 8
STEP_MIB = BATCH * 49152 * 4 * 2 / 2**20  # raw logits and processed scores, float32


def _peak_rss(store: str, *, steps: int = STEPS, checkpoint: int = CHECKPOINT, streams: str = "logits,scores",
              shard_mib: int = SHARD_MIB) -> dict:
    # A process as users run it: the C library's default allocator settings (no MALLOC_* variables,
    # `_common.default_env`); the recorder's per-step buffers are made once, so its peak repeats.
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "peak_rss.py"), "--store", store, "--steps", str(steps),
         "--checkpoint", str(checkpoint), "--batch", str(BATCH), "--shard-mib", str(shard_mib), "--streams", streams],
        capture_output=True, text=True, timeout=900,
        env=bench_module("_common").default_env(HF_HUB_OFFLINE="1"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow(minutes=2)  # three fresh processes of 256 steps
def test_spilling_keeps_peak_memory_flat_while_the_memory_store_grows(real_model):
    """Batch 4, 256 steps: peak RSS growth from step 64 to the end, each store in its own process.

    Stock generate() grows too (its KV cache); the spilling recorder may add at most its three shard
    buffers on top of that, whatever the number of steps; the in-memory store grows by every step's
    logits and scores (1.5 MiB a step here).
    """
    stock, spill, memory = (_peak_rss(store) for store in ("none", "spill", "memory"))
    late_steps = STEPS - CHECKPOINT
    print(json.dumps({"stock": stock, "spill": spill, "memory": memory}, indent=1))
    assert spill["growth_mib"] <= stock["growth_mib"] + 3 * SHARD_MIB, (stock, spill)
    assert memory["growth_mib"] >= stock["growth_mib"] + 0.9 * late_steps * STEP_MIB, (stock, memory)


@pytest.mark.slow(minutes=3)  # seven fresh processes of 160 steps, every layer's attentions
def test_spilling_every_layers_attentions_keeps_peak_memory_flat(real_model):
    """Batch 4, 160 steps, the attentions of all 30 layers: peak RSS growth from step 32 to the end.

    A decode step t holds 30 layers x 4 rows x 9 heads x (prompt + t) keys x 4 bytes (about 0.6 MiB
    here, one more key per step); the spilling recorder may add its three shard buffers over stock
    generate(), each up to twice the shard's size for a stream whose steps grow (a ragged stream's flat
    buffer grows by doubling, `store.shard_buffer.ShardBuffer.put_ragged`), whatever the number of steps;
    the in-memory store grows by every late step's attentions.
    """
    steps, checkpoint, shard_mib = 160, 32, 4

    def least(store: str, times: int) -> dict:  # stock's and spill's growth spread by about 15 MiB a run
        found = [_peak_rss(store, steps=steps, checkpoint=checkpoint, streams="attentions", shard_mib=shard_mib)
                 for _ in range(times)]
        return min(found, key=lambda run: run["growth_mib"])

    # A single run of each spreads by more than the bound (the C library's heaps, as below): the least
    # of 3 fresh processes each.
    runs = {"none": least("none", 3), "spill": least("spill", 3), "memory": least("memory", 1)}
    print(json.dumps(runs, indent=1))
    stock, spill, memory = runs["none"], runs["spill"], runs["memory"]
    prompt = memory["prompt_length"]  # of the left-padded batch
    late_mib = sum(30 * BATCH * 9 * (prompt + t) * 4 for t in range(checkpoint, steps)) / 2**20
    ragged_buffers_mib = 3 * 2 * shard_mib  # measured over stock: 12.4 to 16.5 MiB (least of 3 runs)
    assert late_mib > 2 * ragged_buffers_mib  # the bound below tells the two stores apart
    assert spill["growth_mib"] <= stock["growth_mib"] + ragged_buffers_mib, (stock, spill)
    assert memory["growth_mib"] >= stock["growth_mib"] + 0.9 * late_mib, (stock, memory, late_mib)
    assert spill["bytes_written"] > late_mib * 2**20


LAYER_PEAK_RUNS = 3
GLIBC_HEAP_MIB = 64  # the size of one glibc heap of a non-main arena (HEAP_MAX_SIZE, 64-bit Linux)


def _layer_peak(case: dict, prompt_tokens: int = 1000) -> float:
    """Peak RSS growth of one generate() call over a `prompt_tokens` prompt, the least of
    `LAYER_PEAK_RUNS` fresh processes with the C library's default allocator settings
    (bench/layer_peak.py). The least, not one run: stock generate() itself spreads by more than the
    hidden state's bound below between runs (glibc's reuse of the blocks the eager attention frees
    layer by layer; bench/README.md has the figures); the least is what the call needs."""
    return min(run["growth_mib"] for run in bench_module("layer_peak").measure(case, prompt_tokens, 4, LAYER_PEAK_RUNS))


@pytest.fixture(scope="module")
def stock_peak(real_model) -> float:
    return _layer_peak({"recorder": False})


@pytest.mark.parametrize("selection", [
    {"streams": ["attentions"], "layers": [-1]},
    {"streams": ["attentions"], "layers": [-1], "newest_position_only": True},
    {"streams": ["hidden_states"], "layers": [-1]},
], ids=["attentions", "attentions-newest", "hidden_states"])
def test_one_selected_layer_over_a_long_prompt_costs_at_most_twice_its_own_bytes(real_model, stock_peak, selection):
    """SmolLM2 (eager), a 1,000-token prompt, the last layer: peak growth over stock generate() within
    2 x that layer's prefill bytes + 32 MiB, plus one glibc heap. Attention weights: 9 heads x 1,000 x
    1,000 x 4 bytes.

    The peak of this call is bimodal, stock's and the recorder's alike (`bench/layer_peak.py --runs 4`):
    the upper mode sits about one 64 MiB heap of the C library's allocator higher, and every one of
    3 runs may fall in it, so the bound allows that heap."""
    stock = stock_peak
    recorded = _layer_peak(selection)
    layer_mib = (9 * 1000 * 1000 * 4 if selection["streams"] == ["attentions"] else 1000 * 576 * 4) / 2**20
    print(json.dumps({"stock_mib": stock, "recorded_mib": recorded, "layer_mib": layer_mib}))
    assert recorded - stock <= 2 * layer_mib + 32 + GLIBC_HEAP_MIB, (stock, recorded, layer_mib)


def test_the_demo_records_to_a_directory_and_reads_it_back(real_model, tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "chat_demo.py"), "--out", str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "generation 0: sample, complete" in done.stdout and "Paris" in done.stdout
    assert "top_p=0.9" in done.stdout and "prompt lengths (tokens, without padding): [" in done.stdout
    # Two stock calls of the same seed may differ in the last bits on a CPU (observed once in CI, never
    # here in 25 runs): the demo then checks the recording within one call instead, and says so.
    if "not bit-reproducible from one call to the next" not in done.stderr:
        for line in ("raw logits bit-identical to out.logits:       True",
                     "processed scores bit-identical to out.scores: True"):
            assert line in done.stdout
    assert len(open_recording(tmp_path / "demo").generation().logits()) > 0


def test_the_demo_removes_its_temporary_recording(real_model, tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "chat_demo.py")], capture_output=True, text=True, timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "removed at the end" in done.stdout
    assert list(tmp_path.iterdir()) == []


def test_stop_strings_end_rows_and_the_recording_stays_exact(real_model, chat_batch):
    model, tokenizer = real_model
    kwargs = dict(max_new_tokens=30, stop_strings=["Paris"], tokenizer=tokenizer, pad_token_id=tokenizer.pad_token_id)
    reference = hf_reference(model, **chat_batch, **kwargs)
    with Recorder(model) as rec:
        sequences = model.generate(**chat_batch, logits_processor=[rec], **kwargs)
    assert torch.equal(sequences, reference.sequences)
    assert_steps_equal(rec.logits(), reference.logits, "logits")
    assert_steps_equal(rec.scores(), reference.scores, "scores")
    prompt = chat_batch["input_ids"].shape[1]
    paris = tokenizer.decode(sequences[0, prompt:]).find("Paris")
    assert paris >= 0 and rec.finished()[-1][0], "the stop string did not end the first row"


def test_the_readme_quickstart_runs_offline_as_written(real_model, tmp_path):
    readme = (ROOT / "README.md").read_text()
    quickstart = readme[readme.index("## Quickstart"):]
    code = quickstart[quickstart.index("```python\n") + len("```python\n"):quickstart.index("```\n", 10)]
    script = tmp_path / "quickstart.py"
    script.write_text(code + "\nassert len(logits) == len(scores) > 0 and logits[0].shape == (1, 49152)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
