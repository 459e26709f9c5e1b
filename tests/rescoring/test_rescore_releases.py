"""A recording made on the newest transformers release (tests/golden/cross-release, written by
`python -m tests.golden.make_cross_release`) rescored under the release this suite runs on: the version
matrix runs it on every release it tests (docs/rescore.md gives the two-environment recipe for a
user's own recordings). The replay must follow every recorded token; its logits equal the recording's
bit for bit on the release that wrote it, and within float rounding elsewhere."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from transformers_offload import open_recording, rescore

from ..helpers import GOLDEN

CROSS_RELEASE = GOLDEN / "cross-release"


@pytest.fixture(scope="module")
def rescored():
    llama = getattr(transformers, "LlamaConfig", None)  # 4.28
    if llama is None or "num_key_value_heads" not in llama().to_dict():
        pytest.skip(f"transformers {transformers.__version__}'s Llama has no grouped-query attention (4.31), "
                    "which the golden model uses")
    model = AutoModelForCausalLM.from_pretrained(CROSS_RELEASE / "model").eval()
    original = open_recording(CROSS_RELEASE / "recording")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the recording was made: CPU kernels sum in another order on more threads
    try:
        return original, rescore(original, model)
    finally:
        torch.set_num_threads(threads)


def test_the_replay_follows_every_recorded_token(rescored):
    original, again = rescored
    assert [g.sample_ids for g in again.generations] == [g.sample_ids for g in original.generations]
    for a, b in zip(original.generations, again.generations):
        assert b.complete and (b.num_steps, b.num_rows) == (a.num_steps, a.num_rows)
        for x, y in zip(a.tokens(), b.tokens()):
            assert torch.equal(x, y)


def test_logits_across_releases(rescored):
    original, again = rescored
    written_by = original.describe()["created_by"]["transformers"]
    for a, b in zip(original.generations, again.generations):
        for step, (x, y) in enumerate(zip(a.logits(), b.logits())):
            if transformers.__version__ == written_by:
                assert torch.equal(x, y), f"generation {a.index} ({a.mode}) step {step}"
            else:  # another release computes the same model's forward in another order: float32 rounding
                assert float((x - y).abs().max()) <= 1e-4 * max(1.0, float(x.abs().max())), (
                    f"generation {a.index} ({a.mode}) step {step}: {float((x - y).abs().max())}"
                )
