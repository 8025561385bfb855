"""shard-experts: the graph-level MoE layer as one SPMD function every chip of a mesh runs.

`shard-experts{ep=8}` (or `dp=2 ep=4`, `ep=4 tp=2`, `strategy=allgather`) rewrites the graph
with one `moe.scatter` into the program of one chip. The mesh's chips split the tokens (T / (dp * ep)
each, the chip's `[T/n, ...]` share of every argument that carries tokens: the scatter's input
and the routing arguments); the ep axis splits the experts (E / ep each: the `[E/ep, ...]` share
of every expert weight and bias); everything else (router, shared expert) is replicated. Every
op on tokens keeps its meaning on the chip's tokens; only the MoE ops change:

`strategy=a2a` (DeepEP; seed 001): `ccl.a2a_plan` gives each (token, choice) pair its slot in a
static per-destination buffer (the chip owning its expert, S slots each, S the exact worst
case `ccl.a2a_slots`); `ccl.a2a_tokens` deduplicates: a DMA row scatter packs each token once
per destination chip, and `ccl.all_to_all` sends the tokens, each with the list of its pairs
bound for that chip (`ccl.a2a_token_lists`: local experts and weights, in k order), to the
owning chips, each of which routes the tokens it received with an ordinary `moe.scatter` of
[chips * T/n] tokens with min(K, E/ep) choices each over its E/ep experts (pairs arrive in
source-chip order, token-major within a source: the global token-major order, so a capacity
drops exactly what one chip drops; without one a source's whole tokens first, below, which moves
rows within a block and no bits) and runs the blockwise experts. `ccl.a2a_returns` tells
which tokens are *whole* (all kept pairs on one chip; balanced routing at real sizes) and which
*split*: the receiver's `moe.combine` over its received tokens' lists sums every token's
weighted rows straight from the blocks, over k in order from +0.0 in f32, rounded once, which
for a whole token is what `moe.combine` does on one chip, and sends one row back per whole
token it received (without a capacity the plan ranks a destination's whole tokens first,
`whole_first`, so they are the head of each slice); a split token's pairs' rows are gathered
from the blocks (`moe.pair_rows`: where each listed pair sits) and come back one row each, and the home
chip takes their weighted sum over k in order, adding the whole tokens' rows (zero for a
split token) in place of + 0.0. The result is bit-identical to one chip's, and at balanced
routing the return is one row per token and chip. With `waves` the split pairs go back in
several all-to-alls, one per range of the receiver's experts, each tagged with the receiver's
blocks that can hold its pairs (`ccl.wave_blocks`), after which schedule-level return-waves
issues it; the home adds the waves' rows (each pair's is zero in all waves but one). With sp
or tp the receiver routes per-pair slots instead (each token copied to its slots there by a DMA gather), makes one row per slot
(tp sums those rows, not the padded blocks, over the tp chips) and every pair's row comes back.

`strategy=a2a_sum` (seed 001's "local reduction"; DeepEP's combine takes one row per received
token): the dispatch and the receiver's routing as a2a's, and its `moe.combine` takes each
token's weighted sum over its pairs there in f32 and rounds it to the output's type (bf16);
it sends back one such row per token (as a2a does), and the home chip adds the chips' rows in
chip order in f32 and rounds once. A token whose pairs all sit on one
chip gets one chip's bits (the one rounding is the receiver's); otherwise the sum over k is
regrouped by chip and each chip's part rounded before the sum (within
runtime_sim/semantics/tolerance.py's bound and its RECEIVER_SUM_SCALE). With tp the blocks' partial sums are added over the tp chips before the combine, as
allgather does.

`strategy=allgather` (seed 000): every chip gathers the group's tokens, expert choices and
weights (`ccl.all_gather`), routes them to its own experts (another chip's expert becomes -1,
a pair `moe.scatter` drops), computes its experts' part of every token's weighted sum in f32,
and `ccl.reduce_scatter` adds the chips' parts in chip order and hands each chip its tokens. The
sum over k is regrouped by chip, so the result may differ from one chip's in the last bit
(within runtime_sim/semantics/tolerance.py's bound).

`tp=P` (either strategy) splits every expert over the P chips of a tp group, which share their
tokens: the gate and up projections (grouped_matmuls of the scattered tokens) keep the chip's
F columns, the ops on them stay per column, and the down projection (the grouped_matmul over
F) gives the chip's f32 partial sum over its F rows, its bias added on the first tp chip only.
The tp chips add the partial sums in chip order in f32 and the sum is rounded once, where one
chip rounds the down projection: a2a sums the received slots' rows (the `rows` that hold a
pair) after the unweighted combine, each tp chip its 1/tp of their columns
(`ccl.reduce_scatter` along them), which it returns and weighs alone before `ccl.all_gather`
puts the outputs' columns together; allgather sums the blocks (`ccl.all_reduce`). The regrouped sum
over F may round an expert output to the neighbouring bf16 value: tolerance.py's TP_SCALE.

`sp=S` (a2a, a2a_sum; seed 001's TP columns) makes the ep chips of one sp coordinate one
all-to-all group (a column) of an ep x sp grid: every chip holds its own T / (dp * ep * sp)
tokens and E / (ep * sp) experts (column j the E / sp experts [j * E/sp, (j + 1) * E/sp)). The
MoE's dispatch first all-gathers the tokens, their choices and weights over sp (the row's
tokens, in token order), keeps the pairs of its column's experts (the others become -1, no
pair) and runs the strategy over ep on them; the home sum stays f32 and `ccl.reduce_scatter`
over sp adds the columns' parts in chip order and hands each chip its own tokens, rounded once.
Everything outside the MoE ops (router, shared expert) runs on the chip's own tokens. The sum
over k is regrouped by column, as allgather's by chip (the same tolerance). `sp_sum=bf16` rounds
each column's f32 sum to the output's type (bf16) before the reduce-scatter, as seed 001's bf16
reduce-scatter does: half the bytes of its largest transfer, for one more rounding of a token's
part (runtime_sim/semantics/tolerance.py's RECEIVER_SUM_SCALE, as a2a_sum's). At decode sp's
all-gathers and reduce-scatter are `direct` (one step, each chip sending its share to every other
chip, where the ring takes sp - 1 steps: `_Layer.sp_direct`).

Errors (PassFailedException): no or several scatters, E, T or F that the mesh does not divide,
allgather with fewer experts per chip than K (its local routing keeps a token's K choices),
a token tensor whose first axis is reduced, an expert's hidden values whose F axis is reduced,
a down projection that does not feed the combine (with tp), expert weights that are not
function arguments.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ArrayAttr, DictionaryAttr, IntegerAttr, ModuleOp, StringAttr, TensorType, f32, i1, i32, i64
from xdsl.ir import Attribute, Block, BlockArgument, Operation, Region, SSAValue
from xdsl.passes import ModulePass
from xdsl.utils.exceptions import PassFailedException

from dialects import ccl, moe, tcp, tile, tmath
from dialects.annotations import PHASE_ATTR, mark_pair_sum, place_in_hbm, routing_arguments
from dialects.tensor_types import shape_of, stored_bytes
from passes._loop_builder import index_constant
from passes.schedule.split_clusters import PREFILL_PAIRS_PER_EXPERT
from target.target_spec import machine_of

STRATEGIES = ("a2a", "a2a_sum", "allgather")
CHUNKED_STRATEGIES = ("a2a", "a2a_sum")
"""The strategies whose token loop can be split into chunks (`chunks`): allgather's dispatch
and reduction are over the whole group's tokens."""
SP_SUMS = ("f32", "bf16")
"""How a column's sum crosses sp's reduce-scatter (`sp_sum`): f32, rounded once after it (the
default), or rounded to the output's type before it (seed 001's bf16 reduce-scatter)."""
CHUNK_STAGES = ("gather", "dispatch", "receive", "experts", "combine", "home", "output")
"""A chunk's stages, in its own order: its rows sliced (and with sp all-gathered); the
dispatch's plan and all-to-alls started; their completion and the receiver's routing; the
experts; the receiver's combine and the return started; its completion and the home chip's
sum (with sp reduce-scattered); the sum stored into the output."""
DP = "dp"
EP = "ep"
SP = "sp"
TP = "tp"


def _fail(message: str) -> PassFailedException:
    return PassFailedException(f"shard-experts: {message}")


def _with_rows(t: Attribute, rows: int) -> Attribute:
    assert isinstance(t, TensorType)
    return TensorType(t.get_element_type(), [rows, *shape_of(t)[1:]])


def _with_axis(t: Attribute, axis: int, size: int) -> Attribute:
    assert isinstance(t, TensorType)
    shape = list(shape_of(t))
    shape[axis] = size
    return TensorType(t.get_element_type(), shape)


class _Builder:
    """Ops of the chip's function, in order, and the map from the graph's values to them."""

    def __init__(self, block: Block, cluster_sram_bytes: int):
        self.block = block
        self.cluster_sram_bytes = cluster_sram_bytes
        """One cluster's SRAM on the target: what a buffer larger than goes to HBM."""
        self.values: dict[SSAValue, SSAValue] = {}
        self.rows: dict[SSAValue, tuple[int, int]] = {}
        """New value -> (rows in the graph, rows on the chip) of its first axis, for values
        whose first axis is tokens or blocks that the sharding resized."""
        self.columns: dict[SSAValue, tuple[int, int]] = {}
        """New value -> (F, F/tp) of its last axis, for an expert's hidden values that tensor
        parallelism splits over F."""

    phase: str | None = None
    """The `tcpc.phase` given to the ccl, tcp and tmath ops added (dispatch, combine): the
    lowering keeps it, so the report puts the combine's weighted sum under combine, not router."""

    def add(self, op: Operation, name: str | None = None) -> Operation:
        if self.phase is not None and op.name.startswith(("ccl.", "tcp.", "tmath.")):
            op.attributes[PHASE_ATTR] = StringAttr(self.phase)
        self.block.add_op(op)
        if name is not None and len(op.results) == 1:
            op.results[0].name_hint = name
        return op

    def value(self, v: SSAValue) -> SSAValue:
        return self.values[v]

    stages: dict[str, Block] | None = None
    """While the chunked pipeline emits one chunk: a block per stage (CHUNK_STAGES), which
    `to_stage` switches between, for the pipeline to interleave the chunks' stages; None:
    every op goes to `block` in the order it is made."""

    def to_stage(self, stage: str) -> None:
        if self.stages is not None:
            self.block = self.stages[stage]

    def start(self, op: ccl.AllToAllStartOp, name: str) -> SSAValue:
        """An all-to-all started (its buffers in HBM when larger than a cluster's SRAM)."""
        return self.add(in_hbm_if_oversize(op, self.cluster_sram_bytes), name).results[0]

    def done(self, started: SSAValue) -> SSAValue:
        """The all-to-all `started` completed, here: its received rows."""
        return self.add(ccl.AllToAllDoneOp(started), f"{started.name_hint}_done").results[0]

    def const(self, value: int | float, element: Attribute) -> SSAValue:
        return self.add(tmath.ConstantOp(value, TensorType(element, []))).results[0]

    def reshape(self, x: SSAValue, shape: list[int], name: str | None = None) -> SSAValue:
        if shape_of(x.type) == tuple(shape):
            return x
        t = TensorType(x.type.get_element_type(), shape)  # type: ignore[attr-defined]
        return self.add(tmath.ReshapeOp(x, t), name).results[0]

    def cast(self, x: SSAValue, element: Attribute, name: str | None = None) -> SSAValue:
        if x.type.get_element_type() == element:  # type: ignore[attr-defined]
            return x
        return self.add(tmath.CastOp(x, TensorType(element, shape_of(x.type))), name).results[0]

    def copy(self, op: Operation) -> None:
        """`op` on the chip's values: a first axis the sharding resized stays resized, and so
        does a last axis split over F."""
        if op.regions:
            raise _fail(f"{op.name}: ops with regions are not supported")
        operands = [self.value(v) for v in op.operands]
        types = list(op.result_types)
        change = self._resized(op, operands, self.rows, "first axis", "reduces or reshapes away the first axis of a "
                               "sharded tensor ({old} rows in the graph, {new} per chip): it cannot run on a shard")
        if change is not None and change[0] != change[1]:
            types = [_with_rows(t, change[1]) if isinstance(t, TensorType) and shape_of(t)[:1] == (change[0],) else t
                     for t in types]
        split = self._resized(op, operands, self.columns, "F axis", "reduces or reshapes away the F axis an expert's "
                              "hidden values split over tp ({old} in the graph, {new} per chip)")
        if split is not None:
            types = [_with_axis(t, -1, split[1]) if isinstance(t, TensorType) and shape_of(t)[-1:] == (split[0],) else t
                     for t in types]
        new_op = type(op).create(operands=operands, result_types=types, properties=dict(op.properties),
                                 attributes=dict(op.attributes), location=op.location)
        self.add(new_op)
        for old_r, new_r in zip(op.results, new_op.results):
            new_r.name_hint = old_r.name_hint
            self.values[old_r] = new_r
            if change is not None and (shape_of(new_r.type)[:1] != shape_of(old_r.type)[:1] or change[0] == change[1]):
                self.rows[new_r] = change
            if split is not None and shape_of(new_r.type)[-1:] != shape_of(old_r.type)[-1:]:
                self.columns[new_r] = split

    def _resized(self, op: Operation, operands: list[SSAValue], table: dict[SSAValue, tuple[int, int]], axis: str,
                 lost: str) -> tuple[int, int] | None:
        """How `op`'s operands were resized along one axis (None: not at all); an op that mixes
        two resizings, or whose results lose the resized axis, cannot run on the chip."""
        found = {table[v] for v in operands if v in table}
        if len(found) > 1:
            raise _fail(f"{op.name} mixes tensors resized in different ways along the {axis}")
        change = next(iter(found), None)
        if change is None or change[0] == change[1]:
            return change
        index = 0 if axis == "first axis" else -1
        if not any(isinstance(t, TensorType) and shape_of(t)[index:][:1] == (change[0],) for t in op.result_types):
            raise _fail(f"{op.name} " + lost.format(old=change[0], new=change[1]))
        return change



def token_sources(scatter: moe.ScatterOp) -> set[int]:
    """The indices of the function arguments the scattered tokens are computed from (the tokens
    themselves, or per-token values such as Llama-4's router score scaling them): every value
    on the way has the T tokens as its first axis (a matmul's tokens are its left operand; an
    elementwise operand of lower rank broadcasts along other axes), so each chip computes its
    own tokens' rows."""
    t = scatter.route.type.tokens.data
    found: set[int] = set()
    todo, seen = [scatter.input], set()
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        if isinstance(v, BlockArgument):
            found.add(v.index)
            continue
        op = v.owner
        assert isinstance(op, Operation)
        rank = len(shape_of(v.type))
        operands = [op.operands[0]] if isinstance(op, tmath.MatmulOp) else list(op.operands)
        todo += [u for u in operands if isinstance(u.type, TensorType) and shape_of(u.type)[:1] == (t,)
                 and (len(operands) == 1 or len(shape_of(u.type)) == rank)]
    return found


def in_hbm_if_oversize(op: Operation, cluster_sram_bytes: int) -> Operation:
    """`op` placed in HBM when its result takes more than half a cluster's SRAM: a2a's
    worst-case send and receive buffers (T x min(K, E/N) rows for every chip) and the gather
    of the received rows into slots, at prefill. Only the DMA engines and the link read them
    (the slots' rows by DMA gathers, the buffers by the all-to-all, which moves HBM to HBM
    across chips), so they need no SRAM; the memory plan would otherwise stream them through
    it, or, at a whole cluster's SRAM, spill everything else around them (the split pairs'
    return buffer on ep chips in ep chunks is exactly 128 MB at Qwen3-30B-A3B's 4,096 tokens a
    chip: a2a on 2 chips, 2 chunks, took 3,496.0 us against 1,919.5 with it in HBM)."""
    if 2 * stored_bytes(op.results[0].type) > cluster_sram_bytes:
        place_in_hbm(op)
    return op

@dataclass
class _Layer:
    """The graph's MoE ops and the sizes of the sharding."""

    scatter: moe.ScatterOp
    route: moe.RouteType
    ep: int
    chips: int
    """Token shards: dp * ep (the tp chips of a group share their tokens)."""
    tp: int = 1
    hidden: int = 0
    """F, the experts' hidden width that tp splits (0 without tp)."""
    dp: int = 1
    chunks: int = 1
    """The chip's tokens are dispatched, computed and combined in this many chunks."""
    sp: int = 1
    """Chips of the sp axis (the module docstring): `chips` counts them among the token shards."""
    sp_sum: str = "f32"
    """The type a column's sum crosses sp's reduce-scatter in (SP_SUMS)."""
    waves: int = 1
    """a2a's split pairs go back in this many waves, by the receiver's experts (`_A2A.combine`)."""

    @property
    def tokens(self) -> int:
        """The tokens one chunk dispatches: the chip's (all of them without chunks), with sp the
        sp group's, all-gathered."""
        return self.route.tokens.data // (self.chips // self.sp) // self.chunks

    @property
    def own_tokens(self) -> int:
        """The tokens of one chunk of the chip's own (before sp's all-gather)."""
        return self.tokens // self.sp

    @property
    def sp_direct(self) -> bool:
        """Whether sp's all-gathers and reduce-scatter go in one step (`ccl._GatherOrScatter`'s
        `direct`) rather than the ring's sp - 1: at decode (fewer than PREFILL_PAIRS_PER_EXPERT pairs
        an expert in a chunk), where each is latency-bound (DeepSeek-V3 on ep=16,sp=8 at 4 tokens a
        chip: the tokens' all-gather 27.4 -> 15.4 us, the expert ids' 14.0 -> 2.0). The prefill rows'
        are bandwidth-bound: the ring's latency is a few percent of them."""
        pairs = self.route.tokens.data * self.route.k.data // self.route.experts.data // self.chunks
        return pairs < PREFILL_PAIRS_PER_EXPERT

    @property
    def experts(self) -> int:
        """The experts one all-to-all group (the ep chips of an sp coordinate) holds."""
        return self.route.experts.data // self.sp

    @property
    def experts_per_chip(self) -> int:
        return self.experts // self.ep

    def column_parallel(self, op: moe.GroupedMatmulOp) -> bool:
        """A grouped_matmul of the scattered tokens (gate, up): with tp its F columns split."""
        return op.input == self.scatter.results[0]


@dataclass(frozen=True)
class ShardExpertsPass(ModulePass):
    """Shard the MoE layer of every function over a mesh of `dp * ep * tp` chips (see the
    module docstring); `strategy` is `a2a`, `a2a_sum` or `allgather`."""

    name = "shard-experts"

    ep: int = 1
    """Chips of the expert-parallel axis: each holds E / ep of the experts."""
    dp: int = 1
    """Chips of the data-parallel axis: the tokens are split over all dp * ep chips, the experts
    over the ep chips of each group only."""
    tp: int = 1
    """Chips of the tensor-parallel axis: each holds F / tp of every expert's hidden columns,
    the partial sums added over them."""
    strategy: str = "a2a"
    """How tokens reach their experts' chips: `a2a`, `a2a_sum` or `allgather` (the module
    docstring compares them)."""
    chunks: int = 1
    """Split the chip's tokens into this many chunks whose dispatch, experts and combine are
    software-pipelined (a2a, a2a_sum; the module docstring)."""
    sp: int = 1
    """Chips of the sp axis: each holds its own tokens and E / (ep * sp) experts; the tokens are
    all-gathered over sp before the all-to-all over ep and the outputs reduce-scattered back
    (a2a, a2a_sum; the module docstring)."""
    sp_sum: str = "f32"
    """With sp: `f32`, the columns' f32 sums added over sp and rounded once, or `bf16`, each
    column's sum rounded to the output's type before it crosses (half the bytes; the module
    docstring gives its tolerance)."""
    waves: int = 1
    """a2a without tp, sp, chunks or a capacity: the split pairs' rows go back in this many
    all-to-alls under the expert loop, one per equal range of the receiver's experts whose blocks
    can end before the loop's last, and one of the rest after it (`_A2A._wave_ends`), each issued
    once the blocks of its experts are computed (schedule-level return-waves)."""

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        if self.strategy not in STRATEGIES:
            raise _fail(f"unknown strategy '{self.strategy}' (expected {', '.join(STRATEGIES)})")
        if self.ep < 1 or self.dp < 1 or self.tp < 1 or self.chunks < 1 or self.sp < 1:
            raise _fail(f"ep, dp, sp, tp and chunks must be positive (ep={self.ep}, dp={self.dp}, sp={self.sp}, "
                        f"tp={self.tp}, chunks={self.chunks})")
        if self.sp > 1 and (self.strategy not in CHUNKED_STRATEGIES or self.tp > 1):
            raise _fail(f"sp = {self.sp} gathers the tokens for an all-to-all over ep: it takes strategy "
                        f"{' or '.join(CHUNKED_STRATEGIES)} without tp (got strategy={self.strategy}, tp={self.tp})")
        if self.sp_sum not in SP_SUMS:
            raise _fail(f"unknown sp_sum '{self.sp_sum}' (expected {', '.join(SP_SUMS)})")
        if self.sp_sum != "f32" and self.sp == 1:
            raise _fail(f"sp_sum = {self.sp_sum} rounds the columns' sums of sp's reduce-scatter: it needs sp > 1")
        if self.waves < 1 or (self.waves > 1 and (self.strategy != "a2a" or self.tp > 1 or self.sp > 1
                                                  or self.chunks > 1)):
            raise _fail(f"waves = {self.waves}: a2a returns its split pairs in waves, without tp, sp or chunks "
                        f"(got strategy={self.strategy}, tp={self.tp}, sp={self.sp}, chunks={self.chunks})")
        if self.chunks > 1 and self.strategy not in CHUNKED_STRATEGIES:
            raise _fail(f"chunks = {self.chunks}: only {' and '.join(CHUNKED_STRATEGIES)} split the token loop "
                        f"into chunks, not {self.strategy}")
        for fn in [o for o in op.ops if isinstance(o, func.FuncOp)]:
            if fn.body.blocks.first is not None:
                self._shard(fn)

    def _layer(self, fn: func.FuncOp) -> _Layer:
        scatters = [o for o in fn.walk() if isinstance(o, moe.ScatterOp)]
        if len(scatters) != 1:
            raise _fail(f"@{fn.sym_name.data} has {len(scatters)} moe.scatter ops; sharding needs exactly one")
        scatter = scatters[0]
        if any(isinstance(o, moe.ScaledGroupedMatmulOp) for o in fn.walk()):
            raise _fail(f"@{fn.sym_name.data}'s experts are block-scaled (moe.scaled_grouped_matmul: fp8, MXFP4 "
                        f"weights), which do not shard over a mesh yet; run the layer on one chip, or with bf16 "
                        f"expert weights on the mesh")
        route = scatter.route.type
        t, e = route.tokens.data, route.experts.data
        chips = self.dp * self.ep * self.sp
        if e % self.ep:
            raise _fail(f"E = {e} experts do not divide over ep = {self.ep} chips")
        if self.sp > 1 and e % (self.ep * self.sp):
            raise _fail(f"E = {e} experts do not divide over ep * sp = {self.ep * self.sp} chips")
        if t % chips:
            raise _fail(f"T = {t} tokens do not divide over {'dp * ep * sp' if self.sp > 1 else 'dp * ep'} = "
                        f"{chips} chips")
        if self.sp > 1 and route.capacity_limit is not None:
            raise _fail(f"sp = {self.sp} with a capacity: an expert keeps its first C pairs over all tokens, "
                        "which the columns' all-to-alls do not count together; drop the capacity or sp")
        k = route.k.data
        if self.strategy == "allgather" and e // self.ep < k:
            raise _fail(f"strategy=allgather routes each token's K = {k} choices to the chip's own experts, "
                        f"but E = {e} experts over ep = {self.ep} chips leave {e // self.ep} per chip, fewer than K; "
                        "use strategy=a2a or a2a_sum (they send a token's pairs, at most E/ep of them, to each chip), "
                        "or a smaller ep")
        if self.chunks > 1:
            if (t // chips) % self.chunks:
                raise _fail(f"T / {'(dp * ep * sp)' if self.sp > 1 else '(dp * ep)'} = {t // chips} tokens per "
                            f"chip do not divide into {self.chunks} chunks")
            if route.capacity_limit is not None:
                raise _fail(f"chunks = {self.chunks} with a capacity: an expert keeps its first C pairs over all "
                            "tokens, which a chunk's receiver cannot count; use chunks=1")
        if self.waves > 1 and (route.capacity_limit is not None or self.waves > e // self.ep):
            raise _fail(f"waves = {self.waves}: each wave takes some of a chip's {e // self.ep} experts' pairs, "
                        "all of them without a capacity")
        layer = _Layer(scatter, route, self.ep, chips, self.tp, dp=self.dp, chunks=self.chunks, sp=self.sp,
                       sp_sum=self.sp_sum, waves=self.waves)
        if self.tp > 1:
            layer.hidden = self._hidden(fn, layer)
        return layer

    def _hidden(self, fn: func.FuncOp, layer: _Layer) -> int:
        """F, checked to divide over tp; the experts must end in one grouped_matmul over F
        that feeds the combine (its partial sums are added over the tp chips there)."""
        matmuls = [o for o in fn.walk() if isinstance(o, moe.GroupedMatmulOp)]
        widths = {shape_of(o.weight.type)[2] for o in matmuls if layer.column_parallel(o)}
        down = [o for o in matmuls if not layer.column_parallel(o)]
        if len(widths) != 1 or len(down) != 1:
            raise _fail(f"tp splits F: it needs grouped_matmuls of the scattered tokens to one width F "
                        f"(found {sorted(widths)}) and one grouped_matmul over F (found {len(down)})")
        uses = list(down[0].result.uses)
        if len(uses) != 1 or not isinstance(uses[0].operation, moe.CombineOp):
            raise _fail("with tp, the down projection (the grouped_matmul over F) must feed the combine directly: "
                        "its partial sums are added over the tp chips there")
        f = widths.pop()
        if f % self.tp:
            raise _fail(f"F = {f} does not divide over tp = {self.tp} chips")
        return f

    def _token_arguments(self, fn: func.FuncOp, layer: _Layer) -> set[int]:
        """The arguments the scattered tokens are computed from (`token_sources`) and the
        routing arguments."""
        t = layer.route.tokens.data
        found = token_sources(layer.scatter)
        if not found:
            raise _fail("the tokens scattered to the experts must be computed from a function argument "
                        f"with the T = {t} tokens as its first axis")
        return {*found, *routing_arguments(fn)}

    def _expert_arguments(self, fn: func.FuncOp, layer: _Layer) -> dict[int, int | None]:
        """Expert-sharded argument -> the axis tp splits too (None: only the experts split):
        a gate or up weight's F columns (axis 2) and its bias's (axis 1), a down weight's F
        rows (axis 1); a down projection's bias [E, D] is whole on every tp chip."""
        found: dict[int, int | None] = {}
        for gm in [o for o in fn.walk() if isinstance(o, moe.GroupedMatmulOp)]:
            column = layer.column_parallel(gm)
            for v, axis in ((gm.weight, 2 if column else 1), (gm.bias, 1 if column else None)):
                if v is None:
                    continue
                if not isinstance(v, BlockArgument):
                    raise _fail("expert weights and biases must be function arguments (each chip holds its own)")
                found[v.index] = axis if self.tp > 1 else None
        return found

    def _shard(self, fn: func.FuncOp) -> None:
        layer = self._layer(fn)
        old_block = fn.body.blocks.first
        assert old_block is not None
        tokens = self._token_arguments(fn, layer)
        experts = self._expert_arguments(fn, layer)
        t, tl = layer.route.tokens.data, layer.route.tokens.data // layer.chips
        el = layer.experts_per_chip
        arg_types = []
        for a in old_block.args:
            if a.index in experts:
                split = experts[a.index]
                arg_type = _with_rows(a.type, el)
                if split is not None:
                    arg_type = _with_axis(arg_type, split, shape_of(arg_type)[split] // self.tp)
                arg_types.append(arg_type)
            elif a.index in tokens:
                arg_types.append(_with_rows(a.type, tl))
            else:
                arg_types.append(a.type)
        block = Block(arg_types=arg_types)
        b = _Builder(block, machine_of(fn).cluster_sram_bytes)
        for old, new in zip(old_block.args, block.args):
            new.name_hint = old.name_hint
            b.values[old] = new
            if old.index in tokens:
                b.rows[new] = (t, tl)
        strategy = {"a2a": _A2A, "a2a_sum": _A2ASum, "allgather": _AllGather}[self.strategy]
        emit = strategy(b, layer)
        section = _expert_section(layer.scatter) if layer.chunks > 1 else set()
        for op in old_block.ops:
            if op in section:
                continue  # emitted chunk by chunk at the combine
            if isinstance(op, moe.CombineOp) and section:
                _emit_chunks(b, layer, strategy, [o for o in old_block.ops if o in section], op)
            elif op is layer.scatter:
                emit.scatter(op)
            elif isinstance(op, moe.GroupedMatmulOp):
                emit.grouped_matmul(op)
            elif isinstance(op, moe.CombineOp):
                emit.combine(op)
            elif isinstance(op, func.ReturnOp):
                b.add(func.ReturnOp(*[b.value(v) for v in op.operands]))
            else:
                b.copy(op)
        ret = block.last_op
        assert ret is not None
        outputs = [v.type for v in ret.operands]
        new_fn = func.FuncOp.from_region(fn.sym_name.data, arg_types, outputs, Region(block))
        new_fn.arg_attrs = ArrayAttr([DictionaryAttr({
            **(fn.arg_attrs.data[i].data if fn.arg_attrs is not None else {}),
            **({ccl.SHARD_ATTR: StringAttr(kind)} if kind else {}),
            **({ccl.TP_AXIS_ATTR: IntegerAttr(experts[i], i64)} if experts.get(i) is not None else {})})
            for i, kind in enumerate("experts" if i in experts else "tokens" if i in tokens else ""
                                     for i in range(len(arg_types)))])
        new_fn.res_attrs = fn.res_attrs
        for key, value in fn.attributes.items():
            if key not in ("sym_name", "function_type", "arg_attrs", "res_attrs"):
                new_fn.attributes[key] = value
        mesh = ccl.Mesh(tuple((a, s) for a, s in (("dp", self.dp), ("ep", self.ep), ("sp", self.sp), ("tp", self.tp))
                              if s > 1 or a == "ep"))
        new_fn.attributes[ccl.MESH_ATTR] = StringAttr(str(mesh))
        new_fn.attributes[ccl.STRATEGY_ATTR] = StringAttr(self.strategy)
        if self.chunks > 1:
            new_fn.attributes[ccl.CHUNKS_ATTR] = IntegerAttr(self.chunks, i64)
        parent = fn.parent_block()
        assert parent is not None
        parent.insert_op_before(new_fn, fn)
        parent.erase_op(fn)


def _combine_of(scatter: moe.ScatterOp) -> moe.CombineOp | None:
    """The combine of `scatter`'s route (None: the route has no combine)."""
    return next((u.operation for u in scatter.results[1].uses if isinstance(u.operation, moe.CombineOp)), None)


def _expert_section(scatter: moe.ScatterOp) -> set[Operation]:
    """The scatter and every op that depends on its results short of the combine: what each
    chunk computes for itself (the combine is the chunk's last op)."""
    found: set[Operation] = {scatter}
    pending = list(scatter.results)
    while pending:
        for use in pending.pop().uses:
            op = use.operation
            if op not in found and not isinstance(op, (moe.CombineOp, func.ReturnOp)):
                found.add(op)
                pending += list(op.results)
    return found


def _emit_chunks(b: _Builder, layer: _Layer, strategy: type[_Strategy], section: list[Operation],
                 combine: moe.CombineOp) -> None:
    """The layer's MoE part chunk by chunk, software-pipelined: each chunk's tokens (a row
    slice of the scattered tokens, their choices and weights) go through CHUNK_STAGES, made
    into a block per stage, and the blocks are issued so that chunk i+1's dispatch is under
    chunk i's experts and chunk i's home sum under chunk i+1's experts:

        dispatch 0, dispatch 1, receive 0, experts 0, receive 1, combine 0, dispatch 2,
        experts 1, receive 2, combine 1, dispatch 3, home 0, ..., home n-1

    (the link runs its commands in issue order: chunk i+1's dispatch, then chunk i's return
    once its experts are done). Chunk i+1's receive (its routing, whose tokens crossed under
    chunk i's experts) goes before chunk i's combine, and chunk i+2's dispatch before chunk
    i-1's home sum: commands issue in order, so what the next expert loop waits for is issued
    first (Qwen3-30B-A3B ep=8, 8 chunks, a2a_sum: 1,863.7 -> 1,787.9 us). With sp the order is
    `_sp_order`'s (a chunk's all-gather one chunk ahead). Each chunk's output
    rows are stored into the layer's output (a `tile.store` into a `tile.buffer`, in HBM when
    larger than a cluster's SRAM)."""
    scatter = layer.scatter
    main, tc = b.block, layer.own_tokens
    slices = [v for v in (scatter.input, scatter.expert_idx, combine.weights) if v is not None]
    whole = {v: b.value(v) for v in slices}
    d = shape_of(combine.result.type)[1]
    out_type = TensorType(combine.result.type.get_element_type(), [tc * layer.chunks, d])  # type: ignore[attr-defined]
    # In HBM when the function returns it as it is (the layer's output ends there: each
    # chunk's rows are stored as they are made, not the whole output after the last chunk).
    returned = all(isinstance(u.operation, func.ReturnOp) for u in combine.result.uses)
    space = "hbm" if returned or stored_bytes(out_type) > b.cluster_sram_bytes else "sram"
    out = b.add(tile.BufferOp(space, out_type), f"{combine.result.name_hint or 'out'}_buffer").results[0]
    chunks: list[dict[str, Block]] = []
    for i in range(layer.chunks):
        b.stages = {stage: Block() for stage in CHUNK_STAGES}
        b.to_stage("gather")
        offset = b.add(index_constant(i * tc), f"chunk{i}").results[0]
        for v in slices:
            source = whole[v]
            part = TensorType(source.type.get_element_type(), [tc, *shape_of(source.type)[1:]])  # type: ignore[attr-defined]
            b.values[v] = b.add(tile.SliceOp(source, offset, part), f"{v.name_hint or 'rows'}_chunk{i}").results[0]
        b.to_stage("dispatch")
        emit = strategy(b, layer)
        emit.scatter(scatter)
        for op in section:
            if op is scatter:
                continue
            if isinstance(op, moe.GroupedMatmulOp):
                emit.grouped_matmul(op)
            else:
                b.copy(op)
        emit.combine(combine)
        b.to_stage("output")
        store = b.add(tile.StoreOp(b.value(combine.result), out, offset))
        store.attributes[PHASE_ATTR] = StringAttr("combine")
        out = store.results[0]
        chunks.append(b.stages)
    b.stages, b.block = None, main
    order = _sp_order(layer.chunks) if layer.sp > 1 else _order(layer.chunks)
    for i, stage in order:
        for op in list(chunks[i][stage].ops):
            op.detach()
            main.add_op(op)
    for v in slices:
        b.values[v] = whole[v]
    out.name_hint = combine.result.name_hint
    b.values[combine.result] = out
    b.rows[out] = (layer.route.tokens.data, tc * layer.chunks)


def _order(n: int) -> list[tuple[int, str]]:
    """`_emit_chunks`' issue order of the chunks' stages without sp."""
    def dispatch(i: int) -> list[tuple[int, str]]:
        return [(i, "gather"), (i, "dispatch")] if i < n else []

    def home(i: int) -> list[tuple[int, str]]:
        return [(i, "home"), (i, "output")] if i >= 0 else []

    order = dispatch(0) + dispatch(1) + [(0, "receive")]
    for i in range(n):
        order += [(i, "experts")] + ([(i + 1, "receive")] if i + 1 < n else [])
        order += [(i, "combine")] + dispatch(i + 2) + home(i - 1)
    return order + home(n - 1)


def _sp_order(n: int) -> list[tuple[int, str]]:
    """`_emit_chunks`' issue order with sp, whose chunks' all-gathers and reduce-scatters are the
    longest transfers: chunk i+1's all-gather before chunk i's experts, and its dispatch (a DMA
    row scatter of the gathered tokens into the send buffer) after them, where its tokens have
    arrived (before, waiting for them, it held DMA engines that chunk i's weight loads queue
    on); chunk i's home sum and reduce-scatter right after its combine, before chunk i+2's
    all-gather on the link, and its output (the reduce-scatter's rows stored) after chunk i+1's
    experts. DeepSeek-V3 on ep=16,sp=8, 128 tokens a chip, a2a_sum, 2 chunks: 2,380.9 us in
    `_order`'s order, 2,102.8 in this one (one chunk: 2,333.8); with sp_sum=bf16 1,622.9 (one
    chunk: 1,900.5)."""
    order = [(0, "gather"), (0, "dispatch")] + ([(1, "gather")] if n > 1 else []) + [(0, "receive")]
    for i in range(n):
        order += [(i, "experts")] + ([(i + 1, "dispatch"), (i + 1, "receive")] if i + 1 < n else [])
        order += [(i, "combine"), (i, "home")] + ([(i + 2, "gather")] if i + 2 < n else [])
        order += [(i - 1, "output")] if i else []
    return order + [(n - 1, "output")]


class _Strategy(ABC):
    """What a sharding strategy shares; each one says how a tp partial sum is reduced."""

    def __init__(self, b: _Builder, layer: _Layer):
        self.b = b
        self.layer = layer
        self.route: SSAValue | None = None
        self.partial: SSAValue | None = None
        """With tp: this chip's f32 partial down projection (its F rows), not yet summed."""
        self.gathered: dict[SSAValue, SSAValue] = {}
        """With sp: a value of the chip's own tokens -> its rows all-gathered over sp (`_gathered`)."""

    def grouped_matmul(self, op: moe.GroupedMatmulOp) -> None:
        """The chip's experts; with tp a gate or up projection gives the chip's F columns and
        the down projection its f32 partial sum over the chip's F rows (the bias on the first
        tp chip only, so that the sum adds it once), for `reduce_partial`."""
        b, layer = self.b, self.layer
        assert self.route is not None
        bias = b.value(op.bias) if op.bias is not None else None
        row_parallel = layer.tp > 1 and not layer.column_parallel(op)
        if row_parallel and bias is not None:
            bias = self._on_first_tp_chip(bias)
        new = b.add(moe.GroupedMatmulOp(b.value(op.input), b.value(op.weight), self.route, bias,
                                        f32 if row_parallel else None))
        result = new.results[0]
        result.name_hint = op.result.name_hint
        b.rows[result] = (layer.route.blocks.data, shape_of(result.type)[0])
        if layer.tp > 1 and not row_parallel:
            b.columns[result] = (layer.hidden, layer.hidden // layer.tp)
        if row_parallel:
            result.name_hint = "partial_down"
            self.partial = result
            b.values[op.result] = self.reduce_partial(result, op.result.type.get_element_type())
        else:
            b.values[op.result] = result

    @abstractmethod
    def reduce_partial(self, partial: SSAValue, element: Attribute) -> SSAValue:
        """The down projection summed over the tp chips and rounded once to `element`."""

    def _sum_blocks_over_tp(self, partial: SSAValue, element: Attribute) -> SSAValue:
        """The blocks' f32 partial sums added over the tp chips (chip order) and rounded once."""
        b = self.b
        b.phase = "combine"
        summed = b.add(ccl.AllReduceOp(partial, TP, self.layer.tp), "down_summed").results[0]
        out = b.cast(summed, element, "down")
        b.phase = None
        b.rows[out] = b.rows[partial]
        return out

    def _local_experts(self, ids: SSAValue, name: str | None = None) -> SSAValue:
        """Global expert ids (-1: none) less this chip's first expert: its own experts' local
        ids, and -1 for -1 and for the experts of the chips before it (an id of a later chip's
        expert stays at or above E/ep: the caller bounds it where one may occur)."""
        b, ep = self.b, self.layer.ep
        shape = shape_of(ids.type)
        chip = b.add(ccl.ChipIdOp(EP, ep), "chip").results[0]
        first = b.add(tmath.MulOp(chip, b.const(self.layer.experts_per_chip, i32), TensorType(i32, [])),
                      "first_expert").results[0]
        local = b.add(tmath.SubOp(ids, first, TensorType(i32, shape)), "local_expert").results[0]
        mine = b.add(tmath.CmpOp("ge", local, b.const(0, i32), TensorType(i1, shape))).results[0]
        return b.add(tmath.SelectOp(mine, local, b.const(-1, i32), TensorType(i32, shape)), name).results[0]

    def _gathered(self, v: SSAValue, name: str) -> SSAValue:
        """With sp: `v`'s rows (the chip's own tokens') all-gathered over sp, the sp group's
        tokens in token order; else `v`."""
        if self.layer.sp == 1:
            return v
        if v in self.gathered:
            return self.gathered[v]
        b = self.b
        block = b.block
        if b.stages is not None and block is b.stages["dispatch"]:
            b.to_stage("gather")
        self.gathered[v] = b.add(ccl.AllGatherOp(v, SP, self.layer.sp, direct=self.layer.sp_direct), name).results[0]
        b.block = block
        return self.gathered[v]

    def _column_experts(self, ids: SSAValue) -> SSAValue:
        """With sp: the gathered tokens' expert ids made local to this chip's column (its sp
        coordinate's E / sp experts), -1 for another column's: no pair here; else `ids`."""
        b, layer = self.b, self.layer
        if layer.sp == 1:
            return ids
        shape, e = shape_of(ids.type), layer.experts
        column = b.add(ccl.ChipIdOp(SP, layer.sp), "column").results[0]
        first = b.add(tmath.MulOp(column, b.const(e, i32), TensorType(i32, [])), "column_first_expert").results[0]
        local = b.add(tmath.SubOp(ids, first, TensorType(i32, shape)), "column_expert").results[0]
        low = b.add(tmath.CmpOp("ge", local, b.const(0, i32), TensorType(i1, shape))).results[0]
        local = b.add(tmath.SelectOp(low, local, b.const(-1, i32), TensorType(i32, shape))).results[0]
        high = b.add(tmath.CmpOp("lt", local, b.const(e, i32), TensorType(i1, shape))).results[0]
        return b.add(tmath.SelectOp(high, local, b.const(-1, i32), TensorType(i32, shape)), "column_experts").results[0]

    def _dispatched(self, op: moe.ScatterOp) -> tuple[SSAValue, SSAValue]:
        """The tokens and expert ids the all-to-all over ep dispatches (with sp: gathered, the
        ids local to the column)."""
        x = self._gathered(self.b.value(op.input), "x_row")
        experts = self._column_experts(self._gathered(self.b.value(op.expert_idx), "experts_row"))
        combine = _combine_of(op)
        if combine is not None and combine.weights is not None and combine.weights in self.b.values:
            # With the choices: after the experts, its steps' latency would follow the return.
            self._gathered(self.b.value(combine.weights), "weights_row")
        return x, experts

    def _on_first_tp_chip(self, bias: SSAValue) -> SSAValue:
        b = self.b
        chip = b.add(ccl.ChipIdOp(TP, self.layer.tp), "tp_chip").results[0]
        first = b.add(tmath.CmpOp("eq", chip, b.const(0, i32), TensorType(i1, [])), "first_tp_chip").results[0]
        element = bias.type.get_element_type()  # type: ignore[attr-defined]
        return b.add(tmath.SelectOp(first, bias, b.const(0.0, element), bias.type), "bias_once").results[0]  # type: ignore[arg-type]

    def _plan(self, top_e: SSAValue) -> ccl.A2APlanOp:
        """`ccl.a2a_plan` of this chip's pairs. With a capacity and dp > 1 an expert's pairs
        come from every group, so the plan ranks this chip's after the pairs of all token
        shards before it (each chip's per-expert pair counts, gathered over ep then dp) and
        drops those of global rank >= C, as one chip does over all T tokens."""
        b, layer = self.b, self.layer
        cap, e = layer.route.capacity_limit, layer.experts
        chip_counts = None
        if cap is not None and layer.dp > 1:
            hot = b.add(tmath.OneHotOp(top_e, e)).results[0]
            mine = b.add(tmath.ReduceSumOp(hot, [0, 1], True, TensorType(i32, [1, 1, e]))).results[0]
            mine = b.reshape(mine, [1, e], "pairs_per_expert")
            group = b.add(ccl.AllGatherOp(mine, EP, layer.ep), "group_counts").results[0]
            chip_counts = b.add(ccl.AllGatherOp(group, DP, layer.dp), "chip_counts").results[0]
        plan = b.add(ccl.A2APlanOp(top_e, EP, layer.ep, e, cap, chip_counts))
        for r, name in zip(plan.results, ("slot_rows", "slot_experts", "send_counts")):
            r.name_hint = name
        return plan

    def _local_scatter(self, op: moe.ScatterOp, x: SSAValue, local_experts: SSAValue, capacity: int | None) -> None:
        """moe.scatter of what this chip computes over its own E/ep experts."""
        b, r = self.b, self.layer.route
        rows, k = shape_of(local_experts.type)
        route_type = moe.RouteType.make(rows, k, self.layer.experts_per_chip, r.block.data, capacity)
        new = b.add(moe.ScatterOp(x, local_experts, route_type))
        new.results[0].name_hint = op.results[0].name_hint
        new.results[1].name_hint = op.results[1].name_hint
        b.values[op.results[0]] = new.results[0]
        b.rows[new.results[0]] = (r.blocks.data, route_type.blocks.data)
        self.route = new.results[1]
        b.values[op.results[1]] = self.route


class _A2A(_Strategy):
    """`strategy=a2a`: the receiver routes the tokens it received by their lists of pairs
    (a2a_sum's dispatch), sums the tokens it holds whole as one chip does and returns a split
    token's pairs one row each; with sp or tp (`by_slot`) it routes per-pair slots and returns
    every pair's row."""

    recv_counts: SSAValue | None = None
    recv_weights: SSAValue | None = None
    whole_first = False
    """The plan's token order (ccl `_A2AOrder`): a destination's whole tokens first, so that only
    their sums go back, where the receiver's order changes no bits (a2a's return, no capacity)."""

    @property
    def by_slot(self) -> bool:
        """Whether the receiver routes per-pair slots and returns every pair's row: with sp
        (see `_scatter_slots`) and with tp, whose sum over the tp chips then moves only the
        slots' rows (one of the padded blocks' rows for each of the tokens' pairs)."""
        return self.layer.sp > 1 or self.layer.tp > 1

    def scatter(self, op: moe.ScatterOp) -> None:
        if self.by_slot:
            self._scatter_slots(op)
        else:
            self._scatter_tokens(op, returns=True)

    def _scatter_tokens(self, op: moe.ScatterOp, returns: bool) -> None:
        """The dispatch by token (ccl.a2a_tokens: a token's row crosses once to each chip
        holding one of its pairs), with each token's list of its pairs there
        (ccl.a2a_token_lists: local experts and weights, in k order); the receiver routes the
        tokens it received, min(K, E/ep) choices each (no copy of a token per pair). With
        `returns`, a2a's return plan (ccl.a2a_returns) crosses too."""
        b, layer = self.b, self.layer
        b.phase = "dispatch"
        ep, tl, d = layer.ep, layer.tokens, shape_of(op.input.type)[1]
        x, top_e = self._dispatched(op)
        self.whole_first = returns and layer.route.capacity_limit is None
        tokens = self._plan_tokens(top_e)
        self.entries = min(layer.route.k.data, layer.experts_per_chip)
        # The link runs its commands in issue order: the lists first, so the receiver's routing
        # and its first weight loads start while the token rows cross (decode is bound by the
        # weight stream, not by the rows); what only the combine reads after the rows.
        sent_experts = self._send(self._lists(top_e, "expert_lists"), "recv_expert_lists")
        combine = _combine_of(op)
        sent_weights = None
        if combine is not None and combine.weights is not None and combine.weights in b.values:
            weights = self._gathered(b.value(combine.weights), "weights_row")
            sent_weights = self._send(self._lists(weights, "weight_lists"), "recv_weight_lists")
        sent = self._send_rows(x)
        later: list[tuple[SSAValue, SSAValue | None, str]] = [(tokens.counts, None, "recv_token_counts")]
        if returns:
            plan = self.returns = b.add(ccl.A2AReturnsOp(self.plan.slot_rows, EP, ep, self.plan.slots, self.entries,
                                                         self.whole_first))
            for r, name in zip(plan.results, ("pair_slots", "pair_counts", "token_returns", "pair_returns",
                                              "sum_counts")):
                r.name_hint = name
            # The sums that come back, the head of each sender's slice: with whole_first only
            # the whole tokens' (a split token's is not read at home).
            self.wave_ends = self._wave_ends() if layer.waves > 1 else [layer.experts_per_chip]
            self.wave_returns = [plan] if len(self.wave_ends) == 1 else [
                self._wave(top_e, w, a, b) for w, (a, b) in enumerate(zip([0, *self.wave_ends], self.wave_ends))]
            tags = [str(w) if len(self.wave_ends) > 1 else "" for w in range(len(self.wave_ends))]
            later = ([(r.pair_slots, r.pair_counts, f"recv_pair_slots{t}") for r, t in zip(self.wave_returns, tags)]
                     + [(plan.sum_counts, None, "recv_sum_counts")]
                     + [(r.pair_counts, None, f"recv_pair_counts{t}") for r, t in zip(self.wave_returns, tags)])
        started = [b.start(ccl.AllToAllStartOp(v, EP, ep, rows=rows), name) for v, rows, name in later]
        b.to_stage("receive")
        recv_experts = b.reshape(b.done(sent_experts), [ep * tl, self.entries])
        if sent_weights is not None:  # with the tokens, when already computed
            self.recv_weights = b.reshape(b.done(sent_weights), [ep * tl, self.entries])
        # A list holds only this chip's experts; past its end (-1) it becomes -1 (no pair).
        local = self._local_experts(recv_experts, "recv_local_experts")
        recv = b.done(sent)
        done = [b.done(v) for v in started]
        if returns:
            n = len(self.wave_returns)
            self.recv_pair_slots, self.recv_sum_counts, self.recv_pair_counts = done[:n], done[n], done[n + 1:]
        else:
            (self.recv_token_counts,) = done
        recv_tokens = b.reshape(recv, [ep * tl, d], "recv_tokens")
        self._local_scatter(op, recv_tokens, local, self._receiver_capacity())
        b.phase = None
        b.to_stage("experts")

    def _scatter_slots(self, op: moe.ScatterOp) -> None:
        """The dispatch with sp or tp: each pair's slot (ccl.a2a_plan), the tokens sent once to
        each chip (ccl.a2a_tokens) and copied to their slots there, one expert per slot. With sp a
        token's K pairs spread over the sp columns, mostly one in each column's all-to-all:
        they come back a row per pair in bf16 and the home adds the columns' f32 sums before
        its one rounding; a receiver's sum would have to cross in f32 to keep it (twice the
        bytes) and a whole token of one pair gains nothing."""
        b, layer = self.b, self.layer
        b.phase = "dispatch"
        ep, tl, d = layer.ep, layer.tokens, shape_of(op.input.type)[1]
        x, top_e = self._dispatched(op)
        tokens = self._plan_tokens(top_e)
        plan, slots = self.plan, self.plan.slots
        sent_e = b.start(ccl.AllToAllStartOp(plan.slot_experts, EP, ep, rows=plan.counts), "recv_experts")
        sent_t = b.start(ccl.AllToAllStartOp(tokens.slot_tokens, EP, ep, rows=plan.counts), "recv_slot_tokens")
        sent = self._send_rows(x)
        counts = b.start(ccl.AllToAllStartOp(plan.counts, EP, ep), "recv_counts")
        b.to_stage("receive")
        recv_e, recv_t, recv = (b.done(v) for v in (sent_e, sent_t, sent))
        self.recv_counts = b.done(counts)
        column = b.reshape(recv_e, [ep * slots, 1])
        one = b.const(1, i32)
        local = b.add(tmath.SubOp(column, one, TensorType(i32, [ep * slots, 1])), "recv_local_expert").results[0]
        recv_tokens = b.reshape(recv, [ep * tl, d], "recv_tokens")
        slot_token = b.reshape(recv_t, [ep * slots], "slot_token")
        recv_rows = b.add(in_hbm_if_oversize(tcp.DmaGatherOp(recv_tokens, slot_token), b.cluster_sram_bytes), "recv_rows").results[0]
        self._local_scatter(op, recv_rows, local, self._receiver_capacity())
        b.phase = None
        b.to_stage("experts")

    def _lists(self, values: SSAValue, name: str) -> SSAValue:
        return self.b.add(ccl.A2ATokenListsOp(self.plan.slot_rows, values, EP, self.layer.ep, self.plan.slots,
                                              self.entries, self.whole_first), name).results[0]

    def _send(self, lists: SSAValue, name: str) -> SSAValue:
        """`lists` sent with the tokens (the all-to-all started)."""
        return self.b.start(ccl.AllToAllStartOp(lists, EP, self.layer.ep, rows=self.tokens.counts), name)

    def _send_weights(self, weights: SSAValue) -> None:
        sent = self._send(self._lists(weights, "weight_lists"), "recv_weight_lists")
        self.recv_weights = self.b.reshape(self.b.done(sent), [self.layer.ep * self.layer.tokens, self.entries])

    def _plan_tokens(self, top_e: SSAValue) -> ccl.A2ATokensOp:
        """The plan of this chip's pairs (`self.plan`) and its deduplicated dispatch."""
        plan = self.plan = self._plan(top_e)
        tokens = self.tokens = self.b.add(ccl.A2ATokensOp(plan.slot_rows, EP, self.layer.ep, plan.slots,
                                                          self.whole_first))
        for r, name in zip(tokens.results, ("token_rows", "slot_tokens", "token_counts")):
            r.name_hint = name
        return tokens

    def _wave(self, top_e: SSAValue, w: int, first: int, end: int) -> ccl.A2AReturnsOp:
        """The return plan of wave w's split pairs, those of local experts [first, end) (their
        tables only: `ccl.a2a_returns`)."""
        layer = self.layer
        wave = self.b.add(ccl.A2AReturnsOp(self.plan.slot_rows, EP, layer.ep, self.plan.slots, self.entries,
                                           self.whole_first, (top_e, layer.experts, first, end)))
        for r, name in zip(wave.results, ("pair_slots", "pair_counts", "token_returns", "pair_returns", "sum_counts")):
            r.name_hint = f"{name}{w}"
        return wave

    def _send_rows(self, x: SSAValue) -> SSAValue:
        """Each token's row once to each chip holding one of its pairs (a DMA row scatter into
        the send buffer, then the all-to-all): started (`_Builder.done` completes it)."""
        b, ep, tl = self.b, self.layer.ep, self.layer.tokens
        rows = b.add(in_hbm_if_oversize(tcp.DmaScatterOp(x, self.tokens.token_rows, ep * tl), b.cluster_sram_bytes), "send_rows").results[0]
        send = b.reshape(rows, [ep, tl, shape_of(x.type)[1]], "send_x")
        return b.start(ccl.AllToAllStartOp(send, EP, ep, rows=self.tokens.counts), "recv_x")

    def _receiver_capacity(self) -> int:
        """The receiver's scatter capacity: an expert receives at most one pair per token of
        the group, ep * T/n, so this one never drops; it makes G the exact worst case (a user
        capacity is lower)."""
        cap, group_tokens = self.layer.route.capacity_limit, self.layer.ep * self.layer.tokens
        return min(cap, group_tokens) if cap is not None else group_tokens

    def _return_rows(self, rows: SSAValue, per_chip: int, counts: SSAValue, indices: SSAValue,
                     name: str) -> SSAValue:
        """`rows` (`per_chip` for each source chip, `counts` of them data) sent back to the
        chips they came from, and gathered there by `indices`."""
        started = self._start_return(rows, per_chip, counts, "returned", "send_back")
        self.b.to_stage("home")
        return self._returned(started, per_chip, indices, name)

    def _start_return(self, rows: SSAValue, per_chip: int, counts: SSAValue, name: str, send_name: str,
                      expects: SSAValue | None = None) -> SSAValue:
        """The all-to-all of `rows` (`per_chip` for each source chip, `counts` of them data)
        back to the chips they came from, started; `expects`: the rows each chip sends back
        here, when this chip's plan knows them."""
        back = self.b.reshape(rows, [self.layer.ep, per_chip, shape_of(rows.type)[-1]], send_name)
        return self.b.start(ccl.AllToAllStartOp(back, EP, self.layer.ep, rows=counts, expects=expects), name)

    def _returned(self, started: SSAValue, per_chip: int, indices: SSAValue, name: str) -> SSAValue:
        """The rows of the return `started`, gathered at home by `indices`."""
        b = self.b
        d = shape_of(started.type)[-1]
        flat = b.reshape(b.done(started), [self.layer.ep * per_chip, d], f"{started.name_hint}_rows")
        return b.add(tcp.DmaGatherOp(flat, indices), name).results[0]

    def reduce_partial(self, partial: SSAValue, element: Attribute) -> SSAValue:
        """Left for the combine (with tp the receiver routes slots): only the slots' rows, not
        the padded blocks, are summed."""
        return partial

    def combine(self, op: moe.CombineOp) -> None:
        b, layer = self.b, self.layer
        ep, slots, tl, d = layer.ep, self.plan.slots, layer.tokens, shape_of(op.result.type)[1]
        assert self.route is not None
        b.to_stage("combine")
        b.phase = "combine"
        if self.by_slot:
            rows = b.add(moe.CombineOp(b.value(op.input), self.route), "expert_rows").results[0]
            if self.partial is None:
                self._combine_by_pair(op, rows)
                return
            # tp: the slots' f32 partial sums added over the tp chips, each chip summing its
            # 1/tp of the columns (a reduce-scatter, half an all-reduce's steps), which it
            # rounds, returns and weighs alone; the outputs' columns are then gathered over tp.
            # Column by column the same additions in the same order: the all-reduce's bits.
            tp = layer.tp
            partial = b.reshape(rows, [ep, slots, tp, d // tp], "partial_rows")
            summed = b.add(ccl.ReduceScatterOp(partial, TP, tp, dim=2, rows=self.recv_counts), "summed_rows").results[0]
            rows = b.reshape(b.cast(summed, op.input.type.get_element_type(), "summed_rows_out"),  # type: ignore[attr-defined]
                             [ep * slots, d // tp], "expert_rows_summed")
            self._combine_by_pair(op, rows)
            b.phase = "combine"
            own = b.values[op.result]
            own.name_hint = "own_columns"
            columns = b.reshape(own, [tl, 1, d // tp])
            gathered = b.add(ccl.AllGatherOp(columns, TP, tp, dim=1), "output_gathered").results[0]
            out = b.reshape(gathered, [tl, d], op.result.name_hint)
            b.values[op.result] = out
            b.rows[out] = (layer.route.tokens.data, tl)
            b.phase = None
            return
        if op.weights is not None and self.recv_weights is None:  # the weights computed after the dispatch
            self._send_weights(self._gathered(b.value(op.weights), "weights_row"))
        blocks = b.value(op.input)
        # The split pairs' rows go back first: their all-to-all's step runs on the link while the
        # combine below sums the tokens, and the sums then go back at once (the link runs its
        # commands in issue order). Where those rows are in the blocks: index tables of the
        # receiver's routing, not rows (no token loop of the combine's takes them; balanced
        # routing has none).
        b.phase = "routing"
        at = b.reshape(b.add(moe.PairRowsOp(self.route), "pair_block_rows").results[0], [ep * tl * self.entries, 1])
        at = b.add(tmath.AddOp(at, b.const(1, i32), at.type), "pair_block_rows_1").results[0]  # type: ignore[arg-type]
        g, block = shape_of(blocks.type)[:2]
        waves = len(self.recv_pair_slots)
        backs = []
        for w, (listed, counts, wave) in enumerate(zip(self.recv_pair_slots, self.recv_pair_counts,
                                                       self.wave_returns)):
            tag = str(w) if waves > 1 else ""
            b.phase = "routing"
            # Their places in the received lists, plus one (0: none).
            place = b.add(tmath.SubOp(listed, b.const(1, i32), listed.type)).results[0]  # type: ignore[arg-type]
            found = b.reshape(b.add(tcp.DmaGatherOp(at, place)).results[0], [ep, slots])  # no pair reads 0
            split_at = b.add(tmath.SubOp(found, b.const(1, i32), found.type),  # type: ignore[arg-type]
                             f"split_at{tag}").results[0]
            b.phase = "combine"
            rows = b.reshape(blocks, [g * block, d], f"y_rows{tag}")
            # [chips, S] indices (the send buffer's shape): one gather, not a row-parallel op of
            # the combine's token loop, whose rows it does not follow.
            gather = in_hbm_if_oversize(tcp.DmaGatherOp(rows, split_at), b.cluster_sram_bytes)
            if waves > 1:  # gathered while the experts use SRAM, and apart from the other waves' gathers
                place_in_hbm(gather)
            pairs = b.add(gather, f"split_rows{tag}").results[0]
            # Each chip's plan knows the split pairs that come home in this wave (the counts it sent
            # them): a chip with none to send or get back skips this all-to-all (balanced routing:
            # every chip).
            backs.append(self._start_return(pairs, slots, counts, f"returned{tag}", f"send_back{tag}",
                                            expects=wave.pair_counts))
            if waves > 1:  # the blocks of this wave's experts, at most: schedule-level return-waves cuts there
                backs[-1].owner.attributes[ccl.WAVE_BLOCKS_ATTR] = IntegerAttr(
                    self._wave_blocks(self.wave_ends[w], g, block), i64)
        # A token whose kept pairs all sit here is summed here, straight from the blocks: the
        # combine over its list adds its weighted terms in k order from +0.0 in f32 and rounds
        # once, as one chip's combine does (a dropped pair adds nothing there either). One row
        # per token received goes back; a split token's is not read at home, where its pairs
        # come back one row each and are summed: bit-identical either way.
        sums = b.add(moe.CombineOp(blocks, self.route, self.recv_weights), "token_sums").results[0]
        sums_back = self._start_return(sums, tl, self.recv_sum_counts, "returned_sums", "send_sums")
        b.to_stage("home")
        returns = self.returns
        whole = self._returned(sums_back, tl, returns.token_returns, "whole_sums")
        whole = b.cast(b.reshape(whole, [tl, d]), f32, "whole_sums_f32")
        # A pair's row comes back in one wave, +0.0 in the others: adding those changes a -0.0
        # term to +0.0 at most, which the sum from +0.0 at home does anyway.
        terms: SSAValue | None = None
        for w, (back, wave) in enumerate(zip(backs, self.wave_returns)):
            tag = str(w) if waves > 1 else ""
            part = b.cast(self._returned(back, slots, wave.pair_returns, f"pair_rows{tag}"), f32, f"pair_rows{tag}_f32")
            if terms is not None:
                part = b.add(tmath.AddOp(terms, part, part.type), "pair_rows_f32").results[0]  # type: ignore[arg-type]
            terms = part
        assert terms is not None
        self._sum_at_home(op, self._weighted(op, terms, returns.pair_returns), "pair_sum", whole)

    def _wave_blocks(self, end: int, g: int, block: int) -> int:
        """The receiver's blocks that hold the pairs of its first `end` experts, at most (of `g`
        blocks of `block` rows; they go in expert order): `moe.max_blocks` of its received tokens
        over `end` experts, each token listing at most min(Kk, end) of them (distinct), each
        expert at most the receiver's capacity (decode's B = T' gives each expert one block)."""
        tokens = self.layer.ep * self.layer.tokens
        return min(g, moe.max_blocks(tokens, min(self.entries, end), end, block, self._receiver_capacity()))

    def _wave_ends(self) -> list[int]:
        """Where the waves' ranges of the chip's experts end: `waves` equal ranges of the experts
        whose blocks can end before the loop's last (`_wave_blocks` below G), then the rest, whose
        wave follows the loop, in one more."""
        layer = self.layer
        route = moe.RouteType.make(layer.ep * layer.tokens, self.entries, layer.experts_per_chip,
                                   layer.route.block.data, self._receiver_capacity())
        g, block, local = route.blocks.data, route.block.data, layer.experts_per_chip
        inside = max((e for e in range(1, local + 1) if self._wave_blocks(e, g, block) < g), default=0)
        ends = sorted({-(-(w + 1) * inside // layer.waves) for w in range(layer.waves)} - {0})
        return ends + [local] if not ends or ends[-1] < local else ends

    def _combine_by_pair(self, op: moe.CombineOp, rows: SSAValue) -> None:
        """sp's combine: every slot's row back to its home, weighted and summed there."""
        picked = self._return_rows(rows, self.plan.slots, self.recv_counts, self.plan.slot_rows, "pair_rows")
        terms = self.b.cast(picked, f32, "pair_rows_f32")
        self._sum_at_home(op, self._weighted(op, terms, self.plan.slot_rows), "pair_sum")

    def _weighted(self, op: moe.CombineOp, terms: SSAValue, pair_rows: SSAValue) -> SSAValue:
        """`terms` [T/n, K, D] (f32, a row per pair) times the combine's weights, zero where
        `pair_rows` [T/n, K] is -1 (no row came back for the pair); `terms` without weights."""
        if op.weights is None:
            return terms
        b, layer = self.b, self.layer
        tl, k = layer.tokens, layer.route.k.data
        w = b.cast(self._gathered(b.value(op.weights), "weights_row"), f32, "weights_f32")
        kept = b.add(tmath.CmpOp("ge", pair_rows, b.const(0, i32), TensorType(i1, [tl, k])), "pair_kept").results[0]
        w = b.add(tmath.SelectOp(kept, w, b.const(0.0, f32), TensorType(f32, [tl, k])), "weights_kept").results[0]
        return b.add(tmath.MulOp(b.reshape(w, [tl, k, 1]), terms, terms.type), "weighted").results[0]  # type: ignore[arg-type]

    def _sum_at_home(self, op: moe.CombineOp, terms: SSAValue, name: str, plus: SSAValue | None = None) -> None:
        """The layer's output on its home chip: `terms` [T/n, n, D] (f32) summed over axis 1 in
        order from +0.0, plus `plus` (f32 [T/n, D]: the receivers' sums, zero where `terms`
        hold a token's pairs) or + 0.0 (either makes a -0.0 sum +0.0, as moe.combine does),
        and rounded once; with sp, the columns' f32 sums are first added over sp (chip order),
        each chip keeping its own tokens, then + 0.0; with sp_sum=bf16 each column's sum is
        rounded to the output's type before, and the reduce-scatter's one rounding is the last."""
        b, layer = self.b, self.layer
        tl, d = layer.tokens, shape_of(terms.type)[-1]  # tp's combine: the chip's columns
        summed = b.add(tmath.ReduceSumOp(terms, [1], False, TensorType(f32, [tl, d])), name)
        if plus is not None:
            # A token none of whose pairs came back (every whole token: a routing that splits
            # none) sums zero rows with weights forced to 0: exactly +0.0, which lets
            # schedule-tokens skip a tile of such tokens' pair sums.
            mark_pair_sum(summed)
        total = summed.results[0]
        if layer.sp > 1:
            assert plus is None, "sp's combine returns a row per pair"
            tl = layer.own_tokens
            element = op.result.type.get_element_type()  # type: ignore[attr-defined]
            if layer.sp_sum == "bf16":
                rounded = b.cast(total, element, f"{name}_rounded")
                out = b.add(ccl.ReduceScatterOp(rounded, SP, layer.sp, direct=layer.sp_direct),
                            op.result.name_hint or f"{name}_own").results[0]
                b.to_stage("output")
                b.values[op.result] = out
                b.rows[out] = (layer.route.tokens.data, tl)
                b.phase = None
                return
            total = b.add(ccl.ReduceScatterOp(total, SP, layer.sp, direct=layer.sp_direct), f"{name}_own").results[0]
            b.to_stage("output")
        total = b.add(tmath.AddOp(total, plus if plus is not None else b.const(0.0, f32),
                                  TensorType(f32, [tl, d]))).results[0]
        out = b.cast(total, op.result.type.get_element_type(), op.result.name_hint)
        b.values[op.result] = out
        b.rows[out] = (layer.route.tokens.data, tl)
        b.phase = None


class _A2ASum(_A2A):
    """`strategy=a2a_sum`: a2a's dispatch by token, each receiver summing a token's pairs."""

    def scatter(self, op: moe.ScatterOp) -> None:
        self._scatter_tokens(op, returns=False)

    def reduce_partial(self, partial: SSAValue, element: Attribute) -> SSAValue:
        return self._sum_blocks_over_tp(partial, element)

    def combine(self, op: moe.CombineOp) -> None:
        b = self.b
        assert self.route is not None
        b.to_stage("combine")
        b.phase = "combine"
        if op.weights is not None and self.recv_weights is None:
            self._send_weights(self._gathered(b.value(op.weights), "weights_row"))
        # The combine's f32 sum over the token's pairs here, rounded once to the rows' type
        # (bf16: DeepEP's combine sends bf16): half the bytes of f32 on the link, for one more
        # rounding of a token's part (tolerance.py's RECEIVER_SUM_SCALE).
        part = b.add(moe.CombineOp(b.value(op.input), self.route, self.recv_weights), "token_partials").results[0]
        picked = self._return_rows(part, self.layer.tokens, self.recv_token_counts, self.tokens.token_rows,
                                   "chip_partials")
        self._sum_at_home(op, b.cast(picked, f32, "chip_partials_f32"), "partial_sum")


class _AllGather(_Strategy):
    def scatter(self, op: moe.ScatterOp) -> None:
        b, layer = self.b, self.layer
        b.phase = "dispatch"
        ep, el = layer.ep, layer.experts_per_chip
        x, top_e = b.value(op.input), b.value(op.expert_idx)
        if layer.route.capacity_limit is not None and layer.dp > 1:  # drop what one chip drops first
            kept = b.add(tmath.CmpOp("ge", self._plan(top_e).slot_rows, b.const(0, i32), TensorType(i1, shape_of(top_e.type))),
                         "pair_kept").results[0]
            top_e = b.add(tmath.SelectOp(kept, top_e, b.const(-1, i32), top_e.type), "kept_experts").results[0]  # type: ignore[arg-type]
        x_all = b.add(ccl.AllGatherOp(x, EP, ep), "x_all").results[0]
        e_all = b.add(ccl.AllGatherOp(top_e, EP, ep), "experts_all").results[0]
        shape = shape_of(e_all.type)
        local = self._local_experts(e_all)
        below = b.add(tmath.CmpOp("lt", local, b.const(el, i32), TensorType(i1, shape))).results[0]
        local = b.add(tmath.SelectOp(below, local, b.const(-1, i32), TensorType(i32, shape)), "mine").results[0]
        self._local_scatter(op, x_all, local, layer.route.capacity_limit)
        b.phase = None

    def reduce_partial(self, partial: SSAValue, element: Attribute) -> SSAValue:
        return self._sum_blocks_over_tp(partial, element)

    def combine(self, op: moe.CombineOp) -> None:
        b, layer = self.b, self.layer
        assert self.route is not None
        b.phase = "combine"
        yb = b.cast(b.value(op.input), f32, "expert_rows_f32")
        weights = None
        if op.weights is not None:
            weights = b.add(ccl.AllGatherOp(b.value(op.weights), EP, layer.ep), "weights_all").results[0]
        part = b.add(moe.CombineOp(yb, self.route, weights), "partial").results[0]
        total = b.add(ccl.ReduceScatterOp(part, EP, layer.ep), "summed").results[0]
        out = b.cast(total, op.result.type.get_element_type(), op.result.name_hint)
        b.values[op.result] = out
        b.rows[out] = (layer.route.tokens.data, layer.tokens)
        b.phase = None
