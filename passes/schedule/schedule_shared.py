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
  after (`ve.narrow`), the rounding the whole contraction applied at its end (a block-scaled
  one's, which the program applies after lower-quant's [T, D] view, moves into the blocks too,
  so the loop stores bf16 rows rather than f32 sums);
- x is read straight from HBM (the function argument its load came from), so each block's rows
  are loaded by DMA like a dispatch's blocked rows, on whichever cluster runs the block;
- the ops take the phase `shared`, which makes them one plan for `schedule-experts` (a plan is
  the block-parallel ops of its contractions' phase) and a phase of their own in the report;
  `split-clusters` gives a shared loop's blocks to the clusters in turn (by block, not by
  expert: every block has the same expert);
- nothing the shared expert reads depends on the routing, so the rewritten ops are placed
  before the routing's first op: its weight loads are issued with the router's and run
  while the router, the top-k and the routing compute. On a mesh chip they go after the
  dispatch's all-to-alls start, before the first is waited for: the shared expert computes
  while the link moves the tokens (DeepSeek-V3 on 8 chips at 4,096 tokens each, a2a_sum,
  one chunk: its 1,490 us leave the slowest chip's critical path, 18,814 -> 17,352 us).
  At prefill, interleave-shared (passes/schedule/interleave_shared.py) later spreads its
  contractions through the routed expert loop, whose tensor units wait for HBM.

What is rewritten: a contraction `mk,kn->mn` whose weight is a `tcp.load` of a function
argument and whose lhs is computed, by element-wise `ve` ops on [T, ...], from up-projections
`x @ w` (the same x, weights loaded the same way). Block-scaled (fp8) shared experts too
(DeepSeek-V3's): lower-quant's `tcp.scaled_contract` on [1, T, K] views, the weight and its
block scales function arguments, the up-projections' operands made from x row by row (its
quantization per group: views and reductions within a row, never along T), and h quantized
the same way before the down-projection; all of it becomes the blocked loop, the
quantization included (a row's groups are the row's alone). x's quantization may have other
readers (lower-dispatch{quantize=tokens}: the dispatch gathers the same quantized rows); the
loop then quantizes its row blocks again and the whole one stays for them. Anything else
stays as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import BFloat16Type, Float32Type, IntegerAttr, ModuleOp, StringAttr, TensorType, f32, i32
from xdsl.ir import Block, BlockArgument, Operation, SSAValue
from xdsl.passes import ModulePass

from dialects import ccl, tcp, ve
from dialects.annotations import PHASE_ATTR, SHARED, phase_of
from dialects.tensor_types import shape_of
from passes._auto_option import check_choice, refuse_auto
from passes._loop_builder import ZERO_OPERAND_VE, leading, works_along_axis_zero
from runtime_sim.semantics.numerics import GRID_M

DENSE_SPEC = "mk,kn->mn"
BLOCK_SPEC = "gbd,gdf->gbf"
MAX_ROWS = 512
"""The largest row block by default: a block's rows, its [R, F tile] column work and its f32 [R, D] sums
take tens of MB at Llama-4's sizes (R = 512, D = 5120, F tile 512 or 1024), next to the streamed
weight tiles (passes/schedule/_f_tiles.py); Llama-4-Scout's layer peaks at 153 MB of the chip's 256 MB at
T = 2048, its shared expert spread through the routed loop (benchmarks/schedule.py). A compiler
choice, not a machine number."""
MOST_ROWS = (str(MAX_ROWS), str(2 * MAX_ROWS))
"""`most_rows`, the largest row block (the default first): every row block streams the shared
weights' F tiles through SRAM once, so twice the rows cross HBM with half the weight bytes
(DeepSeek-V3 fp8 at T = 4096: 176 MB rather than 352), for twice the SRAM a block holds; which
is cheaper is the cost model's choice (`most_rows=auto`, tcpc/autotune.py), where the SRAM
decides (at 2,048 rows the same layer's blocks spilled 37 buffers)."""
ROUTING_PHASES = ("routing", "dispatch", "experts", "combine")
"""Phases whose ops depend on the routing: the rewritten shared expert goes before them."""


def choose_rows(tokens: int, forced: int = 0, most: int = MAX_ROWS) -> int:
    """The row block: `forced` when it divides T, else the largest multiple of GRID_M that
    divides T, is at most `most` and leaves at least two blocks, an even number of them when
    one does (split-clusters then gives both clusters a block per iteration); T itself (one
    block) when there is none (decode, or T not a multiple of GRID_M)."""
    if forced > 0 and tokens % forced == 0:
        return forced
    fitting = [rows for rows in range(GRID_M, min(most, tokens // 2) + 1, GRID_M) if tokens % rows == 0]
    even = [rows for rows in fitting if (tokens // rows) % 2 == 0]
    return max(even or fitting or [tokens])


def _unbatched(value: SSAValue) -> SSAValue:
    """`value` before a `tcp.view` that only adds a leading axis of 1 (lower-quant's [1, K, N]
    view of a scaled matmul's weight and scales), else `value`."""
    owner = value.owner
    if isinstance(owner, tcp.ViewOp) and shape_of(value.type) == (1, *shape_of(owner.input.type)):
        return owner.input
    return value


def _weight_argument(value: SSAValue) -> SSAValue | None:
    """The function argument a 2-D weight operand (or its block scales; seen as [1, K, N] by a
    block-scaled contraction) was loaded from (`tcp.load`), read by that contraction alone;
    None otherwise."""
    if len(shape_of(value.type)) == 3:
        if not value.has_one_use():
            return None
        value = _unbatched(value)
    load = value.owner
    if not isinstance(load, tcp.LoadOp) or not value.has_one_use() or len(shape_of(value.type)) != 2:
        return None
    source = load.input
    if isinstance(source, BlockArgument) and isinstance(source.owner, Block) and isinstance(
            source.owner.parent_op(), func.FuncOp):
        return source
    return None


def _is_dense(op: Operation) -> bool:
    """A dense contraction of T rows by a weight argument: `mk,kn->mn`, or a block-scaled one
    (lower-quant's `tcp.scaled_contract` on [1, T, K] and [1, K, N] views, with the weight's
    scales an argument too)."""
    if isinstance(op, tcp.ScaledContractOp):
        return (op.bias is None and op.guard is None and op.acc is None and shape_of(op.lhs.type)[0] == 1
                and _weight_argument(op.rhs) is not None and _weight_argument(op.rhs_scales) is not None)
    return (isinstance(op, tcp.ContractOp) and op.spec.data == DENSE_SPEC and op.bias is None and op.guard is None
            and op.acc is None and _weight_argument(op.rhs) is not None)


def _tokens_of(op: tcp.ContractOp | tcp.ScaledContractOp) -> int:
    """The T rows a dense contraction works on."""
    return shape_of(op.lhs.type)[1 if isinstance(op, tcp.ScaledContractOp) else 0]


def _row_major(value: SSAValue, tokens: int) -> bool:
    """[T, ...], or [1, T, ...] (a block-scaled contraction's view)."""
    shape = shape_of(value.type)
    return shape[:1] == (tokens,) or (len(shape) >= 3 and shape[:2] == (1, tokens))


def _elementwise(op: Operation, tokens: int) -> bool:
    """A `ve` op on [T, ...] values that works on each row alone (not along T, no tags), or a
    view that keeps the T rows (a quantization's [T, K / g, g] groups, a [1, T, K] batch)."""
    if isinstance(op, tcp.ViewOp):
        return _row_major(op.input, tokens) and _row_major(op.result, tokens)
    if op.dialect_name() != "ve" or not op.results or isinstance(op, (ve.IotaOp, ve.PositionTagOp)):
        return False
    if works_along_axis_zero(op) or any(
            ve.is_tag_type(r.type.get_element_type()) for r in op.results):
        return False
    values = [*op.operands, *op.results]
    return all(leading(v) == tokens and len(shape_of(v.type)) >= 2 for v in values) and (
        bool(op.operands) or isinstance(op, ZERO_OPERAND_VE))


@dataclass
class DenseMlp:
    """A shared expert found in a function body: `down` and the ops before it (`ops`, program
    order, the up-projections among them), all working on `x`'s T rows."""

    x: SSAValue
    ups: list[tcp.ContractOp | tcp.ScaledContractOp]
    ops: list[Operation]
    down: tcp.ContractOp | tcp.ScaledContractOp


def _activations(op: tcp.ContractOp | tcp.ScaledContractOp) -> list[SSAValue]:
    """The operands of a dense contraction made from the tokens: lhs (and its scales)."""
    return [op.lhs, op.lhs_scales] if isinstance(op, tcp.ScaledContractOp) else [op.lhs]


def find_dense_mlp(down: tcp.ContractOp | tcp.ScaledContractOp) -> DenseMlp | None:
    """The MLP ending in `down`, or None when its lhs is not made as the docstring says. The
    up-projections' lhs is x, or (block-scaled) made from x row by row (its quantization)."""
    if not _is_dense(down) or phase_of(down) in ROUTING_PHASES:
        return None
    tokens = _tokens_of(down)
    found: set[Operation] = set()
    quantizing: set[Operation] = set()
    ups: list[tcp.ContractOp | tcp.ScaledContractOp] = []
    inputs: set[SSAValue] = set()
    stack = [(v, False) for v in _activations(down)]
    while stack:
        value, before_ups = stack.pop()
        owner = value.owner
        if before_ups and (not isinstance(owner, Operation) or not _elementwise(owner, tokens)):
            inputs.add(value)  # what the up-projections' operands are made from: x
            continue
        if not isinstance(owner, Operation):
            return None
        if owner in found:
            continue
        if _is_dense(owner) and owner is not down:
            ups.append(owner)  # type: ignore[arg-type]
            if isinstance(owner, tcp.ScaledContractOp):  # its operands are x quantized
                stack.extend((v, True) for v in _activations(owner))
            else:
                inputs.add(owner.lhs)  # type: ignore[attr-defined]
        elif _elementwise(owner, tokens):  # type: ignore[arg-type]
            stack.extend((v, before_ups) for v in owner.operands)
            if before_ups:
                quantizing.add(owner)
        else:
            return None
        found.add(owner)
    if not ups or len(inputs) != 1:
        return None
    (x,) = inputs
    if leading(x) != tokens or len(shape_of(x.type)) != 2:
        return None
    inside = found | {down}
    if any(use.operation not in inside for op in found - quantizing for r in op.results for use in r.uses):
        return None  # an intermediate read elsewhere: left whole
    block = down.parent_block()
    assert block is not None
    ops = [op for op in block.ops if op in found]
    return DenseMlp(x, ups, ops, down)


def chooses_rows(module: ModuleOp) -> bool:
    """Whether `most_rows` could change `module` (graph level): a dense MLP of weight arguments
    beside the router (two or more matmuls `x @ w` of a 2-D function argument, block-scaled or
    not) on T rows that the row caps of `MOST_ROWS` cut differently. The driver leaves
    `most_rows` to the cost model only then (prefill with a shared expert)."""
    dense = [op for op in module.walk() if op.name in ("tmath.matmul", "lowp.scaled_matmul") and len(op.operands) >= 2
             and isinstance(op.operands[1], BlockArgument) and len(shape_of(op.operands[1].type)) == 2]
    return len(dense) >= 2 and any(
        len({choose_rows(shape_of(op.operands[0].type)[0], 0, int(most)) for most in MOST_ROWS}) > 1 for op in dense)


def _source_rows(x: SSAValue) -> SSAValue:
    """Where a block's rows of x are read: the HBM argument x was loaded from, else x."""
    owner = x.owner
    if isinstance(owner, tcp.LoadOp) and isinstance(owner.input, BlockArgument):
        return owner.input
    return x


def _anchor(block: Block, mlp: DenseMlp) -> Operation:
    """The op the rewritten MLP goes before: the first op of a routing phase, unless x (read
    in SRAM) is made later; then the op after x's producer. On a mesh chip whose dispatch is
    an asynchronous all-to-all, its first `ccl.all_to_all_done` instead: the shared expert's
    contractions then run while the link moves the tokens, not before the transfers start."""
    waited = ccl.first_all_to_all_done(block)
    first = waited if waited is not None else next((op for op in block.ops if phase_of(op) in ROUTING_PHASES), mlp.ops[0])
    source = _source_rows(mlp.x)
    producer = source.owner
    if isinstance(producer, Operation) and producer.parent_block() is block:
        ordered = list(block.ops)
        if ordered.index(producer) >= ordered.index(first):
            nxt = producer.next_op
            assert nxt is not None
            return nxt
    return first


def _rounding_after(down: tcp.ContractOp | tcp.ScaledContractOp) -> ve.NarrowOp | None:
    """The rounding of a block-scaled down-projection's f32 rows to bf16 (lower-quant's [T, D]
    view of its [1, T, D] result, then `ve.narrow`), when nothing else reads the view or the
    f32 rows: the blocked loop then rounds each block itself, and its results cross HBM in
    bf16 rather than f32 (DeepSeek-V3 fp8 at T = 4096: 117 MB stored and loaded back, not 235).
    Not for one token (`rewrite`): its row stays in SRAM, so the rounding saves no bytes and
    would only lengthen the shared expert's chain (DeepSeek-V3 fp8 T = 1: 373 cycles more)."""
    readers = [use.operation for use in down.result.uses]
    view = readers[0] if len(readers) == 1 else None
    if not isinstance(view, tcp.ViewOp) or not view.result.has_one_use():
        return None
    narrow = next(iter(view.result.uses)).operation
    if not isinstance(narrow, ve.NarrowOp) or narrow.truncate is not None or narrow.parent_block() is not down.parent_block():
        return None
    return narrow


def rewrite(block: Block, mlp: DenseMlp, forced_rows: int = 0, most_rows: int = MAX_ROWS) -> None:
    """Replace `mlp` by its blocked form (the module docstring)."""
    tokens, width = shape_of(mlp.x.type)
    rows = choose_rows(tokens, forced_rows, most_rows)
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
        load = _unbatched(weight).owner
        name = load.results[0].name_hint if isinstance(load, Operation) else None
        return add(tcp.DmaGatherOp(one, ids), name)

    scaled = [u for u in [*mlp.ups, mlp.down] if isinstance(u, tcp.ScaledContractOp)]
    batches = {u.result for u in scaled} | {v for u in scaled for v in (u.lhs, u.lhs_scales)
                                            if isinstance(v.owner, tcp.ViewOp)}
    """lower-quant's [1, T, ...] views around a block-scaled contraction (at T = 1 a view that
    would not change the shape is not made: then the operand is the [T, ...] value itself);
    every other value is [T, ...]."""

    def as_batch(value: SSAValue) -> SSAValue:
        """A blocked operand of a block-scaled contraction as [G, R, K]."""
        shape = shape_of(value.type)
        if len(shape) == 3:
            return value
        return add(tcp.ViewOp(value, [blocks, rows, math.prod(shape[2:])]))

    def blocked(value: SSAValue) -> TensorType:
        """`value` ([T, ...], or one of the [1, T, ...] `batches`) as [G, R, ...]."""
        t = value.type
        assert isinstance(t, TensorType)
        shape = shape_of(t)
        return TensorType(t.get_element_type(), [blocks, rows, *shape[2 if value in batches else 1:]])

    def contraction(op: tcp.ContractOp | tcp.ScaledContractOp, result: TensorType) -> Operation:
        """`op` as the block contraction of the one-expert weights, guarded by `ids`."""
        if isinstance(op, tcp.ScaledContractOp):
            scaled = tcp.ScaledContractOp(as_batch(mapping[op.lhs]), gathered(op.rhs), as_batch(mapping[op.lhs_scales]),
                                          gathered(op.rhs_scales), guard=ids)
            scaled.location = op.location
            return scaled
        made = tcp.ContractOp(BLOCK_SPEC, mapping[op.lhs], gathered(op.rhs), result, guard=ids)
        made.location = op.location
        return made

    mapping: dict[SSAValue, SSAValue] = {mlp.x: x_blocks}
    for op in mlp.ops:
        if op in mlp.ups:
            made: Operation = contraction(op, blocked(op.result))  # type: ignore[arg-type]
        else:
            axis = op.properties.get("axis")
            properties = dict(op.properties)
            if isinstance(axis, IntegerAttr) and op.dialect_name() == "ve":  # a new leading axis: G
                properties["axis"] = IntegerAttr(axis.value.data + 1, axis.type)
            made = type(op).create(operands=[mapping[v] for v in op.operands],
                                   result_types=[blocked(r) for r in op.results],
                                   properties=properties, attributes=dict(op.attributes), location=op.location)
        add(made)
        for old, r in zip(op.results, made.results):
            r.name_hint = old.name_hint
            mapping[old] = r
    down = mlp.down
    rounded = _rounding_after(down) if tokens > 1 else None
    out = down.result if rounded is None else rounded.result
    out_type = out.type
    summed = add(contraction(down, TensorType(f32, [blocks, rows, shape_of(out_type)[-1]])), "shared_acc")
    if not isinstance(out_type.get_element_type(), Float32Type):
        summed = add(ve.NarrowOp(summed, TensorType(out_type.get_element_type(), shape_of(summed.type))), "shared_blocks")
    result = add(tcp.ViewOp(summed, list(shape_of(out_type))), out.name_hint)

    anchor = _anchor(block, mlp)
    block.insert_ops_before(new, anchor)
    out.replace_all_uses_with(result)
    if rounded is not None:
        view = rounded.input.owner
        for op in (rounded, view):
            assert isinstance(op, Operation)
            op.detach()
            op.erase()
    weights = [v for u in [*mlp.ups, down] for v in ([u.rhs, u.rhs_scales] if isinstance(u, tcp.ScaledContractOp) else [u.rhs])]
    weight_views = [v.owner for v in weights if isinstance(v.owner, tcp.ViewOp)]
    loads = [_unbatched(v).owner for v in weights]
    for op in [down, *reversed(mlp.ops), *weight_views, *loads]:
        assert isinstance(op, Operation)
        if any(r.uses for r in op.results):
            continue  # x's quantization that the dispatch reads too (quantize=tokens): its own again
        op.detach()
        op.erase()


@dataclass(frozen=True)
class ScheduleSharedPass(ModulePass):
    """A shared expert's dense MLP -> the one-expert blocked form over row blocks (the module
    docstring says how)."""

    name = "schedule-shared"

    rows: int = 0
    """The row block when positive and dividing T (else chosen, see `choose_rows`)."""
    most_rows: int | str = MAX_ROWS
    """The largest row block `choose_rows` takes (one of `MOST_ROWS`), or `auto`, which the
    driver resolves by the cost model (tcpc/autotune.py)."""

    def __post_init__(self) -> None:
        check_choice(self.name, "most_rows", str(self.most_rows), MOST_ROWS)

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        refuse_auto(self.name, "most_rows", str(self.most_rows), MOST_ROWS)
        for fn in op.ops:
            if not (isinstance(fn, func.FuncOp) and fn.body.blocks):
                continue
            body = fn.body.block
            for down in [o for o in body.ops if _is_dense(o)]:
                if down.parent_block() is None:
                    continue
                mlp = find_dense_mlp(down)  # type: ignore[arg-type]
                if mlp is not None and isinstance(mlp.down.result.type.get_element_type(), (BFloat16Type, Float32Type)):
                    rewrite(body, mlp, self.rows, int(self.most_rows))
