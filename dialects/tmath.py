"""`tmath`: the graph-level tensor math around the MoE ops.

Static-shape tensors of bf16, f32, i32 and i1 (comparison results). Binary ops broadcast as
numpy does; bf16 with f32 gives f32; i32 never mixes with floats implicitly. The shape and type
rules live here as plain functions so the frontend reports the same rule the verifier checks.
Numpy semantics are in `runtime_sim/semantics/tmath_semantics.py`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

from xdsl.dialects.builtin import (
    DenseArrayBase,
    FloatAttr,
    IntegerAttr,
    IntegerType,
    StringAttr,
    TensorType,
    UnitAttr,
    f64,
    i1,
    i32,
    i64,
)
from xdsl.ir import Attribute, Dialect
from xdsl.irdl import (
    IRDLOperation,
    ParsePropInAttrDict,
    irdl_op_definition,
    operand_def,
    opt_prop_def,
    prop_def,
    result_def,
    traits_def,
)
from xdsl.parser import Parser
from xdsl.printer import Printer
from xdsl.traits import Pure

from dialects.tensor_types import (
    broadcast_shapes,
    check_reshape,
    expect,
    float_literal,
    format_type,
    is_bool_type,
    is_float_type,
    is_int_type,
    matmul_shape,
    promote,
    reduced_shape,
    shape_of,
    type_name,
)


@irdl_op_definition
class ConstantOp(IRDLOperation):
    """A splat of one scalar: literals, `inf`, and scalars broadcast into tensor expressions."""

    name = "tmath.constant"
    value = prop_def(FloatAttr)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, value: float, result_type: TensorType):
        super().__init__(
            properties={"value": FloatAttr(float(value), f64)}, result_types=[result_type]
        )

    def verify_(self) -> None:
        v = self.value.value.data
        et = self.result.type.get_element_type()
        if not is_float_type(et):
            expect(math.isfinite(v) and v == int(v), f"{type_name(et)} constant {v} is not an integer")

    def print(self, printer: Printer) -> None:
        v = self.value.value.data
        if is_int_type(self.result.type.get_element_type()):
            text = str(int(v))
        else:
            text = ("-inf" if v < 0 else "inf") if math.isinf(v) else "nan" if math.isnan(v) else float_literal(v)
        printer.print_string(f" {text}")
        printer.print_op_attributes(self.attributes)
        printer.print_string(" : ")
        printer.print_attribute(self.result.type)

    @classmethod
    def parse(cls, parser: Parser) -> ConstantOp:
        negative = parser.parse_optional_punctuation("-") is not None
        if parser.parse_optional_keyword("inf") is not None:
            value = math.inf
        elif parser.parse_optional_keyword("nan") is not None:
            value = math.nan
        else:
            value = float(parser.parse_number())
        attrs = parser.parse_optional_attr_dict()
        parser.parse_punctuation(":")
        result_type = parser.parse_type()
        if not isinstance(result_type, TensorType):
            parser.raise_error("tmath.constant needs a tensor type")
        op = cls(-value if negative else value, result_type)
        op.attributes.update(attrs)
        return op


class ElementwiseBinaryOp(IRDLOperation):
    """Broadcasting arithmetic: the result has the broadcast shape and the promoted type."""

    lhs = operand_def(TensorType)
    rhs = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = (
        "$lhs `,` $rhs attr-dict `:` `(` type($lhs) `,` type($rhs) `)` `->` type($result)"
    )
    ALLOWS_INT: ClassVar[bool] = True

    def __init__(self, lhs, rhs, result_type: TensorType):
        super().__init__(operands=[lhs, rhs], result_types=[result_type])

    def verify_(self) -> None:
        lt, rt = self.lhs.type, self.rhs.type
        shape = broadcast_shapes(shape_of(lt), shape_of(rt))
        expect(shape is not None, f"shapes {format_type(lt)} and {format_type(rt)} do not broadcast")
        et = promote(lt.get_element_type(), rt.get_element_type())
        expect(et is not None, f"element types of {format_type(lt)} and {format_type(rt)} do not mix")
        expect(not is_bool_type(et), f"{self.name} does not take booleans")
        expect(self.ALLOWS_INT or not is_int_type(et), f"{self.name} needs float operands")
        expected = TensorType(et, shape)
        expect(self.result.type == expected, f"result type should be {expected}")


@irdl_op_definition
class AddOp(ElementwiseBinaryOp):
    name = "tmath.add"


@irdl_op_definition
class SubOp(ElementwiseBinaryOp):
    name = "tmath.sub"


@irdl_op_definition
class MulOp(ElementwiseBinaryOp):
    name = "tmath.mul"


@irdl_op_definition
class DivOp(ElementwiseBinaryOp):
    name = "tmath.div"
    ALLOWS_INT: ClassVar[bool] = False


@irdl_op_definition
class MaximumOp(ElementwiseBinaryOp):
    name = "tmath.maximum"


@irdl_op_definition
class MinimumOp(ElementwiseBinaryOp):
    name = "tmath.minimum"


CMP_PREDICATES = ("eq", "ne", "lt", "le", "gt", "ge")


@irdl_op_definition
class CmpOp(IRDLOperation):
    """Broadcasting comparison to i1. Any comparison with NaN is false, except `ne`."""

    name = "tmath.cmp"
    predicate = prop_def(StringAttr)
    lhs = operand_def(TensorType)
    rhs = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = (
        "$predicate `,` $lhs `,` $rhs attr-dict `:` `(` type($lhs) `,` type($rhs) `)` `->` type($result)"
    )

    def __init__(self, predicate: str, lhs, rhs, result_type: TensorType):
        super().__init__(
            operands=[lhs, rhs],
            result_types=[result_type],
            properties={"predicate": StringAttr(predicate)},
        )

    def verify_(self) -> None:
        expect(self.predicate.data in CMP_PREDICATES, f"unknown predicate {self.predicate.data}")
        lt, rt = self.lhs.type, self.rhs.type
        shape = broadcast_shapes(shape_of(lt), shape_of(rt))
        expect(shape is not None, f"shapes {format_type(lt)} and {format_type(rt)} do not broadcast")
        expect(
            promote(lt.get_element_type(), rt.get_element_type()) is not None,
            f"element types of {format_type(lt)} and {format_type(rt)} do not mix",
        )
        expect(self.result.type == TensorType(i1, shape), "result must be i1 of the broadcast shape")


@irdl_op_definition
class SelectOp(IRDLOperation):
    """`where(cond, a, b)`, broadcasting all three."""

    name = "tmath.select"
    cond = operand_def(TensorType)
    on_true = operand_def(TensorType)
    on_false = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = (
        "$cond `,` $on_true `,` $on_false attr-dict `:` "
        "`(` type($cond) `,` type($on_true) `,` type($on_false) `)` `->` type($result)"
    )

    def __init__(self, cond, on_true, on_false, result_type: TensorType):
        super().__init__(operands=[cond, on_true, on_false], result_types=[result_type])

    def verify_(self) -> None:
        ct, tt, ft = self.cond.type, self.on_true.type, self.on_false.type
        expect(is_bool_type(ct.get_element_type()), "condition must be i1")
        shape = broadcast_shapes(shape_of(ct), shape_of(tt), shape_of(ft))
        expect(shape is not None, "operand shapes do not broadcast")
        et = promote(tt.get_element_type(), ft.get_element_type())
        expect(et is not None, "branch element types do not mix")
        expect(self.result.type == TensorType(et, shape), "result type mismatch")


class ElementwiseUnaryOp(IRDLOperation):
    """Same shape and type in and out; float ops compute in f32 and round back."""

    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "$input attr-dict `:` type($input) `->` type($result)"
    ALLOWS_INT: ClassVar[bool] = False

    def __init__(self, input, result_type: TensorType | None = None):
        super().__init__(operands=[input], result_types=[result_type or input.type])

    def verify_(self) -> None:
        et = self.input.type.get_element_type()
        expect(is_float_type(et) or (self.ALLOWS_INT and is_int_type(et)), f"{self.name} needs float operands")
        expect(self.result.type == self.input.type, "result type must equal the operand type")


@irdl_op_definition
class NegOp(ElementwiseUnaryOp):
    name = "tmath.neg"
    ALLOWS_INT: ClassVar[bool] = True


@irdl_op_definition
class AbsOp(ElementwiseUnaryOp):
    name = "tmath.abs"
    ALLOWS_INT: ClassVar[bool] = True


@irdl_op_definition
class ExpOp(ElementwiseUnaryOp):
    name = "tmath.exp"


@irdl_op_definition
class LogOp(ElementwiseUnaryOp):
    name = "tmath.log"


@irdl_op_definition
class SqrtOp(ElementwiseUnaryOp):
    name = "tmath.sqrt"


@irdl_op_definition
class TanhOp(ElementwiseUnaryOp):
    name = "tmath.tanh"


@irdl_op_definition
class SigmoidOp(ElementwiseUnaryOp):
    name = "tmath.sigmoid"


@irdl_op_definition
class SiluOp(ElementwiseUnaryOp):
    name = "tmath.silu"


@irdl_op_definition
class SoftmaxOp(IRDLOperation):
    """Softmax along one axis, max-subtracted, in f32, rounded to the operand type."""

    name = "tmath.softmax"
    axis = prop_def(IntegerAttr[IntegerType])
    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$input attr-dict `:` type($input) `->` type($result)"

    def __init__(self, input, axis: int):
        super().__init__(
            operands=[input], result_types=[input.type], properties={"axis": IntegerAttr(axis, i64)}
        )

    def verify_(self) -> None:
        t = self.input.type
        expect(is_float_type(t.get_element_type()), "softmax needs a float operand")
        expect(0 <= self.axis.value.data < len(shape_of(t)), "axis out of range")
        expect(self.result.type == t, "result type must equal the operand type")


class ReduceOp(IRDLOperation):
    """Reduction over `axes` (sorted, non-negative). Sums accumulate in f32 (i32 for integers)."""

    axes = prop_def(DenseArrayBase.constr(i64))
    keepdims = opt_prop_def(UnitAttr)
    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$input attr-dict `:` type($input) `->` type($result)"

    def __init__(self, input, axes: Sequence[int], keepdims: bool, result_type: TensorType):
        props: dict[str, Attribute] = {"axes": DenseArrayBase.from_list(i64, list(axes))}
        if keepdims:
            props["keepdims"] = UnitAttr()
        super().__init__(operands=[input], result_types=[result_type], properties=props)

    @property
    def axis_list(self) -> tuple[int, ...]:
        return tuple(self.axes.get_values())

    def verify_(self) -> None:
        t = self.input.type
        shape = shape_of(t)
        axes = self.axis_list
        expect(not is_bool_type(t.get_element_type()), f"{self.name} does not take booleans")
        expect(list(axes) == sorted(set(axes)), "axes must be sorted and distinct")
        expect(all(0 <= a < len(shape) for a in axes), "axis out of range")
        expected = TensorType(t.get_element_type(), reduced_shape(shape, axes, self.keepdims is not None))
        expect(self.result.type == expected, f"result type should be {expected}")


@irdl_op_definition
class ReduceSumOp(ReduceOp):
    name = "tmath.reduce_sum"


@irdl_op_definition
class ReduceMaxOp(ReduceOp):
    name = "tmath.reduce_max"


@irdl_op_definition
class ReduceMinOp(ReduceOp):
    name = "tmath.reduce_min"


@irdl_op_definition
class ReshapeOp(IRDLOperation):
    """Row-major reshape; the element count must not change."""

    name = "tmath.reshape"
    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "$input attr-dict `:` type($input) `->` type($result)"

    def __init__(self, input, result_type: TensorType):
        super().__init__(operands=[input], result_types=[result_type])

    def verify_(self) -> None:
        check_reshape(self.input.type, self.result.type, "reshape")


@irdl_op_definition
class CastOp(IRDLOperation):
    """Element type conversion: floats round to nearest even; float to i32 truncates toward zero
    (NaN gives 0, out-of-range saturates); booleans give 0 or 1; a cast to the operand's own
    type is the identity (a bf16 NaN keeps its payload)."""

    name = "tmath.cast"
    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "$input attr-dict `:` type($input) `->` type($result)"

    def __init__(self, input, result_type: TensorType):
        super().__init__(operands=[input], result_types=[result_type])

    def verify_(self) -> None:
        expect(shape_of(self.input.type) == shape_of(self.result.type), "cast keeps the shape")
        expect(not is_bool_type(self.result.type.get_element_type()), "cannot cast to i1; compare instead")


@irdl_op_definition
class MatmulOp(IRDLOperation):
    """numpy.matmul on rank >= 2, leading axes broadcast; f32 accumulation, rounded to the
    promoted operand type."""

    name = "tmath.matmul"
    lhs = operand_def(TensorType)
    rhs = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = (
        "$lhs `,` $rhs attr-dict `:` `(` type($lhs) `,` type($rhs) `)` `->` type($result)"
    )

    def __init__(self, lhs, rhs, result_type: TensorType):
        super().__init__(operands=[lhs, rhs], result_types=[result_type])

    def verify_(self) -> None:
        lt, rt = self.lhs.type, self.rhs.type
        shape = matmul_shape(shape_of(lt), shape_of(rt))
        expect(shape is not None, f"cannot multiply {format_type(lt)} by {format_type(rt)}")
        et = promote(lt.get_element_type(), rt.get_element_type())
        expect(et is not None and is_float_type(et), "matmul needs float operands of one kind")
        expect(self.result.type == TensorType(et, shape), "result type mismatch")


@irdl_op_definition
class OneHotOp(IRDLOperation):
    """i32 indices [...] to an i32 mask [..., depth]; an index outside [0, depth) gives a zero row."""

    name = "tmath.one_hot"
    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "$input attr-dict `:` type($input) `->` type($result)"

    def __init__(self, input, depth: int):
        t = input.type
        super().__init__(operands=[input], result_types=[TensorType(i32, [*shape_of(t), depth])])

    def verify_(self) -> None:
        a, r = self.input.type, self.result.type
        expect(is_int_type(a.get_element_type()), "one_hot takes i32 indices")
        expect(is_int_type(r.get_element_type()), "one_hot gives i32")
        expect(shape_of(r)[:-1] == shape_of(a), "result shape must be the index shape plus depth")


@irdl_op_definition
class TakeOp(IRDLOperation):
    """numpy.take_along_axis on the last axis: x [..., N], i32 indices [..., M] -> [..., M].
    Indices must lie in [-N, N) (negative counts from the end); others are an execution error."""

    name = "tmath.take"
    input = operand_def(TensorType)
    indices = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = (
        "$input `,` $indices attr-dict `:` `(` type($input) `,` type($indices) `)` `->` type($result)"
    )

    def __init__(self, input, indices):
        it = indices.type
        super().__init__(
            operands=[input, indices],
            result_types=[TensorType(input.type.get_element_type(), shape_of(it))],
        )

    def verify_(self) -> None:
        xs, ids = shape_of(self.input.type), shape_of(self.indices.type)
        expect(is_int_type(self.indices.type.get_element_type()), "take needs i32 indices")
        expect(len(xs) >= 1 and xs[:-1] == ids[:-1], "leading shapes of input and indices must match")
        expect(
            self.result.type == TensorType(self.input.type.get_element_type(), ids),
            "result has the index shape and the input's type",
        )


TMath = Dialect(
    "tmath",
    [
        ConstantOp,
        AddOp,
        SubOp,
        MulOp,
        DivOp,
        MaximumOp,
        MinimumOp,
        CmpOp,
        SelectOp,
        NegOp,
        AbsOp,
        ExpOp,
        LogOp,
        SqrtOp,
        TanhOp,
        SigmoidOp,
        SiluOp,
        SoftmaxOp,
        ReduceSumOp,
        ReduceMaxOp,
        ReduceMinOp,
        ReshapeOp,
        CastOp,
        MatmulOp,
        OneHotOp,
        TakeOp,
    ],
    [],
)
