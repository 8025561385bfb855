"""Phases of an MoE layer, marked on the engine ops the lowering passes emit.

Every `ve` and `tcp` op a lowering pass creates carries a discardable attribute naming the part
of the layer it belongs to, `{tcpc.phase = "experts"}` (printed at the end of the op's line),
and the simulator reports cycles by phase from it (runtime_sim/report.py). The phases:

| phase | ops | set by |
|---|---|---|
| `router` | the router's scores (matmul, softmax or sigmoid, bias), every top-k, the routing weights (renormalisation, scaling) | lower-topk; lower-math by data flow |
| `routing` | one-hot, histogram, cumsums, `scatter_idx`, `expert_ids` | lower-routing |
| `dispatch` | the scatter of tokens into blocks | lower-dispatch (moe.dispatch) |
| `experts` | weight gathers, guarded contractions, row masks, and the activation between grouped matmuls | lower-dispatch (moe.grouped_matmul); lower-math by data flow |
| `combine` | the gather back to tokens, the weighted sum over K | lower-dispatch (moe.combine) |
| `other` | everything else: a shared expert, the sum of routed and shared outputs, casts of the result | lower-math by data flow; ops without the attribute |

lower-math lowers graph-level `tmath` ops, which have no phase of their own; it takes one from
their neighbours (`math_phases`): a `tmath` op both fed by and feeding `experts` ops is
`experts` (SwiGLU between the grouped matmuls); one connected, through other `tmath` ops, to a
`router` op (a top-k it feeds or reads) is `router`; any other is `other`. A `tmath` op that
already carries `tcpc.phase` keeps it.
"""

from __future__ import annotations

from collections.abc import Iterable

from xdsl.dialects.builtin import ModuleOp, StringAttr
from xdsl.ir import Operation

PHASE_ATTR = "tcpc.phase"
PHASES: tuple[str, ...] = ("router", "routing", "dispatch", "experts", "combine", "other")
OTHER = "other"

_MOE_PHASES = {
    "moe.topk": "router",
    "moe.scatter": "routing",
    "moe.route": "routing",
    "moe.dispatch": "dispatch",
    "moe.grouped_matmul": "experts",
    "moe.combine": "combine",
}
"""Graph-level MoE ops, before they are lowered, belong to the phase their lowering marks."""


def phase_of(op: Operation) -> str | None:
    """The op's `tcpc.phase`, the phase of a graph-level MoE op, or None."""
    attr = op.attributes.get(PHASE_ATTR)
    if isinstance(attr, StringAttr):
        return attr.data
    return _MOE_PHASES.get(op.name)


def mark(ops: Iterable[Operation], phase: str) -> None:
    """Give every `ve` and `tcp` op of `ops` the phase, unless it has one."""
    for op in ops:
        if op.name.startswith(("ve.", "tcp.")) and PHASE_ATTR not in op.attributes:
            op.attributes[PHASE_ATTR] = StringAttr(phase)


def _is_math(op: Operation) -> bool:
    return op.name.startswith("tmath.")


def math_phases(module: ModuleOp) -> dict[Operation, str]:
    """The phase of every `tmath` op of `module`, from the phases of the ops it connects to
    through other `tmath` ops (see the module docstring)."""
    ops = [op for op in module.walk() if _is_math(op)]
    up: dict[Operation, set[str]] = {}
    for op in ops:  # program order: every producer comes first
        seen: set[str] = set()
        for operand in op.operands:
            owner = operand.owner
            if isinstance(owner, Operation):
                if owner in up:
                    seen |= up[owner]
                elif (p := phase_of(owner)) is not None:
                    seen.add(p)
        up[op] = seen
    down: dict[Operation, set[str]] = {}
    for op in reversed(ops):
        seen = set()
        for result in op.results:
            for use in result.uses:
                user = use.operation
                if user in down:
                    seen |= down[user]
                elif (p := phase_of(user)) is not None:
                    seen.add(p)
        down[op] = seen
    phases: dict[Operation, str] = {}
    for op in ops:
        given = phase_of(op)
        if given is not None:
            phases[op] = given
        elif "experts" in up[op] and "experts" in down[op]:
            phases[op] = "experts"
        elif "router" in up[op] | down[op]:
            phases[op] = "router"
        else:
            phases[op] = OTHER
    return phases
