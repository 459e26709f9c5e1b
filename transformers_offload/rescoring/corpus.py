"""`score(model, texts, out)`: a text corpus scored as llama.cpp's perplexity tool scores it, each scored
position's raw logits recorded as a step, to compare a quantized (or otherwise changed) model with its
base (`compare(base, candidate)`: KL divergences, perplexities, same top token).

The windows are llama.cpp's (`tools/perplexity`, `perplexity` and `kl_divergence`): the texts are
tokenised without special tokens and their ids put one after another, after one BOS where the model's
tokenizer adds one (llama.cpp tokenises the file with `add_special`, which puts BOS first only where the
vocabulary's `add_bos` is set: a GGUF's `tokenizer.ggml.add_bos_token`, a Hugging Face tokenizer's
`add_bos_token`); window `w` is ids `[w * context, (w + 1) * context)` (a last partial window is dropped),
its first id replaced by BOS under the same rule (llama.cpp: `if (add_bos && j == 0)`), and left as it
is where the tokenizer adds none. `bos=True` or `False` overrides the tokenizer's rule either way (BOS
first and each window's first id, or neither); the positions scored are the second half,
`first = context // 2` to `context - 2`, the logits at position `j` predicting id `j + 1`: `context - 1 - context // 2`
tokens a window (255 at 512), each predicted with at least half a context before it. Step `t` of a
window is position `first + t`. Windows are batched `batch_size` at a time, one generation each (its rows
the windows, its sample ids their numbers), scored by rescore's forward path (`rescoring.forward`):
`chunk_size` positions per forward with the KV cache, one `(rows, vocab)` logits buffer, no
`(positions, vocab)` tensor kept.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from ..jobs.parallel import process_rank
from ..jobs.record import recorded_samples, run_share
from ..read.reader import open_recording
from ..recorder import Recorder
from ..store.location import local_directory
from ..store.shard_writer import shard_size
from .corpus_windows import SMALLEST_CONTEXT, window_metadata
from .forward import score_sequences

# The encodings that keep every logit bit for bit (docs/format.md): compare reads each chosen token's logprob from them.
LOSSLESS_ENCODINGS = ("dense", "native", "sparse")


def adds_bos(tokenizer: Any) -> bool:
    """Whether `tokenizer` puts its BOS first when it adds special tokens (what llama.cpp's `add_bos`
    says of a GGUF vocabulary): found by tokenising a probe text with and without special tokens, so a
    tokenizer whose `add_bos_token` setting is missing or stale is read by what it does."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    with_special = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    without = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    return with_special[:1] == [bos] and without[:1] != [bos]


def windows(ids: Sequence[int] | torch.Tensor, context: int, bos_token_id: int | None) -> torch.Tensor:
    """llama.cpp's windows of `ids`: `(len(ids) // context, context)` int64, each window's first id
    replaced by `bos_token_id` where it is not None (the module's docstring)."""
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    count = ids.numel() // context
    cut = ids[: count * context].reshape(count, context).clone()
    if bos_token_id is not None and count:
        cut[:, 0] = bos_token_id
    return cut


def score(model: Any, texts: str | Sequence[str], out: str | os.PathLike | None = None, *, tokenizer: Any,
          context: int = 512, batch_size: int = 4, chunk_size: int = 512, bos: bool | None = None,
          encodings: dict[str, str] | None = None, max_windows: int | None = None, progress: bool = False,
          rank: int | None = None, world_size: int | None = None) -> Any:
    """Score a text corpus with `model`, as llama.cpp's perplexity tool does, and record each scored
    position's raw logits (float32, what the model's forward returns there) as a step.

    Score the base and each candidate (another dtype, a quantization loaded through transformers, another
    attention kernel) on the same texts with the same tokenizer and `context`, then
    `compare(base, candidate)`: both perplexities, their ratio, KL divergences and same-top-token rate
    (docs/compare.md, "a quantization on a corpus").

    Args:
        model (`transformers.PreTrainedModel`): a decoder-only language model, in eval mode; its device takes
            the inputs.
        texts (`str | Sequence[str]`): the corpus: one text, or several whose ids are put one after another.
        out (`str | os.PathLike`, *optional*): a new or empty directory to write the recording to;
            default: in host memory.
        tokenizer: the model's tokenizer (a Hugging Face tokenizer: `tokenizer(text)["input_ids"]`).
        context (`int`, *optional*, defaults to 512): tokens per window (llama.cpp's `-c`), at least 4.
        batch_size (`int`, *optional*, defaults to 4): windows per forward (rows of a generation).
        chunk_size (`int`, *optional*, defaults to 512): positions per forward.
        bos (`bool`, *optional*): put the tokenizer's BOS before the texts' ids and in place of each
            window's first id (True) or neither (False); default None: as llama.cpp does, where the
            tokenizer adds BOS (`adds_bos`), not elsewhere. Each window's metadata names the BOS id used
            (`bos`, null for none).
        encodings (`dict[str, str]`, *optional*): how to store the logits, as `Recorder(encodings=...)`:
            `{"logits": "topk:20"}` for a small reference (its KLs are then estimates: docs/compare.md).
        max_windows (`int`, *optional*): score only the first this many windows (llama.cpp's `--chunks`).
        progress (`bool`, *optional*, defaults to False): show a progress bar (tqdm) over batches.
        rank, world_size (`int`, *optional*): as `record`'s (default: from torchrun's environment): each
            process scores its share of the batches into `out/rank-R`.

    With `out`, a run resumes as `record` does: the windows `out` holds complete are skipped (a batch a
    crash, Ctrl-C or SIGKILL interrupted is scored again; each window is in one complete generation), a process scoring the same
    windows into `out` blocks the run (BlockingIOError), and `out` holding windows of other texts,
    tokenizer, BOS or `context` is refused (each window's sample metadata names them: `context`, `bos`,
    `ids_sha256` of the windows' ids, `window`, `first_token`).

    Returns:
        `Recording` (read back from `out`) or, in memory, the closed `Recorder`: one generation per batch
        of windows, rows the windows, `context - 1 - context // 2` steps each, `tokens()` the ids predicted, sample
        ids the windows' numbers.

    Raises:
        ValueError: a bad option; texts that hold fewer than `context` tokens (no window); a tokenizer
            whose vocabulary the model does not cover; `bos=True` with a tokenizer that has no BOS.
        TypeError: `texts` is not a string or a sequence of strings.
        RecordingError: `out` is damaged. BlockingIOError: another process is scoring these windows into `out`.
    """
    return score_run(model, texts, out, tokenizer=tokenizer, context=context, batch_size=batch_size,
                     chunk_size=chunk_size, bos=bos, encodings=encodings, max_windows=max_windows,
                     progress=progress, rank=rank, world_size=world_size)[0]


def score_run(model: Any, texts: str | Sequence[str], out: str | os.PathLike | None = None, *, tokenizer: Any,
              context: int = 512, batch_size: int = 4, chunk_size: int = 512, bos: bool | None = None,
              encodings: dict[str, str] | None = None, max_windows: int | None = None, progress: bool = False,
              rank: int | None = None, world_size: int | None = None) -> tuple[Any, dict[str, int]]:
    """`score`, and what this process did (the command's result): `windows` and `tokens_scored` scored now,
    `skipped` the windows of its share `out` held complete already, `rank` and `world_size`. Under torchrun
    without a process group the recording returned may lack ranks still running; the counts are this
    rank's own."""
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, Sequence) or not all(isinstance(text, str) for text in texts):
        raise TypeError(f"`texts` must be a string or a sequence of strings, got {type(texts).__name__}.")
    for name, value, least in (("context", context, SMALLEST_CONTEXT), ("batch_size", batch_size, 1),
                                ("chunk_size", chunk_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"`{name}` must be an int of at least {least}, got {value!r}.")
    if max_windows is not None and (isinstance(max_windows, bool) or not isinstance(max_windows, int) or max_windows < 1):
        raise ValueError(f"`max_windows` must be a positive int (windows) or None, got {max_windows!r}.")
    if tokenizer is None or not callable(tokenizer):
        raise ValueError(f"`tokenizer` is needed to cut the texts into tokens: pass the model's tokenizer "
                         f"(`AutoTokenizer.from_pretrained(...)`), got {type(tokenizer).__name__}.")
    if bos is not None and not isinstance(bos, bool):
        raise ValueError(f"`bos` must be True, False or None (as the tokenizer does), got {bos!r}.")
    if bos and getattr(tokenizer, "bos_token_id", None) is None:
        raise ValueError("`bos=True` asks for the tokenizer's BOS, and this tokenizer has none (`bos_token_id` is "
                         "None): pass `bos=None` or `False`.")
    bos_token_id = tokenizer.bos_token_id if (adds_bos(tokenizer) if bos is None else bos) else None
    ids = [i for text in texts for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    if not ids:
        raise ValueError("the texts hold no tokens (they are empty): pass a text to score.")
    cut = windows(([] if bos_token_id is None else [bos_token_id]) + ids, context, bos_token_id)
    if not len(cut):
        raise ValueError(f"the texts hold {len(ids)} tokens, fewer than one window of `context` {context}: pass a "
                         "longer text or a smaller `context`.")
    digest = hashlib.sha256(cut.numpy().tobytes()).hexdigest()  # of every window: `max_windows` may grow on a resume
    if max_windows is not None:
        cut = cut[:max_windows]
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and int(cut.max()) >= vocab:
        raise ValueError(f"the tokenizer gives id {int(cut.max())}, outside the model's vocabulary of {vocab}: pass "
                         "the model's own tokenizer.")
    first = context // 2
    steps = context - 1 - first  # positions first .. context - 2 of each window
    corpus = {"context": context, "bos": bos_token_id, "ids_sha256": digest}
    batches = [range(start, min(start + batch_size, len(cut))) for start in range(0, len(cut), batch_size)]

    vocab_width = int(vocab) if vocab is not None else 2**17
    shard_bytes = shard_size(min(batch_size, len(cut)) * steps * vocab_width * 4)  # a batch's scored logits
    # A compact reference keeps some tokens' logits only: the per-token statistics beside it (36 bytes a token) give
    # every scored token's logprob and rank, so that compare's perplexity covers every token, never a subset.
    compact = (encodings or {}).get("logits", "dense") not in LOSSLESS_ENCODINGS
    streams = ("logits", "stats") if compact else ("logits",)
    windows_scored: list[int] = []

    def scored(spill_dir: Path | None, todo: list[int]) -> Recorder:
        # A batch is scored but for its windows `out` holds complete already: a resume with more windows
        # (`max_windows` grown) cuts its batches anew, and one may hold windows an earlier run scored.
        done = recorded_samples(out) if spill_dir is not None else set()
        rec = Recorder(model, streams=streams, spill_dir=spill_dir, encodings=encodings, append=spill_dir is not None,
                       shard_bytes=shard_bytes if spill_dir is not None else None)
        try:
            bar = _progress(len(todo), progress)
            for index in todo:
                rows = [w for w in batches[index] if str(w) not in done]
                if rows:
                    rec.set_samples(rows, metadata=[window_metadata(corpus, w) for w in rows])
                    score_sequences(model, rec, cut[rows], first + 1, prompt_mask=None, eos_token_id=[],
                                    pad_token_id=getattr(tokenizer, "pad_token_id", None), chunk_size=chunk_size)
                    windows_scored.extend(rows)
                bar.update(1)
            bar.close()
        finally:
            rec.close()
        return rec

    if out is None:
        every = list(range(len(batches)))
        return scored(None, every), _counts(batches, every, windows_scored, steps, 0, 1)
    out = local_directory(out, "`out`")
    _refuse_other_windows(out, corpus)
    rank, world_size = process_rank(rank, world_size)
    mine, _ = run_share(out, [[str(w) for w in rows] for rows in batches], rank=rank, world_size=world_size,
                        work=scored)
    return open_recording(out), _counts(batches, mine, windows_scored, steps, rank, world_size)



def _counts(batches: list[range], mine: list[int], scored: list[int], steps: int, rank: int,
            world_size: int) -> dict[str, int]:
    """This process's work: the windows it scored now, their tokens, and the windows of its share it skipped."""
    return {"windows": len(scored), "tokens_scored": len(scored) * steps,
            "skipped": sum(len(batches[i]) for i in mine) - len(scored), "rank": rank, "world_size": world_size}

def _refuse_other_windows(out: Path, corpus: dict[str, Any]) -> None:
    """ValueError where `out` holds complete windows of other texts, tokenizer, BOS or context."""
    if not recorded_samples(out):
        return
    with open_recording(out) as before:
        for generation in before.generations:
            found = (generation.sample_metadata or [{}])[0]
            if any(found.get(key) != value for key, value in corpus.items()):
                raise ValueError(
                    f"`out` {str(out)!r} holds windows of other texts or settings (context {found.get('context')!r}, "
                    f"BOS {found.get('bos')!r}, ids {str(found.get('ids_sha256'))[:12]}...; now {corpus['context']}, "
                    f"{corpus['bos']!r}, {corpus['ids_sha256'][:12]}...): resume with the same texts, tokenizer and "
                    "`context`, or pick another `out`.")


def _progress(total: int, show: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="batch", disable=not show, desc="score")


__all__ = ["adds_bos", "score", "score_run", "windows"]
