"""`tile`: the schedule level's buffers and tiles.

After the lowering passes every engine op works on whole tensors. The schedule level
(passes/schedule_experts.py) rewrites them into static `scf.for` loops whose bodies work on
tiles: rows [offset, offset + n) of a tensor's first axis. These ops say where each tile comes
from and goes to, so the placement is in the IR, not guessed by the simulator:

- `tile.buffer hbm|sram`: an explicit, zero-filled buffer of a static size in one memory, the
  destination of per-tile stores (a loop's result assembled in place);
- `tile.slice %src[%offset]`: a tile of a tensor already in SRAM (addressing only, no data moves);
- `tile.load %src[%offset]`: a tile of a tensor in HBM, copied into SRAM by a DMA command;
- `tile.store %tile, %dst[%offset]`: a tile written into rows of a buffer, in place (DMA to HBM,
  or the producing engine's commit into SRAM); the result is the same buffer;
- `tile.load_expert %w[%ids] reuse %prev_ids, %prev_tile`: the weight rows of a block's expert,
  fetched by DMA only when the block's expert differs from the previous block's: consecutive
  blocks of one expert (the canonical layout keeps them adjacent) load its weights once;
- `tile.guard %ids`: an `i1`, whether any of the ids names an expert (is not negative): the
  condition of the `scf.if` that skips an unused block's whole body.

A `guard` (one i32, a block's expert id) skips a load or store when negative: a skipped load
gives zeros, a skipped store leaves the buffer as it is; the guard itself costs a little. The
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

from xdsl.dialects.builtin import IndexType, StringAttr, TensorType, i1
from xdsl.ir import Attribute, Dialect, SSAValue
from xdsl.irdl import (
    AttrSizedOperandSegments,
    IRDLOperation,
    irdl_op_definition,
    operand_def,
    opt_operand_def,
    prop_def,
    result_def,
    traits_def,
    var_operand_def,
)
from xdsl.traits import Pure

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


@irdl_op_definition
class SliceOp(IRDLOperation):
    """Rows [offset, offset + n) of an SRAM tensor, n the result's first dimension: addressing
    only."""

    name = "tile.slice"
    source = operand_def(TensorType)
    offset = operand_def(IndexType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "$source `[` $offset `]` `:` type($source) `->` type($result) attr-dict"

    def __init__(self, source: SSAValue, offset: SSAValue, result_type: Attribute):
        super().__init__(operands=[source, offset], result_types=[result_type])

    def verify_(self) -> None:
        _rows_match(self.result.type, self.source.type, self.name)


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
class StoreOp(IRDLOperation):
    """`tile` written into rows [offset, offset + n) of `dest`, in place: the result is `dest`'s
    buffer, which must not be read through the operand afterwards (the schedule level threads
    it through its loop as an iteration argument)."""

    name = "tile.store"
    tile = operand_def(TensorType)
    dest = operand_def(TensorType)
    offset = operand_def(IndexType)
    guard = opt_operand_def(TensorType)
    result = result_def(TensorType)
    irdl_options = (AttrSizedOperandSegments(as_property=True),)
    assembly_format = (
        "$tile `,` $dest `[` $offset `]` (`guard` $guard^)? `:` type($tile) `,` type($dest) (`guard` type($guard)^)? "
        "`->` type($result) attr-dict"
    )

    def __init__(self, tile: SSAValue, dest: SSAValue, offset: SSAValue, guard: SSAValue | None = None):
        super().__init__(operands=[tile, dest, offset, guard], result_types=[dest.type])

    def verify_(self) -> None:
        _rows_match(self.tile.type, self.dest.type, self.name)
        expect(self.result.type == self.dest.type, "tile.store: the result is the destination buffer")


@irdl_op_definition
class CopyOp(IRDLOperation):
    """A tensor copied by DMA from one cluster's SRAM to another's (the value is unchanged):
    what a cluster reads that another cluster computed."""

    name = "tile.copy"
    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "$input `:` type($input) `->` type($result) attr-dict"

    def __init__(self, input: SSAValue):
        super().__init__(operands=[input], result_types=[input.type])

    def verify_(self) -> None:
        expect(self.result.type == self.input.type, "tile.copy keeps the type")


@irdl_op_definition
class LoadExpertOp(IRDLOperation):
    """`source[ids]` (rows of an HBM weight, one per entry of `ids`; id -1 gives zeros), fetched
    by DMA only where `ids` differs from `prev_ids`; elsewhere `prev_tile`, already in SRAM, is
    reused."""

    name = "tile.load_expert"
    source = operand_def(TensorType)
    ids = operand_def(TensorType)
    prev_ids = operand_def(TensorType)
    prev_tile = operand_def(TensorType)
    after = var_operand_def()
    result = result_def(TensorType)
    irdl_options = (AttrSizedOperandSegments(as_property=True),)
    assembly_format = (
        "$source `[` $ids `]` `reuse` $prev_ids `,` $prev_tile (`after` $after^)? `:` type($source) `,` type($ids) "
        "`,` type($prev_ids) `,` type($prev_tile) (`after` type($after)^)? `->` type($result) attr-dict"
    )

    def __init__(self, source: SSAValue, ids: SSAValue, prev_ids: SSAValue, prev_tile: SSAValue,
                 after: list[SSAValue] | None = None):
        st = source.type
        result = TensorType(st.get_element_type(), [*shape_of(ids.type), *shape_of(st)[1:]])
        super().__init__(operands=[source, ids, prev_ids, prev_tile, after or []], result_types=[result])

    def verify_(self) -> None:
        st, it = self.source.type, self.ids.type
        expect(is_int_type(it.get_element_type()) and len(shape_of(it)) == 1, "tile.load_expert: ids must be i32 [n]")
        expect(self.prev_ids.type == it, "tile.load_expert: prev_ids must have the type of ids")
        want = TensorType(st.get_element_type(), [*shape_of(it), *shape_of(st)[1:]])
        expect(self.result.type == want, f"tile.load_expert: result should be {format_type(want)}")
        expect(self.prev_tile.type == want, "tile.load_expert: prev_tile must have the result's type")


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


Tile = Dialect("tile", [BufferOp, SliceOp, LoadOp, StoreOp, CopyOp, LoadExpertOp, GuardOp], [])
