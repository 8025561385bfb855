"""The schedule level's loops and the tile sizes they use, read from the simulated IR for the
report: which tiles the compiler chose is a fact of the IR, not of the cost model."""

from __future__ import annotations

from xdsl.dialects import arith, func, scf
from xdsl.dialects.builtin import IntegerAttr, ModuleOp
from xdsl.ir import SSAValue

from dialects import tile
from dialects.annotations import phase_of
from dialects.tensor_types import format_type
from runtime_sim.perf.report import TileLoop

TILE_OPS = (tile.SliceOp, tile.LoadOp, tile.GatherOp, tile.LoadExpertOp)
"""The ops that bring one iteration's tile into SRAM."""


def _constant(value: SSAValue) -> int | None:
    owner = value.owner
    if isinstance(owner, arith.ConstantOp) and isinstance(owner.value, IntegerAttr):
        return owner.value.value.data
    return None


def tile_loops(module: ModuleOp, function: str) -> list[TileLoop]:
    """Every `scf.for` of `function` with constant bounds, outermost first, with its phase,
    trip count, step and the distinct types of the tiles its body slices or loads."""
    loops: list[TileLoop] = []
    for fn in module.ops:
        if not (isinstance(fn, func.FuncOp) and fn.sym_name.data == function):
            continue
        for op in fn.walk():
            if not isinstance(op, scf.ForOp):
                continue
            lb, ub, step = _constant(op.lb), _constant(op.ub), _constant(op.step)
            if lb is None or ub is None or not step:
                continue
            body = op.body.block
            # through branches (an unused block's scf.if) and the clusters' copies alike
            tiles = dict.fromkeys(format_type(t.result.type) for t in body.walk() if isinstance(t, TILE_OPS))
            variable = body.args[0].name_hint or "i"
            loops.append(TileLoop(phase_of(op) or "other", variable, max(0, -(-(ub - lb) // step)), step, tuple(tiles)))
    return loops
