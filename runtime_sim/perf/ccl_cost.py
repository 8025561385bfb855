"""Costs of the `ccl` ops: the local plan on the vector engine, the collectives on the link.

A collective's time depends on what every chip of its group sends, which one chip's trace does
not know, so its cost here is provisional (zero cycles on the chip's `link`) and `link_parts`
gives the real one once the mesh simulation (mesh_simulate.py) has every chip's traffic. The
link model (mesh_machine.py; numbers in machines/rngd_pcie.toml):

    a step of a collective takes  latency + max(bytes sent, bytes received) / bytes_per_cycle
    on a chip's link (full duplex: sends and receives use the two directions of its one
    link, and all of a chip's messages of a step share them); below latency x bytes_per_cycle
    bytes (60 KB on rngd_pcie) the latency is the larger part: the latency-bound regime of a
    decode step's all-to-alls, which the report marks;
- all_to_all: one step, each chip sending its rows for every other chip directly (through the
  switch); only the rows that hold data cross (the `rows` operand), a chip's own slice stays
  on chip; an asynchronous one (`ccl.all_to_all_start`) costs the same on the link, and its
  `ccl.all_to_all_done` is free (a view of the received rows: the chip's commands that read
  them wait for the link, the others do not); a chip that sends no row and, by the op's
  `expects`, knows none comes (a2a's split pairs going home under balanced routing) skips it:
  no step, no wait for the group, only the check of its counts (the machine's guard cycles,
  as a guarded block's skip costs);
- all_gather, reduce_scatter: the ring algorithm, N - 1 steps of one chip's share each
  (Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms", JPDC 2009), or with `direct`
  one step, a share sent to each other chip as an all-to-all sends its slices (the same bytes
  on each link, one latency: the one-shot algorithm of latency-bound sizes); all_reduce is a
  reduce_scatter then an all_gather, 2 (N - 1) steps; whichever axis a gather or scatter
  splits (`dim`), a share is 1 / N of the bytes; with `rows` (all_reduce, reduce_scatter) only
  the slices' data rows count (the tensor-parallel reduction of a receive buffer: its empty slots are not sent). The additions of a reduction run on the
  receiving chip's vector engine, overlapped with the transfer (not charged; an assumption).
- A collective is synchronous: it starts on every chip of its group when the last one reaches
  it and ends when the slowest chip's link is done, so a chip that receives more (skewed
  routing) holds up the whole group.

`ccl.a2a_plan` is index work on the vector engine, charged as the lowered routing's equivalent
with chips for experts (lower-routing's pair cumsum over [T*K, chips] and five elementwise
invocations over it: one-hot, mask, rank gather, row, slot expert); `ccl.a2a_tokens` likewise
(a cumsum over [T, chips] and three invocations over [T*K, chips]: one-hot, any over K, the
slots' token rows), and `ccl.a2a_token_lists` (the same, with a cumsum over K for a pair's
place in its token's list). Each cumsum along T*K or T runs chunked as lower-routing's does
(`chunked_cumsum_cycles`): with a few chips for rows, one scan of T*K steps would leave all but
a few of the vector engine's lanes idle (Qwen3-30B-A3B on 2 chips, a chunk of 2,048 tokens: one
plan's scan 16,384 steps, chunked 64 chunks of 256 and 2 x 64).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from xdsl.ir import Operation

from dialects import ccl
from dialects.tensor_types import shape_of
from runtime_sim.perf.cost_model import LINK, OpCost, free_cost, register_cost, register_data_operands, register_view
from target.machine import Machine
from target.mesh_machine import MeshMachine
from runtime_sim.perf.vector_cost import scan_cycles, vector_chain_cycles
from target.chunked_scan import scan_chunks, scan_rows_of

PLAN_STREAMS = 5
"""Elementwise vector invocations over [T*K, chips] charged for one `ccl.a2a_plan`."""


def chunked_cumsum_cycles(machine: Machine, rows: int, steps: int) -> tuple[int, str]:
    """Cycles of a cumsum over `rows` rows of `steps` as lower-routing's `chunked_cumsum` runs it:
    in S chunks (`scan_chunks`) side by side, [S * rows] rows of steps / S, then the chunks'
    totals' cumsum and sum (S steps each) and the offsets added back (one invocation over all
    the elements); one scan where S is 1. The same i32 adds of the same counts."""
    chunks = scan_chunks(steps, rows, scan_rows_of(machine))
    if chunks == 1:
        return scan_cycles(machine, rows, steps)
    scan, bound = scan_cycles(machine, chunks * rows, steps // chunks)
    totals, _ = scan_cycles(machine, rows, chunks)
    add, _ = vector_chain_cycles(machine, rows * steps, alu="int", alus_used=1)
    return scan + 2 * totals + add, bound


def cost_a2a_plan(op: Operation, operands: tuple[Any, ...], results: tuple[Any, ...], machine: Machine) -> OpCost:
    assert isinstance(op, ccl.A2APlanOp)
    t, k = shape_of(op.experts_idx.type)
    n = op.group_size
    stream, _ = vector_chain_cycles(machine, t * k * n, alu="int", alus_used=1)
    scan, bound = chunked_cumsum_cycles(machine, n, t * k)
    return OpCost("tensor", PLAN_STREAMS * stream + scan, bytes_moved=4 * (PLAN_STREAMS + 1) * 2 * t * k * n,
                  bound=bound)


TOKEN_STREAMS = 3
"""Elementwise vector invocations over [T*K, chips] charged for one `ccl.a2a_tokens`."""
LIST_STREAMS = 2
"""... and for one `ccl.a2a_token_lists` (a pair's destination one-hot, the lists' values)."""


def _rank_scans(op: ccl.A2ATokensOp | ccl.A2ATokenListsOp | ccl.A2AReturnsOp, machine: Machine) -> tuple[int, str]:
    """The token ranks' cumsum over [T, chips], or with `whole_first` over [T, 2 chips] (the
    whole tokens' and the split ones' side by side, one invocation), and what bounds it."""
    t, _ = shape_of(op.slot_rows.type)
    return chunked_cumsum_cycles(machine, (2 if op.whole_first is not None else 1) * op.group_size, t)


def cost_a2a_tokens(op: Operation, operands: tuple[Any, ...], results: tuple[Any, ...], machine: Machine) -> OpCost:
    """Index work as `ccl.a2a_plan`'s: each pair's destination one-hot over the chips and its
    any over K, the token rank (a cumsum over [T, chips]) and the slots' token rows."""
    assert isinstance(op, ccl.A2ATokensOp)
    t, k = shape_of(op.slot_rows.type)
    n = op.group_size
    stream, _ = vector_chain_cycles(machine, t * k * n, alu="int", alus_used=1)
    scan, bound = _rank_scans(op, machine)
    return OpCost("tensor", TOKEN_STREAMS * stream + scan, bytes_moved=4 * (TOKEN_STREAMS + 1) * 2 * t * k * n,
                  bound=bound)


def cost_a2a_token_lists(op: Operation, operands: tuple[Any, ...], results: tuple[Any, ...],
                         machine: Machine) -> OpCost:
    """Index work as `ccl.a2a_tokens`': each pair's destination one-hot over the chips, its
    place in its token's list there (a cumsum over K), the token rank (a cumsum over [T, chips])
    and the lists' values."""
    assert isinstance(op, ccl.A2ATokenListsOp)
    t, k = shape_of(op.slot_rows.type)
    n = op.group_size
    stream, _ = vector_chain_cycles(machine, t * k * n, alu="int", alus_used=1)
    scan, bound = _rank_scans(op, machine)
    over_k, _ = scan_cycles(machine, t * n, k)
    return OpCost("tensor", LIST_STREAMS * stream + scan + over_k, bytes_moved=4 * (LIST_STREAMS + 2) * 2 * t * k * n,
                  bound=bound)


RETURN_STREAMS = 4
"""... and for one `ccl.a2a_returns` (a pair's destination one-hot, the chips per token, the
token and pair tables' values)."""


def cost_a2a_returns(op: Operation, operands: tuple[Any, ...], results: tuple[Any, ...], machine: Machine) -> OpCost:
    """Index work as `ccl.a2a_token_lists`': each pair's destination one-hot over the chips,
    whether a token's pairs sit on one chip, a pair's place in its token's list (a cumsum over
    K), the tokens' and the split pairs' ranks per destination (two cumsums over [T, chips] and
    over [T*K, chips]) and the tables' values; a wave's, one stream more (its pairs' experts'
    range)."""
    assert isinstance(op, ccl.A2AReturnsOp)
    t, k = shape_of(op.slot_rows.type)
    n = op.group_size
    streams = RETURN_STREAMS + (op.wave_of is not None)
    stream, _ = vector_chain_cycles(machine, t * k * n, alu="int", alus_used=1)
    tokens, bound = _rank_scans(op, machine)
    pairs, _ = chunked_cumsum_cycles(machine, n, t * k)
    over_k, _ = scan_cycles(machine, t * n, k)
    return OpCost("tensor", streams * stream + tokens + pairs + over_k,
                  bytes_moved=4 * (streams + 3) * 2 * t * k * n, bound=bound)


def _row_bytes(value: Any) -> int:
    shape = np.shape(value)
    return int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(value.dtype).itemsize


ALL_TO_ALLS = (ccl.AllToAllOp.name, ccl.AllToAllStartOp.name)
"""The collectives whose messages go to every chip of the group directly (one step)."""


@dataclass(frozen=True)
class Traffic:
    """What one chip sends in one collective: bytes to each chip of its group (own slot 0)."""

    op: str
    sent: tuple[int, ...]
    me: int
    steps: int
    skips: bool = False
    """The chip sends nothing and knows nothing comes (an all-to-all's `expects`): it skips the
    collective."""
    direct: bool = False
    """A gather or scatter in one step, each chip sending to every other (`ccl._GatherOrScatter`)."""


def traffic(op: Operation, operands: tuple[Any, ...], group: int, me: int) -> Traffic:
    """The bytes this chip sends to each chip of the group in `op`."""
    x = operands[0]
    if isinstance(op, ccl.AllToAllExchange):
        per_row = _row_bytes(x[0]) if np.ndim(x) > 1 else np.dtype(x.dtype).itemsize
        if op.rows is not None:
            rows = [int(r) for r in np.asarray(operands[1])]
        else:
            rows = [int(np.shape(x)[1]) if np.ndim(x) > 1 else 1] * group
        sent = [0 if d == me else rows[d] * per_row for d in range(group)]
        expected = [int(r) for r in np.asarray(operands[2])] if op.expects is not None else None
        skips = expected is not None and not any(r for d, r in enumerate(rows) if d != me) and not any(
            r for s, r in enumerate(expected) if s != me)
        return Traffic(op.name, tuple(sent), me, 1, skips)
    share = int(np.prod(np.shape(x), dtype=np.int64)) * np.dtype(x.dtype).itemsize
    if isinstance(op, (ccl.AllReduceOp, ccl.ReduceScatterOp)) and op.rows is not None:  # only the slices' data rows
        share = sum(int(r) for r in np.asarray(operands[1])) * _row_bytes(x[0])
    if isinstance(op, (ccl.ReduceScatterOp, ccl.AllReduceOp)):
        share //= group
    if isinstance(op, ccl.GATHER_OR_SCATTER) and op.is_direct:  # one step: a share to every other chip
        return Traffic(op.name, tuple(0 if d == me else share for d in range(group)), me, 1, direct=True)
    steps = (group - 1) * (2 if isinstance(op, ccl.AllReduceOp) else 1)
    # A ring: each step a chip sends one share to its successor and receives one.
    nxt = (me + 1) % group
    sent = [share * steps if (d == nxt and group > 1) else 0 for d in range(group)]
    return Traffic(op.name, tuple(sent), me, steps)


def received_bytes(group: list[Traffic], me: int) -> int:
    """The bytes chip `me` (its place in `group`) receives in one collective: what every chip
    sends it (an all-to-all, a direct gather or scatter); a ring receives what it sends."""
    t = group[me]
    if t.op in ALL_TO_ALLS or t.direct:
        return sum(g.sent[me] for g in group)
    return sum(t.sent)


def link_parts(mesh: MeshMachine, group: list[Traffic], me: int) -> tuple[int, int]:
    """Chip `me`'s link (its place in `group`) in one collective: the steps' latency and the
    transfer of its bytes, in cycles. Every step pays the latency however few bytes it moves
    (an all-to-all's messages to the other chips start together: one step), so a small
    collective is latency-bound."""
    t = group[me]
    received = received_bytes(group, me)
    if len(group) == 1:
        return 0, 0
    if t.skips:
        return 0, mesh.chip.guard_cycles
    return _link_time(mesh, t.steps, max(sum(t.sent), received))


def _link_time(mesh: MeshMachine, steps: int, volume: int) -> tuple[int, int]:
    """A link's latency over `steps` and its transfer of `volume` bytes, in cycles."""
    return steps * mesh.link_latency_cycles, int(np.ceil(volume / mesh.link_bytes_per_cycle))


def least_link_cycles(mesh: MeshMachine, t: Traffic) -> int:
    """The fewest cycles chip's link takes in a collective from its own traffic `t` alone:
    `link_parts` with none of the group's bytes received (the collective lasts as long as the
    busiest link of its group, its wait besides)."""
    if len(t.sent) == 1:
        return 0
    if t.skips:
        return mesh.chip.guard_cycles
    return sum(_link_time(mesh, t.steps, sum(t.sent)))


def provisional_cost(op: Operation, operands: tuple[Any, ...], results: tuple[Any, ...], machine: Machine) -> OpCost:
    """Zero cycles on the link until the mesh simulation knows every chip's traffic."""
    return OpCost(LINK, 0, bound="link")


def _count_operands(op: Operation) -> tuple[Any, ...]:
    """The operands whose values a collective's cost reads: its `rows` and an all-to-all's
    `expects`."""
    counts = (op.rows, op.expects if isinstance(op, ccl.AllToAllExchange) else None)  # type: ignore[attr-defined]
    return tuple(v for v in counts if v is not None)


def register_ccl_costs() -> None:
    """The cost of every `ccl` op, and the operand whose values an all-to-all's cost reads."""
    register_cost(ccl.A2APlanOp)(cost_a2a_plan)
    register_cost(ccl.A2ATokensOp)(cost_a2a_tokens)
    register_cost(ccl.A2ATokenListsOp)(cost_a2a_token_lists)
    register_cost(ccl.A2AReturnsOp)(cost_a2a_returns)
    register_cost(*ccl.COLLECTIVES)(provisional_cost)
    register_cost(ccl.ChipIdOp)(free_cost)
    register_view(ccl.AllToAllDoneOp)
    for op in (ccl.AllToAllOp, ccl.AllToAllStartOp, ccl.AllReduceOp, ccl.ReduceScatterOp):
        register_data_operands(op, _count_operands)
