"""Element types, shapes and the type rules every dialect shares.

The .moe frontend, the verifiers of `tmath`, `moe`, `tcp` and `ve`, the simulator and the CLI
all state a tensor's type, broadcast shapes and promote element types by these functions, so a
rule reads the same in an error message and in a verifier.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from xdsl.dialects.builtin import BFloat16Type, Float32Type, IntegerType, TensorType, bf16, f32, i1, i32
from xdsl.ir import Attribute
from xdsl.utils.exceptions import VerifyException

ELEMENT_TYPES: dict[str, Attribute] = {"bf16": bf16, "f32": f32, "i32": i32, "i1": i1}


def type_name(element_type: Attribute) -> str:
    """The element type as the .moe language says it; comparison results are `bool`."""
    if is_bool_type(element_type):
        return "bool"
    for name, t in ELEMENT_TYPES.items():
        if t == element_type:
            return name
    return str(element_type)


def is_float_type(element_type: Attribute) -> bool:
    return isinstance(element_type, BFloat16Type | Float32Type)


def is_int_type(element_type: Attribute) -> bool:
    return isinstance(element_type, IntegerType) and element_type.width.data == 32


def is_bool_type(element_type: Attribute) -> bool:
    return isinstance(element_type, IntegerType) and element_type.width.data == 1


def shape_of(t: Attribute) -> tuple[int, ...]:
    assert isinstance(t, TensorType)
    return tuple(t.get_shape())


def format_shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def format_type(t: Attribute) -> str:
    """A tensor type as the .moe language writes it: `bf16[16, 64]`."""
    if isinstance(t, TensorType):
        return type_name(t.get_element_type()) + format_shape(shape_of(t))
    return str(t)


def broadcast_shapes(*shapes: Sequence[int]) -> tuple[int, ...] | None:
    """numpy's broadcast rule, or None when the shapes do not broadcast."""
    rank = max((len(s) for s in shapes), default=0)
    result: list[int] = []
    for axis in range(rank):
        dims = {s[len(s) - rank + axis] for s in shapes if len(s) - rank + axis >= 0}
        dims.discard(1)
        if len(dims) > 1:
            return None
        result.append(dims.pop() if dims else 1)
    return tuple(result)


def promote(a: Attribute, b: Attribute) -> Attribute | None:
    """The arithmetic result type of two element types, or None if they do not mix."""
    if a == b:
        return a
    if is_float_type(a) and is_float_type(b):
        return f32
    return None


def normalize_axis(axis: int, rank: int) -> int | None:
    """An axis in [-rank, rank) as a non-negative index, or None when out of range."""
    if -rank <= axis < rank:
        return axis % rank
    return None


def matmul_shape(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...] | None:
    """numpy.matmul's shape rule for operands of rank >= 2 (leading axes broadcast)."""
    if len(a) < 2 or len(b) < 2 or a[-1] != b[-2]:
        return None
    batch = broadcast_shapes(a[:-2], b[:-2])
    if batch is None:
        return None
    return (*batch, a[-2], b[-1])


def reduced_shape(shape: Sequence[int], axes: Sequence[int], keepdims: bool) -> tuple[int, ...]:
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def float_literal(v: float) -> str:
    """`v` as an MLIR float literal that parses back to the same double: repr, with a `.0`
    added to the mantissa where repr leaves it out (`1e-20` -> `1.0e-20`)."""
    text = repr(v)
    mantissa, e, exponent = text.partition("e")
    if e and "." not in mantissa:
        text = f"{mantissa}.0e{exponent}"
    return text


def check_reshape(a: Attribute, r: Attribute, what: str) -> None:
    """The rule of every row-major reshape (tmath.reshape, tcp.view): same element type and
    element count."""
    expect(a.get_element_type() == r.get_element_type(), f"{what} keeps the element type")
    expect(math.prod(shape_of(a)) == math.prod(shape_of(r)), f"cannot {what} {format_type(a)} to {format_type(r)}")


def expect(cond: bool, message: str) -> None:
    if not cond:
        raise VerifyException(message)
