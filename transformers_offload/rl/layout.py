"""The `(rows, steps)` layout that `kept_sets` and `sampler_logprobs` share: a generation's rows, or every
generation's rows one after another (a recording, a recorder: continuous batching's requests are one row
each), each row's steps from 0, padded to the longest generation's steps (the padding not valid)."""

from __future__ import annotations

from typing import Any

from ..codecs.spec import sample_spec, topk_bits, topk_width


def generations_of(source: Any) -> list[Any]:
    """The generations `source` holds in order: a `Generation` alone, or a `Recorder`'s or `Recording`'s
    (anything with `generations`).

    Raises:
        TypeError: `source` is neither. ValueError: it holds no generation, or a beam search's (whose rows
            are running beams, not samples).
    """
    if hasattr(source, "num_steps") and hasattr(source, "scores"):
        generations = [source]
    elif hasattr(source, "generations"):
        generations = list(source.generations)
    else:
        raise TypeError(f"expected a Generation, a Recording or a Recorder, got {type(source).__name__}.")
    if not generations:
        raise ValueError("the recording holds no generation: record the rollouts first.")
    for generation in generations:
        if generation.is_beam:
            raise ValueError(f"generation {generation.index} is a beam search ({generation.mode}): its rows are "
                             "running beams, not samples drawn from a distribution; kept sets need sampling.")
    return generations


def temperature_of(generation: Any) -> float:
    """The temperature the generation sampled at (1.0 where greedy or unset)."""
    config = generation.generation_config
    return float(config.get("temperature") or 1.0) if config.get("do_sample") else 1.0


def check_scores_exact(generation: Any) -> str:
    """The encoding of the generation's processed scores, refused where it cannot give each step's finite
    entries exactly.

    Raises:
        ValueError: no `scores` recorded, or a lossy encoding (`topk:K:qB`, `sample:N@T`).
    """
    if "scores" not in generation.streams:
        raise ValueError(f"generation {generation.index} recorded no processed scores (streams "
                         f"{list(generation.streams)}): record with `streams=(\"logits\", \"scores\")` to keep each "
                         "token's kept set.")
    encoding = generation.encodings.get("scores", "dense")
    if topk_bits(encoding) is not None or sample_spec(encoding) is not None:
        raise ValueError(f"generation {generation.index}'s scores are recorded `{encoding}`, which does not keep "
                         "every finite entry exactly: record them dense, `sparse` or `topk:K` (K at least the "
                         "largest kept set).")
    return encoding


def is_topk(encoding: str) -> bool:
    return topk_width(encoding) is not None
