"""What crosses the chip's clusters: reading a value another cluster made (a `tile.copy`, a DMA
command SRAM -> SRAM) and pinning ops to a cluster, shared by split-clusters' expert loops and
token tiles (passes/schedule/split_clusters.py, passes/schedule/_cluster_token_tiles.py)."""

from __future__ import annotations

from collections.abc import Callable

from xdsl.dialects import arith
from xdsl.ir import Operation, SSAValue

from dialects import tcp, tile, ve
from dialects.annotations import place_on_cluster, place_on_own_dma
from passes._loop_builder import in_hbm


def is_constant(value: SSAValue) -> bool:
    """A splat or an index constant: each cluster may rebuild it."""
    return isinstance(value.owner, (ve.ConstOp, arith.ConstantOp))


def reacher(before: list[Operation], copies: dict[tuple[int, SSAValue], SSAValue] | None = None
            ) -> Callable[[SSAValue, int], SSAValue]:
    """`reach(value, cluster)`: `value`, defined before a loop, as `cluster` reads it: itself
    on cluster 0, in HBM or a constant, else its DMA copy (`tile.copy`, appended to `before`
    once per cluster and value; `copies` keeps them for the next loop)."""
    copies = {} if copies is None else copies

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


def read_in_place(op: Operation, operand: SSAValue) -> bool:
    """Whether `op` reads `operand` where it lives, on any cluster (or in HBM), so that no
    copy is needed: a DMA gather's source (a DMA command reads any cluster's memory)."""
    return isinstance(op, (tile.GatherOp, tcp.DmaGatherOp)) and operand is op.source


DMA_OPS = (tile.LoadOp, tile.GatherOp, tile.LoadExpertOp, tile.StoreOp, tile.CopyOp, tcp.DmaGatherOp, tcp.DmaScatterOp,
           tcp.LoadOp, tcp.StoreOp)
"""The ops the DMA engines run."""


def pin(op: Operation, cluster: int, own_dma: bool = False) -> None:
    """`op` and every op nested in it on `cluster`; with `own_dma`, its DMA ops on the
    cluster's own DMA engines (`tcpc.own_dma`)."""
    for inner in op.walk():
        place_on_cluster(inner, cluster)
        if own_dma and isinstance(inner, DMA_OPS):
            place_on_own_dma(inner)
