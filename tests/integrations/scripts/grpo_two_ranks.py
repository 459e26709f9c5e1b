"""Run by tests/integrations/test_rl_processes.py under `accelerate launch` (2 processes): TRL's GRPO on the tiny
GPT-2 with `RecordedGRPOTrainer`, each process recording its rollouts to OUT/rank-R; prints one JSON line per
process with what its log history says of the importance-sampling ratio."""

from __future__ import annotations

import json
import sys
import tempfile

import datasets
import torch
import trl

from tests.helpers import record_model, record_tokenizer
from transformers_offload.trainers.grpo import RecordedGRPOTrainer

out = sys.argv[1]
torch.manual_seed(0)
model, tokenizer = record_model(), record_tokenizer()
prompts = datasets.Dataset.from_dict({"prompt": ["w3 w4 w5", "w6 w7", "w8 w9 w10 w11", "w12"] * 4})
with tempfile.TemporaryDirectory() as scratch:
    # float32 and no dropout, so that the trainer's forward is the sampler's (TRL's defaults on CPU autocast to
    # bfloat16 and train with dropout: a real mismatch the correction then has to weigh)
    args = trl.GRPOConfig(output_dir=scratch, per_device_train_batch_size=2, num_generations=2, max_completion_length=5,
                          max_steps=2, temperature=0.7, top_p=0.8, report_to=[], use_cpu=True, bf16=False,
                          disable_dropout=True, beta=0.0, save_strategy="no", disable_tqdm=True, seed=0, logging_steps=1,
                          vllm_importance_sampling_mode="token_truncate")
    trainer = RecordedGRPOTrainer(model=model, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                                  args=args, train_dataset=prompts, processing_class=tokenizer, importance_sampling=True,
                                  replay=True, recording_dir=out)
    trainer.train()
logged = [entry for entry in trainer.state.log_history if "sampling/importance_sampling_ratio/mean" in entry]
print(json.dumps({"rank": trainer.accelerator.process_index, "processes": trainer.accelerator.num_processes,
                  "ratio_mean": [entry["sampling/importance_sampling_ratio/mean"] for entry in logged],
                  "logp_difference_max": [entry["sampling/sampling_logp_difference/max"] for entry in logged]}), flush=True)
