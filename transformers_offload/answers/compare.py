"""`compare(a, b)`: where and how far two recordings of the same tokens part, token by token.

`a` is the reference (e.g. the original recording), `b` the candidate (e.g. `rescore(a, model)` under
another dtype, quantization, attention kernel or transformers release). Both must hold the same
generations, rows, steps and tokens; the values per token are `answers.compare_metrics`' float64
expressions, read a chunk of steps at a time; the summary follows llama.cpp's perplexity tool's
KL-divergence statistics (docs/compare.md).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import numpy as np
import torch

from ..codecs.spec import ENCODED_STREAMS, topk_width
from ..codecs.stats import STATS_STREAM
from ..errors import CompareError
from ..read.samples import sample_ids
from .compare_metrics import Side, Workspace, group_entries, step_values
from .comparison import Comparison


def compare(a: Any, b: Any, *, stream: str = "logits", chunk_steps: int = 16) -> Comparison:
    """Compare two recordings of the same tokens, token by token, in float64.

    Generations are paired by their sample ids where both recordings carry them (`Recorder.set_samples`,
    `record`; `rescore` keeps them), else by order. For every row and step (a finished row's padding
    left out, as the per-token table does) the comparison holds both KL divergences, the chosen token's
    probability change, top-1 agreement, top-k overlaps, the largest logit difference and the chosen
    token's rank under `b`: `answers.compare_metrics` gives each as a torch expression. They are exact
    on dense, sparse and native recordings; where either side is `topk:K`, the KLs are those over the
    kept ids plus one bucket for the rest, a lower bound, and where a `topk:K+tail:N` side meets a full
    one, an unbiased estimate, which may exceed the exact value (both flagged `estimate`, named by
    `estimate_kind`; docs/compare.md). A top-k side gives the chosen token's logprob only where it kept
    it, or from a `stats` stream beside it (`score` records one); where some token has none, the
    perplexity and probability-change statistics are refused (`summary()["refused"]`), never computed
    over the others.

    Steps are read `chunk_steps` at a time (every row), so memory holds one chunk's tensors (and, per
    token, the results: about 350 bytes), whatever the length; a recording on disk keeps only the shard
    it is read from mapped (`Recording.in_order()`).

    Args:
        a: the reference: a `Recording` (`open_recording(path)`), a `Recorder`, a `Generation`, or a
            recording directory's path.
        b: the candidate, of the same kinds, with the same generations, rows, steps and tokens.
        stream (`str`, *optional*, defaults to `"logits"`): `"logits"` (raw, `out.logits`) or `"scores"`
            (processed, `out.scores`).
        chunk_steps (`int`, *optional*, defaults to 16): steps read at once.

    Returns:
        `Comparison`: per-token values (`to_arrow()`), per sample (`samples()`), and the summary
        (`summary()`, `summary_text()`).

    Raises:
        CompareError (a `ValueError`): the two do not line up (the message names the generation and
            what differs), or they hold no token to compare (no generation, or none with a step).
        ValueError: a bad `stream` or `chunk_steps`; a stream one side did not record.
        TypeError: `a` or `b` is not a recording, a recorder, a generation or a path.
        RecordingError: a path that is not a recording, or a damaged shard met while reading.

    Example:
        >>> from transformers_offload import compare, open_recording, rescore  # doctest: +SKIP
        >>> cmp = compare("run", rescore(open_recording("run"), model.to(torch.bfloat16)))  # doctest: +SKIP
        >>> print(cmp.summary_text())  # doctest: +SKIP
    """
    if stream not in ENCODED_STREAMS:
        raise ValueError(f"`stream` must be one of {ENCODED_STREAMS}, got {stream!r}.")
    if isinstance(chunk_steps, bool) or not isinstance(chunk_steps, int) or chunk_steps < 1:
        raise ValueError(f"`chunk_steps` must be an int of at least 1 (steps), got {chunk_steps!r}.")
    opened: list[Any] = []
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: [recording.close() for recording in opened])
        gens_a = _generations(a, "a", opened, stack)
        gens_b = _generations(b, "b", opened, stack)
        if not gens_a or not gens_b:
            raise CompareError(_nothing_to_compare(gens_a, gens_b, []))
        pairs = _pair(gens_a, gens_b)
        plans = [_check_pair(ga, gb, stream) for ga, gb in pairs]  # every refusal before any work
        total = sum(_token_count(ga, plan) for (ga, _), plan in zip(pairs, plans))
        if not total:
            raise CompareError(_nothing_to_compare(gens_a, gens_b, pairs))
        ids = dict(zip(map(id, gens_a), sample_ids(gens_a)))
        columns = _Columns(total)
        workspace = Workspace()
        for (ga, gb), plan in zip(pairs, plans):
            for values in _pair_values(ga, gb, stream, plan, chunk_steps, ids[id(ga)], workspace):
                columns.put(values)
    return Comparison(columns.arrays, stream=stream, pairs=[(ga.index, gb.index) for ga, gb in pairs],
                      sample_as_text=any(isinstance(i, str) for per in ids.values() for i in per),
                      estimate_kind=_estimate_kind(pairs, stream))


def _estimate_kind(pairs: list[tuple[Any, Any]], stream: str) -> str:
    """What a top-k side's KLs are: a lower bound (one bucket for the ids outside the K: the log-sum
    inequality), or, where a `topk:K+tail:N` side meets a full one, an unbiased estimate of the exact KL
    (the tail's share estimated from the draws), which may fall on either side of it."""
    tails = False
    for ga, gb in pairs:
        widths = [topk_width(g.encodings.get(stream, "")) for g in (ga, gb)]
        drawn = ["+tail:" in g.encodings.get(stream, "") for g in (ga, gb)]
        tails |= (drawn[0] and widths[1] is None) or (drawn[1] and widths[0] is None)
    if tails:
        return "top-k ids and draws from the tail: an unbiased estimate of the KL, on either side of it"
    return "top-k ids plus one bucket for the rest: a lower bound of the KL"


def _generations(source: Any, name: str, opened: list[Any], stack: contextlib.ExitStack) -> list[Any]:
    if isinstance(source, (str, os.PathLike)):
        from ..read.reader import open_recording

        source = open_recording(source)
        opened.append(source)
    if hasattr(source, "in_order"):  # a recording on disk, read once in order: its passed shards let go
        stack.enter_context(source.in_order())
    if hasattr(source, "generations"):
        return list(source.generations)
    if hasattr(source, "logits") and hasattr(source, "index") and hasattr(source, "num_steps"):
        return [source]
    raise TypeError(f"`{name}` must be a Recording (`open_recording(path)`), a Recorder, a Generation or a recording "
                    f"directory's path, got {type(source).__name__}.")


def _nothing_to_compare(gens_a: list[Any], gens_b: list[Any], pairs: list[tuple[Any, Any]]) -> str:
    if not gens_a or not gens_b:
        empty = [f"`{name}`" for name, gens in (("a", gens_a), ("b", gens_b)) if not gens]
        verb = "hold" if len(empty) > 1 else "holds"
        return (f"nothing to compare: {' and '.join(empty)} {verb} no generation (a recording whose calls all failed, "
                "or of prompt logprobs or encoder outputs alone). Compare recordings of generated tokens, e.g. a recording with "
                "its rescore (`rescore(a, model)`).")
    return (f"nothing to compare: the {len(pairs)} paired generation(s) hold no token (no step recorded, or every row "
            "finished before its first step). Compare recordings of generated tokens.")


def _pair(gens_a: list[Any], gens_b: list[Any]) -> list[tuple[Any, Any]]:
    """Pair generations by sample ids where both sides have them for every generation, else by order."""
    gens_a, gens_b = _current(gens_a), _current(gens_b)
    by_ids = all(g.sample_ids is not None for g in gens_a + gens_b)
    if not by_ids:
        if len(gens_a) != len(gens_b):
            raise CompareError(
                f"`a` holds {len(gens_a)} generation(s) and `b` {len(gens_b)}, without sample ids to pair them by: "
                "compare recordings of the same generations (rescore every generation of `a`), or one generation "
                "of each (`compare(a.generation(i), b.generation(j))`).")
        return list(zip(gens_a, gens_b))
    keyed_b = {tuple(g.sample_ids): g for g in gens_b}
    pairs, missing = [], []
    for ga in gens_a:
        gb = keyed_b.pop(tuple(ga.sample_ids), None)
        if gb is None:
            missing.append(ga)
        else:
            pairs.append((ga, gb))
    if missing or keyed_b:
        parts = []
        if missing:
            parts.append(f"`a`'s generation {missing[0].index} (samples {_short(missing[0].sample_ids)}) has no "
                         "generation of the same samples in `b`")
        if keyed_b:
            extra = next(iter(keyed_b.values()))
            parts.append(f"`b`'s generation {extra.index} (samples {_short(extra.sample_ids)}) has none in `a`")
        raise CompareError("the two recordings hold other samples: " + "; ".join(parts) + ". Compare a recording with "
                           "its rescore (`rescore(a, model)`), or one generation of each.")
    return pairs


def _current(generations: list[Any]) -> list[Any]:
    """Without incomplete generations whose samples a complete one holds (a resumed `record`)."""
    done = {i for g in generations if g.complete and g.sample_ids is not None for i in g.sample_ids}
    return [g for g in generations
            if g.complete or g.sample_ids is None or not set(g.sample_ids) <= done]


def _short(values: Any, limit: int = 4) -> str:
    values = list(values)
    return repr(values[:limit])[:-1] + (f", ... ({len(values)} in all)]" if len(values) > limit else "]")


def _check_pair(ga: Any, gb: Any, stream: str) -> dict[str, Any]:
    """Refuse a pair that does not line up; return what the comparison reads of it."""
    where = f"generation {ga.index} of `a` and {gb.index} of `b`"
    for what, va, vb in (("decoding mode", ga.is_beam, gb.is_beam), ("rows per step", ga.num_rows, gb.num_rows),
                         ("steps", ga.num_steps, gb.num_steps), ("beams", ga.num_beams, gb.num_beams)):
        if va != vb:
            shown = (ga.mode, gb.mode) if what == "decoding mode" else (va, vb)
            raise CompareError(f"{where} differ in {what}: {shown[0]!r} and {shown[1]!r}. They are not the same "
                               "tokens: compare a recording with its rescore (`rescore(a, model)`).")
    for side, g in (("a", ga), ("b", gb)):
        if g.num_steps and stream not in g.streams:
            raise ValueError(f"`{side}`'s generation {g.index} has no {stream!r} stream (it holds {sorted(g.streams)}): "
                             f"compare another `stream`, or record {stream!r}.")
    tokens_a, tokens_b = _stacked(ga, "tokens"), _stacked(gb, "tokens")
    if tokens_a is not None and not torch.equal(tokens_a, tokens_b):
        t, r = (tokens_a != tokens_b).nonzero()[0].tolist()
        raise CompareError(f"{where} differ in their tokens from step {t}: row {r} chose {int(tokens_a[t, r])} in `a` "
                           f"and {int(tokens_b[t, r])} in `b`. Compare a recording with its rescore "
                           "(`rescore(a, model)`), which replays `a`'s tokens.")
    finished = (_stacked(ga, "finished"), _stacked(gb, "finished")) if not ga.is_beam else (None, None)
    if finished[0] is not None and not torch.equal(*finished):
        t = int((finished[0] != finished[1]).any(-1).nonzero()[0, 0])
        raise CompareError(f"{where} differ in which rows had finished before step {t}: compare a recording "
                           "with its rescore.")
    parents = _stacked(ga, "beam_parents") if ga.is_beam else None
    if parents is not None and not torch.equal(parents, _stacked(gb, "beam_parents")):
        raise CompareError(f"{where} differ in their beams' parents: compare a recording with its rescore.")
    widths = [_width(g, stream) for g in (ga, gb)]
    if None not in widths and widths[0] != widths[1]:
        raise CompareError(f"{where} differ in vocabulary: {widths[0]} and {widths[1]} entries per row. Compare "
                           "models that share a tokenizer (and vocabulary size).")
    return {"tokens": tokens_a, "finished": finished[0], "parents": parents}


def _stacked(generation: Any, name: str, chunk_steps: int = 1024) -> torch.Tensor | None:
    """A per-step field of `generation` (`tokens`, `finished`, `beam_parents`) as one `(steps, rows)`
    tensor, None without steps. Not the tuple of one tensor per step that the accessors return: kept
    for the whole comparison, those cost about 600 bytes a step each (70 MiB at 32k tokens for the
    two recordings' tokens and finished rows); read `chunk_steps` steps at a time for the same reason."""
    if not generation.num_steps:
        return None
    read = getattr(generation, name)
    stacked = None
    for start in range(0, generation.num_steps, chunk_steps):
        part = np.stack(read(steps=range(start, min(start + chunk_steps, generation.num_steps)), framework="np"))
        if stacked is None:
            stacked = np.empty((generation.num_steps, *part.shape[1:]), dtype=part.dtype)
        stacked[start : start + len(part)] = part
    return torch.from_numpy(stacked)


def _width(generation: Any, stream: str) -> int | None:
    """The vocabulary a full stream spans (None for top-k or no steps)."""
    if not generation.num_steps or topk_width(generation.encodings.get(stream, "")) is not None:
        return None
    return int(_read(generation, stream, range(0, 1), rows=[0])[0].full.shape[-1])


def _read(generation: Any, stream: str, steps: range, rows: Any = None) -> list[Side]:
    if topk_width(generation.encodings.get(stream, "")) is not None:
        records = generation.topk(stream, steps=steps, rows=rows)
        if stream != "logits" or STATS_STREAM not in generation.streams:
            return [Side(topk=record) for record in records]
        # The raw logits' statistics (`score` records them beside a compact encoding): every chosen token's logprob.
        stats = generation.stats(steps=steps, rows=rows)
        return [Side(topk=record, chosen={name: step[name] for name in ("token", "logprob_raw", "rank_raw")})
                for record, step in zip(records, stats)]
    read = generation.logits if stream == "logits" else generation.scores
    return [Side(full=x.reshape(-1, x.shape[-1])) for x in read(steps=steps, rows=rows)]


def _token_count(ga: Any, plan: dict[str, Any]) -> int:
    """The tokens `_pair_values` yields for a pair: every row of every step, less finished rows."""
    if plan["finished"] is not None:
        return int((~plan["finished"]).sum())
    return ga.num_rows * ga.num_steps


class _Columns:
    """The per-token columns, each allocated once, `total` tokens long, when the first step's values
    arrive (their dtypes and widths are then known), and filled in place step by step.

    Not a list of each step's small arrays joined at the end: kept between the steps' large float64
    temporaries (a vocabulary's entries a row), those small allocations split the room the temporaries
    free, and the C library's allocator could neither reuse that room for the next step's temporaries
    nor hand it back, so the process grew with the length (+3.6 GiB at 4,096 tokens of a 152k vocabulary,
    +9.2 GiB at 8,192: bench/README.md).
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self.arrays: dict[str, np.ndarray] = {}
        self._filled = 0

    def put(self, values: dict[str, np.ndarray]) -> None:
        n = len(values["step"])
        for name, value in values.items():
            array = self.arrays.get(name)
            if array is None:
                array = self.arrays[name] = np.empty((self.total, *value.shape[1:]), dtype=value.dtype)
            array[self._filled : self._filled + n] = value
        self._filled += n


def _pair_values(ga: Any, gb: Any, stream: str, plan: dict[str, Any], chunk_steps: int,
                 ids: list[Any], workspace: Workspace) -> Iterator[dict[str, np.ndarray]]:
    """Per group of steps, the pair's per-token columns as NumPy arrays. A chunk's steps are computed
    together, as many as `compare_metrics.group_entries` entries (one step at least): one call per
    group, whose rows run in parallel, rather than one per step."""
    per_row = ga.rows_per_prompt
    for start in range(0, ga.num_steps, chunk_steps):
        steps = range(start, min(start + chunk_steps, ga.num_steps))
        sides_a, sides_b = _read(ga, stream, steps), _read(gb, stream, steps)
        group: list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        entries = 0
        for offset, t in enumerate(steps):
            rows, chosen_rows, tokens = _step_rows(ga, plan, t)
            if rows.numel() == 0:
                continue
            for side in (sides_a[offset], sides_b[offset]):
                if side.topk is None and tokens.numel() and int(tokens.max()) >= side.full.shape[-1]:
                    raise CompareError(f"step {t}: token {int(tokens.max())} lies outside the {side.full.shape[-1]} "
                                       "entries per row: the recordings do not share a vocabulary.")
            width = max(side.full.shape[-1] if side.full is not None else side.width for side in
                        (sides_a[offset], sides_b[offset]))
            if group and entries + rows.numel() * width > group_entries(sides_a[offset], sides_b[offset]):
                yield _group_values(ga, gb, group, sides_a, sides_b, per_row, ids, workspace)
                group, entries = [], 0
            group.append((offset, t, rows, chosen_rows, tokens))
            entries += rows.numel() * width
        if group:
            yield _group_values(ga, gb, group, sides_a, sides_b, per_row, ids, workspace)


def _step_rows(ga: Any, plan: dict[str, Any], t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step `t`'s compared rows, the rows their chosen tokens were drawn from, and those tokens."""
    tokens = plan["tokens"][t]
    if ga.is_beam:
        rows = torch.arange(ga.num_rows)
        return rows, plan["parents"][t].clamp(min=0), torch.where(plan["parents"][t] >= 0, tokens, -1)
    rows = (torch.nonzero(~plan["finished"][t]).flatten() if plan["finished"] is not None
            else torch.arange(ga.num_rows))
    return rows, rows, tokens[rows]


def _joined(sides: list[Side]) -> Side:
    """One `Side` of several steps' rows, one after another."""
    if len(sides) == 1:
        return sides[0]
    if sides[0].topk is None:
        fulls = [side.full for side in sides]
        joined = _adjacent(fulls)
        return Side(full=torch.cat(fulls) if joined is None else joined)
    chosen = None if sides[0].chosen is None else {
        name: torch.cat([side.chosen[name] for side in sides]) for name in sides[0].chosen}
    return Side(topk={name: torch.cat([side.topk[name] for side in sides]) for name in sides[0].topk}, chosen=chosen)


def _adjacent(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """`torch.cat(tensors)` as a view, where they lie one after another in one storage (a dense stream's
    steps read from one shard); None otherwise."""
    first = tensors[0]
    storage, offset = first.untyped_storage(), first.storage_offset()
    for tensor in tensors:
        if (not tensor.is_contiguous() or tensor.dtype != first.dtype or tensor.shape[1:] != first.shape[1:]
                or tensor.untyped_storage().data_ptr() != storage.data_ptr() or tensor.storage_offset() != offset):
            return None
        offset += tensor.numel()
    rows = sum(int(tensor.shape[0]) for tensor in tensors)
    return first.new_empty(0).set_(storage, first.storage_offset(), (rows, *first.shape[1:]))


def _group_values(ga: Any, gb: Any, group: list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]],
                  sides_a: list[Side], sides_b: list[Side], per_row: int, ids: list[Any],
                  workspace: Workspace) -> dict[str, np.ndarray]:
    """The per-token columns of a group of steps, computed in one `step_values` call."""
    where, chosen, tokens, steps, before = [], [], [], [], 0
    for offset, t, rows, chosen_rows, step_tokens in group:
        side = sides_a[offset]
        where.append(rows + before)
        chosen.append(chosen_rows + before)
        tokens.append(step_tokens)
        steps.append(np.full(rows.numel(), t, np.int32))
        before += (side.full if side.topk is None else side.topk["indices"]).shape[0]
    a = _joined([sides_a[offset] for offset, *_ in group])
    b = _joined([sides_b[offset] for offset, *_ in group])
    values = step_values(a, b, torch.cat(where), torch.cat(chosen), torch.cat(tokens), workspace)
    rows = torch.cat([rows for _, _, rows, _, _ in group])
    prompt = rows // per_row
    n = int(rows.shape[0])
    return {
        "generation": np.full(n, ga.index, np.int32), "generation_b": np.full(n, gb.index, np.int32),
        "sample": np.array([ids[p] for p in prompt.tolist()], dtype=object),
        "prompt": prompt.numpy().astype(np.int32), "row": rows.numpy().astype(np.int32),
        "sequence": (np.full(n, -1, np.int32) if ga.is_beam else rows.numpy().astype(np.int32)),
        "step": np.concatenate(steps), "token": torch.cat(tokens).numpy().astype(np.int64),
        **{name: value.numpy() for name, value in values.items()},
    }


__all__ = ["CompareError", "Comparison", "compare"]
