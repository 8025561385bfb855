"""Build graph-level IR (func.func + tmath + moe) from the AST, inferring and checking types.

Expressions evaluate to a `Static` (a compile-time number, bool or string: dims, literals and
their arithmetic) or an SSA value. Statics fold; a static meeting a tensor becomes a constant of
the tensor's element type. Every check reports the user's source location; the dialects'
verifiers check the same rules again on the IR (the shape and type rules are shared functions).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import FileLineColLoc, ModuleOp, TensorType, i1
from xdsl.ir import Attribute, Block, Operation, Region, SSAValue
from xdsl.utils.exceptions import VerifyException

from dialects import lowp, moe, tensor_types, tmath
from dialects.locations import file_location
from dialects.tensor_types import format_shape, format_type, shape_of
from runtime_sim.semantics.numerics import numpy_dtype
from tcpc import syntax as ast
from tcpc.diagnostics import CompileError, Loc


@dataclass(frozen=True)
class Static:
    value: int | float | bool | str | tuple[int, ...]


Value = Static | SSAValue
Result = Value | tuple[Value, ...]

FOLD: dict[str, Callable[[object, object], object]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}

ARITH_OPS: dict[str, type[tmath.ElementwiseBinaryOp]] = {
    "+": tmath.AddOp,
    "-": tmath.SubOp,
    "*": tmath.MulOp,
    "/": tmath.DivOp,
}
CMP_PREDICATE = {"==": "eq", "!=": "ne", "<": "lt", "<=": "le", ">": "gt", ">=": "ge"}
UNARY_BUILTINS: dict[str, type[tmath.ElementwiseUnaryOp]] = {
    "exp": tmath.ExpOp,
    "log": tmath.LogOp,
    "sqrt": tmath.SqrtOp,
    "tanh": tmath.TanhOp,
    "sigmoid": tmath.SigmoidOp,
    "silu": tmath.SiluOp,
    "abs": tmath.AbsOp,
}
REDUCE_BUILTINS: dict[str, type[tmath.ReduceOp]] = {
    "sum": tmath.ReduceSumOp,
    "max": tmath.ReduceMaxOp,
    "min": tmath.ReduceMinOp,
}
CONSTANTS = {"inf": math.inf, "true": True, "false": False}

INDEX_MAX = 2**31 - 1
"""The largest size of one axis, and of the token-choice pairs and blocked rows of a scatter:
the lowered IR computes indices (iotas, ranks, row numbers) in i32."""
ELEMENTS_MAX = 2**63 - 1
"""The most elements one tensor may have: MLIR shapes and numpy sizes are 64-bit."""
I32_MIN, I32_MAX = -(2**31), 2**31 - 1


def literal_overflow(value: int | float, element_type: Attribute) -> str | None:
    """Why a finite scalar cannot be a constant of `element_type` (it does not fit an i32, or
    it rounds to infinity in a float type), or None when it can."""
    shown = brief(value)
    if tensor_types.is_int_type(element_type):
        if not I32_MIN <= value <= I32_MAX:
            return f"{shown} does not fit in i32 ({I32_MIN} to {I32_MAX})"
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None  # inf and -inf are written on purpose
    dtype = numpy_dtype(element_type)
    largest = float(ml_dtypes.finfo(dtype).max)
    try:
        with np.errstate(over="ignore"):  # overflow is the question asked here
            rounded = float(np.array(float(value), np.float64).astype(np.float32).astype(dtype))
    except OverflowError:  # an int beyond any float
        rounded = math.inf
    if not math.isfinite(rounded):
        name = "bf16" if dtype == ml_dtypes.bfloat16 else "f32"
        return f"{shown} overflows {name} (largest {largest:.8g})"
    return None


def is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def spell(v: object) -> str:
    """A static value as the .moe language writes it."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, tuple):
        return "[" + ", ".join(spell(i) for i in v) + "]"
    return repr(v)


def brief(v: object) -> str:
    """`spell(v)`, but a number of hundreds of digits as its length."""
    text = spell(v)
    return text if len(text) <= 24 else f"an integer of {len(text.lstrip('-'))} digits"


def _divide(a: int | float, b: int | float, loc: Loc) -> int | float:
    if b == 0:
        raise CompileError("division by zero", loc)
    if isinstance(a, int) and isinstance(b, int) and a % b == 0:
        return a // b
    return a / b


class AutoDim:
    """The value of a dim set to `auto` (`dims B = auto`, or `--set B=auto`): the block of every
    scatter whose `block=` names it is left to the cost model, as `block=auto` would; nothing
    else takes it."""

    def __repr__(self) -> str:
        return "auto"


AUTO_DIM = AutoDim()
AUTO_DIM_FORMS = "dims NAME = auto, or --set NAME=auto"
"""How a dim becomes auto, for the errors at a use other than block=."""


def evaluate_dims(defs: Sequence[ast.DimDef], overrides: Mapping[str, int | str]) -> dict[str, int]:
    """Dims in order of definition; an override replaces a dim's definition, and later dims
    that depend on it follow. A definition or an override `auto` makes the dim AUTO_DIM (a block
    left to the compiler; typed as int for every other dim's sake: only `scatter`, `static_int`
    and `binary` meet it, and all but scatter's block= refuse it where it is used)."""
    names = {d.name for d in defs}
    unknown = sorted(set(overrides) - names)
    if unknown:
        known = ", ".join(d.name for d in defs) or "none"
        raise CompileError(f"--set {unknown[0]}: no dim named {unknown[0]} (dims: {known})")
    dims: dict[str, int] = {}
    for d in defs:
        if d.name in dims:
            raise CompileError(f"dim {d.name} is defined twice", d.loc)
        if overrides.get(d.name) == "auto" or d.name not in overrides and isinstance(d.value, ast.Auto):
            value = AUTO_DIM  # type: ignore[assignment]
        elif d.name in overrides:
            value = overrides[d.name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CompileError(f"--set {d.name}={value}: a dim must be a positive integer")
        else:
            value = GraphBuilder(dims, Block()).static_int(d.value, f"dim {d.name}")
        dims[d.name] = value
    return dims


@dataclass(frozen=True)
class AutoBlock:
    """A scatter whose block size the compiler picks by its cost model (tcpc/autotune.py):
    written `block=auto` (or a dim that is auto), or given a block that cannot fit (B > T, or >
    the capacity), for which auto is the default (decode runs with the program's prefill B).
    The builder lists the scatters whose given block fits too (`fixed`): the report costs the
    compiler's choice in their place (autotune.better_blocks)."""

    graph: str
    loc: Loc
    """Where the block= argument is: the key of its choice."""
    tokens: int
    k: int
    experts: int
    capacity: int | None
    given: int | None = None
    """The program's block (or --set's), None for `block=auto`."""
    dim: str | None = None
    """The dim block= names (`block=B`), which `--set` changes; None for a literal or an expression."""

    @property
    def most(self) -> int:
        """The largest block that fits: one expert holds at most T pairs, or its capacity."""
        return self.tokens if self.capacity is None else min(self.tokens, self.capacity)

    @property
    def reason(self) -> str:
        if self.given is None:
            return "block=auto"
        held = f"T = {self.tokens} pairs" if self.capacity is None or self.capacity >= self.tokens else f"its capacity {self.capacity}"
        return f"block = {self.given} does not fit: one expert holds at most {held}"


class GraphBuilder:
    """Emits the ops of one graph into a block, each located at its expression in `filename`
    (dialects/locations.py). `blocks` gives the block size of each auto
    scatter, by the location of its block= argument (the largest that fits where not given),
    and of a scatter with a fixed block that the driver costs at other sizes; every auto
    scatter met is appended to `autos`, every one whose given block fits to `fixed`."""

    def __init__(self, dims: Mapping[str, int], block: Block, graph: str = "",
                 blocks: Mapping[Loc, int] | None = None, autos: list[AutoBlock] | None = None,
                 fixed: list[AutoBlock] | None = None, filename: str = "<string>"):
        self.dims = dict(dims)
        self.block = block
        self.graph = graph
        self.filename = filename
        self.blocks = blocks or {}
        self.autos = autos if autos is not None else []
        self.fixed = fixed if fixed is not None else []
        self.env: dict[str, Value] = {name: Static(v) for name, v in dims.items()}
        self.values: dict[int, tuple[ast.Expr, Result]] = {}
        """Each expression node (kept alive, so its id stays its own) and its value: evaluating
        a node again, as `max(e, 1)` does, emits no op twice."""

    # --- helpers -------------------------------------------------------------------------

    def emit(self, op: Operation, loc: Loc) -> Operation:
        try:
            op.verify()
        except VerifyException as e:  # a rule the frontend did not check first
            raise CompileError(f"{op.name}: {e}", loc) from None
        op.location = self.location(loc)
        self.block.add_op(op)
        return op

    def location(self, loc: Loc) -> FileLineColLoc:
        """`loc` in the IR: `loc("file":line:col)`."""
        return file_location(self.filename, loc.line, loc.col)

    def single(self, e: ast.Expr) -> Value:
        v = self.expr(e)
        if isinstance(v, tuple):
            raise CompileError(f"this call gives {len(v)} values; unpack them: `a, b = ...`", e.loc)
        return v

    def static(self, e: ast.Expr, what: str) -> Static:
        v = self.single(e)
        if not isinstance(v, Static):
            raise CompileError(f"{what} must be known at compile time, not a tensor", e.loc)
        return v

    def static_int(self, e: ast.Expr, what: str, minimum: int = 1) -> int:
        v = self.static(e, what).value
        if v is AUTO_DIM:
            raise CompileError(f"{what} cannot be auto: a dim set to auto ({AUTO_DIM_FORMS}) is only a scatter's block=",
                               e.loc)
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(e, ast.Binary) and e.op == "/" and isinstance(v, float):
                a, b = self.static(e.lhs, what).value, self.static(e.rhs, what).value
                raise CompileError(f"{what} must be an integer, but {spell(a)} / {spell(b)} does not divide exactly", e.loc)
            raise CompileError(f"{what} must be an integer, got {spell(v)}", e.loc)
        if v < minimum:
            bound = "a positive integer" if minimum == 1 else f"at least {minimum}"
            raise CompileError(f"{what} must be {bound}, got {v}", e.loc)
        return v

    def shape(self, dims: Sequence[ast.Expr]) -> list[int]:
        """Sizes that the IR can hold: each at most INDEX_MAX, their product at most ELEMENTS_MAX."""
        sizes = []
        for d in dims:
            size = self.static_int(d, "a dimension")
            if size > INDEX_MAX:
                what = f"dim {d.id} = {size}" if isinstance(d, ast.Name) else f"the size {size}"
                raise CompileError(f"{what} is too large: the lowered IR indexes an axis with i32, "
                                   f"at most {INDEX_MAX:,} (2^31 - 1)", d.loc)
            sizes.append(size)
        if dims and math.prod(sizes) > ELEMENTS_MAX:
            raise CompileError(f"a tensor of shape {format_shape(sizes)} has {math.prod(sizes):,} elements, "
                               f"more than the {ELEMENTS_MAX:,} (2^63 - 1) a shape can hold", dims[0].loc)
        return sizes

    def tensor_type(self, t: ast.TensorTypeExpr) -> TensorType:
        return TensorType(tensor_types.ELEMENT_TYPES[t.dtype], self.shape(t.dims))

    def tensor(self, e: ast.Expr, what: str = "operand") -> SSAValue:
        v = self.single(e)
        if isinstance(v, Static) or not isinstance(v.type, TensorType):
            raise CompileError(f"{what} must be a tensor", e.loc)
        return v

    def operand(self, e: ast.Expr) -> Static | SSAValue:
        """A static or a tensor: anything but the routing plan."""
        v = self.single(e)
        if isinstance(v, SSAValue) and not isinstance(v.type, TensorType):
            raise CompileError("the routing plan is not a tensor; only grouped_matmul and combine take it", e.loc)
        return v

    def constant(self, value: Static, element_type: Attribute, loc: Loc) -> SSAValue:
        v = value.value
        if not is_number(v):
            raise CompileError(f"{spell(v)} cannot be used as a number here", loc)
        if tensor_types.is_bool_type(element_type):
            raise CompileError("cannot do arithmetic on booleans", loc)
        if tensor_types.is_int_type(element_type) and not (isinstance(v, int) or v.is_integer()):
            raise CompileError(f"{v} is not an integer, and the other operand is i32; convert with f32(...)", loc)
        overflow = literal_overflow(v, element_type)
        if overflow is not None:
            raise CompileError(overflow, loc)
        return self.emit(tmath.ConstantOp(v, TensorType(element_type, [])), loc).result

    def operands(self, lhs: Value, rhs: Value, loc: Loc) -> tuple[SSAValue, SSAValue]:
        """Two tensor operands, materialising a static side in the other side's element type."""
        if isinstance(lhs, Static):
            lhs = self.constant(lhs, rhs.type.get_element_type(), loc)
        if isinstance(rhs, Static):
            rhs = self.constant(rhs, lhs.type.get_element_type(), loc)
        return lhs, rhs

    def broadcast(self, loc: Loc, *values: SSAValue) -> tuple[int, ...]:
        shape = tensor_types.broadcast_shapes(*(shape_of(v.type) for v in values))
        if shape is None:
            shown = " and ".join(format_shape(shape_of(v.type)) for v in values)
            raise CompileError(f"shapes {shown} do not broadcast", loc)
        return shape

    def promote(self, a: SSAValue, b: SSAValue, loc: Loc) -> Attribute:
        et = tensor_types.promote(a.type.get_element_type(), b.type.get_element_type())
        if et is None:
            raise CompileError(
                f"cannot mix {format_type(a.type)} and {format_type(b.type)}; "
                "convert explicitly with f32(...), bf16(...) or i32(...)",
                loc,
            )
        return et

    # --- expressions ---------------------------------------------------------------------

    def expr(self, e: ast.Expr) -> Result:
        if id(e) not in self.values:
            self.values[id(e)] = (e, self.evaluate(e))
        return self.values[id(e)][1]

    def evaluate(self, e: ast.Expr) -> Result:
        match e:
            case ast.Number(value=v) | ast.String(value=v):
                return Static(v)
            case ast.Auto():
                raise CompileError("'auto' is a value only scatter's block= takes, or a dim it names (the "
                                   "compiler then picks the block size by its cost model)", e.loc)
            case ast.Name(id=name):
                if name in self.env:
                    return self.env[name]
                if name in CONSTANTS:
                    return Static(CONSTANTS[name])
                raise CompileError(f"unknown name '{name}'", e.loc)
            case ast.TupleExpr(items=items):
                return tuple(self.single(i) for i in items)
            case ast.ListExpr(items=items):
                return Static(tuple(self.static_int(i, "a list item", minimum=-(2**31)) for i in items))
            case ast.Neg(operand=operand):
                v = self.operand(operand)
                if isinstance(v, Static):
                    if not is_number(v.value):
                        raise CompileError(f"cannot negate {spell(v.value)}", e.loc)
                    return Static(-v.value)
                self.check_arith(v, e.loc)
                return self.emit(tmath.NegOp(v), e.loc).result
            case ast.Binary():
                return self.binary(e)
            case ast.Convert(dtype=dtype, operand=operand):
                x = self.tensor(operand, f"the operand of {dtype}(...)")
                self.check_not_quantized(dtype, x, e.loc)
                shape = shape_of(x.type)
                return self.emit(tmath.CastOp(x, TensorType(tensor_types.ELEMENT_TYPES[dtype], shape)), e.loc).result
            case ast.Call():
                return self.call(e)
        raise AssertionError(f"unhandled expression {e}")

    def check_arith(self, v: SSAValue, loc: Loc) -> None:
        if tensor_types.is_bool_type(v.type.get_element_type()):
            raise CompileError("cannot do arithmetic on booleans; use where(...)", loc)
        self.check_stored_only(v, loc)

    def check_stored_only(self, v: SSAValue, loc: Loc) -> None:
        """Low-precision values and e8m0 scales take no arithmetic: they are dequantized or
        multiplied in matched pairs by grouped_matmul / scaled_matmul with their scales."""
        if tensor_types.is_stored_only(v.type.get_element_type()):
            raise CompileError(
                f"{format_type(v.type)} is stored-only and takes no arithmetic; use dequantize(values, scales), "
                "or grouped_matmul(..., scales=(xs, ws)) / scaled_matmul(...)",
                loc,
            )

    def check_not_quantized(self, dtype: str, x: SSAValue, loc: Loc) -> None:
        """Conversions between float types only: quantized values need their scales."""
        target = tensor_types.ELEMENT_TYPES[dtype]
        if tensor_types.is_code_type(target):
            raise CompileError(f"{dtype}(...): codebook indices are stored data, declared as an argument, not a conversion", loc)
        if tensor_types.is_stored_only(target):
            raise CompileError(f"{dtype}(...) would drop the block scales; use quantize(x, {dtype}, group=...)", loc)
        self.check_stored_only(x, loc)

    def binary(self, e: ast.Binary) -> Value:
        lhs, rhs = self.operand(e.lhs), self.operand(e.rhs)
        if isinstance(lhs, Static) and isinstance(rhs, Static):
            a, b = lhs.value, rhs.value
            if AUTO_DIM in (a, b):
                raise CompileError(f"cannot apply '{e.op}' to auto: a dim set to auto ({AUTO_DIM_FORMS}) is only "
                                   "a scatter's block=", e.loc)
            if not (is_number(a) and is_number(b)) and e.op not in ("==", "!="):
                raise CompileError(f"cannot apply '{e.op}' to {spell(a)} and {spell(b)}", e.loc)
            if e.op == "/":
                return Static(_divide(a, b, e.loc))
            if e.op == "@":
                raise CompileError("'@' needs tensor operands", e.loc)
            try:
                folded = FOLD[e.op](a, b)
            except OverflowError:  # an int too large for a float
                raise CompileError(f"{brief(a)} {e.op} {brief(b)} overflows a 64-bit float", e.loc) from None
            if (isinstance(folded, float) and not math.isfinite(folded)
                    and not any(isinstance(v, float) and not math.isfinite(v) for v in (a, b))):
                raise CompileError(f"{brief(a)} {e.op} {brief(b)} overflows a 64-bit float", e.loc)
            return Static(folded)
        if e.op == "@":
            if isinstance(lhs, Static) or isinstance(rhs, Static):
                raise CompileError("'@' needs tensor operands", e.loc)
            return self.matmul(lhs, rhs, e.loc)
        lhs, rhs = self.operands(lhs, rhs, e.loc)
        et = self.promote(lhs, rhs, e.loc)
        shape = self.broadcast(e.loc, lhs, rhs)
        if e.op in CMP_PREDICATE:
            return self.emit(tmath.CmpOp(CMP_PREDICATE[e.op], lhs, rhs, TensorType(i1, shape)), e.loc).result
        self.check_arith(lhs, e.loc)
        if e.op == "/" and tensor_types.is_int_type(et):
            raise CompileError("integer division is not supported; convert with f32(...) first", e.loc)
        return self.emit(ARITH_OPS[e.op](lhs, rhs, TensorType(et, shape)), e.loc).result

    def matmul(self, lhs: SSAValue, rhs: SSAValue, loc: Loc) -> SSAValue:
        ls, rs = shape_of(lhs.type), shape_of(rhs.type)
        shape = tensor_types.matmul_shape(ls, rs)
        if shape is None:
            if len(ls) < 2 or len(rs) < 2:
                reason = "'@' needs operands of rank 2 or more"
            elif ls[-1] != rs[-2]:
                reason = f"the inner dimensions {ls[-1]} and {rs[-2]} differ"
            else:
                reason = f"the batch shapes {format_shape(ls[:-2])} and {format_shape(rs[:-2])} do not broadcast"
            raise CompileError(f"cannot multiply {format_type(lhs.type)} by {format_type(rhs.type)}: {reason}", loc)
        et = self.promote(lhs, rhs, loc)
        if not tensor_types.is_float_type(et):
            raise CompileError("'@' needs float operands", loc)
        return self.emit(tmath.MatmulOp(lhs, rhs, TensorType(et, shape)), loc).result

    # --- calls ---------------------------------------------------------------------------

    def bind(
        self, call: ast.Call, positional: Sequence[str], optional: Mapping[str, object] = {}
    ) -> dict[str, ast.Expr | object]:
        """Match a call's arguments to the builtin's parameters (positional or by keyword)."""
        names = list(positional) + list(optional)
        if len(call.args) > len(names):
            most = "at most " if optional else ""
            raise CompileError(
                f"{call.func}() takes {most}{plural(len(names), 'argument')} ({', '.join(names)}), got {len(call.args)}",
                call.loc,
            )
        bound: dict[str, ast.Expr | object] = dict(zip(names, call.args))
        for kw in call.keywords:
            if kw.name not in names:
                raise CompileError(f"{call.func}() has no argument '{kw.name}' (it takes {', '.join(names)})", kw.loc)
            if kw.name in bound:
                raise CompileError(f"{call.func}() got '{kw.name}' twice", kw.loc)
            bound[kw.name] = kw.value
        missing = [n for n in positional if n not in bound]
        if missing:
            raise CompileError(f"{call.func}() is missing argument '{missing[0]}'", call.loc)
        for name, default in optional.items():
            bound.setdefault(name, default)
        return bound

    def axes(self, e: ast.Expr | None, rank: int, what: str) -> list[int]:
        if e is None:
            return list(range(rank))
        raw = self.static(e, what).value
        items = raw if isinstance(raw, tuple) else (raw,)
        axes = []
        for a in items:
            if isinstance(a, bool) or not isinstance(a, int):
                raise CompileError(f"{what} must be an integer or a list of integers", e.loc)
            n = tensor_types.normalize_axis(a, rank)
            if n is None:
                raise CompileError(f"{what} {a} is out of range for rank {rank}", e.loc)
            axes.append(n)
        if len(set(axes)) != len(axes):
            raise CompileError(f"{what} repeats an axis", e.loc)
        return sorted(axes)

    def flag(self, e: ast.Expr | object, what: str) -> bool:
        if isinstance(e, bool):
            return e
        v = self.static(e, what).value
        if not isinstance(v, bool):
            raise CompileError(f"{what} must be true or false", e.loc)
        return v

    def call(self, c: ast.Call) -> Result:
        handler = getattr(self, f"call_{c.func}", None)
        if c.func in UNARY_BUILTINS:
            op_type = UNARY_BUILTINS[c.func]
            x = self.tensor(self.bind(c, ["x"])["x"], f"the argument of {c.func}")
            et = x.type.get_element_type()
            if not (tensor_types.is_float_type(et) or (op_type.ALLOWS_INT and tensor_types.is_int_type(et))):
                kind = "a float or i32" if op_type.ALLOWS_INT else "a float"
                raise CompileError(f"{c.func}() needs {kind} tensor, got {format_type(x.type)}", c.loc)
            return self.emit(op_type(x), c.loc).result
        if c.func in REDUCE_BUILTINS:
            return self.reduce(c)
        if handler is None:
            raise CompileError(f"unknown function '{c.func}'", c.loc)
        return handler(c)

    def reduce(self, c: ast.Call) -> Value:
        if c.func in ("max", "min") and len(c.args) >= 2 and not c.keywords:
            values = [self.single(a) for a in c.args]
            if all(isinstance(v, Static) for v in values):  # max(T, 4) on dims
                for v, a in zip(values, c.args):
                    if not is_number(v.value):
                        raise CompileError(f"{c.func}() takes numbers or a tensor, got {spell(v.value)}", a.loc)
                fold = max if c.func == "max" else min
                return Static(fold(v.value for v in values))
        args = self.bind(c, ["x"], {"axis": None, "keepdims": False})
        x = self.tensor(args["x"], f"the argument of {c.func}")
        self.check_stored_only(x, c.loc)
        if tensor_types.is_bool_type(x.type.get_element_type()):
            raise CompileError(f"{c.func}() of booleans; convert with i32(...) first", c.loc)
        shape = shape_of(x.type)
        axes = self.axes(args["axis"], len(shape), "axis")
        keepdims = self.flag(args["keepdims"], "keepdims")
        result = TensorType(x.type.get_element_type(), tensor_types.reduced_shape(shape, axes, keepdims))
        return self.emit(REDUCE_BUILTINS[c.func](x, axes, keepdims, result), c.loc).result

    def elementwise(self, c: ast.Call, op_type: type[tmath.ElementwiseBinaryOp], lhs: Value, rhs: Value) -> Value:
        if isinstance(lhs, Static) and isinstance(rhs, Static):
            if not (is_number(lhs.value) and is_number(rhs.value)):
                raise CompileError(f"{c.func}() takes numbers or tensors, got {spell(lhs.value)} and {spell(rhs.value)}", c.loc)
            fold = max if op_type is tmath.MaximumOp else min
            return Static(fold(lhs.value, rhs.value))
        lhs, rhs = self.operands(lhs, rhs, c.loc)
        et = self.promote(lhs, rhs, c.loc)
        self.check_arith(lhs, c.loc)
        shape = self.broadcast(c.loc, lhs, rhs)
        return self.emit(op_type(lhs, rhs, TensorType(et, shape)), c.loc).result

    def call_maximum(self, c: ast.Call) -> Value:
        args = self.bind(c, ["a", "b"])
        return self.elementwise(c, tmath.MaximumOp, self.operand(args["a"]), self.operand(args["b"]))

    def call_minimum(self, c: ast.Call) -> Value:
        args = self.bind(c, ["a", "b"])
        return self.elementwise(c, tmath.MinimumOp, self.operand(args["a"]), self.operand(args["b"]))

    def call_clamp(self, c: ast.Call) -> Value:
        """clamp(x, lo, hi) = minimum(maximum(x, lo), hi); NaN stays NaN."""
        args = self.bind(c, ["x", "lo", "hi"])
        lo, hi = self.operand(args["lo"]), self.operand(args["hi"])
        if (isinstance(lo, Static) and isinstance(hi, Static) and is_number(lo.value) and is_number(hi.value)
                and lo.value > hi.value):
            raise CompileError(f"clamp bounds are reversed: {spell(lo.value)} > {spell(hi.value)}", c.loc)
        low = self.elementwise(c, tmath.MaximumOp, self.operand(args["x"]), lo)
        return self.elementwise(c, tmath.MinimumOp, low, hi)

    def call_softmax(self, c: ast.Call) -> Value:
        args = self.bind(c, ["x"], {"axis": ast.Number(c.loc, -1)})
        x = self.tensor(args["x"], "the argument of softmax")
        if not tensor_types.is_float_type(x.type.get_element_type()):
            raise CompileError(f"softmax() needs a float tensor, got {format_type(x.type)}", c.loc)
        axes = self.axes(args["axis"], len(shape_of(x.type)), "axis")
        if len(axes) != 1:
            raise CompileError("softmax() takes one axis", c.loc)
        return self.emit(tmath.SoftmaxOp(x, axes[0]), c.loc).result

    def call_where(self, c: ast.Call) -> Value:
        args = self.bind(c, ["cond", "a", "b"])
        cond = self.tensor(args["cond"], "the condition of where")
        if not tensor_types.is_bool_type(cond.type.get_element_type()):
            raise CompileError(f"where() needs a boolean condition (a comparison), got {format_type(cond.type)}", c.loc)
        a, b = self.operand(args["a"]), self.operand(args["b"])
        if isinstance(a, Static) and isinstance(b, Static):
            raise CompileError(
                "where() needs a tensor for at least one branch (it takes its element type); "
                "for a 0/1 mask convert the condition: f32(...) or i32(...)",
                c.loc,
            )
        a, b = self.operands(a, b, c.loc)
        et = self.promote(a, b, c.loc)
        shape = self.broadcast(c.loc, cond, a, b)
        return self.emit(tmath.SelectOp(cond, a, b, TensorType(et, shape)), c.loc).result

    def call_reshape(self, c: ast.Call) -> Value:
        args = self.bind(c, ["x", "shape"])
        x = self.tensor(args["x"], "the argument of reshape")
        shape_expr = args["shape"]
        if not isinstance(shape_expr, ast.ListExpr):
            raise CompileError("reshape() takes the new shape as a list: reshape(x, [T, G, E / G])", c.loc)
        shape = self.shape(shape_expr.items)
        if math.prod(shape) != math.prod(shape_of(x.type)):
            raise CompileError(
                f"cannot reshape {format_type(x.type)} ({math.prod(shape_of(x.type))} elements) "
                f"to {format_shape(shape)} ({math.prod(shape)} elements)",
                c.loc,
            )
        return self.emit(tmath.ReshapeOp(x, TensorType(x.type.get_element_type(), shape)), c.loc).result

    def int_tensor(self, e: ast.Expr, what: str) -> SSAValue:
        v = self.tensor(e, what)
        if not tensor_types.is_int_type(v.type.get_element_type()):
            raise CompileError(f"{what} must be i32, got {format_type(v.type)}", e.loc)
        return v

    def call_one_hot(self, c: ast.Call) -> Value:
        args = self.bind(c, ["indices", "depth"])
        idx = self.int_tensor(args["indices"], "the indices of one_hot")
        depth = self.static_int(args["depth"], "one_hot depth")
        return self.emit(tmath.OneHotOp(idx, depth), c.loc).result

    def call_take(self, c: ast.Call) -> Value:
        args = self.bind(c, ["x", "indices"])
        x = self.tensor(args["x"], "the argument of take")
        idx = self.int_tensor(args["indices"], "the indices of take")
        xs, ids = shape_of(x.type), shape_of(idx.type)
        if len(xs) != len(ids) or xs[:-1] != ids[:-1]:
            raise CompileError(
                f"take() picks along the last axis: {format_type(x.type)} and indices "
                f"{format_type(idx.type)} must agree on every other axis",
                c.loc,
            )
        return self.emit(tmath.TakeOp(x, idx), c.loc).result

    def call_topk(self, c: ast.Call) -> Result:
        args = self.bind(c, ["x", "k"], {"order": "score"})
        x = self.tensor(args["x"], "the scores of topk")
        if tensor_types.is_bool_type(x.type.get_element_type()):
            raise CompileError("topk() of booleans; convert with i32(...) first", c.loc)
        shape = shape_of(x.type)
        if not shape:
            raise CompileError("topk() needs at least one axis", c.loc)
        k = self.static_int(args["k"], "topk k")
        if k > shape[-1]:
            raise CompileError(f"topk: K = {k} exceeds the {shape[-1]} candidates on the last axis of {format_type(x.type)}", args["k"].loc)
        order = args["order"] if isinstance(args["order"], str) else self.static(args["order"], "order").value
        if order not in moe.TOPK_ORDERS:
            raise CompileError(
                f"topk order must be one of {', '.join(map(spell, moe.TOPK_ORDERS))}, got {spell(order)}",
                args["order"].loc,
            )
        op = self.emit(moe.TopKOp(x, k, order), c.loc)
        return op.values, op.indices

    def call_scatter(self, c: ast.Call) -> Result:
        args = self.bind(c, ["x", "experts_idx"], {"experts": None, "block": None, "capacity": None})
        for required in ("experts", "block"):
            if args[required] is None:
                raise CompileError(f"scatter() needs {required}=...", c.loc)
        x = self.tensor(args["x"], "the tokens of scatter")
        idx = self.int_tensor(args["experts_idx"], "the chosen experts of scatter")
        xs, ids = shape_of(x.type), shape_of(idx.type)
        if len(xs) != 2:
            raise CompileError(f"scatter() takes tokens [T, D], got {format_type(x.type)}", args["x"].loc)
        if len(ids) != 2 or ids[0] != xs[0]:
            raise CompileError(
                f"scatter() takes the chosen experts as [T, K] with T = {xs[0]}, got {format_type(idx.type)}",
                args["experts_idx"].loc,
            )
        experts = self.static_int(args["experts"], "experts")
        if isinstance(args["block"], ast.String):
            raise CompileError(f"block must be an integer or auto (a word, not a string), got {spell(args['block'].value)}",
                               args["block"].loc)
        auto = isinstance(args["block"], ast.Auto) or self.static(args["block"], "block").value is AUTO_DIM
        given = None if auto else self.static_int(args["block"], "block")
        capacity = None if args["capacity"] is None else self.static_int(args["capacity"], "capacity")
        tokens, k = ids
        if tokens * k > INDEX_MAX:
            raise CompileError(f"scatter: T * K = {tokens} * {k} = {tokens * k:,} token choices, more than the "
                               f"{INDEX_MAX:,} (2^31 - 1) the lowered routing numbers in i32", c.loc)
        if k > experts:
            raise CompileError(f"scatter: K = {k} exceeds E = {experts} (a token picks K distinct experts)", c.loc)
        named = args["block"]
        dim = named.id if isinstance(named, ast.Name) and named.id in self.dims else None
        scatter = AutoBlock(self.graph, named.loc, tokens, k, experts, capacity, given, dim)
        if given is not None and given <= scatter.most:  # used as written
            self.fixed.append(scatter)
            block = self.blocks.get(scatter.loc, given)
        else:  # auto: the driver picks among blocks that fit
            self.autos.append(scatter)
            block = self.blocks.get(scatter.loc, scatter.most)
        route = moe.RouteType.make(tokens, k, experts, block, capacity)
        rows = route.blocks.data * block
        if rows > INDEX_MAX:
            raise CompileError(f"scatter: G * B = {route.blocks.data} * {block} = {rows:,} blocked rows, more than the "
                               f"{INDEX_MAX:,} (2^31 - 1) the lowered routing addresses in i32", c.loc)
        op = self.emit(moe.ScatterOp(x, idx, route), c.loc)
        return op.blocked, op.route

    def route(self, e: ast.Expr) -> SSAValue:
        v = self.single(e)
        if isinstance(v, Static) or not isinstance(v.type, moe.RouteType):
            raise CompileError("expected the routing plan (the second result of scatter)", e.loc)
        return v

    def call_grouped_matmul(self, c: ast.Call) -> Value:
        args = self.bind(c, ["x", "w", "route"], {"bias": None, "scales": None})
        x = self.tensor(args["x"], "the blocks of grouped_matmul")
        w = self.tensor(args["w"], "the expert weights of grouped_matmul")
        route = self.route(args["route"])
        r = route.type
        g, b, e = r.blocks.data, r.block.data, r.experts.data
        xs, ws = shape_of(x.type), shape_of(w.type)
        if len(xs) != 3 or xs[:2] != (g, b):
            raise CompileError(f"grouped_matmul blocks must be [G, B, D] = [{g}, {b}, D], got {format_type(x.type)}", args["x"].loc)
        if len(ws) != 3 or ws[0] != e or ws[1] != xs[2]:
            raise CompileError(
                f"grouped_matmul weights must be [E, D, F] = [{e}, {xs[2]}, F], got {format_type(w.type)}",
                args["w"].loc,
            )
        bias = None
        if args["bias"] is not None:
            bias = self.tensor(args["bias"], "the bias of grouped_matmul")
            if shape_of(bias.type) != (e, ws[2]) or not tensor_types.is_float_type(bias.type.get_element_type()):
                raise CompileError(
                    f"grouped_matmul bias must be a float [E, F] = [{e}, {ws[2]}], got {format_type(bias.type)}",
                    args["bias"].loc,
                )
        if args["scales"] is not None or self.quantized(x) or self.quantized(w):
            x_scales, w_scales = self.scales(c, args["scales"], x, w, "grouped_matmul")
            self.check_scale_shape(x_scales, (g, b, None), x, args["scales"], "grouped_matmul input scales", "[G, B, D / group]")
            self.check_scale_shape(w_scales, (e, None, None), w, args["scales"], "grouped_matmul weight scales", "[E, D / kw, F / nb]")
            self.check_k_blocks(xs[2] // shape_of(x_scales.type)[2], ws[1] // shape_of(w_scales.type)[1], args["scales"])
            return self.emit(moe.ScaledGroupedMatmulOp(x, w, route, x_scales, w_scales, bias), c.loc).result
        et = self.promote(x, w, c.loc)
        if not tensor_types.is_float_type(et):
            raise CompileError("grouped_matmul needs float tensors", c.loc)
        return self.emit(moe.GroupedMatmulOp(x, w, route, bias), c.loc).result

    # --- low precision -------------------------------------------------------------------

    @staticmethod
    def quantized(v: SSAValue) -> bool:
        return tensor_types.is_low_precision_type(v.type.get_element_type())

    def scales(self, c: ast.Call, e: ast.Expr | None, x: SSAValue, w: SSAValue, what: str
               ) -> tuple[SSAValue, SSAValue]:
        """The `scales=(xs, ws)` of a block-scaled contraction, after checking the operand pair."""
        xt, wt = x.type.get_element_type(), w.type.get_element_type()
        if tensor_types.contraction_pair(xt, wt) is None:
            raise CompileError(
                f"{what} cannot multiply {format_type(x.type)} by {format_type(w.type)}: the contraction engine "
                f"takes matched pairs (bf16 x bf16; {tensor_types.describe_pairs()}); quantize the input "
                "with quantize(x, f8e4m3, group=...)",
                c.loc,
            )
        if e is None:
            raise CompileError(f"{what} of quantized values needs their block scales: scales=(xs, ws)", c.loc)
        v = self.expr(e)
        if not (isinstance(v, tuple) and len(v) == 2 and all(isinstance(i, SSAValue) and isinstance(i.type, TensorType) for i in v)):
            raise CompileError("scales= takes two tensors: scales=(input_scales, weight_scales)", e.loc)
        for s in v:
            if not tensor_types.is_scale_type(s.type.get_element_type()):
                raise CompileError(f"block scales must be f32, bf16 or e8m0, got {format_type(s.type)}", e.loc)
        return v[0], v[1]

    def check_scale_shape(self, scales: SSAValue, fixed: Sequence[int | None], values: SSAValue,
                          e: ast.Expr, what: str, form: str) -> None:
        """Scales of the values' rank, equal to `fixed` where it is given, dividing the values
        into whole blocks elsewhere."""
        ss, vs = shape_of(scales.type), shape_of(values.type)
        ok = tensor_types.block_shape(vs, ss) is not None and all(f is None or f == s for f, s in zip(fixed, ss))
        if not ok:
            raise CompileError(
                f"{what} must be {form} dividing {format_type(values.type)} into whole blocks, got {format_type(scales.type)}",
                e.loc,
            )

    def check_k_blocks(self, kx: int, kw: int, e: ast.Expr) -> None:
        if lowp.k_block(kx, kw) is None:
            raise CompileError(
                f"the scales' blocks along the reduced axis ({kx} for the input, {kw} for the weight) "
                "do not nest: one must divide the other",
                e.loc,
            )

    def call_quantize(self, c: ast.Call) -> Result:
        args = self.bind(c, ["x", "dtype"], {"group": None})
        x = self.tensor(args["x"], "the argument of quantize")
        if not tensor_types.is_float_type(x.type.get_element_type()):
            raise CompileError(f"quantize() takes bf16 or f32, got {format_type(x.type)}", args["x"].loc)
        dtype = self.static(args["dtype"], "the type of quantize").value
        if dtype not in ("f8e4m3", "f8e5m2"):
            raise CompileError(
                f"quantize() gives f8e4m3 or f8e5m2 (what the cast engine writes), got {spell(dtype)}", args["dtype"].loc
            )
        if args["group"] is None:
            raise CompileError("quantize() needs group=... (elements per scale along the last axis)", c.loc)
        shape = shape_of(x.type)
        group = self.static_int(args["group"], "group")
        if not shape or shape[-1] % group:
            raise CompileError(f"quantize: group {group} does not divide the last axis of {format_type(x.type)}", args["group"].loc)
        op = self.emit(lowp.QuantizeOp(x, tensor_types.ELEMENT_TYPES[dtype], group), c.loc)
        return op.values, op.scales

    def call_dequantize(self, c: ast.Call) -> Value:
        args = self.bind(c, ["values", "scales"], {"block": None, "grid": None, "signs": None})
        values = self.tensor(args["values"], "the values of dequantize")
        scales = self.tensor(args["scales"], "the scales of dequantize")
        vt = values.type
        coded = tensor_types.is_code_type(vt.get_element_type())
        if not (self.quantized(values) or coded):
            raise CompileError(f"dequantize() takes f8e4m3, f8e5m2, f4e2m1 or u3 values, got {format_type(vt)}", args["values"].loc)
        if not tensor_types.is_scale_type(scales.type.get_element_type()):
            raise CompileError(f"block scales must be f32, bf16 or e8m0, got {format_type(scales.type)}", args["scales"].loc)
        vs = shape_of(vt)
        block = None if args["block"] is None else self.block_sizes(args["block"], vt)
        if block is None:
            self.check_scale_shape(scales, [None] * len(vs), values, args["scales"], "dequantize scales", "of the values' rank")
        elif shape_of(scales.type) != tensor_types.scales_shape(vs, block):
            want = format_shape(tensor_types.scales_shape(vs, block))
            raise CompileError(f"dequantize scales must be {want} ({format_type(vt)} in blocks of {format_shape(block)}, "
                               f"ceil-divided), got {format_type(scales.type)}", args["scales"].loc)
        grid = self.grid(c, args["grid"], values)
        su = sv = None
        if args["signs"] is not None:
            su, sv = self.signs(args["signs"], values)
        return self.emit(lowp.DequantizeOp(values, scales, block, grid, su, sv), c.loc).result

    def block_sizes(self, e: ast.Expr, values: Attribute) -> list[int]:
        """`block=[b0, b1, ...]`: one positive size per axis of the values."""
        rank = len(shape_of(values))
        if not isinstance(e, ast.ListExpr) or len(e.items) != rank:
            raise CompileError(f"block= takes a list of {rank} sizes, one per axis of {format_type(values)}: "
                               f"block=[1, g, 1] for a scale per group of g along K", e.loc)
        return [self.static_int(item, "a block size") for item in e.items]

    def grid(self, c: ast.Call, e: ast.Expr | None, values: SSAValue) -> SSAValue | None:
        """`grid=g` of u3 codes: bf16 or f32 [8], a value per code; refused for any other values."""
        if not tensor_types.is_code_type(values.type.get_element_type()):
            if e is not None:
                raise CompileError(f"grid= decodes u3 codes; {format_type(values.type)} values decode by their type", e.loc)
            return None
        if e is None:
            raise CompileError(f"dequantize() of u3 codes needs their grid: grid=g, bf16 or f32 [{lowp.GRID_SIZE}]", c.loc)
        grid = self.tensor(e, "the grid of dequantize")
        if not (tensor_types.is_float_type(grid.type.get_element_type()) and shape_of(grid.type) == (lowp.GRID_SIZE,)):
            raise CompileError(f"the grid of u3 codes must be bf16 or f32 [{lowp.GRID_SIZE}] (one value per code), "
                               f"got {format_type(grid.type)}", e.loc)
        return grid

    def signs(self, e: ast.Expr, values: SSAValue) -> tuple[SSAValue, SSAValue]:
        """`signs=(su, sv)` of values [..., K, N]: su [..., K] and sv [..., N], bf16 or f32."""
        vs = shape_of(values.type)
        v = self.expr(e)
        if not (isinstance(v, tuple) and len(v) == 2 and all(isinstance(i, SSAValue) and isinstance(i.type, TensorType) for i in v)):
            raise CompileError("signs= takes two tensors: signs=(su, sv), one value per row K and per column N", e.loc)
        if len(vs) < 2:
            raise CompileError(f"signs= needs values [..., K, N], got {format_type(values.type)}", e.loc)
        for sign, name, want in zip(v, ("su", "sv"), (vs[:-1], (*vs[:-2], vs[-1]))):
            if not (tensor_types.is_float_type(sign.type.get_element_type()) and shape_of(sign.type) == want):
                raise CompileError(f"signs=(su, sv): {name} must be bf16 or f32 {format_shape(want)} for values "
                                   f"{format_type(values.type)}, got {format_type(sign.type)}", e.loc)
        return v[0], v[1]

    def call_ceil(self, c: ast.Call) -> Value:
        """`ceil(D / g)`: the smallest integer at least a static number; exact for a quotient of integers."""
        e = self.bind(c, ["x"])["x"]
        if isinstance(e, ast.Binary) and e.op == "/":
            a, b = self.static(e.lhs, "the argument of ceil").value, self.static(e.rhs, "the argument of ceil").value
            if isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool) and not isinstance(b, bool) and b:
                return Static(-(-a // b))
        v = self.static(e, "the argument of ceil").value
        if not is_number(v) or isinstance(v, float) and not math.isfinite(v):
            raise CompileError(f"ceil() takes a finite number, got {spell(v)}", e.loc)
        return Static(math.ceil(v))

    def call_scaled_matmul(self, c: ast.Call) -> Value:
        args = self.bind(c, ["x", "w"], {"scales": None})
        x = self.tensor(args["x"], "the input of scaled_matmul")
        w = self.tensor(args["w"], "the weight of scaled_matmul")
        xs, ws = shape_of(x.type), shape_of(w.type)
        if len(xs) != 2 or len(ws) != 2 or xs[1] != ws[0]:
            raise CompileError(f"scaled_matmul takes [M, K] and [K, N], got {format_type(x.type)} and {format_type(w.type)}", c.loc)
        x_scales, w_scales = self.scales(c, args["scales"], x, w, "scaled_matmul")
        self.check_scale_shape(x_scales, (xs[0], None), x, args["scales"], "scaled_matmul input scales", "[M, K / group]")
        self.check_scale_shape(w_scales, (None, None), w, args["scales"], "scaled_matmul weight scales", "[K / kw, N / nb]")
        self.check_k_blocks(xs[1] // shape_of(x_scales.type)[1], ws[0] // shape_of(w_scales.type)[0], args["scales"])
        return self.emit(lowp.ScaledMatmulOp(x, w, x_scales, w_scales, TensorType(tensor_types.ELEMENT_TYPES["bf16"], [xs[0], ws[1]])), c.loc).result

    def call_combine(self, c: ast.Call) -> Value:
        args = self.bind(c, ["x", "route"], {"weights": None})
        x = self.tensor(args["x"], "the blocks of combine")
        route = self.route(args["route"])
        r = route.type
        xs = shape_of(x.type)
        if len(xs) != 3 or xs[:2] != (r.blocks.data, r.block.data):
            raise CompileError(
                f"combine blocks must be [G, B, D] = [{r.blocks.data}, {r.block.data}, D], got {format_type(x.type)}",
                args["x"].loc,
            )
        if not tensor_types.is_float_type(x.type.get_element_type()):
            raise CompileError("combine needs float blocks", c.loc)
        weights = None
        if args["weights"] is not None:
            weights = self.tensor(args["weights"], "the weights of combine")
            want = (r.tokens.data, r.k.data)
            if shape_of(weights.type) != want or not tensor_types.is_float_type(weights.type.get_element_type()):
                raise CompileError(
                    f"combine weights must be a float [T, K] = {format_shape(want)}, got {format_type(weights.type)}",
                    args["weights"].loc,
                )
        return self.emit(moe.CombineOp(x, route, weights), c.loc).result

    # --- statements ----------------------------------------------------------------------

    def assign(self, s: ast.Assign) -> None:
        value = self.expr(s.value)
        values = value if isinstance(value, tuple) else (value,)
        if len(values) != len(s.targets):
            raise CompileError(
                f"{plural(len(s.targets), 'name')} on the left, but the right gives {plural(len(values), 'value')}", s.loc
            )
        for target, v in zip(s.targets, values):
            if target.id == "_":
                continue
            if target.id in self.dims:
                raise CompileError(f"'{target.id}' is a dim and cannot be assigned", target.loc)
            if target.id in CONSTANTS:
                raise CompileError(f"'{target.id}' is a constant and cannot be assigned", target.loc)
            if isinstance(v, SSAValue) and v.name_hint is None:
                v.name_hint = target.id
            self.env[target.id] = v


def build_graph(graph: ast.Graph, dims: Mapping[str, int], blocks: Mapping[Loc, int] | None = None,
                autos: list[AutoBlock] | None = None, fixed: list[AutoBlock] | None = None,
                filename: str = "<string>") -> func.FuncOp:
    gb = GraphBuilder(dims, Block(), graph.name, blocks, autos, fixed, filename)
    arg_types = []
    for p in graph.params:
        if p.name in dims:
            raise CompileError(f"parameter '{p.name}' has the name of a dim", p.loc)
        if p.name in gb.env:
            raise CompileError(f"parameter '{p.name}' is declared twice", p.loc)
        t = gb.tensor_type(p.type)
        arg = gb.block.insert_arg(t, len(arg_types), gb.location(p.loc))
        arg.name_hint = p.name
        arg_types.append(t)
        gb.env[p.name] = arg
    result_types = [gb.tensor_type(t) for t in graph.results]
    returns = [s for s in graph.body if isinstance(s, ast.Return)]
    if not returns:
        raise CompileError(f"graph '{graph.name}' has no return statement", graph.loc)
    for s in graph.body:
        if isinstance(s, ast.Return):
            if s is not graph.body[-1]:
                raise CompileError("return must be the last statement of a graph", s.loc)
            values = [gb.tensor(v, "a returned value") for v in s.values]
            if len(values) != len(result_types):
                raise CompileError(
                    f"graph '{graph.name}' declares {plural(len(result_types), 'result')} but returns {len(values)}",
                    s.loc,
                )
            for v, want, e in zip(values, result_types, s.values):
                if v.type != want:
                    raise CompileError(f"returned {format_type(v.type)}, but the graph declares {format_type(want)}", e.loc)
            ret = func.ReturnOp(*values)
            ret.location = gb.location(s.loc)
            gb.block.add_op(ret)
        else:
            gb.assign(s)
    fn = func.FuncOp(graph.name, (arg_types, result_types), Region(gb.block))
    fn.location = gb.location(graph.loc)
    return fn


def build_module(program: ast.Program, dims: Mapping[str, int], blocks: Mapping[Loc, int] | None = None,
                 autos: list[AutoBlock] | None = None, fixed: list[AutoBlock] | None = None,
                 filename: str = "<string>") -> ModuleOp:
    """One func.func per graph, with dims already evaluated by `evaluate_dims`, every op located
    in `filename`; auto scatters take their block from `blocks` (see GraphBuilder) and are
    listed in `autos`, the others in `fixed`."""
    if not program.graphs:
        raise CompileError("the file defines no graph", Loc(1, 1))
    seen: dict[str, ast.Graph] = {}
    for g in program.graphs:
        if g.name in seen:
            raise CompileError(f"graph '{g.name}' is defined twice", g.loc)
        seen[g.name] = g
    module = ModuleOp([build_graph(g, dims, blocks, autos, fixed, filename) for g in program.graphs])
    module.verify()
    return module

