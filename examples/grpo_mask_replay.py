"""A few GRPO steps with TRL on SmolLM2, on CPU, sampling with top-p 0.8: the rollouts recorded, TRL's
importance-sampling correction fed the recorded sampler logprobs, and the policy's logprobs replayed over
each token's kept set (`RecordedGRPOTrainer`, docs/rl.md).

    python examples/grpo_mask_replay.py [--steps 3] [--no-replay] [--continuous-batching] [--out runs/grpo]

It prints, per step, TRL's own metrics of the mismatch between the trainer and the sampler: the mean
|trainer logprob - sampler logprob| over the completion tokens and the mean importance-sampling ratio.
With `--no-replay` the trainer scores each token under the whole vocabulary (what TRL does) and the ratio
falls well below 1; replayed, it is 1 within float32 rounding. `--out` keeps every rollout
(`python -m transformers_offload inspect runs/grpo`). Needs TRL 1.16 (the `integrations` extra) and the
`demo` extra.
"""

from __future__ import annotations

import argparse
import tempfile

from datasets import Dataset
from trl import GRPOConfig

from transformers_offload.demo_model import load
from transformers_offload.trainers.grpo import RecordedGRPOTrainer

QUESTIONS = ["Name a prime number.", "What is the capital of Italy?", "Say hello in French.",
             "Give me a colour.", "What is two plus two?", "Name an animal that flies."]


def reward_brevity(completions: list, **_: object) -> list[float]:
    """Shorter answers score higher (a reward that needs no model)."""
    return [-float(len(completion[0]["content"])) / 100 for completion in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps")
    parser.add_argument("--no-replay", action="store_true", help="score tokens under the whole vocabulary, as TRL does")
    parser.add_argument("--continuous-batching", action="store_true", help="roll out with transformers' continuous batching")
    parser.add_argument("--out", default=None, help="keep the rollouts' recording in this directory (one folder per process)")
    args = parser.parse_args()
    model, tokenizer = load()
    tokenizer.padding_side = "left"
    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in QUESTIONS] * 4})
    with tempfile.TemporaryDirectory() as scratch:
        config = GRPOConfig(output_dir=scratch, per_device_train_batch_size=4, num_generations=4,
                            max_completion_length=24, max_steps=args.steps, temperature=1.0, top_p=0.8,
                            learning_rate=1e-6, beta=0.0, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                            logging_steps=1, disable_tqdm=True, seed=0, vllm_importance_sampling_mode="token_truncate",
                            use_transformers_continuous_batching=args.continuous_batching)
        trainer = RecordedGRPOTrainer(model=model, reward_funcs=reward_brevity, args=config, train_dataset=prompts,
                                      processing_class=tokenizer, importance_sampling=True,
                                      replay=not args.no_replay, recording_dir=args.out)
        trainer.train()
    print(f"{'step':>4}  {'|trainer - sampler| mean':>24}  {'max':>9}  {'IS ratio mean':>13}  {'min':>6}  "
          f"({'plain' if args.no_replay else 'replayed'})")
    for logged in trainer.state.log_history:
        if "sampling/importance_sampling_ratio/mean" in logged:
            print(f"{logged['step']:>4}  {logged['sampling/sampling_logp_difference/mean']:>24.2e}  "
                  f"{logged['sampling/sampling_logp_difference/max']:>9.2e}  "
                  f"{logged['sampling/importance_sampling_ratio/mean']:>13.4f}  "
                  f"{logged['sampling/importance_sampling_ratio/min']:>6.3f}")

if __name__ == "__main__":
    main()
