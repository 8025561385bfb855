"""Numpy semantics of the `tcp` ops."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
from xdsl.interpreter import Interpreter, InterpreterFunctions, impl, register_impls
from xdsl.utils.exceptions import InterpretationError

from dialects import tcp
from runtime_sim.semantics.numerics import (
    GatheredRows,
    bfloat16,
    compute,
    contract,
    raw_bits,
    round_to,
    tensor_dtype,
)
from runtime_sim.semantics.quantization import scaled_contract


def check_rows(op_name: str, indices: np.ndarray, rows: int) -> None:
    bad = indices[(indices < -1) | (indices >= rows)]
    if bad.size:
        raise InterpretationError(f"{op_name}: row index {int(bad.flat[0])} is outside [-1, {rows})")


def _read_only_bf16(x: Any) -> bool:
    return isinstance(x, np.ndarray) and x.dtype == bfloat16 and not x.flags.writeable


class WidenedOperands:
    """f32 copies of the read-only bf16 operands the contractions read, each kept while its bf16
    array lives. The schedule level's expert loop contracts each weight tile
    (`tile.load_expert`'s, read-only, reused while the expert stays the same) with block after
    block of rows; widening it once rather than once per block is much of a prefill's simulation
    time. A loop iteration reads several tiles (Qwen3 at real dims: gate, up and down, two F
    tiles each, on two clusters: 12), so a copy is kept for as long as its tile is alive, not
    for the last few tiles read. Only read-only arrays are kept (their values cannot change under
    the copy); a copy is dropped when its array dies (a weak reference), and its memory is
    reused for the next copy of the same shape (fresh pages are slow to map)."""

    def __init__(self, spares: int = 4):
        self._wide: dict[int, np.ndarray] = {}
        self._spares: list[np.ndarray] = []
        self._max_spares = spares

    def __call__(self, x: np.ndarray) -> np.ndarray:
        assert _read_only_bf16(x)
        wide = self._wide.get(id(x))
        if wide is not None:
            return wide
        wide = self._spare(x.shape)
        np.copyto(wide, x)  # bf16 -> f32 is exact
        self._wide[id(x)] = wide
        # Runs as `x` is freed, before its id can be reused.
        weakref.finalize(x, self._release, id(x))
        return wide

    def __len__(self) -> int:
        """How many copies are kept."""
        return len(self._wide)

    def _spare(self, shape: tuple[int, ...]) -> np.ndarray:
        for i, spare in enumerate(self._spares):
            if spare.shape == shape:
                return self._spares.pop(i)
        return np.empty(shape, np.float32)

    def _release(self, key: int) -> None:
        wide = self._wide.pop(key, None)
        if wide is not None:
            self._spares.append(wide)
            del self._spares[:-self._max_spares]


def _blocks_to_run(spec: str, guard: np.ndarray | None) -> np.ndarray | None:
    """The blocks a guarded contraction computes (those whose guard is not negative), or None to
    compute them all: when some are skipped and the blocks are the lhs's first axis (and the
    rhs's first, if it has that letter), a batch or row axis, whose results are each computed
    alone (`numerics.contract`)."""
    if guard is None or np.all(guard >= 0):
        return None
    (lhs, rhs), block = spec.split("->")[0].split(","), spec.split("->")[1][:1]
    if lhs[:1] != block or (block in rhs and rhs[:1] != block):
        return None
    return np.nonzero(guard >= 0)[0]


def _blocks(x: Any, run: np.ndarray) -> Any:
    """Blocks `run` (indices along the first axis) of an operand, a gather left unmaterialised."""
    if isinstance(x, GatheredRows):
        return GatheredRows(x.source, x.indices[run])
    return np.asarray(x)[run]


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
        run = _blocks_to_run(op.spec.data, guard)
        if run is None:
            out = contract(op.spec.data, lhs, rhs, acc)  # bf16 operands are widened in pieces
        else:  # only the blocks that run are computed: a row's bits do not depend on the rows beside it
            out = np.zeros(tcp.shape_of(op.result.type), np.float32) if acc is None else np.array(acc, np.float32)
            if op.spec.data.split(",")[1][:1] == op.spec.data[0]:  # a batch letter: each block its own rhs
                rhs = _blocks(rhs, run)
            out[run] = contract(op.spec.data, _blocks(lhs, run), rhs, None if acc is None else out[run])
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
        acc = optional.pop(0) if op.acc is not None else None
        g, b, f = tcp.shape_of(op.result.type)
        out = np.zeros((g, b, f), np.float32) if acc is None else np.array(acc, np.float32)  # a skipped block keeps acc
        run = np.arange(g) if guard is None else np.nonzero(guard >= 0)[0]
        if run.size:  # only the blocks that run are computed; each block's bits are its own
            out[run] = scaled_contract(lhs[run], lhs_scales[run], rhs[run], rhs_scales[run],
                                       None if acc is None else acc[run])
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
        raw_bits(out)[dest[keep]] = raw_bits(np.asarray(source))[src[keep]]
        return (out,)

    @impl(tcp.ViewOp)
    def run_view(self, interpreter: Interpreter, op: tcp.ViewOp, args: tuple[Any, ...]):
        return (np.reshape(args[0], tcp.shape_of(op.result.type)),)

    @impl(tcp.OrderOp)
    def run_order(self, interpreter: Interpreter, op: tcp.OrderOp, args: tuple[Any, ...]):
        return (args[0],)

    @impl(tcp.LoadOp)
    def run_load(self, interpreter: Interpreter, op: tcp.LoadOp, args: tuple[Any, ...]):
        return (args[0],)

    @impl(tcp.StoreOp)
    def run_store(self, interpreter: Interpreter, op: tcp.StoreOp, args: tuple[Any, ...]):
        return (args[0],)
