"""Quantization, dequantization and block-scaled contraction: the one definition every level
uses (docs/architecture.md, Shared semantics).

- Conversion to f8e4m3 / f8e5m2 / f4e2m1 saturates and rounds to nearest even
  (`numerics.round_to`, `numerics.saturate_to`).
- `quantize`: per group of `group` elements along the last axis, scale = max(amax, eps) /
  max_finite in f32 and values = saturate(x / scale): vLLM's `per_token_group_quant_fp8`
  (amax over the group, `eps` = 1e-10, division, clamp, cast), without its optional rounding of
  scales to powers of two.
- `quantize_blocks`: the same over blocks of any shape (a weight's 128 x 128 blocks), with f32
  scales as above or e8m0 scales as the OCP Microscaling spec (v1.0, 6.3) sets them: scale =
  2^(floor(log2(amax)) - emax), emax the exponent of the type's largest value (2 for f4e2m1),
  values = saturate(x / scale). `quantize` is its blocks of one row's group.
- `dequantize`: f32(value) * scale of the value's block, in f32; a block shape given
  explicitly may leave the last block along an axis ragged (a checkpoint's ceil-divided
  blocks, FP4 with a scale per group of g along K). u3 codes are indices into an 8-entry grid,
  and sign vectors su (along K) and sv (along N) multiply last: the 3-bit trellis format,
  grid[code] * scale * su[k] * sv[n], left to right in f32. `unpack_code_tiles` /
  `pack_code_tiles` convert the codes from and to their stored 16 x 16 tiles of 96 bytes.
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

from runtime_sim.semantics.numerics import (
    compute,
    contract,
    float8_e8m0,
    round_to,
    sequential_max,
    sequential_sum,
)

QUANTIZE_EPS = np.float32(1e-10)
"""The floor on a group's amax, so an all-zero group gets a finite scale (vLLM's eps)."""


def max_finite(dtype: np.dtype) -> np.float32:
    return np.float32(ml_dtypes.finfo(dtype).max)


def _blocked(x: np.ndarray, block: tuple[int, ...]) -> np.ndarray:
    """x [n0, n1, ...] as [n0 / b0, n1 / b1, ..., b0 * b1 * ...]: each block's elements on the
    last axis, in row-major order within the block."""
    shape = [size for n, b in zip(x.shape, block) for size in (n // b, b)]
    nd = len(block)
    if all(b == 1 for b in block[:-1]):  # groups along the last axis: no transpose
        return x.reshape(*x.shape[:-1], x.shape[-1] // block[-1], block[-1])
    return x.reshape(shape).transpose(*range(0, 2 * nd, 2), *range(1, 2 * nd, 2)).reshape(
        *shape[0::2], int(np.prod(block, dtype=np.int64)))


def block_scales(x: np.ndarray, dtype: np.dtype, block: tuple[int, ...], scale_dtype: np.dtype = np.dtype(np.float32)) -> np.ndarray:
    """The scales of x's blocks (`block` divides x's shape): f32 max(amax, eps) / max_finite, or
    e8m0 2^(floor(log2(amax)) - emax) (OCP MX; the exponent clipped to e8m0's range). The amax
    folds left to right (`sequential_max`), so a NaN in a block gives it a NaN scale at every
    level."""
    amax = sequential_max(np.abs(_blocked(compute(np.asarray(x)), block)), axis=-1)
    if scale_dtype == float8_e8m0:
        emax = np.floor(np.log2(max_finite(dtype)))
        with np.errstate(divide="ignore", invalid="ignore"):
            exponent = np.clip(np.floor(np.log2(amax)) - emax, -127, 127)
        return np.exp2(exponent).astype(np.float32).astype(float8_e8m0)  # NaN stays NaN (0xff)
    return (np.maximum(amax, QUANTIZE_EPS) / max_finite(dtype)).astype(np.float32)


def quantize_blocks(x: np.ndarray, dtype: np.dtype, block: tuple[int, ...],
                    scale_dtype: np.dtype = np.dtype(np.float32)) -> tuple[np.ndarray, np.ndarray]:
    """x as values of `dtype` (x / its block's scale, saturated) and the scales of its blocks."""
    xf = compute(np.asarray(x))
    scales = block_scales(xf, dtype, block, scale_dtype)
    split = [size for n, b in zip(xf.shape, block) for size in (n // b, b)]
    spread = [size for n, b in zip(xf.shape, block) for size in (n // b, 1)]  # each scale over its block
    values = round_to(xf.reshape(split) / compute(scales).reshape(spread), dtype)
    return values.reshape(xf.shape), scales


def group_scales(x: np.ndarray, dtype: np.dtype, group: int) -> np.ndarray:
    """f32 scales [..., N / group] of x [..., N]: max(amax of the group, eps) / max_finite."""
    x = np.asarray(x)
    return block_scales(x, dtype, (1,) * (x.ndim - 1) + (group,))


def quantize(x: np.ndarray, dtype: np.dtype, group: int) -> tuple[np.ndarray, np.ndarray]:
    """x [..., N] as values [..., N] of `dtype` and f32 scales [..., N / group]."""
    x = np.asarray(x)
    return quantize_blocks(x, dtype, (1,) * (x.ndim - 1) + (group,))


def expand_scales(scales: np.ndarray, shape: tuple[int, ...], block: tuple[int, ...] | None = None) -> np.ndarray:
    """Scales in f32, one per element of the values' shape: each repeated over its block (by
    default the shape over the scales', exactly; a given `block` may overhang the values at
    the end of an axis)."""
    out = compute(np.asarray(scales))
    for axis, size in enumerate(shape):
        out = np.repeat(out, block[axis] if block else size // out.shape[axis], axis=axis)
    return out[tuple(slice(0, size) for size in shape)]


def dequantize(values: np.ndarray, scales: np.ndarray, block: tuple[int, ...] | None = None,
               grid: np.ndarray | None = None, su: np.ndarray | None = None, sv: np.ndarray | None = None) -> np.ndarray:
    """f32(value) (u3 codes: grid[code]) * its block's scale, then * su[..., k] and * sv[..., n]
    for values [..., K, N], in f32, in that order (`block`: see `expand_scales`)."""
    values = np.asarray(values)
    real = compute(values) if grid is None else compute(np.asarray(grid))[values]
    real = real * expand_scales(scales, values.shape, block)
    if su is not None:
        real = real * compute(np.asarray(su))[..., :, None]
    if sv is not None:
        real = real * compute(np.asarray(sv))[..., None, :]
    return real


CODE_BITS = 3
"""Bits of a u3 code."""


def _code_bit_offsets(tile: int) -> np.ndarray:
    """[tile, tile] (k, n): where code (k, n) of a tile starts in its bit stream. The tile is
    stored transposed, `idx_in_tile = n_in_tile * 16 + k_in_tile`, `bit_offset = idx * 3`; bits
    run from the least significant bit of byte 0 up (a code may straddle two bytes)."""
    k, n = np.meshgrid(np.arange(tile), np.arange(tile), indexing="ij")
    return (n * tile + k) * CODE_BITS


def unpack_code_tiles(packed: np.ndarray, k: int, n: int, tile: int = 16) -> np.ndarray:
    """u3 codes [..., k, n] (one per int8) from their stored tiles, uint8
    [..., ceil(k / tile), ceil(n / tile), tile * tile * 3 / 8]: the ragged edge's padding is
    dropped."""
    packed = np.asarray(packed, np.uint8)
    bits = np.unpackbits(packed, axis=-1, bitorder="little")  # [..., tk, tn, tile * tile * 3]
    offsets = _code_bit_offsets(tile)
    codes = bits[..., offsets] | bits[..., offsets + 1] << 1 | bits[..., offsets + 2] << 2  # [..., tk, tn, tile, tile]
    lead = packed.shape[:-3]
    tk, tn = packed.shape[-3:-1]
    whole = np.moveaxis(codes, -2, -3).reshape(*lead, tk * tile, tn * tile)  # [..., tk, tile(k), tn, tile(n)]
    return np.ascontiguousarray(whole[..., :k, :n]).astype(np.int8)


def pack_code_tiles(codes: np.ndarray, tile: int = 16) -> np.ndarray:
    """The inverse of `unpack_code_tiles`: u3 codes [..., k, n] into stored tiles, a ragged
    edge padded with code 0."""
    codes = np.asarray(codes)
    *lead, k, n = codes.shape
    tk, tn = -(-k // tile), -(-n // tile)
    whole = np.zeros((*lead, tk * tile, tn * tile), np.uint8)
    whole[..., :k, :n] = codes
    tiles = np.moveaxis(whole.reshape(*lead, tk, tile, tn, tile), -3, -2)  # [..., tk, tn, tile(k), tile(n)]
    bits = np.zeros((*lead, tk, tn, tile * tile * CODE_BITS), np.uint8)
    offsets = _code_bit_offsets(tile)
    for bit in range(CODE_BITS):
        bits[..., offsets + bit] = tiles >> bit & 1
    return np.packbits(bits, axis=-1, bitorder="little")


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

