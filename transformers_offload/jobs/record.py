"""Recording a whole prompts file: batches of left-padded prompts through a stock `generate()` with a
`Recorder`, each row keyed by its sample id, resumable after a crash, Ctrl-C or SIGKILL.

`record(model, tokenizer, prompts, out, ...)` is what `python -m transformers_offload record` runs. The
prompts come from a JSON Lines or Parquet file, a saved Hugging Face dataset, or a list; each has a
text or a chat (`messages`) and, optionally, an id (else its position in the file). Every batch is one
generation of the recording in `out`, its prompts named with `Recorder.set_samples`. Run it again on
the same `out` and it appends: the samples of every complete generation are skipped, the others
(those of a batch a crash interrupted included) are recorded, so each sample ends up in exactly one
complete generation. A run refuses to start while another process is still recording any of the
samples it would record (`claims`), so two runs at once never record one sample twice.

Under `torchrun` or `accelerate launch` each process records its own share of the prompts into
`out/rank-R` (`parallel`); `open_recording(out)` reads every rank as one recording.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import RecordingError, verify_command
from ..read.reader import open_recording
from ..recorder import Recorder
from ..store.layout import MANIFEST, rank_directories, rank_directory
from ..store.location import local_directory
from .claims import claim
from .parallel import process_rank, share, wait_for_every_rank


def read_prompts(source: str | os.PathLike | Sequence[Any], *, text_column: str | None = None,
                 messages_column: str | None = None, id_column: str | None = None) -> list[tuple[Any, Any]]:
    """The prompts of `source` as `(sample id, prompt)` pairs, in order; a prompt is a string or a chat
    (a list of `{"role", "content"}` messages).

    Args:
        source: a `.jsonl` / `.json` file (one JSON object per line), a `.parquet` file, a directory saved
            by `datasets.Dataset.save_to_disk`, or a list of dicts (or of strings).
        text_column (`str`, *optional*): the column holding text prompts (default `text`).
        messages_column (`str`, *optional*): the column holding chats (default `messages`); used when
            there is no text column.
        id_column (`str`, *optional*): the column of sample ids (str or int); by default `id` where the
            rows have one, else a prompt's id is its position (0-based line number). A column named
            here must exist.

    Raises:
        FileNotFoundError: `source` does not exist.
        ValueError: an unknown file type, a line that is not a JSON object, no prompt column or a named
            column missing (the message lists the columns found), an empty prompt, or repeated ids.
    """
    rows = _rows(source)
    if not rows:
        raise ValueError(f"`prompts` {_name(source)} holds no prompts.")
    columns = set().union(*(row.keys() for row in rows)) if isinstance(rows[0], dict) else set()
    if not isinstance(rows[0], dict):
        column = None
    elif text_column is not None or messages_column is not None:
        column = text_column or messages_column
        if column not in columns:
            raise ValueError(f"`prompts` {_name(source)} has no column {column!r} (columns: {sorted(columns)}).")
    else:
        column = "text" if "text" in columns else "messages" if "messages" in columns else None
        if column is None:
            raise ValueError(
                f"`prompts` {_name(source)} has no `text` or `messages` column (columns: {sorted(columns)}); name "
                "yours with `text_column=` / `messages_column=` (`--text-column`, `--messages-column`)."
            )
    if id_column is not None and isinstance(rows[0], dict) and id_column not in columns:
        raise ValueError(f"`prompts` {_name(source)} has no id column {id_column!r} (columns: {sorted(columns)}); "
                         "leave `id_column` out to number the prompts by line.")
    id_column = id_column or "id"
    found = []
    for number, row in enumerate(rows):
        prompt = row if column is None else row.get(column)
        if isinstance(prompt, str) and prompt:
            pass
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "content" in m for m in prompt):
            pass
        else:
            raise ValueError(f"prompt {number} of {_name(source)} has no text or chat in `{column}`: {prompt!r}.")
        sample = row.get(id_column, number) if isinstance(row, dict) else number
        if isinstance(sample, bool) or not isinstance(sample, (str, int)):
            raise ValueError(f"prompt {number} of {_name(source)}: its id `{id_column}` must be a str or int, got {sample!r}.")
        found.append((sample, prompt))
    ids = [str(sample) for sample, _ in found]
    if len(set(ids)) != len(ids):
        repeated = sorted({i for i in ids if ids.count(i) > 1})[:5]
        raise ValueError(f"`prompts` {_name(source)} repeats sample ids {repeated}: each prompt needs its own id.")
    return found


def _name(source: Any) -> str:
    return repr(str(source)) if isinstance(source, (str, os.PathLike)) else f"(a {type(source).__name__})"


def _rows(source: Any) -> list[Any]:
    if not isinstance(source, (str, os.PathLike)):
        return list(source)
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"`prompts` {str(path)!r} does not exist.")
    if path.is_dir():
        try:
            import datasets
        except ImportError as error:
            raise ImportError("reading a saved dataset needs `datasets`: `pip install datasets`.") from error
        return list(datasets.load_from_disk(str(path)))
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        rows = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as error:
                raise ValueError(f"{str(path)!r} line {number + 1} is not JSON ({error}).") from None
            if not isinstance(row, (dict, str)):
                raise ValueError(f"{str(path)!r} line {number + 1} must be a JSON object, got {type(row).__name__}.")
            rows.append(row)
        return rows
    raise ValueError(f"`prompts` {str(path)!r}: expected a .jsonl, .json or .parquet file, or a saved dataset's directory.")


def recorded_samples(out: str | os.PathLike) -> set[str]:
    """The sample ids (as text) of every complete generation in the recording at `out`, every rank's
    included (empty if none).

    Raises:
        RecordingError: a file of the recording is missing or not of the size it was written with: a
            resume would count its samples as recorded; it names the files and what to do.
    """
    if not (Path(out) / MANIFEST).is_file() and not rank_directories(Path(out)):
        return set()
    with open_recording(out) as run:
        damaged = [d["file"] for g in run.describe()["generations"] for d in g.get("damaged_files") or ()]
        if damaged:
            raise RecordingError(Path(out), (
                f"{len(damaged)} file(s) of this recording are damaged ({', '.join(sorted(set(damaged))[:5])}), so "
                f"`record` cannot tell which samples it holds; nothing was recorded. Check it with `{verify_command(out)}`, "
                "then record into a new `out` (or move the damaged recording aside)."
            ))
        return {str(sample) for generation in run.generations if generation.complete
                for sample in (generation.sample_ids or ())}


def check_generate_options(options: dict[str, Any], *, spelled: Callable[[str], str] = "`{}`".format) -> None:
    """Refuse the `generate()` options that transformers itself refuses only once a call runs, so that `record`
    refuses them before it writes anything: the decoding processors' own checks (their constructors:
    `TemperatureLogitsWarper`, `TopPLogitsWarper`, `TopKLogitsWarper`, `RepetitionPenaltyLogitsProcessor`), and
    counts that must be positive ints. Options it does not know are left to `generate()`. `spelled` writes an
    option's name in the message (the command line gives its flag).

    Raises:
        ValueError: naming the option, its value and what it must be.
    """
    from transformers import RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    for name in ("max_new_tokens", "num_beams", "num_return_sequences"):
        value = options.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{spelled(name)} must be a positive int, got {value!r}.")
    processors = {"temperature": TemperatureLogitsWarper, "top_p": TopPLogitsWarper, "top_k": TopKLogitsWarper,
                  "repetition_penalty": RepetitionPenaltyLogitsProcessor}
    for name, processor in processors.items():
        if options.get(name) is not None and not (name == "top_k" and options[name] == 0):  # top_k=0: no top-k
            try:
                processor(options[name])
            except ValueError as error:
                raise ValueError(f"{spelled(name)} {options[name]!r} is refused by transformers' {processor.__name__}: "
                                 f"{error}") from None
    returned, beams = options.get("num_return_sequences") or 1, options.get("num_beams") or 1
    if returned > beams and not options.get("do_sample"):
        raise ValueError(f"{spelled('num_return_sequences')} {returned} is more than {spelled('num_beams')} {beams} "
                         f"without sampling: search returns at most one sequence per beam (raise {spelled('num_beams')}, "
                         "or sample).")


def record(model: Any, tokenizer: Any, prompts: str | os.PathLike | Sequence[Any], out: str | os.PathLike, *,
           batch_size: int = 8, text_column: str | None = None, messages_column: str | None = None,
           id_column: str | None = None, chat: bool = False, progress: bool = True, seed: int | None = 0,
           recorder_options: dict[str, Any] | None = None, rank: int | None = None, world_size: int | None = None,
           **generate_options: Any) -> dict[str, Any]:
    """Record every prompt of `prompts` into the recording at `out`, `batch_size` prompts per
    `generate()` call, resuming where an earlier run stopped.

    Args:
        model: a causal LM (`GenerationMixin`). tokenizer: its tokenizer (set to pad on the left).
        prompts, text_column, messages_column, id_column: see `read_prompts`.
        out (`str | os.PathLike`): the recording directory: created, or appended to when it holds one.
        batch_size (`int`): prompts per call.
        chat (`bool`): wrap text prompts as a user message in the tokenizer's chat template (chats
            always are).
        progress (`bool`): show a progress bar (tqdm) with prompts and new tokens per second.
        seed (`int | None`): `torch.manual_seed(seed + first prompt's position)` before each call, so a
            resumed run samples each batch as the first run would (None: leave the seed alone).
        recorder_options (`dict`): the Recorder's options (`streams`, `encodings`, `layers`...).
        rank, world_size (`int`, *optional*): this process's data-parallel rank and the number of
            processes; by default from torch.distributed or torchrun's environment (`parallel.process_rank`),
            else a single process. With more than one, this rank records its block of the prompts
            (`parallel.share`) into `out/rank-R`, skipping those any rank already completed, then waits
            for the others when a process group is initialised.
        **generate_options: passed to every `generate()` call (`max_new_tokens=64`, `do_sample=True`...).

    Returns:
        `dict`: `recorded` (samples recorded now), `skipped` (already complete), `generations` (calls
        made now), `new_tokens` (tokens generated now) and `seconds`, counted over this rank's share;
        `rank` and `world_size`.

    Raises:
        ValueError: bad prompts (see `read_prompts`), `batch_size` or generate options (`check_generate_options`,
            before anything is written); `recorder_options` naming
            `spill_dir` or `append` (record sets them); a bad rank (see `parallel.process_rank`); several
            ranks over an `out` that one process recorded into directly; an `out` holding generations recorded
            without sample ids.
        FileExistsError: `out` is a file.
        RecordingError: `out` holds a recording with a missing or resized file (`recorded_samples`).
        BlockingIOError: another process is recording samples this one would record into `out`,
            whatever its rank or world size (an earlier `record` or `torchrun` still running; the
            message names its pid, host, rank and command: wait for it or stop it, then run again), or
            holds this rank's directory open (`Recorder(spill_dir=..., append=True)` elsewhere).
    """
    import torch

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive int, got {batch_size!r}.")
    out = local_directory(out, "`out`")
    options = dict(recorder_options or {})
    if {"spill_dir", "append"} & set(options):
        raise ValueError("`recorder_options` must not name `spill_dir` or `append`: `record` writes to `out`.")
    check_generate_options(generate_options)
    rank, world_size = process_rank(rank, world_size)
    found = read_prompts(prompts, text_column=text_column, messages_column=messages_column, id_column=id_column)
    if Path(out).exists() and not Path(out).is_dir():
        raise FileExistsError(f"`out` {str(out)!r} is not a directory: `record` writes a recording directory. "
                              "Pick another path.")
    refuse_generations_without_ids(Path(out))
    target = target_directory(Path(out), rank, world_size)
    positions = {str(sample): number for number, (sample, _) in enumerate(found)}
    mine = [found[position] for position in share(len(found), rank, world_size)]

    def missing() -> list[str]:  # read once the running writers' claims are known (see `claims`)
        done = recorded_samples(out)
        return [str(sample) for sample, _ in mine if str(sample) not in done]

    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    with claim(Path(out), missing, rank=rank, world_size=world_size, target=target) as claimed:
        claimed = set(claimed)
        pending = [(sample, prompt) for sample, prompt in mine if str(sample) in claimed]
        bar = _bar(len(mine), len(mine) - len(pending), progress and rank == 0,
                   "record" if world_size == 1 else f"record (rank 0 of {world_size})")
        start, new_tokens, calls = time.perf_counter(), 0, 0
        with Recorder(model, spill_dir=target, append=True, **options) as rec:
            for first in range(0, len(pending), batch_size):
                batch = pending[first:first + batch_size]
                texts = [_text(tokenizer, prompt, chat) for _, prompt in batch]
                templated = chat or any(isinstance(prompt, list) for _, prompt in batch)  # the template adds them
                enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not templated)
                enc = {name: value.to(model.device) for name, value in enc.items()}
                rec.set_samples([sample for sample, _ in batch])
                if seed is not None:
                    torch.manual_seed(seed + positions[str(batch[0][0])])
                sequences = model.generate(**enc, logits_processor=[rec], pad_token_id=tokenizer.pad_token_id,
                                           **generate_options)
                sequences = getattr(sequences, "sequences", sequences)
                new_tokens += _new_tokens(sequences[:, enc["input_ids"].shape[1]:], rec.generation().eos_token_id)
                calls += 1
                if bar is not None:
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.update(len(batch))
                    bar.set_postfix_str(f"{(first + len(batch)) / elapsed:.2f} prompts/s, "
                                        f"{new_tokens / elapsed:.1f} tokens/s")
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - start
    wait_for_every_rank()
    return {"recorded": len(pending), "skipped": len(mine) - len(pending), "generations": calls,
            "new_tokens": new_tokens, "seconds": seconds, "rank": rank, "world_size": world_size}


def refuse_generations_without_ids(out: Path) -> None:
    """`record` keys every prompt by its sample id; a generation recorded without ids (the Python API without
    `Recorder.set_samples`) reads back with default ids, its prompts' running count, which `record`'s own ids
    (line numbers, where the prompts have none) would repeat, and `record` cannot tell which prompts it holds."""
    if not (out / MANIFEST).is_file() and not rank_directories(out):
        return
    with open_recording(out) as run:
        unnamed = [generation.index for generation in run.generations if generation.sample_ids is None]
    if unnamed:
        raise ValueError(f"`out` {str(out)!r} holds {len(unnamed)} generation(s) recorded without sample ids (generation "
                         f"{', '.join(map(str, unnamed[:5]))}{'...' if len(unnamed) > 5 else ''}; the Python API without "
                         "`Recorder.set_samples`): `record` cannot tell which prompts they hold, and its ids would repeat "
                         "their default ones. Record into another `out`.")


def _new_tokens(generated: Any, eos: tuple[int, ...]) -> int:
    """Tokens generated per returned sequence through its first end-of-sequence token (the padding
    after it not counted, whatever its id)."""
    import torch

    if not eos or generated.shape[1] == 0:
        return int(generated.numel())
    is_eos = torch.isin(generated, torch.tensor(eos, device=generated.device))
    after = (is_eos.cumsum(1) - is_eos.long()) > 0  # past the first one
    return int((~after).sum())


def target_directory(out: Path, rank: int, world_size: int) -> Path:
    """Where this rank writes (`record`, `rescoring.run`): `out` itself for a single process (unless ranks
    already wrote there), else `out/rank-R`."""
    if world_size == 1 and not rank_directories(out):
        return out
    if (out / MANIFEST).is_file():
        raise ValueError(
            f"`out` {str(out)!r} holds a recording one process wrote; {world_size} ranks record into "
            "rank sub-directories of a new `out`: resume this one with a single process, or pick another `out`."
        )
    return out / rank_directory(rank)


def run_share(out: Path, keys: list[list[str]], *, rank: int, world_size: int,
              work: Callable[[Path, list[int]], None]) -> tuple[list[int], list[int]]:
    """Units of work (`rescoring.run`'s generations, `score`'s batches), each named by its samples' ids as
    text (`keys[i]`; [] for a unit without ids, always done): this rank's share (`parallel.share`), less
    the units `out` holds complete, claimed (`claims`) while `work(target, todo)` does them into this
    rank's directory; then every rank is waited for. Returns `(mine, todo)`: the share and the units done now.

    Raises: as `claim` (BlockingIOError: another process holds some of these samples) and
    `target_directory`."""
    target = target_directory(out, rank, world_size)
    mine = list(share(len(keys), rank, world_size))

    def pending() -> list[str]:  # read once the running writers' claims are known (see `claims`)
        done = recorded_samples(out)
        return [sample for index in mine for sample in keys[index] if not set(keys[index]) <= done]

    with claim(out, pending, rank=rank, world_size=world_size, target=target) as claimed:
        claimed = set(claimed)
        todo = [index for index in mine if not keys[index] or set(keys[index]) & claimed]
        if todo:
            work(target, todo)
    wait_for_every_rank()
    return mine, todo


def _text(tokenizer: Any, prompt: Any, chat: bool) -> str:
    if isinstance(prompt, str) and not chat:
        return prompt
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this tokenizer has no chat template: give text prompts without `chat`.")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _bar(total: int, done: int, show: bool, desc: str) -> Any:
    if not show:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, unit="prompt", desc=desc)
