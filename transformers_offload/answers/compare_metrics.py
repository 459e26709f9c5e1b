"""The per-token values of a comparison (`answers.compare`): two next-token distributions of the same
row and step, `a` (the reference) and `b`, compared in float64.

For one row and step, with `xa`, `xb` the recorded `(vocab,)` tensors (`out.logits[t][r]` or
`out.scores[t][r]`) of `a` and `b`, and in full (dense, sparse or native recordings), the values are
these torch expressions (`docs/compare.md` explains them):

    la, lb          = torch.log_softmax(xa.double(), -1), torch.log_softmax(xb.double(), -1)
    pa, pb          = la.exp(), lb.exp()
    kl_ab           = torch.where(pa > 0, pa * (la - lb), 0).sum()          # KL(a||b), nats
    kl_ba           = torch.where(pb > 0, pb * (lb - la), 0).sum()          # KL(b||a), nats
    top_a, top_b    = largest(xa, 5), largest(xb, 5)  # the 5 largest entries' ids, ties to the lower id
    top1_a, top1_b  = top_a[0], top_b[0];  same_top1 = top1_a == top1_b
    top_overlap_k   = len(set(top_a[:k]) & set(top_b[:k])) / k              # k = 1..5
    max_logit_diff  = torch.where(xa == xb, 0, (xa.double() - xb.double()).abs()).max()
and for the chosen token `y` (read from row `q`: `r` itself, or in beam search the parent row
`beam_parents()[t][r]` whose distribution chose it, as the `stats` stream does):
    logprob_a, logprob_b = la[q, y], lb[q, y]
    prob_change     = pb[q, y] - pa[q, y]                                  # p_b - p_a
    rank_b          = (xb[q] > xb[q, y]).sum()                              # 0 = b's most likely

`largest(x, k)` is `torch.sort(x, descending=True, stable=True).indices[:k]` (ties to the lower id), found
among the tiles of 256 entries whose maximum reaches the k-th largest tile maximum (which hold every
entry at least the k-th largest); `rank_b` is counted in the tiles whose maximum is above `xb[q, y]`
where those are few. Both compare the recorded dtype, whose order is that of its `double()`.

A `topk:K` record keeps each row's K largest entries, its logsumexp and the mass outside the K. Where
`a` or `b` (or both) is one, the KLs are those of the two distributions coarsened to the same
partition: each token id kept by every top-k side (all of the other side's vocabulary when it is
full), plus one bucket for everything else (its mass: `mass_outside` plus the kept-elsewhere ids'
probability on a top-k side, `exp(logsumexp of the rest)` on a full side). By the log-sum inequality
this is a lower bound of the true KL, short of it by `tail_a * KL(a's tail || b's tail)` (the
renormalised distributions over the bucket), and exact when the tails agree or carry no mass. Where one
side is full and the other a `topk:K+tail:N` record (N ids drawn from its tail), that shortfall is
estimated from the draws and added, for both directions (`_tail_kls`): unbiased, each draw's term >= 0,
so the estimate is no lower than the bound; its noise falls as 1/sqrt(N x tokens) in a mean (measured on
SmolLM2 against its bfloat16 and int8 versions, 1,020 tokens: mean KL within 0.2% of the full
reference's with K = 32, N = 48, where the one-bucket bound of topk:64 was 11-17% short).
Where every entry of the block's rows on both sides is finite (raw logits), fewer float64 passes over
the vocabulary give the same quantities, by these expressions instead (with `a`, `b` the `double()`s):

    ma, mb          = a.max(), b.max();  ea, eb = (a - ma).exp(), (b - mb).exp()
    za, zb          = ea.sum(), eb.sum();  d = a - b;  shift = (ma - mb) + (za.log() - zb.log())
    kl_ab           = torch.dot(ea, d) / za - shift                        # sum pa (la - lb), sum pa = 1
    kl_ba           = shift - torch.dot(eb, d) / zb
    logprob_a       = (a[q, y] - ma_q) - za_q.log()                          # and so for b, the top-5's
    max_logit_diff  = d.abs().max()
`la = (a - ma) - za.log()` is how log-softmax is computed, so these differ from the log-softmax
expressions above by float64 rounding alone: measured on SmolLM2 against its bfloat16 rescore and on a
152,064-entry vocabulary, KLs by at most 5.5e-14 (relative 1.3e-8 at a KL of 1e-3, 1.2e-7 at 1.4e-7),
logprobs by 6e-14; `max_logit_diff` is the same. The same tensors on both sides still give exactly 0.
`top_overlap_k` needs K >= k on the top-k sides; the chosen token's values need it among the kept ids
(else null); `max_logit_diff` needs both in full (else null).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .largest import count_above, largest, tile_maxima

TOP = 5  # top-k overlaps for k = 1..TOP; the alternatives kept per token for the compare view
BLOCK = 1 << 20  # float64 entries computed at once (8 MiB a temporary, or one row): rows are taken in blocks
# Recorded entries of full rows on both sides taken at once (16 MiB of float32 a side): the fast path holds
# one row's float64 buffers whatever the block, so its per-call work (top ids, ranks, bookkeeping) is
# shared by this many rows; where it cannot run, the `where` expressions take BLOCK-sized sub-blocks.
GROUP = 1 << 22


class Side:
    """One side's distributions at one step: the full `(rows, vocab)` tensor, or a top-k record, with
    (`chosen`, optional, beside a top-k record) the recording's per-token statistics of the step's rows
    (`token`, `logprob_raw`, `rank_raw`: the `stats` stream), which give every chosen token's logprob and
    rank where the record keeps only some of them."""

    def __init__(self, full: torch.Tensor | None = None, topk: dict[str, torch.Tensor] | None = None,
                 chosen: dict[str, torch.Tensor] | None = None) -> None:
        self.full = full
        self.topk = topk
        self.chosen = chosen

    @property
    def width(self) -> int | None:
        """K of a top-k record, None when full."""
        return None if self.topk is None else int(self.topk["indices"].shape[-1])

    def rows(self) -> int:
        return int((self.full if self.full is not None else self.topk["indices"]).shape[0])


class Workspace:
    """Float64 buffers reused from block to block: a fresh `(rows, vocab)` float64 tensor is new memory
    the kernel zero-fills page by page on first touch, which costs as much as the arithmetic on it."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, vocab: int) -> torch.Tensor:
        found = self._buffers.get(name)
        if found is None or found.shape[1] != vocab or found.shape[0] < rows:
            found = self._buffers[name] = torch.empty(rows, vocab, dtype=torch.float64)
        return found[:rows]


def step_values(a: Side, b: Side, rows: torch.Tensor, chosen_rows: torch.Tensor,
                tokens: torch.Tensor, workspace: Workspace | None = None) -> dict[str, torch.Tensor]:
    """The per-token values (the module's docstring) of one step's `rows`, each a `(n,)` tensor (the
    top alternatives `(n, TOP)`), float64 for values, int64 for ids and ranks, bool for masks.

    Args:
        a, b (`Side`): the step's distributions of every row.
        rows (`torch.LongTensor` of shape `(n,)`): the rows whose distributions are compared.
        chosen_rows (`torch.LongTensor` of shape `(n,)`): per row, the row its chosen token was drawn from.
        tokens (`torch.LongTensor` of shape `(n,)`): the chosen tokens (-1: none, e.g. a beam search's
            last step: the chosen-token values are then unknown).

    Masks (True: the value is known): `chosen_known` (logprobs, `prob_change`, `rank_b`), `logit_known`
    (`max_logit_diff`), `overlap_known` `(n, TOP)`, and `estimate` (True where a side is top-k).
    """
    n = int(rows.shape[0])
    out: dict[str, list[torch.Tensor]] = {}
    block = max(1, group_entries(a, b) // max(1, _vocab(a, b)))
    workspace = Workspace() if workspace is None else workspace
    for start in range(0, n, block):
        part = slice(start, start + block)
        values = _block_values(a, b, rows[part], chosen_rows[part], tokens[part], workspace)
        for name, value in values.items():
            out.setdefault(name, []).append(value)
    if not out:
        return {}
    return {name: torch.cat(parts) for name, parts in out.items()}


def group_entries(a: Side, b: Side) -> int:
    """Entries (rows x vocabulary) of one block of `step_values`: GROUP where both sides are full, else
    BLOCK (the float64 temporaries of the `where` and top-k expressions)."""
    return GROUP if a.full is not None and b.full is not None else BLOCK


def _vocab(a: Side, b: Side) -> int:
    for side in (a, b):
        if side.full is not None:
            return int(side.full.shape[-1])
    return max(a.width or 1, b.width or 1)


def _in_blocks(a: Side, b: Side, rows: torch.Tensor, chosen_rows: torch.Tensor, tokens: torch.Tensor,
               workspace: Workspace, maxima: tuple[Any, Any]) -> dict[str, torch.Tensor]:
    """`_block_values` of full sides by the `where` expressions, BLOCK entries of rows at a time (`maxima`:
    the rows' `tile_maxima`, each None or sliced with them)."""
    block = max(1, BLOCK // _vocab(a, b))
    parts = [_block_values(a, b, rows[i : i + block], chosen_rows[i : i + block], tokens[i : i + block], workspace,
                           maxima=tuple(None if m is None else m[i : i + block] for m in maxima))
             for i in range(0, int(rows.shape[0]), block)]
    return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}


def _block_values(a: Side, b: Side, rows: torch.Tensor, chosen_rows: torch.Tensor, tokens: torch.Tensor,
                  workspace: Workspace, maxima: tuple[Any, Any] | None = None) -> dict[str, torch.Tensor]:
    """`step_values` of one block of rows; given `maxima` (the rows' `tile_maxima`), from `_in_blocks`:
    the `where` expressions, the fast path having found an entry that is not finite."""
    n = int(rows.shape[0])
    known_token = tokens >= 0
    y = tokens.clamp(min=0)
    if a.full is not None and b.full is not None:
        xa, xb = _rows(a.full, rows), _rows(b.full, rows)
        fast = maxima is None
        maxima = (tile_maxima(xa), tile_maxima(xb)) if fast else maxima
        found = _finite_values(a, b, xa, xb, maxima, rows, chosen_rows, y, workspace) if fast else None
        if found is not None:  # every entry finite (raw logits): the module's fast expressions
            da, db, kl_ab, kl_ba, max_diff = found
        elif n > max(1, BLOCK // int(xa.shape[-1])):  # the `where` expressions' float64 temporaries: BLOCK at once
            return _in_blocks(a, b, rows, chosen_rows, tokens, workspace, maxima)
        else:  # an entry -inf (processed scores): the documented `where` expressions
            da = _describe(a, rows, chosen_rows, y, xa, maxima[0])
            db = _describe(b, rows, chosen_rows, y, xb, maxima[1])
            la, lb, wide_a, wide_b = da["log_softmax"], db["log_softmax"], da["x"], db["x"]
            pa, pb = la.exp(), lb.exp()
            kl_ab = torch.where(pa > 0, pa * (la - lb), 0.0).sum(-1)
            kl_ba = torch.where(pb > 0, pb * (lb - la), 0.0).sum(-1)
            max_diff = torch.where(wide_a == wide_b, 0.0, (wide_a - wide_b).abs()).amax(-1)
        logit_known = torch.ones(n, dtype=torch.bool)
        estimate = torch.zeros(n, dtype=torch.bool)
    else:  # a top-k side: the coarse KLs
        da, db = _describe(a, rows, chosen_rows, y), _describe(b, rows, chosen_rows, y)
        kl_ab, kl_ba = _coarse_kls(da, db)
        max_diff = torch.full((n,), float("nan"), dtype=torch.float64)
        logit_known = torch.zeros(n, dtype=torch.bool)
        estimate = torch.ones(n, dtype=torch.bool)
    top_a, top_b = da["top_ids"], db["top_ids"]
    width = min(top_a.shape[-1], top_b.shape[-1])
    overlap = torch.full((n, TOP), float("nan"), dtype=torch.float64)
    for k in range(1, width + 1):
        shared = (top_a[:, :k, None] == top_b[:, None, :k]).any(-1).sum(-1)
        overlap[:, k - 1] = shared.double() / k
    overlap_known = torch.zeros((n, TOP), dtype=torch.bool)
    overlap_known[:, :width] = True
    chosen_known = known_token & da["chosen_known"] & db["chosen_known"]
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    logprob_a = torch.where(chosen_known, da["chosen_logprob"], nan)
    logprob_b = torch.where(chosen_known, db["chosen_logprob"], nan)
    return {
        "kl_ab": kl_ab, "kl_ba": kl_ba,
        "logprob_a": logprob_a, "logprob_b": logprob_b,
        "prob_change": torch.where(chosen_known, logprob_b.exp() - logprob_a.exp(), nan),
        "top1_a": top_a[:, 0], "top1_b": top_b[:, 0], "same_top1": top_a[:, 0] == top_b[:, 0],
        "top_overlap": overlap, "overlap_known": overlap_known,
        "max_logit_diff": max_diff, "logit_known": logit_known,
        "rank_b": torch.where(chosen_known, db["chosen_rank"], -1),
        "chosen_known": chosen_known, "estimate": estimate,
        "top_ids_a": _pad(top_a, -1), "top_logprobs_a": _pad(da["top_logprobs"], float("nan")),
        "top_ids_b": _pad(top_b, -1), "top_logprobs_b": _pad(db["top_logprobs"], float("nan")),
    }


def _pad(values: torch.Tensor, fill: Any) -> torch.Tensor:
    if values.shape[-1] >= TOP:
        return values[:, :TOP]
    padding = torch.full((values.shape[0], TOP - values.shape[-1]), fill, dtype=values.dtype)
    return torch.cat([values, padding], -1)


def _rows(full: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`full[rows]`, without a copy where `rows` are every row in order."""
    if rows.numel() == full.shape[0] and torch.equal(rows, torch.arange(full.shape[0])):
        return full
    return full[rows]


def _finite_values(a: Side, b: Side, xa: torch.Tensor, xb: torch.Tensor, maxima: tuple[Any, Any],
                   rows: torch.Tensor, chosen_rows: torch.Tensor, y: torch.Tensor, workspace: Workspace
                   ) -> tuple[dict[str, Any], dict[str, Any], torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Both sides' descriptions (`_describe`'s keys but the full tensors), both KLs and the largest logit
    difference of rows `xa`, `xb` (`a.full[rows]`, `b.full[rows]`), by the module's fast expressions: each
    side's `exp(x - max)` computed once in a reused buffer, no log-softmax tensor. None where an entry is
    not finite (then the caller uses the `where` expressions), found from a row's largest |xa - xb|."""
    n, vocab = int(rows.shape[0]), int(xa.shape[-1])
    top_a, top_b = ((x.amax(-1, keepdim=True) if m is None else m.amax(-1, keepdim=True)).double()
                    for x, m in ((xa, maxima[0]), (xb, maxima[1])))
    sums = torch.empty(5, n, dtype=torch.float64)  # per row: max |d|, Z_a, Z_b, sum e_a d, sum e_b d
    wide_a, wide_b, difference = (workspace.get(name, 1, vocab)[0] for name in ("a", "b", "difference"))
    for i in range(n):  # a row at a time: its float64 rows stay in the cores' caches from pass to pass
        torch.sub(wide_a.copy_(xa[i]), wide_b.copy_(xb[i]), out=difference)  # xa - xb, exact
        torch.maximum(difference.amax(), difference.amin().neg_(), out=sums[0, i])  # max |xa - xb|, exact
        # Every entry of both rows is finite iff max |xa - xb| is (the difference of two finite float32 or
        # bfloat16 values is finite in float64; of an infinite or nan one, infinite or nan, and nan
        # spreads to amax and amin): else the caller's `where` expressions, at the first such row.
        if not math.isfinite(sums[0, i]):
            return None
        torch.sum(torch.exp(wide_a.sub_(top_a[i]), out=wide_a), 0, out=sums[1, i])  # sum of exp(xa - max): Z_a
        torch.sum(torch.exp(wide_b.sub_(top_b[i]), out=wide_b), 0, out=sums[2, i])
        torch.dot(wide_a, difference, out=sums[3, i])
        torch.dot(wide_b, difference, out=sums[4, i])
    max_diff, mass_a, mass_b = sums[0], sums[1], sums[2]
    mean_a, mean_b = sums[3] / mass_a, sums[4] / mass_b  # sum p_a (xa - xb), sum p_b (xa - xb)
    shift = (top_a - top_b)[:, 0] + (mass_a.log() - mass_b.log())  # lse_a - lse_b
    kl_ab, kl_ba = mean_a - shift, shift - mean_b
    described = []
    same = torch.equal(chosen_rows, rows)
    for side, recorded, top, mass, tiles in ((a, xa, top_a, mass_a, maxima[0]), (b, xb, top_b, mass_b, maxima[1])):
        recorded_q = recorded if same else side.full[chosen_rows]
        if same:
            top_q, mass_q = top, mass
        else:
            wide_q = recorded_q.double()
            top_q = wide_q.amax(-1, keepdim=True)
            mass_q = (wide_q - top_q).exp().sum(-1)
        ids = largest(recorded, TOP, tiles)
        picked = recorded_q.gather(-1, y[:, None])
        described.append({
            "top_ids": ids,
            "top_logprobs": (recorded.gather(-1, ids).double() - top) - mass.log()[:, None],
            "chosen_logprob": ((picked.double() - top_q) - mass_q.log()[:, None])[:, 0],
            "chosen_rank": count_above(recorded_q, picked, tiles if same else tile_maxima(recorded_q)),
            "chosen_known": torch.ones(n, dtype=torch.bool),
        })
    return described[0], described[1], kl_ab, kl_ba, max_diff


def _dots(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per row, `torch.dot(x[i], y[i])` (the BLAS dot: one pass, no temporary), float64 `(n,)`."""
    return torch.stack([torch.dot(x[i], y[i]) for i in range(x.shape[0])]) if x.shape[0] else x.new_zeros(0)


def _describe(side: Side, rows: torch.Tensor, chosen_rows: torch.Tensor, y: torch.Tensor,
              recorded: torch.Tensor | None = None, maxima: torch.Tensor | None = None) -> dict[str, Any]:
    """One side's top ids and logprobs of `rows`, and the chosen token's logprob and rank (read from
    `chosen_rows`), in float64; the full log-softmax where the side is full (`recorded`: its `rows`, and
    `maxima` their `tile_maxima`, where the caller has them), the kept ids where top-k."""
    if side.full is not None:
        if recorded is None:
            recorded = side.full[rows]
            maxima = tile_maxima(recorded)
        x = recorded.double()
        log_softmax = torch.log_softmax(x, -1)
        top = largest(recorded, TOP, maxima)
        same = torch.equal(chosen_rows, rows)
        recorded_q = recorded if same else side.full[chosen_rows]
        lq = log_softmax if same else torch.log_softmax(recorded_q.double(), -1)
        picked = recorded_q.gather(-1, y[:, None])
        maxima_q = maxima if same else tile_maxima(recorded_q)
        return {
            "x": x, "log_softmax": log_softmax, "top_ids": top, "top_logprobs": log_softmax.gather(-1, top),
            "chosen_logprob": lq.gather(-1, y[:, None])[:, 0],
            "chosen_rank": count_above(recorded_q, picked, maxima_q),
            "chosen_known": torch.ones(rows.shape[0], dtype=torch.bool),
        }
    record = side.topk
    ids = record["indices"][rows]
    logprobs = record["values"][rows].double() - record["logsumexp"][rows].double()[:, None]
    q_ids, q_values = record["indices"][chosen_rows], record["values"][chosen_rows].double()
    q_logprobs = q_values - record["logsumexp"][chosen_rows].double()[:, None]
    hit = q_ids == y[:, None]
    found = hit.any(-1)
    where = hit.to(torch.int8).argmax(-1, keepdim=True)
    value = q_values.gather(-1, where)
    drawn = {}
    if "tail_indices" in record:  # `"topk:K+tail:N"`: the draws from outside the K, log-probabilities in float64
        drawn = {"tail_ids": record["tail_indices"][rows],
                 "tail_logprobs": record["tail_values"][rows].double() - record["logsumexp"][rows].double()[:, None]}
    chosen_logprob = q_logprobs.gather(-1, where)[:, 0]
    chosen_rank = (q_values > value).sum(-1)  # every entry above a kept one is kept too: its rank among them
    if side.chosen is not None:  # the recorded statistics: every chosen token's, kept or not, one expression
        found = side.chosen["token"][chosen_rows] == y
        chosen_logprob = side.chosen["logprob_raw"][chosen_rows].double()
        chosen_rank = side.chosen["rank_raw"][chosen_rows]
    return {
        **drawn,
        "ids": ids, "logprobs": logprobs, "mass_outside": record["mass_outside"][rows].double(),
        "top_ids": ids[:, :TOP], "top_logprobs": logprobs[:, :TOP],
        "chosen_logprob": chosen_logprob, "chosen_rank": chosen_rank, "chosen_known": found,
    }


def _coarse_kls(da: dict[str, Any], db: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Both KLs over the shared kept ids plus one bucket for the rest (the module's docstring)."""
    drawn = None
    if "ids" in da and "ids" in db:
        match = da["ids"][:, :, None] == db["ids"][:, None, :]  # (n, Ka, Kb)
        in_b, in_a = match.any(-1), match.any(-2)
        la = da["logprobs"]
        lb = db["logprobs"].gather(-1, match.to(torch.int8).argmax(-1))
        shared = in_b
        tail_a = da["mass_outside"] + torch.where(in_b, 0.0, la.exp()).sum(-1)
        tail_b = db["mass_outside"] + torch.where(in_a, 0.0, db["logprobs"].exp()).sum(-1)
    else:
        top, full = (da, db) if "ids" in da else (db, da)
        ids = top["ids"]
        lt, lf = top["logprobs"], full["log_softmax"].gather(-1, ids)
        rest = full["log_softmax"].scatter(-1, ids, float("-inf"))
        tail_t, tail_f = top["mass_outside"], torch.logsumexp(rest, -1).exp()
        shared = torch.ones_like(ids, dtype=torch.bool)
        (la, tail_a), (lb, tail_b) = ((lt, tail_t), (lf, tail_f)) if "ids" in da else ((lf, tail_f), (lt, tail_t))
        drawn = (top, full, tail_t, tail_f) if "tail_ids" in top else None
    la = torch.cat([la, tail_a.log()[:, None]], -1)
    lb = torch.cat([lb, tail_b.log()[:, None]], -1)
    keep = torch.cat([shared, torch.ones_like(shared[:, :1])], -1)
    pa, pb = la.exp(), lb.exp()
    kl_ab = torch.where(keep & (pa > 0), pa * (la - lb), 0.0).sum(-1)
    kl_ba = torch.where(keep & (pb > 0), pb * (lb - la), 0.0).sum(-1)
    if drawn is not None:  # the tails' divergences, from the top-k side's draws
        within_t, within_f = _tail_kls(*drawn)
        kl_ab, kl_ba = (kl_ab + within_t, kl_ba + within_f) if drawn[0] is da else (kl_ab + within_f, kl_ba + within_t)
    return kl_ab, kl_ba


def _tail_kls(top: dict[str, Any], full: dict[str, Any], tail_t: torch.Tensor, tail_f: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`tail_t * KL(t's tail || f's tail)` and `tail_f * KL(f's tail || t's tail)` (the renormalised
    distributions over the ids outside the K) estimated from the top-k side's N draws from its tail:
    with `log r = (lf[j] - log tail_f) - (lt[j] - log tail_t)` at each draw j, the means of `r - 1 - log r`
    and of `r log r - r + 1` (each of whose expectations under t's tail is that KL, and each >= 0). Rows
    where either tail holds no mass add 0 (the bucket's own term is then the whole divergence)."""
    log_t = top["tail_logprobs"] - tail_t.log()[:, None]
    log_f = full["log_softmax"].gather(-1, top["tail_ids"]) - tail_f.log()[:, None]
    log_r = log_f - log_t
    r = log_r.exp()
    both = (tail_t > 0) & (tail_f > 0)
    within_t = torch.where(both, tail_t * (r - 1 - log_r).mean(-1), 0.0)
    within_f = torch.where(both, tail_f * (torch.where(r > 0, r * log_r, 0.0) - r + 1).mean(-1), 0.0)
    return within_t, within_f
