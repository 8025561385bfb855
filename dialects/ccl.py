"""`ccl`: collectives between the chips of a mesh, for expert and data parallelism.

A sharded layer is one SPMD function that every chip of the mesh runs on its own shard of the
tokens and experts (`passes/mesh/shard_experts.py`). The function carries its mesh as the attribute
`ccl.mesh = "dp=2,ep=4"` (axes outer to inner; chip c has coordinates c in row-major order over
the axes). A collective names the mesh axis it spans (`axis = "ep"`): it exchanges values among
the `chips` chips that differ only in that coordinate, and every chip of the mesh runs it at
the same point of the program. Static shapes throughout: an all-to-all moves a buffer of
`chips` fixed-size per-destination slices, of which only the first `rows[d]` rows of slice d
hold data and cross the link (the rest are zero on both sides).

Semantics over all chips' values are in `runtime_sim/semantics/ccl_semantics.py`, the cost on
the link model in `runtime_sim/perf/ccl_cost.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from xdsl.dialects.builtin import IntegerAttr, StringAttr, TensorType, UnitAttr, i32, i64
from xdsl.ir import Block, Dialect, SSAValue
from xdsl.irdl import (
    AttrSizedOperandSegments,
    IRDLOperation,
    ParsePropInAttrDict,
    VarConstraint,
    base,
    irdl_op_definition,
    operand_def,
    opt_operand_def,
    opt_prop_def,
    prop_def,
    result_def,
    traits_def,
)
from xdsl.traits import Pure

from dialects.tensor_types import expect, format_type, is_float_type, is_int_type, shape_of

MESH_ATTR = "ccl.mesh"
"""Function attribute: the mesh the SPMD function runs on, `"dp=2,ep=4"` (axes outer to inner)."""
SHARD_ATTR = "ccl.shard"
"""Argument attribute: how the argument is split over the chips, `"tokens"` (the chip of
token shard c, `Mesh.token_shard`, holds rows [c * T/n, (c + 1) * T/n), n = dp * ep * sp) or
`"experts"` (the chip of expert shard i, `Mesh.expert_shard`, holds experts
[i * E/m, (i + 1) * E/m), m = ep * sp); arguments without it are replicated."""
TP_AXIS_ATTR = "ccl.tp_axis"
"""Argument attribute of an expert-sharded argument on a mesh with tensor parallelism: the axis
(an integer) split over the tp chips as well, the chip at tp coordinate j holding its j-th
slice (the F columns of a gate or up weight and its bias, the F rows of a down weight)."""
CHUNKS_ATTR = "ccl.chunks"
"""Function attribute of a chip program whose token loop shard-experts split into chunks (an
integer > 1): each chunk's dispatch, experts and combine are ops of their own, of one shape,
which the schedule level keeps in loops of their own."""
WAVE_BLOCKS_ATTR = "ccl.wave_blocks"
"""Attribute of an all_to_all_start returning one wave of a2a's split pairs: the receiver's blocks
that hold them, at most (the expert loop's first ones); schedule-level return-waves issues it
after those (passes/schedule/return_waves.py)."""
STRATEGY_ATTR = "ccl.strategy"
"""Function attribute: the expert-parallel strategy the sharding pass used (a2a, allgather)."""


def a2a_slots(tokens: int, k: int, experts_per_chip: int, capacity: int | None = None) -> int:
    """The exact worst case of pairs one chip sends to one destination chip owning
    `experts_per_chip` experts: each token sends at most min(K, E/N) pairs there (its K experts
    are distinct), and with a per-expert capacity C each of those experts can keep at most C of
    one chip's pairs (a chip's later pairs can only drop, never be kept, when earlier chips'
    pairs come first), so min(T * min(K, E/N), E/N * min(T, C)). Every such count is reached by
    some routing (tests/test_mesh.py checks it by brute force)."""
    bound = tokens * min(k, experts_per_chip)
    if capacity is not None:
        bound = min(bound, experts_per_chip * min(tokens, capacity))
    return bound


def _axis_props(axis: str, chips: int, dim: int = 0, direct: bool = False) -> dict[str, object]:
    """The properties of a collective over `chips` chips along mesh axis `axis`; `dim`, the
    tensor axis a gather or scatter splits, only when not the first (the default); `direct`
    (`_GatherOrScatter`) only when set."""
    props: dict[str, object] = {"axis": StringAttr(axis), "chips": IntegerAttr(chips, i64)}
    if dim:
        props["dim"] = IntegerAttr(dim, i64)
    if direct:
        props["direct"] = UnitAttr()
    return props


def _order_props(whole_first: bool) -> dict[str, object]:
    """`whole_first`: a destination's tokens ranked whole ones first (`_A2AOrder`)."""
    return {"whole_first": UnitAttr()} if whole_first else {}


def split_dim(op: IRDLOperation) -> int:
    """The tensor axis an all_gather concatenates or a reduce_scatter splits (`dim`, default 0)."""
    dim = op.dim  # type: ignore[attr-defined]
    return 0 if dim is None else dim.value.data


class _Collective(IRDLOperation):
    """Shared accessors: the mesh axis and the number of chips along it."""

    @property
    def group_size(self) -> int:
        return self.chips.value.data  # type: ignore[attr-defined]

    @property
    def axis_name(self) -> str:
        return self.axis.data  # type: ignore[attr-defined]

    def _verify_group(self) -> None:
        expect(self.group_size >= 1, f"chips must be positive, got {self.group_size}")


class _A2AOrder(_Collective):
    """The order of a destination's tokens in an all-to-all plan's token send buffer: token
    order, or with `whole_first` the *whole* tokens (every kept pair bound for one chip) first,
    in token order, then the split ones: the receiver's sums of whole tokens are then the head
    of each sender's slice, and only they go back (ccl.a2a_returns' `sum_counts`). Without a
    capacity the order of a block's rows changes no row's bits; with one the receiver keeps an
    expert's first pairs in arrival order, which must stay the tokens'."""

    whole_first = opt_prop_def(UnitAttr)


class AllToAllExchange(_Collective):
    """What an all-to-all and its asynchronous start share: input[d] (the slice for chip d of
    the group) goes to chip d; result[s] is what chip s sent here. With `rows`, only the first
    rows[d] rows of slice d are data and cross the link; the rest are zero (the packing makes
    them so) and arrive as zero. `packed` (with `rows`): the input's rows are the slices' data
    rows one after another (slice d's rows[d] rows from the sum of rows[:d]), not each slice's
    at the head of its own; the result is laid out as without it (a mesh receiver's sums,
    computed over its received rows packed first, go back without being unpacked).
    `expects` (with `rows`): the rows each chip s of the group sends here, which this chip knew
    before (a2a's split pairs coming home: its own plan's counts); a chip that sends no row and
    expects none has nothing to exchange and skips it (no step on its link, no wait for the
    group: nobody sends it a row nor waits for one from it)."""

    input = operand_def(TensorType)
    rows = opt_operand_def(TensorType)
    expects = opt_operand_def(TensorType)
    result = result_def(TensorType)
    axis = prop_def(StringAttr)
    chips = prop_def(IntegerAttr)
    packed = opt_prop_def(UnitAttr)
    irdl_options = (AttrSizedOperandSegments(as_property=True), ParsePropInAttrDict())
    assembly_format = (
        "$input (`rows` $rows^)? (`expects` $expects^)? `over` $axis attr-dict `:` type($input) (`,` type($rows)^)? "
        "(`,` type($expects)^)? `->` type($result)"
    )

    def __init__(self, input, axis: str, chips: int, rows=None, packed: bool = False, expects=None):
        props = _axis_props(axis, chips)
        if packed:
            props["packed"] = UnitAttr()
        super().__init__(operands=[input, rows, expects], result_types=[input.type], properties=props)

    def verify_(self) -> None:
        self._verify_group()
        shape = shape_of(self.input.type)
        expect(len(shape) >= 1 and shape[0] == self.group_size,
               f"input {format_type(self.input.type)} needs one slice per chip: a leading axis of {self.group_size}")
        expect(self.result.type == self.input.type, f"result should be {format_type(self.input.type)}")
        if self.rows is not None:
            expect(self.rows.type == TensorType(i32, [self.group_size]), f"rows must be i32 [{self.group_size}]")
        expect(self.packed is None or (self.rows is not None and len(shape) >= 2),
               "packed needs rows (how many of the input's rows each slice takes) and slices of rows")
        if self.expects is not None:
            expect(self.rows is not None, "expects needs rows (what this chip sends)")
            expect(self.expects.type == TensorType(i32, [self.group_size]),
                   f"expects must be i32 [{self.group_size}]")


@irdl_op_definition
class AllToAllOp(AllToAllExchange):
    """An all-to-all that completes where it is issued (AllToAllExchange says what it moves)."""

    name = "ccl.all_to_all"
    traits = traits_def(Pure())


@irdl_op_definition
class AllToAllStartOp(AllToAllExchange):
    """An all-to-all started (XLA's `all-to-all-start`, MLIR's `async.execute`): the link moves
    the rows while the chip's engines go on with what does not need them. Its result is the
    receive buffer as the link fills it, read only by the `ccl.all_to_all_done` that completes
    it, so the schedule can place compute between the two (passes/mesh/shard_experts.py's
    chunks: one chunk's exchange under another's experts)."""

    name = "ccl.all_to_all_start"

    def verify_(self) -> None:
        super().verify_()
        expect(all(isinstance(u.operation, AllToAllDoneOp) for u in self.result.uses),
               "the receive buffer of an all_to_all_start is read only by ccl.all_to_all_done")


@irdl_op_definition
class AllToAllDoneOp(IRDLOperation):
    """The all-to-all `started` has completed: its received rows (the same buffer; the chip
    waits here for the link, at no cost of its own)."""

    name = "ccl.all_to_all_done"
    T: ClassVar = VarConstraint("T", base(TensorType))
    started = operand_def(T)
    result = result_def(T)
    traits = traits_def(Pure())
    assembly_format = "$started attr-dict `:` type($started)"

    def __init__(self, started: SSAValue):
        super().__init__(operands=[started], result_types=[started.type])

    def verify_(self) -> None:
        expect(isinstance(self.started.owner, AllToAllStartOp),
               "ccl.all_to_all_done completes a ccl.all_to_all_start: its operand must be one's result")
        expect(self.result.type == self.started.type, f"result should be {format_type(self.started.type)}")


class _GatherOrScatter(_Collective):
    """An all-gather's or reduce-scatter's algorithm: the ring's N - 1 steps, each chip sending one
    share to its successor (the default), or with `direct` one step, each chip sending its share
    (a reduce-scatter: each chip's slice) straight to every other chip of the group, as an
    all-to-all does: the same bytes on each link, one step's latency instead of N - 1 (the
    one-shot algorithm of small, latency-bound collectives: docs/mesh.md, the sp axis). The values
    are the same either way (a reduction adds the chips' parts in chip order in both)."""

    direct = opt_prop_def(UnitAttr)

    @property
    def is_direct(self) -> bool:
        return self.direct is not None


@irdl_op_definition
class AllGatherOp(_GatherOrScatter):
    """Every chip's input, concatenated along the first axis (`dim`, if given) in chip order."""

    name = "ccl.all_gather"
    input = operand_def(TensorType)
    result = result_def(TensorType)
    axis = prop_def(StringAttr)
    chips = prop_def(IntegerAttr)
    dim = opt_prop_def(IntegerAttr)
    traits = traits_def(Pure())
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$input `over` $axis attr-dict `:` type($input) `->` type($result)"

    def __init__(self, input, axis: str, chips: int, dim: int = 0, direct: bool = False):
        shape = list(shape_of(input.type))
        shape[dim] *= chips
        t = TensorType(input.type.get_element_type(), shape)
        super().__init__(operands=[input], result_types=[t], properties=_axis_props(axis, chips, dim, direct))

    def verify_(self) -> None:
        self._verify_group()
        shape = list(shape_of(self.input.type))
        dim = split_dim(self)
        expect(0 <= dim < len(shape), f"dim {dim} is not an axis of {format_type(self.input.type)}")
        shape[dim] *= self.group_size
        want = TensorType(self.input.type.get_element_type(), shape)
        expect(self.result.type == want, f"result should be {format_type(want)}")


class _Reduction(_Collective):
    def _verify_float(self) -> None:
        element = self.input.type.get_element_type()  # type: ignore[attr-defined]
        expect(is_float_type(element), "reductions take float tensors")


@irdl_op_definition
class ReduceScatterOp(_Reduction, _GatherOrScatter):
    """The sum over chips (in chip order 0, 1, ..., in f32, rounded once to the type) of every
    chip's input; chip i keeps the i-th slice of the first axis (`dim`, if given: tp's slots'
    rows, each chip summing its share of the columns). With `rows` (i32 [S], the input
    [S, R, ...] read as S slices, `dim` > 1), only the first rows[s] rows of slice s are data
    and cross the link, as in ccl.all_reduce."""

    name = "ccl.reduce_scatter"
    input = operand_def(TensorType)
    rows = opt_operand_def(TensorType)
    result = result_def(TensorType)
    axis = prop_def(StringAttr)
    chips = prop_def(IntegerAttr)
    dim = opt_prop_def(IntegerAttr)
    traits = traits_def(Pure())
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = (
        "$input (`rows` $rows^)? `over` $axis attr-dict `:` type($input) (`,` type($rows)^)? "
        "`->` type($result)"
    )

    def __init__(self, input, axis: str, chips: int, dim: int = 0, rows=None, direct: bool = False):
        shape = list(shape_of(input.type))
        shape[dim] //= chips
        t = TensorType(input.type.get_element_type(), shape)
        super().__init__(operands=[input, rows], result_types=[t], properties=_axis_props(axis, chips, dim, direct))

    def verify_(self) -> None:
        self._verify_group()
        self._verify_float()
        shape = list(shape_of(self.input.type))
        dim = split_dim(self)
        expect(0 <= dim < len(shape) and shape[dim] % self.group_size == 0,
               f"input {format_type(self.input.type)}: axis {dim} must divide by {self.group_size}")
        shape[dim] //= self.group_size
        want = TensorType(self.input.type.get_element_type(), shape)
        expect(self.result.type == want, f"result should be {format_type(want)}")
        if self.rows is not None:
            expect(dim >= 2 and self.rows.type == TensorType(i32, [shape[0]]),
                   f"rows must be i32 [{shape[0]}], one count per slice of the input's first axis, "
                   "and dim past the slices' rows (at least 2)")


@irdl_op_definition
class AllReduceOp(_Reduction):
    """The sum over chips (in chip order, in f32, rounded once), on every chip. With `rows`
    (i32 [S], the input [S, R, ...] read as S slices), only the first rows[s] rows of slice s
    are data and cross the link; the rest are zero on every chip and sum to zero."""

    name = "ccl.all_reduce"
    input = operand_def(TensorType)
    rows = opt_operand_def(TensorType)
    result = result_def(TensorType)
    axis = prop_def(StringAttr)
    chips = prop_def(IntegerAttr)
    traits = traits_def(Pure())
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = (
        "$input (`rows` $rows^)? `over` $axis attr-dict `:` type($input) (`,` type($rows)^)? "
        "`->` type($result)"
    )

    def __init__(self, input, axis: str, chips: int, rows=None):
        super().__init__(operands=[input, rows], result_types=[input.type], properties=_axis_props(axis, chips))

    def verify_(self) -> None:
        self._verify_group()
        self._verify_float()
        expect(self.result.type == self.input.type, f"result should be {format_type(self.input.type)}")
        if self.rows is not None:
            shape = shape_of(self.input.type)
            expect(len(shape) >= 2 and self.rows.type == TensorType(i32, [shape[0]]),
                   f"rows must be i32 [{shape[0]}], one count per slice of a rank-2 or higher input")


@irdl_op_definition
class ChipIdOp(_Collective):
    """This chip's coordinate along the mesh axis (0 .. chips - 1), a scalar i32."""

    name = "ccl.chip_id"
    result = result_def(TensorType)
    axis = prop_def(StringAttr)
    chips = prop_def(IntegerAttr)
    traits = traits_def(Pure())
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "`over` $axis attr-dict `:` type($result)"

    def __init__(self, axis: str, chips: int):
        super().__init__(result_types=[TensorType(i32, [])], properties=_axis_props(axis, chips))

    def verify_(self) -> None:
        self._verify_group()
        expect(self.result.type == TensorType(i32, []), "result must be a scalar i32")


@irdl_op_definition
class A2APlanOp(_Collective):
    """Where each (token, choice) pair goes in the static send buffer of an all-to-all dispatch.

    Expert e lives on chip e // (E / chips) of the group, as local expert e mod (E / chips).
    Pairs p = t*K + k in token-major order; a pair's slot is its rank among this chip's pairs
    bound for the same chip; `slot_rows[t, k] = dest * S + slot` (-1 if dropped). With a
    capacity C, only an expert's first C pairs of this chip are sent (in that order): no later
    one could be kept, since the receiver keeps an expert's first C pairs over the group's
    tokens in token-major order, and this chip's pairs come in that order. `slot_experts[d, s]`
    is the local expert of slot s towards chip d, plus one (0 marks an empty slot, so the
    buffer is zero-padded like the rows), and `counts[d]` the slots used towards chip d.
    S is the exact worst case (`a2a_slots`). An expert index of -1 is no pair (with sp, an
    expert of another sp coordinate's chips): never sent.

    With `after %chip_counts` (i32 [M, E]: the pairs each of the mesh's M token shards sends to
    each expert, in token order; data parallelism's groups do not see each other's pairs), a
    pair's rank within its expert counts the pairs of the token shards before this chip's
    (`Mesh.token_shard`) first, and only pairs of global rank < C are sent: exactly the pairs
    one chip keeps, so no receiver drops any."""

    name = "ccl.a2a_plan"
    experts_idx = operand_def(TensorType)
    chip_counts = opt_operand_def(TensorType)
    slot_rows = result_def(TensorType)
    slot_experts = result_def(TensorType)
    counts = result_def(TensorType)
    axis = prop_def(StringAttr)
    chips = prop_def(IntegerAttr)
    experts = prop_def(IntegerAttr)
    capacity = prop_def(IntegerAttr)
    """0: no capacity."""
    traits = traits_def(Pure())
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = (
        "$experts_idx (`after` $chip_counts^)? `over` $axis attr-dict `:` "
        "type($experts_idx) (`,` type($chip_counts)^)? `->` type($slot_rows) `,` type($slot_experts) `,` type($counts)"
    )

    def __init__(self, experts_idx, axis: str, chips: int, experts: int, capacity: int | None = None,
                 chip_counts=None):
        t, k = shape_of(experts_idx.type)
        slots = a2a_slots(t, k, experts // chips, capacity)
        super().__init__(
            operands=[experts_idx, chip_counts],
            result_types=[TensorType(i32, [t, k]), TensorType(i32, [chips, slots]), TensorType(i32, [chips])],
            properties={**_axis_props(axis, chips), "experts": IntegerAttr(experts, i64),
                        "capacity": IntegerAttr(capacity or 0, i64)})

    @property
    def experts_per_chip(self) -> int:
        return self.experts.value.data // self.group_size

    @property
    def capacity_limit(self) -> int | None:
        return self.capacity.value.data or None

    @property
    def slots(self) -> int:
        return shape_of(self.slot_experts.type)[1]

    def verify_(self) -> None:
        self._verify_group()
        e, n = self.experts.value.data, self.group_size
        expect(e >= 1 and e % n == 0, f"{e} experts do not divide over {n} chips")
        expect(self.capacity.value.data >= 0, "capacity must not be negative")
        shape = shape_of(self.experts_idx.type)
        expect(len(shape) == 2 and is_int_type(self.experts_idx.type.get_element_type()),
               f"expert indices {format_type(self.experts_idx.type)} are not i32 [T, K]")
        t, k = shape
        slots = a2a_slots(t, k, e // n, self.capacity_limit)
        expect(self.slot_rows.type == TensorType(i32, [t, k]), f"slot_rows must be i32 [{t}, {k}]")
        expect(self.slot_experts.type == TensorType(i32, [n, slots]),
               f"slot_experts must be i32 [{n}, {slots}] (the worst case: a2a_slots)")
        expect(self.counts.type == TensorType(i32, [n]), f"counts must be i32 [{n}]")
        if self.chip_counts is not None:
            shape = shape_of(self.chip_counts.type)
            expect(len(shape) == 2 and shape[1] == e and self.chip_counts.type.get_element_type() == i32,
                   f"chip_counts {format_type(self.chip_counts.type)} is not i32 [M, {e}]")
            expect(self.capacity_limit is not None, "chip_counts rank pairs for a capacity: give one")


def _pair_shape(slot_rows: SSAValue) -> tuple[int, int]:
    """[T, K] of an all-to-all plan's `slot_rows`, checked to be i32 [T, K]."""
    shape = shape_of(slot_rows.type)
    expect(len(shape) == 2 and slot_rows.type.get_element_type() == i32,  # type: ignore[attr-defined]
           f"slot_rows {format_type(slot_rows.type)} is not i32 [T, K]")
    return shape  # type: ignore[return-value]


@irdl_op_definition
class A2ATokensOp(_A2AOrder):
    """The deduplicated dispatch of an all-to-all plan (DeepEP's): a token's row crosses the
    link once to each chip that owns one of its pairs' slots, and that chip copies it to each
    of the token's slots. From `slot_rows` [T, K] (ccl.a2a_plan's: dest * S + slot, -1 dropped):
    `token_rows[t, d] = d * T + r`, r the token's rank among this chip's tokens with a pair
    bound for chip d (`whole_first`: whole ones first; -1: none), the rows of the token send
    buffer [chips * T]; `slot_tokens[d, s]`
    where the token of slot s towards chip d lands in chip d's token receive buffer
    [chips * T]: me * T + r (me: this chip's place in the group; -1 for an empty slot);
    `counts[d]` the tokens sent to chip d. T rows per destination is the exact worst case
    (every token with a pair there)."""

    name = "ccl.a2a_tokens"
    slot_rows = operand_def(TensorType)
    token_rows = result_def(TensorType)
    slot_tokens = result_def(TensorType)
    counts = result_def(TensorType)
    axis = prop_def(StringAttr)
    chips = prop_def(IntegerAttr)
    traits = traits_def(Pure())
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = (
        "$slot_rows `over` $axis attr-dict `:` type($slot_rows) `->` type($token_rows) `,` type($slot_tokens) "
        "`,` type($counts)"
    )

    def __init__(self, slot_rows: SSAValue, axis: str, chips: int, slots: int, whole_first: bool = False):
        t, _ = shape_of(slot_rows.type)
        super().__init__(
            operands=[slot_rows],
            result_types=[TensorType(i32, [t, chips]), TensorType(i32, [chips, slots]), TensorType(i32, [chips])],
            properties={**_axis_props(axis, chips), **_order_props(whole_first)})

    @property
    def slots(self) -> int:
        return shape_of(self.slot_tokens.type)[1]

    def verify_(self) -> None:
        self._verify_group()
        n = self.group_size
        shape = _pair_shape(self.slot_rows)
        expect(self.token_rows.type == TensorType(i32, [shape[0], n]), f"token_rows must be i32 [{shape[0]}, {n}]")
        slots = shape_of(self.slot_tokens.type)
        expect(len(slots) == 2 and slots[0] == n and self.slot_tokens.type.get_element_type() == i32,
               f"slot_tokens must be i32 [{n}, S]")
        expect(self.counts.type == TensorType(i32, [n]), f"counts must be i32 [{n}]")


@irdl_op_definition
class A2ATokenListsOp(_A2AOrder):
    """A value per pair, listed per token and destination, for a receiver that sums a token's
    pairs itself (`strategy=a2a_sum`). From `slot_rows` [T, K] (ccl.a2a_plan's: dest * S + slot,
    -1 dropped) and `values` [T, K] (an expert index or a weight per pair): `lists[d, r, j]` is
    the value of the j-th kept pair, in k order, of the token of rank r among those with a pair
    bound for chip d (the rows of ccl.a2a_tokens' send buffer, in its order); past a token's last pair, -1
    (integers) or 0 (floats). Kk = min(K, E / chips) entries is the exact worst case (a token's
    K experts are distinct)."""

    name = "ccl.a2a_token_lists"
    slot_rows = operand_def(TensorType)
    values = operand_def(TensorType)
    lists = result_def(TensorType)
    axis = prop_def(StringAttr)
    chips = prop_def(IntegerAttr)
    slots = prop_def(IntegerAttr)
    """S, the plan's slots per destination (slot_rows // S is a pair's destination)."""
    traits = traits_def(Pure())
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = (
        "$slot_rows `,` $values `over` $axis attr-dict `:` type($slot_rows) `,` type($values) `->` type($lists)"
    )

    def __init__(self, slot_rows: SSAValue, values: SSAValue, axis: str, chips: int, slots: int, entries: int,
                 whole_first: bool = False):
        t, _ = shape_of(slot_rows.type)
        element = values.type.get_element_type()  # type: ignore[attr-defined]
        super().__init__(operands=[slot_rows, values], result_types=[TensorType(element, [chips, t, entries])],
                         properties={**_axis_props(axis, chips), "slots": IntegerAttr(slots, i64),
                                     **_order_props(whole_first)})

    @property
    def entries(self) -> int:
        return shape_of(self.lists.type)[2]

    def verify_(self) -> None:
        self._verify_group()
        n = self.group_size
        t, k = _pair_shape(self.slot_rows)
        expect(shape_of(self.values.type) == (t, k), f"values {format_type(self.values.type)} are not [{t}, {k}]")
        expect(self.slots.value.data >= 1, "slots must be positive")
        lists = shape_of(self.lists.type)
        expect(len(lists) == 3 and lists[:2] == (n, t) and 1 <= lists[2] <= k
               and self.lists.type.get_element_type() == self.values.type.get_element_type(),
               f"lists must be [{n}, {t}, Kk] with 1 <= Kk <= {k}, of the values' type")


@irdl_op_definition
class A2AReturnsOp(_A2AOrder):
    """Where an a2a combine's rows come back when each receiver sums the tokens it holds whole
    (`strategy=a2a`; the receiver routes the tokens it received by their lists, laid out as
    ccl.a2a_token_lists lays them). From `slot_rows` [T, K] (ccl.a2a_plan's: dest * S + slot,
    -1 dropped), a token is *whole* when all its kept pairs are bound for one chip, *split* when
    they are bound for several. The receiver of a whole token sums its pairs' rows in k order,
    as one chip's combine does, and sends back one row for every token it received; a split
    token's pairs come back one row each and are summed at home. Results, with `me` this chip's
    place in the group:

    - `pair_slots` [chips, S]: slice d lists the split tokens' pairs bound for d, in slot order,
      as entries of d's received lists (flat, [chips * T * Kk]): (me * T + r) * Kk + j plus one,
      r the token's row in a2a_tokens' send buffer for d and j the pair's place in its list
      there (0: past the last);
    - `pair_counts` [chips]: the split pairs bound for d;
    - `token_returns` [T, 1]: where a whole token's sum lands in the home's receive buffer of
      sums, d * T + r (a2a_tokens' token row; -1: not whole);
    - `pair_returns` [T, K]: where a split token's pair's row lands in the receive buffer of
      pair rows, d * S + its place in slice d (-1: a whole token's pair, or dropped);
    - `sum_counts` [chips]: the rows of d's slice whose sums come back, the head of it: with
      `whole_first` the whole tokens bound for d, else every token sent there (a split one's
      sum crosses unread).

    The token rows r are ccl.a2a_tokens' with the same `whole_first`.

    Kk = `entries` = min(K, E / chips) is the exact worst case (a token's K experts are distinct).

    With `experts %experts_idx` (the pairs' experts, i32 [T, K]) and `local_from = a, local_to = b`,
    the split pairs' tables hold only a wave's pairs (`pair_slots`, `pair_counts`, `pair_returns`;
    the others as without): those whose local expert e mod (E / chips) is in [a, b) (`experts` =
    E), whose blocks a receiver's expert loop computes before the later experts', so that they go
    back while it computes those (shard-experts' waves)."""

    name = "ccl.a2a_returns"
    slot_rows = operand_def(TensorType)
    experts_idx = opt_operand_def(TensorType)
    pair_slots = result_def(TensorType)
    pair_counts = result_def(TensorType)
    token_returns = result_def(TensorType)
    pair_returns = result_def(TensorType)
    sum_counts = result_def(TensorType)
    axis = prop_def(StringAttr)
    chips = prop_def(IntegerAttr)
    entries = prop_def(IntegerAttr)
    experts = opt_prop_def(IntegerAttr)
    local_from = opt_prop_def(IntegerAttr)
    local_to = opt_prop_def(IntegerAttr)
    traits = traits_def(Pure())
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = (
        "$slot_rows (`experts` $experts_idx^)? `over` $axis attr-dict `:` type($slot_rows) (`,` type($experts_idx)^)? "
        "`->` type($pair_slots) `,` type($pair_counts) `,` type($token_returns) `,` type($pair_returns) `,` "
        "type($sum_counts)"
    )

    def __init__(self, slot_rows: SSAValue, axis: str, chips: int, slots: int, entries: int,
                 whole_first: bool = False, wave: tuple[SSAValue, int, int, int] | None = None):
        """`wave`: (the pairs' experts, E, a, b) for the split pairs of local experts [a, b) only."""
        t, k = shape_of(slot_rows.type)
        props = {**_axis_props(axis, chips), "entries": IntegerAttr(entries, i64), **_order_props(whole_first)}
        if wave is not None:
            names = ("experts", "local_from", "local_to")
            props.update({name: IntegerAttr(v, i64) for name, v in zip(names, wave[1:])})
        super().__init__(
            operands=[slot_rows, wave[0] if wave is not None else None],
            result_types=[TensorType(i32, [chips, slots]), TensorType(i32, [chips]), TensorType(i32, [t, 1]),
                          TensorType(i32, [t, k]), TensorType(i32, [chips])],
            properties=props)

    @property
    def slots(self) -> int:
        return shape_of(self.pair_slots.type)[1]

    @property
    def list_entries(self) -> int:
        return self.entries.value.data

    @property
    def wave_of(self) -> tuple[int, int, int] | None:
        """(E, a, b) of a wave's tables (the class docstring); None: every split pair."""
        if self.local_from is None or self.local_to is None or self.experts is None:
            return None
        return self.experts.value.data, self.local_from.value.data, self.local_to.value.data

    def verify_(self) -> None:
        self._verify_group()
        n = self.group_size
        t, k = _pair_shape(self.slot_rows)
        expect(1 <= self.list_entries <= k, f"entries must be in [1, {k}]")
        slots = shape_of(self.pair_slots.type)
        expect(len(slots) == 2 and slots[0] == n and slots[1] >= 1 and self.pair_slots.type.get_element_type() == i32,
               f"pair_slots must be i32 [{n}, S]")
        expect(self.pair_counts.type == TensorType(i32, [n]), f"pair_counts must be i32 [{n}]")
        expect(self.token_returns.type == TensorType(i32, [t, 1]), f"token_returns must be i32 [{t}, 1]")
        expect(self.pair_returns.type == TensorType(i32, [t, k]), f"pair_returns must be i32 [{t}, {k}]")
        expect(self.sum_counts.type == TensorType(i32, [n]), f"sum_counts must be i32 [{n}]")
        given = (self.experts_idx is not None, self.experts is not None, self.local_from is not None,
                 self.local_to is not None)
        expect(all(given) or not any(given), "a wave needs the pairs' experts, experts, local_from and local_to")
        if (wave := self.wave_of) is not None:
            e, a, b = wave
            expect(self.experts_idx.type == TensorType(i32, [t, k]), f"the pairs' experts must be i32 [{t}, {k}]")
            expect(e >= 1 and e % n == 0, f"{e} experts do not divide over {n} chips")
            expect(0 <= a < b <= e // n, f"local experts [{a}, {b}) are not a range of a chip's {e // n}")


GATHER_OR_SCATTER = (AllGatherOp, ReduceScatterOp)
COLLECTIVES = (AllToAllOp, AllToAllStartOp, AllGatherOp, ReduceScatterOp, AllReduceOp)
"""The ops that exchange values between chips (every chip runs each at the same point; an
asynchronous all-to-all at its start, its done being the chip's own wait)."""


def first_all_to_all_done(block: Block) -> AllToAllDoneOp | None:
    """`block`'s first wait for an asynchronous all-to-all: on a mesh chip, the point before
    which work runs while the link moves the dispatch's rows; None where nothing is sent so."""
    return next((op for op in block.ops if isinstance(op, AllToAllDoneOp)), None)


def gathers_over_sp(block: Block) -> bool:
    """Whether a chip (`block`, its function's) gathers its tokens over sp (seed 001's meshes):
    its combine ends in the link's return and sp's reduce-scatter, latency-bound steps at decode."""
    return any(isinstance(op, (AllGatherOp, ReduceScatterOp)) and op.axis_name == "sp" for op in block.ops)



MESH_AXES = ("dp", "ep", "sp", "tp")
"""The mesh axes tcpc knows, outer to inner: data, expert, sequence and tensor parallelism.
sp (seed 001's TP columns, Megatron's sequence parallelism): the chips of an sp group hold
token shards of their own and experts of their own; they all-gather their tokens before the
expert all-to-all (over ep, among the chips of one sp coordinate: a column) and
reduce-scatter the outputs back (passes/mesh/shard_experts.py)."""


class MeshSpecError(ValueError):
    """A mesh spec such as `ep=8` or `dp=2,ep=4` that cannot be used."""


@dataclass(frozen=True)
class Mesh:
    """Named axes with sizes, outer to inner; chip c's coordinates are c in row-major order."""

    axes: tuple[tuple[str, int], ...]

    @staticmethod
    def parse(spec: str) -> Mesh:
        sizes: dict[str, int] = {}
        for item in spec.split(","):
            name, sep, value = item.strip().partition("=")
            name = name.strip()
            if not sep or name not in MESH_AXES:
                raise MeshSpecError(f"mesh '{spec}': expected axes NAME=SIZE with NAME one of {', '.join(MESH_AXES)}")
            if name in sizes:
                raise MeshSpecError(f"mesh '{spec}': axis {name} given twice")
            try:
                size = int(value)
            except ValueError:
                raise MeshSpecError(f"mesh '{spec}': {name} = {value.strip()!r} is not an integer") from None
            if size < 1:
                raise MeshSpecError(f"mesh '{spec}': {name} must be positive, got {size}")
            sizes[name] = size
        return Mesh(tuple((a, sizes[a]) for a in MESH_AXES if a in sizes))

    def size(self, axis: str) -> int:
        return dict(self.axes).get(axis, 1)

    @property
    def chips(self) -> int:
        return math.prod(s for _, s in self.axes)

    def coordinates(self, chip: int) -> dict[str, int]:
        coords: dict[str, int] = {}
        for name, size in reversed(self.axes):
            coords[name] = chip % size
            chip //= size
        return coords

    def chip_at(self, coords: dict[str, int]) -> int:
        chip = 0
        for name, size in self.axes:
            chip = chip * size + coords.get(name, 0)
        return chip

    @property
    def token_shards(self) -> int:
        """How many ways the tokens split: over dp, ep and sp; the tp chips of a group share them."""
        return self.size("dp") * self.size("ep") * self.size("sp")

    def token_shard(self, chip: int) -> int:
        """Which share of the tokens `chip` holds (dp outer, then ep, sp inner: token order, so
        an sp group's all-gather puts its tokens in token order)."""
        coords = self.coordinates(chip)
        return (coords.get("dp", 0) * self.size("ep") + coords.get("ep", 0)) * self.size("sp") + coords.get("sp", 0)

    @property
    def expert_shards(self) -> int:
        """How many ways the experts split: over ep and sp (every dp group holds them all)."""
        return self.size("ep") * self.size("sp")

    def expert_shard(self, chip: int) -> int:
        """Which share of the experts `chip` holds: sp outer, ep inner, so the ep chips of one
        sp coordinate (the all-to-all's group) hold E / sp consecutive experts."""
        coords = self.coordinates(chip)
        return coords.get("sp", 0) * self.size("ep") + coords.get("ep", 0)

    def group(self, chip: int, axis: str) -> list[int]:
        """The chips that differ from `chip` only along `axis`, in coordinate order."""
        coords = self.coordinates(chip)
        return [self.chip_at({**coords, axis: i}) for i in range(self.size(axis))]

    def __str__(self) -> str:
        return ",".join(f"{a}={s}" for a, s in self.axes)


CCL = Dialect("ccl", [AllToAllOp, AllToAllStartOp, AllToAllDoneOp, AllGatherOp, ReduceScatterOp, AllReduceOp, ChipIdOp, A2APlanOp, A2ATokensOp, A2ATokenListsOp, A2AReturnsOp], [])
