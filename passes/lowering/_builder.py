"""Emission helpers shared by the lowering passes: a builder that collects the `ve` (and `tcp.view`)
ops of one lowering in order, names their results and shares constants."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from xdsl.dialects.builtin import BFloat16Type, TensorType, bf16, f32, i32
from xdsl.ir import Attribute, Operation, SSAValue

from dialects import tcp, ve
from dialects.tensor_types import shape_of


def element_of(x: SSAValue) -> Attribute:
    t = x.type
    assert isinstance(t, TensorType)
    return t.get_element_type()


def _const_key(value: int | float, element: Attribute) -> tuple[str, int]:
    """Constants are shared by their 32-bit pattern: -0.0 is not +0.0, and every NaN is itself."""
    if element == i32:
        return ("i", int(value))
    return ("f", int(np.float32(value).view(np.uint32)))


class LoweringBuilder:
    """Collects the ops of one lowering in order, names results and shares constants."""

    def __init__(self) -> None:
        self.ops: list[Operation] = []
        self._consts: dict[tuple[tuple[str, int], tuple[int, ...], Attribute], SSAValue] = {}

    def emit(self, op: Operation, name: str | None = None) -> SSAValue:
        self.ops.append(op)
        result = op.results[0]
        if name is not None:
            result.name_hint = name
        return result

    def const(self, value: int | float, shape: Sequence[int], element: Attribute = i32,
              name: str | None = None) -> SSAValue:
        """A splat of `value` (i32 or f32 lanes), emitted once per value, shape and type."""
        key = (_const_key(value, element), tuple(shape), element)
        if key not in self._consts:
            self._consts[key] = self.emit(ve.ConstOp(value, TensorType(element, list(shape))), name)
        return self._consts[key]

    def like(self, value: int | float, x: SSAValue) -> SSAValue:
        """A splat of x's shape and lane type."""
        return self.const(value, shape_of(x.type), element_of(x))

    def iota(self, shape: Sequence[int], axis: int, name: str | None = None) -> SSAValue:
        return self.emit(ve.IotaOp(TensorType(i32, list(shape)), axis), name)

    def binary(self, cls: type[ve.BinaryOp], a: SSAValue, b: SSAValue | int | float,
               name: str | None = None) -> SSAValue:
        rhs = b if isinstance(b, SSAValue) else self.like(b, a)
        return self.emit(cls(a, rhs), name)

    def unary(self, cls: type[ve.UnaryFloatOp], x: SSAValue, name: str | None = None) -> SSAValue:
        return self.emit(cls(x), name)

    def tag(self, predicate: str, a: SSAValue, b: SSAValue | int | float, name: str | None = None) -> SSAValue:
        rhs = b if isinstance(b, SSAValue) else self.like(b, a)
        return self.emit(ve.TagOp(predicate, a, rhs), name)

    def select(self, tags: SSAValue, on_true: SSAValue | int | float, on_false: SSAValue | int | float,
               name: str | None = None, element: Attribute = i32) -> SSAValue:
        """on_true where the tag is 1 (a `ve.tag` result), else on_false. A number becomes a splat
        of the other operand's type, or of `element` when both are numbers."""
        shape = shape_of(tags.type)
        for v in (on_true, on_false):
            if isinstance(v, SSAValue):
                element = element_of(v)
        t = on_true if isinstance(on_true, SSAValue) else self.const(on_true, shape, element)
        f = on_false if isinstance(on_false, SSAValue) else self.const(on_false, shape, element)
        return self.emit(ve.SelectOp(tags, [1], t, f), name)

    def broadcast(self, x: SSAValue, axis: int, size: int, name: str | None = None) -> SSAValue:
        return self.emit(ve.BroadcastOp(x, axis, size), name)

    def reduce(self, cls: type[ve.ReduceOp], x: SSAValue, axis: int, name: str | None = None) -> SSAValue:
        return self.emit(cls(x, axis), name)

    def filter(self, x: SSAValue, tags: SSAValue, axis: int, size: int, name: str | None = None) -> SSAValue:
        return self.emit(ve.FilterOp(x, tags, [1], axis, size), name)

    def bitcast(self, x: SSAValue, element: Attribute, name: str | None = None) -> SSAValue:
        return self.emit(ve.BitcastOp(x, TensorType(element, list(shape_of(x.type)))), name)

    def widen(self, x: SSAValue, name: str | None = None) -> SSAValue:
        """bf16 -> f32 lanes, exact."""
        return self.emit(ve.WidenOp(x, TensorType(f32, list(shape_of(x.type)))), name)

    def narrow(self, x: SSAValue, name: str | None = None, truncate: bool = False) -> SSAValue:
        """f32 lanes -> bf16: round to nearest even, or keep the upper half (`truncate`)."""
        return self.emit(ve.NarrowOp(x, TensorType(bf16, list(shape_of(x.type))), truncate=truncate), name)

    def view(self, x: SSAValue, shape: Sequence[int], name: str | None = None) -> SSAValue:
        """The same buffer with another row-major shape (`tcp.view`): none if the shape is x's,
        and a view of a view is a view of the original."""
        if isinstance(x.owner, tcp.ViewOp):
            x = x.owner.input
        if tuple(shape) == shape_of(x.type):
            return x
        return self.emit(tcp.ViewOp(x, list(shape)), name)

    def expand(self, x: SSAValue, shape: Sequence[int], name: str | None = None) -> SSAValue:
        """x broadcast to `shape` by numpy's rule, made explicit: one `tcp.view` that drops the
        size-1 axes to be tiled and adds the result's missing size-1 axes, then one `ve.broadcast`
        per tiled axis, in increasing axis order."""
        have, want = shape_of(x.type), tuple(shape)
        if have == want:
            return x
        offset = len(want) - len(have)
        assert offset >= 0, f"cannot broadcast {have} to {want}"
        aligned = (1,) * offset + have
        tiled = [a for a, (h, w) in enumerate(zip(aligned, want)) if h != w]
        assert all(aligned[a] == 1 for a in tiled), f"cannot broadcast {have} to {want}"
        x = self.view(x, [w for a, w in enumerate(want) if a not in tiled])
        for n, a in enumerate(tiled):
            x = self.broadcast(x, a, want[a], name if n == len(tiled) - 1 else None)
        return x


def lane_type(element: Attribute) -> Attribute:
    """The 32-bit lane a value of this element type is computed in: f32 for floats, i32 for i32."""
    return f32 if isinstance(element, BFloat16Type) or element == f32 else element
