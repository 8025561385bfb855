"""Numpy semantics of the `tmath` ops: compute in f32 (i32 for integers), round to the result type."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from xdsl.interpreter import Interpreter, InterpreterFunctions, impl, register_impls
from xdsl.utils.exceptions import InterpretationError

from dialects import tcp, tensor_types, tmath
from runtime_sim.semantics.numerics import (
    compute,
    contract,
    round_to,
    sequential_max,
    sequential_min,
    sequential_sum,
    tensor_dtype,
)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.float32(1) / (np.float32(1) + np.exp(-x))


BINARY: dict[type, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    tmath.AddOp: np.add,
    tmath.SubOp: np.subtract,
    tmath.MulOp: np.multiply,
    tmath.DivOp: np.divide,
    tmath.MaximumOp: np.maximum,
    tmath.MinimumOp: np.minimum,
}

UNARY: dict[type, Callable[[np.ndarray], np.ndarray]] = {
    tmath.NegOp: np.negative,
    tmath.AbsOp: np.abs,
    tmath.ExpOp: np.exp,
    tmath.LogOp: np.log,
    tmath.SqrtOp: np.sqrt,
    tmath.TanhOp: np.tanh,
    tmath.SigmoidOp: _sigmoid,
    tmath.SiluOp: lambda x: x * _sigmoid(x),
}

COMPARE: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
}

def _axis_by_axis(reduce: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    """A reduction over several axes as one sequential reduction per axis, the last axis first."""

    def run(x: np.ndarray, axis: tuple[int, ...], keepdims: bool) -> np.ndarray:
        for a in sorted(axis, reverse=True):
            x = reduce(x, a, keepdims=True)
        return x if keepdims else np.squeeze(x, axis=axis)

    return run


REDUCE: dict[type, Callable[..., np.ndarray]] = {
    tmath.ReduceSumOp: _axis_by_axis(sequential_sum),
    tmath.ReduceMaxOp: _axis_by_axis(sequential_max),
    tmath.ReduceMinOp: _axis_by_axis(sequential_min),
}


def _result(op: Any, value: np.ndarray) -> tuple[np.ndarray]:
    return (round_to(value, tensor_dtype(op.result.type)),)


def constant_value(op: tmath.ConstantOp) -> np.generic:
    """The scalar a `tmath.constant` splats: its value in f32, rounded to the result type (an
    i32 constant goes through f32 too, as every float literal does)."""
    with np.errstate(over="ignore"):
        return round_to(np.float32(op.value.value.data), tensor_dtype(op.result.type))[()]


def softmax(x: np.ndarray, axis: int) -> np.ndarray:
    """Max-subtracted softmax in f32, max and sum taken in order. A row of all -inf gives NaN."""
    x = compute(x)
    shifted = np.exp(x - sequential_max(x, axis, keepdims=True))
    return shifted / sequential_sum(shifted, axis, keepdims=True)


@register_impls
class TMathFunctions(InterpreterFunctions):
    @impl(tmath.ConstantOp)
    def run_constant(self, interpreter: Interpreter, op: tmath.ConstantOp, args: tuple[Any, ...]):
        return (np.full(tensor_types.shape_of(op.result.type), constant_value(op)),)

    def run_binary(self, interpreter: Interpreter, op: Any, args: tuple[Any, ...]):
        a, b = args
        return _result(op, BINARY[type(op)](compute(a), compute(b)))

    def run_unary(self, interpreter: Interpreter, op: Any, args: tuple[Any, ...]):
        return _result(op, UNARY[type(op)](compute(args[0])))

    @impl(tmath.CmpOp)
    def run_cmp(self, interpreter: Interpreter, op: tmath.CmpOp, args: tuple[Any, ...]):
        a, b = args
        return (COMPARE[op.predicate.data](compute(a), compute(b)),)

    @impl(tmath.SelectOp)
    def run_select(self, interpreter: Interpreter, op: tmath.SelectOp, args: tuple[Any, ...]):
        cond, a, b = args
        return _result(op, np.where(cond, compute(a), compute(b)))

    @impl(tmath.SoftmaxOp)
    def run_softmax(self, interpreter: Interpreter, op: tmath.SoftmaxOp, args: tuple[Any, ...]):
        return _result(op, softmax(args[0], op.axis.value.data))

    def run_reduce(self, interpreter: Interpreter, op: Any, args: tuple[Any, ...]):
        x = compute(args[0])
        axes = op.axis_list
        return _result(op, REDUCE[type(op)](x, axis=axes, keepdims=op.keepdims is not None))

    @impl(tmath.ReshapeOp)
    def run_reshape(self, interpreter: Interpreter, op: tmath.ReshapeOp, args: tuple[Any, ...]):
        return (np.reshape(args[0], tensor_types.shape_of(op.result.type)),)

    @impl(tmath.CastOp)
    def run_cast(self, interpreter: Interpreter, op: tmath.CastOp, args: tuple[Any, ...]):
        x = args[0]
        if x.dtype == tensor_dtype(op.result.type):  # a cast to the value's own type is the identity
            return (x,)
        return _result(op, x.astype(np.int32) if x.dtype == np.bool_ else compute(x))

    @impl(tmath.MatmulOp)
    def run_matmul(self, interpreter: Interpreter, op: tmath.MatmulOp, args: tuple[Any, ...]):
        a, b = args
        spec, lhs_shape, rhs_shape = tcp.matmul_contraction(a.shape, b.shape)
        return _result(op, contract(spec, compute(a).reshape(lhs_shape), compute(b).reshape(rhs_shape)))

    @impl(tmath.OneHotOp)
    def run_one_hot(self, interpreter: Interpreter, op: tmath.OneHotOp, args: tuple[Any, ...]):
        depth = tensor_types.shape_of(op.result.type)[-1]
        return ((args[0][..., None] == np.arange(depth, dtype=np.int32)).astype(np.int32),)

    @impl(tmath.TakeOp)
    def run_take(self, interpreter: Interpreter, op: tmath.TakeOp, args: tuple[Any, ...]):
        x, idx = args
        n = x.shape[-1]
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise InterpretationError(
                f"tmath.take: index {int(idx.min() if idx.min() < -n else idx.max())} "
                f"is outside [-{n}, {n})"
            )
        return (np.take_along_axis(x, idx.astype(np.int64), axis=-1),)

    # One implementation serves each family, registered under each op of it (the tables above
    # give each op's numpy function).
    run_add = impl(tmath.AddOp)(run_binary)
    run_sub = impl(tmath.SubOp)(run_binary)
    run_mul = impl(tmath.MulOp)(run_binary)
    run_div = impl(tmath.DivOp)(run_binary)
    run_maximum = impl(tmath.MaximumOp)(run_binary)
    run_minimum = impl(tmath.MinimumOp)(run_binary)
    run_neg = impl(tmath.NegOp)(run_unary)
    run_abs = impl(tmath.AbsOp)(run_unary)
    run_exp = impl(tmath.ExpOp)(run_unary)
    run_log = impl(tmath.LogOp)(run_unary)
    run_sqrt = impl(tmath.SqrtOp)(run_unary)
    run_tanh = impl(tmath.TanhOp)(run_unary)
    run_sigmoid = impl(tmath.SigmoidOp)(run_unary)
    run_silu = impl(tmath.SiluOp)(run_unary)
    run_reduce_sum = impl(tmath.ReduceSumOp)(run_reduce)
    run_reduce_max = impl(tmath.ReduceMaxOp)(run_reduce)
    run_reduce_min = impl(tmath.ReduceMinOp)(run_reduce)

