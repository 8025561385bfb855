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
  Both are costed by the DMA formula and scheduled like any command.
- `error`: stop with SramOverflowError naming the command, the bytes it asks for and the
  bytes available.

**Streaming (the `spill` policy).** A command whose own buffers do not fit in SRAM even with
every other buffer spilled (the top-k ranking's [T, E, E] at prefill; the gathered expert
weights of a large model) is assumed to run in tiles streamed through HBM, as a compiler
would tile it over tokens or blocks. Its largest new buffers (results, reloads) move to HBM,
one at a time, until the rest fits; for each:
- a result is written out tile by tile: a *stream out* (SRAM -> HBM) after the command, and
  the buffer lives in HBM from then on (its readers reload it if it fits them, or stream it);
- a spilled or streamed operand is read in tile by tile: a *stream in* (HBM -> SRAM) before
  the command, taking no SRAM.
Stream transfers are costed by the DMA formula and scheduled on the DMA engines like spills.
Assumptions: the tiles themselves (a few DMA packets per engine) take no SRAM worth counting;
a command does not overlap its own streams (loads, then the command, then stores), which is
pessimistic against double buffering; each oversize command streams on its own, so a chain
of oversize ops goes through HBM at every link, where a tiled lowering would keep each tile's
intermediates on chip.

DMA commands (gathers, scatters, loads) never stream through SRAM. One whose result does not
fit delivers the rows straight into its readers' tiles: the result is *fused* into its readers
(no SRAM, no HBM copy, the command's own cost); the first reader takes the rows the command
fetched, and every later reader fetches them again (a *refetch*, at the command's cost, which
keeps the command's source alive until then). A function result is not fused: the DMA command
writes it straight to HBM. A DMA command reads a spilled or streamed operand where it is, in
HBM, without a reload. Reading or writing HBM in place of SRAM only adds to a DMA command's
HBM bytes (and to its cycles if its share of HBM bandwidth then binds).

**Transfers.** A spill, reload or stream is one DMA copy, and like every DMA command one that
moves more than the machine's `dma.split_bytes` is spread evenly over several DMA engines
(tcp_cost.dma_parts, the same rule as the layer's own gathers and loads; assumption: a
compiler issues a large copy as several commands), so a large copy runs at the engines'
combined rate rather than one engine's. Views and other free commands move no data, so they
never reload.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from runtime_sim.perf.cost_model import DMA, NONE, OpCost
from runtime_sim.perf.machine import Machine
from runtime_sim.perf.op_trace import Trace
from runtime_sim.perf.scheduler import Slot, Task
from runtime_sim.perf.tcp_cost import dma_copy_cost, hbm_share_cycles, requests

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
class Stream:
    """A buffer that a command too large for SRAM streams through HBM."""

    buffer: str
    bytes: int
    """Bytes moved: the buffer, or for `in` the bytes of its HBM copy."""
    op: str
    direction: Literal["in", "out", "fused"]
    """`out`: the command writes the buffer to HBM; `in`: it reads the buffer from HBM;
    `fused`: a DMA command's result goes straight into its readers' tiles."""


@dataclass(frozen=True)
class ExtraOp:
    """A command the plan adds (a spill store, a reload, a stream), with its cost."""

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
    """Key -> the plan's own commands (spill stores, reloads, streams)."""
    peak_live_bytes: int
    """The most bytes resident at one step of issue order."""
    sram_capacity: int
    spills: list[Spill] = field(default_factory=list)
    residencies: list[Residency] = field(default_factory=list)
    streams: list[Stream] = field(default_factory=list)
    costs: dict[int, OpCost] = field(default_factory=dict)
    """Trace command key -> its cost where the plan changed it (a DMA command reading or
    writing HBM in place of SRAM); the trace's cost otherwise."""

    def cost(self, trace: Trace, key: int) -> OpCost:
        return self.costs.get(key, trace.ops[key].cost)


@dataclass(frozen=True)
class _Free:
    """Free space, reusable once every command in `wait` has ended."""

    bytes: int
    wait: tuple[int, ...]


def via_hbm(machine: Machine, cost: OpCost, nbytes: int) -> OpCost:
    """A DMA command's cost when `nbytes` more of its traffic is HBM's rather than SRAM's: the
    same requests, more HBM bytes, and never faster than its share of HBM bandwidth."""
    hbm = cost.hbm_bytes + requests(nbytes, machine) * machine.dma_request_bytes
    share = hbm_share_cycles(machine, hbm, cost.parts)
    if share > cost.cycles:
        return replace(cost, cycles=share, hbm_bytes=hbm, bound="hbm")
    return replace(cost, hbm_bytes=hbm)


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
    streams: list[Stream] = []
    costs: dict[int, OpCost] = {}
    residencies: list[Residency] = []
    free: list[_Free] = [_Free(capacity, ())]
    live: dict[int, int] = {}  # buffer -> bytes, resident and still to be read
    home: dict[int, int] = {}  # buffer -> the command that wrote its current residency
    readers: dict[int, list[int]] = {}  # buffer -> commands that read this residency
    stored: dict[int, tuple[int, ...]] = {}  # buffer -> the commands that put its copy in HBM
    copy_bytes: dict[int, int] = {}  # buffer -> bytes of its HBM copy
    evicted: set[int] = set()  # buffers not in SRAM whose copy is in HBM
    fused: dict[int, int] = {}  # DMA result too large for SRAM -> the command that produces it
    fused_read: dict[int, bool] = {}  # whether a reader has taken its rows yet
    peak = 0

    def plan_cost(key: int) -> OpCost:
        return costs.get(key, trace.ops[key].cost)

    def add_transfer(label: str, name: str, nbytes: int, to_hbm: bool, phase: str, deps: tuple[int, ...],
                     after: tuple[int, ...] = ()) -> tuple[int, ...]:
        cost = dma_copy_cost(machine, nbytes, src_hbm=not to_hbm, dst_hbm=to_hbm)
        key = end + len(extra)
        extra[key] = ExtraOp(label, name, cost, phase)
        tasks.append(Task(key, label, cost.engine, cost.cycles, deps, tuple(a for a in after if a not in deps),
                          cost.parts))
        return (key,)

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
        engine = t.cost.engine
        deps = list(t.deps)
        for b in dict.fromkeys(t.reads):  # a DMA result fused into its readers (see above)
            if b in fused and engine != NONE:
                if fused_read[b]:  # the first reader got the rows; every later one fetches them again
                    src = fused[b]
                    cost, src_deps = plan_cost(src), [src]
                    for s in trace.ops[src].reads:
                        if s in evicted:
                            src_deps += stored[s]
                            cost = via_hbm(machine, cost, min(copy_bytes[s], cost.bytes_moved - (cost.result_bytes or 0)))
                    key = end + len(extra)
                    extra[key] = ExtraOp(f"refetch {labels[b]}", trace.ops[src].name, cost, t.phase)
                    tasks.append(Task(key, f"refetch {labels[b]}", cost.engine, cost.cycles, tuple(dict.fromkeys(src_deps)),
                                      units=cost.parts))
                    for s in trace.ops[src].reads:
                        if s in live:
                            readers[s].append(key)
                    deps.append(key)
                fused_read[b] = True
        missing = [b for b in dict.fromkeys(t.reads) if b in evicted]
        # Free commands move no data; DMA commands read an HBM copy where it is.
        reloads = missing if engine not in (NONE, DMA) else []
        direct = missing if engine == DMA else []
        writes = list(t.writes)
        need = sum(size[b] for b in reloads) + sum(size[b] for b in writes)
        available = sum(f.bytes for f in free)
        if need > available and policy == "error":
            raise SramOverflowError(t.label, need, available, capacity)
        stream_in: list[int] = []
        stream_out: list[int] = []
        resident = sum(size[b] for b in dict.fromkeys(t.reads) if b in live)
        for b in sorted(reloads + writes, key=lambda b: (-size[b], b)):
            if resident + need <= capacity:
                break
            need -= size[b]
            (stream_out if b in t.writes else stream_in).append(b)
        reloads = [b for b in reloads if b not in stream_in]
        writes = [b for b in writes if b not in stream_out]
        if need > available:
            touched = set(t.reads) | set(t.writes)

            def next_use(b: int) -> int:
                i = bisect.bisect_right(uses[b], t.index)
                return uses[b][i] if i < len(uses[b]) else end

            for b in sorted((b for b in live if b not in touched), key=lambda b: (-next_use(b), b)):
                if need <= available:
                    break
                new_store = b not in stored
                if new_store:
                    stored[b] = add_transfer(f"spill {labels[b]}", "tcp.store", size[b], True, t.phase, (home[b],))
                    copy_bytes[b] = size[b]
                    readers[b].extend(stored[b])
                spills.append(Spill(labels[b], size[b], t.label, new_store))
                evicted.add(b)
                release(b)
                available += size[b]
            assert need <= available, "streaming leaves a command only buffers that fit"
        wait = tuple(dict.fromkeys(take(need)))
        for b in stream_in:  # read tile by tile from HBM: no SRAM
            deps += add_transfer(f"stream in {labels[b]}", "tcp.load", copy_bytes[b], False, t.phase, stored[b])
            streams.append(Stream(labels[b], copy_bytes[b], t.label, "in"))
        for b in reloads:  # the reloads are the first to write the space they take
            keys = add_transfer(f"reload {labels[b]}", "tcp.load", size[b], False, t.phase, stored[b], wait)
            evicted.discard(b)
            live[b], home[b], readers[b] = size[b], keys[0], list(keys[1:])
            deps += keys
        via = 0
        for b in direct:
            deps += stored[b]
            via += min(copy_bytes[b], t.cost.bytes_moved - (t.cost.result_bytes or 0))
        to_hbm = [b for b in stream_out if engine != DMA or b in trace.outputs]
        if engine == DMA and to_hbm:
            via += t.cost.result_bytes if t.cost.result_bytes is not None else size[to_hbm[0]]
        if via:
            costs[t.index] = via_hbm(machine, t.cost, via)
        for b in writes:
            live[b], home[b], readers[b] = size[b], t.index, []
        for b in t.reads:
            if b in live:
                readers[b].append(t.index)
        peak = max(peak, sum(live.values()))
        data = tuple(dict.fromkeys(deps))
        cost = plan_cost(t.index)
        tasks.append(Task(t.index, t.label, cost.engine, cost.cycles, data,
                          tuple(w for w in wait if w not in data and w != t.index), cost.parts))
        for b in stream_out:
            if b not in to_hbm:  # a DMA result: its rows go straight into its readers' tiles
                fused[b], fused_read[b] = t.index, False
                for s in t.reads:  # a refetch reads the source again: keep it until the last reader
                    last[s] = max(last[s], last[b])
                    for u in uses[b]:
                        if u > t.index and u not in uses[s]:
                            bisect.insort(uses[s], u)
                streams.append(Stream(labels[b], size[b], t.label, "fused"))
                continue
            if engine == DMA:  # written tile by tile to HBM, by the DMA command itself
                stored[b] = (t.index,)
                copy_bytes[b] = min(size[b], t.cost.result_bytes if t.cost.result_bytes is not None else size[b])
            else:  # written tile by tile to HBM
                stored[b] = add_transfer(f"stream out {labels[b]}", "tcp.store", size[b], True, t.phase, (t.index,))
                copy_bytes[b] = size[b]
            evicted.add(b)
            streams.append(Stream(labels[b], copy_bytes[b], t.label, "out"))
    for b in live:
        residencies.append(Residency(labels[b], size[b], home[b], None))
    return MemoryPlan(tasks, extra, peak, capacity, spills, residencies, streams, costs)


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
