"""Replay's cost inside TRL: `RecordedGRPOTrainer`'s per-token logprobs (TRL's fused head, plus the replay of
the masked positions from the backbone's hidden states) against TRL 1.16's own computation of the same batch.

    .venv/bin/python bench/trl_replay_cost.py [--prompts 8] [--completions 4] [--new-tokens 64] [--repeats 5]

SmolLM2-135M-Instruct (CPU, float32) samples `--prompts` chat prompts x `--completions` completions x
`--new-tokens` tokens at temperature 1.0 with top_p 0.8 (then top_k 20), recorded. Then, on one
`RecordedGRPOTrainer(replay=True)` holding those kept sets, the scoring step of GRPO's loss: the trainer's
`_get_per_token_logps_and_entropies` over the batch (entropies too, as TRL's loss asks), a sum of the logprobs
over the completion mask, and its backward pass; `trl` with replay off (TRL's own method, its fused head),
`replay` with it on. `--repeats` interleaved rounds: the time median, and the median peak of the process's
resident memory over each round above what it held before (`_common.high_water_mib`). Writes
`trl_replay_cost.json`.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import high_water_mib, machine, median, print_table, reset_high_water, rss_bytes, write_json  # noqa: E402
from kept_sets import REPLAY_FILTERS, chat_batch, rollout_arguments  # noqa: E402


def main() -> None:
    args = rollout_arguments(__doc__.splitlines()[0])
    import datasets
    import torch
    import trl

    from transformers_offload import Recorder, kept_sets
    from transformers_offload.demo_model import load
    from transformers_offload.trainers.grpo import RecordedGRPOTrainer

    model, tokenizer = load()
    batch = chat_batch(tokenizer, args.prompts)
    prompt_length = batch["input_ids"].shape[1]
    with tempfile.TemporaryDirectory() as scratch:
        config = trl.GRPOConfig(output_dir=scratch, use_cpu=True, bf16=False, report_to=[], temperature=1.0,
                                per_device_train_batch_size=args.completions, num_generations=args.completions)
        trainer = RecordedGRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                                      args=config, train_dataset=datasets.Dataset.from_dict({"prompt": ["x"]}),
                                      processing_class=tokenizer, replay=True)
    model.train()
    found, rows = {}, []
    for label, options in REPLAY_FILTERS:
        torch.manual_seed(0)
        with torch.no_grad(), Recorder(model, streams=("logits", "scores")) as rec:
            sequences = model.generate(**batch, logits_processor=[rec], do_sample=True, temperature=1.0,
                                       max_new_tokens=args.new_tokens, num_return_sequences=args.completions,
                                       pad_token_id=tokenizer.pad_token_id, **options)
        kept = kept_sets(rec)
        trainer._kept_batches[0] = kept
        mask = batch["attention_mask"].repeat_interleave(args.completions, 0)
        attention = torch.cat([mask, kept.valid.long()], 1)

        seconds = {"trl": [], "replay": []}
        peaks = {"trl": [], "replay": []}
        case = (trainer, model, sequences, attention, kept)
        _scoring(case, False)
        _scoring(case, True)  # warm both paths once
        for _ in range(args.repeats):
            for name in seconds:
                reset_high_water()
                before = rss_bytes() / 2**20
                start = time.perf_counter()
                _scoring(case, name == "replay")
                seconds[name].append(time.perf_counter() - start)
                peaks[name].append(high_water_mib() - before)
        entry = {name: {"seconds": median(seconds[name]), "peak_mib": median(peaks[name]),
                        "all_seconds": seconds[name], "all_peak_mib": peaks[name]} for name in seconds}
        entry["time_ratio"] = entry["replay"]["seconds"] / entry["trl"]["seconds"]
        entry["peak_ratio"] = entry["replay"]["peak_mib"] / entry["trl"]["peak_mib"]
        entry["kept_ids"], entry["tokens"] = int(kept.ids.numel()), int(kept.valid.sum())
        found[label] = entry
        rows.append([label, f"{entry['trl']['seconds']:.3f}", f"{entry['replay']['seconds']:.3f}",
                     f"{entry['time_ratio']:.3f}", f"{entry['trl']['peak_mib']:.1f}", f"{entry['replay']['peak_mib']:.1f}",
                     f"{entry['peak_ratio']:.3f}", entry["kept_ids"]])
    print_table(["filter", "TRL s", "replay s", "time ratio", "TRL peak MiB", "replay peak MiB", "peak ratio", "kept ids"],
                rows)
    write_json(args.out / "trl_replay_cost.json", {"machine": machine(), "versions": {"trl": trl.__version__},
                                                   "args": vars(args) | {"out": str(args.out)}, "results": found,
                                                   "prompt_length": prompt_length})


def _scoring(case: tuple, replay: bool) -> None:
    """GRPO's loss-side scoring of the batch, forward and backward: the trainer's per-token logprobs (and
    entropies), replayed over the kept sets or TRL's own."""
    trainer, model, sequences, attention, kept = case
    trainer._replay_rows = (0, None) if replay else None
    try:
        logps, _, _ = trainer._get_per_token_logps_and_entropies(model, sequences, attention, kept.steps,
                                                                 compute_entropy=True)
        (logps * kept.valid).sum().backward()
    finally:
        trainer._replay_rows = None
    model.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
