"""`split-router-k`: the router's matmul split along its reduction axis, a DMA command per tile.

load-arguments gives the router's weight ([D, E], Qwen3-30B-A3B's 2048 x 128 bf16: 512 KB) one
`tcp.load`. A command of at most one DMA piece (1 MB, `dma.split_bytes`) runs on ONE engine, at
its 1/8 share of HBM bandwidth: 2,797 cycles for those 512 KB, while at decode the matmul, the
top-k, the routing and then every expert weight load wait for it. This pass cuts D into tiles
of whole contraction-grid chunks (GRID_K = 512 rows), each tile's rows of the weight loaded by
its own command (`tile.load %router[%k0]`), so the loads run on as many engines at once, and
the matmul into one contraction per tile on the matching columns of its input (`tile.slice
... at array<i64: k0>`, addressing only), each continuing the previous tile's f32 sum:

    %router_rows = tile.load %router[%c0] : tensor<2048x128xbf16> -> tensor<512x128xbf16>
    %router_rows_1 = tile.load %router[%c512] : ...                 (and %c1024, %c1536)
    %x_cols = tile.slice %x_sram[%c0] at array<i64: 0> : tensor<1x2048xbf16> -> tensor<1x512xbf16>
    %logits_sum = tcp.contract "mk,kn->mn" %x_cols, %router_rows : ... -> tensor<1x128xf32>
    %logits_sum_1 = tcp.contract "mk,kn->mn" %x_cols_1, %router_rows_1 acc %logits_sum : ...
    ...
    %logits = ve.narrow %logits_sum_3 : tensor<1x128xf32> -> tensor<1x128xbf16>

Exact: `numerics.contract` sums K in GRID_K chunks strictly in order into an f32 accumulator;
a split at GRID_K multiples passing each piece's f32 sum as the next one's `acc` adds the same
chunk products in the same order (a bias is added by the last piece, after the whole sum, as
the whole contraction adds it), and the one rounding to the result's type is the `ve.narrow`
(round to nearest even, the rounding of every level).

When it pays: the weight is loaded by one command (at most `piece_bytes`; a larger one is
already cut into pieces on several engines), it has at least two grid chunks, and it holds more
bytes than the matmul's input as loaded (`x`, or the `tcp.load` a widening of it reads): the
input arrives by one command too, at the same rate per byte, so otherwise the contraction
waits for the input and tiles of the weight would only add command start-ups and contraction
invocations (prefill: Qwen3-30B-A3B at T = 2048 loads 8 MB of `x`). The tiles are as many as
the chunks, each a whole number of chunks, at most one per DMA engine the input's own load
leaves free (`engines` - 1: Mixtral's 4096-row router as 4 tiles of 1024 rows, not 8 of 512
of which one would queue behind `x` on its engine).
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import BFloat16Type, Float32Type, ModuleOp, TensorType, f32
from xdsl.ir import BlockArgument, Operation, SSAValue
from xdsl.passes import ModulePass

from dialects import tcp, tile, ve
from dialects.annotations import PHASE_ATTR, phase_of
from dialects.tensor_types import shape_of, stored_bytes
from passes._loop_builder import index_constant
from runtime_sim.semantics.numerics import GRID_K
from target.target_spec import machine_of

MATMUL = "mk,kn->mn"


def loaded_bytes(value: SSAValue) -> int:
    """Bytes of `value` as a DMA command brought it to SRAM: a widening (`ve.widen`,
    `ve.widen_low`) of a loaded tensor counts as the load's bytes."""
    owner = value.owner
    while isinstance(owner, (ve.WidenOp, ve.WidenLowOp)):
        value = owner.input
        owner = value.owner
    return stored_bytes(value.type)


def k_tiles(k: int, engines: int) -> list[tuple[int, int]]:
    """[k0, k1) tiles of K: whole GRID_K chunks (the last one may be shorter), as many as the
    chunks, at most `engines` (at least one tile), the chunks shared out evenly."""
    chunks = -(-k // GRID_K)
    per_tile = GRID_K * -(-chunks // max(1, min(chunks, engines)))
    return [(k0, min(k, k0 + per_tile)) for k0 in range(0, k, per_tile)]


def splittable(op: tcp.ContractOp, piece_bytes: int, engines: int) -> tcp.LoadOp | None:
    """The weight's `tcp.load` when `op` is a router matmul worth splitting (module docstring)."""
    if phase_of(op) != "router" or op.spec.data != MATMUL or op.acc is not None or op.guard is not None:
        return None
    if not isinstance(op.result.type.get_element_type(), (Float32Type, BFloat16Type)):  # type: ignore[attr-defined]
        return None  # the one rounding after the last tile is a ve.narrow: f32 -> bf16
    load = op.rhs.owner
    if not isinstance(load, tcp.LoadOp) or not isinstance(load.input, BlockArgument) or not load.result.has_one_use():
        return None
    weight = stored_bytes(load.result.type)
    k = shape_of(load.result.type)[0]
    if len(k_tiles(k, engines - 1)) < 2 or weight > piece_bytes or weight <= loaded_bytes(op.lhs):
        return None
    return load


def split_contraction(op: tcp.ContractOp, load: tcp.LoadOp, engines: int) -> None:
    """Replace `load` and `op` by a load and a contraction per K tile (module docstring)."""
    block = op.parent_block()
    assert block is not None
    weight_type, lhs_type, out_type = load.result.type, op.lhs.type, op.result.type
    assert isinstance(weight_type, TensorType) and isinstance(lhs_type, TensorType) and isinstance(out_type, TensorType)
    (k, n), (m, _) = shape_of(weight_type), shape_of(lhs_type)
    phase = op.attributes.get(PHASE_ATTR)
    weight_name = load.input.name_hint or "weight"
    lhs_name = op.lhs.name_hint or "router_input"
    sum_name = f"{op.result.name_hint or 'logits'}_sum"
    sum_type = TensorType(f32, [m, n])

    def add(new: Operation, before: Operation, name: str | None = None) -> SSAValue:
        if phase is not None:
            new.attributes[PHASE_ATTR] = phase
        block.insert_op_before(new, before)
        if name is not None:
            new.results[0].name_hint = name
        return new.results[0]

    tiles = k_tiles(k, engines - 1)  # one engine loads the input
    rows_of: list[SSAValue] = []
    zero = add(index_constant(0), load)
    for k0, k1 in tiles:  # every tile's command issued where the whole load was
        start = zero if k0 == 0 else add(index_constant(k0), load)
        rows_of.append(add(tile.LoadOp(load.input, start, TensorType(weight_type.get_element_type(), [k1 - k0, n])),
                           load, f"{weight_name}_rows"))
    total: SSAValue | None = None
    for (k0, k1), rows in zip(tiles, rows_of):
        columns = add(tile.SliceOp(op.lhs, zero, TensorType(lhs_type.get_element_type(), [m, k1 - k0]), [k0]),
                      op, f"{lhs_name}_cols")
        last = k1 == k
        total = add(tcp.ContractOp(MATMUL, columns, rows, sum_type, bias=op.bias if last else None, acc=total),
                    op, sum_name)
    assert total is not None
    if not isinstance(out_type.get_element_type(), Float32Type):
        total = add(ve.NarrowOp(total, out_type), op)
    total.name_hint = op.result.name_hint
    op.result.replace_all_uses_with(total)
    op.detach()
    op.erase()
    load.detach()
    load.erase()


@dataclass(frozen=True)
class SplitRouterKPass(ModulePass):
    name = "split-router-k"

    piece_bytes: int = 0
    """The DMA's piece (0: the target's `dma.split_bytes`, RNGD's 1 MB): a weight above it
    already loads on several engines, and is left whole."""

    engines: int = 0
    """DMA engines (0: the target's, RNGD's 8): at most one tile each, beside the one loading
    the input."""

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        machine = machine_of(op)
        piece_bytes = self.piece_bytes or machine.dma_split_bytes
        engines = self.engines or machine.dma_engines
        for fn in op.ops:
            if not isinstance(fn, func.FuncOp) or not fn.body.blocks:
                continue
            for contraction in [o for o in fn.body.block.ops if isinstance(o, tcp.ContractOp)]:
                if (load := splittable(contraction, piece_bytes, engines)) is not None:
                    split_contraction(contraction, load, engines)
