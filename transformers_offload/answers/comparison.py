"""`Comparison`: what `compare(a, b)` found, per token, per sample and in summary.

The per-token values are `answers.compare_metrics`' expressions; the summary's statistics are these
NumPy expressions of a column `v` (float64, one entry per token where the value is known):

    mean, stderr    v.mean(), v.std(ddof=1) / sqrt(len(v))
    max, min        v.max(), v.min()
    percentile P    numpy.percentile(v, P)            # linear interpolation, P in PERCENTILES
    rms             sqrt((d ** 2).mean())            # d: the chosen token's probability change
    rms stderr      ((d ** 2).std(ddof=1) / sqrt(len(d))) / (2 * rms)    # first-order propagation
    same top-1      s.mean() * 100, sqrt(f * (1 - f) / (len(s) - 1)) * 100    # s: same_top1, f its mean

the probability change in percent (of probability), as llama.cpp's perplexity tool prints it. Its
perplexity statistics are these, over the tokens whose chosen token is known, with `na = -logprob_a`
and `nb = -logprob_b` (the chosen token's negative log-likelihood under each side, nats) and
`se(v) = v.std(ddof=1) / sqrt(n)`:

    ppl_a, ppl_b    math.exp(na.mean()) +- ppl_a * se(na), and so for b
    correlation     numpy.corrcoef(na, nb)[0, 1] * 100                    # Cor(ln(PPL(Q)), ln(PPL(base)))
    log ratio       (nb - na).mean() +- se(nb - na)                       # Mean ln(PPL(Q)/PPL(base))
    ratio           math.exp(log ratio) +- ratio * se(nb - na)            # Mean PPL(Q)/PPL(base)
    difference      ppl_b - ppl_a +- sqrt((ppl_b se(nb))**2 + (ppl_a se(na))**2
                                         - 2 ppl_a ppl_b cov(na, nb) / n)  # first-order propagation

`b` plays llama.cpp's Q (the candidate) and `a` its base.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .compare_metrics import TOP

PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)

# The per-token table's keys, then the comparison's columns (docs/compare.md): name, Arrow type name.
_KEYS = ("generation", "sample", "prompt", "sequence", "row", "step", "token")
_VALUES = (("estimate", "bool"), ("kl_ab", "float64"), ("kl_ba", "float64"), ("logprob_a", "float64"),
           ("logprob_b", "float64"), ("prob_change", "float64"), ("same_top1", "bool"), ("top1_a", "int64"),
           ("top1_b", "int64"), *((f"top_overlap_{k}", "float64") for k in range(1, TOP + 1)),
           ("max_logit_diff", "float64"), ("rank_b", "int64"))


class Comparison:
    """The result of `compare(a, b)`: one entry per compared token (row and step).

    Attributes:
        stream (`str`): `"logits"` or `"scores"`.
        pairs (`list[tuple[int, int]]`): the paired generations, as (index in `a`, index in `b`).
        estimate (`bool`): True when a side was recorded `topk:K`: its tokens' KLs are estimates (docs/compare.md).
        estimate_kind (`str`): which: a lower bound (`topk:K`), or an unbiased estimate that may exceed the
            exact KL (a `topk:K+tail:N` side against a full one).
        columns (`dict[str, numpy.ndarray]`): the per-token values, one entry per token (see `to_arrow`).
    """

    def __init__(self, columns: dict[str, np.ndarray], *, stream: str, pairs: list[tuple[int, int]],
                 sample_as_text: bool, estimate_kind: str = "") -> None:
        self.columns = columns
        self.estimate_kind = estimate_kind
        self.stream = stream
        self.pairs = pairs
        self._sample_as_text = sample_as_text
        self.estimate = bool(len(self) and columns["estimate"].any())

    def __len__(self) -> int:
        return int(self.columns["step"].shape[0]) if "step" in self.columns else 0

    def __repr__(self) -> str:
        return (f"Comparison({self.stream!r}, {len(self.pairs)} generation(s), {len(self)} tokens"
                f"{', estimate' if self.estimate else ''})")

    def chosen_missing(self) -> int:
        """The tokens whose chosen token's logprob a side cannot give (a compact record that did not keep
        it, and no `stats` stream beside it): where any is, the perplexity and probability-change
        statistics are refused rather than computed over the others (a silent subset)."""
        if not len(self):
            return 0
        return int(((self.columns["token"] >= 0) & ~self.columns["chosen_known"]).sum())

    def _refused(self, missing: int) -> str | None:
        if not missing:
            return None
        return (f"perplexity and probability change refused: {missing} of {len(self)} chosen tokens lie outside what a "
                "compact recording kept, and a statistic over the rest would describe another set of tokens. Record "
                "the reference dense, or with its per-token statistics beside the compact logits (`score` does so "
                "for every compact encoding; `Recorder(streams=(\"logits\", \"stats\"))`).")

    def _known(self, name: str) -> np.ndarray:
        values = self.columns[name]
        mask = self.columns["chosen_known"] if name in ("prob_change", "logprob_a", "logprob_b") else None
        return values if mask is None else values[mask]

    def summary(self) -> dict[str, Any]:
        """Mean +- standard error, maximum, minimum and percentiles (99.9 to 0.1) of KL(a||b), KL(b||a)
        and the chosen token's probability change (`p_b - p_a`, in percent), its RMS, and the same-top-1
        percentage, as plain JSON-ready data (None where no token has the value).

        Returns:
            `dict`: `stream`, `tokens`, `estimate`, `generations` (the pairs), `kl_ab`, `kl_ba`,
            `prob_change_percent` (each: `count`, `mean`, `stderr`, `max`, `min`, `percentiles` keyed
            "99.9" ... "0.1"), `perplexity` (`count`, `ppl_a`, `ppl_b`, `log_ratio`, `ratio`, `difference`,
            each `value` and `stderr`, and `correlation_percent`: the module's docstring),
            `prob_change_rms_percent` (`value`, `stderr`), `same_top1_percent`
            (`value`, `stderr`), `top_overlap` (per k, the mean overlap), `max_logit_diff` (the largest
            over every full token, or None).

        Example:
            >>> compare(run, run).summary()["kl_ab"]["max"]  # doctest: +SKIP
            0.0
        """
        missing = self.chosen_missing()
        change = self._known("prob_change") if not missing else np.zeros(0)
        rms = rms_stderr = None
        if change.size:
            squares = change ** 2
            rms = math.sqrt(float(squares.mean()))
            if change.size > 1 and rms > 0:
                rms_stderr = float(squares.std(ddof=1) / math.sqrt(change.size)) / (2 * rms) * 100
            rms *= 100
        same = self.columns["same_top1"] if len(self) else np.zeros(0, dtype=bool)
        fraction = float(same.mean()) if same.size else None
        same_stderr = (math.sqrt(fraction * (1 - fraction) / (same.size - 1)) * 100
                       if same.size > 1 and fraction is not None else None)
        overlap = {}
        for k in range(1, TOP + 1):
            known = self.columns["overlap_known"][:, k - 1] if len(self) else np.zeros(0, dtype=bool)
            overlap[str(k)] = float(self.columns["top_overlap"][known, k - 1].mean()) if known.any() else None
        logit_known = self.columns["logit_known"] if len(self) else np.zeros(0, dtype=bool)
        return {
            "stream": self.stream, "tokens": len(self), "estimate": self.estimate,
            "generations": [list(pair) for pair in self.pairs],
            "perplexity": perplexity_stats(self._known("logprob_a") if len(self) and not missing else np.zeros(0),
                                           self._known("logprob_b") if len(self) and not missing else np.zeros(0)),
            "chosen_missing": missing, "refused": self._refused(missing),
            "kl_ab": percentile_stats(self.columns["kl_ab"] if len(self) else np.zeros(0)),
            "kl_ba": percentile_stats(self.columns["kl_ba"] if len(self) else np.zeros(0)),
            "prob_change_percent": percentile_stats(change if len(self) else np.zeros(0), percent=True),
            "prob_change_rms_percent": {"value": rms, "stderr": rms_stderr},
            "same_top1_percent": {"value": None if fraction is None else fraction * 100, "stderr": same_stderr},
            "top_overlap": overlap,
            "max_logit_diff": float(self.columns["max_logit_diff"][logit_known].max()) if logit_known.any() else None,
        }

    def summary_text(self) -> str:
        """The summary as text, laid out as llama.cpp's perplexity tool prints its KL-divergence
        statistics (one block per quantity; values in nats, probability changes in percent)."""
        s = self.summary()
        kind = f" (ESTIMATE: {self.estimate_kind}; see docs/compare.md)" if s["estimate"] else ""
        lines = [f"compared {s['tokens']} tokens of {len(s['generations'])} generation(s), stream {s['stream']!r}{kind}"]
        if s["refused"]:
            lines += ["", f"NOTE: {s['refused']}"]
        ppl = s["perplexity"]
        lines += ["", "====== Perplexity statistics (of the chosen tokens; Q: b, base: a) ======",
                  f"Mean PPL(Q)                   : {_pair(ppl['ppl_b'])}",
                  f"Mean PPL(base)                : {_pair(ppl['ppl_a'])}",
                  f"Cor(ln(PPL(Q)), ln(PPL(base))): {_number(ppl['correlation_percent'], 2)}%",
                  f"Mean ln(PPL(Q)/PPL(base))     : {_pair(ppl['log_ratio'])}",
                  f"Mean PPL(Q)/PPL(base)         : {_pair(ppl['ratio'])}",
                  f"Mean PPL(Q)-PPL(base)         : {_pair(ppl['difference'])}"]
        for title, key, name, unit in (("KL divergence statistics, KL(a||b)", "kl_ab", "KLD", ""),
                                       ("KL divergence statistics, KL(b||a)", "kl_ba", "KLD", ""),
                                       ("Token probability statistics", "prob_change_percent", "Δp", " %")):
            stats = s[key]
            lines += ["", f"====== {title} ======",
                      f"Mean    {name}: {_number(stats['mean'])} ± {_number(stats['stderr'])}{unit}",
                      f"Maximum {name}: {_number(stats['max'])}{unit}"]
            for p in PERCENTILES:
                label = "Median " if p == 50.0 else f"{p:4.1f}%  "
                lines.append(f"{label} {name}: {_number(stats['percentiles'][str(p)])}{unit}")
            lines.append(f"Minimum {name}: {_number(stats['min'])}{unit}")
        rms, same = s["prob_change_rms_percent"], s["same_top1_percent"]
        lines += [f"RMS Δp    : {_number(rms['value'])} ± {_number(rms['stderr'])} %",
                  f"Same top p: {_number(same['value'], 3)} ± {_number(same['stderr'], 3)} %"]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary_text()

    def samples(self) -> list[dict[str, Any]]:
        """Per sample (prompt of a generation, in order): `sample`, `generation`, `prompt`, `tokens`
        (compared), `first_top1_difference` (the first step where a row of the sample's has another
        top-1 under `b`, or None) with its `row`, and `kl_ab_mean`, `kl_ba_mean`, `kl_ab_max` over its
        tokens."""
        if not len(self):
            return []
        c = self.columns
        keys = np.stack([c["generation"].astype(np.int64), c["prompt"].astype(np.int64)], 1)
        found = []
        unique, first = np.unique(keys, axis=0, return_index=True)
        for (generation, prompt), index in sorted(zip(map(tuple, unique.tolist()), first.tolist())):
            mine = (c["generation"] == generation) & (c["prompt"] == prompt)
            differs = mine & ~c["same_top1"]
            entry: dict[str, Any] = {"sample": _plain(c["sample"][index]), "generation": generation, "prompt": prompt,
                                     "tokens": int(mine.sum()), "first_top1_difference": None, "row": None}
            if differs.any():
                steps = np.where(differs, c["step"], np.iinfo(np.int32).max)
                at = int(steps.argmin())
                entry["first_top1_difference"], entry["row"] = int(c["step"][at]), int(c["row"][at])
            entry.update({"kl_ab_mean": float(c["kl_ab"][mine].mean()), "kl_ba_mean": float(c["kl_ba"][mine].mean()),
                          "kl_ab_max": float(c["kl_ab"][mine].max())})
            found.append(entry)
        return found

    def to_arrow(self) -> Any:
        """One `pyarrow.Table` row per compared token: the per-token table's keys (`generation`,
        `sample`, `prompt`, `sequence` (null in beam search, whose rows are running beams), `row`,
        `step`, `token`; -1 for a beam search's last step, which no beam continues), then `estimate`,
        `kl_ab`, `kl_ba`, `logprob_a`, `logprob_b`, `prob_change`, `same_top1`, `top1_a`, `top1_b`,
        `top_overlap_1` ... `top_overlap_5`, `max_logit_diff`, `rank_b` (null where unknown: see
        `answers.compare_metrics`), and `top_tokens_a`, `top_logprobs_a`, `top_tokens_b`,
        `top_logprobs_b` (each side's five most likely).

        Raises:
            ImportError: pyarrow is not installed.
        """
        from .table import _pyarrow

        pa = _pyarrow()
        c, n = self.columns, len(self)
        if not n:
            return pa.table({name: pa.array([], pa.int64()) for name in (*_KEYS, *(v for v, _ in _VALUES))})
        sample = [str(s) for s in c["sample"]] if self._sample_as_text else [int(s) for s in c["sample"]]
        arrays = {
            "generation": pa.array(c["generation"]), "sample": pa.array(sample, pa.string() if self._sample_as_text
                                                                         else pa.int64()),
            "prompt": pa.array(c["prompt"]), "sequence": pa.array(c["sequence"], mask=c["sequence"] < 0),
            "row": pa.array(c["row"]), "step": pa.array(c["step"]), "token": pa.array(c["token"]),
            "estimate": pa.array(c["estimate"]), "kl_ab": pa.array(c["kl_ab"]), "kl_ba": pa.array(c["kl_ba"]),
        }
        unknown = ~c["chosen_known"]
        for name in ("logprob_a", "logprob_b", "prob_change", "rank_b"):
            arrays[name] = pa.array(c[name], mask=unknown)
        for name in ("same_top1", "top1_a", "top1_b"):
            arrays[name] = pa.array(c[name])
        for k in range(1, TOP + 1):
            arrays[f"top_overlap_{k}"] = pa.array(c["top_overlap"][:, k - 1], mask=~c["overlap_known"][:, k - 1])
        arrays["max_logit_diff"] = pa.array(c["max_logit_diff"], mask=~c["logit_known"])
        for side in ("a", "b"):
            ids, logprobs = c[f"top_ids_{side}"], c[f"top_logprobs_{side}"]
            kept = ids >= 0
            arrays[f"top_tokens_{side}"] = pa.array([row[k].tolist() for row, k in zip(ids, kept)], pa.list_(pa.int64()))
            arrays[f"top_logprobs_{side}"] = pa.array([row[k].tolist() for row, k in zip(logprobs, kept)],
                                                      pa.list_(pa.float64()))
        return pa.table(arrays)


def percentile_stats(values: np.ndarray, *, percent: bool = False) -> dict[str, Any]:
    """Mean, its standard error, extremes and percentiles of `values` (float64): see docs/compare.md."""
    scale = 100.0 if percent else 1.0
    n = int(values.shape[0])
    if n == 0:
        return {"count": 0, "mean": None, "stderr": None, "max": None, "min": None,
                "percentiles": {str(p): None for p in PERCENTILES}}
    with np.errstate(invalid="ignore"):  # an infinite KL (a token one side rules out) gives inf or nan
        mean = float(values.mean())
        stderr = float(values.std(ddof=1) / math.sqrt(n)) if n > 1 else None
        percentiles = {str(p): _percentile(values, p) * scale for p in PERCENTILES}
        if stderr is not None and math.isnan(stderr) and math.isinf(mean):
            stderr = math.inf
    return {
        "count": n, "mean": mean * scale, "stderr": None if stderr is None else stderr * scale,
        "max": float(values.max()) * scale, "min": float(values.min()) * scale, "percentiles": percentiles,
    }


def candidates_table(summaries: list[dict[str, Any]]) -> str:
    """Several candidates compared with one reference, one line each: tokens, mean KL(a||b) with its
    error, its 99th percentile, the perplexity ratio with its error, RMS of the probability change and
    same-top-1, in llama.cpp's units. `summaries`: each `Comparison.summary()` with a `candidate` key
    (its name, shown first)."""
    def number(value: Any, digits: int = 6) -> str:
        return _number(value, digits).strip()

    header = ["candidate", "tokens", "mean KLD", "± se", "99.0% KLD", "PPL(Q)/PPL(base)", "± se", "RMS Δp %",
              "same top %"]
    rows = [[s["candidate"], str(s["tokens"]), number(s["kl_ab"]["mean"]), number(s["kl_ab"]["stderr"]),
             number(s["kl_ab"]["percentiles"]["99.0"]), number(s["perplexity"]["ratio"]["value"]),
             number(s["perplexity"]["ratio"]["stderr"]), number(s["prob_change_rms_percent"]["value"], 3),
             number(s["same_top1_percent"]["value"], 3)] for s in summaries]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in [header, *rows]]
    return "\n".join([f"====== {len(summaries)} candidates against one reference ======", *lines])


def perplexity_stats(logprob_a: np.ndarray, logprob_b: np.ndarray) -> dict[str, Any]:
    """Both perplexities of the chosen tokens, their correlation, log ratio, ratio and difference, each
    value with its standard error (the module's docstring), from the chosen tokens' float64 logprobs
    under `a` and `b`; None where fewer than 2 tokens give no error (or none, no value)."""
    n = int(logprob_a.shape[0])
    none = {"value": None, "stderr": None}
    if n == 0:
        return {"count": 0, "ppl_a": none, "ppl_b": none, "correlation_percent": None, "log_ratio": none,
                "ratio": none, "difference": none}
    na, nb = -logprob_a, -logprob_b
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # a token one side rules out: inf
        def stderr(v: np.ndarray) -> float | None:
            return float(v.std(ddof=1) / math.sqrt(n)) if n > 1 else None

        ppl_a, ppl_b = _exp(float(na.mean())), _exp(float(nb.mean()))
        se_a, se_b, se_log = stderr(na), stderr(nb), stderr(nb - na)
        log_ratio = float((nb - na).mean())
        ratio = _exp(log_ratio)
        correlation = difference_se = None
        if n > 1:
            covariance = float(np.cov(na, nb, ddof=1)[0, 1])
            correlation = float(np.corrcoef(na, nb)[0, 1]) * 100
            squared = (ppl_b * se_b) ** 2 + (ppl_a * se_a) ** 2 - 2 * ppl_a * ppl_b * covariance / n
            difference_se = math.sqrt(max(squared, 0.0)) if math.isfinite(squared) else math.nan
    return {
        "count": n,
        "ppl_a": {"value": ppl_a, "stderr": None if se_a is None else ppl_a * se_a},
        "ppl_b": {"value": ppl_b, "stderr": None if se_b is None else ppl_b * se_b},
        "correlation_percent": correlation,
        "log_ratio": {"value": log_ratio, "stderr": se_log},
        "ratio": {"value": ratio, "stderr": None if se_log is None else ratio * se_log},
        "difference": {"value": ppl_b - ppl_a, "stderr": difference_se},
    }


def _exp(value: float) -> float:
    """`math.exp`, inf where it overflows (a token one side rules out)."""
    try:
        return math.exp(value)
    except OverflowError:
        return math.inf


def _pair(entry: dict[str, Any]) -> str:
    return f"{_number(entry['value'])} ± {_number(entry['stderr'])}"


def _percentile(values: np.ndarray, p: float) -> float:
    """`numpy.percentile` (linear interpolation); between two infinite KLs, where it gives nan, inf."""
    found = float(np.percentile(values, p))
    if math.isnan(found) and np.isinf(values).any():
        found = float(np.percentile(values, p, method="higher"))
    return found


def _number(value: Any, digits: int = 6) -> str:
    return "n/a" if value is None else f"{value:{digits + 5}.{digits}f}"


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value
