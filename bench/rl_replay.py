"""The trainer/sampler ratio with and without replay over the kept sets, and replay's cost.

    .venv/bin/python bench/rl_replay.py [--prompts 8] [--completions 4] [--new-tokens 64] [--repeats 5]

SmolLM2-135M-Instruct (CPU) samples `--prompts` chat prompts x `--completions` completions x `--new-tokens`
tokens at temperature 1.0 with top_p 0.8 (top_k off), then with top_k 20 (top_p off), recorded with
`streams=("logits", "scores")`. The trainer is the same model scoring the rollouts with one forward over the
sequences, in float32 and in bfloat16. Per valid token, the ratio `exp(trainer - sampler)` with the sampler's
logprob `sampler_logprobs(rec)["sampled"]` (the distribution drawn from) and the trainer's logprob either
plain, TRL's `old_per_token_logps` expression `log_softmax(logits / T)[token]`, or replayed,
`replay_logprobs(logits, kept_sets(rec))`: mean, share outside [0.9, 1.1], largest |log ratio|.

Cost: replay against the plain computation of the same logits (TRL's `selective_log_softmax` of
`logits / T`, which gathers a `log_softmax`), `--repeats` interleaved rounds, float32, time median and the peak
of the process's resident memory over each (`_common.high_water_mib` started over before each). Writes
`rl_replay.json`.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import high_water_mib, machine, median, print_table, reset_high_water, rss_bytes, write_json  # noqa: E402
from kept_sets import REPLAY_FILTERS, chat_batch, rollout_arguments  # noqa: E402


def _plain(logits, tokens, temperature):
    import torch

    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, tokens.clamp(min=0)[..., None])[..., 0]


def _ratios(trainer, sampler, valid) -> dict:
    log_ratio = (trainer.double() - sampler.double())[valid]
    ratio = log_ratio.exp()
    return {"mean": float(ratio.mean()), "outside_percent": float(((ratio < 0.9) | (ratio > 1.1)).double().mean() * 100),
            "largest_abs_log_ratio": float(log_ratio.abs().max())}


def main() -> None:
    args = rollout_arguments(__doc__.splitlines()[0])
    import torch

    from transformers_offload import Recorder, kept_sets, replay_logprobs, sampler_logprobs
    from transformers_offload.demo_model import load

    model, tokenizer = load()
    batch = chat_batch(tokenizer, args.prompts)
    prompt_length = batch["input_ids"].shape[1]
    rows, found = [], {}
    for name, options in REPLAY_FILTERS:
        torch.manual_seed(0)
        with Recorder(model, streams=("logits", "scores")) as rec:
            out = model.generate(**batch, logits_processor=[rec], do_sample=True, temperature=1.0,
                                 max_new_tokens=args.new_tokens, num_return_sequences=args.completions,
                                 pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True, **options)
        kept, sampler = kept_sets(rec), sampler_logprobs(rec)
        mask = batch["attention_mask"].repeat_interleave(args.completions, 0)
        attention = torch.cat([mask, torch.ones_like(out.sequences[:, prompt_length:])], 1)
        found[name] = {"bytes_per_token": kept.bytes_per_token(), "tokens": int(kept.valid.sum())}
        for dtype in (torch.float32, torch.bfloat16):
            trainer_model = model if dtype is torch.float32 else copy.deepcopy(model).to(dtype)
            with torch.no_grad():
                logits = trainer_model(input_ids=out.sequences, attention_mask=attention).logits[:, prompt_length - 1 : -1]
            plain = _plain(logits, kept.tokens, 1.0)
            replayed = replay_logprobs(logits, kept)
            label = str(dtype).replace("torch.", "")
            found[name][label] = {"plain": _ratios(plain, sampler["sampled"], kept.valid),
                                  "replay": _ratios(replayed, sampler["sampled"], kept.valid)}
            for kind in ("plain", "replay"):
                r = found[name][label][kind]
                rows.append([name, label, kind, round(r["mean"], 4), round(r["outside_percent"], 2),
                             round(r["largest_abs_log_ratio"], 4)])
            if dtype is torch.float32:
                found[name]["cost"] = _cost(logits, kept, args.repeats)
    print_table(["filter", "trainer dtype", "trainer logprob", "mean ratio", "% outside [0.9, 1.1]", "largest |log ratio|"],
                rows)
    print_table(["filter", "plain s", "replay s", "time ratio", "plain peak MiB", "replay peak MiB", "bytes/token"],
                [[name, round(v["cost"]["plain_s"], 4), round(v["cost"]["replay_s"], 4),
                  round(v["cost"]["replay_s"] / v["cost"]["plain_s"], 3), round(v["cost"]["plain_peak_mib"], 1),
                  round(v["cost"]["replay_peak_mib"], 1), round(v["bytes_per_token"], 1)] for name, v in found.items()])
    write_json(args.out / "rl_replay.json", {"machine": machine(), "args": vars(args) | {"out": str(args.out)},
                                             "results": found})


def _cost(logits, kept, repeats: int) -> dict:
    """Time and peak resident memory of the plain expression and of replay on the same float32 logits."""
    from transformers_offload import replay_logprobs

    cases = {"plain": lambda: _plain(logits, kept.tokens, 1.0), "replay": lambda: replay_logprobs(logits, kept)}
    seconds = {name: [] for name in cases}
    peaks = {name: [] for name in cases}
    for _ in range(repeats):
        for name, run in cases.items():
            reset_high_water()
            before = rss_bytes() / 2**20
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
            peaks[name].append(high_water_mib() - before)
    return {"plain_s": median(seconds["plain"]), "replay_s": median(seconds["replay"]),
            "plain_peak_mib": median(peaks["plain"]), "replay_peak_mib": median(peaks["replay"])}


if __name__ == "__main__":
    main()
