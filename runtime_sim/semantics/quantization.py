"""Quantization, dequantization and block-scaled contraction: the one definition every level
uses (docs/architecture.md, Shared semantics).

- Conversion to f8e4m3 / f8e5m2 / f4e2m1 saturates and rounds to nearest even
  (`numerics.round_to`, `numerics.saturate_to`).
- `quantize`: per group of `group` elements along the last axis, scale = max(amax, eps) /
  max_finite in f32 and values = saturate(x / scale): vLLM's `per_token_group_quant_fp8`
  (amax over the group, `eps` = 1e-10, division, clamp, cast), without its optional rounding of
  scales to powers of two.
- `dequantize`: f32(value) * scale of the value's block, in f32.
- `scaled_contract`: partial sums over K-blocks in f32, each times (lhs scale * rhs scale),
  added in K order strictly left to right: how the chip applies block scales in the vector
  engine to the contraction engine's partial sums.

The graph-level ops (`lowp.*`, `moe.scaled_grouped_matmul`) and the lowered ones
(`tcp.scaled_contract`, the `ve` ops of a lowered quantize) all compute through here or in the
same order, so a lowered program gives the reference's bits.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from runtime_sim.semantics.numerics import compute, contract, round_to, sequential_max, sequential_sum

QUANTIZE_EPS = np.float32(1e-10)
"""The floor on a group's amax, so an all-zero group gets a finite scale (vLLM's eps)."""


def max_finite(dtype: np.dtype) -> np.float32:
    return np.float32(ml_dtypes.finfo(dtype).max)


def group_scales(x: np.ndarray, dtype: np.dtype, group: int) -> np.ndarray:
    """f32 scales [..., N / group] of x [..., N]: max(amax of the group, eps) / max_finite. The
    amax folds left to right (`sequential_max`), so a NaN in a group gives that group a NaN
    scale at every level."""
    xf = compute(np.asarray(x))
    grouped = xf.reshape(*xf.shape[:-1], xf.shape[-1] // group, group)
    amax = sequential_max(np.abs(grouped), axis=-1)
    return (np.maximum(amax, QUANTIZE_EPS) / max_finite(dtype)).astype(np.float32)


def quantize(x: np.ndarray, dtype: np.dtype, group: int) -> tuple[np.ndarray, np.ndarray]:
    """x [..., N] as values [..., N] of `dtype` and f32 scales [..., N / group]."""
    xf = compute(np.asarray(x))
    scales = group_scales(xf, dtype, group)
    grouped = xf.reshape(*xf.shape[:-1], xf.shape[-1] // group, group)
    values = round_to(grouped / scales[..., None], dtype)
    return values.reshape(xf.shape), scales


def expand_scales(scales: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Scales in f32, repeated along every axis to the values' shape (one per element)."""
    out = compute(np.asarray(scales))
    for axis, size in enumerate(shape):
        out = np.repeat(out, size // out.shape[axis], axis=axis)
    return out


def dequantize(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """f32(value) * its block's scale, in f32."""
    values = np.asarray(values)
    return compute(values) * expand_scales(scales, values.shape)


_CHUNK = 1 << 22
"""Partial-sum elements computed at once by `scaled_contract` (16 MB of f32)."""


def scaled_contract(lhs: np.ndarray, lhs_scales: np.ndarray, rhs: np.ndarray,
                    rhs_scales: np.ndarray, acc: np.ndarray | None = None) -> np.ndarray:
    """f32 [G, B, F] from lhs [G, B, D] (scales [G, B, D / kx]) and rhs [G, D, F] (scales
    [G, D / kw, F / nb]): partial sums over K-blocks of kb = min(kx, kw) elements by
    `numerics.contract` (f32 accumulation), each times lhs scale * rhs scale, summed in K
    order, starting from `acc` (f32 [G, B, F]) when given: so a contraction split along D at
    K-block edges, each piece continuing the previous piece's sum, gives the whole one's bits.
    Computed a few blocks at a time; a block's result does not depend on the others."""
    lhs, rhs = np.asarray(lhs), np.asarray(rhs)
    g, b, d = lhs.shape
    f = rhs.shape[2]
    kx, kw = d // lhs_scales.shape[2], d // rhs_scales.shape[1]
    kb = min(kx, kw)
    nk = d // kb
    out = np.empty((g, b, f), np.float32)
    step = max(1, _CHUNK // max(1, b * nk * f))
    for i in range(0, g, step):
        j = min(g, i + step)
        partial = contract("gbjd,gjdf->gbjf", compute(lhs[i:j]).reshape(j - i, b, nk, kb),
                           compute(rhs[i:j]).reshape(j - i, nk, kb, f))
        xs = np.repeat(compute(np.asarray(lhs_scales[i:j])), kx // kb, axis=2)  # [g, B, nk]
        ws = expand_scales(rhs_scales[i:j], (j - i, nk, f))  # [g, nk, F]
        terms = partial * (xs[:, :, :, None] * ws[:, None, :, :])
        if acc is not None:  # the running sum first, then the K-blocks in order
            terms = np.concatenate([compute(np.asarray(acc[i:j]))[:, :, None, :], terms], axis=2)
        out[i:j] = sequential_sum(terms, axis=2)
    return out

