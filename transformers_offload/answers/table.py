"""The per-token table: one row per generated token of each returned sequence, with its logprobs,
ranks and entropies under the raw logits and the processed scores, as Arrow, pandas or Parquet.

Columns, in order (a column whose stream was not recorded holds nulls):

    generation          int32    the generation (one `generate()` call) in the recording
    sample              int64 or string   the prompt's sample id: what `Recorder.set_samples` gave, else
                                 the prompt's position among every prompt of the recording (int64)
    prompt              int32    the prompt's position in its call's batch
    sequence            int32    the returned sequence's row in `out.sequences`
    step                int32    the decoding step (0: the prefill's token)
    token               int64    the chosen token id
    text                string   the token decoded alone (only with a tokenizer)
    logprob_raw         float32  under the raw logits (`out.logits`), as `logprobs(kind="raw")`
    logprob_processed   float32  under the processed scores (`out.scores`)
    rank_raw            int64    0 = the most likely
    rank_processed      int64
    entropy_raw         float32  nats
    entropy_processed   float32
    top_tokens_raw, top_logprobs_raw, top_tokens_processed, top_logprobs_processed
                        list<int64>, list<float32>   the `top` alternatives (only with `top > 0`)
    complete            bool     False in a generation `generate()` did not finish (an exception, a
                                 kill): its rows hold the tokens recorded before (`record` then
                                 records its samples again; keep `complete` rows for one per sample)
    metadata            string   the sample's metadata as JSON (only when the recording has any)

The values are those of `Generation.logprobs` (see `read.logprobs` for their torch expressions and
sources). Rows come in order of generation, then step, then sequence; the table is built a chunk of
steps at a time (`chunk_steps`), so exporting holds one chunk's tensors, not the recording.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

from ..read.logprobs import KINDS, token_chunks
from ..read.samples import sample_ids
from .table_files import table_format, write_table

KINDS_ORDER = tuple(KINDS)


def _pyarrow() -> Any:
    try:
        import pyarrow
    except ImportError as error:
        raise ImportError(
            "the per-token table needs pyarrow: `pip install 'transformers-offload[table]'` (or `pip install pyarrow`)."
        ) from error
    return pyarrow


def schema(*, top: int = 0, text: bool = False, sample_type: Any = None, metadata: bool = False) -> Any:
    """The table's `pyarrow.Schema` for these options (see the module's docstring)."""
    pa = _pyarrow()
    fields = [
        ("generation", pa.int32()), ("sample", sample_type or pa.int64()), ("prompt", pa.int32()),
        ("sequence", pa.int32()), ("step", pa.int32()), ("token", pa.int64()),
    ]
    if text:
        fields.append(("text", pa.string()))
    for name, kind in (("logprob", pa.float32()), ("rank", pa.int64()), ("entropy", pa.float32())):
        fields += [(f"{name}_{k}", kind) for k in KINDS_ORDER]
    if top:
        for k in KINDS_ORDER:
            fields += [(f"top_tokens_{k}", pa.list_(pa.int64())), (f"top_logprobs_{k}", pa.list_(pa.float32()))]
    fields.append(("complete", pa.bool_()))
    if metadata:
        fields.append(("metadata", pa.string()))
    return pa.schema(fields)


def select_generations(source: Any, generations: Sequence[int] | None) -> tuple[list[Any], list[Any]]:
    """The source's generations, and those selected."""
    if hasattr(source, "generations"):
        every = list(source.generations)
    elif hasattr(source, "logprobs") and hasattr(source, "index"):
        every = [source]  # one Generation
    else:
        raise TypeError(
            "`source` must be a Recorder, a Recording (`open_recording(path)`) or a Generation, "
            f"got {type(source).__name__}."
        )
    if generations is None:
        return every, every
    if isinstance(generations, (str, bytes)) or not len(generations):
        raise ValueError(f"`generations` must list at least one generation index (0 to {len(every) - 1}), got {generations!r}.")
    picked = []
    for index in generations:
        if isinstance(index, bool) or not isinstance(index, int) or not -len(every) <= index < len(every):
            raise ValueError(f"`generations` must list indices of recorded generations (0 to {len(every) - 1}), got {index!r}.")
        if any(every[index] is seen for seen in picked):
            raise ValueError(f"`generations` lists generation {every[index].index} twice: {list(generations)!r}.")
        picked.append(every[index])
    return every, picked


def output_path(source: Any, path: str | os.PathLike, what: str) -> Path:
    """`path` as a file to write `what` to: not a directory, not inside the recording it is made from
    (which it would damage); its directory is created if missing.

    Raises:
        ValueError: `path` lies inside the recording's directory.
        IsADirectoryError: `path` is a directory.
    """
    target = Path(path)
    root = getattr(source, "path", None) or getattr(source, "spill_dir", None)
    if root is not None and (target.resolve() == Path(root).resolve() or Path(root).resolve() in target.resolve().parents):
        raise ValueError(
            f"the {what} {str(target)!r} would be written inside the recording {str(root)!r}, whose files it could "
            "replace: write it somewhere else."
        )
    if target.is_dir():
        raise IsADirectoryError(f"the {what} {str(target)!r} is a directory: name a file to write, e.g. {str(target / 'out')!r}.")
    target.parent.mkdir(parents=True, exist_ok=True)
    return target


def record_batches(source: Any, *, generations: Sequence[int] | None = None, top: int = 0, tokenizer: Any = None,
                   chunk_steps: int = 16) -> tuple[Any, Iterator[Any]]:
    """The table's schema, and its rows as `pyarrow.RecordBatch`es, one per chunk of steps of each
    selected generation (an incomplete generation gives its rows' recorded tokens; an incomplete beam
    search, which returned no sequences, is left out).

    Args:
        source: a `Recorder`, a `Recording` or one `Generation`.
        generations (`Sequence[int]`, *optional*): which generations (default all).
        top (`int`): alternatives per token under each kind (0: none).
        tokenizer: a Hugging Face tokenizer, a local tokenizer directory or the demo model's name
            (`smollm2`): adds the `text` column (each token decoded alone).
        chunk_steps (`int`): steps read at once.

    Raises:
        TypeError: `source` is not a recorder, a recording or a generation; `tokenizer` is neither a
            tokenizer (with `decode`) nor a name. ValueError: `tokenizer` names neither a directory nor the demo model.
        ValueError: a bad `generations`, `top` or `chunk_steps`.
        ImportError: pyarrow is not installed.
    """
    pa = _pyarrow()
    every, picked = select_generations(source, generations)
    from ..demo_model import load_tokenizer  # here: `python -m transformers_offload.demo_model` imports the package first

    tokenizer = load_tokenizer(tokenizer)  # a tokenizer, a directory or the demo model's name
    ids = dict(zip(map(id, every), sample_ids(every)))  # a lone Generation numbers its own prompts
    as_text = any(isinstance(i, str) for per_call in ids.values() for i in per_call)
    has_metadata = any(g.sample_metadata for g in every)
    table_schema = schema(top=top, text=tokenizer is not None, sample_type=pa.string() if as_text else pa.int64(),
                          metadata=has_metadata)
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ValueError(f"`top` must be an int of at least 0, got {top!r}.")
    if isinstance(chunk_steps, bool) or not isinstance(chunk_steps, int) or chunk_steps < 1:
        raise ValueError(f"`chunk_steps` must be an int of at least 1, got {chunk_steps!r}.")

    def batches() -> Iterator[Any]:
        for generation in picked:
            if not generation.has_sequences and generation.is_beam:
                continue  # an incomplete beam search: no returned sequences to follow
            per_prompt = generation.num_return_sequences
            call_ids = ids[id(generation)]
            metadata = generation.sample_metadata
            for chunk in token_chunks(generation, top=top, chunk_steps=chunk_steps, strict=False):
                n = int(chunk["sequence"].shape[0])
                prompt = (chunk["sequence"] // per_prompt).tolist()
                columns: dict[str, Any] = {
                    "generation": pa.array([generation.index] * n, pa.int32()),
                    "sample": pa.array([str(call_ids[p]) if as_text else call_ids[p] for p in prompt],
                                       table_schema.field("sample").type),
                    "prompt": pa.array(prompt, pa.int32()),
                    "sequence": pa.array(chunk["sequence"], pa.int32()),
                    "step": pa.array(chunk["step"], pa.int32()),
                    "token": pa.array(chunk["token"], pa.int64()),
                }
                if tokenizer is not None:
                    columns["text"] = pa.array([tokenizer.decode([y]) for y in chunk["token"].tolist()], pa.string())
                for name in ("logprob", "rank", "entropy"):
                    for kind in KINDS_ORDER:
                        columns[f"{name}_{kind}"] = _column(pa, chunk.get(f"{name}_{kind}"),
                                                            table_schema.field(f"{name}_{kind}").type, n)
                if top:
                    for kind in KINDS_ORDER:
                        for name, kind_type in (("top_tokens", pa.int64()), ("top_logprobs", pa.float32())):
                            columns[f"{name}_{kind}"] = _list_column(pa, chunk.get(f"{name}_{kind}"), kind_type, n)
                columns["complete"] = pa.array([generation.complete] * n, pa.bool_())
                if has_metadata:
                    texts = [json.dumps(m, sort_keys=True) for m in metadata] if metadata else None
                    columns["metadata"] = pa.array([texts[p] if texts else None for p in prompt], pa.string())
                yield pa.RecordBatch.from_arrays([columns[f.name] for f in table_schema], schema=table_schema)

    return table_schema, batches()


def _column(pa: Any, values: Any, kind: Any, n: int) -> Any:
    if values is None:
        return pa.nulls(n, kind)
    return pa.array(values, kind)


def _list_column(pa: Any, values: Any, kind: Any, n: int) -> Any:
    if values is None:
        return pa.nulls(n, pa.list_(kind))
    width = values.shape[1]
    offsets = pa.array(range(0, (n + 1) * width, width) if width else [0] * (n + 1), pa.int32())
    return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1), kind))


def to_arrow(source: Any, *, generations: Sequence[int] | None = None, top: int = 0, tokenizer: Any = None,
             chunk_steps: int = 16) -> Any:
    """The per-token table as one `pyarrow.Table` (held in memory: for a big recording, `write_parquet`).

    Args and raises: see `record_batches`.

    Example:
        >>> table = to_arrow(open_recording("run"))  # doctest: +SKIP
        >>> table.column_names[:6]  # doctest: +SKIP
        ['generation', 'sample', 'prompt', 'sequence', 'step', 'token']
    """
    pa = _pyarrow()
    table_schema, batches = record_batches(source, generations=generations, top=top, tokenizer=tokenizer,
                                           chunk_steps=chunk_steps)
    return pa.Table.from_batches(list(batches), schema=table_schema)


def to_pandas(source: Any, **options: Any) -> Any:
    """The per-token table as a `pandas.DataFrame` (options as in `to_arrow`); needs pandas."""
    try:
        import pandas  # noqa: F401  (pyarrow's to_pandas imports it)
    except ImportError as error:
        raise ImportError("`to_pandas` needs pandas: `pip install pandas`.") from error
    return to_arrow(source, **options).to_pandas()


def write_parquet(source: Any, path: str | os.PathLike, *, generations: Sequence[int] | None = None, top: int = 0,
                  tokenizer: Any = None, chunk_steps: int = 16) -> dict[str, int]:
    """Write the per-token table to a file, a chunk of steps at a time (memory bounded by a chunk), in the
    format its extension names: `.parquet`, `.csv` (no `top`: its columns hold lists) or `.jsonl`.

    The file appears whole or not at all: it is written beside `path` and renamed into place. A Parquet file loads
    with `pyarrow.parquet.read_table`, `pandas.read_parquet` or Hugging Face `datasets`
    (`Dataset.from_parquet(path)`).

    Returns:
        `dict`: `rows` (tokens written) and `bytes` (the file's size).

    Raises:
        as `record_batches`; `ValueError` for another extension (or CSV with `top`), before any work;
        `OSError` when the file cannot be written (nothing is left behind).
    """
    _pyarrow()
    target = output_path(source, path, "table")
    table_format(target)  # an unknown extension is refused before any work
    table_schema, batches = record_batches(source, generations=generations, top=top, tokenizer=tokenizer,
                                           chunk_steps=chunk_steps)
    return write_batches(target, table_schema, batches)


def write_batches(target: Path, table_schema: Any, batches: Iterator[Any]) -> dict[str, int]:
    """Write record batches to `target` as they come, in the format its extension names (Parquet, CSV,
    JSON Lines: `table_files`), whole or not at all. Returns `rows` and `bytes`."""
    return write_table(target, table_schema, batches)
