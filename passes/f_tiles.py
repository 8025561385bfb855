"""F tiles of an expert's contractions, for `schedule-experts`.

An expert's SwiGLU is up-projections `x @ w_gate[e]`, `x @ w_up[e]` ([B, D] x [D, F]), work
column by column on [B, F] (row masks, activation, product), and a down-projection
`h @ w_down[e]` ([B, F] x [F, D]) that sums over F. At real sizes an expert's three matrices
are tens to hundreds of megabytes (Mixtral: 117 MB each), so the schedule level fetches them as
F tiles: columns [f0, f1) of the up weights, the same rows of the down weight, the column work
on [B, f1 - f0], and the down-projection accumulated over the tiles into the block's f32
result, rounded once at the end as the reference does. This module finds that structure among
the ops a block loop absorbs (`find_f_region`) and picks the tile (`choose_f_tile`).

Exactness: tiles start at multiples of `F_TILE_GRAIN`, a multiple of the contraction grid's
GRID_N and GRID_K (runtime_sim/semantics/numerics.py), and the down-projection passes its
running f32 sum as the next tile's `acc`: every chunk of the grid is the same matmul on the same
data, added in the same order, so the tiled program gives the whole contraction's bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from xdsl.dialects.builtin import Float32Type, TensorType
from xdsl.ir import Attribute, Operation, SSAValue

from dialects import tcp, ve
from runtime_sim.semantics.numerics import GRID_K, GRID_N, tensor_dtype

F_TILE_GRAIN = math.lcm(GRID_N, GRID_K)
"""F tiles start at multiples of this (512): their edges fall on the contraction grid."""
WEIGHT_SHARE = 2
"""Expert weights may take 1 / WEIGHT_SHARE of a cluster's SRAM; the rest holds the row tiles,
the accumulators and the other phases' tiles (assumption: a compiler's split, not measured)."""
TILES_IN_FLIGHT = 2
"""Streamed F tiles in SRAM at once: the tile contracting and the next one arriving (a tile's
loads wait for the down-projection two tiles earlier, the last reader of that tile's weights)."""
CLUSTER_SRAM_BYTES = 128 * 1024 * 1024
"""One cluster's SRAM, 256 slices x 512 KB (machines/rngd.toml, docs/hardware.md#one-chip): the
default budget (a pass cannot read the machine file; `schedule-experts{sram_bytes=...}`)."""
UP_SPEC = "gbd,gdf->gbf"
"""The block contractions the lowering emits (lower-dispatch): [G, B, K] x [G, K, N]."""


@dataclass(frozen=True)
class FRegion:
    """The F-tileable part of a plan's block ops: `tiled` (in block order) are the up
    contractions, the ops working column by column on their results up to the down
    contraction's lhs, and the F-shaped inputs they need (the weight and bias gathers, masks,
    splats); `down` sums over F with the weight `down_weight` gathers."""

    f: int
    ups: tuple[tcp.ContractOp, ...]
    down: tcp.ContractOp
    down_weight: tcp.DmaGatherOp
    tiled: tuple[Operation, ...]
    shared: tuple[Operation, ...]
    """Ops of `tiled` also read outside the region: they are kept whole as well."""


def last_dim(value: SSAValue | None) -> int | None:
    t = None if value is None else value.type
    if isinstance(t, TensorType) and t.get_shape():
        return t.get_shape()[-1]
    return None


def with_last_dim(t: Attribute, size: int) -> TensorType:
    assert isinstance(t, TensorType)
    return TensorType(t.get_element_type(), [*t.get_shape()[:-1], size])


def _column_wise(op: Operation, f: int) -> bool:
    """A `ve` op whose every result has F columns last and that does not work along the
    last axis (a broadcast creating it is fine): column j of its results is computed from
    column j of its F-shaped operands."""
    if op.dialect_name() != "ve" or not op.results or any(last_dim(r) != f for r in op.results):
        return False
    rank = len(op.results[0].type.get_shape())
    attr = op.properties.get("axis") or op.attributes.get("axis")
    axis = getattr(getattr(attr, "value", None), "data", None)
    return axis != rank - 1 or isinstance(op, ve.BroadcastOp)


def _ancestors(value: SSAValue, inside: set[Operation]) -> set[Operation]:
    seen: set[Operation] = set()
    stack = [value]
    while stack:
        owner = stack.pop().owner
        if isinstance(owner, Operation) and owner in inside and owner not in seen:
            seen.add(owner)
            stack.extend(owner.operands)
    return seen


def find_f_region(ops: list[Operation], gathers: list[tcp.DmaGatherOp]) -> FRegion | None:
    """The plan's F region, or None when its ops are not up-projections, column work and one
    down-projection in the shape above (then the plan is not tiled)."""
    if any(isinstance(op, tcp.ScaledContractOp) for op in ops):
        return None  # block-scaled contractions sum K-blocks their own way: not tiled yet
    inside = set(ops)
    weights = {g.result: g for g in gathers}
    matmuls = [op for op in ops if isinstance(op, tcp.ContractOp) and op.spec.data == UP_SPEC
               and op.rhs in weights and op.acc is None]
    downs = [c for c in matmuls if _ancestors(c.lhs, inside) & set(matmuls)]
    if len(downs) != 1:
        return None
    down = downs[0]
    f = down.rhs.type.get_shape()[1]
    upstream = _ancestors(down.lhs, inside)
    ups = [c for c in matmuls if c is not down and c in upstream]
    if not ups or any(last_dim(u.result) != f for u in ups) or not isinstance(
            down.result.type.get_element_type(), Float32Type):
        return None
    if any(u.operation is not down for u in down.rhs.uses):
        return None
    # core: what depends on an up-projection and feeds the down-projection's lhs
    core: set[Operation] = set(ups)
    for op in ops:
        if op in upstream and any(isinstance(v.owner, Operation) and v.owner in core for v in op.operands):
            core.add(op)
    for op in core:
        if op not in ups and not _column_wise(op, f):
            return None
        if any(use.operation not in core and not (use.operation is down and use.index == 0)
               for r in op.results for use in r.uses):
            return None
    # side: the F-shaped inputs of the core (weights, biases, masks, splats), recursively
    side: set[Operation] = set()
    stack: list[SSAValue] = []
    for op in core:
        stack += [op.rhs] + ([op.bias] if op.bias is not None else []) if op in ups else list(op.operands)
    while stack:
        v = stack.pop()
        if last_dim(v) != f:
            continue  # no F axis (a row mask before its broadcast): read whole by every tile
        owner = v.owner
        if not isinstance(owner, Operation) or owner not in inside:
            return None  # F wide but made outside the loop's ops: its columns are not known
        if owner in core or owner in side:
            continue
        if isinstance(owner, tcp.DmaGatherOp):
            if owner not in gathers:
                return None
        elif isinstance(owner, tcp.ViewOp):
            if last_dim(owner.input) != f:
                return None
            stack.append(owner.input)
        elif _column_wise(owner, f):
            stack += list(owner.operands)
        else:
            return None
        side.add(owner)
    tiled = tuple(op for op in ops if op in core or op in side)
    region = set(tiled) | {down}
    shared = tuple(op for op in tiled if op in side and any(
        u.operation not in region for r in op.results for u in r.uses))
    if any(isinstance(op, tcp.DmaGatherOp) for op in shared):
        return None
    return FRegion(f, tuple(ups), down, weights[down.rhs], tiled, shared)


def expert_bytes(gathers: list[tcp.DmaGatherOp]) -> int:
    """Bytes of one expert's weights that a block loads (every gathered weight's row)."""
    return sum(math.prod(g.source.type.get_shape()[1:]) * tensor_dtype(g.source.type).itemsize for g in gathers)


def choose_f_tile(region: FRegion, gathers: list[tcp.DmaGatherOp], sram_bytes: int, forced: int) -> tuple[int, bool]:
    """The F tile, and whether the tiles stay resident (reused by the expert's next blocks).

    Resident when two experts' whole weights fit the weights' share of SRAM (the current one
    and the next, prefetched): then the tile is one grain (`forced` if given), so an expert's
    weights arrive as several DMA commands spread over more engines, and the first tile
    contracts while the next arrive (Qwen3-30B-A3B, F = 768, T = 1024, cost-only, balanced,
    one cluster: 1.57x -> 1.38x the roofline). Otherwise the tiles stream: the largest multiple of F_TILE_GRAIN whose
    TILES_IN_FLIGHT tiles of every tiled weight fit the share (at least one grain), and every
    block fetches its expert's tiles."""
    budget = sram_bytes // WEIGHT_SHARE
    resident = 2 * expert_bytes(gathers) <= budget
    if forced > 0:
        return min(forced, region.f), resident
    if resident:
        return min(F_TILE_GRAIN, region.f), True
    tiled = [g for g in gathers if g in region.tiled or g is region.down_weight]
    per_column = expert_bytes(tiled) / region.f
    tile = int(budget // (TILES_IN_FLIGHT * per_column)) // F_TILE_GRAIN * F_TILE_GRAIN
    return max(F_TILE_GRAIN, min(region.f, tile)), False
