"""The IR conventions shared by the passes and the simulator: discardable attributes tcpc
puts on ops and function arguments, and how to read them.

## Phases

Every `ve` and `tcp` op a lowering pass creates carries a discardable attribute naming the part
of the layer it belongs to, `{tcpc.phase = "experts"}` (printed at the end of the op's line),
and the simulator reports cycles by phase from it (runtime_sim/perf/report.py). The phases:

| phase | ops | set by |
|---|---|---|
| `router` | the router's scores (matmul, softmax or sigmoid, bias), every top-k, the routing weights (renormalisation, scaling) | lower-topk; lower-math by data flow |
| `routing` | one-hot, histogram, cumsums, `scatter_idx`, `expert_ids` | lower-routing |
| `dispatch` | the tokens into blocks: each block row's token (a scatter of token numbers), the gather of the tokens' rows (a block's, in the expert loop) | lower-dispatch (moe.dispatch) |
| `experts` | weight gathers, guarded contractions, row masks, and the activation between grouped matmuls | lower-dispatch (moe.grouped_matmul); lower-math by data flow |
| `combine` | the gather back to tokens, the weighted sum over K | lower-dispatch (moe.combine) |
| `shared` | a shared expert (a dense MLP every token goes through), as an expert loop of its own | schedule-shared |
| `other` | everything else: a shared expert before schedule-shared, the sum of routed and shared outputs, casts of the result | lower-math by data flow; ops without the attribute |

lower-math gives graph-level `tmath` ops the phase of their neighbours (see
`passes/lowering/lower_math.py`).

## Expert choices

`lower-routing` marks the op that first reads a scatter's [T, K] expert choices (the view that
lays the pairs along one axis) with `tcpc.expert_indices = E`. An index outside [0, E) matches
no expert there and its pair is dropped (the reference rejects it), so the simulator's caller
can count such choices in a run (tcpc/routing_check.py) without knowing the lowering.

## Routing arguments

A routing argument is a function argument carrying the arg attribute
`tcpc.routing_experts = E`: the [T, K] i32 expert choices of one MoE routing over E experts.
The `pin-routing` pass makes them; cost-only runs fill them from a routing scenario
(`runtime_sim/perf/routing_scenarios.py`).
"""

from __future__ import annotations

from collections.abc import Iterable

from xdsl.dialects import func
from xdsl.dialects.builtin import DictionaryAttr, IntegerAttr, StringAttr, UnitAttr
from xdsl.ir import Operation

PHASE_ATTR = "tcpc.phase"
PHASES: tuple[str, ...] = ("router", "routing", "dispatch", "experts", "combine", "shared", "other")
OTHER = "other"
SHARED = "shared"
"""The phase of a shared expert rewritten as an expert loop (passes/schedule/schedule_shared.py)."""

_MOE_PHASES = {
    "moe.topk": "router",
    "moe.scatter": "routing",
    "moe.route": "routing",
    "moe.dispatch": "dispatch",
    "moe.grouped_matmul": "experts",
    "moe.scaled_grouped_matmul": "experts",
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



EXPERT_INDICES_ATTR = "tcpc.expert_indices"
"""Attribute of the op that first reads a lowered routing's expert choices (operand 0): E."""


def expert_indices(op: Operation) -> int | None:
    """E when `op` reads the expert choices of a lowered routing (`tcpc.expert_indices`)."""
    attr = op.attributes.get(EXPERT_INDICES_ATTR)
    return attr.value.data if isinstance(attr, IntegerAttr) else None


PAIR_SUM_ATTR = "tcpc.pair_sum"
"""Unit attribute of the op that makes a lowered `moe.combine`'s result (lower-dispatch), or a
mesh home chip's sum of the pair rows that came back (shard-experts' a2a, kept by lower-math):
row t is the sum over its pairs, so a row whose indices are all -1 (a token with no pair, such
as a mesh chip's receive slots that nothing filled) is exactly +0.0, whatever the weights."""


def is_pair_sum(op: Operation) -> bool:
    return PAIR_SUM_ATTR in op.attributes


def mark_pair_sum(op: Operation) -> None:
    op.attributes[PAIR_SUM_ATTR] = UnitAttr()


SPACE_ATTR = "tcpc.space"
"""Discardable attribute of an op whose result the compiler placed in HBM (`"hbm"`): the
schedule level puts tensors too large for SRAM there (a dispatch's blocked rows, written by
DMA and read back a block at a time). Results without it are in SRAM."""


def place_in_hbm(op: Operation) -> None:
    op.attributes[SPACE_ATTR] = StringAttr("hbm")


def placed_in_hbm(op: Operation) -> bool:
    attr = op.attributes.get(SPACE_ATTR)
    return isinstance(attr, StringAttr) and attr.data == "hbm"


CLUSTER_ATTR = "tcpc.cluster"
"""Discardable attribute of an engine op: the cluster of the chip whose contraction and vector
engines run it (0 without it). The schedule level splits the expert loop over the clusters."""


def cluster_of(op: Operation) -> int:
    attr = op.attributes.get(CLUSTER_ATTR)
    return attr.value.data if isinstance(attr, IntegerAttr) else 0


def place_on_cluster(op: Operation, cluster: int) -> None:
    op.attributes[CLUSTER_ATTR] = IntegerAttr(cluster, 64)


OWN_DMA_ATTR = "tcpc.own_dma"
"""Discardable unit attribute of an op of one cluster's copy of the expert loop: its DMA
commands run on that cluster's own DMA engines (RNGD: the four beside its DMNs) rather than
on whichever of the chip's engines are free (split-clusters sets it where a block is
compute-bound on its cluster with half the chip's HBM bandwidth)."""


def on_own_dma(op: Operation) -> bool:
    return OWN_DMA_ATTR in op.attributes


def place_on_own_dma(op: Operation) -> None:
    op.attributes[OWN_DMA_ATTR] = UnitAttr()


ROUTING_ATTR = "tcpc.routing_experts"
"""Arg attribute of a routing argument: the number of experts E its indices choose from."""


def routing_arguments(fn: func.FuncOp) -> dict[int, int]:
    """Argument index -> E for every routing argument of `fn`."""
    found: dict[int, int] = {}
    if fn.arg_attrs is None:
        return found
    for i, attrs in enumerate(fn.arg_attrs.data):
        if isinstance(attrs, DictionaryAttr) and ROUTING_ATTR in attrs.data:
            value = attrs.data[ROUTING_ATTR]
            if isinstance(value, IntegerAttr):
                found[i] = value.value.data
    return found
