"""Numpy semantics of the `ve` ops: 32-bit lanes (int32 / float32), tags as uint8 0..15.

i32 arithmetic wraps; f32 follows IEEE quietly; bf16 enters and leaves by bit moves
(`widen`, `narrow truncate`) or by the rounding every level shares (`narrow`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from xdsl.interpreter import (
    Interpreter,
    InterpreterFunctions,
    ReturnedValues,
    TerminatorValue,
    impl,
    impl_terminator,
    register_impls,
)

from dialects import tensor_types, tmath, ve
from runtime_sim.semantics.numerics import (
    TAG_DTYPE,
    bfloat16,
    round_to,
    select,
    sequential_max,
    sequential_min,
    sequential_sum,
    tensor_dtype,
)
from runtime_sim.semantics.tmath_semantics import COMPARE, UNARY


def _out(op: Any, value: Any) -> tuple[np.ndarray]:
    """The single result as an array of the result's dtype and shape (numpy gives scalars
    for rank 0)."""
    t = op.result.type
    return (np.asarray(value, dtype=tensor_dtype(t)).reshape(tensor_types.shape_of(t)),)


def _flat(fn: Callable[..., np.ndarray], *arrays: np.ndarray) -> np.ndarray:
    """Apply fn on 1-d views (so rank 0 stays an array and int32 wraps without warnings)."""
    shape = arrays[0].shape
    with np.errstate(all="ignore"):
        return np.asarray(fn(*(np.asarray(a).reshape(-1) for a in arrays))).reshape(shape)


def _shift_amount(s: np.ndarray) -> np.ndarray:
    return (s.astype(np.int64) & 31).astype(np.uint32)


def _shl(a: np.ndarray, s: np.ndarray) -> np.ndarray:
    return (a.view(np.uint32) << _shift_amount(s)).view(np.int32)


def _shr_u(a: np.ndarray, s: np.ndarray) -> np.ndarray:
    return (a.view(np.uint32) >> _shift_amount(s)).view(np.int32)


def _shr_s(a: np.ndarray, s: np.ndarray) -> np.ndarray:
    return a >> _shift_amount(s).astype(np.int32)


BINARY: dict[type, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    ve.AndOp: np.bitwise_and,
    ve.OrOp: np.bitwise_or,
    ve.XorOp: np.bitwise_xor,
    ve.ShlOp: _shl,
    ve.ShrUOp: _shr_u,
    ve.ShrSOp: _shr_s,
    ve.AddOp: np.add,
    ve.SubOp: np.subtract,
    ve.MulOp: np.multiply,
    ve.DivOp: np.divide,
    ve.MaxOp: np.maximum,
    ve.MinOp: np.minimum,
}

UNARY_FLOAT: dict[type, Callable[[np.ndarray], np.ndarray]] = {
    ve.ExpOp: UNARY[tmath.ExpOp],
    ve.SigmoidOp: UNARY[tmath.SigmoidOp],
    ve.LogOp: UNARY[tmath.LogOp],
    ve.SqrtOp: UNARY[tmath.SqrtOp],
    ve.TanhOp: UNARY[tmath.TanhOp],
}

SCAN: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add,
    "max": np.maximum,
    "min": np.minimum,
}

REDUCE: dict[type, Callable[..., np.ndarray]] = {
    ve.ReduceSumOp: sequential_sum,
    ve.ReduceMaxOp: sequential_max,
    ve.ReduceMinOp: sequential_min,
}


def widen(x: np.ndarray) -> np.ndarray:
    """bf16 bits into the upper half of an f32 lane."""
    return (np.asarray(x).view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def narrow_truncate(x: np.ndarray) -> np.ndarray:
    """The upper half of an f32 lane as bf16 bits."""
    return (np.asarray(x).view(np.uint32) >> np.uint32(16)).astype(np.uint16).view(bfloat16)


def position_tags(shape: tuple[int, ...], axis: int, pattern: tuple[int, int, int, int]) -> np.ndarray:
    first, middle, last, single = pattern
    n = shape[axis]
    line = np.full(n, middle, dtype=TAG_DTYPE)
    if n == 1:
        line[0] = single
    else:
        line[0], line[-1] = first, last
    view = [1] * len(shape)
    view[axis] = n
    return np.broadcast_to(line.reshape(view), shape).copy()


def tagged(tags: np.ndarray, values: set[int]) -> np.ndarray:
    """`np.isin(tags, values)`: a branch tag is a byte, so a table of 256 answers it for each
    tag at once (np.isin sorts them; a top-k's routing tags are [T*K, E] at prefill)."""
    if tags.dtype != TAG_DTYPE:
        return np.isin(tags, list(values))
    table = np.zeros(256, dtype=bool)
    table[[v for v in values if 0 <= v < 256]] = True
    return table[tags]


def scan(kind: str, x: np.ndarray, tags: np.ndarray, axis: int, read: set[int], write: set[int]) -> np.ndarray:
    """The carried accumulator: one step per element along `axis`, all other indices at once."""
    fn = SCAN[kind]
    xs, ts = np.moveaxis(x, axis, 0), np.moveaxis(tags, axis, 0)
    out = np.empty_like(xs)
    acc = np.zeros(xs.shape[1:], dtype=x.dtype)
    reads, writes = tagged(ts, read), tagged(ts, write)
    with np.errstate(all="ignore"):
        for i in range(xs.shape[0]):
            result = np.where(reads[i], fn(xs[i], acc), xs[i]).astype(x.dtype)
            out[i] = result
            acc = np.where(writes[i], result, acc).astype(x.dtype)
    return np.moveaxis(out, 0, axis)


def filter_compact(x: np.ndarray, tags: np.ndarray, keep: set[int], axis: int, size: int, pad: int) -> np.ndarray:
    """Kept elements in order at the front of each line along `axis`, `pad` bits after them;
    elements beyond `size` are dropped."""
    xs, ts = np.moveaxis(x, axis, -1), np.moveaxis(tags, axis, -1)
    kept = tagged(ts, keep)
    position = np.cumsum(kept, axis=-1) - 1
    fits = kept & (position < size)
    pad_value = np.array(pad, dtype=np.int64).astype(np.int32).view(x.dtype) if x.dtype == np.float32 \
        else np.int32(pad)
    out = np.full((*xs.shape[:-1], size), pad_value, dtype=x.dtype)
    where = np.nonzero(fits)
    out[(*where[:-1], position[fits])] = xs[fits]
    return np.moveaxis(out, -1, axis)


@register_impls
class VEFunctions(InterpreterFunctions):
    @impl(ve.ConstOp)
    def run_const(self, interpreter: Interpreter, op: ve.ConstOp, args: tuple[Any, ...]):
        shape = tensor_types.shape_of(op.result.type)
        # A read-only broadcast of one value, like iota's table: no memory for a splat.
        return _out(op, np.broadcast_to(np.array(op.scalar, dtype=tensor_dtype(op.result.type)), shape))

    @impl(ve.IotaOp)
    def run_iota(self, interpreter: Interpreter, op: ve.IotaOp, args: tuple[Any, ...]):
        shape = tensor_types.shape_of(op.result.type)
        axis = op.axis.value.data
        view = [1] * len(shape)
        view[axis] = shape[axis]
        line = np.arange(shape[axis], dtype=np.int32).reshape(view)
        return _out(op, np.broadcast_to(line, shape))

    @impl(ve.BitcastOp)
    def run_bitcast(self, interpreter: Interpreter, op: ve.BitcastOp, args: tuple[Any, ...]):
        return _out(op, np.asarray(args[0]).view(tensor_dtype(op.result.type)))

    @impl(ve.WidenOp)
    def run_widen(self, interpreter: Interpreter, op: ve.WidenOp, args: tuple[Any, ...]):
        return _out(op, widen(args[0]))

    @impl(ve.NarrowOp)
    def run_narrow(self, interpreter: Interpreter, op: ve.NarrowOp, args: tuple[Any, ...]):
        x = np.asarray(args[0])
        if op.truncate is not None:
            return _out(op, narrow_truncate(x))
        with np.errstate(all="ignore"):
            return _out(op, round_to(x, bfloat16))

    @impl(ve.WidenLowOp)
    def run_widen_low(self, interpreter: Interpreter, op: ve.WidenLowOp, args: tuple[Any, ...]):
        return _out(op, np.asarray(args[0]).astype(np.float32))

    @impl(ve.LookupOp)
    def run_lookup(self, interpreter: Interpreter, op: ve.LookupOp, args: tuple[Any, ...]):
        codes, table = np.asarray(args[0]), np.asarray(args[1], np.float32)
        if table.ndim == 1:
            return _out(op, table[codes])
        rows = np.arange(codes.shape[0]).reshape(-1, *([1] * (codes.ndim - 1)))
        return _out(op, table[rows, codes])

    @impl(ve.NarrowLowOp)
    def run_narrow_low(self, interpreter: Interpreter, op: ve.NarrowLowOp, args: tuple[Any, ...]):
        return _out(op, round_to(np.asarray(args[0]), tensor_dtype(op.result.type)))

    @impl(ve.FxpToFpOp)
    def run_fxp_to_fp(self, interpreter: Interpreter, op: ve.FxpToFpOp, args: tuple[Any, ...]):
        return _out(op, np.asarray(args[0]).astype(np.float32))

    @impl(ve.FpToFxpOp)
    def run_fp_to_fxp(self, interpreter: Interpreter, op: ve.FpToFxpOp, args: tuple[Any, ...]):
        return _out(op, round_to(np.asarray(args[0]), np.dtype(np.int32)))

    def run_binary(self, interpreter: Interpreter, op: Any, args: tuple[Any, ...]):
        return _out(op, _flat(BINARY[type(op)], *args))

    def run_unary(self, interpreter: Interpreter, op: Any, args: tuple[Any, ...]):
        return _out(op, _flat(UNARY_FLOAT[type(op)], args[0]))

    @impl(ve.TagOp)
    def run_tag(self, interpreter: Interpreter, op: ve.TagOp, args: tuple[Any, ...]):
        a, b = args
        return _out(op, COMPARE[op.predicate.data.value](np.asarray(a), np.asarray(b)))

    @impl(ve.PositionTagOp)
    def run_position_tag(self, interpreter: Interpreter, op: ve.PositionTagOp, args: tuple[Any, ...]):
        shape = tensor_types.shape_of(op.result.type)
        return _out(op, position_tags(shape, op.axis.value.data, op.pattern))

    @impl(ve.SelectOp)
    def run_select(self, interpreter: Interpreter, op: ve.SelectOp, args: tuple[Any, ...]):
        tags, on_true, on_false = args
        when = list(op.when.get_values())
        hit = tags == when[0] if len(when) == 1 else tagged(np.asarray(tags), set(when))
        return _out(op, select(hit, on_true, on_false))

    @impl(ve.ScanOp)
    def run_scan(self, interpreter: Interpreter, op: ve.ScanOp, args: tuple[Any, ...]):
        x, tags = (np.asarray(a) for a in args)
        return _out(op, scan(op.kind.data.value, x, tags, op.axis.value.data,
                             set(op.read.get_values()), set(op.write.get_values())))

    @impl(ve.BroadcastOp)
    def run_broadcast(self, interpreter: Interpreter, op: ve.BroadcastOp, args: tuple[Any, ...]):
        shape = tensor_types.shape_of(op.result.type)
        return _out(op, np.broadcast_to(np.expand_dims(args[0], op.axis.value.data), shape))

    @impl(ve.RepeatOp)
    def run_repeat(self, interpreter: Interpreter, op: ve.RepeatOp, args: tuple[Any, ...]):
        axis = op.axis.value.data
        repeated = np.repeat(np.asarray(args[0]), op.times.value.data, axis=axis)
        return _out(op, repeated[(slice(None),) * axis + (slice(0, tensor_types.shape_of(op.result.type)[axis]),)])

    def run_reduce(self, interpreter: Interpreter, op: Any, args: tuple[Any, ...]):
        x = np.asarray(args[0])
        with np.errstate(all="ignore"):
            return _out(op, REDUCE[type(op)](x, axis=op.axis.value.data))

    @impl(ve.FilterOp)
    def run_filter(self, interpreter: Interpreter, op: ve.FilterOp, args: tuple[Any, ...]):
        x, tags = (np.asarray(a) for a in args)
        size = tensor_types.shape_of(op.result.type)[op.axis.value.data]
        return _out(op, filter_compact(x, tags, set(op.keep.get_values()), op.axis.value.data,
                                       size, op.pad.value.data))

    @impl(ve.ChainOp)
    def run_chain(self, interpreter: Interpreter, op: ve.ChainOp, args: tuple[Any, ...]):
        """The members in order on the chain's inputs: fusing changes the cost, never a value."""
        return interpreter.run_ssacfg_region(op.body, args, "ve.chain")

    @impl_terminator(ve.YieldOp)
    def run_yield(self, interpreter: Interpreter, op: ve.YieldOp,
                  args: tuple[Any, ...]) -> tuple[TerminatorValue, tuple[Any, ...]]:
        return ReturnedValues(args), ()

    # One implementation serves each family, registered under each op of it (the tables above
    # give each op's numpy function).
    run_and = impl(ve.AndOp)(run_binary)
    run_or = impl(ve.OrOp)(run_binary)
    run_xor = impl(ve.XorOp)(run_binary)
    run_shl = impl(ve.ShlOp)(run_binary)
    run_shr_u = impl(ve.ShrUOp)(run_binary)
    run_shr_s = impl(ve.ShrSOp)(run_binary)
    run_add = impl(ve.AddOp)(run_binary)
    run_sub = impl(ve.SubOp)(run_binary)
    run_mul = impl(ve.MulOp)(run_binary)
    run_div = impl(ve.DivOp)(run_binary)
    run_max = impl(ve.MaxOp)(run_binary)
    run_min = impl(ve.MinOp)(run_binary)
    run_exp = impl(ve.ExpOp)(run_unary)
    run_sigmoid = impl(ve.SigmoidOp)(run_unary)
    run_log = impl(ve.LogOp)(run_unary)
    run_sqrt = impl(ve.SqrtOp)(run_unary)
    run_tanh = impl(ve.TanhOp)(run_unary)
    run_reduce_sum = impl(ve.ReduceSumOp)(run_reduce)
    run_reduce_max = impl(ve.ReduceMaxOp)(run_reduce)
    run_reduce_min = impl(ve.ReduceMinOp)(run_reduce)
