"""`lowp`: block-scaled low-precision values at the graph level (not upstream MLIR's `quant`).

A quantized tensor is a pair: values in a stored-only type (`f8e4m3`, `f8e5m2`, `f4e2m1`) and
block scales (f32 or e8m0) of the same rank, each scale covering `values / scales` elements
along every axis. DeepSeek-V3's fp8 weights [E, D, F] carry scales [E, D / 128, F / 128];
gpt-oss's MXFP4 weights scales [E, D / 32, F] (e8m0); vLLM's dynamically quantized activations
[T, D] scales [T, D / 128]. `real = f32(value) * scale`, block by block.

- `lowp.quantize` makes such a pair from a float tensor, per group of `group` elements along
  the last axis (vLLM's per-token-group scheme): scale = max(amax, eps) / max_finite, values =
  saturate(x / scale).
- `lowp.dequantize` gives the f32 tensor a pair stands for (for comparison with bf16 layers,
  or, rounded to bf16, as the weight of a bf16 contraction). Its `block` may leave the last
  block along an axis ragged (scales [E, ceil(K / g), N]: FP4 with a float scale per group
  of g along K); u3 codes take their values from a `grid` (8 entries), and the sign vectors
  `su` [..., K], `sv` [..., N] multiply last: the seed's 3-bit trellis format,
  `grid[code] * scale * su[k] * sv[n]`.

The arithmetic of both is `runtime_sim/semantics/quantization.py`, shared by every level.
Contractions of quantized pairs are `moe.scaled_grouped_matmul` and `lowp.scaled_matmul`.
"""

from __future__ import annotations

from collections.abc import Sequence

from xdsl.dialects.builtin import DenseArrayBase, IntegerAttr, IntegerType, TensorType, f32, i64
from xdsl.ir import Attribute, Dialect, SSAValue
from xdsl.irdl import (
    AttrSizedOperandSegments,
    IRDLOperation,
    ParsePropInAttrDict,
    irdl_op_definition,
    operand_def,
    opt_operand_def,
    opt_prop_def,
    prop_def,
    result_def,
    traits_def,
)
from xdsl.traits import Pure

from dialects.tensor_types import (
    block_shape,
    contraction_pair,
    describe_pairs,
    expect,
    format_type,
    is_code_type,
    is_float_type,
    is_low_precision_type,
    is_scale_type,
    scales_shape,
    shape_of,
    type_name,
)

GRID_SIZE = 8
"""Entries of a u3 codebook's grid: one per 3-bit code."""


def check_scales(values: Attribute, scales: Attribute, what: str) -> tuple[int, ...]:
    """The block shape of a quantized pair, or the VerifyException saying why it has none."""
    assert isinstance(values, TensorType) and isinstance(scales, TensorType)
    expect(is_low_precision_type(values.get_element_type()),
           f"{what} values must be f8e4m3, f8e5m2 or f4e2m1, got {format_type(values)}")
    expect(is_scale_type(scales.get_element_type()), f"{what} scales must be f32, bf16 or e8m0, got {format_type(scales)}")
    block = block_shape(shape_of(values), shape_of(scales))
    expect(block is not None,
           f"{what} scales {format_type(scales)} do not divide values {format_type(values)} into blocks "
           "(same rank, each axis of the values a multiple of the scales')")
    return block  # type: ignore[return-value]


def k_block(lhs_block: int, rhs_block: int) -> int | None:
    """The partial-sum length of a block-scaled contraction: the smaller of the two scale
    blocks along the reduced axis, which must divide the larger (so every partial sum has one
    scale per operand), or None."""
    small, large = sorted((lhs_block, rhs_block))
    return small if large % small == 0 else None


def check_pair(lhs: Attribute, rhs: Attribute, what: str) -> None:
    pair = contraction_pair(lhs, rhs)
    expect(pair is not None,
           f"{what} cannot multiply {type_name(lhs)} by {type_name(rhs)}: the contraction engine takes "
           f"matched pairs ({describe_pairs()})")


@irdl_op_definition
class QuantizeOp(IRDLOperation):
    """Per-group quantization along the last axis: for each group of `group` elements,
    scale = max(amax, eps) / max_finite (f32) and values = saturate(x / scale)."""

    name = "lowp.quantize"
    group = prop_def(IntegerAttr[IntegerType])
    input = operand_def(TensorType)
    values = result_def(TensorType)
    scales = result_def(TensorType)
    traits = traits_def(Pure())
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$input attr-dict `:` type($input) `->` type($values) `,` type($scales)"

    def __init__(self, input: SSAValue, element_type: Attribute, group: int):
        shape = shape_of(input.type)
        super().__init__(
            operands=[input],
            result_types=[TensorType(element_type, shape), TensorType(f32, [*shape[:-1], shape[-1] // group])],
            properties={"group": IntegerAttr(group, i64)},
        )

    @property
    def group_size(self) -> int:
        return self.group.value.data

    def verify_(self) -> None:
        t = self.input.type
        shape = shape_of(t)
        g = self.group_size
        expect(is_float_type(t.get_element_type()), f"quantize takes bf16 or f32, got {format_type(t)}")
        expect(len(shape) >= 1 and g >= 1 and shape[-1] % g == 0,
               f"group {g} does not divide the last axis of {format_type(t)}")
        expect(is_low_precision_type(self.values.type.get_element_type())
               and shape_of(self.values.type) == shape, "values must be a low-precision tensor of the input's shape")
        expect(self.scales.type == TensorType(f32, [*shape[:-1], shape[-1] // g]),
               f"scales must be f32 {[*shape[:-1], shape[-1] // g]}")


@irdl_op_definition
class DequantizeOp(IRDLOperation):
    """The real f32 tensor a quantized tensor stands for: f32(value) * the scale of its block,
    in f32; u3 codes take their value from `grid` (grid[code]); then times `su` (one per
    element of the second-to-last axis, the reduction axis K of a weight [..., K, N]) and
    `sv` (one per element of the last axis), in that order. With `block`, scales are
    ceil(values / block) along each axis (a ragged last block has its own scale); without,
    `values / scales` exactly. Semantics: `quantization.dequantize`."""

    name = "lowp.dequantize"
    values = operand_def(TensorType)
    scales = operand_def(TensorType)
    grid = opt_operand_def(TensorType)
    su = opt_operand_def(TensorType)
    sv = opt_operand_def(TensorType)
    block = opt_prop_def(DenseArrayBase.constr(i64))
    result = result_def(TensorType)
    traits = traits_def(Pure())
    irdl_options = (AttrSizedOperandSegments(as_property=True), ParsePropInAttrDict())
    assembly_format = (
        "$values `,` $scales (`grid` $grid^)? (`su` $su^)? (`sv` $sv^)? attr-dict `:` type($values) `,` type($scales) "
        "(`grid` type($grid)^)? (`su` type($su)^)? (`sv` type($sv)^)? `->` type($result)"
    )

    def __init__(self, values: SSAValue, scales: SSAValue, block: Sequence[int] | None = None,
                 grid: SSAValue | None = None, su: SSAValue | None = None, sv: SSAValue | None = None):
        props = {} if block is None else {"block": DenseArrayBase.from_list(i64, list(block))}
        super().__init__(operands=[values, scales, grid, su, sv], result_types=[TensorType(f32, shape_of(values.type))],
                         properties=props)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Elements of `values` one scale covers along each axis (the last block may be cut)."""
        if self.block is not None:
            return tuple(self.block.get_values())
        block = block_shape(shape_of(self.values.type), shape_of(self.scales.type))
        assert block is not None
        return block

    def verify_(self) -> None:
        vt, st = self.values.type, self.scales.type
        vs = shape_of(vt)
        coded = is_code_type(vt.get_element_type())
        expect(coded or is_low_precision_type(vt.get_element_type()),
               f"dequantize values must be f8e4m3, f8e5m2, f4e2m1 or u3, got {format_type(vt)}")
        expect(is_scale_type(st.get_element_type()), f"dequantize scales must be f32, bf16 or e8m0, got {format_type(st)}")
        if self.block is None:
            expect(block_shape(vs, shape_of(st)) is not None,
                   f"dequantize scales {format_type(st)} do not divide values {format_type(vt)} into blocks "
                   "(same rank, each axis of the values a multiple of the scales')")
        else:
            block = tuple(self.block.get_values())
            expect(len(block) == len(vs) and all(b >= 1 for b in block),
                   f"block {list(block)} must have a positive size for each of the {len(vs)} axes of {format_type(vt)}")
            expect(shape_of(st) == scales_shape(vs, block),
                   f"scales {format_type(st)} are not {list(scales_shape(vs, block))}: {format_type(vt)} in blocks of {list(block)}")
        if coded:
            expect(self.grid is not None, f"u3 codes need their grid: {format_type(vt)}")
        if self.grid is not None:
            gt = self.grid.type
            expect(coded, f"a grid decodes u3 codes, not {format_type(vt)}")
            expect(is_float_type(gt.get_element_type()) and shape_of(gt) == (GRID_SIZE,),
                   f"grid must be bf16 or f32 [{GRID_SIZE}], got {format_type(gt)}")
        for name, sign, want in (("su", self.su, vs[:-1]), ("sv", self.sv, (*vs[:-2], *vs[-1:]))):
            if sign is not None:
                expect(len(vs) >= 2 and is_float_type(sign.type.get_element_type()) and shape_of(sign.type) == want,
                       f"{name} must be bf16 or f32 {list(want)}, got {format_type(sign.type)}")
        expect(self.result.type == TensorType(f32, vs), "result must be f32 of the values' shape")


@irdl_op_definition
class ScaledMatmulOp(IRDLOperation):
    """x [M, K] times w [K, N], both block-scaled (x's scales [M, K / kx], w's [K / kw, N / nb]):
    partial sums over each K-block accumulate in f32, are multiplied by the product of their
    two scales and added in K order (see `moe.scaled_grouped_matmul`); the result is bf16."""

    name = "lowp.scaled_matmul"
    input = operand_def(TensorType)
    weight = operand_def(TensorType)
    input_scales = operand_def(TensorType)
    weight_scales = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = (
        "$input `,` $weight `scales` $input_scales `,` $weight_scales attr-dict `:` type($input) `,` "
        "type($weight) `,` type($input_scales) `,` type($weight_scales) `->` type($result)"
    )

    def __init__(self, input: SSAValue, weight: SSAValue, input_scales: SSAValue, weight_scales: SSAValue,
                 result_type: Attribute):
        super().__init__(operands=[input, weight, input_scales, weight_scales], result_types=[result_type])

    def verify_(self) -> None:
        xs, ws = shape_of(self.input.type), shape_of(self.weight.type)
        expect(len(xs) == 2 and len(ws) == 2 and xs[1] == ws[0],
               f"scaled_matmul takes [M, K] and [K, N], got {format_type(self.input.type)} and {format_type(self.weight.type)}")
        check_pair(self.input.type.get_element_type(), self.weight.type.get_element_type(), "scaled_matmul")
        xb = check_scales(self.input.type, self.input_scales.type, "input")
        wb = check_scales(self.weight.type, self.weight_scales.type, "weight")
        expect(xb[0] == 1, "input scales must be per row (one scale per row and K-group)")
        expect(k_block(xb[1], wb[0]) is not None, f"the K-blocks of the scales ({xb[1]} and {wb[0]}) do not nest")
        expect(is_float_type(self.result.type.get_element_type()) and shape_of(self.result.type) == (xs[0], ws[1]),
               f"result must be a float [{xs[0]}, {ws[1]}]")


LowP = Dialect("lowp", [QuantizeOp, DequantizeOp, ScaledMatmulOp], [])
