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

Everything but the expressions on the full tensors is read and assembled with NumPy: the values that
come from `stats` or a `topk:K` stream (copied as recorded) need no torch, so answering from such a
recording imports none. The full tensors' expressions stay torch's (imported when a chunk needs them):
a NumPy log-softmax differs from `torch.log_softmax` in the last bits (two thirds of the entries of a
(64, 49152) float32 batch, by up to 3.8e-6), and these values are defined as torch's.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy

from .._lazy import torch  # imported when the full tensors' values are asked for (see above)
from ..codecs.spec import topk_width
from ..codecs.stats import STATS_STREAM

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

    Each dict holds NumPy arrays of one length `n` (the chunk's tokens, by step, then sequence):
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
    if not generation.has_sequences and generation.is_beam:
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
        chosen_sequences = numpy.array(sorted(set(int(j) for j in sequences)), dtype=numpy.int64)
        keep = numpy.zeros(lengths.shape[0], dtype=bool)
        keep[chosen_sequences[(chosen_sequences >= 0) & (chosen_sequences < lengths.shape[0])]] = True
        lengths = numpy.where(keep, lengths, 0)
    end = int(lengths.max()) if lengths.size else 0
    if max_steps is not None:
        end = min(end, max_steps)
    for start in range(0, end, chunk_steps):
        steps = range(start, min(start + chunk_steps, end))
        # The rows the chunk's tokens came from, each read once (a step's other rows are not read).
        needed = sorted(set(rows[lengths > start][:, start:steps.stop].flatten().tolist()))
        where = numpy.full((generation.num_rows or 1,), -1, dtype=numpy.int64)
        where[numpy.array(needed, dtype=numpy.int64)] = numpy.arange(len(needed))
        read = _Chunk(generation, steps, plan, needed)
        parts: list[dict[str, Any]] = []
        for offset, t in enumerate(steps):
            live = numpy.nonzero(lengths > t)[0].astype(numpy.int64)
            if live.size == 0:
                continue
            r, y = rows[live, t], tokens[live, t]
            part: dict[str, Any] = {"sequence": live, "step": numpy.full_like(live, t), "token": y, "row": r}
            for kind, (chosen, alternatives) in plan.items():
                part.update(read.values(offset, kind, chosen, alternatives, where[r], y, top, t))
            parts.append(part)
        if parts:
            yield {name: None if parts[0][name] is None else numpy.concatenate([p[name] for p in parts])
                   for name in parts[0]}


class _Chunk:
    """The streams of one chunk of steps, each read once: `stats` and `topk` as NumPy arrays, the full
    tensors (whose values are torch expressions) as tensors."""

    def __init__(self, generation: Any, steps: range, plan: dict[str, tuple[str | None, str | None]],
                 rows: list[int]) -> None:
        self.generation = generation
        wanted = any(c == "stats" for c, _ in plan.values())
        self._stats = generation.stats(steps=steps, rows=rows, framework="np") if wanted else None
        self._full: dict[str, tuple[torch.Tensor, ...]] = {}
        self._topk: dict[str, tuple[dict[str, numpy.ndarray], ...]] = {}
        for kind, (chosen, alternatives) in plan.items():
            stream = KINDS[kind]
            if "full" in (chosen, alternatives):
                self._full[kind] = (generation.logits if stream == "logits" else generation.scores)(steps=steps, rows=rows)
            if alternatives == "topk":
                self._topk[kind] = generation.topk(stream, steps=steps, rows=rows, framework="np")

    def values(self, offset: int, kind: str, chosen: str | None, alternatives: str | None,
               r: numpy.ndarray, y: numpy.ndarray, top: int, step: int) -> dict[str, Any]:
        out: dict[str, Any] = {f"logprob_{kind}": None, f"rank_{kind}": None, f"entropy_{kind}": None}
        if top:
            out.update({f"top_tokens_{kind}": None, f"top_logprobs_{kind}": None})
        x = self._full[kind][offset] if kind in self._full else None
        if x is not None:
            r_pt, y_pt = torch.from_numpy(r), torch.from_numpy(y)
        if chosen == "stats":
            stats = self._stats[offset]
            if not numpy.array_equal(stats["token"][r], y):  # pragma: no cover - the recording's own tokens
                raise ValueError(f"step {step}: the recorded stats' tokens differ from the returned sequences.")
            out[f"logprob_{kind}"] = stats[f"logprob_{kind}"][r]
            out[f"rank_{kind}"] = stats[f"rank_{kind}"][r]
            out[f"entropy_{kind}"] = stats[f"entropy_{kind}"][r]
        elif chosen == "full":
            out[f"logprob_{kind}"] = torch.log_softmax(x, -1)[r_pt, y_pt].float().numpy()
            out[f"rank_{kind}"] = (x[r_pt] > x[r_pt, y_pt][:, None]).sum(-1).numpy()
            out[f"entropy_{kind}"] = torch.special.entr(torch.softmax(x, -1)).sum(-1)[r_pt].float().numpy()
        if alternatives == "topk":
            record = self._topk[kind][offset]  # at most K alternatives
            out[f"top_tokens_{kind}"] = record["indices"][r, :top]
            out[f"top_logprobs_{kind}"] = record["logprobs"][r, :top]
        elif alternatives == "full":
            best = torch.topk(torch.log_softmax(x, -1)[r_pt].float(), min(top, x.shape[-1]), dim=-1)
            out[f"top_tokens_{kind}"] = best.indices.numpy()
            out[f"top_logprobs_{kind}"] = best.values.numpy()
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
        for j, t, y, value, rank in zip(*columns):
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
    return generation.num_rows if not generation.has_sequences else int(generation.sequences_array().shape[0])


def token_positions(generation: Any) -> tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
    """Per returned sequence and step: the row whose values chose its token, the token, and each
    sequence's number of tokens (through its end-of-sequence token; no padding after it); int64 NumPy
    arrays `(sequences, steps)`, `(sequences, steps)` and `(sequences,)`, read without torch."""
    sequences = generation.sequences_array()
    if sequences is None:  # incomplete, outside beam search: each row's recorded tokens
        recorded = generation.tokens(framework="np")
        generated = numpy.stack(recorded, axis=1) if recorded else numpy.zeros((generation.num_rows, 0), dtype=numpy.int64)
        sequences = generated
    else:
        generated = sequences[:, generation.prompt_length:]
    steps = min(generated.shape[1], generation.num_steps)
    generated = generated[:, :steps]
    if generation.is_beam:
        rows = generation.beam_indices(framework="np")[:, :steps]
        lengths = (rows >= 0).sum(-1, dtype=numpy.int64)
        rows = numpy.maximum(rows, 0)
    else:
        rows = numpy.repeat(numpy.arange(sequences.shape[0], dtype=numpy.int64)[:, None], steps, axis=1)
        finished = generation.finished(steps=slice(0, steps), framework="np")
        done = numpy.stack(finished, axis=1) if finished else numpy.zeros((sequences.shape[0], 0), dtype=bool)
        # A row's tokens run until the first step it had already finished before.
        if steps == 0:
            lengths = numpy.zeros(sequences.shape[0], dtype=numpy.int64)
        else:
            lengths = numpy.where(done.any(-1), done.argmax(-1), steps).astype(numpy.int64)
    return rows, generated, lengths
