"""`lower-topk`: every `moe.topk` becomes branchless vector-engine (`ve`) ops.

The TCP cannot branch on data, so top-k is computed as ranks, not by sorting:

1. Keys. Each score becomes a signed i32 key whose integer order is the top-k order
   (docs/architecture.md#top-k-order), so the engine needs only integer compares:
   - bf16: the score's bits go to the upper 16 bits of a lane and a 16-bit index field to the
     lower 16, `0xffff - index` so that a higher field means a lower index and equal scores
     rank by lower index. Before packing, -0.0 becomes +0.0 and every NaN the bf16 pattern
     0xff81, which the comparison trick (XOR 0x7fff0000 where the packed value is negative)
     puts just below -inf. The keys of a row are distinct.
   - f32: the 32 bits themselves, -0.0 canonicalised to +0.0 and NaN to 0xff800001, then
     magnitude bits flipped for negatives (XOR 0x7fffffff), a sortable key ranked exactly (never
     rounded to bf16). Equal keys are broken by index in the compare.
   - i32: the value is the key.
   The payload the result is read from is kept apart from the canonical key: the packed raw
   bits (bf16) or the raw bits (f32, i32), so values come back bit-identical to the input,
   -0.0 and NaN payloads included, as the reference returns them.
2. Ranks, by one of two strategies:
   - `rank` (the default): all pairs. The keys are tiled to [..., E, E] and compared,
     key[j] > key[i] (or, for f32 and i32, equal with j < i), and a reduce-sum over j gives
     each element's rank, a permutation of 0..E-1. Constant depth whatever K is, with E^2
     elements per row: the branchless plan of the book's MoE chapter, section 2
     (docs/hardware.md#the-moe-chapter-of-the-book).
   - `rounds`: K rounds of reduce-max, each marking the row's maximum with its round number
     and masking it to INT_MIN (f32 and i32 keys first pick the lowest index among equal
     maxima with a reduce-min). Five ops over E elements per round (f32: nine, i32: ten),
     so far fewer elements than E^2 when K << E, but K dependent reductions in sequence.
   All-pairs ranking is the default as the book's plan, rounds the baseline to compare it with
   (docs/architecture.md#strategies); which is cheaper on the chip is the cost model's question.
3. Selection: tag rank < K and filter-compact the payload (and, for f32/i32, the index
   stream) to [..., K], which yields ascending index order (`order = "index"`). Score order
   (the default) costs one more step: the ranks of the kept elements are filtered too, and
   each kept element is placed at its rank by a K x K one-hot select and a reduce-sum
   (exact: one non-zero i32 per output). That is one extra filter over E and five (f32/i32:
   eight) ops over K*K elements per row: small next to the ranking when K << E.
4. Unpacking: bf16 values are the upper 16 bits of the packed lane (`narrow truncate`), the
   index is `0xffff - field`; f32 values are the raw bits cast back.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import BFloat16Type, Float32Type, ModuleOp, TensorType, bf16, f32, i32
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass
from xdsl.pattern_rewriter import (
    GreedyRewritePatternApplier,
    PatternRewriter,
    PatternRewriteWalker,
    RewritePattern,
    op_type_rewrite_pattern,
)

from dialects import moe, ve
from dialects.annotations import mark
from dialects.tensor_types import shape_of
from passes._auto_option import AUTO, check_choice, refuse_auto
from passes.lowering._builder import LoweringBuilder

STRATEGIES = ("rank", "rounds")
DEFAULT_STRATEGY = "rank"
"""All-pairs ranking: the TCP design's plan, constant depth in K (see the module docstring)."""
AUTO_STRATEGY = AUTO
"""`strategy=auto`: the tcpc driver costs both strategies and passes the cheaper one
(tcpc/autotune.py); the pass itself has no cost model (layering), so it refuses to run with it."""

INT_MIN = -(2**31)
BF16_NAN_KEY_BITS = 0xFF810000
"""Canonical bf16 NaN (in the upper half): after the comparison trick its key is 0x807e....,
just below -inf's 0x807f...., and never INT_MIN, which the rounds strategy uses as a mask."""
F32_NAN_BITS = 0xFF800001
"""Canonical f32 NaN: its key 0x807ffffe is just below -inf's 0x807fffff and above INT_MIN."""
INDEX_FIELD = 0xFFFF
MAX_EXPERTS = 1 << 16
"""The 16-bit index field holds 0xffff - index for index < 65536; a longer bf16 axis is
ranked like f32, by its exact widening."""


@dataclass
class _Keys:
    """What the ranking and the selection need to know about one top-k's scores."""

    key: SSAValue
    """i32 [..., E]: a larger key ranks first."""
    payload: SSAValue
    """i32 [..., E]: what selection carries to the output (packed raw bits, or raw bits)."""
    packed: bool
    """The index is in the key (bf16): keys are distinct and the payload holds the index."""
    above_min: bool
    """No key is INT_MIN, so a key masked to INT_MIN never ties a live one."""
    index: SSAValue
    """i32 [..., E]: each element's position along the last axis."""


def _flip_negatives(b: LoweringBuilder, x: SSAValue, mask: int, name: str) -> SSAValue:
    """x ^ mask where x < 0, else x, branchless: the sign smeared by an arithmetic shift
    selects the mask (the comparison trick)."""
    sign = b.binary(ve.ShrSOp, x, 31)
    return b.binary(ve.XorOp, x, b.binary(ve.AndOp, sign, mask), name)


def _canonical(b: LoweringBuilder, bits: SSAValue, nan_bits: int) -> SSAValue:
    """-0.0 as +0.0 and every NaN as `nan_bits`, on float bits in an i32 lane."""
    magnitude = b.binary(ve.AndOp, bits, 0x7FFFFFFF)
    is_nan = b.tag("gt", magnitude, 0x7F800000, "is_nan")
    is_neg_zero = b.tag("eq", bits, INT_MIN, "is_neg_zero")
    zeroed = b.select(is_neg_zero, 0, bits)
    return b.select(is_nan, nan_bits, zeroed, "canonical")


def _keys(b: LoweringBuilder, x: SSAValue) -> _Keys:
    t = x.type
    assert isinstance(t, TensorType)
    shape = shape_of(t)
    element = t.get_element_type()
    index = b.iota(shape, len(shape) - 1, "index")
    if isinstance(element, BFloat16Type) and shape[-1] <= MAX_EXPERTS:
        bits = b.bitcast(b.emit(ve.WidenOp(x, TensorType(f32, list(shape)))), i32, "bits")
        field = b.binary(ve.XorOp, index, INDEX_FIELD, "field")
        packed = b.binary(ve.OrOp, bits, field, "packed")
        canonical = b.binary(ve.OrOp, _canonical(b, bits, BF16_NAN_KEY_BITS), field)
        key = _flip_negatives(b, canonical, 0x7FFF0000, "key")
        return _Keys(key, packed, packed=True, above_min=True, index=index)
    if isinstance(element, BFloat16Type | Float32Type):
        # bf16 beyond the 16-bit index field is ranked by its exact f32 widening.
        lanes = b.emit(ve.WidenOp(x, TensorType(f32, list(shape)))) if isinstance(element, BFloat16Type) else x
        bits = b.bitcast(lanes, i32, "bits")
        key = _flip_negatives(b, _canonical(b, bits, F32_NAN_BITS), 0x7FFFFFFF, "key")
        return _Keys(key, bits, packed=False, above_min=True, index=index)
    return _Keys(x, x, packed=False, above_min=False, index=index)


def _ranks_all_pairs(b: LoweringBuilder, keys: _Keys, shape: tuple[int, ...]) -> SSAValue:
    """rank[i] = #{j : key[j] > key[i], or key[j] == key[i] and j < i}."""
    r, e = len(shape), shape[-1]
    mine = b.broadcast(keys.key, r, e, "key_i")  # [..., i, j] = key[i]
    theirs = b.broadcast(keys.key, r - 1, e, "key_j")  # [..., i, j] = key[j]
    above = b.tag("gt", theirs, mine, "beats")
    if keys.packed:
        beats = b.select(above, 1, 0)
    else:
        pairs = (*shape, e)
        earlier = b.tag("lt", b.iota(pairs, r), b.iota(pairs, r - 1), "earlier")
        tie_wins = b.select(b.tag("eq", theirs, mine, "ties"), b.select(earlier, 1, 0), 0)
        beats = b.select(above, 1, tie_wins)
    return b.reduce(ve.ReduceSumOp, beats, r, "rank")


def _ranks_rounds(b: LoweringBuilder, keys: _Keys, shape: tuple[int, ...], k: int) -> SSAValue:
    """rank[i] = the round that picked i, or K if no round did."""
    axis, e = len(shape) - 1, shape[-1]
    rank = b.const(k, shape)
    live = keys.key
    index = available = keys.index
    for n in range(k):
        best = b.broadcast(b.reduce(ve.ReduceMaxOp, live, axis), axis, e, f"max{n}")
        if keys.packed:
            hit = b.tag("eq", live, best, f"hit{n}")
        else:  # the lowest index among the maxima
            ties = b.tag("eq", live, best, f"ties{n}")
            first = b.reduce(ve.ReduceMinOp, b.select(ties, available, e), axis)
            hit = b.tag("eq", index, b.broadcast(first, axis, e), f"hit{n}")
        rank = b.select(hit, n, rank, "rank")
        if n + 1 < k:
            live = b.select(hit, INT_MIN, live, "live")
            if not keys.above_min:
                available = b.select(hit, e, available, "available")
    return rank


def _place_by_rank(b: LoweringBuilder, streams: list[SSAValue], rank: SSAValue, k: int) -> list[SSAValue]:
    """out[p] = stream[m] where rank[m] == p, for ranks that are a permutation of 0..K-1."""
    r = len(shape_of(rank.type))
    square = (*shape_of(rank.type), k)
    place = b.tag("eq", b.broadcast(rank, r, k), b.iota(square, r), "place")
    return [
        b.reduce(ve.ReduceSumOp, b.select(place, b.broadcast(s, r, k), 0), r - 1, "ordered")
        for s in streams
    ]


def lower_topk(op: moe.TopKOp, strategy: str) -> tuple[list[Operation], SSAValue, SSAValue]:
    """The `ve` ops that compute `op`'s values and indices."""
    b = LoweringBuilder()
    t = op.input.type
    assert isinstance(t, TensorType)
    shape = shape_of(t)
    axis, k = len(shape) - 1, op.k.value.data
    keys = _keys(b, op.input)
    if strategy == "rounds":
        rank = _ranks_rounds(b, keys, shape, k)
    else:
        rank = _ranks_all_pairs(b, keys, shape)
    chosen = b.tag("lt", rank, k, "chosen")
    streams = [(keys.payload, "top_packed")] if keys.packed else [(keys.payload, "top_values"), (keys.index, "top_index")]
    tops = [b.filter(s, chosen, axis, k, name) for s, name in streams]
    if op.order_name == "score":
        tops = _place_by_rank(b, tops, b.filter(rank, chosen, axis, k, "top_rank"), k)
    element = t.get_element_type()
    if keys.packed:
        lanes = tops[0]
        indices = b.binary(ve.XorOp, b.binary(ve.AndOp, lanes, INDEX_FIELD), INDEX_FIELD)
    else:
        lanes, indices = tops
    values = lanes if element == i32 else b.bitcast(lanes, f32)
    if isinstance(element, BFloat16Type):
        values = b.emit(ve.NarrowOp(values, TensorType(bf16, [*shape[:-1], k]), truncate=True))
    return b.ops, values, indices


@dataclass
class LowerTopKPattern(RewritePattern):
    strategy: str

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: moe.TopKOp, rewriter: PatternRewriter) -> None:
        ops, values, indices = lower_topk(op, self.strategy)
        mark(ops, "router")
        values.name_hint, indices.name_hint = op.values.name_hint, op.indices.name_hint
        rewriter.replace(op, ops, [values, indices])


@dataclass(frozen=True)
class LowerTopKPass(ModulePass):
    """moe.topk -> ve ops. `strategy=rank` (default): all-pairs ranking; `strategy=rounds`:
    K rounds of max-reduce and masking. Same results, bit for bit."""

    name = "lower-topk"
    strategy: str = DEFAULT_STRATEGY
    """`rank` (the default): all-pairs ranking; `rounds`: K rounds of max-reduce and masking;
    `auto`: the cost model's choice, which tcpc compile and tcpc run make before the pass runs."""

    def __post_init__(self) -> None:
        check_choice(self.name, "strategy", self.strategy, STRATEGIES)

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        refuse_auto(self.name, "strategy", self.strategy, STRATEGIES)
        PatternRewriteWalker(
            GreedyRewritePatternApplier([LowerTopKPattern(self.strategy)]), apply_recursively=False
        ).rewrite_module(op)
