"""Record continuous batching inside a training-style loop, as TRL's GRPO trainer generates without vLLM:
code that calls `model.generate_batch(...)` itself, given no processor, recorded by a Recorder opened with
`every_call=True`. For each sampled token it prints the logprob under the distribution actually sampled
(after temperature and top-p, renormalised over the tokens kept: what truncated importance sampling needs)
and under the unprocessed one.

    python examples/continuous_batching_rl.py [--steps 2] [--out runs/grpo]

Runs on CPU with SmolLM2-135M-Instruct (`demo` extra; fetched once, then offline).
"""

from __future__ import annotations

import argparse

import torch
from transformers import GenerationConfig

from transformers_offload import Recorder, open_recording
from transformers_offload.demo_model import load

PROMPTS = ["Name a prime number.", "What is the capital of Italy?", "Say hello in French."]


def rollout(model, tokenizer, config: GenerationConfig) -> dict:
    """What a GRPO step does: one generate_batch call over the prompts (no processor given)."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in PROMPTS]
    inputs = [tokenizer(text)["input_ids"] for text in texts]
    return model.generate_batch(inputs, generation_config=config, progress_bar=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="training steps (rollouts)")
    parser.add_argument("--out", default=None, help="spill the recording to this new directory")
    args = parser.parse_args()
    model, tokenizer = load()
    config = GenerationConfig(do_sample=True, temperature=0.9, top_p=0.9, max_new_tokens=16,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with Recorder(model, every_call=True, spill_dir=args.out) as rec:
        for step in range(args.steps):
            torch.manual_seed(step)
            results = rollout(model, tokenizer, config)
            print(f"step {step}: {len(results)} completions")
    recording = open_recording(args.out) if args.out else rec
    for generation in recording.generations:
        sampled = generation.logprobs(kind="processed")[0]
        unprocessed = generation.logprobs(kind="raw")[0]
        text = tokenizer.decode([entry["token"] for entry in sampled])
        gaps = [s["logprob"] - u["logprob"] for s, u in zip(sampled, unprocessed)]
        print(f"{generation.sample_ids[0]:>6} {text!r}")
        print(f"        sampled-minus-unprocessed logprob per token: mean {sum(gaps) / len(gaps):+.3f}, "
              f"max {max(gaps):+.3f} (nats)")


if __name__ == "__main__":
    main()
