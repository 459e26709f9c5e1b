"""Record a real chat generation with SmolLM2-135M-Instruct and check it against Hugging Face's own outputs.

Run it with `bash scripts/demo.sh` (sets everything up), or, with the package and its `demo` extra
installed, `python examples/chat_demo.py`.

Three chat prompts run as one left-padded batch with sampling (temperature 0.7, top_p 0.9, 64 new
tokens) through a Recorder that spills to a recording directory (`--out`, default a new temporary
one), with `output_scores`/`output_logits` off. The script reads the directory back with
`open_recording`, prints its summary (as `python -m transformers_offload inspect` does), each answer
and a per-token table for the first one, then re-runs the same seed with `output_logits=True,
output_scores=True` and reports whether what it read back is bit-identical. A temporary recording
is removed at the end.

Where the two calls differ, it tells the two causes apart before failing: a machine whose stock
generate() does not repeat itself bit for bit (a CPU math library may split a sum differently from one
call to the next) is reported as such, and the recording is then checked against HF's outputs of its
own call; a recording that differs from what its call computed exits with status 1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from transformers_offload import DeviceAccumulationWarning, Recorder, Recording, open_recording  # noqa: E402
from transformers_offload.cli.summary import format_summary  # noqa: E402
from transformers_offload.demo_model import load  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about the sea.",
]
SAMPLING = dict(do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="a new or empty directory for the recording (default: a temporary one)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="chat-demo-")) / "recording"

    model, tokenizer = load()
    chats = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
    texts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in chats]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    prompt_length = batch["input_ids"].shape[1]

    with Recorder(model, spill_dir=out) as rec:
        torch.manual_seed(args.seed)
        sequences = model.generate(**batch, logits_processor=[rec], pad_token_id=tokenizer.pad_token_id, **SAMPLING)

    run = open_recording(out)
    print(format_summary(run.describe()))
    for prompt, row in zip(PROMPTS, sequences):
        answer = tokenizer.decode(row[prompt_length:], skip_special_tokens=True).strip()
        print(f"\n>>> {prompt}\n{answer}")

    print_token_table(run, tokenizer, row=0)

    reference = stock(model, batch, tokenizer, args.seed)
    steps, rows, vocab = len(run.logits()), *run.logits()[0].shape
    where = out if args.out else f"{out} (temporary, removed at the end: keep one with --out)"
    print(f"\nrecorded {steps} steps x {rows} rows x {vocab} vocabulary, 2 streams, in {where}")
    print("read back with open_recording; compared with a stock generate() of the same seed:")
    differences = compare(run, sequences, reference)
    for what, first in differences.items():
        print(f"{what + ':':<46}{first is None}")
    if any(first is not None for first in differences.values()):
        explain_mismatch(model, batch, tokenizer, args.seed, reference, differences)
    run.close()
    if args.out is None:
        shutil.rmtree(out.parent)  # the temporary recording; `--out` keeps it


def stock(model, batch, tokenizer, seed: int, **extra):
    """A stock generate() of the same seed and settings, with every output kept (HF's own reference)."""
    torch.manual_seed(seed)
    return model.generate(
        **batch, pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True,
        output_logits=True, output_scores=True, **SAMPLING, **extra,
    )


def compare(run: Recording, sequences: torch.Tensor, reference) -> dict[str, int | None]:
    """Per comparison, the first step that differs (None: bit-identical; -1: the lengths differ)."""

    def first_difference(mine, theirs) -> int | None:
        if len(mine) != len(theirs):
            return -1
        return next((step for step, (a, b) in enumerate(zip(mine, theirs)) if not torch.equal(a, b)), None)

    return {
        "same tokens as stock generate()": None if torch.equal(sequences, reference.sequences) else -1,
        "raw logits bit-identical to out.logits": first_difference(run.logits(), reference.logits),
        "processed scores bit-identical to out.scores": first_difference(run.scores(), reference.scores),
    }


def explain_mismatch(model, batch, tokenizer, seed, reference, differences) -> None:
    """Tell a recording that differs from what generate() computed (exit 1) from a machine whose stock
    generate() does not repeat itself bit for bit (CPU math libraries can split a sum differently from
    one call to the next): run stock generate() again, then record one call that also keeps HF's outputs."""
    for what, first in differences.items():
        if first is not None:
            where = "they differ" if first < 0 else f"first differs at step {first}"
            print(f"{what}: {where}", file=sys.stderr)
    again = stock(model, batch, tokenizer, seed)
    repeats = not any(
        first is not None for first in compare(_Outputs(again), again.sequences, reference).values()
    )
    with Recorder(model) as rec, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeviceAccumulationWarning)  # HF's outputs are kept on purpose here
        within = stock(model, batch, tokenizer, seed, logits_processor=[rec])
    exact = all(first is None for first in compare(rec, within.sequences, within).values())
    print(f"stock generate() repeated itself bit for bit: {repeats}", file=sys.stderr)
    print(f"a recording equals out.logits/out.scores of its own call: {exact}", file=sys.stderr)
    if repeats or not exact:
        raise SystemExit("MISMATCH: the recording differs from Hugging Face's outputs")
    print("this machine's generate() is not bit-reproducible from one call to the next; within one call "
          "the recording is bit-identical to Hugging Face's outputs", file=sys.stderr)


class _Outputs:
    """A stock run's outputs, read like a recording (for `compare`)."""

    def __init__(self, out) -> None:
        self._out = out

    def logits(self):
        return self._out.logits

    def scores(self):
        return self._out.scores


def print_token_table(rec: Recording, tokenizer, row: int) -> None:
    """Per generated token of one row: logprob under the raw logits and the processed scores, entropy."""
    print(f"\nfirst answer, token by token (nats)\n{'step':>4}  {'token':<18}"
          f"{'logprob raw':>12}{'logprob processed':>19}{'entropy raw':>13}")
    for step, (logits, scores, tokens, finished) in enumerate(
        zip(rec.logits(), rec.scores(), rec.tokens(), rec.finished())
    ):
        if finished[row]:
            break
        token = int(tokens[row])
        raw = torch.log_softmax(logits[row].double(), dim=-1)
        processed = torch.log_softmax(scores[row].double(), dim=-1)
        entropy = -(raw.exp() * raw).sum()
        text = repr(tokenizer.decode([token]))[:17]
        print(f"{step:>4}  {text:<18}{raw[token].item():>12.4f}{processed[token].item():>19.4f}{entropy.item():>13.4f}")


if __name__ == "__main__":
    main()
