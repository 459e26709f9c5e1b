"""The prompt-token table: one row per scored prompt token of each prompt (recorded with
`Recorder(..., prompt_logprobs=True | k)` or `record --prompt-logprobs`), as Arrow, pandas or Parquet.

Columns, in order:

    generation      int32    the generation (one `generate()` call) in the recording
    sample          int64 or string   the prompt's sample id (as in the per-token table)
    prompt          int32    the prompt's position in its call's batch
    position        int32    the token's index among the prompt's tokens without padding (from 1: the
                             first token has no context)
    token           int64    the prompt's token
    text            string   the token decoded alone (only with a tokenizer)
    logprob         float32  its logprob given the tokens before it (nats), as `prompt_logprobs()`
    rank            int64    0 = the most likely
    top_tokens, top_logprobs   list<int64>, list<float32>   the top-k (only when recorded with k)
    complete        bool     False in a generation `generate()` did not finish
    metadata        string   the sample's metadata as JSON (only when the recording has any)

Generations recorded without prompt logprobs give no rows. The tensors are read one generation at a
time (they are small: `prompts x prompt_length x (k + 2)` values).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator, Sequence

from ..read.samples import sample_ids
from .table import _pyarrow, output_path, select_generations, write_batches
from .table_files import table_format


def prompt_schema(*, top: bool, text: bool, sample_type: Any, metadata: bool) -> Any:
    """The prompt table's `pyarrow.Schema` for these options (see the module's docstring)."""
    pa = _pyarrow()
    fields = [("generation", pa.int32()), ("sample", sample_type), ("prompt", pa.int32()), ("position", pa.int32()),
              ("token", pa.int64())]
    if text:
        fields.append(("text", pa.string()))
    fields += [("logprob", pa.float32()), ("rank", pa.int64())]
    if top:
        fields += [("top_tokens", pa.list_(pa.int64())), ("top_logprobs", pa.list_(pa.float32()))]
    fields.append(("complete", pa.bool_()))
    if metadata:
        fields.append(("metadata", pa.string()))
    return pa.schema(fields)


def prompt_batches(source: Any, *, generations: Sequence[int] | None = None,
                   tokenizer: Any = None) -> tuple[Any, Iterator[Any]]:
    """The prompt table's schema, and its rows as one `pyarrow.RecordBatch` per generation that holds
    prompt logprobs.

    Raises:
        TypeError: `source` is not a recorder, a recording or a generation; `tokenizer` is neither a
            tokenizer (with `decode`) nor a name. ValueError: `tokenizer` names neither a directory nor the demo model.
        ValueError: a bad `generations`, or no selected generation holds prompt logprobs (record them
            with `prompt_logprobs=True`).
        ImportError: pyarrow is not installed.
    """
    pa = _pyarrow()
    every, picked = select_generations(source, generations)
    from ..demo_model import load_tokenizer  # here: `python -m transformers_offload.demo_model` imports the package first

    tokenizer = load_tokenizer(tokenizer)  # a tokenizer, a directory or the demo model's name
    scored = [g for g in picked if "prompt_logprobs" in g.once_streams]
    if not scored:
        raise ValueError("no selected generation holds prompt logprobs: record them with "
                         "`Recorder(..., prompt_logprobs=True)` (or `record --prompt-logprobs`).")
    ids = dict(zip(map(id, every), sample_ids(every)))
    as_text = any(isinstance(i, str) for per_call in ids.values() for i in per_call)
    has_top = any("prompt_top_tokens" in g.once_streams for g in scored)
    has_metadata = any(g.sample_metadata for g in every)
    table_schema = prompt_schema(top=has_top, text=tokenizer is not None, metadata=has_metadata,
                                 sample_type=pa.string() if as_text else pa.int64())

    def batches() -> Iterator[Any]:
        for generation in scored:
            found = generation.prompt_tensors()
            tokens = found["prompt_tokens"]
            keep = tokens >= 0  # padding, and each prompt's first token, are not scored
            prompt_of, column = keep.nonzero(as_tuple=True)
            # Position among the prompt's tokens without padding: 1 for the first scored one.
            positions = keep.long().cumsum(-1)[keep]
            n = int(prompt_of.shape[0])
            call_ids = ids[id(generation)]
            prompts = prompt_of.tolist()
            columns: dict[str, Any] = {
                "generation": pa.array([generation.index] * n, pa.int32()),
                "sample": pa.array([str(call_ids[p]) if as_text else call_ids[p] for p in prompts],
                                   table_schema.field("sample").type),
                "prompt": pa.array(prompts, pa.int32()),
                "position": pa.array(positions.numpy(), pa.int32()),
                "token": pa.array(tokens[keep].numpy(), pa.int64()),
                "logprob": pa.array(found["prompt_logprobs"][keep].numpy(), pa.float32()),
                "rank": pa.array(found["prompt_ranks"][keep].numpy(), pa.int64()),
            }
            if tokenizer is not None:
                columns["text"] = pa.array([tokenizer.decode([y]) for y in tokens[keep].tolist()], pa.string())
            if has_top:
                for name, kind in (("top_tokens", pa.int64()), ("top_logprobs", pa.float32())):
                    values = found.get(f"prompt_{name}")
                    if values is None:
                        columns[name] = pa.nulls(n, pa.list_(kind))
                        continue
                    width = values.shape[-1]
                    offsets = pa.array(range(0, (n + 1) * width, width) if width else [0] * (n + 1), pa.int32())
                    columns[name] = pa.ListArray.from_arrays(offsets, pa.array(values[keep].reshape(-1).numpy(), kind))
            columns["complete"] = pa.array([generation.complete] * n, pa.bool_())
            if has_metadata:
                metadata = generation.sample_metadata
                texts = [json.dumps(m, sort_keys=True) for m in metadata] if metadata else None
                columns["metadata"] = pa.array([texts[p] if texts else None for p in prompts], pa.string())
            yield pa.RecordBatch.from_arrays([columns[f.name] for f in table_schema], schema=table_schema)

    return table_schema, batches()


def prompt_arrow(source: Any, *, generations: Sequence[int] | None = None, tokenizer: Any = None) -> Any:
    """The prompt-token table as one `pyarrow.Table`; see `prompt_batches` for the arguments and errors.

    Example:
        >>> prompt_arrow(open_recording("run")).column_names[:5]  # doctest: +SKIP
        ['generation', 'sample', 'prompt', 'position', 'token']
    """
    pa = _pyarrow()
    table_schema, batches = prompt_batches(source, generations=generations, tokenizer=tokenizer)
    return pa.Table.from_batches(list(batches), schema=table_schema)


def write_prompt_parquet(source: Any, path: str | os.PathLike, *, generations: Sequence[int] | None = None,
                         tokenizer: Any = None) -> dict[str, int]:
    """Write the prompt-token table to a Parquet file, whole or not at all (written beside `path`, then
    renamed). Returns `rows` and `bytes`; raises as `prompt_batches`, and `OSError` when the file
    cannot be written."""
    _pyarrow()
    target = output_path(source, path, "table")
    table_format(target)  # an unknown extension is refused before any work
    table_schema, batches = prompt_batches(source, generations=generations, tokenizer=tokenizer)
    return write_batches(target, table_schema, batches)
