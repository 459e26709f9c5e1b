"""Run by tests/store/test_memory_store.py: drain many small steps into a MemoryStore while a KV-cache-like
list of tensors grows by `torch.cat` every step (as generate()'s dynamic cache does), in a fresh
process, and print the resident-set growth and the bytes kept, as JSON.

Usage: python memory_store_next_to_a_growing_cache.py STEPS
"""

import json
import os
import sys

import torch

from transformers_offload.store.memory import MemoryStore


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    steps = int(sys.argv[1])
    store = MemoryStore(["logits", "scores", "tokens", "finished"])
    cache = [torch.zeros(1, 3, 40, 64) for _ in range(30)]
    logits = torch.randn(1, 1000)
    before = resident_bytes()
    for step in range(steps):
        cache = [torch.cat([layer, torch.randn(1, 3, 1, 64)], dim=2) for layer in cache]
        store.drain(step, {"logits": logits, "scores": logits, "tokens": torch.zeros(1, dtype=torch.long),
                           "finished": torch.zeros(1, dtype=torch.bool)})
    kept = steps * (2 * logits.numel() * 4 + 8 + 1) + sum(layer.numel() * 4 for layer in cache)
    print(json.dumps({"growth": resident_bytes() - before, "kept": kept}))


if __name__ == "__main__":
    main()
