"""lower-dispatch is checked by translation validation: the IR before the pass (moe.dispatch,
moe.grouped_matmul, moe.combine on a `moe.route` of function arguments) and after it run on the
same inputs. The routing plans are computed here by the reference's `route_plan` from random
valid routings (K distinct experts per token, capacity drops, empty experts, crowded experts), so
the pass is tested without lower-routing.

Exactness (see passes/lowering/lower_dispatch.py):
- dispatch and combine are bit-identical to the reference, -0.0 and NaN payloads included;
- grouped_matmul is bit-identical on padding rows and unused blocks (+0.0) and wherever the f32
  accumulation is exact whatever its order (small integers); elsewhere its valid rows differ from
  the reference only by the contraction's f32 summation order: |got - want| <= 2 gamma_D
  (sum_d |x_d w_d| + |bias|), plus one ulp of the result for bf16 results, with the same NaN and
  inf positions.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from xdsl.dialects.builtin import FunctionType, ModuleOp, TensorType, f32, i32
from xdsl.interpreter import Interpreter
from xdsl.parser import Parser
from xdsl.rewriter import InsertPoint, Rewriter
from xdsl.utils.exceptions import PassFailedException

import tcpc
from dialects import lowp, moe, tcp, ve
from passes.lowering.lower_dispatch import LowerDispatchPass, quantizes_dispatched_tokens
from runtime_sim.semantics.executor import function_named, run_function
from runtime_sim.semantics.moe_semantics import RoutePlan, route_plan
from runtime_sim.semantics.tolerance import ULPS
from tcpc.cli import main as tcpc_main
from tcpc.pipelines import PASSES, apply_pipeline, make_context, parse_pipeline
from support import bits

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.moe"))
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
DTYPES = {"bf16": BF16, "f32": F32}
U = 2.0**-24
"""The unit roundoff of f32."""



def assert_bits(got: np.ndarray, want: np.ndarray, what: str, nan_payloads: bool = True) -> None:
    """The same bits; with nan_payloads=False, any NaN matches any NaN (where NaNs of different
    payloads meet in an add or a multiply, numpy itself keeps either operand's payload depending
    on its loop: `a += b` keeps b's for one element and a's for eight, so no level can promise it)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.dtype, want.shape)
    same = bits(got) == bits(want)
    if not nan_payloads:
        same |= np.isnan(got.astype(np.float32)) & np.isnan(want.astype(np.float32))
    assert same.all(), (
        f"{what}: {int((~same).sum())} of {same.size} values differ, e.g. at {np.argwhere(~same)[:3].tolist()}: "
        f"got {got[~same][:3].astype(np.float64)}, want {want[~same][:3].astype(np.float64)}"
    )


# ---------------------------------------------------------------------------------------------
# Modules: a routing plan from function arguments, then the ops under test


def tt(shape: tuple[int, ...] | list[int], dtype: str) -> str:
    return f"tensor<{'x'.join(map(str, shape))}x{dtype}>"


def route_type(t: int, k: int, e: int, b: int, c: int | None) -> moe.RouteType:
    return moe.RouteType.make(t, k, e, b, c)


def parse(text: str) -> ModuleOp:
    module = Parser(make_context(), text).parse_module()
    module.verify()
    return module


@cache
def layer_modules(t: int, k: int, e: int, b: int, c: int | None, d: int, f: int, x_dt: str, w_dt: str,
                  bias_dt: str | None, weights_dt: str | None) -> tuple[ModuleOp, ModuleOp]:
    """@layer(x, scatter_idx, expert_ids, w, [bias], [weights]) -> (x_blocked, y_blocked, out):
    dispatch, grouped_matmul, combine on one plan."""
    r = route_type(t, k, e, b, c)
    g = r.blocks.data
    y_dt = "f32" if "f32" in (x_dt, w_dt) else "bf16"
    rt = str(r)
    args = [f"%x: {tt([t, d], x_dt)}", f"%scatter_idx: {tt([t, k], 'i32')}", f"%expert_ids: {tt([g], 'i32')}",
            f"%w: {tt([e, d, f], w_dt)}"]
    bias = ""
    if bias_dt is not None:
        args.append(f"%bias: {tt([e, f], bias_dt)}")
        bias = " bias %bias"
    weights = ""
    if weights_dt is not None:
        args.append(f"%weights: {tt([t, k], weights_dt)}")
        weights = " weights %weights"
    xb, yb, out = tt([g, b, d], x_dt), tt([g, b, f], y_dt), tt([t, f], y_dt)
    text = (
        f"func.func @layer({', '.join(args)}) -> ({xb}, {yb}, {out}) {{\n"
        f"  %route = moe.route %scatter_idx, %expert_ids : {tt([t, k], 'i32')}, {tt([g], 'i32')} -> {rt}\n"
        f"  %xb = moe.dispatch %x, %route : {tt([t, d], x_dt)}, {rt} -> {xb}\n"
        f"  %yb = moe.grouped_matmul %xb, %w, %route{bias} : {xb}, {tt([e, d, f], w_dt)}, {rt}"
        + (f", {tt([e, f], bias_dt)}" if bias_dt else "") + f" -> {yb}\n"
        f"  %out = moe.combine %yb, %route{weights} : {yb}, {rt}"
        + (f", {tt([t, k], weights_dt)}" if weights_dt else "") + f" -> {out}\n"
        f"  func.return %xb, %yb, %out : {xb}, {yb}, {out}\n}}"
    )
    before = parse(text)
    return before, apply_pipeline(before, parse_pipeline("lower-dispatch"))


@cache
def matmul_modules(g: int, b: int, d: int, f: int, e: int, r: moe.RouteType, x_dt: str, w_dt: str,
                   bias_dt: str | None) -> tuple[ModuleOp, ModuleOp]:
    """@gmm(xb, scatter_idx, expert_ids, w, [bias]) -> y: grouped_matmul on any blocked input."""
    t, k = r.tokens.data, r.k.data
    y_dt = "f32" if "f32" in (x_dt, w_dt) else "bf16"
    rt = str(r)
    args = [f"%xb: {tt([g, b, d], x_dt)}", f"%scatter_idx: {tt([t, k], 'i32')}", f"%expert_ids: {tt([g], 'i32')}",
            f"%w: {tt([e, d, f], w_dt)}"] + ([f"%bias: {tt([e, f], bias_dt)}"] if bias_dt else [])
    text = (
        f"func.func @gmm({', '.join(args)}) -> {tt([g, b, f], y_dt)} {{\n"
        f"  %route = moe.route %scatter_idx, %expert_ids : {tt([t, k], 'i32')}, {tt([g], 'i32')} -> {rt}\n"
        f"  %y = moe.grouped_matmul %xb, %w, %route" + (" bias %bias" if bias_dt else "")
        + f" : {tt([g, b, d], x_dt)}, {tt([e, d, f], w_dt)}, {rt}" + (f", {tt([e, f], bias_dt)}" if bias_dt else "")
        + f" -> {tt([g, b, f], y_dt)}\n"
        f"  func.return %y : {tt([g, b, f], y_dt)}\n}}"
    )
    before = parse(text)
    return before, apply_pipeline(before, parse_pipeline("lower-dispatch"))


@cache
def combine_modules(r: moe.RouteType, d: int, y_dt: str, weights_dt: str | None,
                    widened: bool = False) -> tuple[ModuleOp, ModuleOp]:
    """@comb(yb, scatter_idx, expert_ids, [weights]) -> out: combine on any blocked input;
    `widened`: of the blocks cast to f32 first (expert parallelism's allgather partial sums)."""
    t, k, g, b = r.tokens.data, r.k.data, r.blocks.data, r.block.data
    rt = str(r)
    args = [f"%yb: {tt([g, b, d], y_dt)}", f"%scatter_idx: {tt([t, k], 'i32')}", f"%expert_ids: {tt([g], 'i32')}"]
    args += [f"%weights: {tt([t, k], weights_dt)}"] if weights_dt else []
    out_dt = "f32" if widened else y_dt
    cast = f"  %rows = tmath.cast %yb : {tt([g, b, d], y_dt)} -> {tt([g, b, d], 'f32')}\n" if widened else ""
    text = (
        f"func.func @comb({', '.join(args)}) -> {tt([t, d], out_dt)} {{\n"
        f"  %route = moe.route %scatter_idx, %expert_ids : {tt([t, k], 'i32')}, {tt([g], 'i32')} -> {rt}\n" + cast
        + f"  %out = moe.combine {'%rows' if widened else '%yb'}, %route" + (" weights %weights" if weights_dt else "")
        + f" : {tt([g, b, d], out_dt)}, {rt}" + (f", {tt([t, k], weights_dt)}" if weights_dt else "")
        + f" -> {tt([t, d], out_dt)}\n"
        f"  func.return %out : {tt([t, d], out_dt)}\n}}"
    )
    before = parse(text)
    return before, apply_pipeline(before, parse_pipeline("lower-dispatch"))


# ---------------------------------------------------------------------------------------------
# Routings and values


def routing(rng: np.random.Generator, t: int, k: int, e: int, style: str) -> np.ndarray:
    """[T, K] i32, K distinct experts per token: `uniform`, `crowded` (every token picks among
    the first K + 1 experts, so most experts are empty and a few overflow any capacity), or
    `same` (every token picks experts 0..K-1; with K = 1 all pairs go to one expert)."""
    if style == "same":
        return np.broadcast_to(np.arange(k, dtype=np.int32), (t, k)).copy()
    pool = e if style == "uniform" else min(e, k + 1)
    rows = [rng.permutation(pool)[:k] for _ in range(t)]
    return np.array(rows, dtype=np.int32).reshape(t, k)


def values(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype, kind: str = "normal") -> np.ndarray:
    """`normal`; `ints`: small integers, so every f32 sum is exact in any order; `special`:
    normal values with some +-0.0, +-inf and NaN (two payloads)."""
    if kind == "ints":
        return rng.integers(-3, 4, size=shape).astype(np.float32).astype(dtype)
    x = rng.standard_normal(shape).astype(np.float32)
    if kind == "special":
        pool = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 0.0], dtype=np.float32)
        pool[5] = np.array(0x7FC12345, dtype=np.uint32).view(np.float32)  # another NaN payload
        pick = rng.random(shape) < 0.15
        x = np.where(pick, pool[rng.integers(0, len(pool), size=shape)], x)
    return x.astype(dtype)


def padding_rows(plan: RoutePlan) -> np.ndarray:
    return ~plan.row_valid


def matmul_bound(xb: np.ndarray, w: np.ndarray, bias: np.ndarray | None, plan: RoutePlan) -> np.ndarray:
    """Per element of y [G, B, F]: how far two f32 evaluations of the same block matmul (plus
    bias) in different summation orders can be apart, 2 gamma_{D+1} (sum |x w| + |bias|)
    (assert_matmul_close adds the rounding to bf16)."""
    g, b, d = xb.shape
    experts = np.maximum(plan.expert_ids, 0)
    wg = np.abs(w.astype(np.float64))[experts]  # [G, D, F]
    with np.errstate(all="ignore"):  # 0 * inf: the bound is NaN where the result is
        s = np.einsum("gbd,gdf->gbf", np.abs(xb.astype(np.float64)), wg)
        if bias is not None:
            s = s + np.abs(bias.astype(np.float64))[experts][:, None, :]
    s.reshape(g * b, -1)[~plan.row_valid] = 0  # padding rows and unused blocks are exactly zero
    n = d + 1
    gamma = n * U / (1 - n * U)
    return 2 * gamma * s


def assert_matmul_close(got: np.ndarray, want: np.ndarray, bound: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    g64, w64 = got.astype(np.float64), want.astype(np.float64)
    assert (np.isnan(g64) == np.isnan(w64)).all(), f"{what}: NaN at different places"
    inf = np.isinf(w64)
    assert (g64[inf] == w64[inf]).all() and (np.isinf(g64) == inf).all(), f"{what}: inf at different places"
    finite = np.isfinite(w64)
    g64, w64 = np.where(finite, g64, 0.0), np.where(finite, w64, 0.0)
    slack = np.where(finite, bound, 0.0)
    if got.dtype == BF16:  # the two f32 values may round to neighbouring bf16 values
        mag = np.maximum(np.abs(g64), np.abs(w64))
        slack = slack + np.where(mag > 0, 2.0 ** (np.floor(np.log2(np.maximum(mag, 1e-300))) - 7), 2.0**-133)
    far = finite & ~(np.abs(g64 - w64) <= slack)
    assert not far.any(), f"{what}: {got[far][:4]} instead of {want[far][:4]} (bound {slack[far][:4]})"


def compare_layer(before: ModuleOp, after: ModuleOp, args: list[np.ndarray], plan: RoutePlan,
                  w: np.ndarray, bias: np.ndarray | None, exact: bool) -> None:
    want = run_function(before, "layer", args)
    got = run_function(after, "layer", args)
    assert_bits(got[0], want[0], "x_blocked")
    y_want, y_got = want[1], got[1]
    pad = padding_rows(plan).reshape(y_want.shape[:2])
    assert_bits(y_got[pad], y_want[pad], "y_blocked padding rows")
    assert not np.signbit(y_got[pad].astype(np.float32)).any()
    if exact:
        assert_bits(y_got, y_want, "y_blocked")
        assert_bits(got[2], want[2], "combine")
    else:
        assert_matmul_close(y_got, y_want, matmul_bound(want[0], w, bias, plan), "y_blocked")
        # combine itself is exact: its input is the lowered y_blocked on both sides.
        comb_before, _ = combine_modules(*combine_key(before))
        weights = args[-1] if len(args) > 4 + (bias is not None) else None
        extra = [weights] if weights is not None else []
        want_out = run_function(comb_before, "comb", [y_got, args[1], args[2], *extra])[0]
        assert_bits(got[2], want_out, "combine on the lowered y_blocked")


def combine_key(layer: ModuleOp) -> tuple:
    (c,) = [op for op in layer.walk() if isinstance(op, moe.CombineOp)]
    d = c.input.type.get_shape()[2]
    y_dt = "f32" if c.input.type.get_element_type() == f32 else "bf16"
    w_dt = None
    if c.weights is not None:
        w_dt = "f32" if c.weights.type.get_element_type() == f32 else "bf16"
    return c.route.type, d, y_dt, w_dt


# ---------------------------------------------------------------------------------------------
# The whole layer on random routings


@st.composite
def layer_cases(draw: st.DrawFn) -> tuple:
    e = draw(st.integers(1, 8))
    k = draw(st.integers(1, min(e, 3)))
    t = draw(st.integers(1, 10))
    b = draw(st.integers(1, 5))
    c = draw(st.one_of(st.none(), st.integers(1, t)))
    d = draw(st.integers(1, 12))
    f = draw(st.integers(1, 12))
    x_dt, w_dt = draw(st.sampled_from(sorted(DTYPES))), draw(st.sampled_from(sorted(DTYPES)))
    bias_dt = draw(st.one_of(st.none(), st.sampled_from(sorted(DTYPES))))
    weights_dt = draw(st.one_of(st.none(), st.sampled_from(sorted(DTYPES))))
    style = draw(st.sampled_from(["uniform", "crowded", "same"]))
    kind = draw(st.sampled_from(["normal", "ints"]))
    seed = draw(st.integers(0, 2**32 - 1))
    return t, k, e, b, c, d, f, x_dt, w_dt, bias_dt, weights_dt, style, kind, seed


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layer_cases())
def test_layer_matches_the_reference(case: tuple) -> None:
    t, k, e, b, c, d, f, x_dt, w_dt, bias_dt, weights_dt, style, kind, seed = case
    rng = np.random.default_rng(seed)
    before, after = layer_modules(t, k, e, b, c, d, f, x_dt, w_dt, bias_dt, weights_dt)
    assert not [op for op in after.walk() if op.dialect_name() == "moe"]
    plan = route_plan(routing(rng, t, k, e, style), route_type(t, k, e, b, c))
    x = values(rng, (t, d), DTYPES[x_dt], kind)
    w = values(rng, (e, d, f), DTYPES[w_dt], kind)
    args = [x, plan.scatter_idx, plan.expert_ids, w]
    bias = None
    if bias_dt is not None:
        bias = values(rng, (e, f), DTYPES[bias_dt], kind)
        args.append(bias)
    if weights_dt is not None:
        weights = values(rng, (t, k), DTYPES[weights_dt], kind)
        # A dropped pair's weight may be anything: it must not reach the output.
        dropped = plan.scatter_idx < 0
        weights[dropped] = np.array([np.nan, np.inf, -np.inf], dtype=np.float32)[
            np.arange(int(dropped.sum())) % 3].astype(weights.dtype)
        args.append(weights)
    compare_layer(before, after, args, plan, w, bias, exact=kind == "ints")


@pytest.mark.parametrize("t, c, style", [
    (63, None, "uniform"),    # one command (under TOKENS_PER_SCATTER)
    (65, None, "crowded"),    # shards of 64 and 1
    (200, 30, "uniform"),     # four shards, the last short, a capacity dropping pairs
    (520, None, "same"),      # eight shards of 65, every pair on one expert
])
def test_the_dispatch_index_scatter_in_token_shards(t: int, c: int | None, style: str) -> None:
    """From TOKENS_PER_SCATTER tokens the dispatch index is scattered by several DMA commands,
    one per shard of consecutive tokens, and their results added: the layer's bits as before."""
    from passes.lowering.lower_dispatch import scatter_shard

    k, e, b, d, f = 2, 4, 8, 3, 2
    rng = np.random.default_rng(t)
    before, after = layer_modules(t, k, e, b, c, d, f, "f32", "f32", None, None)
    scatters = [op for op in after.walk() if isinstance(op, tcp.DmaScatterOp)]
    assert len(scatters) == -(-t // scatter_shard(t, 8)) == (1 if t < 65 else -(-t // max(64, -(-t // 8))))
    plan = route_plan(routing(rng, t, k, e, style), route_type(t, k, e, b, c))
    x = values(rng, (t, d), np.float32, "ints")
    w = values(rng, (e, d, f), np.float32, "ints")
    compare_layer(before, after, [x, plan.scatter_idx, plan.expert_ids, w], plan, w, None, exact=True)


# ---------------------------------------------------------------------------------------------
# combine alone: any blocked input, special values everywhere


@st.composite
def plan_cases(draw: st.DrawFn) -> tuple:
    e = draw(st.integers(1, 8))
    k = draw(st.integers(1, min(e, 4)))
    t = draw(st.integers(1, 12))
    b = draw(st.integers(1, 5))
    c = draw(st.one_of(st.none(), st.integers(1, t)))
    d = draw(st.integers(1, 10))
    style = draw(st.sampled_from(["uniform", "crowded", "same"]))
    seed = draw(st.integers(0, 2**32 - 1))
    return t, k, e, b, c, d, style, seed


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan_cases(), st.sampled_from(sorted(DTYPES)), st.sampled_from([None, *sorted(DTYPES)]), st.booleans())
def test_combine_is_bit_identical(case: tuple, y_dt: str, weights_dt: str | None, widened: bool) -> None:
    """Padding rows hold NaN and inf (combine must never read them), kept values include +-0.0,
    +-inf and NaN payloads, dropped pairs have NaN or inf weights. `widened`: bf16 blocks cast
    to f32 before the combine, which the lowering gathers narrow and widens after the gather."""
    widened = widened and y_dt == "bf16"
    t, k, e, b, c, d, style, seed = case
    rng = np.random.default_rng(seed)
    r = route_type(t, k, e, b, c)
    plan = route_plan(routing(rng, t, k, e, style), r)
    g = r.blocks.data
    yb = values(rng, (g, b, d), DTYPES[y_dt], "special")
    rows = yb.reshape(g * b, d)
    rows[padding_rows(plan)] = np.array(np.nan, dtype=np.float32).astype(yb.dtype)
    args = [yb, plan.scatter_idx, plan.expert_ids]
    if weights_dt is not None:
        weights = values(rng, (t, k), DTYPES[weights_dt], "special")
        weights[plan.scatter_idx < 0] = np.array(np.nan, dtype=np.float32).astype(weights.dtype)
        args.append(weights)
    before, after = combine_modules(r, d, y_dt, weights_dt, widened)
    if widened:  # the whole-tensor cast is gone: the gather reads the bf16 blocks
        assert not any(op.name == "tmath.cast" for op in after.walk())
    got, want = run_function(after, "comb", args)[0], run_function(before, "comb", args)[0]
    assert_bits(got, want, "combine", nan_payloads=False)


def test_combine_of_negative_zeros_is_positive_zero() -> None:
    """The reference's accumulator starts at +0.0, so a sum of -0.0 terms is +0.0; the lowered
    sum starts at the first term and adds +0.0 at the end to agree."""
    r = route_type(2, 1, 2, 1, None)
    plan = route_plan(np.array([[0], [1]], dtype=np.int32), r)
    for y_dt in DTYPES:
        yb = np.full((r.blocks.data, 1, 3), -0.0, dtype=np.float32).astype(DTYPES[y_dt])
        before, after = combine_modules(r, 3, y_dt, None)
        args = [yb, plan.scatter_idx, plan.expert_ids]
        got, want = run_function(after, "comb", args)[0], run_function(before, "comb", args)[0]
        assert_bits(got, want, "combine of -0.0")
        assert not np.signbit(got.astype(np.float32)).any()


# ---------------------------------------------------------------------------------------------
# grouped_matmul alone: a blocked input whose padding rows are not zero


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan_cases(), st.integers(1, 10), st.sampled_from(sorted(DTYPES)), st.sampled_from(sorted(DTYPES)),
       st.sampled_from([None, *sorted(DTYPES)]), st.sampled_from(["normal", "ints"]))
def test_grouped_matmul_zeroes_padding_and_skips_unused_blocks(case: tuple, f: int, x_dt: str, w_dt: str,
                                                               bias_dt: str | None, kind: str) -> None:
    """Padding rows of the input hold NaN and inf and the weights of some used experts hold inf
    and NaN: the reference's padding rows and unused blocks are still +0.0, and so are ours."""
    t, k, e, b, c, d, style, seed = case
    rng = np.random.default_rng(seed)
    r = route_type(t, k, e, b, c)
    plan = route_plan(routing(rng, t, k, e, style), r)
    g = r.blocks.data
    xb = values(rng, (g, b, d), DTYPES[x_dt], kind)
    xrows = xb.reshape(g * b, d)
    xrows[padding_rows(plan)] = np.array([np.nan, np.inf], dtype=np.float32)[
        np.arange(d) % 2].astype(xb.dtype)
    w = values(rng, (e, d, f), DTYPES[w_dt], kind)
    if rng.random() < 0.5:
        w[rng.integers(0, e), rng.integers(0, d), rng.integers(0, f)] = np.inf
        w[rng.integers(0, e), rng.integers(0, d), rng.integers(0, f)] = np.nan
    args = [xb, plan.scatter_idx, plan.expert_ids, w]
    bias = None
    if bias_dt is not None:
        bias = values(rng, (e, f), DTYPES[bias_dt], kind)
        args.append(bias)
    before, after = matmul_modules(g, b, d, f, e, r, x_dt, w_dt, bias_dt)
    want, got = run_function(before, "gmm", args)[0], run_function(after, "gmm", args)[0]
    pad = padding_rows(plan).reshape(g, b)
    assert_bits(got[pad], want[pad], "padding rows")
    assert (bits(got[pad]) == 0).all()
    valid_x = np.where(pad[..., None], np.zeros((), xb.dtype), xb)
    if kind == "ints" and np.isfinite(w.astype(np.float32)).all():
        assert_bits(got, want, "grouped_matmul")
    else:
        assert_matmul_close(got, want, matmul_bound(valid_x, w, bias, plan), "grouped_matmul")


def test_consecutive_blocks_of_one_expert_and_empty_experts() -> None:
    """All pairs on one expert (K = 1): several consecutive blocks share its weight, every other
    expert is empty and unused blocks trail. Integer values: bit-identical."""
    t, k, e, b, d, f = 9, 1, 4, 2, 5, 3
    r = route_type(t, k, e, b, None)
    plan = route_plan(np.full((t, 1), 2, dtype=np.int32), r)
    assert plan.expert_ids.tolist()[:5] == [2] * 5 and (plan.expert_ids[5:] == -1).all()
    rng = np.random.default_rng(1)
    before, after = layer_modules(t, k, e, b, None, d, f, "bf16", "bf16", "bf16", "bf16")
    x, w = values(rng, (t, d), BF16, "ints"), values(rng, (e, d, f), BF16, "ints")
    bias, weights = values(rng, (e, f), BF16, "ints"), values(rng, (t, k), BF16, "ints")
    compare_layer(before, after, [x, plan.scatter_idx, plan.expert_ids, w, bias, weights], plan, w, bias,
                  exact=True)


def test_accumulation_order_is_the_only_difference() -> None:
    """On ordinary values the grouped matmul's f32 sums differ from the reference's per-block
    BLAS matmul in their last bits (np.einsum sums in another order); rounded to bf16 they
    mostly agree. This pins down the stated tolerance: no value is outside it, and the f32
    differences are a few ulps of the sum of |x w|."""
    t, k, e, b, d, f = 32, 2, 4, 4, 64, 64
    rng = np.random.default_rng(0)
    r = route_type(t, k, e, b, None)
    plan = route_plan(routing(rng, t, k, e, "uniform"), r)
    g = r.blocks.data
    for dt in ("f32", "bf16"):
        xb = values(rng, (g, b, d), DTYPES[dt])
        xb.reshape(g * b, d)[padding_rows(plan)] = 0
        w = values(rng, (e, d, f), DTYPES[dt])
        before, after = matmul_modules(g, b, d, f, e, r, dt, dt, None)
        args = [xb, plan.scatter_idx, plan.expert_ids, w]
        want, got = run_function(before, "gmm", args)[0], run_function(after, "gmm", args)[0]
        assert_matmul_close(got, want, matmul_bound(xb, w, None, plan), dt)


# ---------------------------------------------------------------------------------------------
# Every example, with its routing plan given as function arguments


class _PlanRecorder(Interpreter.Listener):
    def __init__(self) -> None:
        self.plans: list[RoutePlan] = []

    def did_interpret_op(self, op, results) -> None:  # noqa: ANN001
        if isinstance(op, moe.ScatterOp):
            self.plans.append(results[1])


def with_route_arguments(module: ModuleOp, graph: str) -> ModuleOp:
    """A copy of `module` where each `moe.scatter` of `graph` is `moe.route` of two new function
    arguments (scatter_idx, expert_ids, in scatter order) and `moe.dispatch`: what lower-routing
    leaves, without its index generation."""
    module = module.clone()
    fn = function_named(module, graph)
    block = fn.body.blocks.first
    for n, scatter in enumerate([op for op in fn.walk() if isinstance(op, moe.ScatterOp)]):
        r = scatter.route.type
        t, k, g = r.tokens.data, r.k.data, r.blocks.data
        idx = block.insert_arg(TensorType(i32, [t, k]), len(block.args))
        ids = block.insert_arg(TensorType(i32, [g]), len(block.args))
        idx.name_hint, ids.name_hint = f"scatter_idx{n}", f"expert_ids{n}"
        route = moe.RouteOp(idx, ids, r)
        dispatch = moe.DispatchOp(scatter.input, route.route)
        Rewriter.insert_op([route, dispatch], InsertPoint.before(scatter))
        scatter.blocked.replace_all_uses_with(dispatch.blocked)
        scatter.route.replace_all_uses_with(route.route)
        Rewriter.erase_op(scatter)
    fn.function_type = FunctionType.from_lists(list(block.arg_types), list(fn.function_type.outputs))
    module.verify()
    return module


def ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    kind, sign = (np.uint16, 0x8000) if a.dtype == BF16 else (np.uint32, 0x80000000)

    def ordinal(x: np.ndarray) -> np.ndarray:
        i = np.ascontiguousarray(x).view(kind).astype(np.int64)
        return np.where(i & sign, -(i & (sign - 1)), i & (sign - 1))

    return np.abs(ordinal(a) - ordinal(b))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_after_lower_dispatch(path: Path) -> None:
    program = tcpc.compile_file(path)
    for graph in program.graph_names:
        ref = program.run(seed=0, graph=graph)
        recorder = _PlanRecorder()
        want = run_function(program.module, graph, list(ref.inputs.values()), [recorder])
        routed = with_route_arguments(program.module, graph)
        lowered = apply_pipeline(routed, parse_pipeline("lower-topk,lower-dispatch"))
        assert not [op for op in lowered.walk() if op.dialect_name() == "moe"]
        plan_args = [a for p in recorder.plans for a in (p.scatter_idx, p.expert_ids)]
        got = run_function(lowered, graph, [*ref.inputs.values(), *plan_args])
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert (np.isnan(g.astype(np.float32)) == np.isnan(w.astype(np.float32))).all()
            assert int(ulps(g, w).max()) <= ULPS  # the one tolerance (runtime_sim/semantics/tolerance.py), f"{graph}: {int(ulps(g, w).max())} ulps"


# ---------------------------------------------------------------------------------------------
# Structure, errors, registration


def test_one_row_mask_per_plan_and_one_weight_gather_per_matmul() -> None:
    _, after = layer_modules(6, 2, 4, 2, None, 4, 4, "bf16", "bf16", "bf16", "bf16")
    names = [op.name for op in after.walk()]
    assert names.count("tcp.dma_scatter") == 1  # the row marks (each row's token), once per plan
    assert names.count("tcp.dma_gather") == 4  # the tokens by row, weights, bias, combine's rows
    (contract,) = [op for op in after.walk() if isinstance(op, tcp.ContractOp)]
    assert contract.guard is not None and contract.spec.data == "gbd,gdf->gbf"
    assert contract.result.type.get_element_type() == f32
    assert len([op for op in after.walk() if isinstance(op, ve.NarrowOp)]) == 2
    assert [op.input.type.get_shape() for op in after.walk() if isinstance(op, ve.ReduceSumOp)] == [(6, 2, 4)]


GMM_FROM_SCATTER = """
func.func @f(%x: tensor<4x8xbf16>, %e: tensor<4x1xi32>, %w: tensor<2x8x8xbf16>) -> tensor<3x2x8xbf16> {
  %xb, %route = moe.scatter %x, %e : tensor<4x8xbf16>, tensor<4x1xi32> -> tensor<3x2x8xbf16>, !moe.route<T = 4, K = 1, E = 2, B = 2, G = 3>
  %y = moe.grouped_matmul %xb, %w, %route : tensor<3x2x8xbf16>, tensor<2x8x8xbf16>, !moe.route<T = 4, K = 1, E = 2, B = 2, G = 3> -> tensor<3x2x8xbf16>
  func.return %y : tensor<3x2x8xbf16>
}
"""

COMBINE_OF_ARGUMENT = """
func.func @f(%y: tensor<3x2x8xbf16>, %route: !moe.route<T = 4, K = 1, E = 2, B = 2, G = 3>) -> tensor<4x8xbf16> {
  %out = moe.combine %y, %route : tensor<3x2x8xbf16>, !moe.route<T = 4, K = 1, E = 2, B = 2, G = 3> -> tensor<4x8xbf16>
  func.return %out : tensor<4x8xbf16>
}
"""


@pytest.mark.parametrize("text, message", [
    (GMM_FROM_SCATTER, "run lower-routing first: moe.scatter has not been lowered"),
    (COMBINE_OF_ARGUMENT, "run lower-routing first: %route of moe.combine is not produced by moe.route "
                          "(it is a block argument)"),
])
def test_unlowered_routing_is_reported(text: str, message: str) -> None:
    module = parse(text)
    unchanged = str(module)
    with pytest.raises(PassFailedException, match=re.escape(f"lower-dispatch: {message}")):
        LowerDispatchPass().apply(make_context(), module)
    assert str(module) == unchanged  # checked before anything is rewritten


def test_unlowered_example_is_reported_by_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    example = str(ROOT / "examples" / "mixtral.moe")
    assert tcpc_main(["compile", example, "-p", "lower-topk,lower-dispatch"]) == 1
    err = capsys.readouterr().err
    assert "lower-dispatch: run lower-routing first" in err and "Traceback" not in err


def test_registered() -> None:
    assert PASSES["lower-dispatch"]() is LowerDispatchPass
    (p,) = parse_pipeline("lower-dispatch")
    assert isinstance(p, LowerDispatchPass)


def test_unused_routes_are_erased_and_used_ones_kept() -> None:
    before, after = layer_modules(3, 1, 2, 2, None, 2, 2, "f32", "f32", None, None)
    assert [op for op in before.walk() if isinstance(op, moe.RouteOp)]
    assert not [op for op in after.walk() if isinstance(op, moe.RouteOp)]


# ---------------------------------------------------------------------------------------------
# quantize=tokens: block-scaled activations quantized once per token, before the dispatch

QUANTIZED_TOKENS = ["deepseek_v3_fp8", "gpt_oss_mxfp4", "qwen3_moe_fp8"]
"""The examples whose scaled grouped matmuls read the quantization of dispatched tokens."""


@pytest.mark.parametrize("example", QUANTIZED_TOKENS)
def test_tokens_quantized_before_the_dispatch_give_the_same_bits(example: str) -> None:
    """The driver leaves `quantize` to the cost model for these programs; forced to `tokens`,
    the tokens [T, D] are quantized once (no quantization of x's blocks is left, DeepSeek-V3's
    shared expert reads the same one) and the blocks gather f8 rows and their f32 scales, and
    the lowered layer gives the reference's bits (Qwen3's also simulated, scheduled)."""
    program = tcpc.compile_file(ROOT / "examples" / f"{example}.moe", {"B": 4})
    assert quantizes_dispatched_tokens(program.module)
    spec = program.full_pipeline()
    assert "lower-dispatch{quantize=auto}" in spec
    lowering = "lower-topk,lower-routing,lower-dispatch{quantize=tokens},lower-quant"
    want = program.run(seed=4).outputs
    runs = [program.run(seed=4, pipeline=lowering)]
    if example == "qwen3_moe_fp8":  # and through the schedule level, simulated
        runs.append(program.simulate(seed=4, pipeline=spec.replace("quantize=auto", "quantize=tokens")))
    for run in runs:
        for g, w in zip(run.outputs, want, strict=True):
            assert np.array_equal(bits(g), bits(w))
    x = program.function().args[0]
    t, d = x.type.get_shape()
    lowered = program.lower("lower-topk,lower-routing,lower-dispatch{quantize=tokens}")
    quantized = [op.input for op in lowered.walk() if isinstance(op, lowp.QuantizeOp)]
    assert [v.type.get_shape() for v in quantized].count((t, d)) == 1  # DeepSeek-V3's shared expert's, shared
    assert not [v for v in quantized if isinstance(v.owner, tcp.DmaGatherOp)]  # no block of x is quantized
    gathered = [op.result.type for op in lowered.walk() if isinstance(op, tcp.DmaGatherOp)]
    assert any("f8E4M3" in str(ty.get_element_type()) and ty.get_shape()[2] == d for ty in gathered)
    blocks = program.lower("lower-topk,lower-routing,lower-dispatch")  # the default: each block's rows
    assert [op for op in blocks.walk() if isinstance(op, lowp.QuantizeOp) and isinstance(op.input.owner, tcp.DmaGatherOp)]


OTHER_READER = """
dims T = 8, D = 64, F = 32, E = 4, K = 2, B = 4
graph g(x: bf16[T, D], router: bf16[D, E], w: f8e4m3[E, D, F], ws: f32[E, D / 32, F / 32]) -> (bf16[T, F], bf16[T, D]) {
    top_p, top_e = topk(softmax(f32(x @ router)), K)
    xb, route = scatter(x, top_e, experts=E, block=B)
    xq, xs = quantize(xb, f8e4m3, group=32)
    return combine(grouped_matmul(xq, w, route, scales=(xs, ws)), route), combine(bf16(dequantize(xq, xs)), route)
}
"""


def test_quantized_blocks_another_op_reads_stay_per_block() -> None:
    """A quantization of blocks that something besides the scaled grouped matmuls reads (here a
    dequantization) is not moved, `tokens` or not: that reader would see the padding rows'
    scales change."""
    program = tcpc.compile_source(OTHER_READER)
    assert not quantizes_dispatched_tokens(program.module)
    assert "quantize=" not in program.full_pipeline()
    lowered = program.lower("lower-topk,lower-routing,lower-dispatch{quantize=tokens}")
    (quantize,) = [op for op in lowered.walk() if isinstance(op, lowp.QuantizeOp)]
    assert isinstance(quantize.input.owner, tcp.DmaGatherOp)  # still each block's rows


def test_the_quantize_option_is_checked() -> None:
    with pytest.raises(ValueError, match=re.escape("lower-dispatch: unknown quantize 'rows' (choose blocks, tokens or auto)")):
        LowerDispatchPass(quantize="rows")
    module = parse(GMM_FROM_SCATTER)
    with pytest.raises(PassFailedException, match=re.escape("lower-dispatch{quantize=auto} is chosen by the cost model")):
        LowerDispatchPass(quantize="auto").apply(make_context(), module)
