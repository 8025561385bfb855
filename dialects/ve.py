"""`ve`: the TCP vector engine, one op per stage the chain can run, on 32-bit lanes.

Shaped after the public vector-engine description (docs/hardware.md#vector-engine): it works on
i32 and f32 values only, every element carries a 4-bit tag, and tags guard which elements an
operand slot or a register-file write-back sees. The ops here are the stages a lowering needs,
with static shapes and no data-dependent control flow:

- data: `const` (a splat held in the constant slots or DM), `iota` (positions along an axis, a
  static table in DM);
- conversions: `bitcast` (i32 <-> f32, bits unchanged), `widen` (bf16 -> f32, the bf16 bits in the
  upper half of the lane, exact), `narrow` (f32 -> bf16, round to nearest even, or `truncate`:
  keep the upper 16 bits), `widen_low` / `narrow_low` (fp8 and fp4 <-> f32, the latter
  saturating), `fxp_to_fp` and `fp_to_fxp`;
- ALUs: logic `and or xor shl shr_u shr_s` (i32), fixed-point or float `add sub mul` (by the
  element type), float `div exp sigmoid log sqrt tanh`, clip `max min`;
- tags: `tag` (compare two streams, 1 where true and 0 elsewhere), `position_tag` (the static
  branch log: first / middle / last / single along an axis);
- tag-guarded ops: `select` (a register-file operand read enabled per tag), `scan` (a carried
  accumulator along an axis whose read and write-back are enabled per tag: cumsum is
  `scan add` with read [1, 2] and write [0, 1] over a position tag);
- layout and reductions: `broadcast` (tile along a new axis), `reduce_sum`, `reduce_max`,
  `reduce_min` (intra-slice, dropping the axis);
- `filter`: keep the elements whose tag is in a set, packed densely along an axis into a static
  size, padded with a 32-bit pattern;
- `chain` (ended by `yield`): several of the ops above run as one invocation of the chain, in
  its fixed stage order (dialects/ve_stages.py says which ops may share one; the
  `fuse-ve-chains` pass forms them).

Tags are `tensor<...xi4>` values holding 0..15 (the simulator stores them as uint8): a distinct
element type, so a verifier can tell a tag stream from data, and four bits as on the chip.
Binary ops take two operands of one type (the mainstream and a register-file or constant
operand); broadcasting is explicit (`ve.broadcast`). Axes are non-negative.
Numpy semantics are in `runtime_sim/semantics/ve_semantics.py`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

from xdsl.dialects.builtin import (
    I64,
    BFloat16Type,
    DenseArrayBase,
    Float32Type,
    FloatAttr,
    IntegerAttr,
    IntegerType,
    TensorType,
    UnitAttr,
    bf16,
    f32,
    i32,
    i64,
)
from xdsl.dialects.utils import EnumAttribute
from xdsl.ir import Attribute, Dialect, Operation, Region, SpacedOpaqueSyntaxAttribute, SSAValue
from xdsl.irdl import (
    IRDLOperation,
    VarConstraint,
    base,
    irdl_attr_definition,
    irdl_op_definition,
    operand_def,
    opt_prop_def,
    prop_def,
    region_def,
    result_def,
    traits_def,
    var_operand_def,
)
from xdsl.parser import Parser, UnresolvedOperand
from xdsl.printer import Printer
from xdsl.traits import HasParent, IsolatedFromAbove, IsTerminator, Pure
from xdsl.utils.str_enum import StrEnum

from dialects.tensor_types import E8M0, LOW_PRECISION_TYPES, U3, expect, format_type, shape_of

TAG = IntegerType(4)
"""The element type of a tag stream: 4 bits, ids 0..15."""

TAG_IDS = range(16)
I32_MIN, I32_MAX = -(2**31), 2**31 - 1


def tag_tensor(shape: Sequence[int]) -> TensorType:
    return TensorType(TAG, list(shape))


def is_lane_type(element_type: Attribute) -> bool:
    """A 32-bit lane: i32 or f32."""
    return element_type == i32 or isinstance(element_type, Float32Type)


def is_tag_type(element_type: Attribute) -> bool:
    return element_type == TAG



def _element(v: SSAValue | Attribute) -> Attribute:
    t = v.type if isinstance(v, SSAValue) else v
    assert isinstance(t, TensorType)
    return t.get_element_type()


def _check_axis(axis: int, rank: int, what: str = "axis") -> None:
    expect(0 <= axis < rank, f"{what} {axis} is out of range for rank {rank}")


def _check_tag_set(values: Sequence[int], what: str) -> None:
    expect(all(v in TAG_IDS for v in values), f"{what} tags must lie in [0, 15], got {list(values)}")
    expect(len(set(values)) == len(values), f"{what} tags must be distinct, got {list(values)}")


def _tag_array(values: Sequence[int]) -> DenseArrayBase:
    return DenseArrayBase.from_list(i64, list(values))


class Predicate(StrEnum):
    EQ = "eq"
    NE = "ne"
    LT = "lt"
    LE = "le"
    GT = "gt"
    GE = "ge"


@irdl_attr_definition
class PredicateAttr(EnumAttribute[Predicate], SpacedOpaqueSyntaxAttribute):
    """A comparison of `ve.tag`: signed for i32, IEEE for f32 (NaN compares false except `ne`)."""

    name = "ve.predicate"


class ScanKind(StrEnum):
    ADD = "add"
    MAX = "max"
    MIN = "min"


@irdl_attr_definition
class ScanKindAttr(EnumAttribute[ScanKind], SpacedOpaqueSyntaxAttribute):
    """The ALU a `ve.scan` runs: fixed-point or float add, or clip max / min."""

    name = "ve.scan_kind"


# --------------------------------------------------------------------------------------------
# Data


@irdl_op_definition
class ConstOp(IRDLOperation):
    """A splat of one scalar. i32 values print in hex when they look like masks; a hex literal
    up to 0xffffffff is read as a bit pattern."""

    name = "ve.const"
    value = prop_def(base(IntegerAttr) | base(FloatAttr))
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, value: int | float, result_type: TensorType):
        et = result_type.get_element_type()
        attr: Attribute
        if isinstance(et, Float32Type):
            attr = FloatAttr(float(value), f32)
        else:
            v = int(value)
            if I32_MAX < v < 2**32:
                v -= 2**32
            attr = IntegerAttr(v, i32)
        super().__init__(properties={"value": attr}, result_types=[result_type])

    @property
    def scalar(self) -> int | float:
        return self.value.value.data

    def verify_(self) -> None:
        et = _element(self.result)
        expect(is_lane_type(et), f"ve.const gives i32 or f32, not {format_type(self.result.type)}")
        if et == i32:
            expect(isinstance(self.value, IntegerAttr) and self.value.type == i32, "an i32 const needs an i32 value")
        else:
            expect(isinstance(self.value, FloatAttr) and self.value.type == f32, "an f32 const needs an f32 value")

    def print(self, printer: Printer) -> None:
        v = self.scalar
        if isinstance(v, float):
            text = ("-inf" if v < 0 else "inf") if math.isinf(v) else "nan" if math.isnan(v) else repr(v)
        elif v >= 0x10000 or v < -0x10000:
            text = f"0x{v & 0xFFFFFFFF:08x}"
        else:
            text = str(v)
        printer.print_string(f" {text} : ")
        printer.print_attribute(self.result.type)
        printer.print_op_attributes(self.attributes)

    @classmethod
    def parse(cls, parser: Parser) -> ConstOp:
        negative = parser.parse_optional_punctuation("-") is not None
        value: int | float
        if parser.parse_optional_keyword("inf") is not None:
            value = math.inf
        elif parser.parse_optional_keyword("nan") is not None:
            value = math.nan
        else:
            value = parser.parse_number()
        parser.parse_punctuation(":")
        result_type = parser.parse_type()
        attrs = parser.parse_optional_attr_dict()
        if not isinstance(result_type, TensorType):
            parser.raise_error("ve.const needs a tensor type")
        if isinstance(value, int) and not (I32_MIN <= (-value if negative else value) < 2**32):
            parser.raise_error(f"ve.const: {value} does not fit 32 bits")
        if result_type.get_element_type() == i32 and isinstance(value, float):
            parser.raise_error("ve.const: an i32 const needs an integer")
        op = cls(-value if negative else value, result_type)
        op.attributes.update(attrs)
        return op


@irdl_op_definition
class IotaOp(IRDLOperation):
    """i32 positions 0..n-1 along `axis`, the same for every other index: a static table (in DM
    on the chip), used as expert ids and as positions to compare against."""

    name = "ve.iota"
    axis = prop_def(IntegerAttr[I64])
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "`along` $axis `:` type($result) attr-dict"

    def __init__(self, result_type: TensorType, axis: int):
        super().__init__(properties={"axis": IntegerAttr(axis, i64)}, result_types=[result_type])

    def verify_(self) -> None:
        expect(_element(self.result) == i32, "ve.iota gives i32")
        _check_axis(self.axis.value.data, len(shape_of(self.result.type)))


# --------------------------------------------------------------------------------------------
# Conversions


class ConversionOp(IRDLOperation):
    """Same shape in and out; the element types are the op's contract."""

    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "$input `:` type($input) `->` type($result) attr-dict"
    FROM: ClassVar[tuple[Attribute, ...]] = ()
    TO: ClassVar[tuple[Attribute, ...]] = ()

    def __init__(self, input: SSAValue, result_type: TensorType):
        super().__init__(operands=[input], result_types=[result_type])

    def verify_(self) -> None:
        a, r = self.input.type, self.result.type
        expect(shape_of(a) == shape_of(r), f"{self.name} keeps the shape: {format_type(a)} -> {format_type(r)}")
        expect(_element(a) in self.FROM, f"{self.name} does not take {format_type(a)}")
        expect(_element(r) in self.TO, f"{self.name} does not give {format_type(r)}")


@irdl_op_definition
class BitcastOp(ConversionOp):
    """i32 <-> f32, the 32 bits unchanged (NaN payloads and -0.0 included)."""

    name = "ve.bitcast"
    FROM: ClassVar[tuple[Attribute, ...]] = (i32, f32)
    TO: ClassVar[tuple[Attribute, ...]] = (i32, f32)

    def verify_(self) -> None:
        super().verify_()
        expect(_element(self.input) != _element(self.result), "ve.bitcast changes the element type")


@irdl_op_definition
class WidenOp(ConversionOp):
    """bf16 -> f32 (the Widen stage): the 16 bits go to the upper half of the lane, the lower
    half is zero. Exact for every bf16, NaN payloads included: the way bf16 enters a lane."""

    name = "ve.widen"
    FROM: ClassVar[tuple[Attribute, ...]] = (bf16,)
    TO: ClassVar[tuple[Attribute, ...]] = (f32,)


@irdl_op_definition
class NarrowOp(IRDLOperation):
    """f32 -> bf16 (the Narrow stage). By default rounds to nearest even, as every level
    rounds (a NaN becomes the quiet NaN of its sign); `truncate` keeps the upper 16 bits
    unchanged, the exact inverse of `ve.widen` for a lane whose lower half is ignored."""

    name = "ve.narrow"
    truncate = opt_prop_def(UnitAttr)
    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "$input (`truncate` $truncate^)? `:` type($input) `->` type($result) attr-dict"

    def __init__(self, input: SSAValue, result_type: TensorType, truncate: bool = False):
        props: dict[str, Attribute] = {"truncate": UnitAttr()} if truncate else {}
        super().__init__(operands=[input], result_types=[result_type], properties=props)

    def verify_(self) -> None:
        a, r = self.input.type, self.result.type
        expect(shape_of(a) == shape_of(r), f"ve.narrow keeps the shape: {format_type(a)} -> {format_type(r)}")
        expect(isinstance(_element(a), Float32Type), "ve.narrow takes f32")
        expect(isinstance(_element(r), BFloat16Type), "ve.narrow gives bf16")


@irdl_op_definition
class WidenLowOp(ConversionOp):
    """f8e4m3, f8e5m2, f4e2m1 or an e8m0 scale -> f32, exact: how stored low-precision values
    enter a lane (the fetch stage's lookup table turns f4e2m1 into f8, the cast path f8 into
    f32; an e8m0 exponent becomes the f32 power of two, a bit shift)."""

    name = "ve.widen_low"
    FROM: ClassVar[tuple[Attribute, ...]] = (*LOW_PRECISION_TYPES.values(), E8M0)
    TO: ClassVar[tuple[Attribute, ...]] = (f32,)


@irdl_op_definition
class LookupOp(IRDLOperation):
    """u3 codes -> f32, each code replaced by its entry of `table` (f32 [8], or [R, 8]: a table
    per row of codes [R, ...], so that a loop over rows takes its row's table): the fetch
    stage's table lookup, after the Logic stage has cut the 3-bit fields out of their packed
    bytes (the lookup takes byte-aligned keys; book, Fetch Adapter, Table Lookup)."""

    name = "ve.lookup"
    input = operand_def(TensorType)
    table = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "$input `in` $table `:` type($input) `,` type($table) `->` type($result) attr-dict"

    def __init__(self, input: SSAValue, table: SSAValue):
        super().__init__(operands=[input, table], result_types=[TensorType(f32, list(shape_of(input.type)))])

    def verify_(self) -> None:
        expect(_element(self.input) == U3, f"ve.lookup takes u3 codes, not {format_type(self.input.type)}")
        rows = shape_of(self.input.type)[:1]
        expect(isinstance(_element(self.table), Float32Type) and shape_of(self.table.type) in ((8,), (*rows, 8)),
               f"ve.lookup's table must be f32 [8] or [{', '.join(map(str, rows))}, 8] (an entry per code, a table "
               f"per row), got {format_type(self.table.type)}")
        expect(self.result.type == TensorType(f32, list(shape_of(self.input.type))), "ve.lookup gives f32 of the codes' shape")


@irdl_op_definition
class NarrowLowOp(ConversionOp):
    """f32 -> f8e4m3 or f8e5m2 (the Cast Engine): saturating (beyond the largest finite value,
    inf included, gives it), round to nearest even, NaN stays NaN."""

    name = "ve.narrow_low"
    FROM: ClassVar[tuple[Attribute, ...]] = (f32,)
    TO: ClassVar[tuple[Attribute, ...]] = (LOW_PRECISION_TYPES["f8e4m3"], LOW_PRECISION_TYPES["f8e5m2"])


@irdl_op_definition
class FxpToFpOp(ConversionOp):
    """i32 -> f32 (the FxpToFp stage), rounding to nearest even above 2^24."""

    name = "ve.fxp_to_fp"
    FROM: ClassVar[tuple[Attribute, ...]] = (i32,)
    TO: ClassVar[tuple[Attribute, ...]] = (f32,)


@irdl_op_definition
class FpToFxpOp(ConversionOp):
    """f32 -> i32 (the FpToFxp stage): truncates toward zero, saturates out-of-range values
    to the i32 limits, NaN gives 0 (as tmath.cast does)."""

    name = "ve.fp_to_fxp"
    FROM: ClassVar[tuple[Attribute, ...]] = (f32,)
    TO: ClassVar[tuple[Attribute, ...]] = (i32,)


# --------------------------------------------------------------------------------------------
# ALU stages


class BinaryOp(IRDLOperation):
    """Elementwise on two operands of one type, the mainstream and a register-file or constant
    operand. i32 arithmetic wraps (two's complement); f32 follows IEEE."""

    T: ClassVar = VarConstraint("T", base(TensorType))
    lhs = operand_def(T)
    rhs = operand_def(T)
    result = result_def(T)
    traits = traits_def(Pure())
    assembly_format = "$lhs `,` $rhs `:` type($result) attr-dict"
    ELEMENTS: ClassVar[tuple[Attribute, ...]] = (i32, f32)

    def __init__(self, lhs: SSAValue, rhs: SSAValue):
        super().__init__(operands=[lhs, rhs], result_types=[lhs.type])

    def verify_(self) -> None:
        et = _element(self.result)
        names = " or ".join(str(e) for e in self.ELEMENTS)
        expect(et in self.ELEMENTS, f"{self.name} takes {names}, not {format_type(self.result.type)}")


class LogicOp(BinaryOp):
    ELEMENTS: ClassVar[tuple[Attribute, ...]] = (i32,)


@irdl_op_definition
class AndOp(LogicOp):
    name = "ve.and"


@irdl_op_definition
class OrOp(LogicOp):
    name = "ve.or"


@irdl_op_definition
class XorOp(LogicOp):
    name = "ve.xor"


@irdl_op_definition
class ShlOp(LogicOp):
    """Left shift by the low 5 bits of the right operand."""

    name = "ve.shl"


@irdl_op_definition
class ShrUOp(LogicOp):
    """Logical right shift (zeros in) by the low 5 bits of the right operand."""

    name = "ve.shr_u"


@irdl_op_definition
class ShrSOp(LogicOp):
    """Arithmetic right shift (sign in) by the low 5 bits of the right operand (the Fxp ALU)."""

    name = "ve.shr_s"


@irdl_op_definition
class AddOp(BinaryOp):
    """Fixed-point add on i32, float add on f32."""

    name = "ve.add"


@irdl_op_definition
class SubOp(BinaryOp):
    """The add ALU with its operand negated (an assumption: the public ALU lists name add only)."""

    name = "ve.sub"


@irdl_op_definition
class MulOp(BinaryOp):
    """Fixed-point multiply on i32 (the low 32 bits), float multiply on f32."""

    name = "ve.mul"


@irdl_op_definition
class DivOp(BinaryOp):
    """The FpDiv stage, f32 only."""

    name = "ve.div"
    ELEMENTS: ClassVar[tuple[Attribute, ...]] = (f32,)


@irdl_op_definition
class MaxOp(BinaryOp):
    """The Clip ALU's max (f32: NaN propagates)."""

    name = "ve.max"


@irdl_op_definition
class MinOp(BinaryOp):
    """The Clip ALU's min (f32: NaN propagates)."""

    name = "ve.min"


class UnaryFloatOp(IRDLOperation):
    T: ClassVar = VarConstraint("T", base(TensorType))
    input = operand_def(T)
    result = result_def(T)
    traits = traits_def(Pure())
    assembly_format = "$input `:` type($result) attr-dict"

    def __init__(self, input: SSAValue):
        super().__init__(operands=[input], result_types=[input.type])

    def verify_(self) -> None:
        expect(isinstance(_element(self.input), Float32Type), f"{self.name} takes f32")


@irdl_op_definition
class ExpOp(UnaryFloatOp):
    name = "ve.exp"


@irdl_op_definition
class SigmoidOp(UnaryFloatOp):
    name = "ve.sigmoid"


@irdl_op_definition
class LogOp(UnaryFloatOp):
    """Natural logarithm on the Float ALU's fpu."""

    name = "ve.log"


@irdl_op_definition
class SqrtOp(UnaryFloatOp):
    """Square root on the Float ALU's fpu."""

    name = "ve.sqrt"


@irdl_op_definition
class TanhOp(UnaryFloatOp):
    """Hyperbolic tangent on the Float ALU's fpu."""

    name = "ve.tanh"


# --------------------------------------------------------------------------------------------
# Tags


@irdl_op_definition
class TagOp(IRDLOperation):
    """Tag 1 where `lhs predicate rhs` holds, 0 elsewhere: the Tag/Branch stage comparing the
    stream against a constant or another stream."""

    name = "ve.tag"
    T: ClassVar = VarConstraint("T", base(TensorType))
    predicate = prop_def(PredicateAttr)
    lhs = operand_def(T)
    rhs = operand_def(T)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "$predicate $lhs `,` $rhs `:` type($lhs) `->` type($result) attr-dict"

    def __init__(self, predicate: str, lhs: SSAValue, rhs: SSAValue):
        super().__init__(
            operands=[lhs, rhs],
            result_types=[tag_tensor(shape_of(lhs.type))],
            properties={"predicate": PredicateAttr(Predicate(predicate))},
        )

    def verify_(self) -> None:
        expect(is_lane_type(_element(self.lhs)), f"ve.tag compares i32 or f32, not {format_type(self.lhs.type)}")
        expect(self.result.type == tag_tensor(shape_of(self.lhs.type)),
                f"ve.tag gives {tag_tensor(shape_of(self.lhs.type))}")


POSITIONS = ("first", "middle", "last", "single")


@irdl_op_definition
class PositionTagOp(IRDLOperation):
    """The static branch log along `axis` (size n): `first` at i = 0, `middle` for 0 < i < n-1,
    `last` at i = n-1, and `single` for the one element of an axis of size 1, which is first
    and last at once (a guard that skips the first element must skip it, a guard that finds
    the last must find it, so it gets a tag of its own)."""

    name = "ve.position_tag"
    axis = prop_def(IntegerAttr[I64])
    first = prop_def(IntegerAttr[I64])
    middle = prop_def(IntegerAttr[I64])
    last = prop_def(IntegerAttr[I64])
    single = prop_def(IntegerAttr[I64])
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = (
        "`along` $axis `first` $first `middle` $middle `last` $last `single` $single `:` type($result) attr-dict"
    )

    def __init__(self, shape: Sequence[int], axis: int, pattern: Sequence[int] = (0, 1, 2, 3)):
        props = {name: IntegerAttr(v, i64) for name, v in zip(POSITIONS, pattern, strict=True)}
        super().__init__(properties={"axis": IntegerAttr(axis, i64), **props}, result_types=[tag_tensor(shape)])

    @property
    def pattern(self) -> tuple[int, int, int, int]:
        return tuple(getattr(self, name).value.data for name in POSITIONS)  # type: ignore[return-value]

    def verify_(self) -> None:
        expect(is_tag_type(_element(self.result)), "ve.position_tag gives a tag tensor (i4)")
        _check_axis(self.axis.value.data, len(shape_of(self.result.type)))
        expect(all(v in TAG_IDS for v in self.pattern), f"position tags must lie in [0, 15], got {list(self.pattern)}")


@irdl_op_definition
class SelectOp(IRDLOperation):
    """`on_true` where the element's tag is in `when`, else `on_false`: an operand slot whose
    read is enabled for those tags and replaces the mainstream there."""

    name = "ve.select"
    T: ClassVar = VarConstraint("T", base(TensorType))
    tags = operand_def(TensorType)
    when = prop_def(DenseArrayBase.constr(i64))
    on_true = operand_def(T)
    on_false = operand_def(T)
    result = result_def(T)
    traits = traits_def(Pure())
    assembly_format = (
        "$tags `in` $when `,` $on_true `,` $on_false `:` type($tags) `,` type($result) attr-dict"
    )

    def __init__(self, tags: SSAValue, when: Sequence[int], on_true: SSAValue, on_false: SSAValue):
        super().__init__(
            operands=[tags, on_true, on_false],
            result_types=[on_true.type],
            properties={"when": _tag_array(when)},
        )

    def verify_(self) -> None:
        expect(is_tag_type(_element(self.tags)), f"ve.select is guarded by a tag tensor, not {format_type(self.tags.type)}")
        expect(is_lane_type(_element(self.result)), f"ve.select moves i32 or f32, not {format_type(self.result.type)}")
        expect(shape_of(self.tags.type) == shape_of(self.result.type),
                f"tags {format_type(self.tags.type)} and values {format_type(self.result.type)} differ in shape")
        _check_tag_set(self.when.get_values(), "select")


@irdl_op_definition
class ScanOp(IRDLOperation):
    """A carried accumulator along `axis`: the `kind` ALU combines each element with the
    register-file value, its operand read enabled only where the element's tag is in `read`
    (elsewhere the element passes through unchanged), and its result written back to the
    register file only where the tag is in `write`. The register starts at zero for every
    other index; every element's result goes to the output stream.

    With a position tag (first 0, middle 1, last 2) read [1, 2] and write [0, 1] this is the
    inclusive cumsum of the book's MoE chapter (docs/hardware.md#vector-engine): each row
    restarts at its first element."""

    name = "ve.scan"
    T: ClassVar = VarConstraint("T", base(TensorType))
    kind = prop_def(ScanKindAttr)
    axis = prop_def(IntegerAttr[I64])
    read = prop_def(DenseArrayBase.constr(i64))
    write = prop_def(DenseArrayBase.constr(i64))
    input = operand_def(T)
    tags = operand_def(TensorType)
    result = result_def(T)
    traits = traits_def(Pure())
    assembly_format = (
        "$kind $input `,` $tags `along` $axis `read` $read `write` $write "
        "`:` type($input) `,` type($tags) attr-dict"
    )

    def __init__(self, kind: str, input: SSAValue, tags: SSAValue, axis: int,
                 read: Sequence[int], write: Sequence[int]):
        super().__init__(
            operands=[input, tags],
            result_types=[input.type],
            properties={
                "kind": ScanKindAttr(ScanKind(kind)),
                "axis": IntegerAttr(axis, i64),
                "read": _tag_array(read),
                "write": _tag_array(write),
            },
        )

    def verify_(self) -> None:
        expect(is_lane_type(_element(self.input)), f"ve.scan runs on i32 or f32, not {format_type(self.input.type)}")
        expect(is_tag_type(_element(self.tags)), f"ve.scan is guarded by a tag tensor, not {format_type(self.tags.type)}")
        shape = shape_of(self.input.type)
        expect(shape_of(self.tags.type) == shape,
                f"tags {format_type(self.tags.type)} and values {format_type(self.input.type)} differ in shape")
        _check_axis(self.axis.value.data, len(shape))
        _check_tag_set(self.read.get_values(), "read")
        _check_tag_set(self.write.get_values(), "write")


# --------------------------------------------------------------------------------------------
# Layout and reductions


@irdl_op_definition
class BroadcastOp(IRDLOperation):
    """Tile the input along a new axis inserted at `axis`; its size is the result's. Works on
    tag streams too."""

    name = "ve.broadcast"
    input = operand_def(TensorType)
    axis = prop_def(IntegerAttr[I64])
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "$input `along` $axis `:` type($input) `->` type($result) attr-dict"

    def __init__(self, input: SSAValue, axis: int, size: int):
        shape = list(shape_of(input.type))
        shape.insert(axis, size)
        super().__init__(
            operands=[input],
            result_types=[TensorType(_element(input), shape)],
            properties={"axis": IntegerAttr(axis, i64)},
        )

    def verify_(self) -> None:
        a, r = shape_of(self.input.type), shape_of(self.result.type)
        axis = self.axis.value.data
        et = _element(self.input)
        expect(is_lane_type(et) or is_tag_type(et), f"ve.broadcast takes i32, f32 or tags, not {format_type(self.input.type)}")
        _check_axis(axis, len(r))
        expect(_element(self.result) == et and len(r) == len(a) + 1 and r[:axis] + r[axis + 1:] == a,
                f"{format_type(self.result.type)} is not {format_type(self.input.type)} with an axis inserted at {axis}")


@irdl_op_definition
class RepeatOp(IRDLOperation):
    """Each element along `axis` repeated `times` times, the result cut to its own size along
    that axis (a last group shorter than `times`): block scales spread over their blocks when
    the last block is ragged. A view the reader makes, as `broadcast` is (assumption: the
    fetch sequencer walks the groups with a stride-0 inner axis, the short last group as a
    second, shorter walk of the same command)."""

    name = "ve.repeat"
    input = operand_def(TensorType)
    axis = prop_def(IntegerAttr[I64])
    times = prop_def(IntegerAttr[I64])
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "$input `along` $axis `times` $times `:` type($input) `->` type($result) attr-dict"

    def __init__(self, input: SSAValue, axis: int, times: int, size: int):
        shape = list(shape_of(input.type))
        shape[axis] = size
        super().__init__(operands=[input], result_types=[TensorType(_element(input), shape)],
                         properties={"axis": IntegerAttr(axis, i64), "times": IntegerAttr(times, i64)})

    def verify_(self) -> None:
        a, r = shape_of(self.input.type), shape_of(self.result.type)
        axis, times = self.axis.value.data, self.times.value.data
        expect(is_lane_type(_element(self.input)), f"ve.repeat takes i32 or f32, not {format_type(self.input.type)}")
        _check_axis(axis, len(a))
        expect(times >= 1 and _element(self.result) == _element(self.input) and len(r) == len(a)
               and r[:axis] + r[axis + 1:] == a[:axis] + a[axis + 1:] and -(-r[axis] // times) == a[axis],
               f"{format_type(self.result.type)} is not {format_type(self.input.type)} repeated {times} times along {axis} and cut")


class ReduceOp(IRDLOperation):
    """Intra-slice reduction along `axis`, which the result drops, left to right over the time
    axis: sums accumulate in order (i32 wraps; f32 rounds at every add); f32 max and min
    propagate NaN (the first NaN met, its bits unchanged) and keep the later of equal values
    (max(+0.0, -0.0) is -0.0), as a folded Clip ALU does."""

    input = operand_def(TensorType)
    axis = prop_def(IntegerAttr[I64])
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "$input `along` $axis `:` type($input) `->` type($result) attr-dict"

    def __init__(self, input: SSAValue, axis: int):
        shape = list(shape_of(input.type))
        del shape[axis]
        super().__init__(
            operands=[input],
            result_types=[TensorType(_element(input), shape)],
            properties={"axis": IntegerAttr(axis, i64)},
        )

    def verify_(self) -> None:
        a = shape_of(self.input.type)
        axis = self.axis.value.data
        et = _element(self.input)
        expect(is_lane_type(et), f"{self.name} takes i32 or f32, not {format_type(self.input.type)}")
        _check_axis(axis, len(a))
        expected = TensorType(et, a[:axis] + a[axis + 1:])
        expect(self.result.type == expected, f"{self.name} along {axis} gives {expected}")


@irdl_op_definition
class ReduceSumOp(ReduceOp):
    name = "ve.reduce_sum"


@irdl_op_definition
class ReduceMaxOp(ReduceOp):
    name = "ve.reduce_max"


@irdl_op_definition
class ReduceMinOp(ReduceOp):
    name = "ve.reduce_min"


@irdl_op_definition
class FilterOp(IRDLOperation):
    """The Filter stage: along `axis`, keep the elements whose tag is in `keep`, in order,
    packed densely into the first positions of an axis of static size (the result's). If
    fewer are kept, the rest hold `pad`, a 32-bit pattern (an i32 value, or an f32's bits);
    if more, only the first ones fit and the rest are dropped."""

    name = "ve.filter"
    input = operand_def(TensorType)
    tags = operand_def(TensorType)
    keep = prop_def(DenseArrayBase.constr(i64))
    axis = prop_def(IntegerAttr[I64])
    pad = prop_def(IntegerAttr[I64])
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = (
        "$input `,` $tags `keep` $keep `along` $axis `pad` $pad "
        "`:` type($input) `,` type($tags) `->` type($result) attr-dict"
    )

    def __init__(self, input: SSAValue, tags: SSAValue, keep: Sequence[int], axis: int, size: int, pad: int = 0):
        shape = list(shape_of(input.type))
        shape[axis] = size
        super().__init__(
            operands=[input, tags],
            result_types=[TensorType(_element(input), shape)],
            properties={"keep": _tag_array(keep), "axis": IntegerAttr(axis, i64), "pad": IntegerAttr(pad, i64)},
        )

    def verify_(self) -> None:
        a, r = shape_of(self.input.type), shape_of(self.result.type)
        axis = self.axis.value.data
        et = _element(self.input)
        expect(is_lane_type(et), f"ve.filter moves i32 or f32, not {format_type(self.input.type)}")
        expect(is_tag_type(_element(self.tags)), f"ve.filter is guarded by a tag tensor, not {format_type(self.tags.type)}")
        expect(shape_of(self.tags.type) == a,
                f"tags {format_type(self.tags.type)} and values {format_type(self.input.type)} differ in shape")
        _check_axis(axis, len(a))
        _check_tag_set(self.keep.get_values(), "keep")
        expect(I32_MIN <= self.pad.value.data <= I32_MAX, f"pad {self.pad.value.data} is not a 32-bit value")
        expect(_element(self.result) == et and len(r) == len(a) and r[:axis] == a[:axis] and r[axis + 1:] == a[axis + 1:],
                f"{format_type(self.result.type)} is not {format_type(self.input.type)} with axis {axis} resized")
        expect(r[axis] >= 1, "ve.filter needs an output size of at least 1")


# --------------------------------------------------------------------------------------------
# Chains


@irdl_op_definition
class ChainOp(IRDLOperation):
    """Several `ve` ops run as ONE invocation of the vector-engine chain: the data streams
    through their stages once, in the chain's fixed order, and only the last op's result leaves
    the chain (intermediates never reach SRAM). The body's block arguments are the tensors the
    chain reads (`inputs`); constants live in the body (immediate slots); `ve.yield` gives the
    result. Which ops may share an invocation is dialects/ve_stages.py's `chain_problem`.

        %h = ve.chain (%a = %x, %b = %y) : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xbf16> {
          %0 = ve.mul %a, %b : tensor<8xf32>
          %1 = ve.narrow %0 : tensor<8xf32> -> tensor<8xbf16>
          ve.yield %1 : tensor<8xbf16>
        }
    """

    name = "ve.chain"
    inputs = var_operand_def(TensorType)
    result = result_def(TensorType)
    body = region_def("single_block")
    traits = traits_def(Pure(), IsolatedFromAbove())

    def __init__(self, inputs: Sequence[SSAValue], result_type: Attribute, body: Region):
        super().__init__(operands=[inputs], result_types=[result_type], regions=[body])

    @property
    def members(self) -> list[Operation]:
        """The ops that run on a stage (or reinterpret): everything but constants and the yield."""
        return [op for op in self.body.block.ops if not isinstance(op, (ConstOp, YieldOp))]

    def verify_(self) -> None:
        from dialects.ve_stages import chain_problem  # the stage table imports this module

        block = self.body.block
        expect(tuple(a.type for a in block.args) == tuple(v.type for v in self.inputs),
               "ve.chain's block arguments must have the types of its inputs")
        last = block.last_op
        expect(isinstance(last, YieldOp), "ve.chain's body must end with ve.yield")
        assert isinstance(last, YieldOp)
        expect(last.value.type == self.result.type,
               f"ve.chain yields {format_type(last.value.type)} but gives {format_type(self.result.type)}")
        members = self.members
        expect(len(members) >= 1 and last.value.owner is members[-1], "ve.chain yields its last op's result")
        problem = chain_problem(members)
        expect(problem is None, f"ve.chain cannot run as one invocation: {problem}")

    def print(self, printer: Printer) -> None:
        printer.print_string(" (")
        printer.print_list(zip(self.body.block.args, self.inputs, strict=True),
                           lambda pair: self._print_input(printer, *pair))
        printer.print_string(") : (")
        printer.print_list((v.type for v in self.inputs), printer.print_attribute)
        printer.print_string(") -> ")
        printer.print_attribute(self.result.type)
        printer.print_string(" ")
        printer.print_region(self.body, print_entry_block_args=False)
        printer.print_op_attributes(self.attributes)

    @staticmethod
    def _print_input(printer: Printer, arg: SSAValue, value: SSAValue) -> None:
        printer.print_ssa_value(arg)
        printer.print_string(" = ")
        printer.print_ssa_value(value)

    @classmethod
    def parse(cls, parser: Parser) -> ChainOp:
        def assignment() -> tuple[Parser.UnresolvedArgument, UnresolvedOperand]:
            arg = parser.parse_argument(expect_type=False)
            parser.parse_punctuation("=")
            return arg, parser.parse_unresolved_operand()

        pairs = parser.parse_comma_separated_list(parser.Delimiter.PAREN, assignment)
        parser.parse_punctuation(":")
        pos = parser.pos
        types = parser.parse_comma_separated_list(parser.Delimiter.PAREN, parser.parse_type)
        if len(types) != len(pairs):
            parser.raise_error(f"ve.chain has {len(pairs)} inputs but {len(types)} types", pos, parser.pos)
        parser.parse_punctuation("->")
        result_type = parser.parse_type()
        inputs = [parser.resolve_operand(operand, t) for (_, operand), t in zip(pairs, types)]
        body = parser.parse_region([arg.resolve(t) for (arg, _), t in zip(pairs, types)])
        attrs = parser.parse_optional_attr_dict()
        op = cls(inputs, result_type, body)
        op.attributes.update(attrs)
        return op


@irdl_op_definition
class YieldOp(IRDLOperation):
    """The result of a `ve.chain`: what its last op leaves the chain with."""

    name = "ve.yield"
    value = operand_def(TensorType)
    traits = traits_def(IsTerminator(), HasParent(ChainOp))
    assembly_format = "$value `:` type($value) attr-dict"

    def __init__(self, value: SSAValue):
        super().__init__(operands=[value])


VE = Dialect(
    "ve",
    [
        ConstOp,
        IotaOp,
        BitcastOp,
        WidenOp,
        NarrowOp,
        WidenLowOp,
        LookupOp,
        NarrowLowOp,
        FxpToFpOp,
        FpToFxpOp,
        AndOp,
        OrOp,
        XorOp,
        ShlOp,
        ShrUOp,
        ShrSOp,
        AddOp,
        SubOp,
        MulOp,
        DivOp,
        MaxOp,
        MinOp,
        ExpOp,
        SigmoidOp,
        LogOp,
        SqrtOp,
        TanhOp,
        TagOp,
        PositionTagOp,
        SelectOp,
        ScanOp,
        BroadcastOp,
        RepeatOp,
        ReduceSumOp,
        ReduceMaxOp,
        ReduceMinOp,
        FilterOp,
        ChainOp,
        YieldOp,
    ],
    [PredicateAttr, ScanKindAttr],
)
