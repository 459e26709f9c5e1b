"""The support table (docs/support.md) (transformers releases x decoding modes), generated from test results.

    .venv/bin/python scripts/support_table.py           # rewrite the table in docs/support.md
    .venv/bin/python scripts/support_table.py --check   # exit 1 if docs/support.md disagrees with the results

Reads the JUnit XML files that scripts/test.sh and scripts/matrix.sh write to .matrix/results/ (one
per transformers release). A cell is "exact" when every test of that mode passed on that release
(recording equal to Hugging Face's tensors), "refused" when the refusal test passed (the call raises
before generation with a message naming the mode, or a passing test said so with the JUnit property
`outcome`), "absent" when every test was skipped because
the release has no such option, and "FAIL" when any failed. "—" means no test of that mode ran
there (the real-model tests run on the newest release only).
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / ".matrix" / "results"
README = ROOT / "docs" / "support.md"
START, END = "<!-- support-table:start -->", "<!-- support-table:end -->"

EXACT = "test_recording_equals_hugging_face["
REFUSED = "test_unsupported_modes_fail_before_generation["
# (row label, what a passing row says, pattern over "file::test[params]")
ROWS = [
    ("greedy", "exact", re.escape(EXACT) + r"\w+-greedy"),
    ("sampling, all processors and warpers", "exact", re.escape(EXACT) + r"\w+-(sample_|num_return)"),
    ("beam search", "exact", re.escape(EXACT) + r"\w+-beam_(search|return|penalties|rows)"),
    ("beam sampling", "exact", re.escape(EXACT) + r"\w+-beam_sample-"),
    ("encoder-decoder (T5, BART)", "exact", r"test_encoder_decoder_models"),
    ("static cache", "exact", r"test_static_cache"),
    ("max_new_tokens=1", "exact", r"test_one_new_token"),
    ("stop_strings", "exact", r"test_stop_strings"),
    # Beam sampling has its own row (refused before 4.35); spilling is the same wherever a mode is recorded.
    ("spill to shards, open_recording", "exact", re.escape(EXACT) + r"\w+-(?!beam_sample-)\w+-(spill|open_recording)\]"),
    ("assisted decoding", "exact", r"test_assisted_recording_equals_hugging_face\[(memory-|spill-)?assistant_model"),
    ("prompt lookup", "exact", r"test_assisted_recording_equals_hugging_face\[(memory-|spill-)?prompt_lookup"),
    ("contrastive search", "exact", r"test_contrastive_search_and_dola\[(memory-|spill-)?contrastive"),
    ("group beam search", "exact", r"test_group_beam_search\["),
    ("constrained beam search", "refused", re.escape(REFUSED) + r".*constrained_beam_search"),
    ("DoLa", "exact", r"test_contrastive_search_and_dola\[(memory-|spill-)?dola"),
    ("low_memory beam search", "exact", r"test_low_memory_beam_search"),
    ("attentions, hidden states", "exact", r"test_decoder_only_attentions_and_hidden_states_equal_hugging_face"),
    ("encoder-decoder attentions, hidden states", "exact", r"test_encoder_decoder_outputs_equal_hugging_face"),
    ("per-token stats, in every mode recorded exactly", "exact", r"test_stats_(equal_their|in_every_other_mode)"),
    ("sparse encoding (lossless), in every mode recorded exactly", "exact", r"test_sparse_(equals_hugging|in_every_other_mode)"),
    ("top-k encoding (`topk:K`), in every mode recorded exactly", "exact", r"test_topk_(equals_its|in_every_other_mode)"),
    ("native encoding (lossless; bfloat16/float16 models), in every mode recorded exactly", "exact",
     r"test_native_(equals_hugging_face|in_every_other_mode)"),
    ("scores stored once with the logits (no processor)", "exact", r"test_scores_equal_to_the_logits_are_stored_once"),
    ("layers taken from module hooks: Llama", "module hooks", r"test_selected_layers_come_from_their_modules\w*\[llama"),
    ("layers taken from module hooks: GPT-2", "module hooks", r"test_selected_layers_come_from_their_modules\w*\[gpt2"),
]


def outcomes(path: Path) -> dict[str, str]:
    """Per test id ("file::name[params]"), "passed", "failed", "skipped", or for a passed test that
    recorded the JUnit property `outcome` (`record_property("outcome", "refused")`), its value."""
    results = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")[-1]
        outcome = "passed"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            for prop in case.iter("property"):
                if prop.get("name") == "outcome":
                    outcome = prop.get("value", outcome)
        results[f"{module}::{case.get('name')}"] = outcome
    return results


def cell(results: dict[str, str], good: str, pattern: str) -> str:
    found = [outcome for test, outcome in results.items() if re.search(pattern, test)]
    if not found:
        return "—"
    if "failed" in found:
        return "FAIL"
    if all(outcome == "skipped" for outcome in found):
        return "absent"
    told = {outcome for outcome in found if outcome not in ("passed", "skipped")}
    return told.pop() if len(told) == 1 else good


def table() -> str:
    files = sorted(RESULTS.glob("*.xml"), key=lambda path: Version(path.stem))
    if not files:
        raise SystemExit(f"no results in {RESULTS}: run scripts/test.sh and scripts/matrix.sh first")
    columns = [(path.stem, outcomes(path)) for path in files]
    lines = [
        "| mode | " + " | ".join(release for release, _ in columns) + " |",
        "| --- | " + " | ".join(":---:" for _ in columns) + " |",
    ]
    for label, good, pattern in ROWS:
        lines.append(f"| {label} | " + " | ".join(cell(results, good, pattern) for _, results in columns) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if docs/support.md's table differs")
    arguments = parser.parse_args()
    readme = README.read_text(encoding="utf-8")
    if START not in readme or END not in readme:
        raise SystemExit(f"docs/support.md has no {START} ... {END} block")
    before, rest = readme.split(START, 1)
    _, after = rest.split(END, 1)
    updated = f"{before}{START}\n{table()}\n{END}{after}"
    if arguments.check:
        if updated != readme:
            print("docs/support.md's support table disagrees with .matrix/results: run scripts/support_table.py", file=sys.stderr)
            return 1
        print("docs/support.md's support table agrees with the results")
        return 0
    README.write_text(updated, encoding="utf-8")
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
