"""Numpy semantics of the `tile` ops (dialects/tile.py).

`tile.store` writes into its destination array in place and returns it: the schedule level
threads a buffer through its loop so each buffer has one live SSA name at a time, and copying
a [G, B, D] buffer once per block would make simulation quadratic in the number of blocks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from xdsl.interpreter import Interpreter, InterpreterFunctions, impl, register_impls
from xdsl.utils.exceptions import InterpretationError

from dialects import tile
from dialects.tensor_types import shape_of
from runtime_sim.semantics.numerics import GatheredRows, tensor_dtype
from runtime_sim.semantics.tcp_semantics import check_rows


def _rows(op_name: str, source: np.ndarray, offset: int, n: int) -> slice:
    if not 0 <= offset <= source.shape[0] - n:
        raise InterpretationError(f"{op_name}: rows [{offset}, {offset + n}) are outside [0, {source.shape[0]})")
    return slice(offset, offset + n)


def sliced(op: tile.SliceOp, source: np.ndarray, offset: int) -> np.ndarray:
    """`tile.slice`: the tile of `source` at row `offset` (and the op's window of each row)."""
    shape = shape_of(op.result.type)
    window = tuple(slice(o, o + n) for o, n in zip(op.window_offsets(), shape[1:]))
    return source[(_rows(op.name, source, offset, shape[0]), *window)]


def guard_runs(ids: np.ndarray) -> bool:
    """`tile.guard`: whether its block runs (an entry >= 0)."""
    return bool(np.any(np.asarray(ids) >= 0))


def _skipped(guard: np.ndarray) -> bool:
    """A guard of one entry: negative skips the command."""
    return bool(np.asarray(guard).reshape(-1)[0] < 0)


def gathered(op_name: str, source: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """source[ids] with zero rows where an id is -1: a DMA gather's rows (tcp.dma_gather's)."""
    check_rows(op_name, np.asarray(ids), source.shape[0])
    return np.asarray(GatheredRows(np.asarray(source), ids))


@register_impls
class TileFunctions(InterpreterFunctions):
    @impl(tile.BufferOp)
    def run_buffer(self, interpreter: Interpreter, op: tile.BufferOp, args: tuple[Any, ...]):
        return (np.zeros(shape_of(op.result.type), tensor_dtype(op.result.type)),)

    @impl(tile.SliceOp)
    def run_slice(self, interpreter: Interpreter, op: tile.SliceOp, args: tuple[Any, ...]):
        return (sliced(op, *args),)

    @impl(tile.LoadOp)
    def run_load(self, interpreter: Interpreter, op: tile.LoadOp, args: tuple[Any, ...]):
        source, offset = args[:2]
        rows = _rows(op.name, source, offset, shape_of(op.result.type)[0])
        if op.guard is not None and _skipped(args[2]):
            return (np.zeros(shape_of(op.result.type), source.dtype),)
        return (np.array(source[rows]),)

    @impl(tile.GatherOp)
    def run_gather(self, interpreter: Interpreter, op: tile.GatherOp, args: tuple[Any, ...]):
        source, indices = args[:2]
        if op.guard is not None and _skipped(args[2]):
            return (np.zeros(shape_of(op.result.type), source.dtype),)
        return (gathered(op.name, source, np.asarray(indices)),)

    @impl(tile.GatherIntoOp)
    def run_gather_into(self, interpreter: Interpreter, op: tile.GatherIntoOp, args: tuple[Any, ...]):
        source, indices, dest, offset = args
        ids = np.asarray(indices).reshape(-1)
        dest[_rows(op.name, dest, offset, ids.size)] = gathered(op.name, source, ids)
        return (dest,)

    @impl(tile.StoreOp)
    def run_store(self, interpreter: Interpreter, op: tile.StoreOp, args: tuple[Any, ...]):
        value, dest, offset = args[:3]
        rows: Any = _rows(op.name, dest, offset, value.shape[0])
        if op.offsets is not None:  # a window of each row
            rows = (rows, *(slice(o, o + n) for o, n in zip(op.window_offsets(), value.shape[1:])))
        if op.guard is None:
            dest[rows] = value
        elif tile.guards_parts(op):  # one guard per part of the tile: only the parts whose guard is not negative
            written = np.asarray(args[3]) >= 0
            parts = dest[rows].reshape(written.size, -1)  # a view: the rows are contiguous
            parts[written] = np.asarray(value).reshape(written.size, -1)[written]
        elif not _skipped(args[3]):
            dest[rows] = value
        return (dest,)

    @impl(tile.CopyOp)
    def run_copy(self, interpreter: Interpreter, op: tile.CopyOp, args: tuple[Any, ...]):
        return (args[0],)

    @impl(tile.GuardOp)
    def run_guard(self, interpreter: Interpreter, op: tile.GuardOp, args: tuple[Any, ...]):
        return (guard_runs(args[0]),)

    @impl(tile.LoadExpertOp)
    def run_load_expert(self, interpreter: Interpreter, op: tile.LoadExpertOp, args: tuple[Any, ...]):
        source, ids = args[:2]
        if op.prev_ids is not None and np.array_equal(ids, args[2]):
            return (args[3],)
        window = tuple(slice(o, o + n) for o, n in zip(op.window_offsets(), shape_of(op.result.type)[1:]))
        rows = gathered(op.name, np.asarray(source)[(slice(None), *window)], ids)
        rows.flags.writeable = False  # weights: nothing writes them, so contractions may keep them widened
        return (rows,)
