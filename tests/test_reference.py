"""An independent check of the graph-level reference (the `moe` and `tmath` semantics).

The first half of this file re-implements the `moe` ops (docs/architecture.md#shared-semantics)
with plain Python loops over tokens, pairs and experts, using only numpy and ml_dtypes (never
`runtime_sim`'s semantics):

- top-k as a sort-free selection loop: largest first; equal values (-0.0 == +0.0) go to the
  lower index; NaN is never chosen over a number; NaNs among themselves by lower index;
- the canonical block layout: pairs p = t*K + k token-major; experts ascending, each owning
  ceil(kept / B) consecutive blocks; with a capacity C an expert keeps its first C pairs in p order;
- grouped matmul per block in f32, rounded once to the result type; padding rows and unused
  blocks are zero, and the bias is not added to them;
- combine: for each token, the sum over k = 0..K-1 in f32 of weight * row, rounded to the output
  type; a dropped pair contributes nothing.

The second half has, for every example in examples/, an independent model of the program written
with numpy and those loops, which rounds at the same points as the program (every op's result
to its type). Each example is run through `tcpc.compile_file(...).run(...)` and compared with
its model on the same inputs, including the intermediate results of every `moe` op.

Tolerance: routing decisions (top-k indices, scatter rows, block expert ids) must be identical.
Values must agree within `tolerance.ULPS` ulps of their own type (bf16 or f32), NaN matching NaN
(the project's one tolerance; the only thing this file takes from runtime_sim). Because the
models mirror every rounding point, and run each contraction in f32 with the shapes the graph has
(per block for grouped matmul), the values are in practice bit-identical; the ulp allows for a
different f32 accumulation order, not for a different rounding point.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from xdsl.dialects import func
from xdsl.dialects.builtin import FunctionType

import tcpc
from dialects.moe import max_blocks
from runtime_sim.semantics.tolerance import ULPS
from tcpc.program import Program

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


# --- the independent semantics -------------------------------------------------------------


def _ranks_before(a: float, i: int, b: float, j: int) -> bool:
    """Whether candidate (value a, index i) is chosen before (value b, index j)."""
    a_nan, b_nan = a != a, b != b
    if a_nan or b_nan:
        if a_nan and b_nan:
            return i < j
        return b_nan  # a number always before a NaN
    if a == b:  # IEEE equality: -0.0 == +0.0
        return i < j
    return a > b


def topk_row(row: np.ndarray, k: int, order: str = "score") -> list[int]:
    """The k chosen indices of one row, by repeated selection of the best remaining candidate."""
    values = [float(v) for v in row]  # bf16, f32 and i32 are exact as Python floats
    chosen: list[int] = []
    for _ in range(k):
        best = -1
        for j, v in enumerate(values):
            if j in chosen:
                continue
            if best < 0 or _ranks_before(v, j, values[best], best):
                best = j
        chosen.append(best)
    return sorted(chosen) if order == "index" else chosen


def topk(x: np.ndarray, k: int, order: str = "score") -> tuple[np.ndarray, np.ndarray]:
    """moe.topk: values (in x's dtype, the elements themselves) and i32 indices."""
    indices = np.zeros((*x.shape[:-1], k), dtype=np.int32)
    values = np.zeros((*x.shape[:-1], k), dtype=x.dtype)
    for pos in np.ndindex(*x.shape[:-1]):
        for slot, j in enumerate(topk_row(x[pos], k, order)):
            indices[pos + (slot,)] = j
            values[pos + (slot,)] = x[pos + (j,)]
    return values, indices


class Layout:
    """Where every pair went: row[t][k] (block * B + position, or -1 if dropped) and the expert
    of each of the G blocks (-1 if unused)."""

    def __init__(self, expert_idx: np.ndarray, experts: int, block: int, blocks: int, capacity: int | None):
        tokens, k = expert_idx.shape
        self.block, self.blocks = block, blocks
        position = [[-1] * k for _ in range(tokens)]
        kept = [0] * experts
        seen = [0] * experts
        for t in range(tokens):  # token-major pair order p = t*K + k
            for c in range(k):
                e = int(expert_idx[t, c])
                assert 0 <= e < experts, f"expert index {e} out of range"
                if capacity is None or seen[e] < capacity:
                    position[t][c] = seen[e]
                    kept[e] += 1
                seen[e] += 1
        first_block = [0] * experts
        self.expert_of_block = [-1] * blocks
        next_block = 0
        for e in range(experts):  # ascending experts, ceil(kept / B) blocks each
            first_block[e] = next_block
            for _ in range((kept[e] + block - 1) // block):
                assert next_block < blocks, "the routing needs more blocks than the static G"
                self.expert_of_block[next_block] = e
                next_block += 1
        self.row = [
            [first_block[int(expert_idx[t, c])] * block + position[t][c] if position[t][c] >= 0 else -1 for c in range(k)]
            for t in range(tokens)
        ]
        self.valid = [False] * (blocks * block)
        for t in range(tokens):
            for c in range(k):
                if self.row[t][c] >= 0:
                    self.valid[self.row[t][c]] = True

    @property
    def scatter_idx(self) -> np.ndarray:
        return np.array(self.row, dtype=np.int32)

    @property
    def expert_ids(self) -> np.ndarray:
        return np.array(self.expert_of_block, dtype=np.int32)


def scatter(x: np.ndarray, expert_idx: np.ndarray, experts: int, block: int,
            capacity: int | None = None) -> tuple[np.ndarray, Layout]:
    tokens, k = expert_idx.shape
    blocks = max_blocks(tokens, k, experts, block, capacity)
    layout = Layout(expert_idx, experts, block, blocks, capacity)
    out = np.zeros((blocks * block, x.shape[1]), dtype=x.dtype)
    for t in range(tokens):
        for c in range(k):
            if layout.row[t][c] >= 0:
                out[layout.row[t][c]] = x[t]
    return out.reshape(blocks, block, x.shape[1]), layout


def result_type(*dtypes: np.dtype) -> np.dtype:
    """bf16 only when every operand is bf16; any f32 operand makes the result f32."""
    return BF16 if all(d == BF16 for d in dtypes) else F32


def grouped_matmul(xb: np.ndarray, w: np.ndarray, layout: Layout, bias: np.ndarray | None = None) -> np.ndarray:
    g, b, _ = xb.shape
    out_type = result_type(xb.dtype, w.dtype)
    out = np.zeros((g, b, w.shape[2]), dtype=out_type)
    for blk in range(g):
        e = layout.expert_of_block[blk]
        if e < 0:
            continue  # unused block: zero, never computed
        acc = xb[blk].astype(F32) @ w[e].astype(F32)  # one [B, D] @ [D, F] contraction in f32
        if bias is not None:
            acc = acc + bias[e].astype(F32)
        for r in range(b):
            if layout.valid[blk * b + r]:
                out[blk, r] = acc[r].astype(out_type)  # padding rows stay zero, without the bias
    return out


def combine(blocks: np.ndarray, layout: Layout, weights: np.ndarray | None = None) -> np.ndarray:
    g, b, d = blocks.shape
    rows = blocks.reshape(g * b, d)
    tokens = len(layout.row)
    out = np.zeros((tokens, d), dtype=blocks.dtype)
    for t in range(tokens):
        acc = np.zeros(d, dtype=F32)
        for c, row in enumerate(layout.row[t]):  # k in order 0..K-1
            if row < 0:
                continue  # a dropped pair contributes zero, whatever its weight
            value = rows[row].astype(F32)
            if weights is not None:
                value = np.float32(weights[t, c]) * value
            acc = acc + value
        out[t] = acc.astype(blocks.dtype)
    return out


class Oracle:
    """The four moe ops, recording every result in program order (the taps to compare)."""

    def __init__(self) -> None:
        self.taps: list[tuple[str, object]] = []

    def topk(self, x, k, order="score"):
        values, indices = topk(x, k, order)
        self.taps += [("topk values", values), ("topk indices", indices)]
        return values, indices

    def scatter(self, x, expert_idx, experts, block, capacity=None):
        blocked, layout = scatter(x, expert_idx, experts, block, capacity)
        self.taps += [("scatter blocks", blocked), ("scatter route", layout)]
        return blocked, layout

    def grouped_matmul(self, xb, w, layout, bias=None):
        out = grouped_matmul(xb, w, layout, bias)
        self.taps.append(("grouped_matmul", out))
        return out

    def combine(self, blocks, layout, weights=None):
        out = combine(blocks, layout, weights)
        self.taps.append(("combine", out))
        return out


# --- tensor math with the program's rounding points ----------------------------------------


def f32(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(F32)


def bf16(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(F32).astype(BF16)


def to(dtype: np.dtype, a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(dtype)


def binary(fn: Callable, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """An elementwise op of two tensors: computed in f32, rounded to the promoted type."""
    return to(result_type(a.dtype, b.dtype), fn(f32(a), f32(b)))


def scalar(value: float, like: np.ndarray) -> np.ndarray:
    """A literal meeting a tensor takes the tensor's type (through f32)."""
    return to(like.dtype, np.float32(value))


def add(a, b):
    return binary(np.add, a, b)


def sub(a, b):
    return binary(np.subtract, a, b)


def mul(a, b):
    return binary(np.multiply, a, b)


def div(a, b):
    return binary(np.divide, a, b)


def matmul(a, b):
    return binary(np.matmul, a, b)


def _sigmoid32(x: np.ndarray) -> np.ndarray:
    return np.float32(1) / (np.float32(1) + np.exp(-x))


def sigmoid(x):
    return to(x.dtype, _sigmoid32(f32(x)))


def silu(x):
    v = f32(x)
    return to(x.dtype, v * _sigmoid32(v))


def in_order_sum(v: np.ndarray, axis: int) -> np.ndarray:
    """Left to right along one axis, one rounding per add (every level sums in order:
    docs/architecture.md#numbers-and-rounding)."""
    v = np.moveaxis(v, axis, -1)
    total = np.zeros(v.shape[:-1], dtype=v.dtype)
    for i in range(v.shape[-1]):
        total = (total + v[..., i]).astype(v.dtype)
    return np.expand_dims(total, axis)


def softmax(x, axis=-1):
    v = f32(x)
    e = np.exp(v - v.max(axis=axis, keepdims=True))
    return to(x.dtype, e / in_order_sum(e, axis))


def reduce_sum(x, axis, keepdims=False):
    v = x if x.dtype == np.int32 else f32(x)
    axes = [a % x.ndim for a in ((axis,) if isinstance(axis, int) else axis)]
    for a in sorted(axes, reverse=True):
        v = in_order_sum(v, a)
    if not keepdims:
        v = np.squeeze(v, axis=tuple(axes))
    return v if x.dtype == np.int32 else to(x.dtype, v)


def one_hot(idx: np.ndarray, depth: int) -> np.ndarray:
    out = np.zeros((*idx.shape, depth), dtype=np.int32)
    for pos in np.ndindex(*idx.shape):
        if 0 <= idx[pos] < depth:
            out[pos + (int(idx[pos]),)] = 1
    return out


def take(x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    out = np.zeros(idx.shape, dtype=x.dtype)
    for pos in np.ndindex(*idx.shape):
        out[pos] = x[pos[:-1] + (int(idx[pos]),)]
    return out


def swiglu(o: Oracle, xb, route, a, gate="w_gate", up="w_up", down="w_down"):
    h = mul(silu(o.grouped_matmul(xb, a[gate], route)), o.grouped_matmul(xb, a[up], route))
    return o.grouped_matmul(h, a[down], route)


def dense_swiglu(x, a):
    return matmul(mul(silu(matmul(x, a["ws_gate"])), matmul(x, a["ws_up"])), a["ws_down"])


# --- one independent model per example -----------------------------------------------------


def model_toy(o: Oracle, d: dict[str, int], a: dict[str, np.ndarray]) -> list[np.ndarray]:
    probs = softmax(matmul(f32(a["x"]), a["router"]))
    top_p, top_e = o.topk(probs, d["K"])
    xb, route = o.scatter(a["x"], top_e, d["E"], d["B"])
    h = silu(o.grouped_matmul(xb, a["w_up"], route))
    return [o.combine(o.grouped_matmul(h, a["w_down"], route), route, bf16(top_p))]


def model_mixtral(o, d, a):
    probs = softmax(matmul(f32(a["x"]), a["router"]))
    top_p, top_e = o.topk(probs, d["K"])
    weights = div(top_p, reduce_sum(top_p, -1, keepdims=True))
    xb, route = o.scatter(a["x"], top_e, d["E"], d["B"])
    return [o.combine(swiglu(o, xb, route, a), route, bf16(weights))]


def model_qwen3_moe(o, d, a):
    logits = matmul(a["x"], a["router"])  # bf16
    probs = softmax(f32(logits))
    top_p, top_e = o.topk(probs, d["K"])
    weights = bf16(div(top_p, reduce_sum(top_p, -1, keepdims=True)))
    xb, route = o.scatter(a["x"], top_e, d["E"], d["B"])
    return [o.combine(swiglu(o, xb, route, a), route, weights)]


def deepseek_route(o, d, a):
    """DeepSeek-V3's group-limited routing: the chosen experts and their weights."""
    t, e, ng = d["T"], d["E"], d["NG"]
    s = sigmoid(matmul(f32(a["x"]), a["router"]))
    biased = add(s, a["bias"])
    grouped = biased.reshape(t, ng, e // ng)
    best2, _ = o.topk(grouped, 2)
    group_score = reduce_sum(best2, -1)
    _, top_g = o.topk(group_score, d["TG"], order="index")
    keep = reduce_sum(one_hot(top_g, ng), 1).reshape(t, ng, 1)
    masked = np.where(keep > 0, grouped, np.float32(-np.inf)).astype(F32).reshape(t, e)
    _, top_e = o.topk(masked, d["K"])
    top_s = take(s, top_e)
    total = add(reduce_sum(top_s, -1, keepdims=True), scalar(1e-20, top_s))
    weights = mul(div(top_s, total), scalar(2.5, top_s))
    return top_e, weights


def model_deepseek_v3(o, d, a):
    top_e, weights = deepseek_route(o, d, a)
    xb, route = o.scatter(a["x"], top_e, d["E"], d["B"])
    routed = o.combine(swiglu(o, xb, route, a), route, weights)
    return [add(routed, dense_swiglu(a["x"], a))]


def model_gpt_oss(o, d, a):
    logits = add(matmul(a["x"], a["router"]), a["router_bias"])
    top_v, top_e = o.topk(logits, d["K"])
    weights = softmax(top_v)
    xb, route = o.scatter(a["x"], top_e, d["E"], d["B"])
    g = o.grouped_matmul(xb, a["w_gate"], route, a["b_gate"])
    u = o.grouped_matmul(xb, a["w_up"], route, a["b_up"])
    h = clamped_swiglu(g, u)
    return [o.combine(o.grouped_matmul(h, a["w_down"], route, a["b_down"]), route, weights)]


def clamped_swiglu(g, u):
    """gpt-oss's activation: (clip(u, -7, 7) + 1) * gate * sigmoid(1.702 * gate), gate = min(g, 7)."""
    gate = binary(np.minimum, g, scalar(7.0, g))
    up = binary(np.minimum, binary(np.maximum, u, scalar(-7.0, u)), scalar(7.0, u))
    glu = mul(gate, sigmoid(bf16(mul(f32(gate), np.float32(1.702)))))
    return mul(add(up, scalar(1.0, up)), glu)


def model_llama4(o, d, a):
    logits = matmul(a["x"], a["router"])
    top_v, top_e = o.topk(logits, d["K"])
    weight = bf16(sigmoid(f32(top_v)))
    xw = mul(a["x"], weight)
    xb, route = o.scatter(xw, top_e, d["E"], d["B"])
    routed = o.combine(swiglu(o, xb, route, a), route)
    return [add(dense_swiglu(a["x"], a), routed)]


# --- low precision: quantization and block-scaled contractions, with loops over groups -------


def quantize(x: np.ndarray, dtype: np.dtype, group: int) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's per-token-group quantization along the last axis, one group at a time: scale =
    max(amax, 1e-10) / max_finite in f32 (a NaN in the group makes it NaN), value = x / scale
    clamped to +-max_finite and cast by ml_dtypes."""
    top = np.float32(ml_dtypes.finfo(dtype).max)
    values = np.zeros(x.shape, dtype=dtype)
    scales = np.zeros((*x.shape[:-1], x.shape[-1] // group), dtype=F32)
    for pos in np.ndindex(*scales.shape):
        chunk = f32(x[pos[:-1]][pos[-1] * group:(pos[-1] + 1) * group])
        amax = np.float32(np.nan) if np.isnan(chunk).any() else np.float32(max(abs(float(v)) for v in chunk))
        scale = np.float32(np.nan) if np.isnan(amax) else np.float32(max(amax, np.float32(1e-10)) / top)
        scales[pos] = scale
        values[pos[:-1]][pos[-1] * group:(pos[-1] + 1) * group] = np.clip(chunk / scale, -top, top).astype(dtype)
    return values, scales


def scaled_rows(xq: np.ndarray, xs: np.ndarray, w: np.ndarray, ws: np.ndarray) -> np.ndarray:
    """Rows xq [B, D] (scales [B, D / kx]) times w [D, F] (scales [D / kw, F / nb]) in f32: for
    each K-block of min(kx, kw), the f32 partial sum times (row scale * weight scale), added in
    K order."""
    d, f = w.shape
    kx, kw, nb = d // xs.shape[1], d // ws.shape[0], f // ws.shape[1]
    kb = min(kx, kw)
    acc = np.zeros((xq.shape[0], f), dtype=F32)
    for j in range(d // kb):
        part = f32(xq[:, j * kb:(j + 1) * kb]) @ f32(w[j * kb:(j + 1) * kb])
        scale = f32(xs[:, j * kb // kx])[:, None] * np.repeat(f32(ws[j * kb // kw]), nb)[None, :]
        acc = acc + part * scale
    return acc


def scaled_grouped_matmul(xq, xs, w, ws, layout: Layout, bias=None) -> np.ndarray:
    g, b, _ = xq.shape
    out = np.zeros((g, b, w.shape[2]), dtype=BF16)
    for blk in range(g):
        e = layout.expert_of_block[blk]
        if e < 0:
            continue
        acc = scaled_rows(xq[blk], xs[blk], w[e], ws[e])
        if bias is not None:
            acc = acc + f32(bias[e])
        for r in range(b):
            if layout.valid[blk * b + r]:
                out[blk, r] = acc[r].astype(BF16)
    return out


def scaled_matmul(xq, xs, w, ws) -> np.ndarray:
    return bf16(scaled_rows(xq, xs, w, ws))


F8E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def fp8_swiglu(d, xb, route, a, bias=None):
    """Routed SwiGLU experts in w8a8: the blocks and the intermediate quantized per group."""
    xq, xs = quantize(xb, F8E4M3, d["QG"])
    g = scaled_grouped_matmul(xq, xs, a["w_gate"], a["w_gate_scale"], route, None if bias is None else a["b_gate"])
    u = scaled_grouped_matmul(xq, xs, a["w_up"], a["w_up_scale"], route, None if bias is None else a["b_up"])
    h = mul(silu(g), u) if bias is None else clamped_swiglu(g, u)
    hq, hs = quantize(h, F8E4M3, d["QG"])
    return scaled_grouped_matmul(hq, hs, a["w_down"], a["w_down_scale"], route, None if bias is None else a["b_down"])


def model_qwen3_moe_fp8(o, d, a):
    probs = softmax(f32(matmul(a["x"], a["router"])))
    top_p, top_e = o.topk(probs, d["K"])
    weights = bf16(div(top_p, reduce_sum(top_p, -1, keepdims=True)))
    xb, route = o.scatter(a["x"], top_e, d["E"], d["B"])
    return [o.combine(fp8_swiglu(d, xb, route, a), route, weights)]


def model_deepseek_v3_fp8(o, d, a):
    top_e, weights = deepseek_route(o, d, a)
    xb, route = o.scatter(a["x"], top_e, d["E"], d["B"])
    routed = o.combine(fp8_swiglu(d, xb, route, a), route, weights)
    sq, ss = quantize(a["x"], F8E4M3, d["QG"])
    shared_h = mul(silu(scaled_matmul(sq, ss, a["ws_gate"], a["ws_gate_scale"])),
                   scaled_matmul(sq, ss, a["ws_up"], a["ws_up_scale"]))
    hq, hs = quantize(shared_h, F8E4M3, d["QG"])
    return [add(routed, scaled_matmul(hq, hs, a["ws_down"], a["ws_down_scale"]))]


def model_gpt_oss_mxfp4(o, d, a):
    logits = add(matmul(a["x"], a["router"]), a["router_bias"])
    top_v, top_e = o.topk(logits, d["K"])
    weights = softmax(top_v)
    xb, route = o.scatter(a["x"], top_e, d["E"], d["B"])
    return [o.combine(fp8_swiglu(d, xb, route, a, bias=True), route, weights)]


def e2m1_value(codes: np.ndarray) -> np.ndarray:
    """f32 values of e2m1 codes from their bits (sign, 2 exponent bits, 1 mantissa bit), by the
    seed document's formula; a subnormal (exponent 0) is man * 0.5, as OCP MX and ml_dtypes
    define e2m1 (the seed writes man * 0.25, which would make code 1 a quarter)."""
    bits = codes.view(np.uint8).astype(np.int64) & 0xF
    sign, exp, man = bits >> 3, (bits >> 1) & 3, bits & 1
    magnitude = np.where(exp == 0, man * 0.5, 2.0 ** (exp - 1) * (1.0 + man * 0.5))
    return np.where(sign == 1, -magnitude, magnitude).astype(F32)


def group_scale(scales: np.ndarray, k: int, group: int) -> np.ndarray:
    """scales [E, ceil(K / group), N] as one f32 per weight [E, K, N]: scale[e, k // group, n]."""
    return scales.astype(F32)[:, np.arange(k) // group, :]


def fp4_group_weight(a, name: str, group: int) -> np.ndarray:
    """bf16(value * scale) of an FP4 weight with a scale per group along K (the seed's layout)."""
    w = a[name]
    return bf16(e2m1_value(w) * group_scale(a[name + "_scale"], w.shape[1], group))


def trellis_weight(a, name: str, group: int) -> np.ndarray:
    """bf16(grid[code] * scale * su[k] * sv[n]) of a 3-bit trellis weight, left to right in f32."""
    codes = a[name].astype(np.int64)
    real = a["grid"].astype(F32)[codes] * group_scale(a[name + "_scale"], codes.shape[1], group)
    real = real * a[name + "_su"].astype(F32)[:, :, None]
    return bf16(real * a[name + "_sv"].astype(F32)[:, None, :])


def model_qwen3_moe_decoded(weight: Callable[[dict[str, np.ndarray], str, int], np.ndarray]):
    """Qwen3's routing and SwiGLU experts, on weights decoded by `weight` (per name, group GS)."""
    def model(o, d, a):
        decoded = {**a, **{n: weight(a, n, d["GS"]) for n in ("w_gate", "w_up", "w_down")}}
        return model_qwen3_moe(o, d, decoded)
    return model


def model_gpt_oss_w4a16(o, d, a):
    """gpt-oss on its MXFP4 weights decoded to bf16: e8m0 scales are powers of two per QK along K."""
    return model_gpt_oss(o, d, {**a, **{n: fp4_group_weight(a, n, d["QK"]) for n in ("w_gate", "w_up", "w_down")}})


MODELS: dict[str, Callable[[Oracle, dict[str, int], dict[str, np.ndarray]], list[np.ndarray]]] = {
    "toy": model_toy,
    "mixtral": model_mixtral,
    "qwen3_moe": model_qwen3_moe,
    "deepseek_v3": model_deepseek_v3,
    "gpt_oss": model_gpt_oss,
    "llama4": model_llama4,
    "qwen3_moe_fp8": model_qwen3_moe_fp8,
    "deepseek_v3_fp8": model_deepseek_v3_fp8,
    "gpt_oss_mxfp4": model_gpt_oss_mxfp4,
    "gpt_oss_w4a16": model_gpt_oss_w4a16,
    "qwen3_moe_fp4_groups": model_qwen3_moe_decoded(fp4_group_weight),
    "qwen3_moe_trellis3": model_qwen3_moe_decoded(trellis_weight),
}


# --- comparison ----------------------------------------------------------------------------


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Units in the last place between same-typed float arrays (bf16 or f32); -0.0 == +0.0."""
    assert a.dtype == b.dtype
    bits, sign = (np.uint16, 0x8000) if a.dtype == BF16 else (np.uint32, 0x80000000)

    def ordinal(x: np.ndarray) -> np.ndarray:
        i = np.ascontiguousarray(x).view(bits).astype(np.int64)
        magnitude = i & (sign - 1)
        return np.where(i & sign, -magnitude, magnitude)

    return np.abs(ordinal(a) - ordinal(b))


def assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    if want.dtype.kind in "iub":
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    got_nan, want_nan = np.isnan(got.astype(F32)), np.isnan(want.astype(F32))
    assert (got_nan == want_nan).all(), f"{what}: NaN at different places"
    far = (ulp_distance(got, want) > ULPS) & ~want_nan
    assert not far.any(), (
        f"{what}: {int(far.sum())} of {far.size} values differ by more than {ULPS} ulp, e.g. "
        f"{got[far][:4].astype(np.float64)} instead of {want[far][:4].astype(np.float64)}"
    )


def assert_same_route(plan: object, layout: Layout, what: str) -> None:
    """The reference's runtime route plan (duck-typed: scatter_idx, expert_ids) equals ours."""
    np.testing.assert_array_equal(plan.scatter_idx, layout.scatter_idx, err_msg=f"{what}: scatter rows")
    np.testing.assert_array_equal(plan.expert_ids, layout.expert_ids, err_msg=f"{what}: block experts")


TAPPED = ("moe.topk", "moe.scatter", "moe.grouped_matmul", "moe.combine")


def run_tapped(program: Program, inputs: dict[str, np.ndarray]) -> list[object]:
    """Run the graph-level IR with every result of every moe op appended to the return, in
    program order, and give those extra results."""
    module = program.module.clone()
    fn = next(op for op in module.ops if isinstance(op, func.FuncOp))
    block = fn.body.blocks.first
    ret = block.last_op
    taps = [r for op in block.ops if op.name in TAPPED for r in op.results]
    block.insert_op_before(func.ReturnOp(*ret.operands, *taps), ret)
    block.erase_op(ret)
    fn.function_type = FunctionType.from_lists(
        fn.function_type.inputs.data, [*fn.function_type.outputs.data, *(t.type for t in taps)]
    )
    tapped = Program(program.filename, program.source, program.dims, module)
    outputs = tapped.run(inputs).outputs
    return outputs[len(outputs) - len(taps):]


def check_example(path: Path, seed: int, dims: dict[str, int] | None = None,
                  adjust: Callable[[dict[str, np.ndarray]], None] | None = None) -> None:
    model = MODELS.get(path.stem)
    assert model is not None, f"{path.name} has no independent model in {Path(__file__).name}; write one"
    program = tcpc.compile_file(path, dims)
    inputs = program.run(seed=seed).inputs
    if adjust is not None:
        adjust(inputs)
    result = program.run(inputs, seed=seed)
    for name, value in inputs.items():  # the run used exactly these inputs, bit for bit
        assert result.inputs[name].dtype == value.dtype
        assert result.inputs[name].tobytes() == value.tobytes(), name

    oracle = Oracle()
    blocks = {"B": int(c.chosen) for c in program.choices}  # the examples' B = auto: the block chosen
    with np.errstate(all="ignore"):
        expected = model(oracle, {**program.dims, **blocks}, {k: v.copy() for k, v in inputs.items()})

    assert len(result.outputs) == len(expected)
    for i, (got, want) in enumerate(zip(result.outputs, expected)):
        assert_close(got, want, f"{path.stem} out{i}")

    taps = run_tapped(program, inputs)
    assert len(taps) == len(oracle.taps), "the model does not mirror the program's moe ops"
    for n, (got, (what, want)) in enumerate(zip(taps, oracle.taps)):
        label = f"{path.stem} tap {n} ({what})"
        if isinstance(want, Layout):
            assert_same_route(got, want, label)
        else:
            assert_close(got, want, label)


EXAMPLE_FILES = sorted(EXAMPLES.glob("*.moe"))


def test_every_example_has_a_model() -> None:
    assert EXAMPLE_FILES, f"no examples in {EXAMPLES}"
    missing = [p.name for p in EXAMPLE_FILES if p.stem not in MODELS]
    assert not missing, f"examples without an independent model here: {missing}"


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.stem)
@pytest.mark.parametrize(
    "seed, dims",
    [(0, None), (1, None), (2, {"T": 5, "B": 4}), (3, {"B": 1})],
    ids=["seed0", "seed1", "T5", "B1"],
)
def test_example_matches_independent_model(path: Path, seed: int, dims: dict[str, int] | None) -> None:
    check_example(path, seed, dims)


def _collapse(inputs: dict[str, np.ndarray]) -> None:
    """Zero the router and its biases: every score ties, so every token picks the same experts
    by the lower-index rule (router collapse: all pairs on K experts, the others empty)."""
    for name in inputs:
        if name.startswith("router") or name == "bias":
            inputs[name] = np.zeros_like(inputs[name])


def _nan_token(inputs: dict[str, np.ndarray]) -> None:
    """A padding token of NaN: its scores are NaN, yet it picks K distinct experts and only its
    own output row becomes NaN."""
    inputs["x"][1] = np.nan


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.stem)
@pytest.mark.parametrize("adjust", [_collapse, _nan_token], ids=["collapse", "nan_token"])
def test_example_edge_inputs(path: Path, adjust: Callable[[dict[str, np.ndarray]], None]) -> None:
    check_example(path, seed=4, adjust=adjust)


def test_collapsed_router_routes_to_the_first_experts() -> None:
    """With all scores tied, the K lowest expert ids win for every token."""
    program = tcpc.compile_file(EXAMPLES / "qwen3_moe.moe")
    inputs = program.run(seed=0).inputs
    _collapse(inputs)
    taps = run_tapped(program, inputs)
    k, t = program.dims["K"], program.dims["T"]
    np.testing.assert_array_equal(taps[1], np.tile(np.arange(k, dtype=np.int32), (t, 1)))


def test_cli_run_reference_out(tmp_path: Path) -> None:
    """`tcpc run --reference --out` writes out0 as f32 (bf16 values, exact) for the drawn inputs."""
    path = EXAMPLES / "toy.moe"
    out = tmp_path / "toy.npz"
    tcpc_bin = Path(sys.executable).parent / "tcpc"
    done = subprocess.run(
        [str(tcpc_bin), "run", str(path), "--reference", "--seed", "7", "--set", "T=6", "--out", str(out)],
        capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}" in done.stdout
    with np.load(out, allow_pickle=False) as data:
        assert data.files == ["out0"]
        written = data["out0"]
    assert written.dtype == np.float32 and written.shape == (6, 8)
    program = tcpc.compile_file(path, {"T": 6})
    inputs = program.run(seed=7).inputs
    with np.errstate(all="ignore"):
        (want,) = model_toy(Oracle(), program.dims, inputs)
    assert_close(written.astype(BF16), want, "tcpc run --out")
    np.testing.assert_array_equal(written, want.astype(np.float32))
