"""Plots as PNG files (matplotlib, the `plot` extra): per generation, the chosen token's logprob and the
entropy per step of each returned sequence, under the raw logits; and, from a recording with attentions,
the attention map of one layer and head of one row.

The per-step values are the per-token table's (`read.logprobs`), read a chunk of steps at a time; the
attention map is `Generation.layer_array("attentions", layer, rows=row)`, one head of it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from ..read.logprobs import token_chunks


def _figure(**options: Any) -> Any:
    try:
        from matplotlib.figure import Figure  # no pyplot: no global state, no display needed
    except ImportError as error:
        raise ImportError(
            "plots need matplotlib: `pip install 'transformers-offload[plot]'` (or `pip install matplotlib`)."
        ) from error
    return Figure(**options)


def plot_steps(generation: Any, path: str | os.PathLike, *, max_sequences: int = 8) -> Path:
    """Draw the chosen token's logprob and the entropy (raw logits, nats) per step of each returned
    sequence (the first `max_sequences`) of one generation, to a PNG file at `path`.

    Raises:
        ValueError: the generation is incomplete, or records neither `logits` nor `stats`.
        ImportError: matplotlib is not installed.
    """
    if not hasattr(generation, "layer_array"):
        raise TypeError(f"`generation` must be one Generation (e.g. `run.generation(0)`), got {type(generation).__name__}.")
    figure = _figure(figsize=(9, 5), layout="constrained")
    logprob_axis, entropy_axis = figure.subplots(2, 1, sharex=True)
    series: dict[int, list[tuple[int, float, float]]] = {}
    for chunk in token_chunks(generation, kinds=("raw",), chunk_steps=16, sequences=range(max_sequences)):
        for j, t, lp, h in zip(chunk["sequence"].tolist(), chunk["step"].tolist(),
                               chunk["logprob_raw"].tolist(), chunk["entropy_raw"].tolist()):
            series.setdefault(j, []).append((t, lp, h))
    for j, points in sorted(series.items()):
        points.sort()
        steps = [p[0] for p in points]
        logprob_axis.plot(steps, [p[1] for p in points], label=f"sequence {j}", linewidth=1)
        entropy_axis.plot(steps, [p[2] for p in points], linewidth=1)
    logprob_axis.set_ylabel("chosen token's logprob")
    entropy_axis.set_ylabel("entropy (nats)")
    entropy_axis.set_xlabel("step")
    logprob_axis.set_title(f"generation {generation.index} ({generation.mode}), raw logits")
    from matplotlib.ticker import MaxNLocator

    entropy_axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    if series:
        figure.legend(fontsize=7, loc="outside right upper")
    target = Path(path)
    figure.savefig(target, dpi=110)
    return target


def plot_attention(generation: Any, path: str | os.PathLike, *, layer: int = -1, head: int = 0, row: int = 0) -> Path:
    """Draw one layer and head of the attention map of one row (`out.sequences`' row outside beam search;
    a running beam's row in it) across every recorded step: query positions down, keys across.

    Args:
        layer (`int`): a recorded layer, as an index into the model's layers (negative from the end).
        head (`int`): a head of the model (one of those recorded with `heads=`).
        row (`int`): the row.

    Raises:
        KeyError: attentions or that layer were not recorded.
        ValueError: that head was not recorded.
        IndexError: `row` is out of range.
        ImportError: matplotlib is not installed.
    """
    if not hasattr(generation, "layer_array"):
        raise TypeError(f"`generation` must be one Generation (e.g. `run.generation(0)`), got {type(generation).__name__}.")
    array = generation.layer_array("attentions", layer, rows=row)  # read through torch (its dtype may be bfloat16)
    kept = (generation.layers or {}).get("heads", {}) or {}
    heads = kept.get("attentions") if isinstance(kept, dict) else None
    index = head
    if heads is not None:
        if head not in heads:
            raise ValueError(f"head {head} was not recorded; the recording kept heads {list(heads)}.")
        index = list(heads).index(head)
    values = array.values[index].float().numpy()
    figure = _figure(figsize=(6, 5.5), layout="constrained")
    axis = figure.subplots()
    image = axis.imshow(values, cmap="viridis", interpolation="nearest", aspect="auto")
    figure.colorbar(image, ax=axis, label="attention weight")
    axis.set_xlabel("key position")
    axis.set_ylabel("query position (prompt, then one per step)")
    axis.set_title(f"generation {generation.index}, row {row}: layer {layer}, head {head}")
    target = Path(path)
    figure.savefig(target, dpi=110)
    return target


def write_plots(source: Any, directory: str | os.PathLike, *, generations: Sequence[int] | None = None,
                layer: int = -1, head: int = 0, sequence: int = 0) -> list[Path]:
    """Write `steps-g<G>.png` for every selected complete generation and, where attentions were recorded,
    `attention-g<G>-layer<L>-head<H>.png` of row `sequence`, into `directory` (created if missing).

    Returns:
        `list[Path]`: the files written.

    Raises:
        as `plot_steps` and `plot_attention`; ValueError when no selected generation is complete.
    """
    from ..read.logprobs import sources
    from .table import output_path, select_generations

    _, picked = select_generations(source, generations)
    target = Path(directory)
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"`directory` {str(target)!r} is a file: name a directory to write the PNG files into.")
    output_path(source, target / "x.png", "plots' directory")
    written, skipped = [], []
    for generation in picked:
        if (not generation.has_sequences and generation.is_beam) or sources(generation, "raw", 0)[0] is None:
            skipped.append(generation.index)  # an incomplete beam search, or neither logits nor (outside beam search) stats
            continue
        written.append(plot_steps(generation, target / f"steps-g{generation.index}.png"))
        if "attentions" in generation.layer_indices:
            name = f"attention-g{generation.index}-layer{layer}-head{head}.png"
            written.append(plot_attention(generation, target / name, layer=layer, head=head, row=sequence))
    if not written:
        raise ValueError(
            f"nothing to plot in generation(s) {skipped}: the steps need the raw `logits` (or, outside beam search, "
            "`stats`), and an incomplete beam search has no sequences."
        )
    return written
