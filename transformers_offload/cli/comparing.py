"""`compare`: two recordings of the same tokens, token by token (KL divergences, probability change, top-1
agreement), summarised as llama.cpp's perplexity tool prints its KL-divergence statistics."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import CompareError, RecordingError
from . import options

JSON_INDENT = 2
ERRORS = {"compare": (((RecordingError,), 1), ((CompareError, ValueError, TypeError, LookupError, OSError), 2))}


def add(commands: Any) -> None:
    compare = commands.add_parser(
        "compare", parents=[options.parent("json")],
        help="compare two recordings of the same tokens: KL divergences, probability change, top-1 agreement",
        description="Token by token, in float64: KL(A||B) and KL(B||A) in nats, the chosen token's probability "
        "change, top-1 and top-k agreement, the largest logit difference and the chosen token's rank under B; "
        "the summary as llama.cpp's perplexity tool prints its KL-divergence statistics (docs/compare.md). "
        "Exit status: 0 compared; 1 a recording is missing or damaged; 2 the two do not line up, or a bad option.",
        epilog="example:\n  python -m transformers_offload rescore runs/france --model ./smollm2 --out runs/france-bf16 "
        "--dtype bfloat16\n  python -m transformers_offload compare runs/france runs/france-bf16 --html report.html",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    compare.add_argument("a", help="the reference recording directory")
    compare.add_argument("b", nargs="+", help="the recording to compare with it (e.g. its rescore); several: each is "
                         "compared with A, and a table gives one line per candidate after their summaries")
    compare.add_argument("--stream", choices=("logits", "scores"), default="logits",
                         help="compare the raw logits or the processed scores (logits)")
    compare.add_argument("--chunk-steps", type=int, default=16, help="steps read at once (16)")
    compare.add_argument("--html", help="also write the compare page (one self-contained HTML file) here")
    compare.add_argument("--tokenizer", help="a local tokenizer directory or the demo model's name (smollm2), to show "
                         "each token's text on the page")


def run(arguments: argparse.Namespace, command_line: str) -> tuple[Any, str]:
    """Compare, write the page where asked: (the summary and per-sample results, the summary's text); with
    several candidates, each one's, then the table of them all."""
    from ..answers.compare import compare
    from ..answers.comparison import candidates_table

    if len(arguments.b) > 1 and arguments.html:
        raise ValueError("`--html` writes the page of one comparison: compare one candidate at a time for a page "
                         f"(`compare {arguments.a} {arguments.b[0]} --html report.html`).")
    if arguments.html:  # never inside a recording it reads, whose files it could replace (as `view -o`)
        from types import SimpleNamespace

        from ..answers.table import output_path

        for recording in (arguments.a, *arguments.b):
            output_path(SimpleNamespace(path=recording), arguments.html, "page")
    results = []
    for candidate in arguments.b:  # every candidate compared before anything is written
        results.append(compare(arguments.a, candidate, stream=arguments.stream, chunk_steps=arguments.chunk_steps))
    if arguments.html:
        from ..answers.viewer import write_html

        write_html(results[0], arguments.html, tokenizer=options.tokenizer(arguments.tokenizer))
    if len(results) == 1:
        wrote = {"wrote": arguments.html} if arguments.html else {}
        text = results[0].summary_text() + (f"\nwrote {arguments.html}" if arguments.html else "")
        return {**results[0].summary(), "samples": results[0].samples(), **wrote}, text
    summaries = [{"candidate": candidate, **result.summary(), "samples": result.samples()}
                 for candidate, result in zip(arguments.b, results)]
    texts = [f"=== {candidate} against {arguments.a} ===\n{result.summary_text()}"
             for candidate, result in zip(arguments.b, results)]
    return {"reference": arguments.a, "candidates": summaries}, "\n\n".join([*texts, candidates_table(summaries)])
