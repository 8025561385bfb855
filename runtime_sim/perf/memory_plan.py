"""The memory plan: where every buffer lives, for how long, and what to do when SRAM is full.

Placement: function arguments (the layer's inputs and weights), stored values and what the
compiler placed in HBM (`tcpc.space = "hbm"`, an HBM `tile.buffer`: cost_model.in_hbm) live in
HBM; every other value an op produces is an SRAM buffer (views share their input's buffer).
SRAM is the clusters' data memories, counted in bytes (no fragmentation), one pool per
cluster (`Machine.cluster_sram_bytes`): a buffer lives in the SRAM of the cluster whose
command it is for (`tcpc.cluster` of its producer, or of the reader it is reloaded for), and a
cluster's buffers never take another cluster's space. Each slice fetches from and commits to
its own DM (furiosa-opt book, Fetch Engine, Commit Engine); data between clusters moves by
DMA (book, DMA Engine). So when a cluster is full, the plan spills or streams as below, within
that cluster, even if the other has room. The exception is a buffer that only DMA commands and
links make and read (views aside: a collective's received rows for the combine's gather), which
any cluster's SRAM may hold, as a DMA engine reaches every DM: when its producer's cluster lacks
the room, it goes to the other cluster with the most free bytes, before anything is spilled.

Lifetime: in issue order, a buffer is resident from the command that writes it (its producer,
or a reload) to its last reader; the function's results stay to the end; an asynchronous
all-to-all's operands stay to its `ccl.all_to_all_done`, since the link reads them until the
transfer ends (their space handed to a command issued in between, such as the next chunk's
weight loads, would make that command wait for the link), and another collective's operands
to the first command that reads its result (sp's all-gather of the next chunk's rows, issued
before this chunk's experts). The plan walks the
commands in issue order and hands out space. Space a dead buffer held is reusable only once
every command that touched it has finished, so the command that takes that space gets
`memory` dependencies on them (only on the space it actually takes). Hence the scheduled run
never holds more than SRAM at any moment, not just in issue order.

When a command's new buffers (its results, and reloads of its spilled operands) do not fit
in its cluster's SRAM, the policy decides:
- `spill` (default): evict its cluster's resident buffers the command does not touch, the one
  needed furthest in the future first (Belady), until they fit. An evicted buffer is stored to
  HBM once (a DMA store after its producer) and loaded back (a DMA load) before its next
  reader. Both are costed by the DMA formula and scheduled like any command.
- `error`: stop with SramOverflowError naming the command, the bytes it asks for and the
  bytes available.

**Streaming (the `spill` policy).** A command whose own buffers do not fit in its cluster's
SRAM even with every other buffer there spilled (the top-k ranking's [T, E, E] at prefill; the
gathered expert weights of a large model) is assumed to run in tiles streamed through HBM, as a
compiler would tile it over tokens or blocks. Its largest new buffers (results, reloads) move
to HBM, one at a time, until the rest fits; for each:
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

**HBM operands of a computing engine.** The contraction and vector engines read SRAM only.
Where a command of theirs reads a value in HBM (hand-written IR, or a partial pipeline: the
router's matmul on the tokens without load-arguments), the operand is streamed in before the
command the same way (one stream per reading command, costed, in the report's streams), so
such a read is never free. The compiler's own output has none (tests/test_schedule.py).

**Another cluster's SRAM.** Likewise, where a command of theirs reads a buffer that lives in
another cluster's SRAM (hand-written IR: a value made on cluster 0 read by an op pinned to
cluster 1), the buffer is copied to the reader's cluster before the command, by one DMA copy
SRAM -> SRAM costed as `tile.copy` is (one per reading command, taking no SRAM, in the
report's streams as `cluster`). A DMA command reads any cluster's SRAM where it is. The
compiler's own output has none: split-clusters copies what crosses (`tile.copy`).

DMA commands (gathers, scatters, loads) never stream through SRAM. One whose result does not
fit delivers the rows straight into its readers' tiles: the result is *fused* into its readers
(no SRAM, no HBM copy, the command's own cost); the first reader takes the rows the command
fetched, and every later reader fetches them again (a *refetch*, at the command's cost, which
keeps the command's source alive until then). A function result is not fused: the DMA command
writes it straight to HBM. A DMA command reads a spilled or streamed operand where it is, in
HBM, without a reload. Reading or writing HBM in place of SRAM only adds to a DMA command's
HBM bytes (and to its cycles if HBM bandwidth then binds it).

**Transfers.** A spill, reload or stream is one DMA copy, and like every DMA command one that
moves more than the machine's `dma.split_bytes` is cut into pieces over several DMA engines
(tcp_cost.dma_parts, the same rule as the layer's own gathers and loads; assumption: a
compiler issues a large copy as several commands), so a large copy runs at the engines'
combined rate rather than one engine's. Views and other free commands move no data, so they
never reload.

**The planner.** `MemoryPlanner` holds the state of SRAM and HBM at the current command and
has one method per mechanism above (holding and releasing buffers, ranking them for Belady,
choosing streams, spilling, reloading, streaming, fusing, refetching, scheduling the command);
free space is `free_space.FreeSpace`. Planning is O(n log n) in the commands, so programs of
tens of thousands of ops plan in seconds (benchmarks/scale.py).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from dialects import ccl
from runtime_sim.perf.cost_model import DMA, LINK, NONE, OpCost
from runtime_sim.perf.free_space import FreeSpace
from target.machine import Machine
from runtime_sim.perf.op_trace import Trace, TracedOp
from runtime_sim.perf.scheduler import Slot, Task
from runtime_sim.perf.tcp_cost import dma_copy_cost, requests, with_hbm_bytes

SramPolicy = Literal["spill", "error"]
SRAM_POLICIES: tuple[str, ...] = ("spill", "error")
DEFAULT_SRAM_POLICY: SramPolicy = "spill"
_LINK_READS_UNTIL_READ = {c.name for c in ccl.COLLECTIVES if c is not ccl.AllToAllStartOp}
"""Collectives without a done: the link reads their operands until a command reads their result."""

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
    direction: Literal["in", "out", "fused", "read", "cluster", "store"]
    """`out`: the command writes the buffer to HBM; `in`: it reads the buffer from HBM;
    `fused`: a DMA command's result goes straight into its readers' tiles; `read`: a computing
    engine's command reads a value in HBM, streamed in before it (not a matter of size);
    `cluster`: a computing engine's command reads a buffer in another cluster's SRAM, copied
    over before it (not a matter of size either); `store`: an in-place store writes a tile
    into a buffer in another cluster's SRAM, copied over by DMA."""


@dataclass(frozen=True)
class ExtraOp:
    """A command the plan adds (a spill store, a reload, a stream), with its cost."""

    label: str
    name: str
    cost: OpCost
    phase: str
    """The phase of the command it makes room for or feeds."""
    serves: int
    """That command's index in the trace (its op's source locations are this one's)."""


# Not frozen: one is built per stay of a buffer (hundreds of thousands at prefill), and a frozen
# dataclass takes about five times as long to build. Nothing modifies one once built.
@dataclass(slots=True)
class Residency:
    """One stay of a buffer in SRAM: from the start of command `start` until every command in
    `until` has ended (None: to the end of the run)."""

    buffer: str
    bytes: int
    start: int
    until: tuple[int, ...] | None
    cluster: int = 0
    """Whose SRAM holds it."""


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


def via_hbm(machine: Machine, cost: OpCost, nbytes: int) -> OpCost:
    """A DMA command's cost when `nbytes` more of its traffic is HBM's rather than SRAM's: the
    same requests, more HBM bytes, which its parts then ask of the HBM bandwidth."""
    hbm = cost.hbm_bytes + requests(nbytes, machine) * machine.dma_request_bytes
    payload = cost.result_bytes if cost.result_bytes is not None else cost.bytes_moved // 2
    return with_hbm_bytes(machine, cost, hbm, payload)


def task_of(key: int, label: str, cost: OpCost, deps: tuple[int, ...], after: tuple[int, ...]) -> Task:
    """The scheduler's task for a command of this cost: a DMA command's parts with their own
    cycles and the HBM bytes they ask of the shared bandwidth on 1 .. parts engines."""
    by_parts = cost.part_cycles
    return Task(key, label, cost.engine, by_parts[-1] if by_parts else cost.cycles, deps, after, cost.parts,
                by_parts if cost.parts > 1 else (), cost.part_hbm_bytes)


class MemoryPlanner:
    """Builds the MemoryPlan of one trace. `plan` walks the commands in issue order; for each,
    `place` frees the buffers that died, refetches fused results, makes room (streams, then
    spills), claims the space, inserts the transfers and schedules the command. The state is
    what SRAM and HBM hold at the current command.

    Every step is O(log n) per buffer it touches: the buffers that die and the buffer to spill
    next come off heaps, free space is a heap of coalesced pieces (free_space.py), and the
    bytes live and free are running totals; so planning is O(n log n) in the commands."""

    def __init__(self, trace: Trace, machine: Machine, policy: SramPolicy) -> None:
        self.trace, self.machine, self.policy = trace, machine, policy
        self.size, self.labels = trace.buffer_bytes, trace.buffer_labels
        self.end = len(trace.ops)
        self.capacity = machine.sram_bytes
        self.clusters = machine.clusters
        self.cluster_capacity = machine.cluster_sram_bytes
        """What each cluster's SRAM holds: a buffer lives in one cluster's."""
        self.uses, self.last = self._lifetimes()
        self.movable = self._moved_by_dma() if self.clusters > 1 else set()
        """Buffers that only DMA engines and links write and read (views aside): any cluster's
        SRAM may hold them."""
        # The plan so far.
        self.tasks: list[Task] = []
        self.extra: dict[int, ExtraOp] = {}
        self.spills: list[Spill] = []
        self.streams: list[Stream] = []
        self.residencies: list[Residency] = []
        self.costs: dict[int, OpCost] = {}
        self.peak = 0
        # SRAM.
        self.free = FreeSpace(self.capacity, machine.clusters)
        self.live: dict[int, int] = {}
        """Buffer -> bytes, resident and still to be read, in the order their stays began."""
        self.live_bytes = [0] * self.clusters
        """Cluster -> the bytes resident in its SRAM."""
        self.live_total = 0
        self.home: dict[int, int] = {}
        """Buffer -> the command that wrote its current stay (its producer or a reload)."""
        self.cluster: dict[int, int] = {}
        """Buffer -> the cluster whose SRAM holds its current stay: that of the command the
        stay is for (its producer, or the reader it was reloaded for)."""
        self.readers: dict[int, list[int]] = {}
        """Buffer -> the commands that read its current stay."""
        self.stay: dict[int, int] = {}
        """Buffer -> the number of its current stay (stays are numbered in the order they begin)."""
        self.stays = 0
        self.deaths: list[tuple[int, int, int]] = []
        """Heap of (last reader, stay, buffer): stale once the stay ended or the buffer lives longer."""
        self.ranks: list[list[tuple[int, int, int]]] = [[] for _ in range(self.clusters)]
        """Cluster -> heap of (-next reader, buffer, version) of its buffers: the buffer needed
        furthest in the future first."""
        self.rank_version: dict[int, int] = {}
        self.ranking = False
        """Whether `ranks` are kept: from the first spill on (`spill_for` makes them then)."""
        # HBM.
        self.stored: dict[int, tuple[int, ...]] = {}
        """Buffer -> the commands that put its copy in HBM."""
        self.copy_bytes: dict[int, int] = {}
        """Buffer -> the bytes of its HBM copy."""
        self.evicted: set[int] = set()
        """Buffers not in SRAM whose copy is in HBM."""
        self.fused: dict[int, int] = {}
        """A DMA result too large for SRAM -> the command that produces it."""
        self.fused_read: dict[int, bool] = {}
        """Whether a reader has taken its rows yet."""
        self.refetched_at: dict[int, list[int]] = {}
        """Command -> sources of a fused result it reads (read again by its refetch)."""

    def _lifetimes(self) -> tuple[dict[int, list[int]], dict[int, int]]:
        """Each buffer's readers in issue order, and the last command it must live to (the
        function's results: the end)."""
        uses: dict[int, list[int]] = {b: [] for b in self.size}
        first: dict[int, int] = {}
        for t in self.trace.ops:
            for b in t.writes:
                first[b] = t.index
            for b in t.reads:
                uses[b].append(t.index)
        outputs = self.trace.outputs
        last = {b: max([first.get(b, 0), *uses[b], self.end if b in outputs else 0]) for b in self.size}
        for done in self.trace.ops:  # the link reads a started all-to-all's operands until its done
            if done.name == ccl.AllToAllDoneOp.name:
                for started in done.deps:
                    for b in self.trace.ops[started].reads:
                        last[b] = max(last[b], done.index)
        # Another collective's operands likewise until the first command that reads its result
        # (the chip's wait for it): the link reads them while commands issued after it run.
        links = {t.index: t.reads for t in self.trace.ops if t.name in _LINK_READS_UNTIL_READ}
        for t in self.trace.ops if links else ():
            for d in t.deps:
                if d in links:
                    for b in links.pop(d):  # its first reader only
                        last[b] = max(last[b], t.index)
        return uses, last

    def _moved_by_dma(self) -> set[int]:
        """The buffers a DMA command or a link makes and only DMA commands, links and views
        read: a DMA engine reaches every cluster's SRAM (the book, DMA Engine), so such a
        buffer need not live in its producer's cluster."""
        ops, movers = self.trace.ops, (DMA, LINK)
        made = {b: t.cost.engine for t in ops for b in t.writes}
        return {b for b, engine in made.items()
                if engine in movers and all(ops[u].cost.engine in (*movers, NONE) for u in self.uses[b])}

    def plan(self) -> MemoryPlan:
        for t in self.trace.ops:
            self.release_dead(t.index)
            self.place(t)
        for b in self.live:
            self.residencies.append(Residency(self.labels[b], self.size[b], self.home[b], None, self.cluster[b]))
        return MemoryPlan(self.tasks, self.extra, self.peak, self.capacity, self.spills, self.residencies,
                          self.streams, self.costs)

    def place(self, t: TracedOp) -> None:
        """Plan one command: room for its new buffers, the transfers it needs, its task. (Each
        mechanism runs only when it can apply: nothing evicted or fused, everything fitting, is
        the common case, and a long program has hundreds of thousands of commands.)"""
        index, size = t.index, self.size
        engine = t.cost.engine
        cluster = t.cluster % self.clusters
        deps = list(t.deps)
        if self.fused:
            deps += self.refetch_fused(t)
        missing = [b for b in dict.fromkeys(t.reads) if b in self.evicted] if self.evicted else []
        # Free commands move no data; DMA commands read an HBM copy where it is, and any
        # cluster's SRAM; a computing engine reads its own cluster's SRAM only.
        computes = engine not in (NONE, DMA)
        reloads = missing if computes else []
        direct = missing if engine == DMA else []
        far = [b for b in t.reads if self.cluster.get(b, cluster) != cluster and b in self.live] \
            if computes and self.clusters > 1 else []
        if far:
            far = list(dict.fromkeys(far))
        writes = list(t.writes)
        need = sum(size[b] for b in reloads) + sum(size[b] for b in writes) if reloads else sum(size[b] for b in writes)
        free = self.free.free
        elsewhere = self.place_elsewhere(cluster, writes, need) if need > free[cluster] and self.movable else {}
        if elsewhere:
            need -= sum(size[b] for b in elsewhere)
            writes = [b for b in writes if b not in elsewhere]
        if need > free[cluster] and self.policy == "error":
            raise SramOverflowError(t.label, need, free[cluster], self.cluster_capacity,
                                    f" in cluster {cluster}'s SRAM" if self.clusters > 1 else "")
        stream_in: list[int] = []
        stream_out: list[int] = []
        if self.live_bytes[cluster] + need > self.cluster_capacity:  # else it fits beside every resident buffer
            stream_in, stream_out = self.choose_streams(t, cluster, reloads + writes, need)
            reloads = [b for b in reloads if b not in stream_in]
            writes = [b for b in writes if b not in stream_out]
            need -= sum(size[b] for b in stream_in) + sum(size[b] for b in stream_out)
        if self.refetched_at:
            self.rank(self.refetched_at.pop(index, ()), index)  # sources `t` reads again by a refetch
        if need > free[cluster]:
            self.spill_for(t, cluster, need)
        wait = tuple(dict.fromkeys(self.free.take(need, cluster))) if need else ()
        if elsewhere:
            wait = tuple(dict.fromkeys([*wait, *(w for b, c in elsewhere.items() for w in self.free.take(size[b], c))]))
        if stream_in:
            deps += self.stream_in(t, stream_in)
        if t.hbm_reads:
            deps += self.stream_hbm_operands(t)
        if far:
            deps += self.copy_across(t, far)
        if engine == NONE and t.cost.result_bytes and self.clusters > 1:
            deps += self.store_across(t, cluster)
        if reloads:
            deps += self.reload(t, reloads, wait)
        if direct or stream_out:
            deps += self.read_from_hbm(t, direct, stream_out)
        for b in writes:
            self.hold(b, index, cluster)
        for b, c in elsewhere.items():
            self.hold(b, index, c)
        live, readers = self.live, self.readers
        for b in t.reads:
            if b in live:
                readers[b].append(index)
        if self.live_total > self.peak:
            self.peak = self.live_total
        self.schedule(t, deps, wait)
        if stream_out:
            self.stream_out(t, stream_out)
        self.rank((*t.reads, *t.writes), index)

    # --- SRAM stays -------------------------------------------------------------------------

    def hold(self, b: int, home: int, cluster: int) -> None:
        """Begin a stay of `b` in `cluster`'s SRAM, written by command `home`."""
        self.live[b] = self.size[b]
        self.cluster[b] = cluster
        self.live_bytes[cluster] += self.size[b]
        self.live_total += self.size[b]
        self.home[b], self.readers[b] = home, []
        self.stay[b] = stay = self.stays
        self.stays += 1
        heapq.heappush(self.deaths, (self.last[b], stay, b))

    def release(self, b: int) -> None:
        """End `b`'s stay: its space is free once its writer and every reader have ended."""
        wait = tuple(dict.fromkeys([self.home[b], *self.readers[b]]))
        cluster = self.cluster[b]
        self.residencies.append(Residency(self.labels[b], self.size[b], self.home[b], wait, cluster))
        self.free.add(self.size[b], wait, cluster)
        del self.live[b]
        self.live_bytes[cluster] -= self.size[b]
        self.live_total -= self.size[b]

    def release_dead(self, index: int) -> None:
        """Release every buffer whose last reader comes before command `index`, in the order
        their stays began."""
        dead: list[tuple[int, int]] = []
        while self.deaths and self.deaths[0][0] < index:
            last, stay, b = heapq.heappop(self.deaths)
            if b in self.live and self.stay[b] == stay and self.last[b] == last:
                dead.append((stay, b))
        for _, b in sorted(dead):
            self.release(b)

    def outlive(self, b: int, last: int) -> None:
        """Keep `b` until command `last` at least."""
        if last > self.last[b]:
            self.last[b] = last
            if b in self.live:
                heapq.heappush(self.deaths, (last, self.stay[b], b))

    def rank(self, buffers: Iterable[int], index: int) -> None:
        """Re-rank the live `buffers` by their next reader after command `index`. A buffer's next
        reader changes only when one of its readers comes: a command that reads it, or (for the
        source of a fused result) a reader of the result, which refetches it. Before the first
        spill nothing is ranked: `spill_for` ranks every live buffer then."""
        if not self.ranking:
            return
        live, versions, ranks = self.live, self.rank_version, self.ranks
        for b in dict.fromkeys(buffers):
            if b in live:
                uses = self.uses[b]
                i = bisect.bisect_right(uses, index)
                version = versions[b] = versions.get(b, 0) + 1
                heapq.heappush(ranks[self.cluster[b]], (-(uses[i] if i < len(uses) else self.end), b, version))

    # --- making room --------------------------------------------------------------------------

    def place_elsewhere(self, cluster: int, writes: list[int], need: int) -> dict[int, int]:
        """Results only DMA engines touch (`movable`) that go to another cluster's SRAM because
        `cluster`'s lacks the room for `need` bytes: the largest first, each to the cluster
        with the most free bytes that holds it (the lowest on a tie), until the rest fits."""
        moved: dict[int, int] = {}
        free = list(self.free.free)
        for b in sorted((b for b in writes if b in self.movable), key=lambda b: (-self.size[b], b)):
            if need <= free[cluster]:
                break
            other = max((c for c in range(self.clusters) if c != cluster), key=lambda c: (free[c], -c))
            if free[other] >= self.size[b]:
                moved[b] = other
                free[other] -= self.size[b]
                need -= self.size[b]
        return moved

    def choose_streams(self, t: TracedOp, cluster: int, new: list[int], need: int) -> tuple[list[int], list[int]]:
        """The new buffers (`new`: reloads and results) `t` streams through HBM, largest first,
        until the rest fits in `cluster`'s SRAM beside its resident operands there, even with
        everything else spilled: (operands streamed in, results streamed out)."""
        stream_in: list[int] = []
        stream_out: list[int] = []
        resident = sum(self.size[b] for b in dict.fromkeys(t.reads) if self.cluster.get(b) == cluster and b in self.live)
        for b in sorted(new, key=lambda b: (-self.size[b], b)):
            if resident + need <= self.cluster_capacity:
                break
            need -= self.size[b]
            (stream_out if b in t.writes else stream_in).append(b)
        return stream_in, stream_out

    def spill_for(self, t: TracedOp, cluster: int, need: int) -> None:
        """Spill resident buffers of `cluster` that `t` does not touch, the one needed furthest
        in the future first (Belady), until `need` bytes of its SRAM are free."""
        touched = set(t.reads) | set(t.writes)
        kept: list[tuple[int, int, int]] = []
        if not self.ranking:
            # Every live buffer's next reader after `t`: what ranking it at each of its
            # readers would have left (a buffer `t` reads is kept whatever its rank, and ranked
            # again after `t`).
            self.ranking = True
            self.rank(list(self.live), t.index)
        ranks = self.ranks[cluster]
        while need > self.free.free[cluster]:
            assert ranks, "streaming leaves a command only buffers that fit"
            entry = heapq.heappop(ranks)
            _, b, version = entry
            if b not in self.live or self.rank_version[b] != version or self.cluster[b] != cluster:
                continue
            if b in touched:
                kept.append(entry)
                continue
            self.spill(t, b)
        for entry in kept:
            heapq.heappush(ranks, entry)

    def spill(self, t: TracedOp, b: int) -> None:
        """Evict `b` to make room for `t`: stored to HBM once (after its writer), then released."""
        new_store = b not in self.stored
        if new_store:
            self.stored[b] = (self.transfer(f"spill {self.labels[b]}", "tcp.store", self.size[b], True, t,
                                            (self.home[b],)),)
            self.copy_bytes[b] = self.size[b]
            self.readers[b].extend(self.stored[b])
        self.spills.append(Spill(self.labels[b], self.size[b], t.label, new_store))
        self.evicted.add(b)
        self.release(b)

    # --- transfers ------------------------------------------------------------------------------

    def add_command(self, label: str, name: str, cost: OpCost, serves: TracedOp, deps: tuple[int, ...],
                    after: Iterable[int] = ()) -> int:
        """Add a command of the plan's own (a transfer or a refetch) for command `serves`, in
        issue order; its key."""
        key = self.end + len(self.extra)
        self.extra[key] = ExtraOp(label, name, cost, serves.phase, serves.index)
        self.tasks.append(task_of(key, label, cost, deps, tuple(a for a in after if a not in deps)))
        return key

    def transfer(self, label: str, name: str, nbytes: int, to_hbm: bool, serves: TracedOp, deps: tuple[int, ...],
                 after: Iterable[int] = ()) -> int:
        """Add a DMA copy of `nbytes` between SRAM and HBM (a spill, reload or stream) for `serves`."""
        cost = dma_copy_cost(self.machine, nbytes, src_hbm=not to_hbm, dst_hbm=to_hbm)
        return self.add_command(label, name, cost, serves, deps, after)

    def reload(self, t: TracedOp, reloads: list[int], wait: tuple[int, ...]) -> list[int]:
        """Load spilled operands back before `t`; the reloads are the first to write the space
        `t` claimed, so they wait for its previous holders. Returns the reload commands."""
        keys: list[int] = []
        for b in reloads:
            key = self.transfer(f"reload {self.labels[b]}", "tcp.load", self.size[b], False, t,
                                self.stored[b], wait)
            self.evicted.discard(b)
            self.hold(b, key, t.cluster % self.clusters)
            keys.append(key)
        return keys

    def stream_in(self, t: TracedOp, buffers: list[int]) -> list[int]:
        """Read operands from HBM tile by tile before `t`, taking no SRAM. Returns the commands."""
        keys: list[int] = []
        for b in buffers:
            nbytes = self.copy_bytes[b]
            keys.append(self.transfer(f"stream in {self.labels[b]}", "tcp.load", nbytes, False, t,
                                      self.stored[b]))
            self.streams.append(Stream(self.labels[b], nbytes, t.label, "in"))
        return keys

    def stream_hbm_operands(self, t: TracedOp) -> list[int]:
        """Stream in, before `t`, the operands a computing engine reads from HBM (it reads
        SRAM only): hand-written IR, or a pipeline without load-arguments or the schedule
        level. Each read is a stream of its own, taking no SRAM. Returns the commands."""
        keys: list[int] = []
        for name, nbytes, ready in t.hbm_reads:
            keys.append(self.transfer(f"stream in {name}", "tcp.load", nbytes, False, t, ready))
            self.streams.append(Stream(name, nbytes, t.label, "read"))
        return keys

    def copy_across(self, t: TracedOp, buffers: list[int]) -> list[int]:
        """Copy, before `t`, the buffers it reads from another cluster's SRAM (a computing
        engine reads its own cluster's only): a DMA copy SRAM -> SRAM each, as `tile.copy`,
        after what `t` waits for, taking no SRAM (streamed, as a value in HBM is). The
        compiler's own output has none (split-clusters copies what crosses, tests/test_schedule.py).
        Returns the commands."""
        keys: list[int] = []
        for b in buffers:
            nbytes = self.size[b]
            key = self.add_command(f"copy {self.labels[b]} from cluster {self.cluster[b]}", "tile.copy",
                                   dma_copy_cost(self.machine, nbytes, src_hbm=False, dst_hbm=False), t,
                                   tuple(dict.fromkeys((self.home[b], *t.deps))))
            self.readers[b].append(key)
            self.streams.append(Stream(self.labels[b], nbytes, t.label, "cluster"))
            keys.append(key)
        return keys

    def store_across(self, t: TracedOp, cluster: int) -> list[int]:
        """An in-place store (`tile.store` into an SRAM buffer) from `cluster` into a buffer in
        another cluster's SRAM: an engine writes its own cluster's SRAM only and data between
        clusters moves by DMA (the book, DMA Engine), so the stored bytes cross in a DMA copy
        SRAM -> SRAM before the store counts as done. A buffer that only DMA commands and links
        read needs none: they reach every cluster's SRAM, so the rows each cluster stores stay
        in its own (as `_moved_by_dma`'s buffers may live anywhere). Returns the commands."""
        ops = self.trace.ops
        away = [b for b in t.reads if b in self.live and self.cluster[b] != cluster
                and any(ops[u].cost.engine not in (DMA, LINK, NONE) for u in self.uses[b])]
        if not away:
            return []
        b, nbytes = away[0], t.cost.result_bytes or 0
        key = self.add_command(f"store into {self.labels[b]} on cluster {self.cluster[b]}", "tile.copy",
                               dma_copy_cost(self.machine, nbytes, src_hbm=False, dst_hbm=False), t, t.deps)
        self.streams.append(Stream(self.labels[b], nbytes, t.label, "store"))
        return [key]

    def writes_to_hbm(self, t: TracedOp, b: int) -> bool:
        """Whether a result `t` streams goes to HBM (rather than fused into its readers): always
        but for a DMA command's results that are not the function's."""
        return t.cost.engine != DMA or b in self.trace.outputs

    def read_from_hbm(self, t: TracedOp, direct: list[int], stream_out: list[int]) -> list[int]:
        """A DMA command reads evicted operands (`direct`) and writes streamed results in HBM
        itself: its cost grows by those HBM bytes. Returns the commands it waits for."""
        deps: list[int] = []
        via = 0
        cost = t.cost
        for b in direct:
            deps += self.stored[b]
            via += min(self.copy_bytes[b], cost.bytes_moved - (cost.result_bytes or 0))
        to_hbm = [b for b in stream_out if self.writes_to_hbm(t, b)]
        if cost.engine == DMA and to_hbm:
            via += cost.result_bytes if cost.result_bytes is not None else self.size[to_hbm[0]]
        if via:
            self.costs[t.index] = via_hbm(self.machine, cost, via)
        return deps

    def stream_out(self, t: TracedOp, buffers: list[int]) -> None:
        """Results of `t` too large for SRAM: written to HBM tile by tile (by a stream command,
        or by a DMA command itself), or fused into their readers."""
        for b in buffers:
            if not self.writes_to_hbm(t, b):
                self.fuse(t, b)
                continue
            if t.cost.engine == DMA:
                self.stored[b] = (t.index,)
                result = t.cost.result_bytes
                self.copy_bytes[b] = min(self.size[b], result if result is not None else self.size[b])
            else:
                self.stored[b] = (self.transfer(f"stream out {self.labels[b]}", "tcp.store", self.size[b], True,
                                                t, (t.index,)),)
                self.copy_bytes[b] = self.size[b]
            self.evicted.add(b)
            self.streams.append(Stream(self.labels[b], self.copy_bytes[b], t.label, "out"))

    # --- fused DMA results ----------------------------------------------------------------------

    def fuse(self, t: TracedOp, b: int) -> None:
        """DMA command `t` delivers its result `b` straight into its readers' tiles. A refetch
        reads `t`'s sources again, so they must live until `b`'s last reader."""
        self.fused[b], self.fused_read[b] = t.index, False
        later = [u for u in self.uses[b] if u > t.index]
        for s in t.reads:
            self.outlive(s, self.last[b])
            known = set(self.uses[s])
            added = [u for u in dict.fromkeys(later) if u not in known]
            if added:
                self.uses[s] = sorted(self.uses[s] + added)
                for u in added:
                    self.refetched_at.setdefault(u, []).append(s)
        self.streams.append(Stream(self.labels[b], self.size[b], t.label, "fused"))

    def refetch_fused(self, t: TracedOp) -> list[int]:
        """The first reader of a fused result takes the rows its DMA command fetched; every
        later one fetches them again, at the command's cost. Returns the refetch commands."""
        keys: list[int] = []
        if t.cost.engine == NONE:
            return keys
        for b in dict.fromkeys(t.reads):
            if b not in self.fused:
                continue
            if self.fused_read[b]:
                src = self.trace.ops[self.fused[b]]
                cost, deps = self.cost_of(src.index), [src.index]
                for s in src.reads:
                    if s in self.evicted:
                        deps += self.stored[s]
                        cost = via_hbm(self.machine, cost,
                                       min(self.copy_bytes[s], cost.bytes_moved - (cost.result_bytes or 0)))
                key = self.add_command(f"refetch {self.labels[b]}", src.name, cost, t, tuple(dict.fromkeys(deps)))
                for s in src.reads:
                    if s in self.live:
                        self.readers[s].append(key)
                keys.append(key)
            self.fused_read[b] = True
        return keys

    # --- the command itself -------------------------------------------------------------------

    def cost_of(self, key: int) -> OpCost:
        return self.costs.get(key, self.trace.ops[key].cost)

    def schedule(self, t: TracedOp, deps: list[int], wait: tuple[int, ...]) -> None:
        """Add `t`'s task: data dependencies on its producers and transfers, memory ones on the
        previous holders of the space it claimed."""
        data = t.deps if len(deps) == len(t.deps) else tuple(dict.fromkeys(deps))  # t.deps: sorted, distinct
        cost = self.costs.get(t.index, t.cost)
        after: tuple[int, ...] = ()
        if wait:
            known = set(data)
            after = tuple(w for w in wait if w not in known and w != t.index)
        self.tasks.append(task_of(t.index, t.label, cost, data, after))


def plan_memory(trace: Trace, machine: Machine, policy: SramPolicy = DEFAULT_SRAM_POLICY) -> MemoryPlan:
    """Place every buffer of `trace` in SRAM or HBM, in issue order (see the module docstring)."""
    if policy not in SRAM_POLICIES:
        raise ValueError(f"SRAM policy must be one of {', '.join(SRAM_POLICIES)}, got {policy!r}")
    return MemoryPlanner(trace, machine, policy).plan()


def scheduled_peak(plan: MemoryPlan, slots: Mapping[int, Slot], clusters: int = 1) -> tuple[int, list[int]]:
    """The most SRAM bytes held at any moment of the scheduled run: the chip's, and each of
    its `clusters` clusters' (each at most its own SRAM: a buffer lives in one cluster's)."""
    makespan = max((s.end for s in slots.values()), default=0)
    events: list[tuple[int, int, int]] = []
    for r in plan.residencies:
        until = makespan if r.until is None else max(slots[k].end for k in r.until)
        events += [(slots[r.start].start, r.bytes, r.cluster), (until, -r.bytes, r.cluster)]
    held = peak = 0
    by_cluster = [0] * clusters
    peaks = [0] * clusters
    for _, delta, cluster in sorted(events, key=lambda e: (e[0], e[1])):  # at equal times frees come first
        held += delta
        by_cluster[cluster] += delta
        peak = max(peak, held)
        peaks[cluster] = max(peaks[cluster], by_cluster[cluster])
    return peak, peaks
