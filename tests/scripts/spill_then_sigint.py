"""Run by tests/test_interrupts.py (and by tests/store/test_spill.py, which watches the directory while it
is written): spill a long greedy run with one-step shards (the writer is the bottleneck), print
"ready" just before generate(), and wait for a SIGINT from the test (or run to the end).

A user's stopping criterion counts the steps whose token was appended and keeps those tokens. When
generate() returns or raises, one JSON line reports them; the test compares it with what the
recording holds.

Usage: python spill_then_sigint.py RECORDING_DIR MAX_NEW_TOKENS [threaded]
("threaded": the ring drains in its own thread, as on CUDA)
"""

import json
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, StoppingCriteria

from transformers_offload import Recorder
from transformers_offload import recorder as recorder_module


class Completed(StoppingCriteria):
    def __init__(self) -> None:
        self.tokens: list[list[int]] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.tokens.append(input_ids[:, -1].tolist())
        return False


def main() -> None:
    path, new_tokens = sys.argv[1], int(sys.argv[2])
    if sys.argv[3:] == ["threaded"]:
        recorder_module._on_cuda = lambda model: True
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50_000, n_positions=2048,
                        bos_token_id=1, eos_token_id=1, pad_token_id=0)
    model = GPT2LMHeadModel(config).eval()
    input_ids = torch.randint(3, 50_000, (4, 8), generator=torch.Generator().manual_seed(1))
    completed = Completed()
    state = "returned"
    started = time.monotonic()
    with Recorder(model, spill_dir=path, shard_bytes=1) as rec:
        try:
            print("ready", flush=True)
            started = time.monotonic()
            model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), logits_processor=[rec],
                           stopping_criteria=[completed], max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        except KeyboardInterrupt:
            state = "interrupted"
    print(json.dumps({"state": state, "seconds": time.monotonic() - started, "tokens": completed.tokens}), flush=True)


if __name__ == "__main__":
    main()
