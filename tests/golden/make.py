"""Rewrite the golden recordings (tests/golden/tiny-recording, tiny-layers-recording,
tiny-stats-recording, tiny-packed-topk-recording, tiny-sampled-recording, tiny-sparse-recording, tiny-native-recording) after
a deliberate format change. Decide first whether a
reader of the current FORMAT_VERSION would misread the new layout: if so, bump FORMAT_VERSION; if it
reads it right (a key it ignores, like the `files` checksums, or a stream it need not know, like
`stats`) or refuses it by name (an encoding it does not know, like `topk:K` or `sparse`), the version stays.
Either way docs/format.md says what changed.

tests/golden/tiny-recording-before-checksums is a frozen copy from before checksums (what older
recordings look like), and tests/golden/tiny-topk-recording one of a `topk:K` stream from before the packed
records (float64 `(rows, 2K + 2)` per step): never rewritten.

Usage: python -m tests.golden.make
"""

import shutil
from pathlib import Path

from tests.helpers import write_made_up_recording

if __name__ == "__main__":
    for name, options in (
        ("tiny-recording", {}),
        ("tiny-layers-recording", {"layers": True}),
        ("tiny-stats-recording", {"stats": True}),
        ("tiny-packed-topk-recording", {"topk": True}),
        ("tiny-sampled-recording", {"sampled": True}),
        ("tiny-sparse-recording", {"sparse": True}),
        ("tiny-native-recording", {"native": True}),
    ):
        target = Path(__file__).resolve().parent / name
        shutil.rmtree(target, ignore_errors=True)
        write_made_up_recording(target, steps=3, rows=2, vocab=4, shard_bytes=164, **options)
        print(f"wrote {target}: {sorted(p.name for p in target.iterdir())}")
