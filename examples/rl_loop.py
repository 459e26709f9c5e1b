"""A policy-gradient loop in plain PyTorch (with accelerate for the processes), sampling with top-p: each
process records its own rollouts, takes each token's kept set and sampler logprob from the recording, replays
the policy's logprobs over the kept sets from its hidden states (no full logits), and weights the loss with a
truncated importance-sampling ratio. The rollouts of every process read back as one recording.

    python examples/rl_loop.py [--steps 3] [--out runs/rl]                              # one process, SmolLM2
    accelerate launch --multi_gpu --num_processes 2 examples/rl_loop.py --out runs/rl   # two, each its rank-R folder
    python -m transformers_offload inspect runs/rl                                      # both ranks' rollouts

(`--multi_gpu` starts the processes with torchrun; on a machine without a GPU they train on the CPU over gloo.)

`--tiny` uses a tiny random Llama built from a config instead (what the tests run). Needs accelerate (the
`integrations` extra) and, without `--tiny`, the `demo` extra.
"""

from __future__ import annotations

import argparse
import json

import torch
from accelerate import Accelerator

from transformers_offload import Recorder, kept_sets, open_recording, replay_logprobs_from_hidden, sampler_logprobs

QUESTIONS = ["Name a prime number.", "What is the capital of Italy?", "Say hello in French.", "Give me a colour."]


def load(tiny: bool):
    if tiny:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        return LlamaForCausalLM(config), None
    from transformers_offload.demo_model import load as load_demo

    return load_demo()


def prompts_for(tokenizer, rank: int, step: int) -> dict:
    """Two prompts per process and step (left-padded)."""
    if tokenizer is None:  # the tiny model: made-up ids
        ids = torch.tensor([[5 + rank, 6 + step, 7, 8], [9, 10 + rank, 11, 12 + step]])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    chosen = [QUESTIONS[(2 * rank + step + k) % len(QUESTIONS)] for k in range(2)]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in chosen]
    return dict(tokenizer(texts, return_tensors="pt", padding=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2")
    parser.add_argument("--out", default="runs/rl", help="the recording's root (one rank-R folder per process)")
    parser.add_argument("--clip", type=float, default=2.0, help="importance-sampling ratios above this are truncated")
    args = parser.parse_args()
    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # on CPU: gloo between the processes
    model, tokenizer = load(args.tiny)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, optimizer = accelerator.prepare(model, optimizer)
    policy = accelerator.unwrap_model(model)
    head = policy.get_output_embeddings()
    rank, group = accelerator.process_index, 4
    options = {"do_sample": True, "temperature": 0.9, "top_p": 0.8, "max_new_tokens": 12, "num_return_sequences": group,
               "pad_token_id": policy.config.pad_token_id or 0}
    torch.manual_seed(1234 + rank)  # each process samples its own rollouts
    for step in range(args.steps):
        batch = {name: value.to(accelerator.device) for name, value in prompts_for(tokenizer, rank, step).items()}
        policy.eval()
        with torch.no_grad(), Recorder(policy, streams=("logits", "scores"), spill_dir=f"{args.out}/rank-{rank}",
                                       append=True) as rec:
            sequences = policy.generate(**batch, logits_processor=[rec], **options)
        policy.train()
        generation = rec.generations[-1]
        kept = kept_sets(generation).to(accelerator.device)
        sampled = sampler_logprobs(generation)["sampled"].to(accelerator.device)  # the sampler's own logprobs
        valid = kept.valid.float()
        # reward: shorter completions score higher; advantages normalised within each prompt's group
        reward = -valid.sum(1)
        advantage = ((reward.view(-1, group) - reward.view(-1, group).mean(1, keepdim=True))
                     / (reward.view(-1, group).std(1, keepdim=True) + 1e-4)).view(-1)
        prompt = batch["input_ids"].shape[1]
        attention = torch.cat([batch["attention_mask"].repeat_interleave(group, 0), kept.valid.long()], 1)
        out = model(input_ids=sequences, attention_mask=attention, output_hidden_states=True, logits_to_keep=1)
        hidden = out.hidden_states[-1][:, prompt - 1 : -1]  # the states that predicted each sampled token
        trainer = replay_logprobs_from_hidden(hidden, head.weight, kept, bias=head.bias)  # (rows, steps), with grad
        ratio = (trainer.detach() - sampled).exp().clamp(max=args.clip)  # truncated importance sampling
        loss = -(ratio * advantage[:, None] * trainer * valid).sum() / valid.sum().clamp(min=1)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        log_ratio = (trainer.detach() - sampled)[kept.valid]
        print(json.dumps({"rank": rank, "step": step, "loss": round(float(loss.detach()), 6), "tokens": int(kept.valid.sum()),
                          "ratio_mean": round(float(log_ratio.exp().mean()), 6),
                          "max_abs_log_ratio": float(log_ratio.abs().max())}), flush=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        run = open_recording(args.out)
        print(json.dumps({"generations": len(run.generations), "ranks": sorted(set(getattr(run, "generation_ranks", [0])))}))


if __name__ == "__main__":
    main()
