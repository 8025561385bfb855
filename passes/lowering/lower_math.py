"""`lower-math`: the graph tensor math (`tmath`) becomes contraction-engine and vector-engine ops.

After this pass no `tmath` op is left: matmuls are `tcp.contract`, reshapes `tcp.view`, and
everything else runs on the vector engine's 32-bit lanes (`ve`), with every rounding point of the
reference (docs/architecture.md#numbers-and-rounding) made explicit:

- Lanes. A bf16 operand enters a lane by `ve.widen` (exact), the op runs in f32, and a bf16
  result leaves by `ve.narrow` (round to nearest even): exactly the reference's "compute in f32,
  round each op's result to its type". f32 and i32 values are lanes already. A `tmath.constant`
  operand becomes a `ve.const` splat of the shape its consumer needs (its value rounded to the
  constant's type first, as the reference rounds it).
- Broadcasting is explicit: one `tcp.view` drops the size-1 axes to be tiled, then one
  `ve.broadcast` per tiled axis.
- Booleans (`i1`, from `tmath.cmp`) become tag streams (`ve.tag`: 1 where true), consumed by
  `ve.select`; a cast of a boolean selects 1 or 0.
- Elementwise: add sub mul div maximum minimum, exp log sqrt tanh sigmoid are one `ve` op each;
  silu is sigmoid then mul (the reference's `x * sigmoid(x)`, unrounded in between); float neg
  and abs are bit operations on the lane (xor 0x80000000, and 0x7fffffff), which is what numpy's
  negative and abs do to every f32, -0.0 and NaN included; i32 neg is 0 - x and abs max(x, 0 - x)
  (both wrap at INT_MIN, as numpy does).
- Softmax along an axis: reduce_max, broadcast, sub, exp, reduce_sum, broadcast, div.
- Reductions over several axes: one `ve.reduce_*` per axis, the last axis first (the reference's
  order), then a `tcp.view` for keepdims.
- Casts: widen / narrow between floats, `fp_to_fxp` (truncate, saturate, NaN to 0) to i32,
  `fxp_to_fp` from i32; i32 -> bf16 is `fxp_to_fp` then `narrow`, two roundings, which is what
  the reference (ml_dtypes) does too: it differs from one correct rounding for some |x| > 2^24
  (2^24 + 2^16 + 1 gives 2^24, not 2^24 + 2^17). A cast to the operand's own type disappears.
- matmul: `tcp.contract` with an einsum spec built from the ranks (`tcp.matmul_contraction`;
  batch axes broadcast by leaving a size-1 axis out of that operand's side), rounded once to
  the result type. The simulator runs `tcp.contract` through the same routine as the reference
  matmul (`runtime_sim.semantics.numerics.contract`), so it gives the reference's bits; the chip
  accumulates in its own order, which is allowed to differ by the tolerance in `runtime_sim/semantics/tolerance.py`.
- one_hot: the index broadcast along a new axis, tagged `eq` against an iota, select 1 / 0.
- take along the last axis: negative indices + N first; then a one-hot tag of [..., M, N]
  against an iota selects the value's 32 bits (INT_MIN elsewhere) and a reduce_max over N picks
  them: an integer max over bit patterns, so -0.0, NaN payloads and bf16 bits come back exactly
  (bf16 leaves by `narrow truncate`, the exact inverse of widen). An index outside [-N, N)
  (an execution error in the reference) gives the bits 0x80000000.

Everything but matmul is bit-identical to the reference, because every level computes the same
f32 operations in the same order (sums and max/min left to right along an axis).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import BFloat16Type, ModuleOp, TensorType, f32, i32
from xdsl.ir import Attribute, Operation, SSAValue
from xdsl.passes import ModulePass
from xdsl.pattern_rewriter import (
    GreedyRewritePatternApplier,
    PatternRewriter,
    PatternRewriteWalker,
    RewritePattern,
    op_type_rewrite_pattern,
)
from xdsl.utils.exceptions import DiagnosticException

from dialects import tcp, tensor_types, tmath, ve
from dialects.annotations import OTHER, is_pair_sum, mark, mark_pair_sum, phase_of
from dialects.tensor_types import is_bool_type, is_float_type, is_int_type, shape_of
from passes.lowering._builder import LoweringBuilder, element_of, lane_type
from runtime_sim.semantics.tmath_semantics import constant_value

INT_MIN = -(2**31)
SIGN_BIT = 0x80000000
MAGNITUDE_BITS = 0x7FFFFFFF

BINARY: dict[type, type[ve.BinaryOp]] = {
    tmath.AddOp: ve.AddOp,
    tmath.SubOp: ve.SubOp,
    tmath.MulOp: ve.MulOp,
    tmath.DivOp: ve.DivOp,
    tmath.MaximumOp: ve.MaxOp,
    tmath.MinimumOp: ve.MinOp,
}

UNARY_FLOAT: dict[type, type[ve.UnaryFloatOp]] = {
    tmath.ExpOp: ve.ExpOp,
    tmath.LogOp: ve.LogOp,
    tmath.SqrtOp: ve.SqrtOp,
    tmath.TanhOp: ve.TanhOp,
    tmath.SigmoidOp: ve.SigmoidOp,
}

REDUCE: dict[type, type[ve.ReduceOp]] = {
    tmath.ReduceSumOp: ve.ReduceSumOp,
    tmath.ReduceMaxOp: ve.ReduceMaxOp,
    tmath.ReduceMinOp: ve.ReduceMinOp,
}


class _Lowering(LoweringBuilder):
    """The ops that compute one `tmath` op's result, in the result's own type."""

    # --- operands and results ----------------------------------------------------------------

    def lanes(self, v: SSAValue, shape: tuple[int, ...]) -> SSAValue:
        """v as 32-bit lanes (bf16 widened), broadcast to `shape`; a constant as a splat."""
        owner = v.owner
        element = element_of(v)
        if isinstance(owner, tmath.ConstantOp):
            value = constant_value(owner)
            lane = lane_type(element)
            return self.const(float(value) if lane == f32 else int(value), shape, lane)
        if isinstance(element, BFloat16Type):
            v = self.widen(v)
        return self.expand(v, shape)

    def tags(self, v: SSAValue, shape: tuple[int, ...]) -> SSAValue:
        """A boolean as its tag stream (the lowered `tmath.cmp`), broadcast to `shape`."""
        if not ve.is_tag_type(element_of(v)):
            raise DiagnosticException(
                f"lower-math: a boolean must come from tmath.cmp, got {tensor_types.format_type(v.type)}")
        return self.expand(v, shape)

    def rounded(self, y: SSAValue, element: Attribute) -> SSAValue:
        """A lane result in the result's type: bf16 is narrowed (round to nearest even)."""
        return self.narrow(y) if isinstance(element, BFloat16Type) else y

    # --- op families --------------------------------------------------------------------------

    def lower_binary(self, op: tmath.ElementwiseBinaryOp) -> SSAValue:
        t = op.result.type
        shape = shape_of(t)
        a, b = self.lanes(op.lhs, shape), self.lanes(op.rhs, shape)
        return self.rounded(self.emit(BINARY[type(op)](a, b)), t.get_element_type())

    def lower_cmp(self, op: tmath.CmpOp) -> SSAValue:
        shape = shape_of(op.result.type)
        return self.emit(ve.TagOp(op.predicate.data, self.lanes(op.lhs, shape), self.lanes(op.rhs, shape)))

    def lower_select(self, op: tmath.SelectOp) -> SSAValue:
        t = op.result.type
        shape = shape_of(t)
        tags = self.tags(op.cond, shape)
        on_true, on_false = self.lanes(op.on_true, shape), self.lanes(op.on_false, shape)
        return self.rounded(self.emit(ve.SelectOp(tags, [1], on_true, on_false)), t.get_element_type())

    def lower_unary(self, op: tmath.ElementwiseUnaryOp) -> SSAValue:
        t = op.result.type
        element = t.get_element_type()
        x = self.lanes(op.input, shape_of(t))
        if is_int_type(element):
            negated = self.emit(ve.SubOp(self.like(0, x), x))
            if isinstance(op, tmath.NegOp):
                return negated
            return self.emit(ve.MaxOp(x, negated))
        if isinstance(op, tmath.NegOp | tmath.AbsOp):
            bits = self.bitcast(x, i32)
            cls, mask = (ve.XorOp, SIGN_BIT) if isinstance(op, tmath.NegOp) else (ve.AndOp, MAGNITUDE_BITS)
            y = self.bitcast(self.emit(cls(bits, self.like(mask, bits))), f32)
        elif isinstance(op, tmath.SiluOp):
            y = self.emit(ve.MulOp(x, self.emit(ve.SigmoidOp(x), "sigmoid")))
        else:
            y = self.emit(UNARY_FLOAT[type(op)](x))
        return self.rounded(y, element)

    def lower_softmax(self, op: tmath.SoftmaxOp) -> SSAValue:
        t = op.result.type
        shape = shape_of(t)
        axis, n = op.axis.value.data, shape[op.axis.value.data]
        x = self.lanes(op.input, shape)
        top = self.broadcast(self.reduce(ve.ReduceMaxOp, x, axis, "row_max"), axis, n)
        e = self.emit(ve.ExpOp(self.emit(ve.SubOp(x, top), "shifted")), "exps")
        total = self.broadcast(self.reduce(ve.ReduceSumOp, e, axis, "row_sum"), axis, n)
        return self.rounded(self.emit(ve.DivOp(e, total)), t.get_element_type())

    def lower_reduce(self, op: tmath.ReduceOp) -> SSAValue:
        t = op.result.type
        x = self.lanes(op.input, shape_of(op.input.type))
        for axis in reversed(op.axis_list):
            x = self.reduce(REDUCE[type(op)], x, axis)
        return self.rounded(self.view(x, shape_of(t)), t.get_element_type())

    def lower_reshape(self, op: tmath.ReshapeOp) -> SSAValue:
        return self.view(op.input, shape_of(op.result.type))

    def lower_cast(self, op: tmath.CastOp) -> SSAValue:
        x = op.input
        source, target = element_of(x), op.result.type.get_element_type()
        if ve.is_tag_type(source):
            lane = lane_type(target)
            one, zero = (1.0, 0.0) if lane == f32 else (1, 0)
            return self.rounded(self.select(x, one, zero, element=lane), target)
        if is_bool_type(source):
            self.tags(x, shape_of(x.type))  # raises: an i1 that is not a lowered comparison
        if source == target:
            return x
        if is_float_type(target):
            if is_float_type(source):  # bf16 <-> f32
                return self.widen(x) if target == f32 else self.narrow(x)
            return self.rounded(self.emit(ve.FxpToFpOp(x, TensorType(f32, list(shape_of(x.type))))), target)
        lanes = self.lanes(x, shape_of(x.type))
        return self.emit(ve.FpToFxpOp(lanes, TensorType(i32, list(shape_of(x.type)))))

    def lower_matmul(self, op: tmath.MatmulOp) -> SSAValue:
        spec, lhs_shape, rhs_shape = tcp.matmul_contraction(shape_of(op.lhs.type), shape_of(op.rhs.type))
        lhs, rhs = self.view(op.lhs, lhs_shape), self.view(op.rhs, rhs_shape)
        return self.emit(tcp.ContractOp(spec, lhs, rhs, op.result.type))

    def lower_one_hot(self, op: tmath.OneHotOp) -> SSAValue:
        shape = shape_of(op.result.type)
        r, depth = len(shape) - 1, shape[-1]
        index = self.broadcast(self.lanes(op.input, shape[:-1]), r, depth)
        hit = self.tag("eq", index, self.iota(shape, r, "position"), "hit")
        return self.select(hit, 1, 0)

    def lower_take(self, op: tmath.TakeOp) -> SSAValue:
        xt, it = op.input.type, op.indices.type
        element = xt.get_element_type()
        xs, ids = shape_of(xt), shape_of(it)
        r, n, m = len(xs), xs[-1], ids[-1]
        index = self.lanes(op.indices, ids)
        wrapped = self.binary(ve.AddOp, index, n)
        index = self.select(self.tag("lt", index, 0, "from_end"), wrapped, index, "index")
        lanes = self.lanes(op.input, xs)
        bits = lanes if element == i32 else self.bitcast(lanes, i32, "bits")
        pairs = (*ids, n)  # [..., M, N]
        hit = self.tag("eq", self.broadcast(index, r, n), self.iota(pairs, r, "position"), "hit")
        picked = self.select(hit, self.broadcast(bits, r - 1, m), INT_MIN)
        y = self.reduce(ve.ReduceMaxOp, picked, r)
        if element == i32:
            return y
        y = self.bitcast(y, f32)
        return self.narrow(y, truncate=True) if isinstance(element, BFloat16Type) else y

    def lower_constant(self, op: tmath.ConstantOp) -> SSAValue:
        t = op.result.type
        return self.rounded(self.lanes(op.result, shape_of(t)), t.get_element_type())


LOWERINGS: dict[type, Callable[[_Lowering, Operation], SSAValue]] = {
    **{cls: _Lowering.lower_binary for cls in BINARY},
    **{cls: _Lowering.lower_unary for cls in (*UNARY_FLOAT, tmath.NegOp, tmath.AbsOp, tmath.SiluOp)},
    **{cls: _Lowering.lower_reduce for cls in REDUCE},
    tmath.CmpOp: _Lowering.lower_cmp,
    tmath.SelectOp: _Lowering.lower_select,
    tmath.SoftmaxOp: _Lowering.lower_softmax,
    tmath.ReshapeOp: _Lowering.lower_reshape,
    tmath.CastOp: _Lowering.lower_cast,
    tmath.MatmulOp: _Lowering.lower_matmul,
    tmath.OneHotOp: _Lowering.lower_one_hot,
    tmath.TakeOp: _Lowering.lower_take,
}
"""Every `tmath` op but the constant, whose consumers take it as a splat (see `LowerConstantPattern`)."""


def lower(op: Operation) -> tuple[list[Operation], SSAValue]:
    """The ops that compute `op`'s result, and the value that replaces it."""
    b = _Lowering()
    fn = _Lowering.lower_constant if isinstance(op, tmath.ConstantOp) else LOWERINGS[type(op)]
    value = fn(b, op)  # type: ignore[arg-type]
    return b.ops, value


def _replace(op: Operation, rewriter: PatternRewriter, phases: dict[Operation, str]) -> None:
    ops, value = lower(op)
    mark(ops, phases.get(op, OTHER))
    if is_pair_sum(op) and isinstance(value.owner, Operation):
        mark_pair_sum(value.owner)  # a sum over pairs stays one (a mesh home chip's sum of returned pairs)
    unnamed = [r for new in ops for r in new.results if r.name_hint is None and r is not value]
    rewriter.replace(op, ops, [value])
    for r in unnamed:  # the rewriter gives every new result the op's name; keep it for the result
        r.name_hint = None


@dataclass
class LowerMathPattern(RewritePattern):
    phases: dict[Operation, str]

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> None:
        if type(op) in LOWERINGS:
            _replace(op, rewriter, self.phases)


@dataclass
class LowerConstantPattern(RewritePattern):
    """A constant still used once its consumers are lowered (by a `moe` op, a reshape, a
    return) becomes a `ve.const` splat, narrowed for bf16."""

    phases: dict[Operation, str]

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tmath.ConstantOp, rewriter: PatternRewriter) -> None:
        _replace(op, rewriter, self.phases)


@dataclass(frozen=True)
class LowerMathPass(ModulePass):
    """tmath -> tcp.contract, tcp.view and ve ops; no tmath op is left."""

    name = "lower-math"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        # Each op's phase (dialects/annotations.py) from its neighbours, before any is rewritten.
        phases = math_phases(op)
        # In program order, so a comparison is a tag stream before its select sees it.
        for pattern in (LowerMathPattern(phases), LowerConstantPattern(phases)):
            PatternRewriteWalker(GreedyRewritePatternApplier([pattern]), apply_recursively=False).rewrite_module(op)


def _is_math(op: Operation) -> bool:
    return op.name.startswith("tmath.")


def math_phases(module: ModuleOp) -> dict[Operation, str]:
    """The phase of every `tmath` op of `module`, from the phases of the ops it connects to
    through other `tmath` ops (see the module docstring)."""
    ops = [op for op in module.walk() if _is_math(op)]
    up: dict[Operation, set[str]] = {}
    for op in ops:  # program order: every producer comes first
        seen: set[str] = set()
        for operand in op.operands:
            owner = operand.owner
            if isinstance(owner, Operation):
                if owner in up:
                    seen |= up[owner]
                elif (p := phase_of(owner)) is not None:
                    seen.add(p)
        up[op] = seen
    down: dict[Operation, set[str]] = {}
    for op in reversed(ops):
        seen = set()
        for result in op.results:
            for use in result.uses:
                user = use.operation
                if user in down:
                    seen |= down[user]
                elif (p := phase_of(user)) is not None:
                    seen.add(p)
        down[op] = seen
    phases: dict[Operation, str] = {}
    for op in ops:
        given = phase_of(op)
        if given is not None:
            phases[op] = given
        elif "experts" in up[op] and "experts" in down[op]:
            phases[op] = "experts"
        elif "router" in up[op] | down[op]:
            phases[op] = "router"
        else:
            phases[op] = OTHER
    return phases
