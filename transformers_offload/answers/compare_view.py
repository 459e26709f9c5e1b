"""The compare page: one self-contained HTML file (no network) of a `Comparison` (`answers.compare`).

Each compared row's tokens are coloured by KL(a||b) or KL(b||a) (nats, on a log scale); clicking a
token shows both distributions' five most likely tokens side by side, with the chosen token's
probability change and rank under `b`; the summary heads the page in llama.cpp's layout. The page
holds at most `max_rows` rows of each compared generation and `max_steps` steps of each, so its size
is bounded whatever the comparison's length. `write_html(comparison, path)` writes it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

_TEMPLATE = Path(__file__).with_name("compare_view.html")


def page_data(comparison: Any, *, max_rows: int = 16, max_steps: int = 512, tokenizer: Any = None) -> dict[str, Any]:
    """What the page shows, as plain JSON-ready data (see `render`)."""
    for name, value in (("max_rows", max_rows), ("max_steps", max_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be an int of at least 1, got {value!r}.")
    from ..demo_model import load_tokenizer  # here: `python -m transformers_offload.demo_model` imports the package first

    tokenizer = load_tokenizer(tokenizer)  # a tokenizer, a directory or the demo model's name

    def text(token: int) -> str:
        return "" if token < 0 else tokenizer.decode([token]) if tokenizer is not None else f"#{token}"

    c = comparison.columns
    generations = []
    for index_a, index_b in comparison.pairs:
        mine = c["generation"] == index_a if len(comparison) else np.zeros(0, dtype=bool)
        rows = sorted(set(c["row"][mine].tolist()))
        entry = {"a": index_a, "b": index_b, "rows": [], "hidden_rows": max(0, len(rows) - max_rows)}
        for row in rows[:max_rows]:
            picked = np.nonzero(mine & (c["row"] == row) & (c["step"] < max_steps))[0]
            picked = picked[np.argsort(c["step"][picked], kind="stable")]
            tokens = []
            for i in picked.tolist():
                y = int(c["token"][i])
                known = bool(c["chosen_known"][i])
                sides = [[[int(t), text(int(t)), _finite(v)] for t, v in zip(c[f"top_ids_{s}"][i].tolist(),
                                                                              c[f"top_logprobs_{s}"][i].tolist()) if t >= 0]
                         for s in ("a", "b")]
                tokens.append([int(c["step"][i]), y, text(y), _finite(c["kl_ab"][i]), _finite(c["kl_ba"][i]),
                               _finite(c["prob_change"][i]) if known else None, bool(c["same_top1"][i]),
                               int(c["rank_b"][i]) if known else None, sides,
                               _finite(c["logprob_a"][i]) if known else None, _finite(c["logprob_b"][i]) if known else None])
            entry["rows"].append({"row": row, "sample": _plain(c["sample"][picked[0]]) if len(picked) else None,
                                  "tokens": tokens})
        generations.append(entry)
    return {"summary": comparison.summary_text(), "estimate": comparison.estimate, "generations": generations,
            "max_steps": max_steps}


def _finite(value: Any) -> Any:
    value = float(value)
    return value if math.isfinite(value) else None  # JSON has no NaN or infinities


def _plain(value: Any) -> Any:
    value = value.item() if hasattr(value, "item") else value
    return value if isinstance(value, (int, str)) else str(value)


def render(comparison: Any, **options: Any) -> str:
    """The compare page as one HTML document (no external resource).

    Args:
        comparison (`Comparison`): what `compare(a, b)` returned.
        max_rows (`int`, defaults to 16), max_steps (`int`, defaults to 512): the most rows per compared
            generation and steps per row the page holds.
        tokenizer: a Hugging Face tokenizer, a local tokenizer directory or the demo model's name
            (`smollm2`), to show text (else token ids, `#1234`).

    Raises:
        ValueError: a bad `max_rows` or `max_steps`, or a `tokenizer` name that is neither a directory nor
            the demo model's. TypeError: a `tokenizer` that is neither a tokenizer (with `decode`) nor a name.
    """
    data = page_data(comparison, **options)
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    return _TEMPLATE.read_text(encoding="utf-8").replace("/*DATA*/null", payload)
