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


def sampler_logprobs(source: Any, *, raw: bool = True) -> dict[str, torch.Tensor]:
    """The sampled tokens' logprobs under the distribution sampled and under the raw one (module docstring).

    Args:
        source: a `Generation`, `Recording` or `Recorder` (rows laid out as `kept_sets(source)`), recorded with
            `streams=("logits", "scores")` (dense, `sparse` or `native`); `("scores",)` is enough with `raw=False`.
        raw (`bool`, *optional*, defaults to True): also `raw` and `raw_temperature` (which read the raw logits).

    Returns:
        `dict` of CPU tensors `(rows, steps)`: `sampled`, `raw`, `raw_temperature` (float32; the last two only
        with `raw`), `tokens` (int64), `valid` (bool).

    Raises:
        ValueError: a stream not recorded, or recorded top-k or lossily; a beam search.
        TypeError: `source` is not a generation, recording or recorder.

    Example:
        >>> lp = sampler_logprobs(rec)  # doctest: +SKIP
        >>> ratio = (trainer_logprobs - lp["sampled"]).exp()  # doctest: +SKIP
    """
    generations = generations_of(source)
    steps = max(generation.num_steps for generation in generations)
    kinds = ("sampled", "raw", "raw_temperature") if raw else ("sampled",)
    found: dict[str, list[torch.Tensor]] = {name: [] for name in (*kinds, "tokens", "valid")}
    for generation in generations:
        encoding = check_scores_exact(generation)
        no_logits = "logits" not in generation.streams or is_topk(generation.encodings.get("logits", "dense"))
        if is_topk(encoding):
            raise ValueError(f"generation {generation.index}'s scores are recorded `{encoding}` (the top K only): the "
                             "sampler's logprob needs every kept entry, so record the scores dense, `sparse` or "
                             "`native`.")
        if raw and no_logits:
            raise ValueError(f"generation {generation.index}: `raw` and `raw_temperature` need the raw logits recorded "
                             "in full (dense, `sparse` or `native`): record with `streams=(\"logits\", \"scores\")`, "
                             "or pass `raw=False` for the sampled logprob alone.")
        rows, count, temperature = generation.num_rows, generation.num_steps, temperature_of(generation)
        columns = {name: torch.zeros((rows, steps), dtype=torch.float32) for name in kinds}
        tokens = torch.full((rows, steps), -1, dtype=torch.long)
        valid = torch.zeros((rows, steps), dtype=torch.bool)
        if count:
            tokens[:, :count] = torch.stack(generation.tokens(), 1)
            valid[:, :count] = ~torch.stack(generation.finished(), 1)
            for t, s in enumerate(generation.scores()):
                columns["sampled"][:, t] = torch.log_softmax(s.float(), -1).gather(-1, tokens[:, t, None])[:, 0]
            for t, x in enumerate(generation.logits() if raw else ()):
                y = tokens[:, t, None]
                columns["raw"][:, t] = torch.log_softmax(x.float(), -1).gather(-1, y)[:, 0]
                columns["raw_temperature"][:, t] = torch.log_softmax(x.float() / temperature, -1).gather(-1, y)[:, 0]
        for name, column in columns.items():
            found[name].append(torch.where(valid, column, 0.0))
        found["tokens"].append(tokens)
        found["valid"].append(valid)
    return {name: torch.cat(parts) for name, parts in found.items()}
