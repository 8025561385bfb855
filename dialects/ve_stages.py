"""Which stage of the vector-engine chain runs each `ve` op, and which ops may share one
invocation of the chain: the legality table of `ve.chain` and the `fuse-ve-chains` pass.

Source: the furiosa-opt book, "Intra-Slice Chain" (the public furiosa-ai/furiosa-opt
repository's book; summarised in docs/hardware.md#vector-engine). The chain is a fixed sequence of
optional stages; software runs the ones it needs and skips the rest, so one invocation runs
ops whose stages come in this order. Within a stage, each ALU runs at most once per invocation
("Operators sharing the same class cannot fuse into one invocation"); each ALU used adds one
cycle of latency. The book's stage table, with what tcpc adds at either end:

| # | stage | ALUs (book) | `ve` ops | source / assumption |
|---|---|---|---|---|
| 0 | Fetch | the Fetch Adapter's cast and table lookup | `widen` (bf16 -> f32); `widen_low` of f8e4m3, f8e5m2, f4e2m1 values | `widen`: assumption, as in ve_cost.py: bf16 enters a lane as it is fetched, before the chain; `widen_low`: book, Fetch Adapter (f4e2m1 -> f8 by the table, f8 -> f32 by `fetch_cast`, the chain's input stream) |
| 1 | Tag (entry) | up to four comparisons against constants | `tag` with a `ve.const` right operand | book, Tag; one `tag` per chain (two would share one 4-bit tag, and the ops reading it test for 1) |
| 2 | Logic | LogicAnd, LogicOr, LogicXor, LogicLshift, LogicRshift | `and or xor shl shr_u shr_s`; `select`; `lookup` | book, Logic Cluster; `select` (assumption): clear the chosen lanes with a tag-guarded and, then or in the operand: it claims LogicAnd and LogicOr; `lookup` (assumption, ve_cost.py's): the shift and the and that cut each 3-bit code out of its bytes, the table's entry entering the stream there |
| 3 | Fxp | FxpAdd, FxpLshift, FxpMul, FxpRshift | `add sub mul` on i32; `shl shr_u shr_s` when the Logic ALU is taken | book, Fxp Cluster (SubFxp runs on FxpAdd) |
| 4 | FxpToFp | the stage | `fxp_to_fp` | book |
| 5 | Narrow | (8-way -> 4-way, no op of its own) | taken by the float path | book: the Float stage needs it |
| 6 | Float | FpFma, FpFpu, FpExp, FpMul0, FpMul1 | `add sub mul` on f32 (add/sub: FpFma; mul: FpMul0, FpMul1 or FpFma), `exp` (FpExp), `sigmoid log sqrt tanh` (FpFpu), `div` when the FpDiv stage is taken (FpFpu) | book, Float Cluster |
| 7 | IntraSliceReduce | the accumulator tree | `reduce_sum reduce_max reduce_min` | book; the ops after it stream the reduced tensor |
| 8 | FpDiv | the divider | `div` | book |
| 9 | Widen | (4-way -> 8-way, no op of its own) | taken by the float path | book |
| 10 | FpToFxp | the stage | `fp_to_fxp` | book |
| 11 | Clip | ClipAdd, ClipMax, ClipMin | `max min`; `add` (i32 or f32) after the Fxp/Float stage | book, Clip Cluster |
| 12 | Filter | the stage | `filter` | book: the last stage |
| 13 | Cast | the Cast Engine | `narrow` (f32 -> bf16), `narrow_low` (f32 -> f8e4m3, f8e5m2) | book, Cast Engine (its supported casts: f32 -> f8e5m2, f8e4m3, bf16): after the vector engine, before commit (ve_cost.py) |

The book's Narrow and Widen stages switch the lane width (8 -> 4 values per cycle and back);
tcpc's `ve.narrow`, `ve.narrow_low` and `ve.widen` are the casts around the chain (rows 13 and 0).
`bitcast` is the book's Reinterpret: no stage, no ALU, allowed anywhere in a chain.

Never in a chain (they stay outside; members read them as operands):
- `const`: a splat held in an immediate slot of the op that reads it (a chain's constants live
  in its body);
- `iota`, `position_tag`: static tables in DM, read as operands;
- `broadcast`: the fetch sequencer or VRF indexer broadcasts an operand as it reads it; inside
  a chain it would change the stream's shape mid-way;
- `scan`: its carried accumulator needs the scanned axis on Time, a layout of its own.

The rules a chain obeys (`chain_problem`), the ones of the book plus tcpc's choices:
1. every member has a stage (table above), in non-decreasing order, each ALU used once: a member
   with several homes takes the earliest one still free at or after the previous member's stage;
2. the members form one stream: each member after the first reads the previous member's result
   (or, after a `tag`, the value the tag compared) as one operand; its other operands come from
   outside the chain (constants, or tensors read as the unfused op reads them, through the
   register-file operand port), or from the stash: at most one earlier intermediate, read
   once, produced by a member at a stage the book lets stash (`STASHABLE`; `widen`'s result is
   the stream entering the Tag stage, which may stash). Book, Operands: "the slot is
   single-use ... read-once", stashable at Branch, Logic, Fxp, Narrow, Fp, FpDiv, Clip. So
   SwiGLU's `x * sigmoid(x)` after a widen is one chain;
3. tags: a member that reads tags reads the chain's `tag` result, or (without one) one tag tensor
   from outside for the whole chain;
4. only the last member's result leaves the chain: every other member's result is used by
   members only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from xdsl.dialects.builtin import Float32Type, TensorType
from xdsl.ir import Operation, SSAValue

from dialects import ve
from dialects.tensor_types import E8M0

STAGES: tuple[str, ...] = (
    "Fetch", "Tag", "Logic", "Fxp", "FxpToFp", "Narrow", "Float", "IntraSliceReduce", "FpDiv",
    "Widen", "FpToFxp", "Clip", "Filter", "Cast",
)
"""The chain's stages in order; 1..12 are the book's, 0 and 13 the casts around the chain."""


@dataclass(frozen=True)
class Slot:
    """A home of an op in the chain: its stage and the ALUs it claims there."""

    stage: str
    alus: frozenset[str]

    @property
    def position(self) -> int:
        return STAGES.index(self.stage)


def _slot(stage: str, *alus: str) -> Slot:
    """A stage with no ALU choice claims the stage itself (usable once per invocation)."""
    assert stage in STAGES, stage
    return Slot(stage, frozenset(alus or (stage,)))


_FLOAT_FPU = (_slot("Float", "FpFpu"),)

CHAIN_SLOTS: dict[str, tuple[Slot, ...] | dict[str, tuple[Slot, ...]]] = {
    "ve.widen": (_slot("Fetch"),),
    "ve.widen_low": (_slot("Fetch"),),
    "ve.lookup": (_slot("Logic", "LogicRshift", "LogicAnd"),),
    "ve.tag": (_slot("Tag"),),
    "ve.and": (_slot("Logic", "LogicAnd"),),
    "ve.or": (_slot("Logic", "LogicOr"),),
    "ve.xor": (_slot("Logic", "LogicXor"),),
    "ve.shl": (_slot("Logic", "LogicLshift"), _slot("Fxp", "FxpLshift")),
    "ve.shr_u": (_slot("Logic", "LogicRshift"), _slot("Fxp", "FxpRshift")),
    "ve.shr_s": (_slot("Logic", "LogicRshift"), _slot("Fxp", "FxpRshift")),
    "ve.select": (_slot("Logic", "LogicAnd", "LogicOr"),),
    "ve.add": {"i32": (_slot("Fxp", "FxpAdd"), _slot("Clip", "ClipAdd")),
               "f32": (_slot("Float", "FpFma"), _slot("Clip", "ClipAdd"))},
    "ve.sub": {"i32": (_slot("Fxp", "FxpAdd"),), "f32": (_slot("Float", "FpFma"),)},
    "ve.mul": {"i32": (_slot("Fxp", "FxpMul"),),
               "f32": (_slot("Float", "FpMul0"), _slot("Float", "FpMul1"), _slot("Float", "FpFma"))},
    "ve.fxp_to_fp": (_slot("FxpToFp"),),
    "ve.exp": (_slot("Float", "FpExp"),),
    "ve.sigmoid": _FLOAT_FPU,
    "ve.log": _FLOAT_FPU,
    "ve.sqrt": _FLOAT_FPU,
    "ve.tanh": _FLOAT_FPU,
    "ve.div": (_slot("Float", "FpFpu"), _slot("FpDiv")),
    "ve.reduce_sum": (_slot("IntraSliceReduce"),),
    "ve.reduce_max": (_slot("IntraSliceReduce"),),
    "ve.reduce_min": (_slot("IntraSliceReduce"),),
    "ve.fp_to_fxp": (_slot("FpToFxp"),),
    "ve.max": (_slot("Clip", "ClipMax"),),
    "ve.min": (_slot("Clip", "ClipMin"),),
    "ve.filter": (_slot("Filter"),),
    "ve.narrow": (_slot("Cast"),),
    "ve.narrow_low": (_slot("Cast"),),
}
"""Op name -> its homes in the chain, in order of preference (by element type where it matters)."""

NOT_IN_A_CHAIN: dict[str, str] = {
    "ve.const": "a splat in an immediate slot of the op that reads it",
    "ve.iota": "a static table in DM, read as an operand",
    "ve.position_tag": "a static table in DM, read as an operand",
    "ve.broadcast": "a view the operand reader makes; inside a chain it would change the stream's shape",
    "ve.scan": "its carried accumulator needs the scanned axis on Time, a layout of its own",
    "ve.repeat": "a view the operand reader makes, as broadcast; inside a chain it would change the stream's shape",
    "ve.chain": "already a chain",
    "ve.yield": "the end of a chain",
}
"""Op name -> why it never is a member of a chain."""

STASHABLE: frozenset[str] = frozenset({"Fetch", "Tag", "Logic", "Fxp", "Float", "FpDiv", "Clip"})
"""Stages after which the stream may be stashed (the book's Stashable stages; after Fetch the
stream is at the Tag stage). Narrow is stashable too, but no op of tcpc's ends there."""

REINTERPRET = "ve.bitcast"
"""No stage and no ALU: may sit anywhere in a chain (book, Reinterpret)."""


def _element_key(op: Operation) -> str:
    t = op.results[0].type
    assert isinstance(t, TensorType)
    return "f32" if isinstance(t.get_element_type(), Float32Type) else "i32"


E8M0_WIDEN = "an e8m0 scale becomes its f32 power of two by a shift, no fetch-stage table or cast (book, Fetch Adapter)"
"""Why `ve.widen_low` of e8m0 scales stays out of a chain (its f8 and f4 values' widening is the Fetch stage)."""


def chain_slots(op: Operation) -> tuple[Slot, ...] | None:
    """The homes of `op` in the chain; None if it never is a member (or is a reinterpret)."""
    if isinstance(op, ve.WidenLowOp) and op.input.type.get_element_type() == E8M0:  # type: ignore[attr-defined]
        return None
    slots = CHAIN_SLOTS.get(op.name)
    if isinstance(slots, dict):
        return slots[_element_key(op)]
    return slots


def is_chainable(op: Operation) -> bool:
    """`op` may be a member of a chain (it has a stage, or is a reinterpret)."""
    return op.name == REINTERPRET or op.name in CHAIN_SLOTS


def runs_a_stage(op: Operation) -> bool:
    """A member that occupies a stage (everything but a reinterpret)."""
    return op.name in CHAIN_SLOTS


def assign_slots(members: Sequence[Operation]) -> list[Slot | None] | str:
    """Each member's home (None for a reinterpret), or why the members do not fit one chain."""
    position, used = 0, set[str]()
    homes: list[Slot | None] = []
    for op in members:
        if op.name == REINTERPRET:
            homes.append(None)
            continue
        slots = chain_slots(op)
        if slots is None:
            why = E8M0_WIDEN if isinstance(op, ve.WidenLowOp) else NOT_IN_A_CHAIN.get(op.name, "no stage")
            return f"{op.name} never runs in a chain ({why})"
        free = [s for s in slots if s.position >= position and not s.alus & used]
        if not free:
            homes_text = ", ".join(f"{s.stage} ({'/'.join(sorted(s.alus))})" for s in slots)
            return f"{op.name} needs {homes_text}, taken or earlier in the chain than the ops before it"
        home = min(free, key=lambda s: s.position)
        position, used = home.position, used | home.alus
        homes.append(home)
    return homes


def tag_operands(op: Operation) -> tuple[SSAValue, ...]:
    """The operands of `op` that are tag streams (the tags a select or filter reads)."""
    if isinstance(op, ve.SelectOp | ve.FilterOp):
        return (op.tags,)
    return ()


def _stream_problem(members: Sequence[Operation], homes: Sequence[Slot | None]) -> str | None:
    """Rules 2 and 3 of the module docstring."""
    results = {r for op in members for r in op.results}
    home_of = {op.results[0]: home for op, home in zip(members, homes, strict=True) if op.results}
    stream: SSAValue | None = None
    tags: SSAValue | None = None
    stash: SSAValue | None = None
    for i, op in enumerate(members):
        if isinstance(op, ve.TagOp):
            if not isinstance(op.rhs.owner, ve.ConstOp):
                return "ve.tag compares against a stream, not a constant"
            if tags is not None:
                return "a chain has one tag stage"
            if stream is not None and op.lhs is not stream:
                return "ve.tag does not compare the chain's stream"
            stream, tags = op.lhs, op.result
            continue
        tag_reads = tag_operands(op)
        for t in tag_reads:
            if tags is None and t not in results:
                tags = t
            elif t is not tags:
                return f"{op.name} reads other tags than the chain's"
        data = [v for v in op.operands if v not in tag_reads]
        if stream is not None and i > 0 and stream not in data:
            return f"{op.name} does not read the previous op's result"
        inner = [v for v in data if v in results and v is not stream]
        if inner:
            home = home_of.get(inner[0])
            if stash is not None or len(inner) > 1 or home is None or home.stage not in STASHABLE:
                return f"{op.name} reads an intermediate result other than the stream (the stash holds one " \
                       "value of a stashable stage, read once)"
            stash = inner[0]
        stream = op.results[0]
    return None


def _escape_problem(members: Sequence[Operation]) -> str | None:
    """Rule 4: only the last member's result leaves the chain."""
    inside = set(members)
    for op in members[:-1]:
        for r in op.results:
            if any(use.operation not in inside for use in r.uses):
                return f"the result of {op.name} is used outside the chain"
    return None


def chain_problem(members: Sequence[Operation], *, complete: bool = True) -> str | None:
    """Why `members` (in order) cannot run as one invocation of the chain, or None if they can.
    `complete=False` skips rule 4, for a chain still growing (its last result may yet be used
    by the next member)."""
    if not members:
        return "a chain needs at least one op"
    homes = assign_slots(members)
    if isinstance(homes, str):
        return homes
    problem = _stream_problem(members, homes)
    if problem is None and complete:
        problem = _escape_problem(members)
    return problem
