"""`sampler_logprobs(recording)`: per sampled token, in `kept_sets`' `(rows, steps)` layout, the logprobs
an importance-sampling correction needs, from the recording alone (no second forward):

    sampled[r, t]          = torch.log_softmax(s.float(), -1)[y]       # s = out.scores[t][r]: the distribution drawn from
    raw[r, t]              = torch.log_softmax(x.float(), -1)[y]       # x = out.logits[t][r], temperature 1
    raw_temperature[r, t]  = torch.log_softmax(x.float() / T, -1)[y]   # at the sampling temperature T

with `y` the sampled token; 0 where not `valid`. `sampled` is the sampler's own logprob (renormalised over the
kept set, since `s` is -inf outside it); `raw_temperature` is what TRL's `old_per_token_logps` computes
from a trainer forward; their difference is what top-p/top-k sampling moved.
"""

from __future__ import annotations

from typing import Any

import torch

from .layout import check_scores_exact, generations_of, is_topk, temperature_of


def sampler_logprobs(source: Any) -> dict[str, torch.Tensor]:
    """The sampled tokens' logprobs under the distribution sampled and under the raw one (module docstring).

    Args:
        source: a `Generation`, `Recording` or `Recorder` (rows laid out as `kept_sets(source)`), recorded with
            `streams=("logits", "scores")` (dense, `sparse` or `native`).

    Returns:
        `dict` of CPU tensors `(rows, steps)`: `sampled`, `raw`, `raw_temperature` (float32), `tokens` (int64),
        `valid` (bool).

    Raises:
        ValueError: a stream not recorded, or recorded top-k or lossily; a beam search.
        TypeError: `source` is not a generation, recording or recorder.

    Example:
        >>> lp = sampler_logprobs(rec)  # doctest: +SKIP
        >>> ratio = (trainer_logprobs - lp["sampled"]).exp()  # doctest: +SKIP
    """
    generations = generations_of(source)
    steps = max(generation.num_steps for generation in generations)
    found: dict[str, list[torch.Tensor]] = {name: [] for name in ("sampled", "raw", "raw_temperature", "tokens", "valid")}
    for generation in generations:
        encoding = check_scores_exact(generation)
        if is_topk(encoding) or "logits" not in generation.streams or is_topk(generation.encodings.get("logits", "dense")):
            raise ValueError(f"generation {generation.index}: sampler logprobs need the raw logits and the scores "
                             "recorded in full (dense, `sparse` or `native`): record with "
                             "`streams=(\"logits\", \"scores\")`.")
        rows, count, temperature = generation.num_rows, generation.num_steps, temperature_of(generation)
        columns = {name: torch.zeros((rows, steps), dtype=torch.float32) for name in ("sampled", "raw", "raw_temperature")}
        tokens = torch.full((rows, steps), -1, dtype=torch.long)
        valid = torch.zeros((rows, steps), dtype=torch.bool)
        if count:
            tokens[:, :count] = torch.stack(generation.tokens(), 1)
            valid[:, :count] = ~torch.stack(generation.finished(), 1)
            for t, (x, s) in enumerate(zip(generation.logits(), generation.scores())):
                y = tokens[:, t, None]
                columns["sampled"][:, t] = torch.log_softmax(s.float(), -1).gather(-1, y)[:, 0]
                columns["raw"][:, t] = torch.log_softmax(x.float(), -1).gather(-1, y)[:, 0]
                columns["raw_temperature"][:, t] = torch.log_softmax(x.float() / temperature, -1).gather(-1, y)[:, 0]
        for name, column in columns.items():
            found[name].append(torch.where(valid, column, 0.0))
        found["tokens"].append(tokens)
        found["valid"].append(valid)
    return {name: torch.cat(parts) for name, parts in found.items()}
