"""Where a recording lives: a local directory (a network file system's mount included), named by a path or a
`file://` URL.

A URL of another scheme (`s3://`, `gs://`, `memory://`: fsspec's) is refused, with what to do instead: taken
as a path it would name a local folder (`s3:/bucket/run`), and a user on a cluster node would believe their
recording in the bucket while it sits on a disk that goes with the node. Writing and reading object storage
is issue 55's next step; until it holds the recording's guarantees there (nothing lost on a kill, every
shard checksummed), there is none."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# fsspec's chained URLs (`simplecache::s3://...`) and a URL whose `//` a `Path` collapsed (`s3:/bucket`)
_CHAINED = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*::")
_COLLAPSED = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/[^/]")


def local_directory(value: Any, what: str) -> Path:
    """`value`, a path (`str` or `os.PathLike`) or a `file://` URL naming a local one, as a `Path`.

    Args:
        value: what the user gave.
        what (`str`): how messages name it (`"spill_dir"`, "`--out`").

    Raises:
        TypeError: `value` is neither a string nor a path.
        ValueError: an empty string; a URL of any other scheme (a chained one, `simplecache::s3://...`, or one a
            `Path` collapsed, `s3:/bucket`, with a scheme fsspec knows, included); a `file://` URL naming
            another host.
    """
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{what} must be a path (str or os.PathLike), got {type(value).__name__}.")
    text = os.fspath(value)
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a path given as text, got {type(text).__name__}.")
    if not text:
        raise ValueError(f"{what} is empty: name a directory (`.` for this one).")
    found = _URL.match(text) or _CHAINED.match(text)
    collapsed = _COLLAPSED.match(text)
    if found is None and collapsed is not None and collapsed.group(1).lower() in _known_protocols():
        found = collapsed
    if found is None:
        return Path(text)
    scheme = found.group(0).split(":")[0].lower()
    if scheme == "file" and found.re is _URL:
        parsed = urlparse(text)
        if parsed.netloc.lower() not in ("", "localhost"):
            raise ValueError(f"{what} {text!r} names host {parsed.netloc!r}: a `file://` URL must name this machine "
                             "(`file:///path`); for a network file system, give its mount point.")
        return Path(unquote(parsed.path))
    if scheme == "file" and found.re is _COLLAPSED:  # `file:/path` (RFC 8089's short form)
        return Path(unquote(text[len("file:"):]))
    label = f"{scheme}::" if found.re is _CHAINED else f"{scheme}://"
    raise ValueError(
        f"{what} {text!r} is an object-store URL (`{label}`): recordings are written and read on a local or "
        "mounted file system only (such a URL would otherwise name a local folder, `" + str(Path(text)) + "`). "
        "Record to a local directory, check it with `python -m transformers_offload verify DIR`, then copy it to "
        "the store (for example `fsspec.filesystem(\"" + scheme + "\").put(DIR, URL, recursive=True)`), and copy "
        "it back to read it.")


def _known_protocols() -> set[str]:
    """The URL schemes fsspec knows (`s3`, `gs`, `memory`, `hf`...), or none where it is not installed."""
    try:
        from fsspec.registry import known_implementations
    except ImportError:
        return set()
    return {name.lower() for name in known_implementations}
