"""The layer's useful work, what the roofline counts: the contractions of its graph-level program
on the routed pairs, not on the blocks the compiler padded them into.

A grouped matmul computes whole blocks of B rows, and an expert's last block holds padding rows
(zero, never read back) unless its pairs fill it. Counted as the lowered commands do it, the
padding inflates the FLOPs with the block: the roofline rose with B and hid the waste. So the roofline counts
the graph's work instead, worked out from the graph-level function once (`graph_work`) and the
routing the run actually had:

- `tmath.matmul` (the router, a shared expert, any dense layer): 2 x the result's elements x
  the contracted size; `lowp.scaled_matmul` the same, at the fp8 rate;
- `moe.grouped_matmul`: 2 x D x F per routed pair (+ F bias adds), `moe.scaled_grouped_matmul`
  the same at the fp8 rate (its bias adds not);
- routed pairs: a routing's [T, K] expert choices as the run had them (the op lower-routing marks
  `tcpc.expert_indices`, which the trace records), each within [0, E) and kept by the capacity
  (the first C pairs of each expert): what the lowered routing places in a block.

Vector-engine work (activations, softmax, the combine's weighted sum) is not counted: the
roofline's compute side is the contraction engine's peak, and at real dims the vector FLOPs are
under 0.1% of the contractions' (Qwen3-30B-A3B, T = 256: 0.07%).

The padding, reported beside the roofline (`Padding`): the contraction FLOPs the commands did
beyond the useful ones (on padding rows: at B = 1 there are none, and every example's commands
do exactly the graph's work, tests/test_roofline.py), and the HBM bytes the expert loop moved
for padding rows. Those are the blocked buffers' tiles in HBM (`tile.store` / `tile.load` of
an experts-phase buffer [G, B, ...] of a routing): every block that runs moves its tile, so over
the run a share (B x blocks run - kept pairs) / (B x blocks run) of those bytes is padding rows
(a whole-buffer move of the whole buffer's bytes, G blocks, the share of G x B rows; one that
moved fewer bytes moved only blocks that ran). Gathers and scatters by row index
skip the padding rows (index -1), and weights do not depend on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from math import prod

import numpy as np
from xdsl.dialects import func
from xdsl.ir import Operation, SSAValue

from dialects import lowp, moe, tcp, tile, tmath
from dialects.annotations import phase_of
from dialects.tensor_types import shape_of, stored_bytes
from runtime_sim.perf.cost_model import CostModelError, in_hbm
from runtime_sim.perf.op_trace import RoutingChoices, TracedOp

CONTRACTIONS: tuple[str, ...] = (tcp.ContractOp.name, tcp.ScaledContractOp.name)
"""The commands whose FLOPs are contraction work (the rest are the vector engine's)."""


@dataclass(frozen=True)
class RoutedWork:
    """One routing (a `moe.scatter`) and the contraction work, per routed pair, of the grouped
    matmuls that use it."""

    route: moe.RouteType
    flops_per_pair: int = 0
    fp8_flops_per_pair: int = 0


@dataclass(frozen=True)
class GraphWork:
    """A graph-level function's contraction work: fixed (dense matmuls) and per routed pair of
    each routing, in program order."""

    dense_flops: int
    dense_fp8_flops: int
    routes: tuple[RoutedWork, ...]


@dataclass(frozen=True)
class RoutedPairs:
    """What one routing of a run put in blocks."""

    work: RoutedWork
    kept: int
    """Pairs in blocks: choices within [0, E), at most C per expert."""
    blocks_run: int
    """Blocks holding a pair: sum over experts of ceil(kept_e / B)."""



@dataclass(frozen=True)
class Padding:
    """Work the commands did on rows that hold no pair; not in the roofline."""

    flops: int
    hbm_bytes: int
    contraction_flops: int
    """Every contraction FLOP the commands did, padding included."""

    @property
    def share(self) -> float:
        """The padding's part of the contraction work."""
        return self.flops / self.contraction_flops if self.contraction_flops else 0.0


@dataclass(frozen=True)
class UsefulWork:
    """The roofline's FLOPs (`fp8_flops` of them at the fp8 rate) and the padding beside it."""

    flops: int
    fp8_flops: int
    padding: Padding


def graph_work(fn: func.FuncOp) -> GraphWork | None:
    """`fn`'s contraction work, or None when it cannot be read from `fn`: contractions already
    lowered (IR below the graph level), a call, or a grouped matmul whose routing is not made
    in `fn`."""
    dense = dense_fp8 = 0
    routes: dict[SSAValue, RoutedWork] = {}
    for op in fn.walk():
        if op.name in CONTRACTIONS or isinstance(op, func.CallOp):
            return None
        if isinstance(op, (moe.ScatterOp, moe.RouteOp)):
            routes[op.route] = RoutedWork(op.route.type)  # type: ignore[arg-type]
        elif isinstance(op, tmath.MatmulOp):
            dense += 2 * prod(shape_of(op.result.type)) * shape_of(op.lhs.type)[-1]
        elif isinstance(op, lowp.ScaledMatmulOp):
            flops = 2 * prod(shape_of(op.result.type)) * shape_of(op.input.type)[-1]
            dense, dense_fp8 = dense + flops, dense_fp8 + flops
        elif isinstance(op, (moe.GroupedMatmulOp, moe.ScaledGroupedMatmulOp)):
            if op.route not in routes:
                return None
            routes[op.route] = _with_pair_work(routes[op.route], op)
    return GraphWork(dense, dense_fp8, tuple(routes.values()))


def _with_pair_work(work: RoutedWork, op: Operation) -> RoutedWork:
    """`work` plus one grouped matmul's FLOPs per pair: 2 x D x F, plus F bias adds."""
    _, d, f = shape_of(op.weight.type)  # type: ignore[attr-defined]
    macs = 2 * d * f
    adds = f if op.bias is not None else 0  # type: ignore[attr-defined]
    fp8 = macs if isinstance(op, moe.ScaledGroupedMatmulOp) else 0
    return RoutedWork(work.route, work.flops_per_pair + macs + adds, work.fp8_flops_per_pair + fp8)


def routed_pairs(work: GraphWork, routings: Sequence[RoutingChoices]) -> list[RoutedPairs]:
    """Each routing's pairs in blocks, from the choices the run recorded (one record per
    routing, in program order). Records that do not match the graph's routings mean the
    simulated IR is not the graph's lowering: a bug (CostModelError), never a roofline."""
    if len(routings) != len(work.routes):
        raise CostModelError(f"the run recorded {len(routings)} routing(s), the graph has {len(work.routes)}")
    pairs = []
    for routed, recorded in zip(work.routes, routings):
        r = routed.route
        experts, block, capacity = r.experts.data, r.block.data, r.capacity_limit
        choices = np.asarray(recorded.choices).reshape(-1)
        if recorded.experts != experts or choices.size != r.tokens.data * r.k.data:
            raise CostModelError(f"the run's routing chose among {recorded.experts} experts for {choices.size} pairs, "
                                 f"the graph's routing {r}")
        counts = np.bincount(choices[(choices >= 0) & (choices < experts)], minlength=experts)
        if capacity is not None:
            counts = np.minimum(counts, capacity)
        pairs.append(RoutedPairs(routed, int(counts.sum()), int((-(-counts // block)).sum())))
    return pairs


def useful_work(work: GraphWork, ops: Sequence[TracedOp], routings: Sequence[RoutingChoices]) -> UsefulWork:
    """The run's useful FLOPs and its padding. Commands that did fewer contraction FLOPs than
    the graph would be a lowering that drops work (a bug), which the roofline must not hide."""
    pairs = routed_pairs(work, routings)
    flops = work.dense_flops + sum(p.kept * p.work.flops_per_pair for p in pairs)
    fp8 = work.dense_fp8_flops + sum(p.kept * p.work.fp8_flops_per_pair for p in pairs)
    done = sum(t.cost.flops for t in ops if t.name in CONTRACTIONS)
    if done < flops:
        raise CostModelError(f"the commands did {done:,} contraction FLOPs, fewer than the graph's {flops:,}")
    return UsefulWork(flops, fp8, Padding(done - flops, padding_hbm_bytes(ops, pairs), done))


def padding_hbm_bytes(ops: Sequence[TracedOp], pairs: Sequence[RoutedPairs]) -> int:
    """HBM bytes the commands moved for padding rows: the experts phase's tiles of a blocked
    buffer in HBM (see the module docstring)."""
    by_layout = {(p.work.route.blocks.data, p.work.route.block.data): p for p in pairs}
    padding = Fraction(0)
    for t in ops:
        op = t.op
        if not t.cost.hbm_bytes or op is None or phase_of(op) != "experts":
            continue
        if isinstance(op, tile.StoreOp) and in_hbm(op.result):
            if tile.guards_parts(op) and tile.guards_rows(op.tile.type, op.guard.type):
                continue  # a guard per row of one block (schedule-experts' row stores): only pairs' rows move
            buffer, moved = op.result.type, op.tile.type
        elif isinstance(op, tile.LoadOp) and in_hbm(op.source):
            buffer, moved = op.source.type, op.result.type
        else:
            continue
        shape = shape_of(buffer)
        p = by_layout.get(shape[:2]) if len(shape) >= 3 else None
        if p is None:
            continue
        g, b = shape[:2]
        # The rows a buffer's moves cover over the run: all of it, or each block that runs (a
        # whole-buffer command that moved fewer bytes than the buffer moved only those blocks:
        # a cluster's store of the blocks it ran, its guessed first weights shifting them).
        whole = shape_of(moved)[0] == g and t.cost.hbm_bytes >= stored_bytes(buffer)
        rows = g * b if whole else p.blocks_run * b
        if rows:
            padding += Fraction(t.cost.hbm_bytes * (rows - p.kept), rows)
    return int(padding)
