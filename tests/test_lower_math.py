"""lower-math is checked by translation validation: each `tmath` op, and every example, is run
before and after the pass on the same inputs, and the results must have the same bits: special
values (NaN payloads of both signs, +-inf, +-0, subnormals, i32 limits) included, for every
element type and with broadcasting.

One exception, stated where it applies: numpy does not fix which NaN an add or a multiply of two
NaNs returns (its vector loops swap the operands of commutative ops, so the answer depends on the
array's length, alignment and layout). Where two NaNs meet in an add or a multiply (also inside
silu, and in sums) the result must be a NaN, of any sign and payload. Every other NaN keeps its
bits, and tests below check that separately.

matmul: the simulator runs `tcp.contract` through the reference's own routine, so a lowered
matmul is bit-identical too; the tolerance a chip's accumulation order is allowed
(`runtime_sim.semantics.tolerance.ULPS`) is tested against accumulation orders that differ (np.einsum's,
and a strictly sequential one)."""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from xdsl.dialects.builtin import ModuleOp
from xdsl.parser import Parser

import tcpc
from dialects import tcp, tensor_types, tmath, ve
from passes.lowering.lower_math import LowerMathPass
from runtime_sim.semantics.executor import run_function
from runtime_sim.semantics.numerics import GRID_K, contract
from runtime_sim.semantics.tolerance import ULPS
from tcpc.cli import main as tcpc_main
from tcpc.pipelines import PASSES, apply_pipeline, make_context, parse_pipeline
from support import bits

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.moe"))
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"bf16": BF16, "f32": np.dtype(np.float32), "i32": np.dtype(np.int32)}
FLOATS = ("bf16", "f32")
LOWERED_DIALECTS = {"func", "tcp", "ve", "builtin", "moe"}


# ---------------------------------------------------------------------------------------------
# Building one-op functions and running them before and after the pass


def ttype(shape: tuple[int, ...], dtype: str) -> str:
    return "tensor<" + "".join(f"{d}x" for d in shape) + f"{dtype}>"


Arg = tuple[str, tuple[int, ...], str]
"""A name, a shape and an element type."""


def function(args: list[Arg], body: list[str], result: Arg) -> str:
    """`func.func @f` with the given arguments, body lines and one result (name, shape, dtype)."""
    params = ", ".join(f"%{n}: {ttype(s, d)}" for n, s, d in args)
    name, shape, dtype = result
    lines = [f"func.func @f({params}) -> {ttype(shape, dtype)} {{", *(f"  {b}" for b in body),
             f"  func.return %{name} : {ttype(shape, dtype)}", "}"]
    return "\n".join(lines)


@cache
def modules(text: str) -> tuple[ModuleOp, ModuleOp]:
    before = Parser(make_context(), text).parse_module()
    before.verify()
    after = apply_pipeline(before, parse_pipeline("lower-math"))
    assert not [op for op in after.walk() if op.dialect_name() == "tmath"]
    return before, after



def is_nan(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return np.isnan(a.astype(np.float32)) if a.dtype in (BF16, np.dtype(np.float32)) else np.zeros(a.shape, bool)


def assert_same(text: str, inputs: list[np.ndarray], any_nan: np.ndarray | bool = False) -> np.ndarray:
    """Run before and after lowering; the results must have the same bits, except that where
    `any_nan` holds (two NaNs met in an add or multiply) any NaN will do."""
    before, after = modules(text)
    (want,) = run_function(before, "f", inputs)
    (got,) = run_function(after, "f", inputs)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    same = bits(got) == bits(want)
    loose = np.broadcast_to(any_nan, want.shape) & is_nan(want) & is_nan(got)
    bad = ~(same | loose)
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.size} differ\n{text}\ninputs {inputs!r}\n"
        f"want {bits(want)[bad][:8]} got {bits(got)[bad][:8]}")
    return want


# ---------------------------------------------------------------------------------------------
# Values: special ones mixed with ordinary ones

F32_SPECIAL = np.array(
    [0x7FC00000, 0xFFC00000, 0x7FC00123, 0xFF812345, 0x7F800001, 0x7F800000, 0xFF800000, 0x00000000,
     0x80000000, 0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF,
     0x3F800000, 0xBF800000, 0x3F800001, 0x3F808000, 0x3F818000, 0x4B800001, 0xCF000000, 0x4F000000],
    dtype=np.uint32).view(np.float32)
BF16_SPECIAL = np.array(
    [0x7FC0, 0xFFC0, 0x7FC1, 0xFF81, 0x7F81, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x8001, 0x007F,
     0x807F, 0x0080, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80, 0x3F81, 0xC2F7, 0x4F00],
    dtype=np.uint16).view(ml_dtypes.bfloat16)
I32_SPECIAL = np.array([-(2**31), -(2**31) + 1, -(2**24) - 1, -1, 0, 1, 2, 2**24 + 1, 2**31 - 2, 2**31 - 1, 7, -7],
                       dtype=np.int32)
SPECIAL = {"bf16": BF16_SPECIAL, "f32": F32_SPECIAL, "i32": I32_SPECIAL}


def values(shape: tuple[int, ...], dtype: str, rng: np.random.Generator, special: float = 0.4) -> np.ndarray:
    if dtype == "i32":
        ordinary = rng.integers(-5, 6, size=shape).astype(np.int32)
    else:
        ordinary = (rng.standard_normal(shape) * 3).astype(np.float32).astype(DTYPES[dtype])
    pool = SPECIAL[dtype]
    picked = pool[rng.integers(0, len(pool), size=shape)]
    return np.where(rng.random(shape) < special, picked, ordinary).astype(DTYPES[dtype])


def both_nan(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return is_nan(a) & is_nan(b)


# ---------------------------------------------------------------------------------------------
# Shapes that broadcast


@st.composite
def broadcast_pair(draw: st.DrawFn, max_rank: int = 3) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Two shapes that broadcast: each drops some leading axes and sets some axes to 1."""
    shape = tuple(draw(st.lists(st.integers(1, 4), max_size=max_rank)))

    def operand() -> tuple[int, ...]:
        dropped = draw(st.integers(0, len(shape)))
        return tuple(1 if draw(st.booleans()) else d for d in shape[dropped:])

    return operand(), operand()


BINARY_OPS = ("add", "sub", "mul", "div", "maximum", "minimum")
DTYPE_PAIRS = (("bf16", "bf16"), ("f32", "f32"), ("bf16", "f32"), ("f32", "bf16"), ("i32", "i32"))


def promoted(a: str, b: str) -> str:
    return a if a == b else "f32"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(broadcast_pair(), st.sampled_from(BINARY_OPS), st.sampled_from(DTYPE_PAIRS), st.integers(0, 2**32 - 1))
def test_binary_ops_with_broadcasting(shapes: tuple, name: str, dtypes: tuple[str, str], seed: int) -> None:
    (sa, sb), (da, db) = shapes, dtypes
    if name == "div" and da == "i32":
        da, db = "f32", "f32"
    out, dt = tensor_types.broadcast_shapes(sa, sb), promoted(da, db)
    text = function([("a", sa, da), ("b", sb, db)],
                    [f"%r = tmath.{name} %a, %b : ({ttype(sa, da)}, {ttype(sb, db)}) -> {ttype(out, dt)}"],
                    ("r", out, dt))
    rng = np.random.default_rng(seed)
    a, b = values(sa, da, rng), values(sb, db, rng)
    meet = both_nan(*np.broadcast_arrays(a, b)) if name in ("add", "mul") else False
    assert_same(text, [a, b], meet)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(broadcast_pair(), st.sampled_from(BINARY_OPS), st.sampled_from(["bf16", "f32", "i32"]),
       st.sampled_from([0.0, -0.0, 1.5, -7.0, 1.702, 1e-20, math.inf, -math.inf, 3.4e38, 2**31 - 1]),
       st.booleans(), st.integers(0, 2**32 - 1))
def test_constant_operands_become_splats(shapes: tuple, name: str, dtype: str, c: float, left: bool, seed: int) -> None:
    """A scalar constant, rounded to its type as the reference rounds it, on either side."""
    if dtype == "i32" and (name == "div" or not math.isfinite(c) or c != int(c) or abs(c) > 2**31):
        dtype = "f32"
    shape = shapes[0]
    const = tensor_types.float_literal(c) if math.isfinite(c) else ("inf" if c > 0 else "-inf")
    lhs, rhs = ("%c", "%a") if left else ("%a", "%c")
    tl, tr = (ttype((), dtype), ttype(shape, dtype)) if left else (ttype(shape, dtype), ttype((), dtype))
    text = function([("a", shape, dtype)], [
        f"%c = tmath.constant {const} : {ttype((), dtype)}",
        f"%r = tmath.{name} {lhs}, {rhs} : ({tl}, {tr}) -> {ttype(shape, dtype)}"], ("r", shape, dtype))
    assert_same(text, [values(shape, dtype, np.random.default_rng(seed))])
    _, after = modules(text)
    assert not [op for op in after.walk() if isinstance(op, ve.BroadcastOp)]  # a splat of the right shape


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(broadcast_pair(), st.sampled_from(tmath.CMP_PREDICATES), st.sampled_from(DTYPE_PAIRS),
       st.sampled_from(DTYPE_PAIRS), st.integers(0, 2**32 - 1))
def test_cmp_and_where_with_broadcasting(shapes: tuple, predicate: str, cmp_types: tuple[str, str],
                                         branch_types: tuple[str, str], seed: int) -> None:
    """where(a <pred> b, x, y): the i1 becomes a tag stream, broadcast with the branches."""
    (sa, sb), (da, db), (dx, dy) = shapes, cmp_types, branch_types
    cond = tensor_types.broadcast_shapes(sa, sb)
    sx, sy = sb, sa  # the branches broadcast too
    out, dt = tensor_types.broadcast_shapes(cond, sx, sy), promoted(dx, dy)
    text = function([("a", sa, da), ("b", sb, db), ("x", sx, dx), ("y", sy, dy)], [
        f'%c = tmath.cmp "{predicate}", %a, %b : ({ttype(sa, da)}, {ttype(sb, db)}) -> {ttype(cond, "i1")}',
        f"%r = tmath.select %c, %x, %y : ({ttype(cond, 'i1')}, {ttype(sx, dx)}, {ttype(sy, dy)}) -> {ttype(out, dt)}",
    ], ("r", out, dt))
    rng = np.random.default_rng(seed)
    assert_same(text, [values(sa, da, rng), values(sb, db, rng), values(sx, dx, rng), values(sy, dy, rng)])


UNARY_OPS = ("neg", "abs", "exp", "log", "sqrt", "tanh", "sigmoid", "silu")
"""The unary-op tests below check the lanes path: a bf16 operand is widened to f32 (exact), the
op runs on the f32 lane, and the result is narrowed to bf16 (round to nearest even); f32 runs
on the lane as it is, and i32 neg and abs take the integer path. Their bits must be the
reference's, which rounds each op's f32 result to its type the same way."""


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 5), max_size=3), st.sampled_from(UNARY_OPS), st.sampled_from(["bf16", "f32", "i32"]),
       st.integers(0, 2**32 - 1))
def test_unary_ops(shape: list[int], name: str, dtype: str, seed: int) -> None:
    """Random shapes and values, specials mixed in: widen / op / narrow for bf16, the lane for f32."""
    if dtype == "i32" and name not in ("neg", "abs"):
        dtype = "f32"
    s = tuple(shape)
    text = function([("a", s, dtype)], [f"%r = tmath.{name} %a : {ttype(s, dtype)} -> {ttype(s, dtype)}"],
                    ("r", s, dtype))
    a = values(s, dtype, np.random.default_rng(seed))
    assert_same(text, [a], is_nan(a) if name == "silu" else False)  # silu multiplies x by sigmoid(x)


def test_neg_and_abs_keep_every_nan_and_zero_bit() -> None:
    """Bit operations, as numpy's negative and abs do to every f32 (bf16 NaNs then narrow)."""
    for dtype, pool in (("f32", F32_SPECIAL), ("bf16", BF16_SPECIAL)):
        s = (len(pool),)
        for name in ("neg", "abs"):
            text = function([("a", s, dtype)], [f"%r = tmath.{name} %a : {ttype(s, dtype)} -> {ttype(s, dtype)}"],
                            ("r", s, dtype))
            want = assert_same(text, [pool])
            if dtype == "f32":
                mask = 0x80000000 if name == "neg" else 0x7FFFFFFF
                expected = bits(pool) ^ mask if name == "neg" else bits(pool) & mask
                assert np.array_equal(bits(want), expected)


def test_every_bf16_through_unary_and_binary_ops() -> None:
    """All 65536 bf16 patterns through each unary op and, paired with a shuffle, each binary op:
    the widen / f32 op / narrow path on every bf16 input there is."""
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16)
    other = np.random.default_rng(3).permutation(every)
    s, t = (1 << 16,), ttype((1 << 16,), "bf16")
    for name in UNARY_OPS:
        text = function([("a", s, "bf16")], [f"%r = tmath.{name} %a : {t} -> {t}"], ("r", s, "bf16"))
        assert_same(text, [every], is_nan(every) if name == "silu" else False)
    for name in BINARY_OPS:
        text = function([("a", s, "bf16"), ("b", s, "bf16")], [f"%r = tmath.{name} %a, %b : ({t}, {t}) -> {t}"],
                        ("r", s, "bf16"))
        assert_same(text, [every, other], both_nan(every, other) if name in ("add", "mul") else False)


# ---------------------------------------------------------------------------------------------
# Softmax and reductions


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 6), min_size=1, max_size=3), st.data(), st.sampled_from(FLOATS),
       st.floats(0, 0.5), st.integers(0, 2**32 - 1))
def test_softmax(shape: list[int], data: st.DataObject, dtype: str, special: float, seed: int) -> None:
    s = tuple(shape)
    axis = data.draw(st.integers(0, len(s) - 1))
    op = f"%r = tmath.softmax %a {{axis = {axis} : i64}} : {ttype(s, dtype)} -> {ttype(s, dtype)}"
    text = function([("a", s, dtype)], [op], ("r", s, dtype))
    a = values(s, dtype, np.random.default_rng(seed), special)
    # A NaN or inf in a line makes NaNs that meet in the sum.
    assert_same(text, [a], np.any(~np.isfinite(a.astype(np.float32)), axis=axis, keepdims=True))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 5), max_size=4), st.data(), st.sampled_from(["sum", "max", "min"]),
       st.sampled_from(["bf16", "f32", "i32"]), st.booleans(), st.integers(0, 2**32 - 1))
def test_reductions_over_several_axes(shape: list[int], data: st.DataObject, kind: str, dtype: str,
                                      keepdims: bool, seed: int) -> None:
    s = tuple(shape)
    axes = sorted(data.draw(st.sets(st.integers(0, len(s) - 1), max_size=len(s))) if s else [])
    out = tensor_types.reduced_shape(s, axes, keepdims)
    props = f"axes = array<i64{': ' if axes else ''}{', '.join(map(str, axes))}>" + (", keepdims" if keepdims else "")
    op = f"%r = tmath.reduce_{kind} %a {{{props}}} : {ttype(s, dtype)} -> {ttype(out, dtype)}"
    text = function([("a", s, dtype)], [op], ("r", out, dtype))
    a = values(s, dtype, np.random.default_rng(seed))
    meet = np.sum(is_nan(a), axis=tuple(axes), keepdims=keepdims) > 1 if kind == "sum" else False
    assert_same(text, [a], meet)
    _, after = modules(text)
    assert len([op for op in after.walk() if isinstance(op, ve.ReduceOp)]) == len(axes)


def test_max_of_signed_zeros_and_nan_payloads_over_several_axes() -> None:
    """numpy's own np.max over several axes picks among +-0 and NaN payloads by its vector
    loops; every level folds left to right, one axis at a time, so the bits agree."""
    rng = np.random.default_rng(5)
    zeros = np.where(rng.random((3, 48)) < 0.5, np.float32(0.0), np.float32(-0.0)).astype(np.float32)
    nans = zeros.copy()
    nans[1, 40], nans[2, 7] = np.uint32(0x7FC00042).view(np.float32), np.uint32(0xFFC00007).view(np.float32)
    for kind in ("max", "min"):
        for x in (zeros, nans):
            text = function([("a", x.shape, "f32")], [
                f"%r = tmath.reduce_{kind} %a {{axes = array<i64: 0, 1>}} : {ttype(x.shape, 'f32')} -> tensor<f32>"],
                ("r", (), "f32"))
            assert_same(text, [x])


# ---------------------------------------------------------------------------------------------
# Reshape, casts, one_hot, take


def test_reshape_is_a_view_of_values_and_of_booleans() -> None:
    text = function([("a", (2, 6), "bf16"), ("b", (3, 4), "f32")], [
        '%c = tmath.cmp "lt", %a, %a : (tensor<2x6xbf16>, tensor<2x6xbf16>) -> tensor<2x6xi1>',
        "%v = tmath.reshape %c : tensor<2x6xi1> -> tensor<3x4xi1>",
        "%w = tmath.reshape %a : tensor<2x6xbf16> -> tensor<3x4xbf16>",
        "%r = tmath.select %v, %w, %b : (tensor<3x4xi1>, tensor<3x4xbf16>, tensor<3x4xf32>) -> tensor<3x4xf32>",
    ], ("r", (3, 4), "f32"))
    rng = np.random.default_rng(0)
    assert_same(text, [values((2, 6), "bf16", rng), values((3, 4), "f32", rng)])
    _, after = modules(text)
    views = [op for op in after.walk() if isinstance(op, tcp.ViewOp)]
    assert {str(op.result.type) for op in views} >= {"tensor<3x4xi4>", "tensor<3x4xbf16>"}


CASTS = [(a, b) for a in ("bf16", "f32", "i32") for b in ("bf16", "f32", "i32")]


@pytest.mark.parametrize("source,target", CASTS, ids=[f"{a}-{b}" for a, b in CASTS])
def test_casts(source: str, target: str) -> None:
    x = np.concatenate([SPECIAL[source], values((64,), source, np.random.default_rng(1))])
    if source == "f32":
        x = np.concatenate([x, np.float32([2.5, -2.5, 3e9, -3e9, 2**31, -(2**31), 0.999])])
    s = x.shape
    text = function([("a", s, source)], [f"%r = tmath.cast %a : {ttype(s, source)} -> {ttype(s, target)}"],
                    ("r", s, target))
    assert_same(text, [x])
    _, after = modules(text)
    if source == target:  # the cast disappears
        assert [op.name for op in after.walk()][2:] == ["func.return"]


@pytest.mark.parametrize("target", ["bf16", "f32", "i32"])
def test_cast_of_booleans(target: str) -> None:
    s = (3, 5)
    text = function([("a", s, "f32"), ("b", (5,), "f32")], [
        f'%c = tmath.cmp "ge", %a, %b : ({ttype(s, "f32")}, tensor<5xf32>) -> {ttype(s, "i1")}',
        f"%r = tmath.cast %c : {ttype(s, 'i1')} -> {ttype(s, target)}"], ("r", s, target))
    rng = np.random.default_rng(2)
    want = assert_same(text, [values(s, "f32", rng), values((5,), "f32", rng)])
    assert set(np.unique(want.astype(np.float32))) <= {0.0, 1.0}


def test_i32_to_bf16_rounds_twice_like_the_reference() -> None:
    """ml_dtypes converts i32 to bf16 through f32 (two roundings), and so does the lowered
    cast (fxp_to_fp, narrow): near every bf16 tie between 2^24 and 2^31, both agree, and both
    differ from a single correct rounding where the first rounding makes a tie."""
    ties = [(1 << e) + (2 * m + 1) * (1 << (e - 8)) for e in range(24, 31) for m in range(0, 256, 5)]
    near = np.array([t + d for t in ties for d in (-65, -1, 0, 1, 2, 63, 64, 65) if t + d < 2**31], dtype=np.int64)
    x = np.concatenate([near, -near, [2**31 - 1, -(2**31), 2**24 + 2**16 + 1]]).astype(np.int32)
    s = x.shape
    text = function([("a", s, "i32")], [f"%r = tmath.cast %a : {ttype(s, 'i32')} -> {ttype(s, 'bf16')}"],
                    ("r", s, "bf16"))
    want = assert_same(text, [x])
    assert float(want[-1]) == 2.0**24  # one correct rounding would give 2^24 + 2^17


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 4), max_size=2), st.integers(1, 9), st.integers(0, 2**32 - 1))
def test_one_hot(shape: list[int], depth: int, seed: int) -> None:
    s = tuple(shape)
    text = function([("i", s, "i32")], [f"%r = tmath.one_hot %i : {ttype(s, 'i32')} -> {ttype((*s, depth), 'i32')}"],
                    ("r", (*s, depth), "i32"))
    idx = np.random.default_rng(seed).integers(-2, depth + 2, size=s).astype(np.int32)  # out of range: zero rows
    assert_same(text, [idx])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 3), max_size=2), st.integers(1, 9), st.integers(1, 6),
       st.sampled_from(["bf16", "f32", "i32"]), st.integers(0, 2**32 - 1))
def test_take_along_the_last_axis(lead: list[int], n: int, m: int, dtype: str, seed: int) -> None:
    xs, ids = (*lead, n), (*lead, m)
    text = function([("x", xs, dtype), ("i", ids, "i32")],
                    [f"%r = tmath.take %x, %i : ({ttype(xs, dtype)}, {ttype(ids, 'i32')}) -> {ttype(ids, dtype)}"],
                    ("r", ids, dtype))
    rng = np.random.default_rng(seed)
    idx = rng.integers(-n, n, size=ids).astype(np.int32)  # negative indices count from the end
    assert_same(text, [values(xs, dtype, rng, special=0.6), idx])


def test_take_returns_every_bit_pattern() -> None:
    """-0.0 (whose bits are INT_MIN, the fill), NaN payloads, signalling NaNs and bf16 bits."""
    for dtype, pool in SPECIAL.items():
        x = np.broadcast_to(pool, (2, len(pool))).copy()
        idx = np.stack([np.arange(len(pool)), np.arange(len(pool)) - len(pool)]).astype(np.int32)
        s, t = x.shape, ttype(x.shape, "i32")
        text = function([("x", s, dtype), ("i", s, "i32")],
                        [f"%r = tmath.take %x, %i : ({ttype(s, dtype)}, {t}) -> {ttype(s, dtype)}"], ("r", s, dtype))
        got = assert_same(text, [x, idx])
        assert np.array_equal(bits(got), bits(x))


# ---------------------------------------------------------------------------------------------
# matmul


MATMUL_SHAPES = [
    ((16, 64), (64, 16)), ((1, 8), (8, 3)), ((4, 1), (1, 5)), ((2, 3, 4), (4, 5)), ((4, 5), (2, 5, 3)),
    ((2, 1, 3, 4), (5, 4, 2)), ((1, 3, 4), (6, 4, 2)), ((3, 1, 2, 8), (1, 4, 8, 2)),
]


@pytest.mark.parametrize("lhs,rhs", MATMUL_SHAPES)
@pytest.mark.parametrize("dtypes", [("bf16", "bf16"), ("f32", "f32"), ("bf16", "f32")])
def test_matmul_is_bit_identical_in_the_simulator(lhs: tuple, rhs: tuple, dtypes: tuple[str, str]) -> None:
    dl, dr = dtypes
    out, dt = tensor_types.matmul_shape(lhs, rhs), promoted(dl, dr)
    text = function([("a", lhs, dl), ("b", rhs, dr)],
                    [f"%r = tmath.matmul %a, %b : ({ttype(lhs, dl)}, {ttype(rhs, dr)}) -> {ttype(out, dt)}"],
                    ("r", out, dt))
    rng = np.random.default_rng(0)
    a = rng.standard_normal(lhs).astype(np.float32).astype(DTYPES[dl])
    b = rng.standard_normal(rhs).astype(np.float32).astype(DTYPES[dr])
    assert_same(text, [a, b])
    _, after = modules(text)
    (contraction,) = [op for op in after.walk() if isinstance(op, tcp.ContractOp)]
    assert str(contraction.result.type) == ttype(out, dt)  # rounded once, to the result type


def test_matmul_batch_broadcast_spec() -> None:
    assert tcp.matmul_contraction((2, 1, 3, 4), (5, 4, 2)) == ("amk,bkn->abmn", (2, 3, 4), (5, 4, 2))
    assert tcp.matmul_contraction((4, 5), (2, 5, 3)) == ("mk,akn->amn", (4, 5), (2, 5, 3))
    assert tcp.matmul_contraction((1, 3, 4), (1, 4, 2)) == ("amk,akn->amn", (1, 3, 4), (1, 4, 2))


def matmul_tolerance(a: np.ndarray, b: np.ndarray, want: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """ULPS ulps of the output type at S = sum_k |a_k b_k| (f32: 2 K ulps), plus one
    ulp at the result for the final rounding."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    scale = np.matmul(np.abs(a64), np.abs(b64))
    k = a.shape[-1]
    ulps = ULPS if dtype == BF16 else 2 * k

    def ulp(v: np.ndarray) -> np.ndarray:
        v = np.abs(v).astype(np.float32)
        if dtype == BF16:
            return np.spacing(v.astype(BF16).astype(np.float32)).astype(np.float64) * 2.0**16
        return np.spacing(v).astype(np.float64)

    return ulps * ulp(scale) + ulp(want.astype(np.float64))


def sequential_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    acc = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for k in range(a.shape[1]):
        acc = acc + a[:, k:k + 1] * b[k:k + 1, :]
    return acc


@pytest.mark.parametrize("m,k,n", [(16, 64, 16), (16, 64, 128), (4, 2048, 8), (3, 7, 5)])
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_other_accumulation_orders_are_within_the_stated_tolerance(m: int, k: int, n: int, dtype: str) -> None:
    """The chip accumulates in its own order; np.einsum and a strictly sequential sum are two
    other orders, and must lie within ULPS of the reference (which they do not match
    bit for bit: that is why the simulator shares the reference's routine)."""
    rng = np.random.default_rng(k)
    a = rng.standard_normal((m, k)).astype(np.float32).astype(DTYPES[dtype]).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32).astype(DTYPES[dtype]).astype(np.float32)
    want = contract("mk,kn->mn", a, b).astype(DTYPES[dtype])
    if k <= GRID_K:  # one chunk of the grid: one np.matmul
        assert np.array_equal(bits(np.matmul(a, b).astype(DTYPES[dtype])), bits(want))
    tolerance = matmul_tolerance(a, b, want, DTYPES[dtype])
    for other in (np.einsum("mk,kn->mn", a, b), sequential_matmul(a, b)):
        got = other.astype(DTYPES[dtype])
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        assert (diff <= tolerance).all(), float((diff / tolerance).max())
    if dtype == "f32" and k >= 64:
        assert not np.array_equal(bits(np.einsum("mk,kn->mn", a, b)), bits(np.matmul(a, b)))


# ---------------------------------------------------------------------------------------------
# The pass, the examples, the CLI


def test_registered_and_no_tmath_left() -> None:
    assert PASSES["lower-math"]() is LowerMathPass
    text = function([("a", (2, 3), "bf16")], [
        "%c = tmath.constant 2.5 : tensor<bf16>",
        "%r = tmath.reshape %c : tensor<bf16> -> tensor<1x1xbf16>",
        "%s = tmath.mul %a, %r : (tensor<2x3xbf16>, tensor<1x1xbf16>) -> tensor<2x3xbf16>",
    ], ("s", (2, 3), "bf16"))
    assert_same(text, [values((2, 3), "bf16", np.random.default_rng(0))])
    _, after = modules(text)
    assert {op.dialect_name() for op in after.walk()} <= LOWERED_DIALECTS


def test_a_boolean_that_is_not_a_comparison_is_reported() -> None:
    text = function([("c", (2,), "i1"), ("a", (2,), "f32")],
                    ["%r = tmath.select %c, %a, %a : (tensor<2xi1>, tensor<2xf32>, tensor<2xf32>) -> tensor<2xf32>"],
                    ("r", (2,), "f32"))
    module = Parser(make_context(), text).parse_module()
    with pytest.raises(Exception, match="a boolean must come from tmath.cmp"):
        apply_pipeline(module, parse_pipeline("lower-math"))


@cache
def compiled(path: Path) -> tcpc.Program:
    return tcpc.compile_file(path)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_lowers_to_func_tcp_ve_and_moe(path: Path) -> None:
    # lower-quant takes the low-precision examples' lowp ops (a no-op elsewhere)
    lowered = compiled(path).lower("lower-topk,lower-quant,lower-math")
    assert {op.dialect_name() for op in lowered.walk()} <= LOWERED_DIALECTS


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_after_lower_math_equals_its_reference(path: Path) -> None:
    """Bit-identical, matmuls included: the simulator contracts with the reference's routine,
    so no top-k choice can flip on a last-bit difference."""
    program = compiled(path)
    for graph in program.graph_names:
        for seed in (0, 1):
            ref = program.run(seed=seed, graph=graph)
            got = program.run(seed=seed, graph=graph, reference=False, pipeline="lower-topk,lower-math")
            assert len(got.outputs) == len(ref.outputs)
            for g, w in zip(got.outputs, ref.outputs):
                assert g.dtype == w.dtype and np.array_equal(bits(g), bits(w))


def test_cli_compile_and_check_after_lower_math(capsys: pytest.CaptureFixture[str]) -> None:
    example = str(ROOT / "examples" / "mixtral.moe")
    assert tcpc_main(["compile", example, "-p", "lower-topk,lower-math"]) == 0
    ir = capsys.readouterr().out
    assert "tmath." not in ir and "tcp.contract" in ir and "ve.exp" in ir
    assert tcpc_main(["run", example, "-p", "lower-topk,lower-math", "--check"]) == 0
    assert "check: outputs equal the reference" in capsys.readouterr().out
