"""The viewer: one self-contained HTML page (no network, no CDN) of a recording's returned sequences.

Each returned sequence's tokens are coloured by their logprob or rank bucket (raw logits or processed
scores, chosen on the page); clicking a token (or hovering it) shows its top alternatives under the raw
logits and the processed scores side by side; a line per sequence draws the chosen token's logprob and
the entropy per step; a beam search also gets the tree of its kept beams, with each returned sequence's
path through it.

The page holds at most `max_sequences` sequences of each selected generation and `max_steps` steps of
each, with `top` alternatives per token, so its size is bounded whatever the recording's length. The
values are the per-token table's (`answers.table`, `read.logprobs`), read a chunk of steps at a time.
"""

from __future__ import annotations

import html
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from ..read import display
from ..read.logprobs import token_chunks
from ..read.samples import sample_ids
from ..store.files import write_atomically

_TEMPLATE = Path(__file__).with_name("viewer.html")
MAX_TOP = 20


def page_data(source: Any, *, generations: Sequence[int] | None = None, sequences: Sequence[int] | None = None,
              max_sequences: int = 16, max_steps: int = 512, top: int = 5, tokenizer: Any = None) -> dict[str, Any]:
    """What the page shows, as plain JSON-ready data (see `render`)."""
    from .table import select_generations

    every, picked = select_generations(source, generations)
    if sequences is not None and (isinstance(sequences, (str, bytes)) or not all(
            isinstance(j, int) and not isinstance(j, bool) for j in sequences)):
        raise TypeError(f"`sequences` must list rows of `out.sequences` (ints), got {sequences!r}.")
    for name, value, minimum in (("max_sequences", max_sequences, 1), ("max_steps", max_steps, 1), ("top", top, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"`{name}` must be an int of at least {minimum}, got {value!r}.")
    if top > MAX_TOP:
        raise ValueError(f"the viewer shows at most {MAX_TOP} alternatives per token (a page of bounded size), got `top` {top}.")
    from ..demo_model import load_tokenizer  # here: `python -m transformers_offload.demo_model` imports the package first

    tokenizer = load_tokenizer(tokenizer)  # a tokenizer, a directory or the demo model's name
    ids = dict(zip(map(id, every), sample_ids(every)))  # a lone Generation numbers its own prompts

    def text(token: int) -> str:
        return tokenizer.decode([token]) if tokenizer is not None else f"#{token}"

    shown = []
    for generation in picked:
        entry: dict[str, Any] = {"index": generation.index, "mode": generation.mode, "complete": generation.complete,
                                 "num_steps": generation.num_steps, "sequences": [], "tree": None}
        shown.append(entry)
        if not generation.complete:
            entry["error"] = generation.error
        if not generation.has_sequences and generation.is_beam:
            continue  # an incomplete beam search: no returned sequences to follow
        total = int(generation.sequences_array().shape[0]) if generation.has_sequences else generation.num_rows
        wanted = list(range(total)) if sequences is None else [s for s in sequences if 0 <= s < total]
        wanted = wanted[:max_sequences]
        entry["hidden_sequences"] = total - len(wanted)
        per_prompt = generation.num_return_sequences
        tokens: dict[int, list[Any]] = {s: [] for s in wanted}
        for chunk in token_chunks(generation, top=top, chunk_steps=16, strict=False, sequences=wanted,
                                  max_steps=max_steps):
            columns = {name: (None if value is None else value.tolist()) for name, value in chunk.items()}
            for i, (j, t) in enumerate(zip(columns["sequence"], columns["step"])):
                y = columns["token"][i]
                item = [t, y, text(y)]
                for kind in ("raw", "processed"):
                    item += [_number(columns, f"logprob_{kind}", i), _number(columns, f"rank_{kind}", i),
                             _number(columns, f"entropy_{kind}", i)]
                alternatives = []
                for kind in ("raw", "processed"):
                    ids_k, values_k = columns.get(f"top_tokens_{kind}"), columns.get(f"top_logprobs_{kind}")
                    alternatives.append([] if ids_k is None else
                                        [[a, text(a), _finite(v)] for a, v in zip(ids_k[i], values_k[i])])
                item.append(alternatives)
                tokens[j].append(item)
        for j in wanted:
            prompt = j // per_prompt
            entry["sequences"].append({
                "sequence": j, "prompt": prompt, "sample": _jsonable_id(ids[id(generation)][prompt]),
                "metadata": None if generation.sample_metadata is None else generation.sample_metadata[prompt],
                "tokens": sorted(tokens[j], key=lambda item: item[0]),
            })
        if generation.is_beam and generation.has_sequences:
            entry["tree"] = _beam_tree(generation, wanted, max_steps, text)
    return {"generations": shown, "top": top, "max_steps": max_steps}


def _number(columns: dict[str, Any], name: str, i: int) -> Any:
    values = columns.get(name)
    return None if values is None else _finite(values[i])


def _finite(value: Any) -> Any:
    """JSON has no infinities: -inf (a token the processors removed) becomes None."""
    return value if not isinstance(value, float) or math.isfinite(value) else None


def _jsonable_id(value: Any) -> Any:
    return value if isinstance(value, (int, str)) else str(value)


def _beam_tree(generation: Any, wanted: list[int], max_steps: int, text: Any) -> dict[str, Any]:
    """The kept beams per step (`beam_parents`, `tokens`) and each shown sequence's rows (`beam_indices`)."""
    steps = range(min(generation.num_steps, max_steps))
    parents = [p.tolist() for p in generation.beam_parents(steps=steps, framework="np")]
    tokens = [y.tolist() for y in generation.tokens(steps=steps, framework="np")]
    indices = generation.beam_indices(framework="np")
    return {
        "num_beams": generation.num_beams,
        "num_rows": generation.num_rows,
        "steps": [[[p, y, text(y) if y >= 0 else ""] for p, y in zip(ps, ys)] for ps, ys in zip(parents, tokens)],
        "paths": {str(j): [r for r in indices[j, : len(steps)].tolist()] for j in wanted},
    }


def render(source: Any, **options: Any) -> str:
    """The viewer's page, as one HTML document (no external resource).

    Args:
        source: a `Recorder`, a `Recording` or one `Generation`.
        generations (`Sequence[int]`, *optional*): the generations to show (default all).
        sequences (`Sequence[int]`, *optional*): rows of `out.sequences` to show (default all, up to
            `max_sequences`).
        max_sequences (`int`, defaults to 16), max_steps (`int`, defaults to 512): the most sequences per
            generation and steps per sequence the page holds.
        top (`int`, defaults to 5): alternatives shown per token, under each kind.
        tokenizer: a Hugging Face tokenizer, a local tokenizer directory or the demo model's name
            (`smollm2`), to show text (else token ids, `#1234`).

    Raises:
        TypeError, ValueError: as `answers.table.record_batches`, or a bad `max_*`/`top`.
    """
    data = page_data(source, **options)
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    return _TEMPLATE.read_text(encoding="utf-8").replace("/*DATA*/null", payload)


def fragment(source: Any, **options: Any) -> str:
    """The page for a notebook cell (`_repr_html_`): the same document, in a sandboxed `iframe`."""
    document = render(source, **options)
    return (f'<iframe srcdoc="{html.escape(document, quote=True)}" sandbox="allow-scripts" '
            'style="width:100%;height:560px;border:1px solid #ccc"></iframe>')


def write_html(source: Any, path: str | os.PathLike, **options: Any) -> dict[str, int]:
    """Write the viewer's page to `path` (whole or not at all: written beside it, then renamed); for a
    `Comparison` (`compare(a, b)`), the compare page (`answers.compare_view`: tokens coloured by KL, a
    click shows both distributions' alternatives side by side; options `max_rows`, `max_steps`,
    `tokenizer`).

    Returns:
        `dict`: `bytes` (the page's size).
    """
    from .table import output_path

    target = output_path(source, path, "page")
    # A `Comparison` exists only once its module is imported (which imports torch): not imported here.
    comparison = sys.modules.get(f"{__package__}.comparison")
    if comparison is not None and isinstance(source, comparison.Comparison):
        from .compare_view import render as render_comparison

        document = render_comparison(source, **options)
    else:
        document = render(source, **options)
    return {"bytes": write_atomically(target, lambda temporary: temporary.write_text(document, encoding="utf-8"))["bytes"]}


display.register(fragment)
