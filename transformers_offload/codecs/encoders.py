"""The encoder that writes each stream recorded in an encoding other than dense, from its name."""

from __future__ import annotations

from typing import Any, Mapping

from . import packed as _packed
from .native import Native
from .sparse import Sparse
from .spec import NATIVE, SPARSE


def encoders(encodings: Mapping[str, str], *, model_dtype: Any, generators: dict, seed: int) -> dict[str, Any]:
    """Per stream of `encodings` (stream name -> encoding name, as `spec.check` accepts), its encoder:
    `sparse.Sparse`, `native.Native` (for a model of `model_dtype`), or a top-k or sampled encoder
    (`packed.encoder`; `generators`, per device, and `seed` draw the `"sample:N@T"` tokens). Streams
    in `"sparse"` share one `Sparse`, and in `"native"` one `Native` (their working buffers)."""
    sparse, native = Sparse(), Native(model_dtype)
    found = {}
    for name, encoding in encodings.items():
        if encoding == SPARSE:
            found[name] = sparse
        elif encoding == NATIVE:
            found[name] = native
        else:
            found[name] = _packed.encoder(encoding, model_dtype=model_dtype, generators=generators, seed=seed)
    return found
