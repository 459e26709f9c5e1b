"""The `stats` stream's record: one row of nine per-token statistics per returned row and step, and its
columns as a reader sees them."""

from __future__ import annotations

from typing import Any

from .dtypes import cast

# Per-token statistics (`streams=("stats",)`): one `(rows, 9)` record per step, float32, or float64 where an
# integer column may reach 2**24 (a larger vocabulary); a reader takes either.
STATS_STREAM = "stats"
STATS_COLUMNS = (
    "token",
    "logprob_raw",
    "logprob_processed",
    "rank_raw",
    "rank_processed",
    "entropy_raw",
    "entropy_processed",
    "logsumexp_raw",
    "support_processed",
)


STATS_INTEGER_COLUMNS = ("token", "rank_raw", "rank_processed", "support_processed")


def stats_columns(record: Any) -> dict[str, Any]:
    """A stored `(rows, 9)` float32 or float64 stats record (a tensor, or a NumPy array: the same values)
    as `(rows,)` columns of its kind, int64 or float32: exact, since the recorder writes float32 only where
    every integer column is below 2**24."""
    return {
        name: cast(record[..., i], "int64" if name in STATS_INTEGER_COLUMNS else "float32")
        for i, name in enumerate(STATS_COLUMNS)
    }
