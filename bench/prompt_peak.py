"""Prompt logprobs' peak memory against a full forward's logits, one case per fresh process, CPU.

    .venv/bin/python bench/prompt_peak.py --case stock prompt_logprobs --tokens 8192 --vocab 152064 \
                                          --runs 5 [--top 0] [--chunk N] [--no-check]
    .venv/bin/python bench/prompt_peak.py --case {stock,prompt_logprobs,full_forward} --tokens 2048
                                          [--model smollm2 | --vocab 32000] [--top 0] [--chunk N]

`stock`: `generate(max_new_tokens=1)` on a `--tokens`-token prompt, no recorder (the baseline);
`prompt_logprobs`: the same call with `Recorder(model, streams=("scores",), prompt_logprobs=--top,
prompt_chunk=--chunk)`; `full_forward`: what a hand-written scorer does, `log_softmax(model(ids).logits)`
gathered at the prompt's next tokens. The model is SmolLM2-135M-Instruct (float32, 49,152 tokens) or,
with `--vocab`, a one-layer Llama of that vocabulary (hidden size 64) built from a config. Peak RSS is
Linux `VmHWM` after loading the model and one warm-up call (`_common.reset_high_water`). With `prompt_logprobs`
it also compares the recorded logprobs with the full forward's (`max_abs_difference`, `equal`), unless
`--no-check` (the full forward holds the whole logits: 4.6 GiB at 8,192 x 152,064, 10 GiB at its peak).

With `--runs N`, each case runs N times, interleaved, each in a fresh process with the C library's
default allocator settings (`_common.default_env`: no `MALLOC_*` variables), as users run it; it prints
a table of each case's growth and its excess over stock (median, min, max over the runs) and writes
`results/prompt_peak.json`. Without it, one case runs in this process and prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _common import Stopwatch, high_water_mib, reset_high_water  # noqa: E402

from transformers_offload import Recorder  # noqa: E402


def build(model_name: str, vocab: int | None) -> torch.nn.Module:
    if vocab is None:
        from transformers_offload.demo_model import load

        return load()[0]
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16384,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def full_forward(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits.float(), -1)
        return logprobs[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]


def measure(case: str, tokens: int, *, vocab: int | None = None, top: int = 0, chunk: int | None = None,
            check: bool = True) -> dict:
    model = build("smollm2", vocab)
    size = model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, size, (1, tokens), generator=generator)
    common = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)
    model.generate(ids[:, :16], **common)  # warm-up
    reset_high_water()
    loaded = high_water_mib()
    clock = Stopwatch()
    result: dict = {"case": case, "tokens": tokens, "vocab": size, "top": top, "chunk": chunk}
    if case == "stock":
        model.generate(ids, **common)
    elif case == "full_forward":
        full_forward(model, ids)
    else:
        with Recorder(model, streams=("scores",), prompt_logprobs=top or True, prompt_chunk=chunk) as rec:
            model.generate(ids, logits_processor=[rec], **common)
        result["wall_s"] = round(clock.elapsed(), 3)  # the check below is not timed
        recorded = rec.generation().prompt_tensors()["prompt_logprobs"][0]
        result["peak_mib_before_check"] = high_water_mib() - loaded
        if not check:
            return _finish(result, tokens, size, loaded)
        reference = full_forward(model, ids)
        result["max_abs_difference"] = float((recorded - reference).abs().max())
        result["equal"] = bool(torch.equal(recorded, reference))
    result.setdefault("wall_s", round(clock.elapsed(), 3))
    return _finish(result, tokens, size, loaded)


def _finish(result: dict, tokens: int, size: int, loaded: float) -> dict:
    result["growth_mib"] = round(result.pop("peak_mib_before_check", high_water_mib() - loaded), 1)
    result["full_logits_mib"] = round(tokens * size * 4 / 2**20, 1)
    return result


def runs(cases: list[str], count: int, options: list[str]) -> dict:
    """Each case `count` times, interleaved, each in a fresh process with default allocator settings."""
    from _common import RESULTS, fresh_runs, machine, print_peaks, write_json

    found = fresh_runs(__file__, {case: ["--case", case, *options] for case in cases}, count)
    summary = print_peaks(found, key="growth_mib", base="stock")
    for entry in summary.values():  # the keys this file's results have always had
        if "over_stock" in entry:
            entry["over_stock_mib"] = entry.pop("over_stock")
    record = {"machine": machine(), "runs": count, "options": options, "allocator_env": "default",
              "summary": summary, "each": found}
    write_json(RESULTS / "prompt_peak.json", record)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=("stock", "prompt_logprobs", "full_forward"), nargs="+", required=True)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, help="a one-layer Llama of this vocabulary instead of SmolLM2")
    parser.add_argument("--top", type=int, default=0)
    parser.add_argument("--chunk", type=int)
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip the comparison with a full forward (which holds the whole logits)")
    parser.add_argument("--runs", type=int, help="each case this many times, each in a fresh default process")
    args = parser.parse_args()
    if args.runs:
        options = ["--tokens", str(args.tokens), "--top", str(args.top)]
        options += [*(["--vocab", str(args.vocab)] if args.vocab else []), *(["--chunk", str(args.chunk)] if args.chunk else []),
                    *([] if args.check else ["--no-check"])]
        runs(args.case, args.runs, options)
        return
    if len(args.case) != 1:
        parser.error("one `--case` at a time in this process; several need `--runs`")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(json.dumps(measure(args.case[0], args.tokens, vocab=args.vocab, top=args.top, chunk=args.chunk,
                             check=args.check)))


if __name__ == "__main__":
    main()
