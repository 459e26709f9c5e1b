"""Handing the C heap's free pages back to the system (glibc's `malloc_trim`), so that a long
recording's resident set follows what is live.

With the C library's default settings, blocks that a writer and a decoding loop free in turn, of sizes
that grow by a key a step (attentions), leave free pages between live ones that glibc keeps: measured
on SmolLM2, 160 steps of every layer's attentions spilled in 4 MiB shards, the heap's free part grew by
35 to 120 MiB (`mallinfo2`) while what was in use grew as stock generate()'s did. `malloc_trim(0)`
returns every whole free page (it walks the heap: 0.2 to 1.3 ms beside the loaded SmolLM2); the
spilling writer calls it once per shard written. Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Callable


def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own C library
    except (OSError, AttributeError):  # a C library without it (musl)
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def release_free_pages() -> None:
    """Return the C heap's whole free pages to the system (glibc); elsewhere, nothing."""
    if _TRIM is not None:
        _TRIM(0)
