"""Rows back to the user's data: each prompt's sample id and metadata, and which rows and returned
sequences are its, across a recording's generations.

A call's prompts carry the ids (and metadata) given to `Recorder.set_samples` before it, kept in the
manifest (`sample_ids`, `sample_metadata`). A call without them gets default ids: each prompt's
position among every prompt of the recording, counted over the generations in order (ints).
"""

from __future__ import annotations

from typing import Any, Sequence


def sample_ids(generations: Sequence[Any]) -> list[list[Any]]:
    """Per generation, its prompts' sample ids (the user's, else the running prompt count)."""
    ids: list[list[Any]] = []
    offset = 0
    for generation in generations:
        count = generation.num_prompts
        ids.append(list(generation.sample_ids) if generation.sample_ids is not None else list(range(offset, offset + count)))
        offset += count
    return ids


def samples(generations: Sequence[Any]) -> list[dict[str, Any]]:
    """One dict per prompt of every generation, in order; see `Readable.samples`."""
    found = []
    for generation, ids in zip(generations, sample_ids(generations)):
        rows_per_prompt = generation.rows_per_prompt
        per_prompt = generation.num_return_sequences
        metadata = generation.sample_metadata
        lengths = generation.prompt_lengths
        for prompt, sample in enumerate(ids):
            found.append({
                "sample": sample,
                "generation": generation.index,
                "prompt": prompt,
                "rows": list(range(prompt * rows_per_prompt, (prompt + 1) * rows_per_prompt)),
                "sequences": list(range(prompt * per_prompt, (prompt + 1) * per_prompt))
                if generation.has_sequences else [],
                "prompt_length": None if lengths is None else lengths[prompt],
                "metadata": None if metadata is None else metadata[prompt],
                "complete": generation.complete,
            })
    return found
