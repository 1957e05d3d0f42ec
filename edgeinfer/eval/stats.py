"""Per-token statistics of scored logits, and their totals as llama-perplexity reports them.

A window's scored rows give, per token: the negative log-likelihood of the true next token, the
argmax, and (against a reference distribution) KL(reference || model) and Δp, the change in the
true token's probability. Totals follow llama.cpp's tools/perplexity formulas (mean ± standard
error of the per-token values, PPL = exp(mean NLL), percentiles by linear interpolation), so
both reports can be read line for line. Exponentials are float32 (kernels' vectorizing exp_f32: a
window of Gemma 3's 262k vocabulary costs a fraction of its forward pass), sums float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from numba import njit, prange

from edgeinfer.kernels.activations import exp_f32


# fastmath lets the float64 sums run in vector lanes; exp_f32 (relative error ~2e-7) is
# branch-free so it vectorizes, where libm's exp is a scalar call per element.
@njit(parallel=True, cache=True, fastmath=True, error_model="numpy")
def _lse_rows(logits, out):
    # logits: float32[m, V] -> out: float64[m], the log-sum-exp of each row
    m, v = logits.shape
    for i in prange(m):
        top = logits[i, 0]
        for j in range(1, v):
            top = max(top, logits[i, j])
        s = 0.0
        for j in range(v):
            s += np.float64(exp_f32(logits[i, j] - top))
        out[i] = top + math.log(s)


@njit(parallel=True, cache=True, fastmath=True, error_model="numpy")
def _kl_rows(base, base_lse, logits, lse, floor, out):
    # sum p (lb - lq) = sum p (b - q) - (lse_b - lse_q) sum p: the float32 difference of two
    # close logits is exact, the sums and log-sum-exps are float64
    m, v = logits.shape
    for i in prange(m):
        shift = np.float32(base_lse[i])
        s_pd = 0.0
        s_p = 0.0
        for j in range(v):
            lb = base[i, j] - shift
            p = exp_f32(lb) * np.float32(lb > floor)
            s_pd += np.float64(p * (base[i, j] - logits[i, j]))
            s_p += np.float64(p)
        out[i] = s_pd - (base_lse[i] - lse[i]) * s_p


@dataclass
class Scores:
    """One window's scored tokens: float64 NLL, int64 argmax, float64 log-sum-exp per row."""

    nll: np.ndarray
    top: np.ndarray
    lse: np.ndarray


def log_sum_exp(logits: np.ndarray) -> np.ndarray:
    """float32[m, V] -> float64[m]."""
    out = np.empty(logits.shape[0])
    _lse_rows(np.ascontiguousarray(logits, dtype=np.float32), out)
    return out


def score(logits: np.ndarray, targets: np.ndarray) -> Scores:
    """logits: float32[m, V], the rows that predict targets: int[m] -> Scores."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    m = logits.shape[0]
    lse = log_sum_exp(logits)
    nll = lse - logits[np.arange(m), targets]
    return Scores(nll, logits.argmax(axis=1).astype(np.int64), lse)


def kl_rows(
    base: np.ndarray,
    base_lse: np.ndarray,
    logits: np.ndarray,
    lse: np.ndarray,
    floor: float = -math.inf,
) -> np.ndarray:
    """KL(softmax(base) || softmax(logits)) per row -> float64[m]; base: float32[m, V] logits
    with their log-sum-exp (log-probs with lse 0). floor: base log-probs at or below it are
    left out (saved log-probs store the unresolved tail at a floor, and llama.cpp's KL skips
    log-probs <= -16 likewise)."""
    out = np.empty(logits.shape[0])
    _kl_rows(
        np.ascontiguousarray(base, dtype=np.float32),
        np.ascontiguousarray(base_lse, dtype=np.float64),
        np.ascontiguousarray(logits, dtype=np.float32),
        np.ascontiguousarray(lse, dtype=np.float64),
        np.float32(floor),
        out,
    )
    return out


def mean_and_error(values: np.ndarray) -> tuple[float, float]:
    """Mean and its standard error, as llama.cpp computes them (0 error for <= 10 values)."""
    n = values.size
    if n < 1:
        return 0.0, 0.0
    f = float(values.mean())
    var = float((values.astype(np.float64) ** 2).mean()) - f * f
    return f, math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0


def _covariance(a: np.ndarray, b: np.ndarray) -> float:
    n = a.size
    if n < 10:
        return 0.0
    return (float((a * b).mean()) - float(a.mean()) * float(b.mean())) / (n - 1)


@dataclass
class Totals:
    """Per-token values of every window so far (a few scalars per token; logits never kept)."""

    nll: list[np.ndarray] = field(default_factory=list)
    nll_base: list[np.ndarray] = field(default_factory=list)
    kld: list[np.ndarray] = field(default_factory=list)
    p_diff: list[np.ndarray] = field(default_factory=list)
    same_top: list[np.ndarray] = field(default_factory=list)

    def add(self, s: Scores, base: Scores | None = None, kld: np.ndarray | None = None) -> None:
        self.nll.append(s.nll)
        if base is not None:
            self.nll_base.append(base.nll)
            self.kld.append(kld)
            self.p_diff.append(np.exp(-s.nll) - np.exp(-base.nll))
            self.same_top.append(s.top == base.top)

    @property
    def count(self) -> int:
        return sum(a.size for a in self.nll)

    @property
    def has_reference(self) -> bool:
        return bool(self.kld)

    def perplexity(self) -> tuple[float, float]:
        """(PPL, its standard error) over every scored token."""
        return _ppl(np.concatenate(self.nll))

    def summary(self) -> dict:
        """Every figure of the report, for --json."""
        ppl, ppl_err = self.perplexity()
        out = {"tokens": self.count, "perplexity": ppl, "perplexity_stderr": ppl_err}
        if self.has_reference:
            out.update(self._divergence())
        return out

    def _divergence(self) -> dict:
        nll, nll_b = np.concatenate(self.nll), np.concatenate(self.nll_base)
        kld, p_diff = np.concatenate(self.kld), np.concatenate(self.p_diff)
        same = np.concatenate(self.same_top)
        ln_q, ln_q_err = mean_and_error(nll)
        ln_b, ln_b_err = mean_and_error(nll_b)
        cov = _covariance(nll, nll_b)
        ratio_err = math.sqrt(max(ln_q_err**2 + ln_b_err**2 - 2 * cov, 0.0))
        ppl_q, ppl_b = math.exp(ln_q), math.exp(ln_b)
        ppl_q_err, ppl_b_err = ppl_q * ln_q_err, ppl_b * ln_b_err
        kl_mean, kl_err = mean_and_error(kld)
        dp_mean, dp_err = mean_and_error(p_diff)
        mse, mse_err = mean_and_error(p_diff**2)
        rms = math.sqrt(mse)
        top1 = float(same.mean())
        n = same.size
        return {
            "perplexity_reference": ppl_b,
            "perplexity_reference_stderr": ppl_b_err,
            "ln_ppl_correlation": cov / (ln_q_err * ln_b_err) if ln_q_err * ln_b_err else 0.0,
            "ln_ppl_ratio": ln_q - ln_b,
            "ln_ppl_ratio_stderr": ratio_err,
            "ppl_ratio": math.exp(ln_q - ln_b),
            "ppl_ratio_stderr": math.exp(ln_q - ln_b) * ratio_err,
            "ppl_diff": ppl_q - ppl_b,
            "ppl_diff_stderr": math.sqrt(
                max(ppl_q_err**2 + ppl_b_err**2 - 2 * ppl_q * ppl_b * cov, 0.0)
            ),
            "kl": {"mean": kl_mean, "mean_stderr": kl_err, **_quantiles(kld, KL_QUANTILES)},
            "delta_p": {
                "mean": dp_mean,
                "mean_stderr": dp_err,
                **_quantiles(p_diff, DP_QUANTILES),
                "rms": rms,
                "rms_stderr": 0.5 / rms * mse_err if rms else 0.0,
            },
            "top1_agreement": top1,
            "top1_agreement_stderr": math.sqrt(top1 * (1 - top1) / (n - 1)) if n > 1 else 0.0,
        }


KL_QUANTILES = (0.999, 0.99, 0.95, 0.90, 0.5, 0.10, 0.05, 0.01, 0.001)
DP_QUANTILES = (0.999, 0.99, 0.95, 0.90, 0.75, 0.5, 0.25, 0.10, 0.05, 0.01, 0.001)


def _quantiles(values: np.ndarray, fractions) -> dict:
    out = {"max": float(values.max())}
    for f in fractions:
        key = "median" if f == 0.5 else f"p{f * 100:g}"
        out[key] = float(np.quantile(values, f))  # linear interpolation, as llama.cpp's
    out["min"] = float(values.min())
    return out


def _ppl(nll: np.ndarray) -> tuple[float, float]:
    mean, err = mean_and_error(nll)
    ppl = math.exp(mean)
    return ppl, ppl * err


def report(summary: dict) -> str:
    """The figures of `Totals.summary()` in llama-perplexity's words and layout."""
    s = summary
    lines = [f"Final estimate: PPL = {s['perplexity']:.4f} +/- {s['perplexity_stderr']:.5f}"]
    if "kl" not in s:
        return "\n".join(lines)
    kl, dp = s["kl"], s["delta_p"]
    lines += [
        "",
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {s['perplexity']:10.6f} ± {s['perplexity_stderr']:10.6f}",
        f"Mean PPL(base)                : {s['perplexity_reference']:10.6f} ± "
        f"{s['perplexity_reference_stderr']:10.6f}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s['ln_ppl_correlation']:6.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {s['ln_ppl_ratio']:10.6f} ± "
        f"{s['ln_ppl_ratio_stderr']:10.6f}",
        f"Mean PPL(Q)/PPL(base)         : {s['ppl_ratio']:10.6f} ± {s['ppl_ratio_stderr']:10.6f}",
        f"Mean PPL(Q)-PPL(base)         : {s['ppl_diff']:10.6f} ± {s['ppl_diff_stderr']:10.6f}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {kl['mean']:10.6f} ± {kl['mean_stderr']:10.6f}",
        f"Maximum KLD: {kl['max']:10.6f}",
    ]
    lines += [f"{_label(f, 'KLD')}: {kl[_key(f)]:10.6f}" for f in KL_QUANTILES]
    lines += [
        f"Minimum KLD: {kl['min']:10.6f}",
        "",
        "====== Token probability statistics ======",
        f"Mean    Δp: {100 * dp['mean']:6.3f} ± {100 * dp['mean_stderr']:5.3f} %",
        f"Maximum Δp: {100 * dp['max']:6.3f}%",
    ]
    lines += [f"{_label(f, 'Δp')}: {100 * dp[_key(f)]:6.3f}%" for f in DP_QUANTILES]
    lines += [
        f"Minimum Δp: {100 * dp['min']:6.3f}%",
        f"RMS Δp    : {100 * dp['rms']:6.3f} ± {100 * dp['rms_stderr']:5.3f} %",
        f"Same top p: {100 * s['top1_agreement']:6.3f} ± {100 * s['top1_agreement_stderr']:5.3f} %",
    ]
    return "\n".join(lines)


def _key(f: float) -> str:
    return "median" if f == 0.5 else f"p{f * 100:g}"


def _label(f: float, what: str) -> str:
    if f == 0.5:
        return f"Median  {what}"
    return f"{f * 100:4.1f}%   {what}"
