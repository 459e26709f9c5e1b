"""Per-token logprobs of each returned sequence: the chosen token's logprob and rank, and the top-k
alternatives, under the raw logits or the processed scores, in the shape serving APIs return them
(`logprobs` / `top_logprobs`); and the same as columns, a chunk of steps at a time (`token_chunks`,
which the per-token table builds on).

For step `t` of returned sequence `j`, with `r` the row whose scores chose its token (`j` itself
outside beam search; `beam_indices()[j, t]` in beam search), `y` the token and `x` that step's raw
logits (`out.logits[t]`) or processed scores (`out.scores[t]`), the values are these torch expressions
(the per-token statistics' `logprob_*`, `rank_*` and `entropy_*`):

    logprob        torch.log_softmax(x, -1)[r, y].float()
    rank           (x[r] > x[r, y]).sum()                 # 0 = the most likely
    entropy        torch.special.entr(torch.softmax(x, -1)).sum(-1)[r].float()     # nats
    top_logprobs   torch.topk(torch.log_softmax(x, -1)[r].float(), top)   # ties as torch breaks them

Where each comes from, per kind:
- `logprob`, `rank`, `entropy`: the `stats` stream where it was recorded (outside beam search; its
  values were computed on the device the step ran on), else the full tensors (dense or sparse), on CPU.
- `top_logprobs`: a `topk:K` stream where one was recorded (its `logprobs`, `values - logsumexp`,
  which can differ from `log_softmax` in the last bits; at most K of them), else the full tensors.
An incomplete generation (`generate()` raised, or the process stopped) has no returned sequences: its
rows' recorded tokens stand for them (outside beam search, whose beams are only known at the end).
The full tensors are read a chunk of steps at a time (every row of `chunk_steps` steps), never every
step at once.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from .._lazy import torch  # imported when first used: reading a manifest needs no torch (`inspect`, `verify`)

from ..store.format import STATS_STREAM, topk_width

KINDS = {"raw": "logits", "processed": "scores"}


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an int of at least {minimum}, got {value!r}.")


def sources(generation: Any, kind: str, top: int) -> tuple[str | None, str | None]:
    """Where `kind`'s chosen-token values and its `top` alternatives come from: `"stats"`, `"full"`,
    `"topk"` or None (not recorded)."""
    stream = KINDS[kind]
    width = topk_width(generation.encodings.get(stream, "")) if stream in generation.streams else None
    full = stream in generation.streams and width is None
    chosen = "stats" if STATS_STREAM in generation.streams and not generation.is_beam else "full" if full else None
    alternatives = None
    if top:
        alternatives = "topk" if width is not None else "full" if full else None
    return chosen, alternatives


def token_chunks(generation: Any, *, kinds: tuple[str, ...] = ("raw", "processed"), top: int = 0,
                 chunk_steps: int = 16, strict: bool = True, sequences: Sequence[int] | None = None,
                 max_steps: int | None = None) -> Iterator[dict[str, Any]]:
    """Yield, per chunk of `chunk_steps` steps, every returned sequence's tokens in it as columns.

    Each dict holds CPU tensors of one length `n` (the chunk's tokens, by step, then sequence):
    `sequence`, `step`, `token` (int64), the `row` whose values chose the token (int64) and, per kind
    in `kinds` (`"raw"`, `"processed"`), `logprob_<kind>` float32, `rank_<kind>` int64,
    `entropy_<kind>` float32, and with `top`, `top_tokens_<kind>` int64 `(n, top)` and
    `top_logprobs_<kind>` float32 `(n, top)`. A value whose stream was not recorded is None, or with
    `strict` raises ValueError. `sequences` (rows of `out.sequences`) and `max_steps` (the first steps)
    narrow what is read: only the rows those sequences' tokens came from.
    """
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"`kind` must be 'raw' (the logits) or 'processed' (the scores), got {kind!r}.")
    _check_int("top", top, 0)
    _check_int("chunk_steps", chunk_steps, 1)
    if generation.num_steps == 0 and not generation.complete:
        return  # stopped before its first step was committed (killed, or failed in the prefill): no token
    if generation.sequences is None and generation.is_beam:
        raise ValueError(
            "the per-token values of a beam search need the sequences `generate()` returned, and this "
            f"generation is incomplete ({generation.error}); its per-step tensors are still available."
        )
    plan = {kind: sources(generation, kind, top) for kind in kinds}
    if strict:
        for kind, (chosen, alternatives) in plan.items():
            stream = KINDS[kind]
            if chosen is None or (top and alternatives is None):
                have = generation.encodings.get(stream, "dense") if stream in generation.streams else "no"
                raise ValueError(
                    f"`logprobs(kind={kind!r}, top={top})` needs the full {stream!r} stream (this recording has "
                    f"{have} {stream!r}{'' if STATS_STREAM in generation.streams else ' and no stats'}); record it "
                    "dense or sparse, or record `stats` and ask for `top=0` (outside beam search), with a `topk:K` "
                    "encoding for the alternatives."
                )
    rows, tokens, lengths = token_positions(generation)
    if sequences is not None:
        chosen_sequences = torch.tensor(sorted(set(int(j) for j in sequences)), dtype=torch.long)
        keep = torch.zeros(lengths.shape[0], dtype=torch.bool)
        keep[chosen_sequences[(chosen_sequences >= 0) & (chosen_sequences < lengths.shape[0])]] = True
        lengths = torch.where(keep, lengths, torch.zeros_like(lengths))
    end = int(lengths.max()) if lengths.numel() else 0
    if max_steps is not None:
        end = min(end, max_steps)
    for start in range(0, end, chunk_steps):
        steps = range(start, min(start + chunk_steps, end))
        # The rows the chunk's tokens came from, each read once (a step's other rows are not read).
        needed = sorted(set(rows[lengths > start][:, start:steps.stop].flatten().tolist()))
        where = torch.full((generation.num_rows or 1,), -1, dtype=torch.long)
        where[torch.tensor(needed, dtype=torch.long)] = torch.arange(len(needed))
        read = _Chunk(generation, steps, plan, needed)
        parts: list[dict[str, Any]] = []
        for offset, t in enumerate(steps):
            live = torch.nonzero(lengths > t).flatten()
            if live.numel() == 0:
                continue
            r, y = rows[live, t], tokens[live, t]
            part: dict[str, Any] = {"sequence": live, "step": torch.full_like(live, t), "token": y, "row": r}
            for kind, (chosen, alternatives) in plan.items():
                part.update(read.values(offset, kind, chosen, alternatives, where[r], y, top, t))
            parts.append(part)
        if parts:
            yield {name: None if parts[0][name] is None else torch.cat([p[name] for p in parts]) for name in parts[0]}


class _Chunk:
    """The streams of one chunk of steps, each read once."""

    def __init__(self, generation: Any, steps: range, plan: dict[str, tuple[str | None, str | None]],
                 rows: list[int]) -> None:
        self.generation = generation
        wanted = any(c == "stats" for c, _ in plan.values())
        self._stats = generation.step_stats(steps=steps, rows=rows) if wanted else None
        self._full: dict[str, tuple[torch.Tensor, ...]] = {}
        self._topk: dict[str, tuple[dict[str, torch.Tensor], ...]] = {}
        for kind, (chosen, alternatives) in plan.items():
            stream = KINDS[kind]
            if "full" in (chosen, alternatives):
                self._full[kind] = (generation.logits if stream == "logits" else generation.scores)(steps=steps, rows=rows)
            if alternatives == "topk":
                self._topk[kind] = generation.topk(stream, steps=steps, rows=rows)

    def values(self, offset: int, kind: str, chosen: str | None, alternatives: str | None,
               r: torch.Tensor, y: torch.Tensor, top: int, step: int) -> dict[str, Any]:
        out: dict[str, Any] = {f"logprob_{kind}": None, f"rank_{kind}": None, f"entropy_{kind}": None}
        if top:
            out.update({f"top_tokens_{kind}": None, f"top_logprobs_{kind}": None})
        x = self._full[kind][offset] if kind in self._full else None
        if chosen == "stats":
            stats = self._stats[offset]
            if not torch.equal(stats["token"][r], y):  # pragma: no cover - the recording's own tokens
                raise ValueError(f"step {step}: the recorded stats' tokens differ from the returned sequences.")
            out[f"logprob_{kind}"] = stats[f"logprob_{kind}"][r]
            out[f"rank_{kind}"] = stats[f"rank_{kind}"][r]
            out[f"entropy_{kind}"] = stats[f"entropy_{kind}"][r]
        elif chosen == "full":
            out[f"logprob_{kind}"] = torch.log_softmax(x, -1)[r, y].float()
            out[f"rank_{kind}"] = (x[r] > x[r, y][:, None]).sum(-1)
            out[f"entropy_{kind}"] = torch.special.entr(torch.softmax(x, -1)).sum(-1)[r].float()
        if alternatives == "topk":
            record = self._topk[kind][offset]  # at most K alternatives
            out[f"top_tokens_{kind}"] = record["indices"][r, :top]
            out[f"top_logprobs_{kind}"] = record["logprobs"][r, :top]
        elif alternatives == "full":
            best = torch.topk(torch.log_softmax(x, -1)[r].float(), min(top, x.shape[-1]), dim=-1)
            out[f"top_tokens_{kind}"] = best.indices
            out[f"top_logprobs_{kind}"] = best.values
        return out


def logprobs(generation: Any, *, kind: str = "raw", top: int = 0, tokenizer: Any = None,
             chunk_steps: int = 16) -> list[list[dict[str, Any]]]:
    """See `Generation.logprobs`."""
    if kind not in KINDS:
        raise ValueError(f"`kind` must be 'raw' (the logits) or 'processed' (the scores), got {kind!r}.")
    if tokenizer is not None and not hasattr(tokenizer, "decode"):
        raise TypeError("`tokenizer` must be a Hugging Face tokenizer (with `decode`).")
    text = (lambda token: tokenizer.decode([token])) if tokenizer is not None else None
    result: list[list[dict[str, Any]]] = [[] for _ in range(_num_sequences(generation))]
    for chunk in token_chunks(generation, kinds=(kind,), top=top, chunk_steps=chunk_steps):
        columns = [chunk[name].tolist() for name in ("sequence", "step", "token", f"logprob_{kind}", f"rank_{kind}")]
        alternatives = None
        if top:
            alternatives = zip(chunk[f"top_tokens_{kind}"].tolist(), chunk[f"top_logprobs_{kind}"].tolist())
        for i, (j, t, y, value, rank) in enumerate(zip(*columns)):
            entry: dict[str, Any] = {"step": t, "token": y, "logprob": value, "rank": rank}
            if text is not None:
                entry["text"] = text(y)
            if alternatives is not None:
                ids, values = next(alternatives)
                entry["top_logprobs"] = [
                    {"token": a, "logprob": v, **({"text": text(a)} if text is not None else {})}
                    for a, v in zip(ids, values)
                ]
            result[j].append(entry)
    for entries in result:
        entries.sort(key=lambda entry: entry["step"])
    return result


def _num_sequences(generation: Any) -> int:
    return generation.num_rows if generation.sequences is None else int(generation.sequences.shape[0])


def token_positions(generation: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per returned sequence and step: the row whose values chose its token, the token, and each
    sequence's number of tokens (through its end-of-sequence token; no padding after it)."""
    sequences = generation.sequences
    if sequences is None:  # incomplete, outside beam search: each row's recorded tokens
        recorded = generation.tokens()
        generated = torch.stack(recorded, dim=1) if recorded else torch.zeros((generation.num_rows, 0), dtype=torch.long)
        sequences = generated
    else:
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
        if steps == 0:
            lengths = torch.zeros(sequences.shape[0], dtype=torch.long)
        else:
            lengths = torch.where(done.any(-1), done.to(torch.int8).argmax(-1), torch.tensor(steps))
    return rows, generated, lengths
