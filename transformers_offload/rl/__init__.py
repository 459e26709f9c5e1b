"""Reinforcement learning on the distribution actually sampled: each token's kept set from a recording
(`kept`), the trainer's logprobs renormalised over it (`replay`), and the sampler's own logprobs (`sampler`)."""
