"""Per-token logprobs of each returned sequence: the chosen token's logprob and rank, and the top-k
alternatives, under the raw logits or the processed scores, in the shape serving APIs return them
(`logprobs` / `top_logprobs`).

For step `t` of returned sequence `j`, with `r` the row whose scores chose its token (`j` itself
outside beam search; `beam_indices()[j, t]` in beam search), `y` the token and `x` that step's raw
logits (`out.logits[t]`) or processed scores (`out.scores[t]`), the values are these torch expressions,
on CPU (the same as the per-token statistics' `logprob_*` and `rank_*`):

    logprob        torch.log_softmax(x, -1)[r, y].float()
    rank           (x[r] > x[r, y]).sum()                 # 0 = the most likely
    top_logprobs   torch.topk(torch.log_softmax(x, -1)[r].float(), top)   # ties as torch breaks them

The full tensors are read a chunk of steps at a time (every row of `chunk_steps` steps), never every
step at once. A recording with only the `stats` stream gives `logprob` and `rank` (not alternatives).
"""

from __future__ import annotations

from typing import Any

import torch

from ..store.format import STATS_STREAM

KINDS = {"raw": "logits", "processed": "scores"}


def logprobs(generation: Any, *, kind: str = "raw", top: int = 0, tokenizer: Any = None,
             chunk_steps: int = 16) -> list[list[dict[str, Any]]]:
    """See `Generation.logprobs`."""
    if kind not in KINDS:
        raise ValueError(f"`kind` must be 'raw' (the logits) or 'processed' (the scores), got {kind!r}.")
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ValueError(f"`top` must be a whole number of alternatives, 0 or more, got {top!r}.")
    if isinstance(chunk_steps, bool) or not isinstance(chunk_steps, int) or chunk_steps < 1:
        raise ValueError(f"`chunk_steps` must be a positive int, got {chunk_steps!r}.")
    if generation.sequences is None:
        raise ValueError(
            "`logprobs()` needs the sequences `generate()` returned, and this generation is incomplete "
            f"({generation.error}); its per-step tensors are still available."
        )
    stream = KINDS[kind]
    full = stream in generation.streams and not generation.encodings.get(stream, "").startswith("topk:")
    if not full and not (STATS_STREAM in generation.streams and top == 0):
        have = "top-k" if stream in generation.streams else "no"
        raise ValueError(
            f"`logprobs(kind={kind!r}, top={top})` needs the full {stream!r} stream (this recording has {have} "
            f"{stream!r}); record it dense or sparse, or record `stats` and ask for `top=0`."
        )
    rows, tokens, lengths = _positions(generation)
    vocab = None
    if tokenizer is not None:
        vocab = getattr(tokenizer, "convert_ids_to_tokens", None)
        if vocab is None:
            raise TypeError("`tokenizer` must be a Hugging Face tokenizer (with `convert_ids_to_tokens`).")
    result: list[list[dict[str, Any]]] = [[] for _ in range(tokens.shape[0])]
    for start in range(0, int(lengths.max()) if lengths.numel() else 0, chunk_steps):
        steps = range(start, min(start + chunk_steps, int(lengths.max())))
        if full:
            values = (generation.logits if stream == "logits" else generation.scores)(steps=steps)
        else:
            values = generation.step_stats(steps=steps)
        for offset, t in enumerate(steps):
            live = torch.nonzero(lengths > t).flatten()
            if live.numel() == 0:
                continue
            r, y = rows[live, t], tokens[live, t]
            if full:
                x = values[offset]
                logprob_rows = torch.log_softmax(x, -1)[r].float()
                chosen = torch.log_softmax(x, -1)[r, y].float()
                rank = (x[r] > x[r, y][:, None]).sum(-1)
                alternatives = torch.topk(logprob_rows, min(top, x.shape[-1]), dim=-1) if top else None
            else:
                _check_stats_rows(generation, values[offset], r, y, t)
                chosen = values[offset][f"logprob_{kind}"][r]
                rank = values[offset][f"rank_{kind}"][r]
                alternatives = None
            for i, j in enumerate(live.tolist()):
                entry = {"step": t, "token": int(y[i]), "logprob": float(chosen[i]), "rank": int(rank[i])}
                if vocab is not None:
                    entry["text"] = tokenizer.decode([int(y[i])])
                if alternatives is not None:
                    entry["top_logprobs"] = [
                        {"token": int(token), "logprob": float(value),
                         **({"text": tokenizer.decode([int(token)])} if vocab is not None else {})}
                        for token, value in zip(alternatives.indices[i], alternatives.values[i])
                    ]
                result[j].append(entry)
    return result


def _positions(generation: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per returned sequence and step: the row whose values chose its token, the token, and each
    sequence's number of tokens (through its end-of-sequence token; no padding after it)."""
    sequences = generation.sequences
    generated = sequences[:, generation.prompt_length:]
    steps = min(generated.shape[1], generation.num_steps)
    generated = generated[:, :steps]
    if generation.is_beam:
        rows = generation.beam_indices()[:, :steps]
        lengths = (rows >= 0).sum(-1)
        rows = rows.clamp(min=0)
    else:
        rows = torch.arange(sequences.shape[0]).view(-1, 1).expand(-1, steps)
        finished = generation.finished(steps=slice(0, steps))
        done = torch.stack(finished, dim=1) if finished else torch.zeros((sequences.shape[0], 0), dtype=torch.bool)
        # A row's tokens run until the first step it had already finished before.
        lengths = torch.where(done.any(-1), done.to(torch.int8).argmax(-1), torch.tensor(steps))
    return rows, generated, lengths


def _check_stats_rows(generation: Any, stats: dict[str, torch.Tensor], rows: torch.Tensor, tokens: torch.Tensor,
                      step: int) -> None:
    if generation.is_beam:
        raise ValueError(
            "`logprobs()` of a beam search needs the full `logits` / `scores` streams: its `stats` describe "
            "running beams, not returned sequences."
        )
    if not torch.equal(stats["token"][rows], tokens):  # pragma: no cover - the recording's own tokens
        raise ValueError(f"step {step}: the recorded stats' tokens differ from the returned sequences.")
