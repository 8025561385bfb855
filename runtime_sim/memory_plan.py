"""The memory plan: where every buffer lives, for how long, and what to do when SRAM is full.

Placement: function arguments (the layer's inputs and weights) and stored values live in
HBM; every other value an op produces is an SRAM buffer (views share their input's buffer).
SRAM is the cluster's: slices x bytes per slice, counted in bytes (no fragmentation).

Lifetime: in issue order, a buffer is resident from the command that writes it (its producer,
or a reload) to its last reader; the function's results stay to the end. The plan walks the
commands in issue order and hands out space. Space a dead buffer held is reusable only once
every command that touched it has finished, so the command that takes that space gets
`memory` dependencies on them (only on the space it actually takes). Hence the scheduled run
never holds more than SRAM at any moment, not just in issue order.

When a command's new buffers (its results, and reloads of its spilled operands) do not fit,
the policy decides:
- `spill` (default): evict resident buffers the command does not touch, the one needed
  furthest in the future first (Belady), until they fit. An evicted buffer is stored to HBM
  once (a DMA store after its producer) and loaded back (a DMA load) before its next reader.
  Both are costed by the DMA formula and scheduled like any command. If the command's own
  operands and results do not fit in SRAM, it is an error all the same.
- `error`: stop with SramOverflowError naming the command, the bytes it asks for and the
  bytes available.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from runtime_sim.cost_model import OpCost
from runtime_sim.machine import Machine
from runtime_sim.op_trace import Trace
from runtime_sim.scheduler import Slot, Task
from runtime_sim.tcp_cost import dma_copy_cost

SramPolicy = Literal["spill", "error"]
SRAM_POLICIES: tuple[str, ...] = ("spill", "error")
DEFAULT_SRAM_POLICY: SramPolicy = "spill"


class SramOverflowError(Exception):
    """A command whose buffers do not fit in SRAM."""

    def __init__(self, op: str, asked: int, available: int, capacity: int, note: str = ""):
        self.op, self.asked, self.available, self.capacity = op, asked, available, capacity
        super().__init__(f"SRAM overflow at {op}: it asks for {asked:,} bytes, {available:,} of "
                         f"{capacity:,} bytes are available{note}")


@dataclass(frozen=True)
class Spill:
    buffer: str
    bytes: int
    evicted_at: str
    """The command that needed the space."""
    stored: bool
    """False when the buffer already had an HBM copy from an earlier spill."""


@dataclass(frozen=True)
class ExtraOp:
    """A command the plan adds (a spill store or a reload), with its cost."""

    label: str
    name: str
    cost: OpCost
    phase: str
    """The phase of the command it makes room for or feeds."""


@dataclass(frozen=True)
class Residency:
    """One stay of a buffer in SRAM: from the start of command `start` until every command in
    `until` has ended (None: to the end of the run)."""

    buffer: str
    bytes: int
    start: int
    until: tuple[int, ...] | None


@dataclass
class MemoryPlan:
    tasks: list[Task]
    """Every command to schedule, in issue order: the trace's (keys 0..n-1) and the plan's."""
    extra: dict[int, ExtraOp]
    """Key -> the plan's own commands (spill stores and reloads)."""
    peak_live_bytes: int
    """The most bytes resident at one step of issue order."""
    sram_capacity: int
    spills: list[Spill] = field(default_factory=list)
    residencies: list[Residency] = field(default_factory=list)


@dataclass(frozen=True)
class _Free:
    """Free space, reusable once every command in `wait` has ended."""

    bytes: int
    wait: tuple[int, ...]


def plan_memory(trace: Trace, machine: Machine, policy: SramPolicy = DEFAULT_SRAM_POLICY) -> MemoryPlan:
    if policy not in SRAM_POLICIES:
        raise ValueError(f"SRAM policy must be one of {', '.join(SRAM_POLICIES)}, got {policy!r}")
    ops, size, labels = trace.ops, trace.buffer_bytes, trace.buffer_labels
    end = len(ops)
    uses: dict[int, list[int]] = {b: [] for b in size}
    first: dict[int, int] = {}
    for t in ops:
        for b in t.writes:
            first[b] = t.index
        for b in t.reads:
            uses[b].append(t.index)
    last = {b: max([first.get(b, 0), *uses[b], end if b in trace.outputs else 0]) for b in size}
    capacity = machine.sram_bytes

    tasks: list[Task] = []
    extra: dict[int, ExtraOp] = {}
    spills: list[Spill] = []
    residencies: list[Residency] = []
    free: list[_Free] = [_Free(capacity, ())]
    live: dict[int, int] = {}  # buffer -> bytes, resident and still to be read
    home: dict[int, int] = {}  # buffer -> the command that wrote its current residency
    readers: dict[int, list[int]] = {}  # buffer -> commands that read this residency
    stored: dict[int, int] = {}  # buffer -> the store that put its copy in HBM
    evicted: set[int] = set()
    peak = 0

    def add_extra(label: str, name: str, cost: OpCost, phase: str, deps: tuple[int, ...],
                  after: tuple[int, ...] = ()) -> int:
        key = end + len(extra)
        extra[key] = ExtraOp(label, name, cost, phase)
        tasks.append(Task(key, label, cost.engine, cost.cycles, deps, tuple(a for a in after if a not in deps)))
        return key

    def release(b: int) -> None:
        wait = tuple(dict.fromkeys([home[b], *readers[b]]))
        residencies.append(Residency(labels[b], size[b], home[b], wait))
        free.append(_Free(size[b], wait))
        del live[b]

    def take(n: int) -> list[int]:
        """Claim n bytes, never-used space first, then the space freed earliest; returns the
        commands the claimant must wait for."""
        free.sort(key=lambda f: (max(f.wait, default=-1), f.wait))
        wait: list[int] = []
        while n > 0:
            f = free[0]
            use = min(n, f.bytes)
            wait.extend(f.wait)
            n -= use
            if use == f.bytes:
                free.pop(0)
            else:
                free[0] = _Free(f.bytes - use, f.wait)
        return wait

    for t in ops:
        for b in [b for b in live if last[b] < t.index]:
            release(b)
        reloads = [b for b in t.reads if b in evicted]
        need = sum(size[b] for b in reloads) + sum(size[b] for b in t.writes)
        available = sum(f.bytes for f in free)
        if need > available:
            if policy == "error":
                raise SramOverflowError(t.label, need, available, capacity)
            touched = set(t.reads) | set(t.writes)

            def next_use(b: int) -> int:
                i = bisect.bisect_right(uses[b], t.index)
                return uses[b][i] if i < len(uses[b]) else end

            for b in sorted((b for b in live if b not in touched), key=lambda b: (-next_use(b), b)):
                if need <= available:
                    break
                new_store = b not in stored
                if new_store:
                    cost = dma_copy_cost(machine, size[b], src_hbm=False, dst_hbm=True)
                    stored[b] = add_extra(f"spill {labels[b]}", "tcp.store", cost, t.phase, (home[b],))
                    readers[b].append(stored[b])
                spills.append(Spill(labels[b], size[b], t.label, new_store))
                evicted.add(b)
                release(b)
                available += size[b]
            if need > available:
                own = sum(size[b] for b in touched)
                raise SramOverflowError(t.label, own, capacity, capacity,
                                        note=" (its own operands and results do not fit, even with every other buffer spilled)")
        wait = tuple(dict.fromkeys(take(need)))
        deps = list(t.deps)
        for b in reloads:  # the reloads are the first to write the space they take
            cost = dma_copy_cost(machine, size[b], src_hbm=True, dst_hbm=False)
            key = add_extra(f"reload {labels[b]}", "tcp.load", cost, t.phase, (stored[b],), wait)
            evicted.discard(b)
            live[b], home[b], readers[b] = size[b], key, []
            deps.append(key)
        for b in t.writes:
            live[b], home[b], readers[b] = size[b], t.index, []
        for b in t.reads:
            readers[b].append(t.index)
        peak = max(peak, sum(live.values()))
        data = tuple(dict.fromkeys(deps))
        tasks.append(Task(t.index, t.label, t.cost.engine, t.cost.cycles, data,
                          tuple(w for w in wait if w not in data and w != t.index)))
    for b in live:
        residencies.append(Residency(labels[b], size[b], home[b], None))
    return MemoryPlan(tasks, extra, peak, capacity, spills, residencies)


def scheduled_peak(plan: MemoryPlan, slots: Mapping[int, Slot]) -> int:
    """The most SRAM bytes held at any moment of the scheduled run."""
    makespan = max((s.end for s in slots.values()), default=0)
    events: list[tuple[int, int]] = []
    for r in plan.residencies:
        until = makespan if r.until is None else max(slots[k].end for k in r.until)
        events += [(slots[r.start].start, r.bytes), (until, -r.bytes)]
    held = peak = 0
    for _, delta in sorted(events):  # at equal times frees (negative) come first
        held += delta
        peak = max(peak, held)
    return peak
