"""`lower-dispatch`: the data movement of an MoE layer becomes DMA and contraction commands.

It runs after `lower-routing`, which leaves the routing plan as `moe.route %scatter_idx,
%expert_ids` (scatter_idx [T, K]: the row of pair (t, k) in the blocked buffer, -1 if dropped;
expert_ids [G]: block g's expert, -1 if unused) and `moe.scatter`'s data movement as
`moe.dispatch`. This pass rewrites the three ops that consume a plan (the book's MoE chapter,
sections 3.4 to 3.6, docs/hardware.md#the-moe-chapter-of-the-book):

- `moe.dispatch %x, %route` -> `tcp.dma_gather %x[%block_tokens]` ([G, B, D], `x_blocked`):
  each row of the blocked buffer reads its token's row, by the plan's inverse index
  `block_tokens` ([G, B], the token of each row, -1 on padding rows and unused blocks, which
  read nothing and are zero, as the scatter's zeroed buffer left them). The index is built
  once per plan: a DMA scatter of the token numbers plus one by scatter_idx into zeroed rows
  (`row_marks`, [G * B, 1]), minus one; from 64 tokens the scatter is split into shards of
  consecutive tokens, one DMA command each, their results added (`scatter_shard`). The tokens themselves are never written to
  a blocked buffer in HBM: the schedule level gathers each block's rows straight from the
  tokens, inside its expert loop (passes/schedule/schedule_experts.py).
- `moe.grouped_matmul %xb, %w, %route (bias %b)?` ->
  - `tcp.dma_gather %w[%expert_ids]` ([G, D, F], `w_gathered`): one weight per block; an unused
    block's id is -1, so nothing is read for it. Blocks of one expert are consecutive, so the
    DMA engine reloads a weight only when the id changes (the cost model charges it so);
  - with a bias, `tcp.dma_gather %b[%expert_ids]` viewed as [G, 1, F] (`bias_gathered`);
  - `tcp.contract "gbd,gdf->gbf" ... guard %expert_ids` into f32 (`y_acc`): blocks with id -1
    are skipped and left zero;
  - the padding mask: the reference leaves padding rows zero (the bias is not added to them,
    and 0 * inf in a padding row is not NaN), so `ve.select` keeps `y_acc` on valid rows and
    +0.0 elsewhere. Which rows are valid is read from the dispatch's index `block_tokens`
    (below; phase `dispatch`), tagged >= 0 (`row_valid`, [G, B]), built once per routing plan
    and broadcast over F;
  - `ve.narrow` to bf16 when the result is bf16: the contraction's f32 result is rounded once,
    as the reference rounds it.
  A weight decoded for the contraction, `bf16(dequantize(values, scales, ...))` of per-expert
  operands (FP4 with group scales, the 3-bit trellis codes with their grid and sign vectors),
  is decoded block by block instead of whole: its per-expert operands are gathered at their
  stored width (`w_gathered`, `w_scales_gathered`, `su_gathered`, `sv_gathered`; the grid is
  shared), and the `lowp.dequantize` and `tmath.cast` are made again on the gathered [G, ...]
  operands, for lower-quant and lower-math to lower (`w_decoded`): only the blocks' experts
  are decoded, right before their contraction.
- `moe.scaled_grouped_matmul %xq, %wq, %route scales %xs, %ws (bias %b)?` -> the same, with
  the weight scales gathered too (`w_scales_gathered`; right after the plan's row masks when
  they are a function argument, so that the small scale gathers run early rather than queue
  behind the weight gathers) and `tcp.scaled_contract` in place of
  `tcp.contract`: the f32 partial sum of each K-block is multiplied by its two scales in the
  chain's vector stage and summed in K order; values and scales move at their stored width.
- `moe.combine %yb, %route (weights %w)?` -> `tcp.view` as [G*B, D] rows (`y_rows`),
  `tcp.dma_gather` by scatter_idx to [T, K, D] (`y_restored`; a dropped pair reads nothing and
  is zero), `ve.widen` to f32, then with weights: the weights (widened) with a dropped pair's
  weight forced to +0.0 by a tag on scatter_idx >= 0 (so a NaN or inf weight never meets its
  zero row), broadcast over D and multiplied (`y_weighted`); `ve.reduce_sum` along K, strictly
  k = 0, 1, ..., K-1 as the reference adds; `+ 0.0`, because the reference's accumulator starts
  at +0.0 (so an all-(-0.0) sum is +0.0 there); `ve.narrow` when the output is bf16 (`moe_out`).
  A combine of bf16 blocks widened to f32 by a `tmath.cast` (shard-experts' allgather sums f32
  partial rows) gathers the bf16 rows instead and widens them after the gather as above, the
  same values (widening is exact), and the whole-tensor cast goes (`widened_from`).
- `moe.pair_rows %route` -> the plan's scatter_idx itself.

Exactness: dispatch and combine give the reference's bits exactly. grouped_matmul gives them
exactly on padding rows and unused blocks and in the rounding points (one f32 accumulation,
bias added in f32, one rounding); its valid rows can differ only by the f32 accumulation order
of the contraction, which the two levels' numpy evaluations do not share (`np.einsum` for
`tcp.contract`, a BLAS `@` per block for the reference): |difference| <= 2 * gamma_D *
(sum_d |x_d * w_d| + |bias|) with gamma_D = D * 2^-24 / (1 - D * 2^-24), plus one ulp of the
result for a bf16 result (the two f32 values may round to neighbouring bf16 values). See
tests/test_lower_dispatch.py, which checks exactly this.

Where the activations of a block-scaled grouped matmul are quantized (`quantize`, the option's
values in `QUANTIZE_PLACES`): `blocks` (the default) leaves `lowp.quantize` on each block's
rows, after the dispatch, once per routed pair; `tokens` quantizes each token once, before the
dispatch (K times fewer rows through the vector engine's amax and division passes), and the
blocks gather its f8 rows and their f32 scales by the plan (`moe.dispatch` of each, then
lowered as above). It moves only a quantization of a dispatch's blocks that nothing but the
plan's block-scaled grouped matmuls read (as their tokens and their scales): a group's values
and scale depend only on its row, so valid rows get the same bits, and the padding rows, whose
scales are then zero rather than eps / max_finite, are masked to +0.0 by those matmuls. Which is
faster depends on the loop (one vector pass per pair less; one DMA gather per block more and the
quantized tokens held in SRAM), so `quantize=auto` leaves it to the cost model (tcpc/autotune.py;
the driver asks only when a program has such a quantization, `quantizes_dispatched_tokens`):
Qwen3-30B-A3B fp8 at T = 4096 (cost-only, balanced, B = 256) 978 -> 922 µs with `tokens`,
gpt-oss-120b fp8 at T = 2048 (B = 64) 2,524 with `blocks` against 2,559.

A route that is not a `moe.route` result (a `moe.scatter`'s, or a function argument) means
`lower-routing` has not run: the pass stops with a PassFailedException saying so, before it
changes anything. `moe.route` ops left without uses are erased.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from xdsl.context import Context
from xdsl.dialects.builtin import BFloat16Type, ModuleOp, TensorType, f32, i32
from xdsl.ir import Attribute, BlockArgument, Operation, SSAValue
from xdsl.passes import ModulePass
from xdsl.pattern_rewriter import (
    GreedyRewritePatternApplier,
    PatternRewriter,
    PatternRewriteWalker,
    RewritePattern,
    op_type_rewrite_pattern,
)
from xdsl.rewriter import InsertPoint, Rewriter
from xdsl.utils.exceptions import PassFailedException

from dialects import lowp, moe, tcp, tmath, ve
from dialects.annotations import mark, mark_pair_sum
from dialects.tensor_types import shape_of
from passes._auto_option import check_choice, refuse_auto
from passes.lowering._builder import LoweringBuilder, element_of
from target.target_spec import machine_of

PLAN_CONSUMERS = (moe.DispatchOp, moe.GroupedMatmulOp, moe.ScaledGroupedMatmulOp, moe.CombineOp, moe.PairRowsOp)
QUANTIZE_BLOCKS, QUANTIZE_TOKENS = "blocks", "tokens"
QUANTIZE_PLACES = (QUANTIZE_BLOCKS, QUANTIZE_TOKENS)
"""The `quantize` option's values, the default first (the module docstring)."""


class _Emitter(LoweringBuilder):
    """The shared builder, with every constant named (the rewriter would otherwise give an
    unnamed one the replaced op's name) and f32 lanes made only where they are missing."""

    def const(self, value: int | float, shape: Sequence[int], element: Attribute = i32,
              name: str | None = None) -> SSAValue:
        default = {0: "zeros", 1: "ones"}.get(value, "splat")  # type: ignore[call-overload]
        return super().const(value, shape, element, name or default)

    def to_f32(self, x: SSAValue, name: str | None = None) -> SSAValue:
        """x in 32-bit lanes: bf16 widens (exactly), f32 is already there."""
        return x if element_of(x) == f32 else self.widen(x, name)

    def to_result(self, x: SSAValue, result_type: Attribute, name: str | None) -> SSAValue:
        """An f32 value rounded once to the result type (nothing to do for f32)."""
        assert isinstance(result_type, TensorType)
        if isinstance(result_type.get_element_type(), BFloat16Type):
            return self.narrow(x, name)
        assert result_type == x.type
        if name is not None:
            x.name_hint = name
        return x


TOKENS_PER_SCATTER = 64
"""The fewest tokens one of those commands scatters (a rule of thumb: below it a command's
start-up is a large part of its time; decode keeps one command)."""


def scatter_shard(tokens: int, engines: int) -> int:
    """Tokens per DMA command of the dispatch index's scatter: max(TOKENS_PER_SCATTER,
    ceil(T / engines)), a command per DMA engine of the target at most; T or more means one
    command. Each command sends one shard of
    consecutive tokens' pairs (the others' indices -1) and their results are added (a row is
    written by one shard at most, the rest are zero). A scatter moves one 4-byte row per
    pair, so its time is a DMA request per pair, and one command (a 64 KB payload at T = 2048,
    K = 8, under the 1 MB DMA piece) runs on one engine: 18.9k cycles on Qwen3-30B-A3B's
    critical path, against about 2.4k for each of eight at once. The shard never shrinks as
    T grows (the first shards are full), so neither does the longest command."""
    return max(TOKENS_PER_SCATTER, -(-tokens // engines))


def plan_of(op: Operation, route: SSAValue) -> moe.RouteOp:
    """The `moe.route` op that produced `route`, or the error that lower-routing must run first."""
    owner = route.owner
    if isinstance(owner, moe.RouteOp):
        return owner
    name = f"%{route.name_hint}" if route.name_hint else "the route"
    source = f"it comes from {owner.name}" if isinstance(owner, Operation) else "it is a block argument"
    raise PassFailedException(
        f"lower-dispatch: run lower-routing first: {name} of {op.name} is not produced by moe.route ({source})"
    )


def check_lowered_routing(module: ModuleOp) -> None:
    """Every plan consumer reads a `moe.route` and no `moe.scatter` is left, or the error."""
    for op in module.walk():
        if isinstance(op, moe.ScatterOp):
            raise PassFailedException(
                "lower-dispatch: run lower-routing first: moe.scatter has not been lowered to moe.route and moe.dispatch"
            )
        if isinstance(op, PLAN_CONSUMERS):
            plan_of(op, op.route)


@dataclass
class _RowMasks:
    """Which rows of each plan's blocked buffer hold a pair: built once per `moe.route`, right
    after it (so it dominates every consumer of the plan), and broadcast once per width."""

    tokens: dict[moe.RouteOp, SSAValue] = field(default_factory=dict)
    tags: dict[moe.RouteOp, SSAValue] = field(default_factory=dict)
    wide: dict[tuple[moe.RouteOp, int], SSAValue] = field(default_factory=dict)
    last: dict[moe.RouteOp, Operation] = field(default_factory=dict)

    def block_tokens(self, plan: moe.RouteOp, rewriter: PatternRewriter) -> SSAValue:
        """[G, B] i32: the token whose pair was scattered to each row of the blocked buffer, -1
        on padding rows and unused blocks (a DMA scatter of the token numbers plus one by
        scatter_idx into zeroed rows, minus one): the dispatch's gather index."""
        if plan not in self.tokens:
            r = plan.route.type
            assert isinstance(r, moe.RouteType)
            t, g, b = r.tokens.data, r.blocks.data, r.block.data
            e = _Emitter()
            numbers = e.emit(ve.AddOp(e.iota([t, 1], 0, "token_numbers"), e.const(1, [t, 1], i32)), "token_marks")
            shard = scatter_shard(t, machine_of(plan).dma_engines)
            if shard >= t:
                rows = e.emit(tcp.DmaScatterOp(numbers, plan.scatter_idx, g * b), "row_marks")
            else:
                k = shape_of(plan.scatter_idx.type)[1]
                token = e.iota([t, k], 0, "pair_token")
                shard_idx = []
                for c, lo in enumerate(range(0, t, shard)):
                    idx = plan.scatter_idx
                    if lo > 0:
                        idx = e.select(e.tag("ge", token, lo, f"from{c}"), idx, -1, f"shard{c}_from")
                    if lo + shard < t:
                        idx = e.select(e.tag("lt", token, lo + shard, f"below{c}"), idx, -1)
                    idx.name_hint = f"shard{c}_idx"
                    shard_idx.append(idx)
                # Every shard's indices, then every scatter, then the sums: the vector engine runs
                # its commands in program order, so an add waiting for a scatter would hold back
                # the next shard's indices (and its scatter) behind it.
                parts = [e.emit(tcp.DmaScatterOp(numbers, idx, g * b), f"row_marks{c}") for c, idx in enumerate(shard_idx)]
                rows = parts[0]
                for c, part in enumerate(parts[1:], 2):
                    rows = e.emit(ve.AddOp(rows, part), "row_marks" if c == len(parts) else f"row_marks_to{c}")
            marks = e.view(rows, [g, b], "block_marks")
            self.tokens[plan] = e.emit(ve.SubOp(marks, e.const(1, [g, b], i32)), "block_tokens")
            mark(e.ops, "dispatch")
            self._insert(plan, e.ops, InsertPoint.after(plan), rewriter)
        return self.tokens[plan]

    def row_valid(self, plan: moe.RouteOp, rewriter: PatternRewriter) -> SSAValue:
        """Tags [G, B]: 1 on a row some pair was scattered to, 0 on padding and unused blocks."""
        if plan not in self.tags:
            tokens = self.block_tokens(plan, rewriter)
            e = _Emitter()
            self.tags[plan] = e.emit(ve.TagOp("ge", tokens, e.const(0, shape_of(tokens.type), i32)), "row_valid")
            self._insert(plan, e.ops, InsertPoint.after(self.last[plan]), rewriter)
        return self.tags[plan]

    def rows_valid(self, plan: moe.RouteOp, width: int, rewriter: PatternRewriter) -> SSAValue:
        """Tags [G, B, width]: row_valid broadcast along a new last axis."""
        key = (plan, width)
        if key not in self.wide:
            row_valid = self.row_valid(plan, rewriter)
            op = ve.BroadcastOp(row_valid, 2, width)
            op.result.name_hint = "rows_valid"
            self._insert(plan, [op], InsertPoint.after(self.last[plan]), rewriter)
            self.wide[key] = op.result
        return self.wide[key]

    def early_gather(self, plan: moe.RouteOp, source: SSAValue, name: str, rewriter: PatternRewriter) -> SSAValue | None:
        """`tcp.dma_gather %source[%expert_ids]` placed right after the plan's masks, when
        `source` is a function argument (so it is available there): block scales are small,
        and gathered early they run beside the dispatch rather than queueing behind weight
        gathers that occupy every DMA engine (commands issue in program order). None when
        `source` is computed in the function."""
        if not isinstance(source, BlockArgument):
            return None
        self.row_valid(plan, rewriter)
        op = tcp.DmaGatherOp(source, plan.expert_ids)
        op.result.name_hint = name
        self._insert(plan, [op], InsertPoint.after(self.last[plan]), rewriter)
        return op.result

    def _insert(self, plan: moe.RouteOp, ops: list[Operation], at: InsertPoint, rewriter: PatternRewriter) -> None:
        mark(ops, "experts")
        rewriter.insert(ops, at)
        self.last[plan] = ops[-1]


def _tokens_of_blocks(quantize: lowp.QuantizeOp) -> tuple[SSAValue, SSAValue] | None:
    """The tokens and the route of the blocks `quantize` quantizes, when they are a
    `moe.scatter`'s or a `moe.dispatch`'s blocks and only the same plan's block-scaled grouped
    matmuls read its values and scales, as their tokens and their scales (`quantize=tokens`)."""
    owner = quantize.input.owner
    if isinstance(owner, moe.ScatterOp) and quantize.input == owner.blocked:
        tokens, route = owner.input, owner.route
    elif isinstance(owner, moe.DispatchOp):
        tokens, route = owner.input, owner.route
    else:
        return None
    values, scales = quantize.values, quantize.scales

    def reads_as_tokens(op: Operation) -> bool:
        return (isinstance(op, moe.ScaledGroupedMatmulOp) and op.route == route and op.input == values
                and op.input_scales == scales and not any(v in (values, scales) for v in (op.weight, op.weight_scales, op.bias)))

    readers = [use.operation for r in (values, scales) for use in r.uses]
    return (tokens, route) if readers and all(reads_as_tokens(op) for op in readers) else None


def quantizes_dispatched_tokens(module: ModuleOp) -> bool:
    """Whether `quantize=tokens` would move a quantization in `module` (graph or lowered
    routing): the driver leaves `quantize` to the cost model only then."""
    return any(isinstance(op, lowp.QuantizeOp) and _tokens_of_blocks(op) is not None for op in module.walk())


def quantize_tokens(module: ModuleOp) -> None:
    """`quantize=tokens` (the module docstring): each quantization of a dispatch's blocks that
    only the plan's block-scaled grouped matmuls read becomes the quantization of the tokens and
    a dispatch of its values and of its scales; a dispatch left unread goes, and a later equal
    quantization of the same tokens (DeepSeek-V3's shared expert's) reads the one made here."""
    for quantize in [op for op in module.walk() if isinstance(op, lowp.QuantizeOp)]:
        if quantize.parent is None:  # erased as a copy of an earlier one
            continue
        found = _tokens_of_blocks(quantize)
        if found is None or not isinstance(quantize.input.owner, moe.DispatchOp):
            continue
        tokens, route = found
        dispatch = quantize.input.owner
        whole = lowp.QuantizeOp(tokens, element_of(quantize.values), quantize.group_size)
        whole.values.name_hint, whole.scales.name_hint = "xq_tokens", "xs_tokens"
        values, scales = moe.DispatchOp(whole.values, route), moe.DispatchOp(whole.scales, route)
        values.blocked.name_hint, scales.blocked.name_hint = quantize.values.name_hint, quantize.scales.name_hint
        Rewriter.insert_op([whole, values, scales], InsertPoint.before(quantize))
        quantize.values.replace_all_uses_with(values.blocked)
        quantize.scales.replace_all_uses_with(scales.blocked)
        Rewriter.erase_op(quantize)
        if not dispatch.blocked.uses:
            Rewriter.erase_op(dispatch)
        later = whole.next_op
        while later is not None:
            after = later.next_op
            if (isinstance(later, lowp.QuantizeOp) and later.input == tokens and later.values.type == whole.values.type
                    and later.group_size == whole.group_size):
                later.values.replace_all_uses_with(whole.values)
                later.scales.replace_all_uses_with(whole.scales)
                Rewriter.erase_op(later)
            later = after


def lower_dispatch(op: moe.DispatchOp, block_tokens: SSAValue) -> tuple[list[Operation], SSAValue]:
    e = _Emitter()
    blocked = e.emit(tcp.DmaGatherOp(op.input, block_tokens), op.blocked.name_hint or "x_blocked")
    return e.ops, blocked


def decoded_weight(weight: SSAValue) -> lowp.DequantizeOp | None:
    """The dequantization `weight` is the bf16 rounding of, when only that rounding reads it
    and it decodes each expert's operands on their own (every operand but the grid has the
    experts as its first axis, one scale per expert): it can be decoded block by block."""
    cast = weight.owner
    if not (isinstance(cast, tmath.CastOp) and isinstance(element_of(weight), BFloat16Type)):
        return None
    decode = cast.input.owner
    if not isinstance(decode, lowp.DequantizeOp) or cast.input.uses.get_length() != 1:
        return None
    experts = shape_of(weight.type)[0]
    per_expert = [v for v in (decode.values, decode.scales, decode.su, decode.sv) if v is not None]
    if decode.block_shape[0] != 1 or any(shape_of(v.type)[0] != experts for v in per_expert):
        return None
    return decode


def decode_blocks(e: _Emitter, decode: lowp.DequantizeOp, expert_ids: SSAValue) -> SSAValue:
    """Each block's expert's weight decoded to bf16 [G, K, N]: its per-expert operands gathered
    (at their stored width), the dequantization and the rounding made on those."""
    def gathered(v: SSAValue | None, name: str) -> SSAValue | None:
        return None if v is None else e.emit(tcp.DmaGatherOp(v, expert_ids), name)

    values = gathered(decode.values, "w_gathered")
    scales = gathered(decode.scales, "w_scales_gathered")
    assert values is not None and scales is not None
    block = decode.block_shape if decode.block is not None else None
    real = e.emit(lowp.DequantizeOp(values, scales, block, decode.grid, gathered(decode.su, "su_gathered"),
                                    gathered(decode.sv, "sv_gathered")), "w_real")
    return e.emit(tmath.CastOp(real, TensorType(BFloat16Type(), shape_of(real.type))), "w_decoded")


def lower_grouped_matmul(op: moe.GroupedMatmulOp, plan: moe.RouteOp, rows_valid: SSAValue
                         ) -> tuple[list[Operation], SSAValue]:
    g, b, f = shape_of(op.result.type)
    e = _Emitter()
    decode = decoded_weight(op.weight)
    if decode is not None:
        weights = decode_blocks(e, decode, plan.expert_ids)
    else:
        weights = e.emit(tcp.DmaGatherOp(op.weight, plan.expert_ids), "w_gathered")
    bias = None
    if op.bias is not None:
        gathered = e.emit(tcp.DmaGatherOp(op.bias, plan.expert_ids), "bias_gathered")
        bias = e.view(gathered, [g, 1, f], "bias_blocked")
    acc = e.emit(tcp.ContractOp("gbd,gdf->gbf", op.input, weights, TensorType(f32, [g, b, f]),
                                bias=bias, guard=plan.expert_ids), "y_acc")
    masked = e.emit(ve.SelectOp(rows_valid, [1], acc, e.const(0.0, [g, b, f], f32)), "y_masked")
    return e.ops, e.to_result(masked, op.result.type, op.result.name_hint or "y_blocked")


def lower_scaled_grouped_matmul(op: moe.ScaledGroupedMatmulOp, plan: moe.RouteOp, rows_valid: SSAValue,
                                 weight_scales: SSAValue | None = None) -> tuple[list[Operation], SSAValue]:
    """As `lower_grouped_matmul`, with the weights' block scales gathered too (both at their
    stored width; the scales already gathered when `weight_scales` is given) and one
    `tcp.scaled_contract`, which applies the scales to the f32 partial sums in the chain's
    vector stage."""
    g, b, f = shape_of(op.result.type)
    e = _Emitter()
    weights = e.emit(tcp.DmaGatherOp(op.weight, plan.expert_ids), "w_gathered")
    if weight_scales is None:
        weight_scales = e.emit(tcp.DmaGatherOp(op.weight_scales, plan.expert_ids), "w_scales_gathered")
    bias = None
    if op.bias is not None:
        gathered = e.emit(tcp.DmaGatherOp(op.bias, plan.expert_ids), "bias_gathered")
        bias = e.view(gathered, [g, 1, f], "bias_blocked")
    acc = e.emit(tcp.ScaledContractOp(op.input, weights, op.input_scales, weight_scales,
                                      bias=bias, guard=plan.expert_ids), "y_acc")
    masked = e.emit(ve.SelectOp(rows_valid, [1], acc, e.const(0.0, [g, b, f], f32)), "y_masked")
    return e.ops, e.to_result(masked, op.result.type, op.result.name_hint or "y_blocked")


def widened_from(blocks: SSAValue) -> SSAValue | None:
    """The bf16 rows `blocks` widens to f32 (a `tmath.cast`), if it is such a widening: a
    combine of them gathers the bf16 rows and widens what it gathered, which it does anyway,
    rather than read rows widened whole beforehand (expert parallelism's allgather sums f32
    partial rows: the whole widened tensor was G x B x D f32, hundreds of MB at prefill)."""
    cast = blocks.owner
    if isinstance(cast, tmath.CastOp) and element_of(blocks) == f32 and isinstance(element_of(cast.input), BFloat16Type):
        return cast.input
    return None


def lower_combine(op: moe.CombineOp, plan: moe.RouteOp) -> tuple[list[Operation], SSAValue]:
    r = plan.route.type
    t, k, g, b = r.tokens.data, r.k.data, r.blocks.data, r.block.data
    d = shape_of(op.input.type)[2]
    e = _Emitter()
    rows = e.view(widened_from(op.input) or op.input, [g * b, d], "y_rows")
    restored = e.to_f32(e.emit(tcp.DmaGatherOp(rows, plan.scatter_idx), "y_restored"), "y_restored_f32")
    if op.weights is not None:
        weights = e.to_f32(op.weights, "weights_f32")
        kept = e.emit(ve.TagOp("ge", plan.scatter_idx, e.const(0, [t, k], i32)), "pair_kept")
        weights = e.emit(ve.SelectOp(kept, [1], weights, e.const(0.0, [t, k], f32)), "weights_kept")
        spread = e.emit(ve.BroadcastOp(weights, 2, d), "weights_spread")
        restored = e.emit(ve.MulOp(spread, restored), "y_weighted")  # the reference multiplies w * y
    total = e.emit(ve.ReduceSumOp(restored, 1), "y_sum")
    # The reference's accumulator starts at +0.0: the same bits except that it never ends at -0.0.
    total = e.emit(ve.AddOp(total, e.const(0.0, [t, d], f32)), "moe_out_f32")
    result = e.to_result(total, op.result.type, op.result.name_hint or "moe_out")
    # A token with no pair: zero rows, zero weights (-1 pairs are masked), a sum of zeros + 0.0.
    mark_pair_sum(result.owner)  # type: ignore[arg-type]
    return e.ops, result


@dataclass
class LowerDispatchPattern(RewritePattern):
    masks: _RowMasks = field(default_factory=_RowMasks)

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: moe.DispatchOp | moe.GroupedMatmulOp | moe.ScaledGroupedMatmulOp
                          | moe.CombineOp | moe.PairRowsOp, rewriter: PatternRewriter) -> None:
        plan = plan_of(op, op.route)
        if isinstance(op, moe.PairRowsOp):
            rewriter.replace(op, [], [plan.scatter_idx])
            return
        if isinstance(op, moe.DispatchOp):
            ops, result = lower_dispatch(op, self.masks.block_tokens(plan, rewriter))
            mark(ops, "dispatch")
        elif isinstance(op, moe.GroupedMatmulOp):
            width = shape_of(op.result.type)[2]
            ops, result = lower_grouped_matmul(op, plan, self.masks.rows_valid(plan, width, rewriter))
            mark(ops, "experts")
        elif isinstance(op, moe.ScaledGroupedMatmulOp):
            width = shape_of(op.result.type)[2]
            rows_valid = self.masks.rows_valid(plan, width, rewriter)
            scales = self.masks.early_gather(plan, op.weight_scales, "w_scales_gathered", rewriter)
            ops, result = lower_scaled_grouped_matmul(op, plan, rows_valid, scales)
            mark(ops, "experts")
        else:
            ops, result = lower_combine(op, plan)
            mark(ops, "combine")
        widening = op.input.owner if isinstance(op, moe.CombineOp) and widened_from(op.input) is not None else None
        decoding = op.weight.owner if isinstance(op, moe.GroupedMatmulOp) and decoded_weight(op.weight) is not None else None
        rewriter.replace(op, ops, [result])
        if isinstance(widening, Operation) and not widening.results[0].uses:
            rewriter.erase(widening)
        if isinstance(decoding, tmath.CastOp) and not decoding.result.uses:  # the whole decode, now made per block
            whole = decoding.input.owner
            rewriter.erase(decoding)
            assert isinstance(whole, Operation)
            rewriter.erase(whole)


@dataclass(frozen=True)
class LowerDispatchPass(ModulePass):
    """moe.dispatch / grouped_matmul / combine -> tcp DMA gathers and scatters, blockwise
    contraction and ve ops, on the plan `lower-routing` computed (see the module docstring)."""

    name = "lower-dispatch"

    quantize: str = QUANTIZE_BLOCKS
    """Where the activations of a block-scaled grouped matmul are quantized: `blocks` (each
    block's rows) or `tokens` (each token once, before the dispatch); see the module docstring."""

    def __post_init__(self) -> None:
        check_choice(self.name, "quantize", self.quantize, QUANTIZE_PLACES)

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        refuse_auto(self.name, "quantize", self.quantize, QUANTIZE_PLACES)
        check_lowered_routing(op)
        if self.quantize == QUANTIZE_TOKENS:
            quantize_tokens(op)
        PatternRewriteWalker(
            GreedyRewritePatternApplier([LowerDispatchPattern()], dce_enabled=False),
            apply_recursively=False,
        ).rewrite_module(op)
        for plan in [o for o in op.walk() if isinstance(o, moe.RouteOp)]:
            if not plan.route.uses:
                Rewriter.erase_op(plan)
