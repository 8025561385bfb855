"""Costs of the schedule level's `tile` ops (dialects/tile.py), from the DMA formulas in
tcp_cost.py (furiosa-opt book, "DMA"; see the machine file for the numbers).

- `tile.buffer`: free; an HBM buffer takes no SRAM, an SRAM one its size.
- `tile.slice`: addressing within an SRAM tensor: free, and no new SRAM (its source's buffer).
- `tile.load`: one DMA copy of the tile, HBM -> SRAM.
- `tile.gather`: one DMA command, as `tcp.dma_gather` (tcp_cost.cost_dma_gather: the rows
  whose index is not -1, from HBM or SRAM as the source lives).
- `tile.gather_into`: that one DMA command, its rows written where the destination buffer lives
  (an HBM output: SRAM -> HBM, reads and writes pipelined as a store's), in place.
- `tile.store`: into an HBM buffer, one DMA copy SRAM -> HBM; into an SRAM buffer, free: the
  engine that produced the tile commits it at the buffer's address (an assumption: the
  compiler gives the producer that destination). Into another cluster's SRAM the memory plan
  adds a DMA copy of the stored bytes (`result_bytes`; memory_plan.py, `store_across`).
- a guarded load or store whose guard is negative: the guard only (`guard_cycles`, on DMA); a
  store guarded part by part (a group's blocks or their 128-row parts) moves the parts whose
  guard is not negative, in one command.
- `tile.copy`: one DMA copy SRAM -> SRAM (between clusters), its reads and writes serialised:
  the book says so of a same-cluster DM -> DM copy; for one between clusters it gives no
  figure, and the same is assumed.
- `tile.load_expert`: one DMA command moving the weight rows of the ids that differ from the
  previous block's; when the expert is the same, or the block unused, no command is issued:
  the guard that decides it only (`guard_cycles`, on a DMA engine). A window of each row (an
  F tile) moves as its contiguous pieces, each in whole requests (`window_pieces`). A load of
  another expert does not read the previous tile, so it does not wait for it
  (`register_unread_operands`): the next expert's weights are fetched while the previous
  expert's are still arriving. A load of the same expert passes the previous tile through
  (`register_forwarded_operand`): its guard decides from the ids alone, so it does not wait
  for that tile to arrive (its readers do) and takes no new SRAM. Before, the guard waited for
  the previous load on a DMA engine, and the next expert's load, issued after it, queued
  behind it there: two 1 MB loads ran one after the other on one engine (issue #12's sweep
  layer at T = 720: 231,158 cycles, above T = 728's 229,599; passed through: 223,068 and
  223,122, row tiles still two blocks ahead).
- `tile.guard`: the sequencer reads one scalar and branches (`guard_cycles`, on the tensor
  unit, as a contraction's guard): an unused block's `scf.if` costs this and nothing else.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from xdsl.ir import Operation

from dialects import tile
from dialects.tensor_types import shape_of, window_pieces
from runtime_sim.perf.cost_model import (
    DMA,
    TENSOR,
    OpCost,
    free_cost,
    guard_signs,
    in_hbm,
    register_alias,
    register_cost,
    register_cost_key,
    register_data_operands,
    register_disjoint_store,
    register_forwarded_operand,
    register_order_operands,
    register_unread_operands,
)
from target.machine import Machine
from runtime_sim.perf.tcp_cost import cost_dma_gather, dma_copy_cost, dma_rows_cost, gathered_rows, row_bytes
from runtime_sim.semantics.numerics import stored_nbytes


def same_expert_ids(ids: Any, prev_ids: Any) -> bool:
    """`np.array_equal(ids, prev_ids)`: by their bytes when both are integers of one dtype (equal
    values, equal bytes), a tenth of numpy's time; an expert loop asks it three times a block."""
    ids, prev_ids = np.asarray(ids), np.asarray(prev_ids)
    if ids.dtype == prev_ids.dtype and ids.dtype.kind in "iu":
        return ids.shape == prev_ids.shape and ids.tobytes() == prev_ids.tobytes()
    return bool(np.array_equal(ids, prev_ids))


def experts_fetched(ids: np.ndarray, prev_ids: np.ndarray | None) -> int:
    """Rows a `tile.load_expert` moves: ids that changed (all, without reuse) and name an expert."""
    ids = np.asarray(ids)
    if prev_ids is not None and same_expert_ids(ids, prev_ids):
        return 0
    return int(np.count_nonzero(ids >= 0))


def _guarded_off(op: Operation, operands: tuple[Any, ...]) -> bool:
    guard = getattr(op, "guard", None)
    return guard is not None and bool(np.asarray(operands[op.operands.index(guard)]).reshape(-1)[0] < 0)


def _guard_only(machine: Machine) -> OpCost:
    return OpCost(DMA, machine.guard_cycles, bound="guard (skipped)")


def cost_tile_load(op: Operation, operands: tuple[Any, ...], results: tuple[Any, ...], machine: Machine) -> OpCost:
    if _guarded_off(op, operands):
        return _guard_only(machine)
    return dma_copy_cost(machine, stored_nbytes(results[0]), in_hbm(op.operands[0]), False)


def cost_tile_gather(op: Operation, operands: tuple[Any, ...], results: tuple[Any, ...], machine: Machine) -> OpCost:
    if _guarded_off(op, operands):
        return _guard_only(machine)
    return cost_dma_gather(op, operands[:2], results, machine)


def cost_tile_gather_into(op: Operation, operands: tuple[Any, ...], results: tuple[Any, ...],
                          machine: Machine) -> OpCost:
    source, indices = operands[:2]
    rows = gathered_rows(indices)
    return dma_rows_cost(machine, rows, rows, row_bytes(source), in_hbm(op.operands[0]), in_hbm(op.results[0]))


def cost_tile_store(op: Operation, operands: tuple[Any, ...], results: tuple[Any, ...], machine: Machine) -> OpCost:
    assert isinstance(op, tile.StoreOp)
    nbytes = stored_nbytes(operands[0])
    if tile.guards_parts(op):  # only the parts whose guard is not negative move
        written = np.asarray(operands[3]) >= 0
        if not written.any():
            return _guard_only(machine)
        nbytes = nbytes * int(written.sum()) // written.size
    elif _guarded_off(op, operands):
        return _guard_only(machine)
    if not in_hbm(op.results[0]):
        return OpCost("none", 0, bound="committed in place", result_bytes=nbytes)
    return dma_copy_cost(machine, nbytes, False, True)


def cost_tile_copy(op: Operation, operands: tuple[Any, ...], results: tuple[Any, ...], machine: Machine) -> OpCost:
    return dma_copy_cost(machine, operands[0].nbytes, False, False)


def _guard_operand(op: Operation) -> tuple:
    return () if op.guard is None else (op.guard,)  # type: ignore[attr-defined]


def cost_load_expert(op: Operation, operands: tuple[Any, ...], results: tuple[Any, ...], machine: Machine) -> OpCost:
    assert isinstance(op, tile.LoadExpertOp)
    source, ids = operands[:2]
    rows = experts_fetched(ids, operands[2] if op.prev_ids is not None else None)
    if rows == 0:  # the expert's weights are already in SRAM, or the block is unused
        return OpCost(DMA, machine.guard_cycles, bound="guard (reused)")
    whole, window = shape_of(op.source.type)[1:], shape_of(op.result.type)[1:]
    nbytes = row_bytes(source) * math.prod(window) // max(1, math.prod(whole))
    return dma_rows_cost(machine, rows, rows, nbytes, in_hbm(op.operands[0]), False, window_pieces(whole, window))


def _rows_fetched(op: Operation, values: tuple[Any, ...]) -> int:
    """What `cost_load_expert` reads of the expert ids (a cost key): the rows it moves."""
    return experts_fetched(values[0], values[1] if op.prev_ids is not None else None)  # type: ignore[attr-defined]


def _unreused_tile(op: Operation, operands: tuple[Any, ...]) -> tuple[int, ...]:
    """A load of another expert's weights neither reads nor waits for the previous tile."""
    if op.prev_ids is None:  # type: ignore[attr-defined]
        return ()
    return () if same_expert_ids(operands[1], operands[2]) else (3,)


def _reused_tile(op: Operation, operands: tuple[Any, ...]) -> int | None:
    """A load of the previous block's expert passes the previous tile through."""
    if op.prev_ids is None or not same_expert_ids(operands[1], operands[2]):  # type: ignore[attr-defined]
        return None
    return 3


def cost_guard(op: Operation, operands: tuple[Any, ...], results: tuple[Any, ...], machine: Machine) -> OpCost:
    return OpCost(TENSOR, machine.guard_cycles, bound="guard")


def register_tile_costs() -> None:
    register_cost(tile.BufferOp)(free_cost)
    register_cost(tile.SliceOp)(free_cost)
    register_alias(tile.SliceOp, 0)
    register_cost(tile.LoadOp)(cost_tile_load)
    register_data_operands(tile.LoadOp, _guard_operand)
    register_data_operands(tile.StoreOp, _guard_operand)
    register_cost_key(tile.LoadOp, guard_signs)
    register_cost_key(tile.StoreOp, guard_signs)
    register_cost(tile.GatherOp)(cost_tile_gather)
    register_data_operands(tile.GatherOp, lambda op: (op.indices, *_guard_operand(op)))  # type: ignore[attr-defined]
    register_order_operands(tile.GatherOp, lambda op: tuple(op.after))  # type: ignore[attr-defined]
    register_cost(tile.GatherIntoOp)(cost_tile_gather_into)
    register_data_operands(tile.GatherIntoOp, lambda op: (op.indices,))  # type: ignore[attr-defined]
    register_alias(tile.GatherIntoOp, 2)
    register_disjoint_store(tile.GatherIntoOp)
    register_cost(tile.CopyOp)(cost_tile_copy)
    register_order_operands(tile.LoadOp, lambda op: tuple(op.after))  # type: ignore[attr-defined]
    register_cost(tile.StoreOp)(cost_tile_store)
    register_alias(tile.StoreOp, 1)
    register_disjoint_store(tile.StoreOp)
    register_unread_operands(tile.LoadExpertOp, _unreused_tile)
    register_forwarded_operand(tile.LoadExpertOp, _reused_tile)
    register_cost(tile.GuardOp)(cost_guard)
    register_cost(tile.LoadExpertOp)(cost_load_expert)
    register_data_operands(tile.LoadExpertOp,  # type: ignore[attr-defined]
                           lambda op: (op.ids,) if op.prev_ids is None else (op.ids, op.prev_ids))
    register_cost_key(tile.LoadExpertOp, _rows_fetched)
    register_order_operands(tile.LoadExpertOp, lambda op: tuple(op.after))  # type: ignore[attr-defined]
