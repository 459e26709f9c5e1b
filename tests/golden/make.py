"""Rewrite tests/golden/tiny-recording after a deliberate format change (bump FORMAT_VERSION first).

Usage: python -m tests.golden.make
"""

import shutil
from pathlib import Path

from tests.helpers import write_made_up_recording

if __name__ == "__main__":
    target = Path(__file__).resolve().parent / "tiny-recording"
    shutil.rmtree(target, ignore_errors=True)
    write_made_up_recording(target, steps=3, rows=2, vocab=4, shard_bytes=164)
    print(f"wrote {target}: {sorted(p.name for p in target.iterdir())}")
