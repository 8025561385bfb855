"""`schedule-shared`: a shared expert (a dense MLP every token goes through) as an expert loop.

Llama-4 and DeepSeek-V3 add a shared expert, `(silu(x @ ws_gate) * (x @ ws_up)) @ ws_down`.
After `lower-math` it is whole-tensor commands on [T, FS] (Llama-4-Scout: 252 MB of weights,
more than a cluster's SRAM). This pass rewrites it into the form `schedule-experts` builds its
expert loop from, so the shared expert gets that loop's F tiles (weights streamed through SRAM,
double-buffered, the down-projection accumulated in f32), and `split-clusters` spreads it over
the clusters:

- the tokens become G row blocks of R rows, `[T, D] -> [G, R, D]` (a view; R divides T and is
  a multiple of the contraction grid's GRID_M, or R = T: every block's contraction is then the
  reference's own chunks, so the loop gives its bits);
- each weight becomes a one-expert tensor `[1, K, N]` (a view of the HBM argument) gathered by
  `ids`, G zeros (every block uses "expert" 0); each contraction `mk,kn->mn` becomes the block
  contraction `gbd,gdf->gbf` guarded by `ids`; the down-projection gives f32 and is rounded
  after (`ve.narrow`), the rounding the whole contraction applied at its end;
- x is read straight from HBM (the function argument its load came from), so each block's rows
  are loaded by DMA like a dispatch's blocked rows, on whichever cluster runs the block;
- the ops take the phase `shared`, which makes them one plan for `schedule-experts` (a plan is
  the block-parallel ops of its contractions' phase) and a phase of their own in the report;
  `split-clusters` gives a shared loop's blocks to the clusters in turn (by block, not by
  expert: every block has the same expert);
- nothing the shared expert reads depends on the routing, so the rewritten ops are placed
  before the routing's first op: its weight loads are issued with the router's and run
  while the router, the top-k and the routing compute.

What is rewritten: a contraction `mk,kn->mn` whose weight is a `tcp.load` of a function
argument and whose lhs is computed, by element-wise `ve` ops on [T, ...], from up-projections
`x @ w` (the same x, weights loaded the same way). Anything else stays as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import BFloat16Type, Float32Type, ModuleOp, StringAttr, TensorType, f32, i32
from xdsl.ir import Block, BlockArgument, Operation, SSAValue
from xdsl.passes import ModulePass

from dialects import tcp, ve
from dialects.annotations import PHASE_ATTR, SHARED, phase_of
from dialects.tensor_types import shape_of
from passes.loop_builder import ZERO_OPERAND_VE, leading
from runtime_sim.semantics.numerics import GRID_M

DENSE_SPEC = "mk,kn->mn"
BLOCK_SPEC = "gbd,gdf->gbf"
MAX_ROWS = 512
"""The largest row block: a block's rows, its [R, F tile] column work and its f32 [R, D] sums
take tens of MB at Llama-4's sizes (R = 512, D = 5120, F tile 1024), next to the streamed
weight tiles (passes/f_tiles.py); Llama-4-Scout's layer peaks at 172 MB of the chip's 256 MB at
T = 2048 (benchmarks/schedule.py). A compiler choice, not a machine number."""
ROUTING_PHASES = ("routing", "dispatch", "experts", "combine")
"""Phases whose ops depend on the routing: the rewritten shared expert goes before them."""


def choose_rows(tokens: int, forced: int = 0) -> int:
    """The row block: `forced` when it divides T, else the largest multiple of GRID_M that
    divides T, is at most MAX_ROWS and leaves at least two blocks, an even number of them when
    one does (split-clusters then gives both clusters a block per iteration); T itself (one
    block) when there is none (decode, or T not a multiple of GRID_M)."""
    if forced > 0 and tokens % forced == 0:
        return forced
    fitting = [rows for rows in range(GRID_M, min(MAX_ROWS, tokens // 2) + 1, GRID_M) if tokens % rows == 0]
    even = [rows for rows in fitting if (tokens // rows) % 2 == 0]
    return max(even or fitting or [tokens])


def _weight_argument(value: SSAValue) -> SSAValue | None:
    """The function argument a 2-D weight operand was loaded from (`tcp.load`), read by that
    contraction alone; None otherwise."""
    load = value.owner
    if not isinstance(load, tcp.LoadOp) or not value.has_one_use() or len(shape_of(value.type)) != 2:
        return None
    source = load.input
    if isinstance(source, BlockArgument) and isinstance(source.owner, Block) and isinstance(
            source.owner.parent_op(), func.FuncOp):
        return source
    return None


def _is_dense(op: Operation) -> bool:
    return (isinstance(op, tcp.ContractOp) and op.spec.data == DENSE_SPEC and op.bias is None and op.guard is None
            and op.acc is None and _weight_argument(op.rhs) is not None)


def _elementwise(op: Operation, tokens: int) -> bool:
    """A `ve` op on [T, ...] values that works element by element (no axis, no tags)."""
    if op.dialect_name() != "ve" or not op.results or isinstance(op, (ve.IotaOp, ve.PositionTagOp)):
        return False
    if "axis" in op.properties or "axis" in op.attributes or any(ve.is_tag_type(r.type.get_element_type()) for r in op.results):
        return False
    values = [*op.operands, *op.results]
    return all(leading(v) == tokens and len(shape_of(v.type)) == 2 for v in values) and (
        bool(op.operands) or isinstance(op, ZERO_OPERAND_VE))


@dataclass
class DenseMlp:
    """A shared expert found in a function body: `down` and the ops before it (`ops`, program
    order, the up-projections among them), all working on `x`'s T rows."""

    x: SSAValue
    ups: list[tcp.ContractOp]
    ops: list[Operation]
    down: tcp.ContractOp


def find_dense_mlp(down: tcp.ContractOp) -> DenseMlp | None:
    """The MLP ending in `down`, or None when its lhs is not made as the docstring says."""
    if not _is_dense(down) or phase_of(down) in ROUTING_PHASES:
        return None
    tokens = leading(down.lhs)
    found: set[Operation] = set()
    ups: list[tcp.ContractOp] = []
    stack = [down.lhs]
    while stack:
        owner = stack.pop().owner
        if not isinstance(owner, Operation):
            return None
        if owner in found:
            continue
        if _is_dense(owner) and owner is not down:
            ups.append(owner)  # type: ignore[arg-type]
        elif _elementwise(owner, tokens):  # type: ignore[arg-type]
            stack.extend(owner.operands)
        else:
            return None
        found.add(owner)
    if not ups or len({u.lhs for u in ups}) != 1:
        return None
    x = ups[0].lhs
    if leading(x) != tokens or len(shape_of(x.type)) != 2:
        return None
    inside = found | {down}
    if any(use.operation not in inside for op in found for r in op.results for use in r.uses):
        return None  # an intermediate read elsewhere: left whole
    block = down.parent_block()
    assert block is not None
    ops = [op for op in block.ops if op in found]
    return DenseMlp(x, ups, ops, down)


def _source_rows(x: SSAValue) -> SSAValue:
    """Where a block's rows of x are read: the HBM argument x was loaded from, else x."""
    owner = x.owner
    if isinstance(owner, tcp.LoadOp) and isinstance(owner.input, BlockArgument):
        return owner.input
    return x


def _anchor(block: Block, mlp: DenseMlp) -> Operation:
    """The op the rewritten MLP goes before: the first op of a routing phase, unless x (read
    in SRAM) is made later; then the op after x's producer."""
    first = next((op for op in block.ops if phase_of(op) in ROUTING_PHASES), mlp.ops[0])
    source = _source_rows(mlp.x)
    producer = source.owner
    if isinstance(producer, Operation) and producer.parent_block() is block:
        ordered = list(block.ops)
        if ordered.index(producer) >= ordered.index(first):
            nxt = producer.next_op
            assert nxt is not None
            return nxt
    return first


def rewrite(block: Block, mlp: DenseMlp, forced_rows: int = 0) -> None:
    """Replace `mlp` by its blocked form (the module docstring)."""
    tokens, width = shape_of(mlp.x.type)
    rows = choose_rows(tokens, forced_rows)
    blocks = tokens // rows
    new: list[Operation] = []

    def add(op: Operation, name: str | None = None) -> SSAValue:
        op.attributes[PHASE_ATTR] = StringAttr(SHARED)
        new.append(op)
        if name is not None:
            op.results[0].name_hint = name
        return op.results[0]

    ids = add(ve.ConstOp(0, TensorType(i32, [blocks])), "shared_ids")
    source = _source_rows(mlp.x)
    x_blocks = add(tcp.ViewOp(source, [blocks, rows, width]), "x_blocks")

    def gathered(weight: SSAValue) -> SSAValue:
        arg = _weight_argument(weight)
        assert arg is not None
        one = add(tcp.ViewOp(arg, [1, *shape_of(arg.type)]))
        load = weight.owner
        name = load.results[0].name_hint if isinstance(load, Operation) else None
        return add(tcp.DmaGatherOp(one, ids), name)

    def blocked(t: TensorType) -> TensorType:
        return TensorType(t.get_element_type(), [blocks, rows, *shape_of(t)[1:]])

    mapping: dict[SSAValue, SSAValue] = {}
    for op in mlp.ops:
        if op in mlp.ups:
            assert isinstance(op, tcp.ContractOp)
            made: Operation = tcp.ContractOp(BLOCK_SPEC, x_blocks, gathered(op.rhs), blocked(op.result.type), guard=ids)
        else:
            made = type(op).create(operands=[mapping[v] for v in op.operands],
                                   result_types=[blocked(r.type) for r in op.results],
                                   properties=dict(op.properties), attributes=dict(op.attributes))
        add(made)
        for old, r in zip(op.results, made.results):
            r.name_hint = old.name_hint
            mapping[old] = r
    down = mlp.down
    out_type = down.result.type
    summed = add(tcp.ContractOp(BLOCK_SPEC, mapping[down.lhs], gathered(down.rhs),
                                TensorType(f32, [blocks, rows, shape_of(out_type)[1]]), guard=ids), "shared_acc")
    if not isinstance(out_type.get_element_type(), Float32Type):
        summed = add(ve.NarrowOp(summed, blocked(out_type)), "shared_blocks")
    result = add(tcp.ViewOp(summed, list(shape_of(out_type))), down.result.name_hint)

    anchor = _anchor(block, mlp)
    block.insert_ops_before(new, anchor)
    down.result.replace_all_uses_with(result)
    loads = [u.rhs.owner for u in [*mlp.ups, down]]
    for op in [down, *reversed(mlp.ops), *loads]:
        assert isinstance(op, Operation)
        op.detach()
        op.erase()


@dataclass(frozen=True)
class ScheduleSharedPass(ModulePass):
    """`rows`: the row block when positive and dividing T (else chosen, see `choose_rows`)."""

    name = "schedule-shared"

    rows: int = 0

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for fn in op.ops:
            if not (isinstance(fn, func.FuncOp) and fn.body.blocks):
                continue
            body = fn.body.block
            for down in [o for o in body.ops if _is_dense(o)]:
                if down.parent_block() is None:
                    continue
                mlp = find_dense_mlp(down)  # type: ignore[arg-type]
                if mlp is not None and isinstance(mlp.down.result.type.get_element_type(), (BFloat16Type, Float32Type)):
                    rewrite(body, mlp, self.rows)
