"""Peak memory of recording a selection of layers over a long prompt, against stock generate().

    .venv/bin/python bench/layer_peak.py [--prompt-tokens 1000] [--new-tokens 4] [--runs 5] [--out bench/results]
    .venv/bin/python bench/layer_peak.py --case '{"streams": ["attentions"], "layers": [-1]}'   # one case, JSON out

SmolLM2-135M-Instruct (CPU, float32, eager attention), one prompt of `--prompt-tokens` tokens, greedy
for `--new-tokens` steps. Each case runs in a fresh process: the model is loaded and warmed up, the
peak RSS is started over (Linux `VmHWM` via `/proc/self/clear_refs`), then one generate() call; the
figure is the peak's rise over the loaded model ("growth"), in a process with the C library's default
allocator settings (no `MALLOC_*` variables, as users run it), each case `--runs` times, interleaved,
reported as median, min and max (`_common.fresh_runs`, `print_peaks`). Cases: stock generate (the baseline),
generate with `output_attentions=True` (what asking the forward for every layer costs), and the
Recorder (in memory) with a selection. "over stock" is a case's growth minus the baseline's of the same round; the
last layer's prefill attention weights are `heads x P x P x 4` bytes (36 MB for P = 1,000).
Writes `layer_peak.json` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

CASES = {
    "stock generate": {"recorder": False},
    "generate, output_attentions=True": {"recorder": False, "output_attentions": True},
    "Recorder: attentions, layers=[-1], newest_position_only": {
        "streams": ["attentions"], "layers": [-1], "newest_position_only": True,
    },
    "Recorder: attentions, layers=[-1]": {"streams": ["attentions"], "layers": [-1]},
    "Recorder: attentions, layers=[-1], heads=[0]": {"streams": ["attentions"], "layers": [-1], "heads": [0]},
    "Recorder: hidden_states, layers=[-1]": {"streams": ["hidden_states"], "layers": [-1]},
    "Recorder: attentions, every layer, newest_position_only": {"streams": ["attentions"], "newest_position_only": True},
}


def run_case(case: dict, prompt_tokens: int, new_tokens: int) -> dict:
    """One case in this process (call it in a fresh one)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from _common import high_water_mib, reset_high_water

    from transformers_offload import Recorder
    from transformers_offload.demo_model import load

    model, tokenizer = load(attn_implementation="eager")
    text = " ".join(["The lighthouse keeper wrote down the weather every hour of the night."] * (prompt_tokens // 12 + 2))
    input_ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :prompt_tokens]
    common = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), pad_token_id=tokenizer.pad_token_id,
                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    model.generate(**{**common, "input_ids": input_ids[:, :16], "attention_mask": common["attention_mask"][:, :16]},
                   max_length=20)  # warm-up, short
    options = {key: case[key] for key in ("streams", "layers", "heads", "newest_position_only") if key in case}
    recorder = Recorder(model, **options) if case.get("recorder", True) else None
    reset_high_water()
    loaded = high_water_mib()
    if recorder is None:
        extra = {"return_dict_in_generate": True, "output_attentions": True} if case.get("output_attentions") else {}
        out = model.generate(**common, **extra)
        del out
    else:
        model.generate(**common, logits_processor=[recorder])
        recorder.close()
    return {"case": case, "prompt_tokens": int(input_ids.shape[1]), "new_tokens": new_tokens,
            "loaded_mib": round(loaded, 1), "growth_mib": round(high_water_mib() - loaded, 1)}


def measure(case: dict, prompt_tokens: int, new_tokens: int, runs: int = 1) -> list[dict]:
    """`run_case` `runs` times, each in a fresh process (a peak never goes down) with default allocator
    settings: one result per run."""
    from _common import fresh_runs

    arguments = ["--case", json.dumps(case), "--prompt-tokens", str(prompt_tokens), "--new-tokens", str(new_tokens)]
    return fresh_runs(__file__, {"case": arguments}, runs, timeout=900, show=False)["case"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5, help="each case this many times, interleaved")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES),
                        help="only these cases (stock generate always runs: the baseline)")
    parser.add_argument("--case", help="run one case (a JSON object of Recorder options) and print its JSON")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(json.loads(args.case), args.prompt_tokens, args.new_tokens)))
        return
    from _common import RESULTS, fresh_runs, machine, print_peaks, write_json

    options = ["--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)]
    names = ["stock generate", *(name for name in args.cases if name != "stock generate")]
    found = fresh_runs(__file__, {name: ["--case", json.dumps(CASES[name]), *options] for name in names},
                       args.runs, timeout=900)
    layer_mib = 9 * args.prompt_tokens**2 * 4 / 2**20
    print(f"prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens; the last layer's prefill weights: "
          f"{layer_mib:.1f} MiB; {args.runs} runs, each case in a fresh default process")
    summary = print_peaks(found, key="growth_mib", base="stock generate", label="peak growth")
    write_json((args.out or RESULTS) / "layer_peak.json",
               {"machine": machine(), "layer_prefill_mib": layer_mib, "runs": args.runs, "allocator_env": "default",
                "summary": summary, "each": found})

if __name__ == "__main__":
    main()
