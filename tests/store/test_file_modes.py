"""Files others can read: every file and directory the project writes (a spilled recording's shards and
manifest, `export`'s Parquet file, `view`'s page) gets the mode any file the user creates gets, 0666 /
0777 less the process's umask, though each file is written aside and renamed into place.

Each umask runs in a process of its own (the umask is the process's), from recording to page."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import pytest

from ..helpers import ROOT

WRITE_ALL = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    os.umask(int(sys.argv[2], 8))
    from helpers import write_made_up_recording
    from transformers_offload.cli import main
    out = sys.argv[1]
    from pathlib import Path
    write_made_up_recording(Path(out) / "run", steps=6, rows=2, vocab=32, shard_bytes=2_000)
    assert main(["export", out + "/run", out + "/table.parquet"]) == 0
    assert main(["view", out + "/run", "-o", out + "/page.html"]) == 0
""")


@pytest.mark.parametrize("umask, file_mode, directory_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_every_written_file_has_the_mode_the_umask_gives(tmp_path, umask, file_mode, directory_mode):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", WRITE_ALL.format(tests=str(ROOT / "tests")), str(tmp_path), oct(umask)],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    written = sorted(path for path in tmp_path.rglob("*"))
    files = [path for path in written if path.is_file()]
    directories = [path for path in written if path.is_dir()]
    shards = [path for path in files if path.suffix == ".safetensors"]
    assert len(shards) >= 3 and (tmp_path / "run" / "manifest.json") in files  # several shards were written
    assert {tmp_path / "table.parquet", tmp_path / "page.html"} <= set(files)
    assert not [path for path in files if path.name.endswith(".tmp")]  # nothing left aside
    modes = {path.relative_to(tmp_path).as_posix(): stat.S_IMODE(path.stat().st_mode) for path in written}
    assert {name: mode for name, mode in modes.items() if (tmp_path / name).is_file() and mode != file_mode} == {}
    assert {name: mode for name, mode in modes.items() if (tmp_path / name).is_dir() and mode != directory_mode} == {}
    assert len(files) + len(directories) == len(modes) >= 6
