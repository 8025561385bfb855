"""`lower-quant`: the graph-level `lowp` ops become vector-engine and contraction commands.

- `lowp.quantize %x {group = g}` (x [..., N], bf16 or f32) -> per group of g along the last
  axis, in f32 lanes: a `tcp.view` as [..., N / g, g], `ve.widen` (bf16), |x| by clearing the
  sign bit (`ve.and` 0x7fffffff on the bits), `ve.reduce_max` over the group (`amax`),
  `ve.max` with eps and `ve.div` by the type's largest finite value (`scales`), then x
  (widened again) divided by its group's scale (`ve.broadcast` + `ve.div`) and
  `ve.narrow_low`, the cast engine's saturating conversion (`values`). One widen per stream
  that reads x: each is the fetch cast of its own chain (fuse-ve-chains), so no f32 copy of x
  is written to SRAM and read back.
- `lowp.dequantize %v, %s` -> `ve.widen_low` of the values (and of e8m0 scales; bf16 scales
  `ve.widen`), the scales repeated over their blocks (`ve.broadcast` + `tcp.view` per blocked
  axis, free views; `ve.repeat` along an axis whose last block is ragged), one `ve.mul`. u3
  codes become their grid's values by `ve.lookup` (the grid widened to f32 and broadcast to a
  table per row of codes, a free view, so that a loop over blocks reads its block's) instead
  of the widening; sign vectors su [..., K] and sv [..., N] are broadcast over N and K and multiply
  in that order (`ve.mul` each).
- `lowp.scaled_matmul %x, %w scales %xs, %ws` -> `tcp.scaled_contract` on [1, M, K] and
  [1, K, N] views, then `ve.narrow` to bf16.

Each step is the operation `runtime_sim/semantics/quantization.py` performs, in its order, so
the lowered ops give the reference's bits (checked by tests/test_quant.py). Every op
takes the phase of the quantized value's first user that has one, looking through users that
have none (the bf16 rounding of a decoded weight, before lower-math): `experts` for what feeds
a grouped matmul, else `other`.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
from xdsl.context import Context
from xdsl.dialects.builtin import BFloat16Type, ModuleOp, TensorType, f32, i32
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass
from xdsl.pattern_rewriter import (
    GreedyRewritePatternApplier,
    PatternRewriter,
    PatternRewriteWalker,
    RewritePattern,
    op_type_rewrite_pattern,
)

from dialects import lowp, tcp, ve
from dialects.annotations import OTHER, mark, phase_of
from dialects.tensor_types import block_shape, shape_of
from passes.lowering._builder import LoweringBuilder, element_of
from runtime_sim.semantics.numerics import numpy_dtype
from runtime_sim.semantics.quantization import QUANTIZE_EPS


class _Emitter(LoweringBuilder):
    def to_f32(self, x: SSAValue, name: str | None = None) -> SSAValue:
        """x in f32 lanes: bf16 widens, stored low-precision values and e8m0 scales widen through
        the cast path; f32 is already there. All exact."""
        et = element_of(x)
        if et == f32:
            return x
        if isinstance(et, BFloat16Type):
            return self.widen(x, name)
        return self.emit(ve.WidenLowOp(x, TensorType(f32, list(shape_of(x.type)))), name)

    def repeat(self, x: SSAValue, axis: int, times: int, name: str | None = None) -> SSAValue:
        """Each element of `axis` repeated `times` times: a broadcast along a new axis just
        after it, viewed back with `axis` `times` as long (both free)."""
        if times == 1:
            return x
        shape = list(shape_of(x.type))
        tiled = self.broadcast(x, axis + 1, times, "tiled")
        return self.view(tiled, [*shape[:axis], shape[axis] * times, *shape[axis + 1:]], name or "repeated")

    def expand_scales(self, scales: SSAValue, shape: tuple[int, ...], name: str,
                      block: tuple[int, ...] | None = None) -> SSAValue:
        """Scales in f32 lanes, one per element of a tensor of `shape` (each over its block:
        `block`, whose last block along an axis may be cut, or shape / scales exactly)."""
        x = self.to_f32(scales, f"{name}_f32")
        block = block or block_shape(shape, shape_of(scales.type))
        assert block is not None
        for axis, times in enumerate(block):
            if shape[axis] % times:
                x = self.emit(ve.RepeatOp(x, axis, times, shape[axis]), "repeated")
            else:
                x = self.repeat(x, axis, times)
        x.name_hint = name
        return x


def lower_quantize(op: lowp.QuantizeOp) -> tuple[list[Operation], list[SSAValue]]:
    shape = shape_of(op.input.type)
    g = op.group_size
    grouped_shape = [*shape[:-1], shape[-1] // g, g]
    last = len(grouped_shape) - 1
    dtype = numpy_dtype(op.values.type.get_element_type())
    e = _Emitter()
    groups = e.view(op.input, grouped_shape, "x_groups")
    x = e.to_f32(groups, "x_f32")
    magnitude = e.bitcast(e.binary(ve.AndOp, e.bitcast(x, i32), 0x7FFFFFFF), f32, "x_abs")
    amax = e.reduce(ve.ReduceMaxOp, magnitude, last, "amax")
    floor = e.binary(ve.MaxOp, amax, float(QUANTIZE_EPS), "amax_floor")
    scales = e.binary(ve.DivOp, floor, float(ml_dtypes.finfo(dtype).max), op.scales.name_hint or "scales")
    again = e.to_f32(groups, "x_f32_again")
    scaled = e.binary(ve.DivOp, again, e.broadcast(scales, last, g), "x_scaled")
    values = e.emit(ve.NarrowLowOp(scaled, TensorType(op.values.type.get_element_type(), grouped_shape)), "values_groups")
    return e.ops, [e.view(values, shape, op.values.name_hint or "values"), scales]


def lower_dequantize(op: lowp.DequantizeOp) -> tuple[list[Operation], list[SSAValue]]:
    shape = shape_of(op.values.type)
    name = op.result.name_hint or "dequantized"
    e = _Emitter()
    if op.grid is None:
        values = e.to_f32(op.values, "values_f32")
    else:
        table = e.broadcast(e.to_f32(op.grid, "grid_f32"), 0, shape[0], "grid_rows")  # each row's own: loops take theirs
        values = e.emit(ve.LookupOp(op.values, table), "values_f32")
    scales = e.expand_scales(op.scales, shape, "scales_expanded", op.block_shape)
    real = e.emit(ve.MulOp(values, scales), name if op.su is None and op.sv is None else "scaled")
    if op.su is not None:
        su = e.broadcast(e.to_f32(op.su, "su_f32"), len(shape) - 1, shape[-1], "su_spread")
        real = e.emit(ve.MulOp(real, su), name if op.sv is None else "scaled_su")
    if op.sv is not None:
        sv = e.broadcast(e.to_f32(op.sv, "sv_f32"), len(shape) - 2, shape[-2], "sv_spread")
        real = e.emit(ve.MulOp(real, sv), name)
    return e.ops, [real]


def lower_scaled_matmul(op: lowp.ScaledMatmulOp) -> tuple[list[Operation], list[SSAValue]]:
    (m, _), (_, n) = shape_of(op.input.type), shape_of(op.weight.type)
    e = _Emitter()

    def batch(v: SSAValue, name: str) -> SSAValue:
        return e.view(v, [1, *shape_of(v.type)], name)

    acc = e.emit(tcp.ScaledContractOp(batch(op.input, "x_batch"), batch(op.weight, "w_batch"),
                                      batch(op.input_scales, "x_scales_batch"),
                                      batch(op.weight_scales, "w_scales_batch")), "y_acc")
    y = e.view(acc, [m, n], "y_f32")
    return e.ops, [e.narrow(y, op.result.name_hint or "y") if isinstance(op.result.type.get_element_type(), BFloat16Type) else y]


LOWERINGS = {
    lowp.QuantizeOp: lower_quantize,
    lowp.DequantizeOp: lower_dequantize,
    lowp.ScaledMatmulOp: lower_scaled_matmul,
}


def quant_phase(op: Operation) -> str:
    """The phase of the first user of the op's first result that has one (looking through
    users without one, in order), else `other`."""
    for use in op.results[0].uses:
        user = use.operation
        phase = phase_of(user) or (quant_phase(user) if user.results else OTHER)
        if phase != OTHER:
            return phase
    return OTHER


@dataclass
class LowerQuantPattern(RewritePattern):
    phases: dict[Operation, str]

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: lowp.QuantizeOp | lowp.DequantizeOp | lowp.ScaledMatmulOp,
                          rewriter: PatternRewriter) -> None:
        ops, results = LOWERINGS[type(op)](op)
        mark(ops, self.phases.get(op, OTHER))
        rewriter.replace(op, ops, results)


@dataclass(frozen=True)
class LowerQuantPass(ModulePass):
    """lowp.quantize / dequantize / scaled_matmul -> ve and tcp ops (see the module docstring)."""

    name = "lower-quant"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        phases = {o: quant_phase(o) for o in op.walk() if type(o) in LOWERINGS}
        PatternRewriteWalker(
            GreedyRewritePatternApplier([LowerQuantPattern(phases)], dce_enabled=False),
            apply_recursively=False,
        ).rewrite_module(op)
