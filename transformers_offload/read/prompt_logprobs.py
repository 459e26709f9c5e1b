"""Prompt logprobs read back: per prompt, each token's logprob and rank given the tokens before it (and
the top-k alternatives), as `Recorder(..., prompt_logprobs=True | k)` computed them on the device
(`capture.prompt_logprobs` gives the expressions)."""

from __future__ import annotations

import math
from typing import Any

from ..errors import StreamNotRecorded
from ..store.layout import PROMPT_STREAMS
from .indexing import as_framework, check_framework


def prompt_tensors(generation: Any, framework: str = "pt") -> dict[str, Any]:
    """The recorded prompt streams of `generation`, padded layout: `prompt_tokens` `(prompts, length - 1)`
    int64 (position p holds the prompt's token p + 1; -1 where it or its context is padding),
    `prompt_logprobs` float32 (NaN there), `prompt_ranks` int64 (-1 there) and, with top-k,
    `prompt_top_tokens` / `prompt_top_logprobs` `(prompts, length - 1, k)`.

    Raises:
        StreamNotRecorded (a KeyError): the generation was recorded without `prompt_logprobs`.
    """
    check_framework(framework)
    once = generation.once_streams
    if "prompt_logprobs" not in once:
        raise StreamNotRecorded(
            "this generation has no prompt logprobs: create the Recorder with `prompt_logprobs=True` (or an int, "
            "for the top-k too) to record them."
        )
    return {name: as_framework(generation.source.read_once(name), name, framework) for name in PROMPT_STREAMS
            if name in once}


def prompt_logprobs(generation: Any, *, tokenizer: Any = None) -> list[list[dict[str, Any]]]:
    """Per prompt of the call (batch order), one dict per prompt token that has a context (the first
    token that is not padding has none, as serving engines give None for it): `position` (its index
    among the prompt's tokens without padding: 1 for the second), `token`, `logprob` (float, nats), `rank` (0 = the most
    likely) and, when recorded with top-k, `top_logprobs` (`[{"token", "logprob"}]`, most likely first);
    with a `tokenizer`, `text` (each token's own, `convert_ids_to_tokens`), in the alternatives too.

    Raises:
        StreamNotRecorded: recorded without `prompt_logprobs`.
        TypeError: `tokenizer` has no `convert_ids_to_tokens`.
    """
    if tokenizer is not None and not callable(getattr(tokenizer, "convert_ids_to_tokens", None)):
        raise TypeError(f"`tokenizer` must be a transformers tokenizer (with `convert_ids_to_tokens`), got {tokenizer!r}.")
    found = prompt_tensors(generation)
    tokens, logprobs, ranks = (found[name].tolist() for name in PROMPT_STREAMS[:3])
    top_tokens = found["prompt_top_tokens"].tolist() if "prompt_top_tokens" in found else None
    top_logprobs = found["prompt_top_logprobs"].tolist() if top_tokens is not None else None
    prompts = []
    for prompt, row in enumerate(tokens):
        entries = []
        for p, token in enumerate(row):
            if token < 0:
                continue  # padding, or the first real token (its context is padding)
            entry = {"position": len(entries) + 1, "token": token, "logprob": logprobs[prompt][p], "rank": ranks[prompt][p]}
            if top_tokens is not None:
                entry["top_logprobs"] = [{"token": t, "logprob": v}
                                         for t, v in zip(top_tokens[prompt][p], top_logprobs[prompt][p])
                                         if t >= 0 and not math.isnan(v)]
            entries.append(entry)
        if tokenizer is not None:
            texts = tokenizer.convert_ids_to_tokens([e["token"] for e in entries])
            for entry, text in zip(entries, texts):
                entry["text"] = text
                alternatives = entry.get("top_logprobs") or []
                for alternative, name in zip(alternatives, tokenizer.convert_ids_to_tokens([a["token"] for a in alternatives])):
                    alternative["text"] = name
        prompts.append(entries)
    return prompts

