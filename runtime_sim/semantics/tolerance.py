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


def compare_output(index: int, got: np.ndarray, want: np.ndarray) -> Comparison:
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
    bad = diff > ULPS * unit + NEAR_ZERO * scale
    if nan_ok and inf_ok and not bad.any():
        return Comparison(index, True, False, worst, f"{name} within tolerance (max {worst:.3g} ulp; allowed {ULPS} ulp + {NEAR_ZERO:g} x {scale:.4g})")
    what = []
    if not nan_ok:
        what.append("NaNs in other places")
    if not inf_ok:
        what.append("infinities differ")
    if bad.any():
        i = np.unravel_index(int(np.argmax(np.where(bad, err, -1.0))), err.shape)
        what.append(f"{err[i]:.3g} ulp at {list(map(int, i))} ({g[i]:.6g} vs {w[i]:.6g}; "
                    f"allowed {ULPS} ulp + {NEAR_ZERO:g} x {scale:.4g})")
    return Comparison(index, False, False, worst, f"{name} differs from the reference: {', '.join(what)}")


def compare_outputs(got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> list[Comparison]:
    return [compare_output(i, g, w) for i, (g, w) in enumerate(zip(got, want))]
