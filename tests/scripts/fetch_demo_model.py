"""Run by tests/test_demo_model.py: `demo_model.fetch()` in a process of its own, with the cache and
pip's index taken from the environment (TRANSFORMERS_OFFLOAD_CACHE; PIP_NO_INDEX, PIP_FIND_LINKS).

    python fetch_demo_model.py race    # print "ready", wait for a line on stdin, fetch(), load()
    python fetch_demo_model.py killed  # fetch() that stops after saving the weights, for a SIGKILL

`race` prints one JSON line: the folder and the SHA-256 of each file in it. `killed` prints
"saved" once the converted weights are on disk (before the tokenizer and the rename), then sleeps
until the test kills it.
"""

import hashlib
import json
import sys
import time

from transformers_offload import demo_model


def main() -> None:
    mode = sys.argv[1]
    if mode == "race":
        import transformers  # noqa: F401  # imported before the start line, so both start converting at once

        print("ready", flush=True)
        sys.stdin.readline()
        folder = demo_model.fetch()
        demo_model.load()
        digests = {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.iterdir())}
        print(json.dumps({"folder": str(folder), "files": digests}), flush=True)
    elif mode == "killed":
        from transformers import PreTrainedModel

        save_pretrained = PreTrainedModel.save_pretrained

        def save_then_stall(self, *args, **kwargs):
            save_pretrained(self, *args, **kwargs)
            print("saved", flush=True)
            time.sleep(600)

        PreTrainedModel.save_pretrained = save_then_stall
        demo_model.fetch()
    else:
        raise SystemExit(f"unknown mode {mode!r}: race or killed")


if __name__ == "__main__":
    main()
