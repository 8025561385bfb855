"""How close a lowered run's outputs must be to the reference's (docs/architecture.md#tolerance).

Integer outputs (routing indices, expert ids) must be identical. Float outputs must be within

    |got - want| <= ULPS * ulp(want) + NEAR_ZERO * scale

elementwise, where ulp(x) is the spacing of the output type at x (bf16: 8 significant bits,
f32: 24) and `scale` is the largest finite |want| of that output.

- ULPS = 2: every op is bit-identical across levels except the accumulation order of a
  matmul / contraction, whose f32 sum may differ in its last bits and then round to a
  neighbouring value of the output type (one ulp), or two where rounding boundaries meet
  (the f32 sum, then bf16).
- NEAR_ZERO = 2^-16: an element that cancels to almost nothing has no relative precision
  to keep; a reordered f32 sum of n terms moves by up to about n * 2^-24 of their magnitude,
  so its absolute error is bounded relative to the output's scale (2^-16: 256 terms' worth,
  below one bf16 ulp of any element above scale / 2^9).

NaN must meet NaN and infinities must match exactly, sign included.

For one contraction the same ULPS bounds the chip's own accumulation order, measured at the
contraction's scale S = sum_k |a_ik * b_kj|: a result may differ from the reference by at most
ULPS ulps of the output type at S, plus the one ulp of the final rounding at the result itself.
Any f32 accumulation order is within K * 2^-24 * S of the exact sum, so two orders are within
2 * K * 2^-24 * S: at most 2 ulps of bf16 at S for K <= 2^16 (bf16 keeps 8 significant bits, so
an ulp at S is more than 2^-8 * S). f32 outputs need 2 * K ulps of f32 at S. The simulator itself
is bit-identical to the reference: it runs `tcp.contract` through the reference matmul's routine.

With tensor parallelism (a mesh's `tp`), the down projection's f32 sum over F is regrouped
(each chip's F rows, then the chips in order) before its one rounding to bf16, so an expert's
output y may land on the neighbouring bf16 value: one ulp at |y|, at most 2^-7 |y|. An output
element then moves by at most sum_k |w_k| ulp(y_k) <= 2^-7 A before the combine's own rounding,
which may move to a neighbour too (<= 2^-7 A again), where A = sum_k |w_k| |y_k| is the
combine's scale at that element (its terms' magnitudes, as S is a contraction's); ops after the
combine that add to it (a shared expert) pass the difference on. So a tp run is also allowed
TP_SCALE * A = 2^-6 A (`combine_scale` computes A from the reference's combine), which matters
only where the K terms cancel; elsewhere it stays within the ULPS above.

A mesh's `a2a_sum` rounds each chip's part of a token's weighted sum (its pairs on that chip,
summed in f32) to the output's type before it goes home, where the parts are added in f32 and
rounded again. Each rounding moves a part by at most half an ulp, 2^-8 of its magnitude in
bf16, and the parts' magnitudes add up to at most A, so the sum moves by at most 2^-8 A; its
final rounding may then land on the neighbour of the reference's (one ulp of the combine's
result, at most 2^-7 A), which ops after the combine (a shared expert) pass on even where
they cancel. So a2a_sum is allowed RECEIVER_SUM_SCALE * A = (2^-8 + 2^-7) A. A token whose
pairs all sit on one chip is rounded once, as on one chip (its bits, up to the sign of a zero).
A mesh's sp axis with `sp_sum=bf16` rounds each column's f32 part of a token's sum to bf16
before the reduce-scatter adds the columns in f32 and rounds once: the same argument, so it is
allowed RECEIVER_SUM_SCALE * A more (with a2a_sum, whose receivers round first, both: each
rounding stage moves the parts by at most 2^-8 of their magnitudes, a bound the sum of the two
allowances covers).

These are the only tolerance numbers; `tcpc run --check` and the tests use them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from runtime_sim.semantics.numerics import bfloat16

ULPS = 2
"""Allowed distance, in ulps of the output type."""
NEAR_ZERO = 2.0**-16
"""Allowed absolute distance, as a fraction of the output's largest magnitude."""

TP_SCALE = 2.0**-6
"""With tensor parallelism, allowed absolute distance as a fraction of the combine's scale."""

RECEIVER_SUM_SCALE = 2.0**-8 + 2.0**-7
"""With a mesh's a2a_sum (its parts of a token's sum rounded where they are summed), allowed
absolute distance as a fraction of the combine's scale."""

_PRECISION = {bfloat16: 8, np.dtype(np.float32): 24}
"""Significant bits (with the implicit one) of each float output type."""
_MIN_EXPONENT = {bfloat16: -126, np.dtype(np.float32): -126}


def ulp(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The spacing of `dtype` at |x| (the subnormal spacing below the smallest normal)."""
    p = _PRECISION[np.dtype(dtype)]
    magnitude = np.abs(np.asarray(x, np.float64))
    _, e = np.frexp(magnitude)  # |x| = m * 2^e with m in [0.5, 1)
    exponent = np.where(magnitude > 0, np.maximum(e - 1, _MIN_EXPONENT[np.dtype(dtype)]), _MIN_EXPONENT[np.dtype(dtype)])
    return np.ldexp(1.0, exponent - (p - 1))


@dataclass(frozen=True)
class Comparison:
    """How one output compares: `identical`, `within` tolerance, or not (`ok` False)."""

    index: int
    ok: bool
    identical: bool
    max_ulps: float
    """The largest error in ulps of the output type at the reference value."""
    message: str


def combine_scale(blocked: np.ndarray, scatter_idx: np.ndarray, weights: np.ndarray | None) -> np.ndarray:
    """A = sum_k |w_k| |y_k| at every element of a combine's [T, D] result (float64): the
    pairs' rows of `blocked` [G, B, D] by scatter_idx [T, K] (-1: dropped, adds nothing)."""
    rows = np.abs(np.asarray(blocked, np.float64)).reshape(-1, np.shape(blocked)[-1])
    picked = np.where((scatter_idx >= 0)[..., None], rows[np.maximum(scatter_idx, 0)], 0.0)
    if weights is not None:
        picked = np.abs(np.asarray(weights, np.float64))[..., None] * picked
    return np.nan_to_num(picked.sum(axis=1), nan=0.0, posinf=0.0)


def compare_output(index: int, got: np.ndarray, want: np.ndarray, allowance: np.ndarray | None = None,
                   factor: float = TP_SCALE) -> Comparison:
    """`allowance`: an absolute distance each element is allowed on top (`factor` * A: tensor
    parallelism's TP_SCALE, a2a_sum's RECEIVER_SUM_SCALE, or their sum), or None."""
    got, want = np.asarray(got), np.asarray(want)
    name = f"out{index}"
    if got.shape != want.shape:
        return Comparison(index, False, False, np.inf, f"{name} has shape {list(got.shape)}, the reference {list(want.shape)}")
    if want.dtype not in _PRECISION:  # integers and booleans: routing is bit-identical
        if np.array_equal(got, want):
            return Comparison(index, True, True, 0.0, f"{name} identical")
        bad = int(np.count_nonzero(got != want))
        return Comparison(index, False, False, np.inf, f"{name} differs from the reference in {bad} of {want.size} elements (integers must be identical)")
    g, w = got.astype(np.float64), want.astype(np.float64)
    same_bits = np.array_equal(g, w, equal_nan=True) and np.array_equal(np.signbit(g), np.signbit(w))
    if same_bits:
        return Comparison(index, True, True, 0.0, f"{name} identical")
    nan_ok = np.array_equal(np.isnan(g), np.isnan(w))
    inf_ok = np.array_equal(np.where(np.isinf(w), w, 0), np.where(np.isinf(g), g, 0))
    finite = np.isfinite(w) & np.isfinite(g)
    scale = float(np.max(np.abs(w[np.isfinite(w)]), initial=0.0))
    unit = ulp(w, want.dtype)
    diff = np.where(finite, np.abs(g - w), 0.0)
    err = diff / unit
    worst = float(np.max(err, initial=0.0))
    extra = 0.0 if allowance is None else np.broadcast_to(np.asarray(allowance, np.float64), diff.shape)
    bad = diff > ULPS * unit + NEAR_ZERO * scale + extra
    allowed = f"{ULPS} ulp + {NEAR_ZERO:g} x {scale:.4g}" + ("" if allowance is None else f" + {factor:g} x A")
    if nan_ok and inf_ok and not bad.any():
        return Comparison(index, True, False, worst, f"{name} within tolerance (max {worst:.3g} ulp; allowed {allowed})")
    what = []
    if not nan_ok:
        what.append("NaNs in other places")
    if not inf_ok:
        what.append("infinities differ")
    if bad.any():
        i = np.unravel_index(int(np.argmax(np.where(bad, err, -1.0))), err.shape)
        what.append(f"{err[i]:.3g} ulp at {list(map(int, i))} ({g[i]:.6g} vs {w[i]:.6g}; allowed {allowed}"
                    + ("" if allowance is None else f", A = {float(np.broadcast_to(allowance, diff.shape)[i]) / factor:.4g}")
                    + ")")
    return Comparison(index, False, False, worst, f"{name} differs from the reference: {', '.join(what)}")


def compare_outputs(got: Sequence[np.ndarray], want: Sequence[np.ndarray],
                    allowances: Sequence[np.ndarray | None] | None = None, factor: float = TP_SCALE) -> list[Comparison]:
    extra = list(allowances) if allowances is not None else [None] * len(want)
    return [compare_output(i, g, w, a, factor) for i, (g, w, a) in enumerate(zip(got, want, extra))]
