"""The distillation table: one row per token a teacher scored, with the teacher's top-K ids, their
log-probabilities and the log of the probability outside them (the tail), as Arrow or Parquet, for a
training loop (`transformers_offload.distill`: `kd_loss`, `KDCollator`).

Columns, in order:

    generation    int32    the generation (one `generate()` call) in the recording
    sample        int64 or string   the prompt's sample id (as in the per-token table)
    sequence      int32    the row of `out.sequences` whose tokens `input_ids` and `token` are (for a
                           prompt token: the prompt's first returned sequence, `prompt x num_return_sequences`)
    position      int32    the token's index among the sequence's tokens without padding (0: the prompt's
                           first token); `len(input_ids) == position`
    token         int64    the token at `position`: a generated token, or with `prompt=True` a prompt token
    input_ids     list<int64>    the tokens before it: the prompt without its padding, then the generated
                           tokens before it (what a student reads to predict `token`)
    top_ids       list<int64>    the teacher's K most likely next tokens, most likely first
    top_logprobs  list<float32>  their log-probabilities under the teacher (nats)
    tail_logmass  float32  log of the teacher's probability outside `top_ids`, `log(1 - sum(exp(top_logprobs)))`
                           (-inf when nothing is outside: K = vocabulary)

Two sources:
- completions (default): the generated steps, from the `logits` stream (the raw logits, `out.logits`).
  A dense (or sparse) stream gives `torch.topk(torch.log_softmax(x.float(), -1), K)` and the tail as
  `torch.logsumexp` of the other entries; a `topk:K` stream gives its `logprobs` and `indices` and the
  tail as `log(mass_outside)` (with `top` < K, the dropped entries' mass added back). A lossy
  `topk:K:qB` stream's K probabilities are first rescaled by one factor per row so that with the exact
  `mass_outside` they sum to 1 (`_from_topk`; decoded as they are, they were off 1 by up to 1.4% at q8
  and 64% at q2 on SmolLM2), which `kd_loss` requires. A teacher's own
  completions come from recording its `generate()`; its scores on another model's completions from
  `transformers_offload.rescore(recording, teacher)`, whose result exports the same way.
- prompt tokens (`prompt=True`): the teacher's scores on a given text, recorded with
  `Recorder(..., prompt_logprobs=k)` (or `record --prompt-logprobs K`): the top-k `prompt_top_logprobs`,
  and the tail `log1p(-sum(exp(top_logprobs)))` in float64. The recording keeps no logsumexp there, so a
  tail below about 1e-6 (float32 rounding of the k logprobs) reads as that rounding's size, or -inf.

Rows come by generation, then step (or prompt), then sequence. Incomplete generations (no returned
sequences: no prompt ids to rebuild `input_ids`) and encoder-decoder models are not supported.
`input_ids` repeats each sequence's prefix in every row (Parquet stores about `L^2 / 2` ids per
sequence of `L` tokens); `distill.group_sequences` joins a sequence's rows back into one example.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Sequence

import torch

from ..codecs.spec import topk_bits, topk_width
from ..read.logprobs import token_positions
from ..read.samples import sample_ids
from .table import _pyarrow, output_path, select_generations, write_batches
from .table_files import table_format

DEFAULT_TOP = 20


def kd_schema(*, sample_type: Any = None) -> Any:
    """The distillation table's `pyarrow.Schema` (see the module's docstring)."""
    pa = _pyarrow()
    return pa.schema([
        ("generation", pa.int32()), ("sample", sample_type or pa.int64()), ("sequence", pa.int32()),
        ("position", pa.int32()), ("token", pa.int64()), ("input_ids", pa.list_(pa.int64())),
        ("top_ids", pa.list_(pa.int64())), ("top_logprobs", pa.list_(pa.float32())), ("tail_logmass", pa.float32()),
    ])


def kd_batches(source: Any, *, generations: Sequence[int] | None = None, top: int | None = None,
               prompt: bool = False, chunk_steps: int = 16) -> tuple[Any, Iterator[Any]]:
    """The distillation table's schema, and its rows as `pyarrow.RecordBatch`es (one per chunk of
    steps of each generation; with `prompt=True`, one per generation).

    Args:
        source: a `Recorder`, a `Recording` or one `Generation`.
        generations (`Sequence[int]`, *optional*): which generations (default all complete ones).
        top (`int`, *optional*): K, the teacher's ids kept per token. Default: 20 from dense logits, the
            recorded K from a `topk:K` stream or from prompt logprobs recorded with `prompt_logprobs=k`.
        prompt (`bool`): the prompt tokens' rows (prompt logprobs) instead of the generated tokens'.
        chunk_steps (`int`): steps read at once.

    Raises:
        TypeError: `source` is not a recorder, a recording or a generation.
        ValueError: a bad `generations`, `top` or `chunk_steps`; `top` above a recorded K; no selected
            generation is complete; the recording has no `logits` stream (or, with `prompt=True`, no top-k
            prompt logprobs: record with `prompt_logprobs=k`).
        ImportError: pyarrow is not installed.
    """
    pa = _pyarrow()
    every, picked = select_generations(source, generations)
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
        raise ValueError(f"`top` must be an int of at least 1 (the teacher's ids kept per token), got {top!r}.")
    if isinstance(chunk_steps, bool) or not isinstance(chunk_steps, int) or chunk_steps < 1:
        raise ValueError(f"`chunk_steps` must be an int of at least 1, got {chunk_steps!r}.")
    complete = [g for g in picked if g.complete and g.sequences is not None]
    if not complete:
        raise ValueError("no selected generation is complete: the distillation table needs the sequences "
                         "`generate()` returned (record again, or `record` resumes the missing samples).")
    if prompt:
        scored = [g for g in complete if "prompt_top_logprobs" in g.once_streams]
        if not scored:
            raise ValueError("no selected generation holds top-k prompt logprobs: record them with "
                             "`Recorder(..., prompt_logprobs=k)` (or `record --prompt-logprobs K`).")
    else:
        scored = [g for g in complete if "logits" in g.streams]
        if not scored:
            raise ValueError("no selected generation holds the `logits` stream (the teacher's raw logits): record "
                             "`streams=('logits', ...)`, dense or with a `topk:K` encoding, or rescore the recording "
                             "with the teacher (`transformers_offload.rescore`).")
    ids = dict(zip(map(id, every), sample_ids(every)))
    as_text = any(isinstance(i, str) for per_call in ids.values() for i in per_call)
    table_schema = kd_schema(sample_type=pa.string() if as_text else pa.int64())

    def batches() -> Iterator[Any]:
        for generation in scored:
            call_ids = [str(i) if as_text else i for i in ids[id(generation)]]
            parts = _prompt_rows(generation, top) if prompt else _completion_rows(generation, top, chunk_steps)
            per_prompt = generation.num_return_sequences
            for part in parts:
                samples = [call_ids[j // per_prompt] for j in part["sequence"]]
                yield _record_batch(pa, table_schema, generation.index, samples, part)

    return table_schema, batches()


def _prompts_without_padding(generation: Any) -> list[list[int]]:
    """Each prompt's ids without its left padding (from `sequences`, one row per returned sequence)."""
    per_prompt = generation.num_return_sequences
    padded = generation.sequences[:, :generation.prompt_length]
    lengths = generation.prompt_lengths
    prompts = []
    for p in range(padded.shape[0] // per_prompt):
        row = padded[p * per_prompt].tolist()
        prompts.append(row if lengths is None else row[len(row) - lengths[p]:])
    return prompts


def _completion_rows(generation: Any, top: int | None, chunk_steps: int) -> Iterator[dict[str, Any]]:
    """The generated tokens' rows, a chunk of steps at a time."""
    width = topk_width(generation.encodings.get("logits", ""))
    lossy = width is not None and topk_bits(generation.encodings["logits"]) is not None
    if top is not None and width is not None and top > width:
        raise ValueError(f"`top` must be at most the recorded K ({width}: logits recorded as "
                         f"{generation.encodings['logits']!r}), got {top}.")
    k = top or (width if width is not None else DEFAULT_TOP)
    per_prompt = generation.num_return_sequences
    prompts = _prompts_without_padding(generation)
    rows, tokens, lengths = (torch.from_numpy(part.copy()) for part in token_positions(generation))
    generated = tokens.tolist()
    end = int(lengths.max()) if lengths.numel() else 0
    for start in range(0, end, chunk_steps):
        steps = range(start, min(start + chunk_steps, end))
        needed = sorted(set(rows[lengths > start][:, start:steps.stop].flatten().tolist()))
        where = torch.full((generation.num_rows or 1,), -1, dtype=torch.long)
        where[torch.tensor(needed, dtype=torch.long)] = torch.arange(len(needed))
        if width is None:
            dense = generation.logits(steps=steps, rows=needed)
            read = [_from_dense(x, k) for x in dense]
        else:
            read = [_from_topk(record, k, lossy=lossy) for record in generation.topk("logits", steps=steps, rows=needed)]
        part: dict[str, list[Any]] = {name: [] for name in ("sequence", "position", "token", "input_ids")}
        found: dict[str, list[torch.Tensor]] = {"top_ids": [], "top_logprobs": [], "tail_logmass": []}
        for offset, t in enumerate(steps):
            live = torch.nonzero(lengths > t).flatten()
            if live.numel() == 0:
                continue
            picked = where[rows[live, t]]
            for name, values in zip(found, read[offset]):
                found[name].append(values[picked])
            for j in live.tolist():
                context = prompts[j // per_prompt] + generated[j][:t]
                part["sequence"].append(j)
                part["position"].append(len(context))
                part["token"].append(generated[j][t])
                part["input_ids"].append(context)
        if part["sequence"]:
            yield {**part, **{name: torch.cat(values) for name, values in found.items()}}


def _from_dense(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k ids, their logprobs and the tail's log-mass of `(rows, vocab)` logits."""
    logprobs = torch.log_softmax(x.float(), -1)
    best = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
    rest = logprobs.scatter(-1, best.indices, float("-inf"))
    return best.indices, best.values, torch.logsumexp(rest, -1)


def _from_topk(record: dict[str, torch.Tensor], k: int, *,
               lossy: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same from a `topk:K` record (`Generation.topk`), keeping its first `k` <= K entries.

    `lossy` (a `topk:K:qB` record): its K log-probabilities are quantised while its mass outside them is
    exact, so they and that mass do not sum to 1 (by up to 1.4% at q8 and 64% at q2 on SmolLM2). The K
    probabilities are first rescaled by one factor per row so that they sum to `1 - mass_outside`
    (`logprobs + log((1 - mass_outside) / sum(exp(logprobs)))`, in float64): every target then holds the
    teacher's whole distribution, as `kd_loss` requires, with the exact mass outside kept."""
    logprobs = record["logprobs"].double()
    outside = record["mass_outside"].double()
    if lossy:
        kept = torch.logsumexp(logprobs, -1, keepdim=True)
        logprobs = logprobs + torch.log1p(-outside.clamp(max=1.0))[:, None] - kept
    tail = torch.log(outside)
    dropped = logprobs[:, k:]
    if dropped.shape[-1]:
        tail = torch.logaddexp(tail, torch.logsumexp(dropped, -1))
    return record["indices"][:, :k], logprobs[:, :k].to(record["logprobs"].dtype), tail.float()


def _prompt_rows(generation: Any, top: int | None) -> Iterator[dict[str, Any]]:
    """The prompt tokens' rows of one generation (prompt logprobs recorded with top-k)."""
    found = generation.prompt_tensors()
    tokens, top_ids, top_logprobs = found["prompt_tokens"], found["prompt_top_tokens"], found["prompt_top_logprobs"]
    width = top_ids.shape[-1]
    if top is not None and top > width:
        raise ValueError(f"`top` must be at most the recorded K of the prompt logprobs ({width}), got {top}.")
    k = top or width
    keep = tokens >= 0  # padding, and each prompt's first token, are not scored
    prompt_of, column = keep.nonzero(as_tuple=True)
    positions = keep.long().cumsum(-1)[keep]
    ids, logprobs = top_ids[keep], top_logprobs[keep].double()
    # Alternatives the vocabulary could not fill (k > vocab) are padded with -1 / NaN: not kept.
    valid = (ids >= 0) & ~torch.isnan(logprobs)
    kept = torch.where(valid[:, :k], logprobs[:, :k], torch.tensor(float("-inf"), dtype=torch.float64))
    tail = torch.log1p(-kept.exp().sum(-1).clamp(max=1.0))
    prompts = _prompts_without_padding(generation)
    per_prompt = generation.num_return_sequences
    part: dict[str, Any] = {"sequence": [], "position": [], "token": [], "input_ids": []}
    for p, position, token in zip(prompt_of.tolist(), positions.tolist(), tokens[keep].tolist()):
        part["sequence"].append(p * per_prompt)
        part["position"].append(position)
        part["token"].append(token)
        part["input_ids"].append(prompts[p][:position])
    if part["sequence"]:
        yield {**part, "top_ids": ids[:, :k], "top_logprobs": logprobs[:, :k].float(), "tail_logmass": tail.float(),
               "valid": valid[:, :k]}


def _record_batch(pa: Any, table_schema: Any, index: int, samples: list[Any], part: dict[str, Any]) -> Any:
    """One record batch of a generation's rows (`part`: the columns, the top-k as tensors; `valid`
    marks the kept alternatives where some are padding)."""
    n = len(part["sequence"])
    valid = part.get("valid")
    top_ids, top_logprobs = part["top_ids"], part["top_logprobs"]
    if valid is not None and not bool(valid.all()):
        counts = valid.sum(-1)
        offsets = pa.array([0, *counts.cumsum(0).tolist()], pa.int32())
        id_values, logprob_values = top_ids[valid].numpy(), top_logprobs[valid].numpy()
    else:
        width = top_ids.shape[-1]
        offsets = pa.array(range(0, (n + 1) * width, width) if width else [0] * (n + 1), pa.int32())
        id_values, logprob_values = top_ids.reshape(-1).numpy(), top_logprobs.reshape(-1).numpy()
    columns = {
        "generation": pa.array([index] * n, pa.int32()),
        "sample": pa.array(samples, table_schema.field("sample").type),
        "sequence": pa.array(part["sequence"], pa.int32()),
        "position": pa.array(part["position"], pa.int32()),
        "token": pa.array(part["token"], pa.int64()),
        "input_ids": pa.array(part["input_ids"], pa.list_(pa.int64())),
        "top_ids": pa.ListArray.from_arrays(offsets, pa.array(id_values, pa.int64())),
        "top_logprobs": pa.ListArray.from_arrays(offsets, pa.array(logprob_values, pa.float32())),
        "tail_logmass": pa.array(part["tail_logmass"].numpy(), pa.float32()),
    }
    return pa.RecordBatch.from_arrays([columns[f.name] for f in table_schema], schema=table_schema)


def kd_arrow(source: Any, **options: Any) -> Any:
    """The distillation table as one `pyarrow.Table` (held in memory: for a big recording,
    `write_kd_parquet`); options and errors as in `kd_batches`.

    Example:
        >>> kd_arrow(open_recording("run"), top=20).column_names[3:6]  # doctest: +SKIP
        ['position', 'token', 'input_ids']
    """
    pa = _pyarrow()
    table_schema, batches = kd_batches(source, **options)
    return pa.Table.from_batches(list(batches), schema=table_schema)


def write_kd_parquet(source: Any, path: str | os.PathLike, *, generations: Sequence[int] | None = None,
                     top: int | None = None, prompt: bool = False, chunk_steps: int = 16) -> dict[str, int]:
    """Write the distillation table to a Parquet file, a chunk of steps at a time, whole or not at all
    (written beside `path`, then renamed). It loads with `datasets.Dataset.from_parquet(path)`,
    `pyarrow.parquet.read_table` or `pandas.read_parquet`.

    Returns:
        `dict`: `rows` (tokens written) and `bytes` (the file's size).

    Raises:
        as `kd_batches`; `ValueError` when `path` lies inside the recording; `OSError` when the file cannot
        be written (nothing is left behind).

    Example:
        >>> write_kd_parquet(open_recording("run"), "kd.parquet")  # doctest: +SKIP
        {'rows': 512, 'bytes': 90211}
    """
    _pyarrow()
    target = output_path(source, path, "table")
    table_format(target)  # an unknown extension is refused before any work
    table_schema, batches = kd_batches(source, generations=generations, top=top, prompt=prompt, chunk_steps=chunk_steps)
    return write_batches(target, table_schema, batches)
