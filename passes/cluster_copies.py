"""What crosses the chip's clusters: where a value lives, and reading a value another cluster
made (a `tile.copy`, a DMA command SRAM -> SRAM), shared by split-clusters' expert loop and
token tiles (passes/split_clusters.py, passes/cluster_token_tiles.py)."""

from __future__ import annotations

from collections.abc import Callable

from xdsl.dialects import arith, func, scf
from xdsl.ir import Block, BlockArgument, Operation, OpResult, SSAValue

from dialects import tcp, tile, ve
from dialects.annotations import place_on_cluster, placed_in_hbm


def in_hbm(value: SSAValue) -> bool:
    """Whether `value` lives in HBM: a function argument, an HBM buffer or a command placed in
    HBM, through views, stores into a buffer and the loops that carry one."""
    while True:
        owner = value.owner
        if isinstance(owner, tcp.ViewOp):
            value = owner.input
        elif isinstance(owner, tile.StoreOp):
            value = owner.dest
        elif isinstance(owner, scf.ForOp) and isinstance(value, OpResult):
            value = owner.iter_args[value.index]
        else:
            break
    if isinstance(value, BlockArgument) and isinstance(owner, Block):
        return isinstance(owner.parent_op(), func.FuncOp)
    if isinstance(owner, tile.BufferOp):
        return owner.space.data == "hbm"
    return isinstance(owner, Operation) and placed_in_hbm(owner)


def is_constant(value: SSAValue) -> bool:
    """A splat or an index constant: each cluster may rebuild it."""
    return isinstance(value.owner, (ve.ConstOp, arith.ConstantOp))


def reacher(before: list[Operation]) -> Callable[[SSAValue, int], SSAValue]:
    """`reach(value, cluster)`: `value`, defined before a loop, as `cluster` reads it: itself
    on cluster 0, in HBM or a constant, else its DMA copy (`tile.copy`, appended to `before`
    once per cluster and value)."""
    copies: dict[tuple[int, SSAValue], SSAValue] = {}

    def reach(value: SSAValue, cluster: int) -> SSAValue:
        if cluster == 0 or in_hbm(value) or is_constant(value):
            return value
        if (cluster, value) not in copies:
            copy = tile.CopyOp(value)
            place_on_cluster(copy, cluster)
            before.append(copy)
            copies[(cluster, value)] = copy.result
        return copies[(cluster, value)]

    return reach


def pin(op: Operation, cluster: int) -> None:
    """`op` and every op nested in it on `cluster`."""
    for inner in op.walk():
        place_on_cluster(inner, cluster)
