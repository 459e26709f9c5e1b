"""Prompt logprobs: how likely the model found each token of the prompt, from the prefill's own forward.

With `Recorder(..., prompt_logprobs=True)` (or an int `k`: the top-k too), the capture keeps the final
hidden states `h` of the call's first forward (the decoder's output after its last norm, the input of
the language-model head: `(rows, length, hidden)`) and, when the first step's processors run, scores
every prompt position `p` against the prompt's own next token `y = input_ids[:, p + 1]`, a chunk of
positions at a time, on the device the states are on, so no `(prompt, vocab)` tensor exists at once:

    x = head(h[:, p0:p1]).float()                       # (rows, chunk, vocab), float32
    x = tanh(x / cap) * cap                              # only where the config sets final_logit_softcapping
    logprob = torch.log_softmax(x, -1).gather(-1, y[..., None])[..., 0]
    rank    = (x > x.gather(-1, y[..., None])).sum(-1)   # 0 = the most likely
    top_logprobs, top_tokens = torch.topk(torch.log_softmax(x, -1), k, -1)

One row per prompt (the first of its `num_beams` / `num_return_sequences` copies, which are equal).
Positions whose token or context is padding (`attention_mask` 0) hold `token` -1, a NaN logprob and a
rank of -1. The extra device memory is the kept states plus about `8 x rows x chunk x vocab` bytes
(the chunk's logits, their log-softmax; the rank's comparison is held in the log-softmax's buffer
before it), and the results; nothing here waits for the device. Every chunk reuses the first chunk's
buffers (`ChunkBuffers`), a plain `nn.Linear` head's product included, and writes into results made
once, so the peak does not depend on how the C library's allocator reuses freed blocks (any other head,
offloaded, hooked or quantized, runs as itself, and its output is new each chunk).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch

from ..codecs.workspace import ChunkBuffers

CHUNK_ELEMENTS = 2**24  # default chunk: at most this many logits (64 MiB of float32) at once
FLOAT32_INTEGERS = 2**24  # every integer up to this is a float32 value (a rank's count of 0.0 / 1.0)
# Config fields of models whose forward scales the head's output (Cohere, Granite, Falcon-H1): refused.
LOGIT_TRANSFORMS = ("logit_scale", "logits_scaling", "lm_head_multiplier")


@dataclass(frozen=True)
class PromptScoring:
    """What scores the prompt: the model's output embeddings (`head`), `top` alternatives per position
    (0: none), `chunk` positions at a time (None: `CHUNK_ELEMENTS` logits), the config's softcap."""

    head: torch.nn.Module
    top: int
    chunk: int | None
    softcap: float | None
    model_name: str = "model"

    def score(self, hidden: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor | None,
              rows_per_prompt: int, *, buffers: ChunkBuffers | None = None) -> dict[str, torch.Tensor]:
        """The prompt streams of one call, on the states' device.

        Args:
            hidden: `(rows, >= length, hidden)` final hidden states of the first forward.
            input_ids: `(rows, length)` the prompt (`length` = prompt length; later columns ignored).
            mask: `(prompts, length)` the call's attention mask, or None (no padding).
            rows_per_prompt: copies of each prompt among the rows (`num_beams` or `num_return_sequences`).
            buffers: the chunks' buffers (default: new ones, freed when the call returns).

        Returns:
            `prompt_tokens` `(prompts, length - 1)` int64, `prompt_logprobs` float32, `prompt_ranks`
            int64 and, with `top`, `prompt_top_tokens` `(prompts, length - 1, top)` int64 and
            `prompt_top_logprobs` float32.
        """
        ids = input_ids[::rows_per_prompt]
        length = ids.shape[1]
        states = hidden[::rows_per_prompt, :length]
        prompts, positions = ids.shape[0], max(length - 1, 0)
        vocab = int(getattr(self.head, "out_features", 0) or next(self.head.parameters()).shape[0])
        chunk = self.chunk or max(1, CHUNK_ELEMENTS // max(1, prompts * vocab))
        top = min(self.top, vocab)
        buffers = ChunkBuffers() if buffers is None else buffers
        device = hidden.device
        results: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            # The head runs where it is (a `device_map` may put it on another device than the states, or
            # offload its weights: accelerate's hooks move what it needs); the rest follows its output.
            # Every chunk writes into the same buffers (the last, shorter one into their first part) and
            # the results into tensors made once: nothing of a chunk's size is freed and allocated again,
            # and nothing long-lived is allocated between chunks, which, with glibc's default malloc,
            # pinned each freed chunk's block (the peak grew by a chunk's comparison per chunk).
            for start in range(0, positions, chunk):
                end = min(positions, start + chunk)
                x = self._logits(states[:, start:end], buffers)
                if not results:
                    device = x.device
                    results = _results(prompts, positions, top, device)
                if self.softcap:
                    x.div_(self.softcap).tanh_().mul_(self.softcap)  # tanh(x / cap) * cap, in place
                y = ids[:, start + 1:end + 1, None].to(device)
                # The rank counts a comparison held as 0.0 / 1.0 in the log-softmax's buffer: summing a
                # bool tensor converts it to int64 first (8 bytes a logit, 128 MiB a default chunk),
                # and the float sum of counts below 2**24 (2**53 in float64) is exact in any order.
                above = buffers.take("log_softmax", x.shape, torch.float32, device)
                if x.shape[-1] > FLOAT32_INTEGERS:
                    above = buffers.take("above", x.shape, torch.float64, device)
                results["ranks"][:, start:end] = torch.gt(x, x.gather(-1, y), out=above).sum(-1)
                x = torch.log_softmax(x, -1, out=buffers.take("log_softmax", x.shape, torch.float32, device))
                results["logprobs"][:, start:end] = x.gather(-1, y)[..., 0]
                if top:
                    values, indices = torch.topk(x, top, -1)
                    results["top_logprobs"][:, start:end] = values
                    results["top_tokens"][:, start:end] = indices
                del x, above
        if not results:
            results = _results(prompts, positions, top, device)
        targets = ids[:, 1:].to(device)
        ranks, logprobs = results["ranks"], results["logprobs"]
        top_logprobs, top_tokens = results["top_logprobs"], results["top_tokens"]
        if mask is not None:
            mask = mask.to(device).bool()
            valid = mask[:, 1:length] & mask[:, : length - 1]
            targets = torch.where(valid, targets, torch.full_like(targets, -1))
            logprobs = torch.where(valid, logprobs, torch.full_like(logprobs, math.nan))
            ranks = torch.where(valid, ranks, torch.full_like(ranks, -1))
            if top:
                top_tokens = torch.where(valid[..., None], top_tokens, torch.full_like(top_tokens, -1))
                top_logprobs = torch.where(valid[..., None], top_logprobs, torch.full_like(top_logprobs, math.nan))
        found = {"prompt_tokens": targets.contiguous(), "prompt_logprobs": logprobs, "prompt_ranks": ranks}
        if top:
            found.update(prompt_top_tokens=top_tokens, prompt_top_logprobs=top_logprobs)
        return found

    def _logits(self, states: torch.Tensor, buffers: ChunkBuffers) -> torch.Tensor:
        """`head(states).float()` for one chunk's states `(rows, n, hidden)`, which the caller may edit in
        place. A plain `nn.Linear` head without bias computes `matmul(states, weight.t())` (its forward,
        `F.linear`, computes just that) into the chunk's buffer; any other head runs as itself."""
        weight = _plain_weight(self.head, states)
        if weight is None:
            raw = self.head(states)
        else:
            # Contiguous states, as `F.linear`'s own folding gives them to the product: `matmul(..., out=)`
            # of strided states (several prompts) sums in another order (4.8e-7 apart, torch 2.13 CPU).
            states = buffers.take("states", states.shape, states.dtype, states.device).copy_(states)
            shape = (*states.shape[:-1], weight.shape[0])
            raw = torch.matmul(states, weight.t(), out=buffers.take("head", shape, weight.dtype, weight.device))
        if raw.dtype == torch.float32:
            return raw
        return buffers.take("logits", raw.shape, torch.float32, raw.device).copy_(raw)


def _plain_weight(head: torch.nn.Module, states: torch.Tensor) -> torch.Tensor | None:
    """The weight of `head` where calling it is `F.linear(states, weight)` and nothing else: an exact
    `nn.Linear` without bias, hooks (accelerate's offload replaces `forward` or adds hooks) or a
    weight of a tensor subclass (quantized, sharded), on the states' device in their dtype; else None."""
    module = torch.nn.modules.module
    if type(head) is not torch.nn.Linear or head.bias is not None or "forward" in vars(head):
        return None
    if head._forward_hooks or head._forward_pre_hooks or getattr(module, "_global_forward_hooks", None) \
            or getattr(module, "_global_forward_pre_hooks", None):
        return None
    weight = head.weight
    if type(weight) is not torch.nn.Parameter or type(weight.data) is not torch.Tensor or weight.layout != torch.strided:
        return None
    if weight.device != states.device or weight.dtype != states.dtype or weight.is_meta:
        return None
    return weight


def _results(prompts: int, positions: int, top: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The scoring's outputs for the whole prompt, made once, each chunk writing its columns."""
    return {"ranks": torch.empty((prompts, positions), dtype=torch.long, device=device),
            "logprobs": torch.empty((prompts, positions), dtype=torch.float32, device=device),
            "top_logprobs": torch.empty((prompts, positions, top), dtype=torch.float32, device=device),
            "top_tokens": torch.empty((prompts, positions, top), dtype=torch.long, device=device)}


def scoring_for(model: Any, prompt_logprobs: Any, chunk: Any) -> PromptScoring | None:
    """The `PromptScoring` for a Recorder's `prompt_logprobs` option (False/None: none).

    Raises:
        ValueError: a bad option; an encoder-decoder model (its decoder's prompt is its start token);
            a model without output embeddings, or one that scales its logits (`logit_scale`,
            `logits_scaling`), whose head alone does not give its logits.
    """
    if prompt_logprobs is None or prompt_logprobs is False:
        if chunk is not None:
            raise ValueError("`prompt_chunk` sizes the prompt logprobs' chunks: pass `prompt_logprobs=True` (or an int) too.")
        return None
    if prompt_logprobs is True:
        top = 0
    else:
        top = _integer(prompt_logprobs)
        if top is None or top < 0:
            raise ValueError(f"`prompt_logprobs` must be True or the number of alternatives per position "
                             f"(an int >= 0; 0 gives the logprob and rank alone, as True), got {prompt_logprobs!r}.")
    if chunk is not None:
        chunk = _integer(chunk)
        if chunk is None or chunk < 1:
            raise ValueError(f"`prompt_chunk` must be a positive number of positions, got {chunk!r}.")
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("`prompt_logprobs` scores a decoder-only model's prompt; an encoder-decoder model's "
                         "decoder prompt is its start token. Leave it off for this model.")
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and top > vocab:
        raise ValueError(f"`prompt_logprobs={top}` asks for more alternatives than the vocabulary's {vocab} tokens.")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or next(head.parameters(), None) is None:
        raise ValueError(f"`prompt_logprobs` needs the model's output embeddings; {type(model).__name__} has none.")
    for name in LOGIT_TRANSFORMS:
        if getattr(config, name, 1) not in (1, 1.0, None):
            raise ValueError(f"`prompt_logprobs`: {type(model).__name__} scales its logits (`{name}`), which "
                             "prompt logprobs do not reproduce yet. Leave it off for this model.")
    return PromptScoring(head=head, top=top, chunk=chunk, softcap=getattr(config, "final_logit_softcapping", None),
                         model_name=type(model).__name__)


def decoders_of(model: Any) -> list[torch.nn.Module]:
    """The modules whose output is the head's input: the base model (`model.model`, `model.transformer`...)
    and, where the causal-LM class calls it directly (OPT, BART's and Marian's `*ForCausalLM`), its
    `decoder`. The first forward of the call that reaches either gives the prompt's hidden states."""
    base = getattr(model, "base_model", None)
    if not isinstance(base, torch.nn.Module) or base is model:
        return []
    decoder = getattr(base, "decoder", None)
    return [base, *([decoder] if isinstance(decoder, torch.nn.Module) else [])]


def cache_length(past_key_values: Any) -> int:
    """Tokens already in a `past_key_values` given to generate() (0 for none), read on the host."""
    if past_key_values is None:
        return 0
    length = getattr(past_key_values, "get_seq_length", None)
    if callable(length):
        return int(length())
    try:
        return int(past_key_values[0][0].shape[-2])  # the legacy tuple of (key, value) per layer
    except (TypeError, IndexError, AttributeError):
        return 0


def _integer(value: Any) -> int | None:
    """`value` as an int when it is one (a Python, NumPy or 0-d torch integer; not a bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
