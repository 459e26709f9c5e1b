"""What a recorder refuses of a `generate()` call before the call runs (`Recorder.check_call`), each with what to
do instead: sample ids named for another batch size, prompt logprobs over a cache filled before the call, and
`custom_generate`, whose loop the recorder cannot see into."""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedModeError
from . import prompt_logprobs as _prompt_logprobs


def samples_mismatch(samples: dict[str, Any] | None, attention_mask: Any, inputs: Any) -> str | None:
    """Why the ids `set_samples` named do not fit this call's batch (None: they fit, or none were named)."""
    if samples is None:
        return None
    batch = next((int(t.shape[0]) for t in (attention_mask, inputs) if t is not None and t.dim() >= 1), None)
    if batch is None or batch == len(samples["sample_ids"]):
        return None
    return (f"`set_samples` named {len(samples['sample_ids'])} prompt(s), but this generate() call has a batch of "
            f"{batch}; nothing was run. Call `set_samples` again with one id per prompt.")


def refuse(*, prompt_scoring: Any, past_key_values: Any, custom_generate: Any) -> None:
    """Raise where the call cannot be recorded as asked.

    Raises:
        ValueError: prompt logprobs asked (`prompt_scoring`) over a `past_key_values` already holding tokens.
        UnsupportedModeError: a `custom_generate` replaces transformers' decoding loop.
    """
    cached = _prompt_logprobs.cache_length(past_key_values) if prompt_scoring is not None else 0
    if cached:
        raise ValueError(
            f"`prompt_logprobs` scores the prompt from the call's own prefill, but this call was given a "
            f"`past_key_values` already holding {cached} token(s), whose forward ran before it; nothing was run. "
            "Score the whole prompt in one call (without the cache), or record this one without `prompt_logprobs`."
        )
    if custom_generate is not None:
        raise UnsupportedModeError(
            "`custom_generate` replaces transformers' decoding loop, which the Recorder cannot see "
            "into; remove the Recorder from `logits_processor` or drop `custom_generate`."
        )
