"""Numpy semantics of the `tcp` ops."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
from xdsl.interpreter import Interpreter, InterpreterFunctions, impl, register_impls
from xdsl.utils.exceptions import InterpretationError

from dialects import tcp
from runtime_sim.semantics.numerics import GatheredRows, bfloat16, compute, contract, round_to, tensor_dtype
from runtime_sim.semantics.quantization import scaled_contract


def check_rows(op_name: str, indices: np.ndarray, rows: int) -> None:
    bad = indices[(indices < -1) | (indices >= rows)]
    if bad.size:
        raise InterpretationError(f"{op_name}: row index {int(bad.flat[0])} is outside [-1, {rows})")


def _read_only_bf16(x: Any) -> bool:
    return isinstance(x, np.ndarray) and x.dtype == bfloat16 and not x.flags.writeable


class WidenedOperands:
    """f32 copies of the last few read-only bf16 operands the contractions read. The schedule
    level's expert loop contracts one weight tile (`tile.load_expert`'s, read-only, reused while
    the expert stays the same) with block after block of rows; widening it once rather than
    once per block is most of a prefill's simulation time. Only read-only arrays are kept (their
    values cannot change under the copy), each with a reference so its id stays its own. A copy
    lives only here and in the contraction using it, so the least recently used one's memory is
    reused for the next."""

    def __init__(self, keep: int = 4):
        assert keep >= 2, "a contraction's two operands must both stay"
        self.keep = keep
        self._recent: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        assert _read_only_bf16(x)
        hit = self._recent.get(id(x))
        if hit is not None and hit[0] is x:
            self._recent.move_to_end(id(x))
            return hit[1]
        spare = None
        if len(self._recent) >= self.keep:  # the least recently used copy's memory, reused: fresh pages are slow to map
            _, (_, spare) = self._recent.popitem(last=False)
        if spare is not None and spare.shape == x.shape:
            wide = spare
            np.copyto(wide, x)
        else:
            wide = x.astype(np.float32)
        self._recent[id(x)] = (x, wide)
        return wide


@register_impls
class TCPFunctions(InterpreterFunctions):
    def __init__(self) -> None:
        self.widened = WidenedOperands()

    @impl(tcp.ContractOp)
    def run_contract(self, interpreter: Interpreter, op: tcp.ContractOp, args: tuple[Any, ...]):
        lhs, rhs, *optional = args
        bias = optional.pop(0) if op.bias is not None else None
        guard = optional.pop(0) if op.guard is not None else None
        acc = optional.pop(0) if op.acc is not None else None
        if guard is not None and not np.any(np.asarray(guard) >= 0):
            # Every block skipped (an unused block of the expert loop): what computing the product
            # and clearing it would give (zeros, or the accumulator), without computing it.
            kept = np.zeros(tcp.shape_of(op.result.type), np.float32) if acc is None else np.array(acc, np.float32)
            return (round_to(kept, tensor_dtype(op.result.type)),)
        if _read_only_bf16(rhs):
            # Both operands in f32 (the same values): contract() then makes one matmul of them.
            rhs = self.widened(rhs)
            if isinstance(lhs, np.ndarray):
                lhs = self.widened(lhs) if _read_only_bf16(lhs) else np.asarray(lhs, np.float32)
        out = contract(op.spec.data, lhs, rhs, acc)  # bf16 operands are widened in pieces
        if bias is not None:
            out = out + compute(bias)
        if guard is not None:
            out[guard < 0] = 0 if acc is None else acc[guard < 0]
        return (round_to(out, tensor_dtype(op.result.type)),)

    @impl(tcp.ScaledContractOp)
    def run_scaled_contract(self, interpreter: Interpreter, op: tcp.ScaledContractOp, args: tuple[Any, ...]):
        lhs, rhs, lhs_scales, rhs_scales, *optional = (np.asarray(a) for a in args)
        bias = optional.pop(0) if op.bias is not None else None
        guard = optional.pop(0) if op.guard is not None else None
        g, b, f = tcp.shape_of(op.result.type)
        out = np.zeros((g, b, f), np.float32)
        run = np.arange(g) if guard is None else np.nonzero(guard >= 0)[0]
        if run.size:  # only the blocks that run are computed; each block's bits are its own
            out[run] = scaled_contract(lhs[run], lhs_scales[run], rhs[run], rhs_scales[run])
        if bias is not None:
            out[run] = out[run] + np.broadcast_to(compute(bias), (g, b, f))[run]
        return (out,)

    @impl(tcp.DmaGatherOp)
    def run_dma_gather(self, interpreter: Interpreter, op: tcp.DmaGatherOp, args: tuple[Any, ...]):
        source, indices = args
        check_rows(op.name, indices, source.shape[0])
        # Rows are gathered on their raw bits (zero bits are a zero row). When only contractions
        # read the result, it stays unmaterialised and they gather a few rows at a time.
        rows = GatheredRows(np.asarray(source), indices)
        if all(isinstance(use.operation, tcp.ContractOp) and use.index < 2 for use in op.result.uses):
            return (rows,)
        return (np.asarray(rows),)

    @impl(tcp.DmaScatterOp)
    def run_dma_scatter(self, interpreter: Interpreter, op: tcp.DmaScatterOp, args: tuple[Any, ...]):
        source, indices = args
        rows = tcp.shape_of(op.result.type)[0]
        check_rows(op.name, indices, rows)
        out = np.zeros((rows, *source.shape[1:]), dtype=source.dtype)
        per_row = indices.reshape(indices.shape[0], -1)
        dest = per_row.reshape(-1)
        src = np.repeat(np.arange(source.shape[0]), per_row.shape[1])
        keep = dest >= 0
        if np.unique(dest[keep]).size != int(keep.sum()):
            raise InterpretationError(f"{op.name}: two source rows are written to one destination row")
        out[dest[keep]] = source[src[keep]]
        return (out,)

    @impl(tcp.ViewOp)
    def run_view(self, interpreter: Interpreter, op: tcp.ViewOp, args: tuple[Any, ...]):
        return (np.reshape(args[0], tcp.shape_of(op.result.type)),)

    @impl(tcp.LoadOp)
    def run_load(self, interpreter: Interpreter, op: tcp.LoadOp, args: tuple[Any, ...]):
        return (args[0],)

    @impl(tcp.StoreOp)
    def run_store(self, interpreter: Interpreter, op: tcp.StoreOp, args: tuple[Any, ...]):
        return (args[0],)
