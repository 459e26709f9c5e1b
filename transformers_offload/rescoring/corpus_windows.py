"""What `score` keeps beside each window it scores (the window's sample metadata), written and recognised in one
place: `score` writes it, `inspect` reads a generation of `score`'s windows as one (without torch, as every
reading command runs).

Each window's metadata: `context` (tokens per window), `bos` (the BOS id placed first and as each window's
first id, or None), `ids_sha256` (of every window's ids: a resume must cut the same ones), `window` (its number)
and `first_token` (its first id's position in the corpus's ids)."""

from __future__ import annotations

from typing import Any, Sequence

WINDOW_KEYS = ("context", "bos", "ids_sha256", "window", "first_token")
SMALLEST_CONTEXT = 4  # tokens per window at least: `score_run` refuses fewer, the command line reads no fewer


def window_metadata(corpus: dict[str, Any], window: int) -> dict[str, Any]:
    """Window `window`'s metadata, from the corpus's `context`, `bos` and `ids_sha256`."""
    return {**corpus, "window": window, "first_token": window * corpus["context"]}


def scored_windows(sample_metadata: Sequence[Any] | None) -> dict[str, Any] | None:
    """For a generation whose every sample is one of `score`'s windows (its metadata has exactly `WINDOW_KEYS`, of one
    corpus): `{"context", "bos", "windows"}`, the windows by number; else None."""
    if not sample_metadata or not all(isinstance(m, dict) and sorted(m) == sorted(WINDOW_KEYS) for m in sample_metadata):
        return None
    if len({(m["context"], m["bos"], m["ids_sha256"]) for m in sample_metadata}) != 1:
        return None
    first = sample_metadata[0]
    return {"context": first["context"], "bos": first["bos"], "windows": [m["window"] for m in sample_metadata]}
