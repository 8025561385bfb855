"""Cost of every `ve` op: which stage of the vector-engine chain runs it, at which rate.

The formulas are vector_cost.py's; this module decides, per op, the stage, its rate class
(`int`: 8 elements per cycle per slice; `float`: 4) and the shape of the work. Sources: the
furiosa-opt book, "Intra-Slice Chain" (stage table with each stage's way, the ALU classes of
the Logic, Fxp, Float and Clip clusters, Reinterpret, operand sources), "Intra-Slice Reduce",
"Cast Engine", "Fetch Engine"; summarised in docs/hardware.md#vector-engine. An op on its own
is costed as one chain invocation of its own (configuration overhead + one stage of latency +
the stream); ops that the `fuse-ve-chains` pass grouped into a `ve.chain` (legal by the stage
table of dialects/ve_stages.py) are costed together as ONE invocation (`chain_cost`): the
overhead once, each member's stage latency, one pass at the slowest member's rate, and only the
chain's inputs and result as SRAM traffic.

| op | stage (ALU) | rate | cost |
|---|---|---|---|
| `and or xor shl shr_u shr_s` | Logic (LogicAnd/Or/Xor/Lshift/Rshift) | 8-way | stream |
| `add sub mul` on i32 | Fxp (FxpAdd, FxpMul) | 8-way | stream |
| `add sub mul` on f32 | Float (FpFma, FpMul0) | 4-way | stream, 1 FLOP per element |
| `div` | FpDiv (dedicated divider) | 4-way | stream, 1 FLOP per element |
| `exp` | Float (FpExp) | 4-way | stream, 1 FLOP per element |
| `sigmoid`, and any later unary float op (`log sqrt tanh ...`) | Float (FpFpu) | 4-way | stream, 1 FLOP per element |
| `max min` (i32 and f32) | Clip (ClipMax, ClipMin) | 8-way | stream |
| `tag` | Tag (entry stage, comparisons) | 8-way | stream |
| `select` | a tag-guarded operand slot of a Logic pass | 8-way | stream |
| `fxp_to_fp`, `fp_to_fxp` | FxpToFp, FpToFxp | 8-way | stream |
| `narrow` (f32 -> bf16) | Cast Engine (one flit per cycle) | 8-way | stream |
| `widen` (bf16 -> f32) | Fetch Adapter cast (assumption: one flit per cycle, like the Cast Engine) | 8-way | stream |
| `widen_low` (f8e4m3, f8e5m2, f4e2m1, e8m0 -> f32) | fetch lookup table (f4e2m1 -> f8) and cast path (a `ConversionOp`; assumption: one flit per cycle) | 8-way | stream |
| `narrow_low` (f32 -> f8e4m3, f8e5m2) | Cast Engine (a `ConversionOp`) | 8-way | stream |
| `lookup` (u3 codes -> f32 entries of an 8-entry table) | the Logic stage cuts the 3-bit fields out of their bytes (shift, and), the fetch stage's table looks them up (book, Fetch Adapter: byte-aligned keys; assumption: one flit per cycle, the keys not written back) | 8-way | stream |
| `reduce_sum reduce_max reduce_min` | IntraSliceReduce (accumulator tree) | 4-way | stream + first output after n steps of the reduced axis |
| `scan` | Fxp add (i32) or Clip add/max/min (f32 add, max, min) with a guarded register-file operand | 8 rows per slice | time-axis scan: n cycles per round of rows |
| `filter` | Filter | 8-way | stream + the Filter stage's packing latency (machine file, assumption) |
| `const` | an immediate register (three per pass) | free | no cycles, no SRAM: the splat rides in the consumer's constant slot |
| `iota`, `position_tag` | static tables placed in DM by the loader | free | no cycles, no SRAM counted: one line of n values, fetched with zero strides along the other axes |
| `bitcast` | Reinterpret: no instruction, no ALU | free | a view of its input |
| `broadcast` | the consumer's fetch sequencer (a stride-0 axis) or VRF operand indexer ("an axis the stream has and the operand does not is a broadcast") | free | a view of its input; the consumer streams the full broadcast shape |
| `repeat` | the consumer's fetch sequencer: each element read `times` times (a stride-0 inner axis; a ragged last group a second, shorter walk: assumption) | free | a view of its input, as `broadcast` |
| `chain` | its members' stages (dialects/ve_stages.py), one invocation | slowest member | overhead once + every member's latency + one pass of the data (vector_cost.py) |
| `yield` | the end of a chain | free | no instruction |

Decisions behind the table:
- *const is free.* The book gives each pass three immediate registers; a `ve.const` is a
  splat, so it never needs DM: no cycles, no SRAM, and a consumer reads no bytes for it.
- *iota and position_tag are static tables.* The position-tag generators of the Tag stage
  (AxisToggle, ValidCount) are not usable today (book, Tag), so a static branch log is a table
  written once at load time, like a weight: no cycles. Only one line along the op's axis
  differs (positions 0..n-1, or first/middle/last tags); the consumer's fetch sequencer walks
  it with zero strides along the other axes, as for `broadcast`. That line (n values) is too
  small to count, so the memory plan gives tables no SRAM. A consumer still streams every
  element it reads from a table (its bytes count), unlike a const.
- *broadcast is a view.* The fetch sequencer walks a tensor as (size : stride) axes and the
  VRF operand indexer broadcasts missing axes, so tiling needs no pass of its own; the
  consumer's cost already counts every element of the broadcast shape.
- *i32 reductions run 4-way* like float ones: the stage table gives IntraSliceReduce one way.
- *f32 max/min run 8-way*: the Clip cluster takes f32 (book, Clip Cluster).
- *scan*: the carried accumulator needs the scanned axis on Time, so a round of up to
  slices x 8 independent rows takes n cycles for an axis of n (the cumsum of the book's MoE
  chapter, docs/hardware.md#vector-engine).

A later ve op gets a cost without touching this file when it belongs to a family: a subclass
of `ve.UnaryFloatOp` is a Float-cluster stream, of `ve.LogicOp` a Logic stream, of
`ve.ReduceOp` a reduction, of `ve.ConversionOp` an 8-way conversion, of `ve.BinaryOp` an
arithmetic stream whose rate follows the element type. tests/test_ve_cost.py fails, naming
them, for any `ve` or `tcp` op left without a cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from xdsl.dialects.builtin import Float32Type, TensorType
from xdsl.ir import BlockArgument, Operation, SSAValue

from dialects import ve
from dialects.tensor_types import shape_of
from runtime_sim.perf.cost_model import (
    TENSOR,
    OpCost,
    free_cost,
    register_cost,
    register_fused,
    register_unbuffered,
    register_view,
)
from target.machine import Machine
from runtime_sim.perf.vector_cost import AluClass, ChainStage, chain_invocation_cycles, scan_cycles
from runtime_sim.semantics.numerics import stored_nbytes

Rate = Literal["int", "float", "by type"]
"""`int`: 8-way; `float`: 4-way; `by type`: 8-way on i32, 4-way on f32."""
Kind = Literal["stream", "reduce", "scan", "filter", "slot", "table", "view", "chain", "end"]


@dataclass(frozen=True)
class VeCost:
    """How one `ve` op runs: the chain stage (and ALU) it uses, its rate, the shape of its
    work, and whether it does float arithmetic (counted as one FLOP per result element)."""

    stage: str
    rate: Rate
    kind: Kind
    flops: Literal["none", "f32", "always"] = "none"
    """`f32`: one FLOP per result element when the op's element type is f32."""


_LOGIC = VeCost("Logic", "int", "stream")
_ARITH = VeCost("Fxp (i32) / Float (f32)", "by type", "stream", flops="f32")
_FLOAT_UNARY = VeCost("Float (FpFpu)", "float", "stream", flops="always")
_CONVERT = VeCost("FxpToFp / FpToFxp", "int", "stream")
_REDUCE = VeCost("IntraSliceReduce", "float", "reduce")

VE_COSTS: dict[str, VeCost] = {
    "ve.and": VeCost("Logic (LogicAnd)", "int", "stream"),
    "ve.or": VeCost("Logic (LogicOr)", "int", "stream"),
    "ve.xor": VeCost("Logic (LogicXor)", "int", "stream"),
    "ve.shl": VeCost("Logic (LogicLshift)", "int", "stream"),
    "ve.shr_u": VeCost("Logic (LogicRshift)", "int", "stream"),
    "ve.shr_s": VeCost("Logic (LogicRshift)", "int", "stream"),
    "ve.add": VeCost("Fxp (FxpAdd) / Float (FpFma)", "by type", "stream", flops="f32"),
    "ve.sub": VeCost("Fxp (FxpAdd) / Float (FpFma)", "by type", "stream", flops="f32"),
    "ve.mul": VeCost("Fxp (FxpMul) / Float (FpMul0)", "by type", "stream", flops="f32"),
    "ve.div": VeCost("FpDiv", "float", "stream", flops="always"),
    "ve.exp": VeCost("Float (FpExp)", "float", "stream", flops="always"),
    "ve.sigmoid": VeCost("Float (FpFpu)", "float", "stream", flops="always"),
    "ve.max": VeCost("Clip (ClipMax)", "int", "stream"),
    "ve.min": VeCost("Clip (ClipMin)", "int", "stream"),
    "ve.tag": VeCost("Tag (comparison)", "int", "stream"),
    "ve.select": VeCost("tag-guarded operand slot", "int", "stream"),
    "ve.fxp_to_fp": VeCost("FxpToFp", "int", "stream"),
    "ve.fp_to_fxp": VeCost("FpToFxp", "int", "stream"),
    "ve.narrow": VeCost("Cast Engine (f32 -> bf16)", "int", "stream"),
    "ve.widen": VeCost("Fetch Adapter cast (bf16 -> f32)", "int", "stream"),
    "ve.lookup": VeCost("Logic (3-bit fields) + Fetch Adapter table lookup", "int", "stream"),
    "ve.reduce_sum": VeCost("IntraSliceReduce (add)", "float", "reduce", flops="f32"),
    "ve.reduce_max": VeCost("IntraSliceReduce (max)", "float", "reduce"),
    "ve.reduce_min": VeCost("IntraSliceReduce (min)", "float", "reduce"),
    "ve.scan": VeCost("Fxp add / Clip add, max, min (carried accumulator)", "int", "scan", flops="f32"),
    "ve.filter": VeCost("Filter", "int", "filter"),
    "ve.const": VeCost("immediate register", "int", "slot"),
    "ve.iota": VeCost("static table in DM", "int", "table"),
    "ve.position_tag": VeCost("static branch log in DM", "int", "table"),
    "ve.bitcast": VeCost("Reinterpret (no instruction)", "int", "view"),
    "ve.broadcast": VeCost("fetch sequencer / VRF indexer broadcast", "int", "view"),
    "ve.repeat": VeCost("fetch sequencer repeat (stride-0 inner axis)", "int", "view"),
    "ve.chain": VeCost("its members' stages, one invocation", "int", "chain"),
    "ve.yield": VeCost("the chain's output (no instruction)", "int", "end"),
}
"""Op name -> how it is costed (the module docstring's table)."""

FAMILIES: tuple[tuple[type[Operation], VeCost], ...] = (
    (ve.UnaryFloatOp, _FLOAT_UNARY),
    (ve.LogicOp, _LOGIC),
    (ve.ReduceOp, _REDUCE),
    (ve.ConversionOp, _CONVERT),
    (ve.BinaryOp, _ARITH),
)
"""Classes whose later members are costed like their family (first match wins)."""


def ve_cost_of(op_class: type[Operation]) -> VeCost | None:
    """The cost description of a `ve` op class: its table entry, else its family's."""
    if op_class.name in VE_COSTS:
        return VE_COSTS[op_class.name]
    for family, cost in FAMILIES:
        if issubclass(op_class, family):
            return cost
    return None


# --------------------------------------------------------------------------------------------
# Cost functions


def _element_is_f32(value: SSAValue) -> bool:
    t = value.type
    return isinstance(t, TensorType) and isinstance(t.get_element_type(), Float32Type)


def _size(value: SSAValue) -> int:
    return math.prod(shape_of(value.type))


def _rate(spec: VeCost, op: Operation) -> AluClass:
    if spec.rate == "by type":
        return "float" if _element_is_f32(op.results[0]) else "int"
    return spec.rate


def _flops(spec: VeCost, op: Operation, count: int) -> int:
    if spec.flops == "always" or (spec.flops == "f32" and _element_is_f32(op.results[0])):
        return count
    return 0


def _read_bytes(op: Operation, operands: tuple[Any, ...]) -> int:
    """Bytes the op reads: every operand, except splats that ride in a constant slot."""
    total = 0
    for operand, value in zip(op.operands, operands):
        if isinstance(operand.owner, ve.ConstOp):
            continue
        total += stored_nbytes(value)
    return total


def _written_bytes(results: tuple[Any, ...]) -> int:
    return sum(stored_nbytes(v) for v in results)


def chain_stage(op: Operation) -> ChainStage:
    """The work `op` does in a chain invocation (alone, or as a member of a `ve.chain`): a
    stream, a reduction or the Filter stage; a reinterpret (bitcast) does none."""
    spec = ve_cost_of(type(op))
    assert spec is not None and spec.kind in _CHAIN_KINDS, f"{op.name} does not run on a chain stage"
    if spec.kind == "view":
        return ChainStage(0, "int", alus_used=0)
    if spec.kind == "reduce":
        shape = shape_of(op.operands[0].type)
        return ChainStage(math.prod(shape), "float", reduce_steps=shape[op.axis.value.data])  # type: ignore[attr-defined]
    if spec.kind == "filter":
        return ChainStage(_size(op.operands[0]), "int", filter_stage=True)
    return ChainStage(_size(op.results[0]), _rate(spec, op))


def op_flops(op: Operation) -> int:
    """The float operations of one chain-stage op: one per element it computes (a reduction:
    one per element it folds in)."""
    spec = ve_cost_of(type(op))
    assert spec is not None
    if spec.kind == "reduce":
        return _flops(spec, op, _size(op.operands[0]) - _size(op.results[0]))
    return _flops(spec, op, _size(op.results[0])) if spec.kind == "stream" else 0


def _chain_stage_cost(op: Operation, operands: tuple[Any, ...], results: tuple[Any, ...], machine: Machine) -> OpCost:
    """A single op: one chain invocation of one stage."""
    cycles, bound = chain_invocation_cycles(machine, [chain_stage(op)])
    return OpCost(TENSOR, cycles, bytes_moved=_read_bytes(op, operands) + _written_bytes(results),
                  flops=op_flops(op), bound=bound)


def _scan_cost(op: Operation, operands: tuple[Any, ...], results: tuple[Any, ...], machine: Machine) -> OpCost:
    spec = VE_COSTS["ve.scan"]
    shape = shape_of(op.operands[0].type)
    axis = op.axis.value.data  # type: ignore[attr-defined]
    n = math.prod(shape)
    steps = shape[axis]
    rows = n // steps if steps else 0
    cycles, bound = scan_cycles(machine, rows, steps, alu="int", alus_used=1)
    return OpCost(TENSOR, cycles, bytes_moved=_read_bytes(op, operands) + _written_bytes(results),
                  flops=_flops(spec, op, n), bound=bound)


def chain_cost(op: Operation, operands: tuple[Any, ...], results: tuple[Any, ...], machine: Machine) -> OpCost:
    """A `ve.chain`: ONE invocation for all its members (vector_cost.chain_invocation_cycles:
    the overhead once, every member's ALU latency, one pass at the slowest member's rate).
    Bytes: what the chain reads from SRAM (every read a member makes of a chain input, as the
    unfused op would count it; constants ride in immediate slots) and the result it writes;
    intermediates stay in the chain."""
    assert isinstance(op, ve.ChainOp)
    members = op.members
    cycles, bound = chain_invocation_cycles(machine, [chain_stage(m) for m in members])
    args = op.body.block.args
    read = sum(int(getattr(operands[v.index], "nbytes", 0))
               for m in members for v in m.operands if isinstance(v, BlockArgument) and v in args)
    return OpCost(TENSOR, cycles, bytes_moved=read + _written_bytes(results),
                  flops=sum(op_flops(m) for m in members), bound=bound)


_CHAIN_KINDS = ("stream", "reduce", "filter", "view")
"""Kinds of work that run on a chain stage (a view only as a member: a reinterpret)."""


def register_ve_op(op_class: type[Operation]) -> bool:
    """Register the cost of one `ve` op class from its table entry or family; False if it has
    neither (the coverage test then names it)."""
    spec = ve_cost_of(op_class)
    if spec is None:
        return False
    if spec.kind in ("slot", "table"):
        register_unbuffered(op_class)
    elif spec.kind == "view":
        register_view(op_class)
    elif spec.kind == "scan":
        register_cost(op_class)(_scan_cost)
    elif spec.kind == "chain":
        register_cost(op_class)(chain_cost)
        register_fused(op_class)
    elif spec.kind == "end":
        register_cost(op_class)(free_cost)
    else:
        register_cost(op_class)(_chain_stage_cost)
    return True


def register_ve_costs() -> list[str]:
    """Register every op of the `ve` dialect; returns the names left without a cost."""
    return [cls.name for cls in ve.VE.operations if not register_ve_op(cls)]

