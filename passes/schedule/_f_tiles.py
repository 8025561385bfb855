"""F tiles of an expert's contractions, for `schedule-experts`.

An expert's SwiGLU is up-projections `x @ w_gate[e]`, `x @ w_up[e]` ([B, D] x [D, F]), work
column by column on [B, F] (row masks, activation, product), and a down-projection
`h @ w_down[e]` ([B, F] x [F, D]) that sums over F. At real sizes an expert's three matrices
are tens to hundreds of megabytes (Mixtral: 117 MB each), so the schedule level fetches them as
F tiles: columns [f0, f1) of the up weights, the same rows of the down weight, the column work
on [B, f1 - f0], and the down-projection accumulated over the tiles into the block's f32
result, rounded once at the end as the reference does. This module finds that structure among
the ops a block loop absorbs (`find_f_region`) and picks the tile (`choose_f_tile`).

Block-scaled (fp8, MXFP4) experts tile the same way: the up-projections' `tcp.scaled_contract`
take their columns of the weight and of its block scales; the quantization of h between them
works group by group along F ([.., F / g, g] views, an amax per group), so a tile of whole
groups quantizes its columns as the whole does; the down-projection reads its rows of the
weight and of the weight's scales and h's groups' scales, and continues the previous tile's
sum (`acc`). Where each value holds F (the columns themselves, or groups or blocks of them)
is tracked per value (`FAxis`); tiles are multiples of every group and block.

Exactness: tiles start at multiples of `F_TILE_GRAIN`, a multiple of the contraction grid's
GRID_N and GRID_K (runtime_sim/semantics/numerics.py), and the down-projection passes its
running f32 sum as the next tile's `acc`: every chunk of the grid is the same matmul on the same
data, added in the same order, so the tiled program gives the whole contraction's bits. A
block-scaled contraction adds its K-blocks' scaled partial sums in K order onto `acc`
(`quantization.scaled_contract`), and its tile edges are K-block edges: the same sum again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from xdsl.dialects.builtin import TensorType
from xdsl.ir import Operation, SSAValue

from dialects import tcp, ve
from dialects.tensor_types import shape_of, stored_bytes, window_pieces
from passes._loop_builder import axis_of
from runtime_sim.semantics.numerics import GRID_K, GRID_N
from target.machine import Machine

F_TILE_GRAIN = math.lcm(GRID_N, GRID_K)
"""F tiles start at multiples of this (512): their edges fall on the contraction grid."""
WEIGHT_SHARE = 2
"""Expert weights may take 1 / WEIGHT_SHARE of a cluster's SRAM; the rest holds the row tiles,
the accumulators and the other phases' tiles (assumption: a compiler's split, not measured)."""
TILES_IN_FLIGHT = 2
"""Streamed F tiles in SRAM at once: the tile contracting and the next one arriving (a tile's
loads wait for the down-projection two tiles earlier, the last reader of that tile's weights)."""
UP_SPEC = "gbd,gdf->gbf"
"""The block contractions the lowering emits (lower-dispatch): [G, B, K] x [G, K, N]."""
CONTRACTIONS = (tcp.ContractOp, tcp.ScaledContractOp)
"""Block contractions: bf16/f32, and block-scaled fp8/MXFP4 (always `gbd,gdf->gbf`)."""


@dataclass(frozen=True)
class FAxis:
    """Where a value of the region holds F: along `axis`, `per` columns of F per index (1 for
    the columns themselves, g for a quantization's groups [.., F / g, g] and their scales
    [.., F / g], a weight block's size for its block scales)."""

    axis: int
    per: int


@dataclass(frozen=True)
class FRegion:
    """The F-tileable part of a plan's block ops: `tiled` (in block order) are the up
    contractions, the ops working column by column (or group by group) on their results up to
    the down contraction's F-wide operands, and the F-wide inputs they need (the weight, scale
    and bias gathers, masks, splats); `down` sums over F, reading `down_loads` (its weight and,
    block-scaled, the weight's scales) gathered. `axes` says where each of these values holds F."""

    f: int
    ups: tuple[Operation, ...]
    down: tcp.ContractOp | tcp.ScaledContractOp
    down_loads: tuple[tcp.DmaGatherOp, ...]
    tiled: tuple[Operation, ...]
    shared: tuple[Operation, ...]
    """Ops of `tiled` also read outside the region: they are kept whole as well."""
    axes: Mapping[SSAValue, FAxis]
    outside: tuple[SSAValue, ...] = ()
    """F-wide values made before the loop (in SRAM, G rows: scales gathered ahead) that each
    tile reads a window of."""

    @property
    def grain(self) -> int:
        """Tiles are multiples of this: the contraction grid's and every group's and block's."""
        return math.lcm(F_TILE_GRAIN, *(a.per for a in self.axes.values()))

    def tile_type(self, value: SSAValue, width: int) -> TensorType:
        """`value`'s type for one block and `width` columns of F."""
        t = value.type
        assert isinstance(t, TensorType)
        shape = [1, *t.get_shape()[1:]]
        a = self.axes[value]
        shape[a.axis] = width // a.per
        return TensorType(t.get_element_type(), shape)

    def window(self, value: SSAValue, columns: tuple[int, int]) -> tuple[list[int], list[int]]:
        """The part of each row of `value` (a gather's: of each expert's row of its source)
        an F tile reads: offsets and sizes in every axis after the first."""
        return axis_window(value, self.axes[value], columns)


def axis_window(value: SSAValue, a: FAxis, span: tuple[int, int]) -> tuple[list[int], list[int]]:
    """The part of each row of `value`, which holds an axis at `a`, that holds `span` of that
    axis (an F tile's columns, a K piece's rows): offsets and sizes in every axis after the first."""
    sizes = list(shape_of(value.type)[1:])
    offsets = [0] * len(sizes)
    offsets[a.axis - 1] = span[0] // a.per
    sizes[a.axis - 1] = (span[1] - span[0]) // a.per
    return offsets, sizes


def last_dim(value: SSAValue | None) -> int | None:
    t = None if value is None else value.type
    if isinstance(t, TensorType) and t.get_shape():
        return t.get_shape()[-1]
    return None


def view_axis(src: tuple[int, ...], dst: tuple[int, ...], a: FAxis) -> FAxis | None:
    """Where F is in a view of shape `dst` of a value of shape `src` holding F at `a`: the
    views the lowering makes around a group-wise step, the last axis split into [n / g, g]
    and merged back, or an axis of 1 added or dropped before it (a bias [G, 1, F]); None for
    any other view of F."""
    if src == dst:
        return a
    r = len(src)
    if len(dst) == r + 1 and dst[:r - 1] == src[:r - 1] and dst[r - 1] * dst[r] == src[r - 1]:  # split the last axis
        last = r - 1
        if a.axis < last:
            return a
        if dst[last] == 1:
            return FAxis(last + 1, a.per)
        return FAxis(last, a.per * dst[last + 1])
    if len(dst) == r - 1 and dst[:r - 2] == src[:r - 2] and dst[r - 2] == src[r - 2] * src[r - 1]:  # merge the last two
        outer = r - 2
        if a.axis < outer:
            return a
        if a.axis == outer + 1:
            return FAxis(outer, a.per) if src[outer] == 1 else None
        return FAxis(outer, a.per // src[outer + 1]) if a.per % src[outer + 1] == 0 else None
    return None


def operand_axes(op: Operation, a: FAxis) -> list[tuple[SSAValue, FAxis]] | None:
    """For a `ve` op or view whose results hold F at `a`: its operands that hold F, and where;
    None when column j of its results does not come from column j of its operands alone (it
    works along F, or reshapes it in another way)."""
    if isinstance(op, tcp.ViewOp):
        b = view_axis(shape_of(op.result.type), shape_of(op.input.type), a)
        return None if b is None else [(op.input, b)]
    if op.dialect_name() != "ve" or not op.results:
        return None
    result = shape_of(op.results[0].type)
    if any(shape_of(r.type) != result for r in op.results):
        return None
    along = axis_of(op)
    if isinstance(op, ve.BroadcastOp):  # along F: it creates F from an operand without it
        assert along is not None
        return [] if along == a.axis else [(op.input, FAxis(a.axis - (along < a.axis), a.per))]
    if isinstance(op, ve.ReduceOp):
        assert along is not None
        b = FAxis(a.axis + (along <= a.axis), a.per)
        return [(op.input, b)]
    if along == a.axis:  # a scan, numbering or tag along F
        return None
    if any(not isinstance(v.type, TensorType) or shape_of(v.type) != result for v in op.operands):
        return None
    return [(v, a) for v in op.operands]


def _is_up(op: Operation, weights: Mapping[SSAValue, tcp.DmaGatherOp]) -> bool:
    """A block contraction of a gathered weight that starts from zero (an up- or a down-projection)."""
    if isinstance(op, tcp.ContractOp):
        return op.spec.data == UP_SPEC and op.rhs in weights and op.acc is None
    return isinstance(op, tcp.ScaledContractOp) and op.rhs in weights and op.acc is None


def ancestors(value: SSAValue, inside: set[Operation]) -> set[Operation]:
    """The ops of `inside` that `value` is computed from."""
    seen: set[Operation] = set()
    stack = [value]
    while stack:
        owner = stack.pop().owner
        if isinstance(owner, Operation) and owner in inside and owner not in seen:
            seen.add(owner)
            stack.extend(owner.operands)
    return seen


def _f_operands(op: tcp.ContractOp | tcp.ScaledContractOp, f: int, down: bool) -> list[tuple[SSAValue, FAxis]]:
    """The operands of a block contraction that hold F: an up-projection's weight, its scales
    and its bias hold its result's columns; a down-projection reads F as its reduction axis,
    in its lhs and the weight's rows (and their scales)."""
    def per(v: SSAValue, axis: int) -> FAxis:
        return FAxis(axis, f // shape_of(v.type)[axis])

    if down:
        found = [(op.lhs, FAxis(2, 1)), (op.rhs, FAxis(1, 1))]
        if isinstance(op, tcp.ScaledContractOp):
            found += [(op.lhs_scales, per(op.lhs_scales, 2)), (op.rhs_scales, per(op.rhs_scales, 1))]
        return found
    found = [(op.rhs, FAxis(2, 1))]
    if isinstance(op, tcp.ScaledContractOp):
        found.append((op.rhs_scales, per(op.rhs_scales, 2)))
    if op.bias is not None:
        found.append((op.bias, FAxis(len(shape_of(op.bias.type)) - 1, 1)))
    return found


def find_f_region(ops: list[Operation], gathers: list[tcp.DmaGatherOp],
                  addressable: Callable[[SSAValue], bool] = lambda v: False) -> FRegion | None:
    """The plan's F region, or None when its ops are not up-projections, column-wise (or
    group-wise) work and one down-projection in the shape above (then the plan is not tiled).
    F-wide values made before the loop are read by window where `addressable` says they may
    be (in SRAM, one row per block)."""
    inside = set(ops)
    weights = {g.result: g for g in gathers}
    matmuls = [op for op in ops if _is_up(op, weights)]
    downs = [c for c in matmuls if ancestors(c.lhs, inside) & set(matmuls)]
    if len(downs) != 1:
        return None
    down = downs[0]
    assert isinstance(down, CONTRACTIONS)
    f = shape_of(down.rhs.type)[1]
    axes: dict[SSAValue, FAxis] = {}
    down_loads: list[tcp.DmaGatherOp] = []
    outside: list[SSAValue] = []
    stack: list[tuple[SSAValue, FAxis]] = []
    for v, a in _f_operands(down, f, down=True):
        if v in (down.lhs, getattr(down, "lhs_scales", None)):
            stack.append((v, a))
            continue
        axes[v] = a
        load = weights.get(v)
        if load is None and addressable(v):
            outside.append(v)
        elif load is None or any(u.operation is not down for u in v.uses):
            return None  # the down-projection's weight (or its scales) is not its own gather
        else:
            down_loads.append(load)
    ups: list[Operation] = []
    region: set[Operation] = set()
    while stack:
        v, a = stack.pop()
        if v in axes:
            if axes[v] != a:
                return None
            continue
        t = v.type
        if not isinstance(t, TensorType) or not 0 <= a.axis < len(t.get_shape()) or t.get_shape()[a.axis] * a.per != f:
            return None
        axes[v] = a
        owner = v.owner
        if not isinstance(owner, Operation) or owner not in inside:
            if addressable(v):
                outside.append(v)
                continue
            return None  # F wide, made outside the loop's ops, not to be addressed by window
        if owner in region:
            continue
        region.add(owner)
        if owner in matmuls:
            if a != FAxis(2, 1):
                return None
            ups.append(owner)
            stack += _f_operands(owner, f, down=False)
        elif isinstance(owner, tcp.DmaGatherOp):
            if owner not in gathers:
                return None
        else:
            found = operand_axes(owner, a)
            if found is None:
                return None
            for r in owner.results:
                axes.setdefault(r, a)
            stack += found
    if not ups:
        return None
    # core: what depends on an up-projection; it may be read only inside the region
    core: set[Operation] = set()
    for op in ops:
        if op in region and (op in ups or any(isinstance(v.owner, Operation) and v.owner in core for v in op.operands)):
            core.add(op)
    everything = region | {down}
    for op in core:
        for r in op.results:
            if r not in axes or any(u.operation not in everything for u in r.uses):
                return None
    for op in everything:
        if any(isinstance(v.owner, Operation) and v.owner in core and v not in axes for v in op.operands):
            return None
    tiled = tuple(op for op in ops if op in region)
    shared = tuple(op for op in tiled if op not in core and any(
        u.operation not in everything for r in op.results for u in r.uses))
    if any(isinstance(op, tcp.DmaGatherOp) for op in shared):
        return None
    return FRegion(f, tuple(op for op in ops if op in ups), down, tuple(down_loads), tiled, shared, axes,
                   tuple(outside))


def expert_bytes(gathers: list[tcp.DmaGatherOp]) -> int:
    """Bytes of one expert's weights that a block loads (every gathered weight's row, at its
    stored width)."""
    return sum(stored_bytes(g.source.type) // shape_of(g.source.type)[0] for g in gathers)


def held_weight_bytes(region: FRegion | None, gathers: list[tcp.DmaGatherOp], width: int, resident: bool) -> int:
    """The SRAM the expert loop's weight tiles hold at once, for the weights' share of SRAM
    (`WEIGHT_SHARE`): two experts' whole weights where they are resident or untiled (the one
    contracting and the next, prefetched), else `TILES_IN_FLIGHT` tiles of `width` columns of
    the tiled weights beside two of the untiled ones."""
    if resident or region is None or width >= region.f:
        return 2 * expert_bytes(gathers)
    tiled = [g for g in gathers if g in region.tiled or g in region.down_loads]
    untiled = [g for g in gathers if g not in tiled]
    return TILES_IN_FLIGHT * expert_bytes(tiled) * width // region.f + 2 * expert_bytes(untiled)


def idle_engine_bytes(nbytes: int, machine: Machine) -> float:
    """What a DMA command of `nbytes` leaves its engines idle, in bytes: it is cut into pieces
    of the machine's `dma.split_bytes` (the last smaller), one engine each, spread evenly over
    all engines beyond one piece per engine, and holds every engine it uses for its largest
    part's time."""
    piece, engines = machine.dma_split_bytes, machine.dma_engines
    pieces = -(-nbytes // piece)
    if pieces <= 1:
        return 0.0
    parts = min(engines, pieces)
    return parts * max(piece, nbytes / engines) - nbytes


def moved_bytes(gather: tcp.DmaGatherOp, sizes: list[int], request_bytes: int) -> int:
    """Bytes a load of the window `sizes` of one expert's row of `gather`'s source moves: each
    contiguous piece in whole DMA requests of `request_bytes` (as tile.load_expert's cost
    counts them)."""
    whole = shape_of(gather.source.type)[1:]
    nbytes = stored_bytes(gather.source.type) // shape_of(gather.source.type)[0] * math.prod(sizes) // math.prod(whole)
    pieces = window_pieces(whole, sizes)
    return pieces * -(-nbytes // pieces // request_bytes) * request_bytes


def resident_tile(region: FRegion, tiled: list[tcp.DmaGatherOp], machine: Machine) -> int:
    """The F tile of resident weights: the width (a multiple of the grain, or the whole F)
    whose tiles' loads hold the DMA engines least (the bytes they move, in whole requests,
    plus what they leave their engines idle, `idle_engine_bytes`), the narrowest of equals:
    an expert's weights arrive as commands of whole pieces spread over the engines, and its
    first tile contracts while the next arrive. Qwen3-30B-A3B's fp8 matrix (1.5 MB) loads as
    a 1 MB and a 0.5 MB tile, not as one command holding two engines for 1 MB each;
    gpt-oss-120b's (8.3 MB) loads whole over the eight engines, not as 1.5 MB tiles; an MXFP4
    tile of 256 columns would move its 128-byte rows as 256-byte requests. One token's too
    (decode): its results kept in SRAM (schedule-experts), only the last tile's contraction
    and the combine follow the last weight byte (Qwen3-30B-A3B bf16 T = 1: 512 and 256 rather
    than the whole F = 768, 58,221 -> 58,095 cycles; the widest of equals was taken there while
    the results went through HBM, 59,420 -> 59,308)."""
    def held(width: int) -> float:
        total = 0.0
        for f0 in range(0, region.f, width):
            columns = (f0, min(region.f, f0 + width))
            for g in tiled:
                moved = moved_bytes(g, region.window(g.result, columns)[1], machine.dma_request_bytes)
                total += moved + idle_engine_bytes(moved, machine)
        return total

    widths = list(range(region.grain, region.f, region.grain)) + [region.f]
    return min(widths, key=lambda w: (held(w), w))


def choose_f_tile(region: FRegion, gathers: list[tcp.DmaGatherOp], sram_bytes: int, forced: int,
                  machine: Machine) -> tuple[int, bool]:
    """The F tile, and whether the tiles stay resident (reused by the expert's next blocks),
    for `sram_bytes` of SRAM and `machine`'s DMA.

    Resident when two experts' whole weights fit the weights' share of SRAM (the current one
    and the next, prefetched): then the tile is `resident_tile`'s (`forced` if given), so an
    expert's weights arrive as several DMA commands spread over more engines, and the first tile
    contracts while the next arrive (one grain for Qwen3-30B-A3B in bf16, F = 768, T = 1024,
    cost-only, balanced, one cluster: 1.57x -> 1.38x the roofline). Otherwise the tiles stream, every block
    fetching its expert's tiles: as many as the widest tile (a multiple of the grain whose
    TILES_IN_FLIGHT tiles of every tiled weight fit the share, at least one grain) needs, of
    even widths rounded up to the grain (DeepSeek-V3's F = 2048 in fp8: two tiles of 1024
    rather than 1536 and 512: 10.08 M -> 9.84 M cycles at T = 2048)."""
    budget = sram_bytes // WEIGHT_SHARE
    resident = 2 * expert_bytes(gathers) <= budget
    grain = region.grain
    if forced > 0:
        return min(-(-forced // grain) * grain, region.f), resident
    tiled = [g for g in gathers if g in region.tiled or g in region.down_loads]
    if resident:
        return resident_tile(region, tiled, machine), True
    per_column = expert_bytes(tiled) / region.f
    widest = max(grain, min(region.f, int(budget // (TILES_IN_FLIGHT * per_column)) // grain * grain))
    even = -(-region.f // -(-region.f // widest))  # as many tiles as the widest needs, of even widths
    return -(-even // grain) * grain, False
