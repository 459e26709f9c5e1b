"""Rewrite tests/golden/cross-release: a tiny Llama saved with `save_pretrained` and a recording of it
made on the newest transformers release (greedy search, sampling and beam search over a left-padded
batch, each call's prompts named), which `tests/rescoring/test_rescore_releases.py` rescores under every release of
the version matrix. Rewrite it with the newest release only (`scripts/setup.sh`'s), after a deliberate
change; the recording's manifest names the release that wrote it.

Usage: python -m tests.golden.make_cross_release
"""

import shutil
from pathlib import Path

import torch

from tests.conftest import EOS, PAD, left_padded_batch, make_tiny
from transformers_offload import Recorder

TARGET = Path(__file__).resolve().parent / "cross-release"
CALLS = {"greedy": {"do_sample": False}, "sample": {"do_sample": True, "top_k": 20},
         "beam": {"num_beams": 3, "num_return_sequences": 2}}

if __name__ == "__main__":
    shutil.rmtree(TARGET, ignore_errors=True)
    torch.set_num_threads(1)  # as the test rescores it: CPU kernels sum in another order on more threads
    model = make_tiny("llama")
    model.save_pretrained(TARGET / "model", safe_serialization=True)
    with Recorder(model, spill_dir=TARGET / "recording", streams=("logits",)) as rec:
        for name, options in CALLS.items():
            rec.set_samples([f"{name}-{row}" for row in range(3)])
            torch.manual_seed(0)
            model.generate(**left_padded_batch(), logits_processor=[rec], max_new_tokens=8, pad_token_id=PAD,
                           eos_token_id=EOS, **options)
    print(f"wrote {TARGET}: {sorted(str(p.relative_to(TARGET)) for p in TARGET.rglob('*') if p.is_file())}")
