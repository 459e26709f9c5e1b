"""Distillation from recorded teacher targets: a loss over the teacher's top-K ids plus one bucket for
the rest (`kd_loss`), a collator that pads the distillation table's rows into batches (`KDCollator`),
and `group_sequences`, which joins a sequence's per-token rows into one example.

The targets are the distillation table's columns (`answers.kd_table`, `export REC kd.parquet --kd`):
per position, the teacher's top ids `i_1..i_K`, their log-probabilities `log p_i` and the log of the
teacher's mass outside them, `log p_tail = log(1 - sum_i p_i)`. The loss compares the teacher and the
student on K + 1 buckets: the K kept ids, and the tail, one bucket holding every other token. With
`z` the student's logits (`(..., vocab)`) and `T` the temperature:

    log q      = torch.log_softmax(z / T, -1)                 # the student, whole vocabulary
    log q_i    = log q[i]                                      # on the kept ids
    log q_tail = torch.logsumexp(log q[not kept], -1)          # = log(1 - sum_i q_i), computed exactly
    log t      = torch.log_softmax([log p_1 .. log p_K, log p_tail] / T, -1)   # the teacher's K + 1 buckets
    log s      = [log q_1 .. log q_K, log q_tail]

    forward:  KL(t || s) = sum_b t_b (log t_b - log s_b)                      (terms with t_b = 0 are 0)
    reverse:  KL(s || t) = sum_b s_b (log s_b - log t_b)                      (terms with s_b = 0 are 0)
    jsd:      (KL(t || m) + KL(s || m)) / 2,  m = (t + s) / 2                 (in [0, log 2])

What the tail bucket means: all the teacher's mass that the table does not spell out, compared with all
the student's mass on the same tokens, so a student cannot lower the loss by moving mass outside the
kept ids (a loss over the top-K renormalised, without the tail, cannot see that). Merging tokens into one
bucket never raises a KL divergence or a JSD (the data-processing inequality), so each of the three is
a lower bound of the same loss over the whole vocabulary; they are equal when K is the vocabulary (the
tail is empty). At `T = 1` the gap is exactly what the two distributions disagree on inside the tail
(the chain rule of KL): `p_tail * KL(p_rest || q_rest)` for `forward` (the teacher's tail mass times the
KL of the two tails, each normalised), `q_tail * KL(q_rest || p_rest)` for `reverse`. docs/distill.md gives the gap measured
on SmolLM2.

At `T = 1` the teacher's buckets are the recorded probabilities. At another temperature the kept ids
are exact (`p_i^(1/T)` renormalised) but the tail is scaled as if it were one token (`p_tail^(1/T)`),
which its unknown spread would make larger for `T > 1` and smaller for `T < 1`. The loss is not
multiplied by `T^2` (Hinton et al.'s gradient scale): do it in the training loop where wanted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

KINDS = ("forward", "reverse", "jsd")
REDUCTIONS = ("mean", "sum", "none")
_TARGET_KEYS = ("top_ids", "top_logprobs", "tail_logmass")
# How far a target's kept probability plus its tail mass may be from 1, for float32 targets: the table's
# float32 logprobs round each probability by about 6e-8 of itself (a lossy `topk:K:qB` export is rescaled
# to sum to 1); a target whose tail was computed wrongly (a tail of 0 with every id kept sums to 2) is far
# outside it. Targets in a shorter float get 4 of their epsilons (bfloat16: 0.031, float16: 0.0039).
MASS_TOLERANCE = 1e-3


def mass_tolerance(dtype: torch.dtype) -> float:
    """The tolerance for targets of `dtype`: `max(MASS_TOLERANCE, 4 * torch.finfo(dtype).eps)`."""
    return max(MASS_TOLERANCE, 4 * torch.finfo(dtype).eps) if dtype.is_floating_point else MASS_TOLERANCE


def kd_loss(student_logits: torch.Tensor, targets: Mapping[str, Any], temperature: float = 1.0,
            kind: str = "forward", *, reduction: str = "mean") -> torch.Tensor:
    """The distillation loss of `student_logits` against the teacher's top-K targets and tail bucket
    (see the module's docstring for the expressions).

    Args:
        student_logits (`torch.FloatTensor` of shape `(..., vocab_size)`): the student's logits at each
            target position (`model(**batch).logits`: `(batch, length, vocab_size)`), on any device.
        targets (`Mapping`): what `KDCollator` returns (extra keys are ignored), on the logits' device:
            `top_ids` int64 `(..., K)`, `top_logprobs` float `(..., K)` (`-inf` for padding alternatives),
            `tail_logmass` float `(...)`, and optionally `target_mask` bool `(...)` (False: no target there).
        temperature (`float`): divides the student's logits and the teacher's bucket log-probabilities.
        kind (`str`): `"forward"` (KL(teacher || student)), `"reverse"` (KL(student || teacher)) or `"jsd"`.
        reduction (`str`): `"mean"` over the target positions, `"sum"`, or `"none"` (per position, 0 where
            `target_mask` is False).

    Returns:
        `torch.Tensor`: a scalar (or `(...)` with `reduction="none"`), in nats, float32 (float64 for
        float64 logits), differentiable with respect to `student_logits`.

    Raises:
        ValueError: a bad `kind`, `reduction` or `temperature`; targets missing a key or whose shapes do
            not match the logits'; a target whose kept probability plus tail mass,
            `sum(exp(top_logprobs)) + exp(tail_logmass)`, is off 1 by more than `mass_tolerance` of the
            targets' dtype (1e-3 in float32, 0.031 in bfloat16) (the message names the positions and the mass
            found). The check reads one boolean back from
            the logits' device.

    Example:
        >>> batch = KDCollator()(rows)  # doctest: +SKIP
        >>> loss = kd_loss(student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, batch)  #
        doctest: +SKIP
    """
    if kind not in KINDS:
        raise ValueError(f"`kind` must be one of {KINDS}, got {kind!r}.")
    if reduction not in REDUCTIONS:
        raise ValueError(f"`reduction` must be one of {REDUCTIONS}, got {reduction!r}.")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0 \
            or not math.isfinite(temperature):
        raise ValueError(f"`temperature` must be a positive number, got {temperature!r}.")
    missing = [key for key in _TARGET_KEYS if key not in targets]
    if missing:
        raise ValueError(f"`targets` lacks {missing}: pass what `KDCollator` returns (the distillation table's "
                         "`top_ids`, `top_logprobs` and `tail_logmass`, padded).")
    ids, teacher, tail = targets["top_ids"], targets["top_logprobs"], targets["tail_logmass"]
    lead = student_logits.shape[:-1]
    if ids.shape[:-1] != lead or teacher.shape != ids.shape or tail.shape != lead:
        raise ValueError(
            f"the targets' shapes (`top_ids` {tuple(ids.shape)}, `top_logprobs` {tuple(teacher.shape)}, `tail_logmass` "
            f"{tuple(tail.shape)}) must match `student_logits` {tuple(student_logits.shape)} (ids `(..., K)`, tail `(...)`)."
        )
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    valid = ids >= 0
    if teacher.is_floating_point():
        valid = valid & (teacher > float("-inf"))
    _check_mass(teacher, valid, tail, targets.get("target_mask"))
    log_s = _StudentBuckets.apply(student_logits, _safe_ids(ids, valid), valid, float(temperature))
    minus_inf = torch.tensor(float("-inf"), dtype=dtype, device=log_s.device)
    tail = tail.to(dtype)
    # A position with no target at all (padding) gets all its mass in the tail: finite, no NaN to mask.
    tail = torch.where(valid.any(-1) | (tail > float("-inf")), tail, torch.zeros_like(tail))
    buckets = torch.cat([torch.where(valid, teacher.to(dtype), minus_inf), tail[..., None]], -1)
    log_t = torch.log_softmax(buckets / temperature, -1)
    per_position = _divergence(log_t, log_s, kind)
    mask = targets.get("target_mask")
    if mask is not None:
        per_position = torch.where(mask.to(torch.bool), per_position, torch.zeros_like(per_position))
    if reduction == "none":
        return per_position
    if reduction == "sum":
        return per_position.sum()
    count = per_position.numel() if mask is None else mask.to(torch.bool).sum()
    return per_position.sum() / torch.clamp(torch.as_tensor(count, device=per_position.device), min=1)


def _check_mass(teacher: torch.Tensor, valid: torch.Tensor, tail: torch.Tensor, mask: Any) -> None:
    """Raise where a target's buckets do not hold the teacher's whole distribution (positions with no
    target, all padding, are skipped)."""
    kept = torch.where(valid, teacher.double(), torch.tensor(float("-inf"), dtype=torch.float64, device=teacher.device))
    mass = kept.exp().sum(-1) + tail.double().exp()
    targeted = valid.any(-1) | (tail > float("-inf"))
    if mask is not None:
        targeted = targeted & mask.to(torch.bool)
    tolerance = max(mass_tolerance(teacher.dtype) if teacher.is_floating_point() else 0.0, mass_tolerance(tail.dtype))
    wrong = targeted & ~((mass - 1.0).abs() <= tolerance)  # NaN mass is wrong too
    if bool(wrong.any()):
        where = wrong.nonzero().tolist()
        shown = ", ".join(f"{tuple(index)}: {mass[tuple(index)].item():.6g}" for index in where[:5])
        raise ValueError(
            f"{len(where)} target(s) whose kept probability plus tail mass is not 1 (within {tolerance:g}): "
            f"position {shown}{' ...' if len(where) > 5 else ''}. `tail_logmass` must be the log of the teacher's "
            "probability outside `top_ids`, log(1 - sum(exp(top_logprobs))), and -inf where every id is kept "
            "(the distillation table's column: `export --kd`)."
        )


def _safe_ids(ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`ids` with each padding entry pointing at a kept id of its row (the first one), so that writing
    to the ids touches only kept tokens."""
    first = ids.gather(-1, valid.to(torch.int8).argmax(-1, keepdim=True)).clamp(min=0)
    return torch.where(valid, ids, first)


class _StudentBuckets(torch.autograd.Function):
    """The student's log-probabilities on the K + 1 buckets, `[log q_1 .. log q_K, log q_tail]`, of
    `log_softmax(z / T)`, with few passes over the vocabulary: forward exponentiates once and sums twice
    (all; the rest, kept ids zeroed), backward is one product. Keeps one `(..., vocab)` tensor for backward
    (`exp((z - max) / T)` of the tokens outside the kept ids). Per-row scalars are float64.

    Backward, with `g` the gradient of the K + 1 outputs, `G = sum(g)` and `q = softmax(z / T)`:
    `dz_j = (g_j - q_j G) / T` for a kept id, `q_j (g_tail / q_tail - G) / T` for any other.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor,
                temperature: float) -> torch.Tensor:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        x = logits.to(dtype)
        top = x.amax(-1, keepdim=True)
        scaled_kept = (x.gather(-1, ids) - top) / temperature
        rest = x - top
        if temperature != 1.0:
            rest.div_(temperature)
        rest.exp_()
        total = rest.sum(-1).double()
        rest.scatter_(-1, ids, 0.0)
        outside = rest.sum(-1).double()
        log_total = total.log().to(dtype)
        minus_inf = torch.tensor(float("-inf"), dtype=dtype, device=x.device)
        log_kept = torch.where(valid, scaled_kept - log_total[..., None], minus_inf)
        log_tail = (outside.log() - total.log()).to(dtype)
        ctx.save_for_backward(rest, ids, valid, total, outside, log_kept.exp())
        ctx.temperature = temperature
        ctx.input_dtype = logits.dtype
        return torch.cat([log_kept, log_tail[..., None]], -1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        rest, ids, valid, total, outside, q_kept = ctx.saved_tensors
        k = ids.shape[-1]
        g_kept = torch.where(valid, grad[..., :k], torch.zeros_like(grad[..., :k]))
        g_tail = grad[..., k].double()
        g_sum = g_kept.sum(-1).double() + g_tail
        per_token = torch.where(outside > 0, g_tail / outside, torch.zeros_like(g_tail)) - g_sum / total
        per_token = (per_token / ctx.temperature).to(rest.dtype)
        dz = rest * per_token[..., None]
        kept = torch.where(valid, (g_kept - q_kept * g_sum.to(rest.dtype)[..., None]) / ctx.temperature,
                           torch.zeros_like(g_kept))
        dz.scatter_add_(-1, ids, kept)
        return dz.to(ctx.input_dtype), None, None, None


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """sum_b a_b (log a_b - log b_b) over the last axis, terms with a_b = 0 taken as 0 (no NaN, no
    gradient through them)."""
    present = log_a > float("-inf")
    zero = torch.zeros_like(log_a)
    a = torch.where(present, log_a, zero)
    b = torch.where(present, log_b, zero)
    return torch.where(present, a.exp() * (a - b), zero).sum(-1)


def _divergence(log_t: torch.Tensor, log_s: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "forward":
        return _kl(log_t, log_s)
    if kind == "reverse":
        return _kl(log_s, log_t)
    either = (log_t > float("-inf")) | (log_s > float("-inf"))
    zero = torch.zeros_like(log_t)
    log_m = torch.where(either, torch.logaddexp(torch.where(either, log_t, zero), torch.where(either, log_s, zero))
                        - math.log(2.0), torch.full_like(log_t, float("-inf")))
    return 0.5 * (_kl(log_t, log_m) + _kl(log_s, log_m))


class KDCollator:
    """Pads distillation rows into a batch for a causal LM student and `kd_loss`.

    Takes a list of features, each either a row of the distillation table (`Dataset.from_parquet` of
    `export --kd`: `input_ids` the context, one target at `position`) or an example of
    `group_sequences` (`input_ids` the whole sequence, a list of targets, one per `position`). The target
    for the token at `position` sits at the student's logits index `position - 1` (the logits there
    predict it). Sequences are padded on the right.

    Args:
        pad_token_id (`int`): the id that pads `input_ids` (masked out by `attention_mask`).
        max_length (`int`, *optional*): cut every sequence to this many tokens (targets past it dropped).

    Returns (from `__call__`) a dict of CPU tensors: `input_ids` and `attention_mask` int64 `(B, T)`;
    `top_ids` int64 `(B, T, K)` (0 where padding), `top_logprobs` float32 `(B, T, K)` (-inf where
    padding), `tail_logmass` float32 `(B, T)`, `target_mask` bool `(B, T)` (True where a target is),
    with `K` the widest row's.

    Raises:
        ValueError: a feature lacks a column, its lists disagree in length, a target's position is not
            inside its `input_ids` (`1 <= position <= len(input_ids)`), or a target's kept probability plus
            tail mass is off 1 by more than `MASS_TOLERANCE` (1e-3).

    Example:
        >>> from datasets import Dataset  # doctest: +SKIP
        >>> rows = Dataset.from_parquet("kd.parquet")  # doctest: +SKIP
        >>> loader = torch.utils.data.DataLoader(rows, batch_size=8, collate_fn=KDCollator(pad_token_id=0))  # doctest: +SKIP
    """

    def __init__(self, pad_token_id: int = 0, *, max_length: int | None = None) -> None:
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int):
            raise ValueError(f"`pad_token_id` must be an int token id, got {pad_token_id!r}.")
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
            raise ValueError(f"`max_length` must be None or an int of at least 1, got {max_length!r}.")
        self.pad_token_id = pad_token_id
        self.max_length = max_length

    def __call__(self, features: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        examples = [_as_example(feature, index, self.max_length) for index, feature in enumerate(features)]
        rows = len(examples)
        length = max([1, *(len(e["input_ids"]) for e in examples)])
        width = max([1, *(len(ids) for e in examples for ids in e["top_ids"])])
        batch = {
            "input_ids": torch.full((rows, length), self.pad_token_id, dtype=torch.long),
            "attention_mask": torch.zeros((rows, length), dtype=torch.long),
            "top_ids": torch.zeros((rows, length, width), dtype=torch.long),
            "top_logprobs": torch.full((rows, length, width), float("-inf"), dtype=torch.float32),
            "tail_logmass": torch.full((rows, length), float("-inf"), dtype=torch.float32),
            "target_mask": torch.zeros((rows, length), dtype=torch.bool),
        }
        for b, example in enumerate(examples):
            n = len(example["input_ids"])
            batch["input_ids"][b, :n] = torch.tensor(example["input_ids"], dtype=torch.long)
            batch["attention_mask"][b, :n] = 1
            for position, ids, logprobs, tail in zip(example["position"], example["top_ids"], example["top_logprobs"],
                                                     example["tail_logmass"]):
                at = position - 1
                batch["top_ids"][b, at, :len(ids)] = torch.tensor(ids, dtype=torch.long)
                batch["top_logprobs"][b, at, :len(ids)] = torch.tensor(logprobs, dtype=torch.float32)
                batch["tail_logmass"][b, at] = float("-inf") if tail is None else tail
                batch["target_mask"][b, at] = True
        return batch


def _as_example(feature: Mapping[str, Any], index: int, max_length: int | None) -> dict[str, Any]:
    """A feature as `input_ids` and lists of targets (a table row holds one target)."""
    missing = [key for key in ("input_ids", "position", *_TARGET_KEYS) if key not in feature]
    if missing:
        raise ValueError(f"feature {index} lacks {missing}: pass rows of the distillation table (`export --kd`) "
                         "or examples of `group_sequences`.")
    input_ids = list(feature["input_ids"])
    position = feature["position"]
    if isinstance(position, int):  # one row of the table: one target, after its context
        targets = {"position": [position], **{key: [feature[key]] for key in _TARGET_KEYS}}
    else:
        targets = {"position": list(position), **{key: list(feature[key]) for key in _TARGET_KEYS}}
        if len({len(values) for values in targets.values()}) != 1:
            raise ValueError(f"feature {index}: `position`, `top_ids`, `top_logprobs` and `tail_logmass` must be "
                             "lists of one length (one entry per target).")
    for position, ids, logprobs in zip(targets["position"], targets["top_ids"], targets["top_logprobs"]):
        if not 1 <= position <= len(input_ids):
            raise ValueError(f"feature {index}: a target at position {position} needs 1 <= position <= "
                             f"len(input_ids) ({len(input_ids)}): the logits at position - 1 predict it.")
        if len(ids) != len(logprobs):
            raise ValueError(f"feature {index}: `top_ids` and `top_logprobs` differ in length at position {position}.")
    for position, logprobs, tail in zip(targets["position"], targets["top_logprobs"], targets["tail_logmass"]):
        mass = math.fsum(math.exp(value) for value in logprobs) + (0.0 if tail is None else math.exp(tail))
        if not abs(mass - 1.0) <= MASS_TOLERANCE:
            raise ValueError(f"feature {index}: the target at position {position} holds a kept probability plus "
                             f"tail mass of {mass:.6g}, not 1 (within {MASS_TOLERANCE}): `tail_logmass` must be "
                             "log(1 - sum(exp(top_logprobs))), -inf (or None) where every id is kept.")
    if max_length is not None and len(input_ids) > max_length:
        input_ids = input_ids[:max_length]
        keep = [i for i, position in enumerate(targets["position"]) if position <= max_length]
        targets = {key: [values[i] for i in keep] for key, values in targets.items()}
    return {"input_ids": input_ids, **targets}


def group_sequences(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Join the distillation table's rows of each sequence into one example, so that a student reads a
    sequence once for all its targets (the table's rows each carry their own context).

    Rows of one sequence share `generation`, `sample` and `sequence` (a prompt table's rows and a
    completion table's rows of the same sequence join too). An example, in order of each sequence's first
    row: `generation`, `sample`, `sequence`, `input_ids` (the last row's context and token: the whole
    sequence), and one entry per target, by position: `position`, `top_ids`, `top_logprobs`,
    `tail_logmass`. `KDCollator` takes these examples.

    Raises:
        ValueError: two rows of a sequence hold the same position.

    Example:
        >>> examples = group_sequences(Dataset.from_parquet("kd.parquet"))  # doctest: +SKIP
    """
    groups: dict[tuple[Any, Any, Any], list[Mapping[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["generation"], row["sample"], row["sequence"]), []).append(row)
    examples = []
    for (generation, sample, sequence), members in groups.items():
        members = sorted(members, key=lambda row: row["position"])
        positions = [row["position"] for row in members]
        if len(set(positions)) != len(positions):
            raise ValueError(f"generation {generation}, sample {sample!r}, sequence {sequence}: two rows hold one "
                             "position; group one table's rows (or a prompt table's and a completion table's).")
        last = members[-1]
        examples.append({
            "generation": generation, "sample": sample, "sequence": sequence,
            "input_ids": [*last["input_ids"], last["token"]],
            "position": positions,
            **{key: [row[key] for row in members] for key in _TARGET_KEYS},
        })
    return examples
