"""A user's analysis of 24 prompts, by hand and with the per-token table, side by side.

    .venv/bin/python examples/analysis_24_prompts.py

Records 24 chat prompts with SmolLM2-135M-Instruct in 3 batches of 8 (sampling with a repetition penalty, spilled to disk), each
prompt named with `set_samples`. Then answers, per prompt, twice: its tokens' total logprob and mean
entropy under the raw logits, how many of its tokens the processors moved off rank 0, and its
least likely token with the 3 alternatives the model preferred. `by_hand` does what a user wrote before
(stack the steps, log_softmax, gather, entropy, topk, mask finished rows, map rows back to prompts);
`with_table` uses `to_pandas`. It checks that both give the same answers and prints each one's lines
of code.
"""

from __future__ import annotations

import inspect
import shutil
import tempfile
from pathlib import Path

import torch

from transformers_offload import Recorder, open_recording
from transformers_offload.answers.table import to_pandas
from transformers_offload.demo_model import load

PROMPTS = [f"In one sentence, what is {topic}?" for topic in (
    "gravity", "a prime number", "democracy", "a volcano", "DNA", "jazz", "an atom", "the internet",
    "a rainbow", "inflation", "a glacier", "a poem", "a neuron", "chess", "a comet", "yoga", "a virus",
    "a bridge", "coffee", "a tsunami", "the Moon", "a museum", "a compiler", "a desert")]


def by_hand(run, ids_per_call):
    answers = {}
    for generation, ids in zip(run.generations, ids_per_call):
        logits = torch.stack(run.logits(generation.index), dim=1)            # (rows, steps, vocab)
        scores = torch.stack(run.scores(generation.index), dim=1)
        tokens = generation.sequences[:, generation.prompt_length:][:, :logits.shape[1]]
        finished = torch.stack(run.finished(generation.index), dim=1)        # (rows, steps)
        logprobs = torch.log_softmax(logits, -1)
        chosen = logprobs.gather(-1, tokens[..., None])[..., 0].float()
        entropy = torch.special.entr(torch.softmax(logits, -1)).sum(-1).float()
        rank_raw = (logits > logits.gather(-1, tokens[..., None])).sum(-1)
        rank_processed = (scores > scores.gather(-1, tokens[..., None])).sum(-1)
        for row, sample in enumerate(ids):
            keep = ~finished[row]
            worst = int(torch.argmin(torch.where(keep, chosen[row], torch.inf)))
            alternatives = torch.topk(logprobs[row, worst].float(), 3).indices.tolist()
            answers[sample] = (float(chosen[row][keep].sum()), float(entropy[row][keep].mean()),
                               int(((rank_raw[row] == 0) & (rank_processed[row] != 0))[keep].sum()),
                               int(tokens[row, worst]), alternatives)
    return answers


def with_table(run):
    frame = to_pandas(run, top=3)
    worst = frame.loc[frame.groupby("sample").logprob_raw.idxmin()].set_index("sample")
    moved = (frame.rank_raw == 0) & (frame.rank_processed != 0)
    totals = frame.assign(moved=moved).groupby("sample").agg(
        logprob=("logprob_raw", "sum"), entropy=("entropy_raw", "mean"), moved=("moved", "sum"))
    return {s: (float(t.logprob), float(t.entropy), int(t.moved), int(worst.token[s]), [int(a) for a in worst.top_tokens_raw[s]])
            for s, t in totals.iterrows()}


def _lines(function) -> int:
    body = inspect.getsource(function).splitlines()[1:]
    return sum(1 for line in body if line.strip() and not line.strip().startswith("#"))


def main() -> None:
    model, tokenizer = load()
    work = Path(tempfile.mkdtemp(prefix="analysis-"))
    try:
        ids_per_call = []
        with Recorder(model, spill_dir=work / "run") as rec:
            for first in range(0, 24, 8):
                batch = PROMPTS[first:first + 8]
                texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                       tokenize=False) for p in batch]
                enc = tokenizer(texts, return_tensors="pt", padding=True)
                ids = [f"q{first + i}" for i in range(len(batch))]
                rec.set_samples(ids, metadata=[{"prompt": p} for p in batch])
                ids_per_call.append(ids)
                torch.manual_seed(first)
                model.generate(**enc, logits_processor=[rec], do_sample=True, temperature=0.7, top_p=0.9,
                               repetition_penalty=1.3, max_new_tokens=32, pad_token_id=tokenizer.pad_token_id)
        run = open_recording(work / "run")
        mine, table = by_hand(run, ids_per_call), with_table(run)
        agree = set(mine) == set(table) and all(
            abs(mine[s][0] - table[s][0]) < 1e-3 and abs(mine[s][1] - table[s][1]) < 1e-4 and mine[s][2:] == table[s][2:]
            for s in mine)
        print(f"by hand: {_lines(by_hand)} lines; with the table: {_lines(with_table)} lines; same answers: {agree}")
        for sample in list(table)[:3]:
            print(sample, table[sample])
        if not agree:
            raise SystemExit(1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
