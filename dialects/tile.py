"""`tile`: the schedule level's buffers and tiles.

After the lowering passes every engine op works on whole tensors. The schedule level
(passes/schedule/schedule_experts.py) rewrites them into static `scf.for` loops whose bodies work on
tiles: rows [offset, offset + n) of a tensor's first axis. These ops say where each tile comes
from and goes to, so the placement is in the IR, not guessed by the simulator:

- `tile.buffer hbm|sram`: an explicit, zero-filled buffer of a static size in one memory, the
  destination of per-tile stores (a loop's result assembled in place);
- `tile.slice %src[%offset]`: a tile of a tensor already in SRAM (addressing only, no data moves);
  with `at array<i64: ...>`, a window of each of its rows;
- `tile.load %src[%offset]`: a tile of a tensor in HBM, copied into SRAM by a DMA command;
- `tile.gather %src[%indices]`: the rows of a tensor named by `indices` (-1: a zero row),
  copied into a new SRAM tile by one DMA command: a block's token rows, gathered straight from
  the tokens by the block's row -> token index (the dispatch, done a block at a time);
- `tile.gather_into %src[%indices], %dst[%offset]`: the rows `tile.gather` would take, written
  by that one DMA command straight into rows [offset, offset + n) of a buffer, in place (a mesh
  home chip's returned sums into the layer's output); the result is the same buffer;
- `tile.store %tile, %dst[%offset]`: a tile written into rows of a buffer, in place (DMA to HBM,
  or the producing engine's commit into SRAM); the result is the same buffer; with
  `at array<i64: ...>`, into a window of each of those rows (a contraction's column piece);
- `tile.load_expert %w[%ids] reuse %prev_ids, %prev_tile`: the weight rows of a block's expert,
  fetched by DMA only when the block's expert differs from the previous block's: consecutive
  blocks of one expert (the canonical layout keeps them adjacent) load its weights once
  (without `reuse`, every block's expert is fetched: a tile streamed through SRAM). With
  `at array<i64: r, c>` it fetches a window of each expert's weight: the result's shape from
  those offsets (an F tile of an expert: columns of w_gate, rows of w_down).
- `tile.guard %ids`: an `i1`, whether any of the ids names an expert (is not negative): the
  condition of the `scf.if` that skips an unused block's whole body.

A `guard` (one i32, a block's expert id) skips a load or store when negative: a skipped load
gives zeros, a skipped store leaves the buffer as it is; the guard itself costs a little. A
store's guard may also hold n ids for n equal parts of its tile (its elements in order: a
group's blocks, or their 128-row parts): the parts whose id is negative are not written, as a
DMA scatter skips an index of -1, and the command moves only the others. The
expert loop guards each cluster's copy of a block's work by the block's expert id masked to
the experts that cluster owns. `tile.copy` moves a tensor between clusters' SRAM by DMA.

Loads may name `after` values: order-only operands (no data is read) that make the load wait
for the commands producing them. The schedule level uses them for double buffering: the tiles
of block g are fetched once block g - 2 has finished with its buffers, so two blocks' tiles are
in SRAM at a time and the fetch of one block overlaps the contraction of the previous one.

Offsets are `index` values (an `scf.for` induction variable or an `arith.constant`). Numpy
semantics: runtime_sim/semantics/tile_semantics.py; costs: runtime_sim/perf/tile_cost.py.
"""

from __future__ import annotations

import math

from xdsl.dialects.builtin import DenseArrayBase, IndexType, StringAttr, TensorType, i1, i64
from xdsl.ir import Attribute, Dialect, SSAValue
from xdsl.irdl import (
    AnyAttr,
    AttrSizedOperandSegments,
    IRDLOperation,
    irdl_op_definition,
    operand_def,
    opt_operand_def,
    opt_prop_def,
    prop_def,
    result_def,
    traits_def,
    var_operand_def,
)
from xdsl.traits import Pure

from dialects.tcp import CopyOpBase
from dialects.tensor_types import expect, format_type, is_int_type, shape_of

SPACES = ("hbm", "sram")


def _rows_match(tile: Attribute, whole: Attribute, what: str) -> None:
    """A tile has the element type and the trailing shape of the tensor it is a part of, and no
    more rows than it."""
    ts, ws = shape_of(tile), shape_of(whole)
    expect(tile.get_element_type() == whole.get_element_type() and len(ts) == len(ws) >= 1 and ts[1:] == ws[1:]
           and ts[0] <= ws[0], f"{what}: a tile of {format_type(whole)} cannot be {format_type(tile)}")


@irdl_op_definition
class BufferOp(IRDLOperation):
    """A zero-filled buffer of the result's static size in `space` (hbm or sram)."""

    name = "tile.buffer"
    space = prop_def(StringAttr)
    result = result_def(TensorType)
    assembly_format = "$space `:` type($result) attr-dict"

    def __init__(self, space: str, result_type: Attribute):
        super().__init__(properties={"space": StringAttr(space)}, result_types=[result_type])

    def verify_(self) -> None:
        expect(self.space.data in SPACES, f"tile.buffer: space must be one of {', '.join(SPACES)}, not {self.space.data!r}")


def _check_window(op_name: str, part: Attribute, whole: Attribute, offsets: tuple[int, ...]) -> None:
    """`part` is a window of `whole`'s rows: the element type, as many axes, and in each axis
    after the first `offsets` plus the part's size within the whole's."""
    ps, ws = shape_of(part)[1:], shape_of(whole)[1:]
    expect(part.get_element_type() == whole.get_element_type() and len(offsets) == len(ws) == len(ps)
           and all(0 <= o and o + n <= w for o, n, w in zip(offsets, ps, ws)),
           f"{op_name}: {format_type(part)} at {list(offsets)} is not a window of the rows of {format_type(whole)}")


@irdl_op_definition
class SliceOp(IRDLOperation):
    """Rows [offset, offset + n) of an SRAM tensor, n the result's first dimension: addressing
    only. With `at array<i64: ...>` (one offset per axis after the first), the window of the
    result's shape starting there in each row (an F tile of a block's weight scales): still
    addressing only, the engine reading it with strides."""

    name = "tile.slice"
    source = operand_def(TensorType)
    offset = operand_def(IndexType)
    offsets = opt_prop_def(AnyAttr())
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "$source `[` $offset `]` (`at` $offsets^)? `:` type($source) `->` type($result) attr-dict"

    def __init__(self, source: SSAValue, offset: SSAValue, result_type: Attribute, window: list[int] | None = None):
        """`window`: the offsets of the window in each axis after the first (None: whole rows)."""
        properties = {} if window is None else {"offsets": DenseArrayBase.from_list(i64, window)}
        super().__init__(operands=[source, offset], result_types=[result_type], properties=properties)

    def window_offsets(self) -> tuple[int, ...]:
        """Where the window starts in each axis after the first (zeros without `offsets`)."""
        if self.offsets is None:
            return (0,) * (len(shape_of(self.source.type)) - 1)
        return tuple(self.offsets.get_values())

    def verify_(self) -> None:
        if self.offsets is None:
            _rows_match(self.result.type, self.source.type, self.name)
            return
        expect(isinstance(self.offsets, DenseArrayBase), "tile.slice: offsets must be an array<i64: ...>")
        _check_window(self.name, self.result.type, self.source.type, self.window_offsets())
        expect(shape_of(self.result.type)[0] <= shape_of(self.source.type)[0],
               f"{self.name}: a tile of {format_type(self.source.type)} cannot be {format_type(self.result.type)}")


@irdl_op_definition
class LoadOp(IRDLOperation):
    """Rows [offset, offset + n) of an HBM tensor, copied into a new SRAM tile by DMA."""

    name = "tile.load"
    source = operand_def(TensorType)
    offset = operand_def(IndexType)
    guard = opt_operand_def(TensorType)
    after = var_operand_def()
    result = result_def(TensorType)
    irdl_options = (AttrSizedOperandSegments(as_property=True),)
    assembly_format = (
        "$source `[` $offset `]` (`guard` $guard^)? (`after` $after^)? `:` type($source) (`guard` type($guard)^)? "
        "(`after` type($after)^)? `->` type($result) attr-dict"
    )

    def __init__(self, source: SSAValue, offset: SSAValue, result_type: Attribute, after: list[SSAValue] | None = None,
                 guard: SSAValue | None = None):
        super().__init__(operands=[source, offset, guard, after or []], result_types=[result_type])

    def verify_(self) -> None:
        _rows_match(self.result.type, self.source.type, self.name)


@irdl_op_definition
class GatherOp(IRDLOperation):
    """`source[indices]` (rows of `source`'s first axis; index -1 gives a zero row) in a new SRAM
    tile by DMA: the result has the indices' shape followed by a row's. `guard` and `after` as
    `tile.load`'s."""

    name = "tile.gather"
    source = operand_def(TensorType)
    indices = operand_def(TensorType)
    guard = opt_operand_def(TensorType)
    after = var_operand_def()
    result = result_def(TensorType)
    irdl_options = (AttrSizedOperandSegments(as_property=True),)
    assembly_format = (
        "$source `[` $indices `]` (`guard` $guard^)? (`after` $after^)? `:` type($source) `,` type($indices) "
        "(`guard` type($guard)^)? (`after` type($after)^)? `->` type($result) attr-dict"
    )

    def __init__(self, source: SSAValue, indices: SSAValue, after: list[SSAValue] | None = None,
                 guard: SSAValue | None = None):
        st = source.type
        result = TensorType(st.get_element_type(), [*shape_of(indices.type), *shape_of(st)[1:]])
        super().__init__(operands=[source, indices, guard, after or []], result_types=[result])

    def verify_(self) -> None:
        st, it, rt = self.source.type, self.indices.type, self.result.type
        expect(is_int_type(it.get_element_type()), "tile.gather: indices must be i32")
        expect(len(shape_of(st)) >= 1 and rt.get_element_type() == st.get_element_type()
               and shape_of(rt) == (*shape_of(it), *shape_of(st)[1:]),
               f"tile.gather: rows of {format_type(st)} by {format_type(it)} cannot be {format_type(rt)}")


@irdl_op_definition
class GatherIntoOp(IRDLOperation):
    """`source[indices]` (index -1: a zero row) written into rows [offset, offset + n) of `dest`
    in place by one DMA command, n the indices' count: a gather and the store of its rows in one
    command, no SRAM tile between. The result is `dest`'s buffer, as `tile.store`'s."""

    name = "tile.gather_into"
    source = operand_def(TensorType)
    indices = operand_def(TensorType)
    dest = operand_def(TensorType)
    offset = operand_def(IndexType)
    result = result_def(TensorType)
    assembly_format = (
        "$source `[` $indices `]` `,` $dest `[` $offset `]` `:` type($source) `,` type($indices) `,` type($dest) "
        "`->` type($result) attr-dict"
    )

    def __init__(self, source: SSAValue, indices: SSAValue, dest: SSAValue, offset: SSAValue):
        super().__init__(operands=[source, indices, dest, offset], result_types=[dest.type])

    def rows(self) -> int:
        """The rows written: one per index."""
        return math.prod(shape_of(self.indices.type))

    def verify_(self) -> None:
        st, it, dt = self.source.type, self.indices.type, self.dest.type
        expect(is_int_type(it.get_element_type()), "tile.gather_into: indices must be i32")
        ss, ds = shape_of(st), shape_of(dt)
        expect(len(ss) >= 1 and st.get_element_type() == dt.get_element_type() and ss[1:] == ds[1:]
               and self.rows() <= ds[0],
               f"tile.gather_into: rows of {format_type(st)} by {format_type(it)} cannot go into {format_type(dt)}")
        expect(self.result.type == dt, "tile.gather_into: the result is the destination buffer")


@irdl_op_definition
class StoreOp(IRDLOperation):
    """`tile` written into rows [offset, offset + n) of `dest`, in place: the result is `dest`'s
    buffer, which must not be read through the operand afterwards (the schedule level threads
    it through its loop as an iteration argument). With `at array<i64: ...>` (one offset per
    axis after the first), into the window of the tile's shape starting there in each row."""

    name = "tile.store"
    tile = operand_def(TensorType)
    dest = operand_def(TensorType)
    offset = operand_def(IndexType)
    guard = opt_operand_def(TensorType)
    offsets = opt_prop_def(AnyAttr())
    result = result_def(TensorType)
    irdl_options = (AttrSizedOperandSegments(as_property=True),)
    assembly_format = (
        "$tile `,` $dest `[` $offset `]` (`at` $offsets^)? (`guard` $guard^)? `:` type($tile) `,` type($dest) "
        "(`guard` type($guard)^)? `->` type($result) attr-dict"
    )

    def __init__(self, tile: SSAValue, dest: SSAValue, offset: SSAValue, guard: SSAValue | None = None,
                 window: list[int] | None = None):
        """`window`: the offsets of the window in each axis after the first (None: whole rows)."""
        properties = {} if window is None else {"offsets": DenseArrayBase.from_list(i64, window)}
        super().__init__(operands=[tile, dest, offset, guard], result_types=[dest.type], properties=properties)

    def window_offsets(self) -> tuple[int, ...]:
        """Where the window starts in each axis after the first (zeros without `offsets`)."""
        if self.offsets is None:
            return (0,) * (len(shape_of(self.dest.type)) - 1)
        return tuple(self.offsets.get_values())

    def verify_(self) -> None:
        if self.offsets is None:
            _rows_match(self.tile.type, self.dest.type, self.name)
        else:
            expect(isinstance(self.offsets, DenseArrayBase), "tile.store: offsets must be an array<i64: ...>")
            expect(self.guard is None, "tile.store: a store into a window takes no guard")
            _check_window(self.name, self.tile.type, self.dest.type, self.window_offsets())
            expect(shape_of(self.tile.type)[0] <= shape_of(self.dest.type)[0],
                   f"tile.store: a tile of {format_type(self.dest.type)} cannot be {format_type(self.tile.type)}")
        expect(self.result.type == self.dest.type, "tile.store: the result is the destination buffer")
        if self.guard is not None:
            parts = shape_of(self.guard.type)
            expect(is_int_type(self.guard.type.get_element_type()) and len(parts) == 1  # type: ignore[attr-defined]
                   and math.prod(shape_of(self.tile.type)) % parts[0] == 0,
                   f"tile.store: the guard must be i32 [n], n parts of {format_type(self.tile.type)}, "
                   f"got {format_type(self.guard.type)}")


def guards_parts(op: StoreOp) -> bool:
    """Whether a store's guard holds one id per part of its tile (rather than one for all)."""
    return op.guard is not None and shape_of(op.guard.type)[0] > 1


def guards_rows(tile_type: Attribute, guard_type: Attribute) -> bool:
    """Whether a guard of `guard_type` holds one id per row of a one-block tile of `tile_type`
    ([B] for [1, B, ...]): a store under it moves only the rows whose id is not negative, no
    padding row (schedule-experts' row stores)."""
    return shape_of(tile_type)[:2] == (1, shape_of(guard_type)[0])


@irdl_op_definition
class CopyOp(CopyOpBase):
    """A tensor copied by DMA from one cluster's SRAM to another's (the value is unchanged):
    what a cluster reads that another cluster computed."""

    name = "tile.copy"


@irdl_op_definition
class LoadExpertOp(IRDLOperation):
    """`source[ids]` (rows of an HBM weight, one per entry of `ids`; id -1 gives zeros), fetched
    by DMA only where `ids` differs from `prev_ids`; elsewhere `prev_tile`, already in SRAM, is
    reused. With `offsets` (one per axis after the first), each row is the window of the
    result's shape starting there."""

    name = "tile.load_expert"
    source = operand_def(TensorType)
    ids = operand_def(TensorType)
    prev_ids = opt_operand_def(TensorType)
    prev_tile = opt_operand_def(TensorType)
    after = var_operand_def()
    offsets = opt_prop_def(AnyAttr())
    result = result_def(TensorType)
    irdl_options = (AttrSizedOperandSegments(as_property=True),)
    assembly_format = (
        "$source `[` $ids `]` (`at` $offsets^)? (`reuse` $prev_ids^ `,` $prev_tile)? (`after` $after^)? `:` "
        "type($source) `,` type($ids) (`,` type($prev_ids)^ `,` type($prev_tile))? (`after` type($after)^)? "
        "`->` type($result) attr-dict"
    )

    def __init__(self, source: SSAValue, ids: SSAValue, prev_ids: SSAValue | None, prev_tile: SSAValue | None,
                 after: list[SSAValue] | None = None, window: tuple[list[int], list[int]] | None = None):
        """`window`: (offsets, sizes) of each expert's part, one entry per axis after the first.
        Without `prev_ids` and `prev_tile` nothing is reused: every block's expert is fetched."""
        st = source.type
        sizes = list(shape_of(st)[1:]) if window is None else window[1]
        result = TensorType(st.get_element_type(), [*shape_of(ids.type), *sizes])
        properties = {} if window is None else {"offsets": DenseArrayBase.from_list(i64, window[0])}
        super().__init__(operands=[source, ids, prev_ids, prev_tile, after or []], result_types=[result],
                         properties=properties)

    def window_offsets(self) -> tuple[int, ...]:
        """Where each expert's window starts (zeros without `offsets`)."""
        if self.offsets is None:
            return (0,) * (len(shape_of(self.source.type)) - 1)
        return tuple(self.offsets.get_values())

    def verify_(self) -> None:
        st, it, rt = self.source.type, self.ids.type, self.result.type
        expect(is_int_type(it.get_element_type()) and len(shape_of(it)) == 1, "tile.load_expert: ids must be i32 [n]")
        expect((self.prev_ids is None) == (self.prev_tile is None), "tile.load_expert: reuse needs prev_ids and prev_tile")
        expect(self.prev_ids is None or self.prev_ids.type == it, "tile.load_expert: prev_ids must have the type of ids")
        expect(self.offsets is None or isinstance(self.offsets, DenseArrayBase),
               "tile.load_expert: offsets must be an array<i64: ...>")
        _check_window(self.name, rt, st, self.window_offsets())
        expect(shape_of(rt)[:1] == shape_of(it), f"tile.load_expert: {format_type(rt)} has not one row per id of {format_type(it)}")
        expect(self.prev_tile is None or self.prev_tile.type == rt, "tile.load_expert: prev_tile must have the result's type")


@irdl_op_definition
class GuardOp(IRDLOperation):
    """Whether a block runs: true when any of `ids` (i32 [n]) is not negative. The sequencer
    reads the scalar and branches, so a block no expert uses costs only this guard."""

    name = "tile.guard"
    ids = operand_def(TensorType)
    result = result_def(i1)
    traits = traits_def(Pure())
    assembly_format = "$ids `:` type($ids) attr-dict"

    def __init__(self, ids: SSAValue):
        super().__init__(operands=[ids], result_types=[i1])

    def verify_(self) -> None:
        t = self.ids.type
        expect(is_int_type(t.get_element_type()) and len(shape_of(t)) == 1, "tile.guard: ids must be i32 [n]")


Tile = Dialect("tile", [BufferOp, SliceOp, LoadOp, GatherOp, GatherIntoOp, StoreOp, CopyOp, LoadExpertOp, GuardOp], [])
