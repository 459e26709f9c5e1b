"""Rescore's forward mode: a generation's prompt and tokens scored by chunked forward passes.

Where decode mode replays `generate()` one token per forward, this mode feeds the whole sequence
(`sequences`: the left-padded prompt and every generated token) through the model `chunk_size` positions
at a time, keeping the KV cache between chunks, with the attention mask and position ids `generate()`
gives those positions (padding masked, positions counted from each row's first real token). The logits
at position `prompt_length - 1 + t` are step `t`'s. They are handed to the recorder as a greedy decoding
loop of the recorded tokens would hand them, so the result is a recording like decode mode's, checked
the same way. Larger forwards sum in another order: the logits differ from decode mode's by float
rounding (docs/rescore.md gives the measured difference).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig

from .. import _compat
from ..capture.peft import unwrap
from ..read.generation import Generation


def score(gen: Generation, model: Any, rec: Any, call: dict[str, Any], chunk_size: int) -> None:
    """Score generation `gen` (greedy search or sampling, decoder-only) with `model` into recorder `rec`.

    Args:
        gen (`Generation`): the recorded generation; its `sequences` are the ids scored.
        model: the model (its device takes the inputs).
        rec (`Recorder`): the recorder attached to `model`, which records the scored steps.
        call (`dict`): the prompt inputs (`input_ids` `(prompts, prompt_length)`, `attention_mask`),
            from the recording or the user's `inputs`.
        chunk_size (`int`): positions per forward.
    """
    rows, length, steps = gen.num_rows, gen.prompt_length, gen.num_steps
    repeat = rows // call["input_ids"].shape[0]
    prompt_mask = call.get("attention_mask")
    if prompt_mask is not None:
        prompt_mask = torch.as_tensor(prompt_mask).repeat_interleave(repeat, dim=0)
    if gen.sample_ids is not None:
        rec.set_samples(list(gen.sample_ids), metadata=None if gen.sample_metadata is None else list(gen.sample_metadata))
    score_sequences(model, rec, gen.sequences[:, : length + steps], length, prompt_mask=prompt_mask,
                    eos_token_id=list(gen.eos_token_id), pad_token_id=gen.pad_token_id, chunk_size=chunk_size)


def score_sequences(model: Any, rec: Any, sequences: torch.Tensor, prompt_length: int, *,
                    prompt_mask: torch.Tensor | None, eos_token_id: list[int], pad_token_id: int | None,
                    chunk_size: int) -> None:
    """Record, as one generation of `rec`, the raw logits `model` gives at positions `prompt_length - 1`
    to `sequences.shape[1] - 2` of `sequences`: step `t` the position predicting token
    `sequences[:, prompt_length + t]`, as a greedy decoding loop of those tokens would hand them.

    Args:
        model: the model (its device takes the inputs). rec (`Recorder`): attached to `model`, with the
            samples of this call set where wanted (`set_samples`).
        sequences (`torch.LongTensor` of shape `(rows, prompt_length + steps)`): the ids, prompt first.
        prompt_length (`int`): positions before the first scored token (at least 1).
        prompt_mask (`torch.Tensor` of shape `(rows, prompt_length)`, *optional*): the prompt's attention
            mask (left padding as 0), None for every position real; what follows counts 1, as in
            generate().
        eos_token_id (`list[int]`): a row is finished after one of these (its later steps are padding);
            [] for none. pad_token_id (`int`, *optional*): recorded in the generation's header.
        chunk_size (`int`): positions per forward (the KV cache kept between forwards).
    """
    device = next(model.parameters()).device
    rows, length = sequences.shape[0], prompt_length
    steps = sequences.shape[1] - length
    sequences = sequences.to(device)
    given_mask = None if prompt_mask is None else prompt_mask.to(device)
    prompt_mask = torch.ones(rows, length, dtype=torch.long, device=device) if given_mask is None else given_mask
    # generate() extends the mask with ones for every appended token, finished rows included.
    mask = torch.cat([prompt_mask, prompt_mask.new_ones(rows, steps)], dim=1)
    positions = mask.long().cumsum(-1) - 1
    positions.masked_fill_(mask == 0, 1)
    config = GenerationConfig(do_sample=False, max_new_tokens=steps, pad_token_id=pad_token_id,
                              eos_token_id=list(eos_token_id) or None)
    capture = rec.begin_call(assistant_model=None, custom_generate=None, attention_mask=given_mask,
                             inputs=sequences[:, :length])
    head = None
    try:
        capture.start(config, length, no_processors=True)
        eos = torch.tensor(list(eos_token_id), device=device, dtype=torch.long)
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        cache = None
        logits = None  # one `(rows, vocab)` float32 buffer, reused for every position (the ring copies it)
        inner = unwrap(model)[0]  # a PEFT model's forward hands its keywords to the transformers model's
        cache_argument = _compat.cache_argument(inner)
        keep_argument = _compat.logits_to_keep_argument(inner)
        if keep_argument is None:
            head = _HeadOnScored(model)
        end_of_scored = length + steps - 1  # the last token is appended, never scored
        with torch.no_grad():
            for start in range(0, end_of_scored, chunk_size):
                end = min(start + chunk_size, end_of_scored)
                # The scored positions of a chunk are its last ones: the forward computes only their logits
                # (one position's where none is scored; 0 would mean every position), by `logits_to_keep`
                # where it has it and by the head's input cut to them elsewhere.
                kept = max(1, end - max(start, length - 1))
                keep = {} if keep_argument is None else {keep_argument: kept}
                if head is not None:
                    head.width, head.kept = end - start, kept
                # A sequence scored in one forward builds no KV cache: no later chunk would read it (SmolLM2,
                # 4 x 511 positions: 94 MiB, half its scored logits).
                use_cache = cache is not None or end < end_of_scored
                out = model(input_ids=sequences[:, start:end], attention_mask=mask[:, :end],
                            position_ids=positions[:, start:end], use_cache=use_cache, **{cache_argument: cache},
                            **keep)
                cache = _compat.cache_of(out)
                computed = out.logits.shape[1]  # the chunk's last `computed` positions
                if computed not in (kept, end - start):
                    raise RuntimeError(
                        f"{type(model).__name__}'s forward gave the logits of {computed} positions for a chunk of "
                        f"{end - start} ({kept} scored): neither every position nor the scored ones, so which "
                        "position each belongs to is unknown. Report it with the model's name.")
                for position in range(max(start, length - 1), end):
                    step = position - (length - 1)
                    if logits is None:
                        logits = torch.empty(out.logits[:, 0].shape, dtype=torch.float32, device=out.logits.device)
                    logits.copy_(out.logits[:, position - (end - computed)])
                    ids = sequences[:, : length + step]
                    capture.on_raw(ids, logits)
                    capture.on_processed(ids, logits)
                    appended = sequences[:, : length + step + 1]
                    done = done | torch.isin(appended[:, -1], eos)
                    capture.on_stopping(appended, done)
                del out
    except BaseException as exc:  # recorded so far stays readable, as a failed generate() call's
        rec.end_call(capture, None, exc)
        raise
    finally:
        if head is not None:
            head.remove()
    rec.end_call(capture, sequences, None)


class _HeadOnScored:
    """For a forward without `logits_to_keep` (releases before 4.45, models whose forward does not name it): a
    pre-hook on the model's head (`get_output_embeddings()`) that hands it the last `kept` positions of a
    `(rows, width, hidden)` input only, the slice `logits_to_keep` takes where the forward has it. A head the
    forward does not call on that input leaves the logits of every position."""

    def __init__(self, model: Any) -> None:
        self.width = self.kept = 0
        get = getattr(model, "get_output_embeddings", None)
        module = get() if callable(get) else None
        self._handle = module.register_forward_pre_hook(self._cut) if isinstance(module, torch.nn.Module) else None

    def _cut(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        hidden = args[0] if args else None
        if isinstance(hidden, torch.Tensor) and hidden.dim() == 3 and hidden.shape[1] == self.width > self.kept:
            return (hidden[:, -self.kept :], *args[1:])
        return None

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
