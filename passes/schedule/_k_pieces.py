"""Weight loads in pieces, for `schedule-experts`: the last block's in K pieces (one token,
decode), and every block's whole weight whose one DMA command would leave an engine idle
(`engine_pieces`: in K pieces, or in N pieces where K is one grain, `column_pieces`).

One token's expert loop (blocks of one row, results in SRAM) is the weight stream: each block
loads its expert's matrices, each by one DMA command, and where a matrix is at most one DMA
piece (`dma.split_bytes`) that command runs on one engine, at most 256 B/cycle. The engines
take the commands in program order as they free, so the last block's commands, each as large
as the others, end staggered: Qwen3-30B-A3B MXFP4 (768 KB a matrix) left its engines running
out of work over ~4k cycles while HBM had bandwidth to spare. schedule-experts therefore runs
the last block as a loop of its own, whose body this module rewrites (`cut_last_block`): each
contraction `gbd,gdf->gbf` of a whole weight one engine loads, after the block's first, is cut
along its contraction axis K into LAST_PIECES pieces, each loading its rows of the weight
(`tile.load_expert ... at`, an expert's rows are contiguous) and continuing the previous
piece's f32 sum (`acc`); the lhs, its scales and scales gathered before the loop are
addressed in place by window (`tile.slice ... at`, no DMA).
Smaller commands end the stream, and the engines finish closer together (Qwen3-30B-A3B MXFP4
T = 1: 19,206 -> 18,552 cycles). The block's first matrix ends well before the others: cut, it
only adds a start-up (all three cut: 18,768; every block's matrices cut: 19,527).

The pieces load afresh (nothing follows the last block to reuse them): the tile the loop
carries for the next block's reuse is the one it was given, never read again.

A mesh chip's weight stream at decode ends the same way, with its last chunk's last round of
the clusters' blocks, whose F tiles' windows are one engine's each (Qwen3-30B-A3B's [2048, 256]
bf16, 1 MB): interleave-chunks makes that round a loop piece of its own and `round_in_pieces`
loads those windows in pieces too, along K where the contraction starts its sum, else along N
(a down projection whose K is an F tile, continuing the previous tile's sum by columns,
`column_pieces`); the block then carries on the tile and ids it was given, as the slot's next
block may be of the same expert (`load_in_pieces`).

Exact: the pieces start at multiples of `k_grain` (the contraction grid's GRID_K and every
K-block of the scales), so each piece is whole grid chunks and whole K-blocks, summed in K
order onto the previous piece's sum (`numerics.contract`, `quantization.scaled_contract`): the
last piece gives the whole contraction's bits; a bias is added by the last piece. N pieces
start at multiples of GRID_N, so each piece's output chunks are the whole contraction's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from xdsl.dialects import scf
from xdsl.dialects.builtin import TensorType
from xdsl.ir import Block, Operation, SSAValue

from dialects import tcp, tile
from dialects.annotations import CLUSTER_ATTR, PHASE_ATTR
from dialects.tensor_types import shape_of, stored_bytes
from passes._loop_builder import erase_unread, index_constant
from passes.schedule._f_tiles import CONTRACTIONS, UP_SPEC, FAxis, axis_window, idle_engine_bytes
from passes.schedule.map_contractions import map_contraction
from runtime_sim.semantics.numerics import GRID_K, GRID_N
from target.machine import Machine

LAST_PIECES = 2
"""The pieces of each weight of the last block after its first (module docstring)."""


def _k_axes(op: tcp.ContractOp | tcp.ScaledContractOp) -> dict[SSAValue, FAxis]:
    """The operands of a block contraction that hold K, and where (`per`: elements of K per
    index, a K-block's size for scales)."""
    k = shape_of(op.rhs.type)[1]
    axes = {op.lhs: FAxis(2, 1), op.rhs: FAxis(1, 1)}
    if isinstance(op, tcp.ScaledContractOp):
        axes[op.lhs_scales] = FAxis(2, k // shape_of(op.lhs_scales.type)[2])
        axes[op.rhs_scales] = FAxis(1, k // shape_of(op.rhs_scales.type)[1])
    return axes


def k_grain(op: tcp.ContractOp | tcp.ScaledContractOp) -> int:
    """Pieces of `op`'s K start at multiples of this: the grid's GRID_K and every K-block."""
    return math.lcm(GRID_K, *(a.per for a in _k_axes(op).values()))


def k_pieces(k: int, grain: int, count: int) -> list[tuple[int, int]]:
    """[0, k) cut into at most `count` pieces of whole grains, the first ones the widest."""
    grains = -(-k // grain)
    count = max(1, min(count, grains))
    sizes = [grains // count + (i < grains % count) for i in range(count)]
    bounds: list[tuple[int, int]] = []
    k0 = 0
    for n in sizes:
        bounds.append((k0, min(k, k0 + n * grain)))
        k0 += n * grain
    return bounds


def _whole_load(value: SSAValue) -> tile.LoadExpertOp | None:
    """The load that made `value` when it is an expert's whole weight (no window)."""
    owner = value.owner
    return owner if isinstance(owner, tile.LoadExpertOp) and owner.offsets is None else None


def splittable(op: Operation) -> bool:
    """Whether `op` is a block contraction of a whole loaded weight that K pieces can replace."""
    if not isinstance(op, CONTRACTIONS) or op.acc is not None or _whole_load(op.rhs) is None:
        return False
    if isinstance(op, tcp.ContractOp) and op.spec.data != UP_SPEC:
        return False
    if shape_of(op.rhs.type)[1] <= k_grain(op):  # one grain: nothing to cut
        return False
    if isinstance(op, tcp.ScaledContractOp) and isinstance(op.rhs_scales.owner, tile.LoadExpertOp):
        return False  # scales loaded with their expert: only weights over one DMA piece have such
    return all(isinstance(u.operation, scf.YieldOp) or u.operation is op for u in op.rhs.uses)


def contract_pieces(op: tcp.ContractOp | tcp.ScaledContractOp, weights: list[SSAValue], bounds: list[tuple[int, int]],
                    operand: Callable[[SSAValue], SSAValue]) -> list[Operation]:
    """The ops that compute `op` from its weight's K pieces `weights` (rows `bounds` of it),
    each piece's contraction continuing the previous one's f32 sum (`acc`), the bias added by
    the last; `operand` gives the value to read for each of `op`'s other operands (its lhs and
    scales are addressed in place by window, `tile.slice ... at`). The last op's result is
    `op`'s."""
    axes = _k_axes(op)
    zero = index_constant(0)
    made: list[Operation] = [zero]
    acc: SSAValue | None = None
    for i, rows in enumerate(bounds):
        def part(v: SSAValue, rows: tuple[int, int] = rows) -> SSAValue:
            """The piece's part of operand `v` (not the weight), addressed in place."""
            offsets, sizes = axis_window(v, axes[v], rows)
            source, offset = operand(v), zero.result
            t = TensorType(v.type.get_element_type(), [shape_of(source.type)[0], *sizes])  # type: ignore[attr-defined]
            owner = source.owner
            if isinstance(owner, tile.SliceOp):  # a block's rows, or their window: addressed directly
                source, offset = owner.source, owner.offset
                offsets = [o + w for o, w in zip(offsets, owner.window_offsets())]
            window = tile.SliceOp(source, offset, t, offsets)
            window.attributes.update(op.attributes)
            window.result.name_hint = f"{v.name_hint}_piece" if v.name_hint else None
            made.append(window)
            return window.result

        bias = operand(op.bias) if i == len(bounds) - 1 and op.bias is not None else None
        guard = operand(op.guard) if op.guard is not None else None
        if isinstance(op, tcp.ScaledContractOp):
            new: Operation = tcp.ScaledContractOp(part(op.lhs), weights[i], part(op.lhs_scales), part(op.rhs_scales),
                                                  bias=bias, guard=guard, acc=acc)
        else:
            lhs = part(op.lhs)
            result = TensorType(op.result.type.get_element_type(),  # type: ignore[attr-defined]
                                [shape_of(lhs.type)[0], *shape_of(op.result.type)[1:]])
            new = tcp.ContractOp(op.spec.data, lhs, weights[i], result, bias=bias, guard=guard, acc=acc)
        new.attributes.update(op.attributes)
        new.location = op.location
        new.results[0].name_hint = op.result.name_hint
        made.append(new)
        acc = new.results[0]
    return made


def cut_into_pieces(op: tcp.ContractOp | tcp.ScaledContractOp, count: int) -> None:
    """Replace `op` (`splittable`) and its weight's whole load by `count` K pieces (the module
    docstring), in place."""
    load_in_pieces(op, K_AXIS, k_pieces(shape_of(op.rhs.type)[1], k_grain(op), count))


def load_in_pieces(op: tcp.ContractOp | tcp.ScaledContractOp, axis: int, bounds: list[tuple[int, int]],
                   slots: int = 0, machine: Machine | None = None) -> None:
    """Replace `op` and the `tile.load_expert` of its weight (whole or a window: an F tile) by
    loads of the spans `bounds` of it along `axis` (K_AXIS: `contract_pieces`, N_AXIS:
    `column_pieces`), in place. The pieces are not carried for reuse: where the block yielded
    the load's tile (and its ids, `slots` places before it: a loop body yields its slots' ids,
    then their tiles) for the next block, it yields the tile and ids it was given, so a next
    block of the same expert reloads, or reuses what an earlier block loaded. An `op` already
    mapped (map-contractions) has its pieces mapped for `machine`; the new ops take its phase
    and cluster."""
    block = op.parent_block()
    load = op.rhs.owner
    assert block is not None and isinstance(load, tile.LoadExpertOp)
    base = load.window_offsets()
    pieces = []
    for span in bounds:
        offsets, sizes = piece_window(op, op.rhs, span, axis)
        pieces.append(tile.LoadExpertOp(load.source, load.ids, None, None, list(load.after),
                                        ([b + o for b, o in zip(base, offsets)], sizes)))
    for piece in pieces:
        piece.attributes.update(load.attributes)
        piece.location = load.location
        piece.results[0].name_hint = load.result.name_hint
    block.insert_ops_before(pieces, load)
    weights = [p.results[0] for p in pieces]
    if axis == K_AXIS:
        made = contract_pieces(op, weights, bounds, lambda v: v)
    else:
        assert isinstance(op, tcp.ContractOp)
        made = column_pieces(op, weights, tuple(bounds), lambda v: v)
    for new in made:
        for key in (PHASE_ATTR, CLUSTER_ATTR):
            if key in op.attributes:
                new.attributes.setdefault(key, op.attributes[key])
        if isinstance(new, CONTRACTIONS) and op.mapping is not None:
            assert machine is not None
            del new.attributes["mapping"]
            map_contraction(new, machine)
    block.insert_ops_before(made, op)
    op.result.replace_all_uses_with(made[-1].results[0])
    operands = [v for v in op.operands if v is not op.rhs]
    op.detach()
    op.erase()
    for v in operands:
        erase_unread(v)
    assert load.prev_tile is not None or not load.result.uses
    for use in list(load.result.uses):
        assert isinstance(use.operation, scf.YieldOp) and load.prev_ids is not None and load.prev_tile is not None
        use.operation.operands[use.index] = load.prev_tile
        if slots:
            use.operation.operands[use.index - slots] = load.prev_ids
    load.detach()
    load.erase()


K_AXIS, N_AXIS = 1, 2
"""The axes of a block weight [G, K, N] that `engine_pieces` cuts: its contraction's K (rows)
or its output's N (columns)."""


@dataclass(frozen=True)
class Pieces:
    """A whole weight's pieces along `axis` (K_AXIS or N_AXIS): the spans `bounds` of it."""

    axis: int
    bounds: tuple[tuple[int, int], ...]


def piece_window(op: tcp.ContractOp | tcp.ScaledContractOp, weight: SSAValue,
                 rows: tuple[int, int], axis: int = K_AXIS) -> tuple[list[int], list[int]]:
    """The window of each expert's row of `weight` (`op`'s rhs, or the gather it reads) that
    holds K piece `rows` (or, along N_AXIS, those columns): offsets and sizes in every axis
    after the first."""
    return axis_window(weight, _k_axes(op)[op.rhs] if axis == K_AXIS else FAxis(N_AXIS, 1), rows)


def engine_pieces(op: Operation, machine: Machine) -> Pieces | None:
    """Pieces for the weight every block loads whole for `op` (a bf16/f32 block contraction
    `gbd,gdf->gbf` of a gathered weight it alone reads) when one DMA command for it would
    leave engines idle: a matrix over one `dma.split_bytes` piece but not whole pieces is cut
    into a full part and a short one, and the command holds both engines for the full part's
    time (tp's halved F: Qwen3-30B-A3B's [2048, 384] bf16 matrices, 1.5 MB, as 1 MB + 0.5 MB).
    The cut that holds the engines least (bytes plus idle bytes, `idle_engine_bytes`), the
    fewest pieces of equals, along K (`contract_pieces`); where K is one grain (the down
    matrix [384, 2048]), along N at multiples of GRID_N (`column_pieces`: each output chunk is
    the whole contraction's); None when the whole command is as good."""
    if not isinstance(op, tcp.ContractOp) or op.spec.data != UP_SPEC or op.acc is not None:
        return None
    weight = op.rhs
    if any(u.operation is not op for u in weight.uses):
        return None
    shape = shape_of(weight.type)
    for axis, grain in ((K_AXIS, k_grain(op)), (N_AXIS, GRID_N)):
        if axis == N_AXIS and op.bias is not None:
            break
        extent = shape[axis]
        unit_bytes = stored_bytes(weight.type) // (shape[0] * extent)

        def held(bounds: list[tuple[int, int]], unit_bytes: int = unit_bytes) -> float:
            return sum((b - a) * unit_bytes + idle_engine_bytes((b - a) * unit_bytes, machine) for a, b in bounds)

        cuts = [k_pieces(extent, grain, n) for n in range(1, -(-extent // grain) + 1)]
        best = min(cuts, key=lambda bounds: (held(bounds), len(bounds)))
        if len(best) > 1:
            return Pieces(axis, tuple(best))
        if len(cuts) > 1:  # K could be cut, and is as good whole
            return None
    return None


def column_pieces(op: tcp.ContractOp, weights: list[SSAValue], bounds: tuple[tuple[int, int], ...],
                  operand: Callable[[SSAValue], SSAValue]) -> list[Operation]:
    """The ops that compute `op` from its weight's N pieces `weights` (columns `bounds` of it):
    each piece's contraction makes its columns of the result (continuing those columns of the
    f32 sum `op` continues, `acc`), stored into their window of a zero-filled SRAM buffer
    (`tile.store ... at`, the engine's commit in place); `operand` gives the value to read for
    each of `op`'s other operands. The last op's result is `op`'s."""
    lhs = operand(op.lhs)
    guard = operand(op.guard) if op.guard is not None else None
    element = op.result.type.get_element_type()  # type: ignore[attr-defined]
    rows = [shape_of(lhs.type)[0], *shape_of(op.result.type)[1:-1]]
    zero = index_constant(0)
    whole = tile.BufferOp("sram", TensorType(element, [*rows, shape_of(op.result.type)[-1]]))
    made: list[Operation] = [zero, whole]
    out = whole.result
    for weight, (n0, n1) in zip(weights, bounds):
        columns = TensorType(element, [*rows, n1 - n0])
        window = [0] * (len(rows) - 1) + [n0]
        acc = None if op.acc is None else tile.SliceOp(operand(op.acc), zero.result, columns, window)
        piece = tcp.ContractOp(op.spec.data, lhs, weight, columns, guard=guard,
                               acc=None if acc is None else acc.result)
        store = tile.StoreOp(piece.result, out, zero.result, window=window)
        made += [] if acc is None else [acc]
        for new in (*([] if acc is None else [acc]), piece, store):
            new.attributes.update(op.attributes)
            new.location = op.location
        piece.result.name_hint = f"{op.result.name_hint}_columns" if op.result.name_hint else None
        store.result.name_hint = op.result.name_hint
        made += [piece, store]
        out = store.result
    return made


def one_engine(op: Operation, machine: Machine) -> bool:
    """Whether `op`'s weight load is one DMA command on one engine: at most one `dma.split_bytes`
    piece (a larger one is already cut into pieces spread over the engines)."""
    load = _whole_load(op.rhs) if isinstance(op, CONTRACTIONS) else None
    return load is not None and stored_bytes(load.result.type) <= machine.dma_split_bytes


def last_block_cuts(body: Block, machine: Machine) -> list[Operation]:
    """The contractions of a loop body whose weights the last block loads in pieces (the
    module docstring): the `splittable` ones whose weight one engine loads, after the first."""
    return [op for op in body.walk() if splittable(op) and one_engine(op, machine)][1:]


def cut_last_block(body: Block, machine: Machine) -> None:
    """`last_block_cuts` of `body`, each weight in LAST_PIECES pieces."""
    for op in last_block_cuts(body, machine):
        assert isinstance(op, CONTRACTIONS)
        cut_into_pieces(op, LAST_PIECES)


def round_cuts(body: Block, machine: Machine) -> list[tuple[tcp.ContractOp, int, list[tuple[int, int]]]]:
    """The contractions of a loop body whose weights `round_in_pieces` loads in pieces: those
    one DMA engine loads (at most one `dma.split_bytes` piece), with the axis and the spans:
    K where it has more than one grain and the contraction starts its sum, else N (an F tile's
    down projection after the first, whose K is the tile, continuing the previous tile's sum;
    at multiples of GRID_N), in LAST_PIECES pieces."""
    cuts = []
    for op in body.walk():
        load = op.rhs.owner if isinstance(op, tcp.ContractOp) and op.spec.data == UP_SPEC else None
        if not isinstance(load, tile.LoadExpertOp) or stored_bytes(load.result.type) > machine.dma_split_bytes:
            continue
        if any(u.operation is not op and not isinstance(u.operation, scf.YieldOp) for u in op.rhs.uses):
            continue
        assert isinstance(op, tcp.ContractOp)
        k, n = shape_of(op.rhs.type)[1:]
        if k > k_grain(op) and op.acc is None:
            cuts.append((op, K_AXIS, k_pieces(k, k_grain(op), LAST_PIECES)))
        elif n > GRID_N and op.bias is None:
            cuts.append((op, N_AXIS, k_pieces(n, GRID_N, LAST_PIECES)))
    return cuts


def round_in_pieces(body: Block, machine: Machine) -> None:
    """Load `round_cuts`' weights in pieces (`load_in_pieces`): for the loop that ends a chip's
    weight stream (interleave-chunks: a mesh chip's last chunk at decode), as for one token's
    last block."""
    loads = [op for op in body.walk() if isinstance(op, tile.LoadExpertOp)]
    slots = {b: sum(1 for op in loads if op.prev_ids is not None and op.parent_block() is b)
             for b in {op.parent_block() for op in loads}}
    for op, axis, bounds in round_cuts(body, machine):
        load_in_pieces(op, axis, bounds, slots[op.rhs.owner.parent_block()], machine)  # type: ignore[union-attr]
