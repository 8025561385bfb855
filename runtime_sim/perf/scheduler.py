"""List scheduling of costed commands onto engines that run concurrently.

Policy (docs/architecture.md#the-simulator): commands issue in program order (the order the
interpreter ran them, the compiler's order). A command starts when every command producing
one of its inputs has finished and a unit of its engine is free: as early as the units allow
(`units` of them free). Of the units free by then it takes the ones that became free last
(best fit; lowest index on ties), so a unit runs its commands in order and never back-fills.
Engines with `None` units (zero-cost ops) never wait for a unit. A command that needs several
units (a large DMA command spread over several engines, `Task.units`) runs one part on each,
in parallel: each part is a command of its own in its unit's queue, starting when that unit
frees (or the inputs are ready) and taking the command's cycles; the command ends with its
last part (its slot's start is that part's), and each unit is free again when its own part
ends, so a small command queued on one unit delays only that unit's part.

Why best fit: the start is the same as taking the units that freed first, but a command that
waits for its inputs (a weight load behind the previous one, a guard behind a load) no longer
takes a unit idle since long ago, which a later command that is ready early could have used:
with first-free, such a command pushed a ready row load behind it on the same unit, and a
layer with more tokens (more commands, each waiting less) came out faster than one with fewer.
The units' free times after each command are then never later, in sorted order, than
first-free's would be from the same state.
A DMA command that may be spread over fewer engines than its parts (`Task.cycles_by_units`:
its cycles on 1, 2, ... engines, each part moving more) takes the number of units that ends it
first, given when each unit frees (fewest units on a tie): a compiler that knows the static
schedule issues a large transfer as as many commands as there are engines free for it, rather
than queueing one part behind a command that waits (a store waiting for its contraction held
one engine, and the next weight load, issued after it, waited for all eight; with two clusters
the second cluster's loads queued behind the first's stores and the clusters ran in turn).
A tensor-unit command pinned to a cluster (`pinned`, from its op's `tcpc.cluster`) takes
that cluster's unit.

A bandwidth the units of an engine share (`SharedBandwidth`: HBM, shared by the DMA engines)
is booked in issue order. A part moving bytes through it (`Task.traffic_by_units`) starts its
transfer `lead` cycles after it starts and moves them at a rate that may change over time: the
parts of one command share equally what the commands placed before them leave at that moment,
at most each part's own rate (its bytes over its transfer cycles), always leaving `floor` bytes
per cycle to every unit not moving data then. A part therefore ends no earlier than its own
cycles, and later when the bandwidth is short; a command never slows one placed before it (so
nothing placed earlier moves), the parts together never take more than the bandwidth, and a
command placed later is never starved (`floor` per part at least). The spread such a command
takes is the one that ends it first given what the commands before it booked (`_spread`).

The dependency graph is a networkx DiGraph over command keys with `kind="data"` edges
(producer -> consumer), `kind="memory"` edges (a command reusing SRAM space waits for the
space's last reader) and `kind="engine"` edges (previous command on the same unit -> next).
Every start equals the end of one of its inputs' producers, or the end of the previous part on
one of its units (or 0), so the makespan is the length of a path through that graph: the
critical path, found by walking back from the last command through the command that set each
start (recorded as it is placed).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import networkx as nx



# Not frozen: one is built per command of a run (hundreds of thousands at prefill), and a frozen
# dataclass takes about five times as long to build. Nothing modifies one once built.
@dataclass(slots=True)
class Task:
    """A command to place: `deps` are keys of earlier tasks whose results it reads, `after`
    keys of earlier tasks it must wait for otherwise (the memory plan's reuse of space)."""

    key: int
    label: str
    engine: str
    cycles: int
    deps: tuple[int, ...] = ()
    after: tuple[int, ...] = ()
    units: int = 1
    """Units of its engine it occupies at once (at most the engine's unit count)."""
    cycles_by_units: tuple[int, ...] = ()
    """Its cycles on 1, 2, ..., `units` units (the last is `cycles`): a DMA command the
    scheduler may spread over fewer engines than `units` (module docstring); empty: `units` only.
    For a command moving bytes through a shared bandwidth, each part's cycles on its own unit
    when the bandwidth has room to spare."""
    traffic_by_units: tuple[int, ...] = ()
    """The bytes each part moves through the engine's shared bandwidth, on 1, 2, ..., `units`
    units (module docstring); empty: none."""


# Not frozen: one is built per command of a run (hundreds of thousands at prefill), and a frozen
# dataclass takes about five times as long to build. Nothing modifies one once built.
@dataclass(slots=True)
class Slot:
    key: int
    engine: str
    unit: int
    """The first of `units` (0 for engines without units)."""
    start: int
    end: int
    units: tuple[int, ...] = (0,)
    """Every unit the command occupies, ascending."""
    part_starts: tuple[int, ...] = ()
    """For a command on several units, when its part on each of `units` started (a part
    starts as soon as its unit frees, so only the last one starts at `start`); empty for a
    command on one unit."""
    part_ends: tuple[int, ...] = ()
    """For a command on several units, when its part on each of `units` ended (the last one
    at `end`); empty for a command on one unit."""
    shared: bool = False
    """The shared bandwidth ended it later than its own cycles would have (module docstring)."""


@dataclass
class Schedule:
    slots: dict[int, Slot]
    tasks: Sequence[Task]
    makespan: int
    critical_path: list[int]
    busy: dict[str, int]
    """Engine -> cycles its units were busy, summed over units (a command on n units counts n times)."""
    units: dict[str, int | None]
    critical_cycles: dict[int, int] = field(default_factory=dict)
    """Key of a command on the critical path -> the cycles it spends there (its part's, from
    when it started to when the next command on the path did; they add up to the makespan)."""
    shared_peak: float = 0.0
    """The most bytes per cycle the shared bandwidth carried at once (never more than it has)."""

    def utilisation(self, engine: str) -> float:
        """Busy cycles over (makespan x units); 0 for an empty schedule or unlimited engine."""
        n = self.units.get(engine)
        if not n or not self.makespan:
            return 0.0
        return self.busy.get(engine, 0) / (self.makespan * n)

    @cached_property
    def preds(self) -> dict[int, dict[int, str]]:
        """Key -> the keys it waits for, each with its edge's kind (the first found), in the
        order found: its data inputs, the memory it reuses, then on each of its units in turn
        the command before it there. Worked out when first asked for (by `graph`)."""
        preds: dict[int, dict[int, str]] = {}
        last_on_unit: dict[tuple[str, int], int] = {}
        for t in self.tasks:
            into: dict[int, str] = {}
            for d in t.deps:
                into.setdefault(d, "data")
            for d in t.after:
                into.setdefault(d, "memory")
            if self.units.get(t.engine):
                for u in self.slots[t.key].units:
                    prev = last_on_unit.get((t.engine, u))
                    if prev is not None:
                        into.setdefault(prev, "engine")
                    last_on_unit[(t.engine, u)] = t.key
            preds[t.key] = into
        return preds

    @cached_property
    def graph(self) -> nx.DiGraph:
        """The dependency graph (module docstring), built when first asked for: a long program
        has millions of edges, and a simulation needs none of them."""
        import networkx as nx  # here, not at the top: 0.2 s of every tcpc process's start

        graph = nx.DiGraph()
        slots = self.slots
        graph.add_nodes_from(
            (t.key, {"label": t.label, "engine": t.engine, "cycles": t.cycles, "unit": (s := slots[t.key]).unit,
                     "units": s.units, "start": s.start, "end": s.end})
            for t in self.tasks)
        graph.add_edges_from((u, v, {"kind": kind}) for v, into in self.preds.items() for u, kind in into.items())
        return graph


@dataclass(frozen=True)
class SharedBandwidth:
    """A bandwidth the units of `engine` share, booked in issue order (module docstring): HBM,
    shared by the DMA engines (tcp_cost.hbm_sharing gives the machine's)."""

    engine: str
    bytes_per_cycle: float
    floor: float
    """Bytes per cycle always left to each unit not moving data: what a part placed later is
    sure to get."""
    lead: int
    """Cycles from a part's start to its first byte (a DMA command's start-up)."""

    def rate(self, used: float, idle: int, parts: int, own: float) -> float:
        """Bytes per cycle each of `parts` parts moving data together gets while earlier parts
        take `used` and `idle` other units move none: an equal share of what is left beyond
        their floors, at most `own`, a part's own rate."""
        return min(own, (self.bytes_per_cycle - used - self.floor * idle) / parts)

    def alone(self, cycles: int, nbytes: int, parts: int, units: int) -> int:
        """Cycles of `parts` parts starting together while nothing else moves data, each
        taking `cycles` on its own unit and moving `nbytes`, on an engine of `units` units."""
        if not nbytes:
            return cycles
        rate = self.rate(0.0, units - parts, parts, _own_rate(cycles - self.lead, nbytes))
        return max(cycles, self.lead + _ceil(nbytes / rate))


def _own_rate(transfer: int, nbytes: int) -> float:
    """A part's own rate: its bytes over its transfer cycles (unbounded if it has none)."""
    return nbytes / transfer if transfer > 0 else math.inf


def _ceil(cycles: float) -> int:
    """The whole cycle a transfer ends in (float rates: a hair over a whole cycle is that cycle)."""
    return math.ceil(cycles - 1e-6)


class _Bookings:
    """What a shared bandwidth carries over time: from `times[i]` to `times[i + 1]` (the last
    piece lasts forever) `used[i]` bytes per cycle taken by `busy[i]` parts."""

    def __init__(self) -> None:
        self.times: list[int] = [0]
        self.used: list[float] = [0.0]
        self.busy: list[int] = [0]
        self.peak = 0.0
        """The most bytes per cycle booked at once."""

    def forget_before(self, horizon: int) -> None:
        """Drop the pieces that end by `horizon`: no part starts before it any more."""
        i = bisect_right(self.times, horizon) - 1
        if i > 0:
            del self.times[:i], self.used[:i], self.busy[:i]

    def _book(self, start: int, end: int, rate: float, parts: int) -> None:
        """Add `rate` bytes per cycle and `parts` parts from `start` to `end`, cutting the pieces
        there (in one pass: every piece of every DMA command's transfer is booked so)."""
        times, used, busy = self.times, self.used, self.busy
        edges: list[int] = []
        for t in (start, end):  # the end cut after the start's: its index is the later one
            i = bisect_right(times, t) - 1
            if times[i] != t:
                i += 1
                times.insert(i, t)
                used.insert(i, used[i - 1])
                busy.insert(i, busy[i - 1])
            edges.append(i)
        first, stop = edges
        peak = self.peak
        for i in range(first, stop):
            used[i] += rate
            busy[i] += parts
            if used[i] > peak:
                peak = used[i]
        self.peak = peak

    def plan(self, bw: SharedBandwidth, begins: Sequence[int], cycles: int, nbytes: int, units: int) -> _Placement:
        """When each of one command's parts ends, starting at `begins` and each moving `nbytes`
        (module docstring): never before its own `cycles`; and the rates to book for it."""
        if not nbytes:
            return _Placement([b + cycles for b in begins], [])
        own = _own_rate(cycles - bw.lead, nbytes)
        # Parts that start together move alike: one group each, [start, parts, bytes left, end].
        groups = [[b + bw.lead, begins.count(b), float(nbytes), b + cycles] for b in sorted(set(begins))]
        times, used, busy = self.times, self.used, self.busy
        # bw.rate and _ceil written out (the same arithmetic): this loop runs for every piece of
        # every DMA command's transfer, of every spread `_spread` tries.
        capacity, floor, inf, ceil = bw.bytes_per_cycle, bw.floor, math.inf, math.ceil
        booked: list[tuple[int, int, float, int]] = []
        active: list[list] = []
        n = waiting = 0
        count = len(groups)
        t = groups[0][0]
        i = bisect_right(times, t) - 1
        last = len(times) - 1
        while active or waiting < count:
            while waiting < count and groups[waiting][0] <= t:
                active.append(groups[waiting])
                n += groups[waiting][1]
                waiting += 1
            until = times[i + 1] if i < last else inf
            if waiting < count and groups[waiting][0] < until:
                until = groups[waiting][0]
            if active:
                share = (capacity - used[i] - floor * (units - busy[i] - n)) / n
                rate = share if share < own else own
                # The group that started first has the fewest bytes left.
                finish = ceil(t + active[0][2] / rate - 1e-6)
                if finish < t + 1:
                    finish = t + 1
                if finish < until:
                    until = finish
                booked.append((t, until, rate * n, n))
                done = until + 1e-6
                for g in active:
                    if t + g[2] / rate <= done:
                        if until > g[3]:
                            g[3] = until
                        g[2] = 0.0
                        n -= g[1]
                    else:
                        g[2] -= rate * (until - t)
                if active[0][2] == 0.0:
                    active = [g for g in active if g[2] > 0.0]
            t = until
            if i < last and t >= times[i + 1]:
                i += 1
        ends = {g[0] - bw.lead: g[3] for g in groups}
        return _Placement([ends[b] for b in begins], booked)

    def book(self, placement: _Placement) -> None:
        for start, end, rate, n in placement.booked:
            self._book(start, end, rate, n)


@dataclass
class _Placement:
    ends: list[int]
    """When each part ends, in the order of its units."""
    booked: list[tuple[int, int, float, int]]
    """(from, to, bytes per cycle, parts): the rates its parts take."""


def _spread(bookings: _Bookings, shared: SharedBandwidth, t: Task, unit_free: Sequence[int],
            candidates: Sequence[int], ready: int, most: int) -> tuple[int, _Placement]:
    """How many units (at most `most`) a command moving bytes through `shared` takes, and its
    placement on them: the spread that ends it first given the bandwidth booked before it, the
    fewest units on a tie. A spread is tried only if its own cycles could end it no later than
    the best so far."""
    first_free = sorted(unit_free[u] for u in candidates)
    bound = {k: max(ready, first_free[k - 1]) + t.cycles_by_units[k - 1] for k in range(1, most + 1)}
    best: tuple[int, int, _Placement] | None = None
    for k in sorted(bound, key=lambda k: (bound[k], k)):
        if best is not None and (bound[k], k) >= best[:2]:
            break
        begins = [max(ready, unit_free[u]) for u in _best_fit(unit_free, candidates, ready, k)]
        placed = bookings.plan(shared, begins, t.cycles_by_units[k - 1], t.traffic_by_units[k - 1], len(unit_free))
        if best is None or (max(placed.ends), k) < best[:2]:
            best = (max(placed.ends), k, placed)
    assert best is not None
    return best[1], best[2]


def _best_fit(unit_free: Sequence[int], candidates: Sequence[int], ready: int, count: int) -> tuple[int, ...]:
    """The `count` units a command ready at `ready` takes (module docstring): of the candidates
    free when the count-th frees (or at `ready`), the ones that became free last, lowest first
    on a tie; ascending."""
    start = max(ready, sorted(unit_free[u] for u in candidates)[count - 1])
    fits = sorted((u for u in candidates if unit_free[u] <= start), key=lambda u: (-unit_free[u], u))
    return tuple(sorted(fits[:count]))


def schedule(tasks: Sequence[Task], units: Mapping[str, int | None], pinned: Mapping[int, int] | None = None,
             allowed: Mapping[int, tuple[int, ...]] | None = None, shared: SharedBandwidth | None = None) -> Schedule:
    """Place `tasks` (in issue order) on the engines; `units` gives each engine's unit count;
    `pinned` maps a task's key to the one unit it must run on (a tensor command to its cluster;
    modulo the engine's units, so a program split over more clusters than the machine has
    shares them); `allowed` maps a task's key to the units it may take (a DMA command on its
    cluster's own engines): fewer than its `units` only if it may be spread over fewer;
    `shared`, a bandwidth the units of one engine share (HBM: the module docstring)."""
    placer = Placer(units, pinned, allowed, shared)
    for t in tasks:
        placer.place(t)
    return placer.finish()


class Placer:
    """`schedule`, one command at a time: in issue order a command's slot depends only on the
    commands placed before it, so a caller that learns a command's cycles late (the mesh: a
    collective's wait, known once every chip of its group has reached it) places the commands
    before it, reads when it would start (`slots`, `free`), and goes on, instead of
    scheduling the prefix again."""

    def __init__(self, units: Mapping[str, int | None], pinned: Mapping[int, int] | None = None,
                 allowed: Mapping[int, tuple[int, ...]] | None = None, shared: SharedBandwidth | None = None) -> None:
        self._placing = _placing(units, pinned, allowed, shared)
        self.slots: dict[int, Slot]
        self.free: dict[str, list[int]]
        """Engine -> when each of its units frees."""
        self.slots, self.free = next(self._placing)

    def place(self, task: Task) -> Slot:
        return self._placing.send(task)

    def finish(self) -> Schedule:
        try:
            self._placing.send(None)
        except StopIteration as done:
            return done.value
        raise AssertionError("the placer placed a command after its end")


def _placing(units: Mapping[str, int | None], pinned: Mapping[int, int] | None,
             allowed: Mapping[int, tuple[int, ...]] | None,
             shared: SharedBandwidth | None) -> Generator[Any, Task | None, Schedule]:
    """The scheduler's state and loop: yields (slots, free) first, then each command's slot as
    it is sent; sent None, returns the Schedule."""
    pinned = pinned or {}
    allowed = allowed or {}
    free: dict[str, list[int]] = {e: [0] * n for e, n in units.items() if n}
    bookings = _Bookings()
    last_on_unit: dict[str, list[int | None]] = {e: [None] * n for e, n in units.items() if n}
    """Engine -> the last command on each of its units."""
    slots: dict[int, Slot] = {}
    busy: dict[str, int] = {e: 0 for e in units}
    setter: dict[int, tuple[int, int]] = {}
    """Key -> (the command, its unit) whose end set its start (none for a start at 0); for a
    command on several units, the start of its part on `main_unit`, the one that started last."""
    main_unit: dict[int, int] = {}
    part_start: dict[tuple[int, int], int] = {}
    part_setter: dict[tuple[int, int], tuple[int, int]] = {}
    """(key, unit) -> as `setter`, for the other parts of a command on several units."""

    def data_setter(t: Task, ready: int) -> tuple[int, int]:
        """The input whose end is `ready` (a data input rather than a memory one, then the
        latest issued), with the unit it ended on."""
        d = max((d for d in t.deps if slots[d].end == ready), default=None)
        if d is None:
            d = max(d for d in t.after if slots[d].end == ready)
        return d, main_unit.get(d, slots[d].unit)

    tasks: list[Task] = []
    placed: Any = (slots, free)
    while True:
        t = yield placed
        if t is None:
            break
        tasks.append(t)
        key, engine, cycles = t.key, t.engine, t.cycles
        if engine not in units:
            raise ValueError(f"{t.label}: unknown engine '{engine}' (engines: {', '.join(units)})")
        if cycles < 0:
            raise ValueError(f"{t.label}: negative cycles {cycles}")
        ready = 0
        for keys in (t.deps, t.after):
            for d in keys:
                slot = slots.get(d)
                if slot is None:
                    raise ValueError(f"{t.label}: depends on {d}, which is not scheduled before it")
                if slot.end > ready:
                    ready = slot.end
        unit_free = free.get(engine)
        if unit_free is None:  # an engine without units: it never waits for one
            if ready:
                setter[key] = data_setter(t, ready)
            busy[engine] += cycles
            placed = slots[key] = Slot(key, engine, 0, ready, ready + cycles)
            continue
        last = last_on_unit[engine]
        sharing = shared if shared is not None and shared.engine == engine and any(t.traffic_by_units) else None
        if key in pinned and t.units == 1 and sharing is None:
            # One unit, known: the common case (a tensor command on its cluster's unit).
            if not 1 <= t.units <= len(unit_free):
                raise ValueError(f"{t.label}: needs {t.units} units of '{engine}', which has {len(unit_free)}")
            u = pinned[key] % len(unit_free)
            prev = last[u]
            start = ready if ready >= unit_free[u] else unit_free[u]
            end = start + cycles
            if prev is not None and unit_free[u] > ready:
                setter[key] = (prev, u)
            elif ready:
                setter[key] = data_setter(t, ready)
            unit_free[u] = end
            last[u] = key
            busy[engine] += cycles
            placed = slots[key] = Slot(key, engine, u, start, end, (u,))
            continue
        taken: tuple[int, ...] = (0,)
        start = ready
        traffic = 0
        placed: _Placement | None = None
        if not 1 <= t.units <= len(unit_free):
            raise ValueError(f"{t.label}: needs {t.units} units of '{engine}', which has {len(unit_free)}")
        if sharing is not None:
            bookings.forget_before(min(unit_free))
            traffic = t.traffic_by_units[t.units - 1]
        if key in pinned and t.units == 1:
            taken = (pinned[key] % len(unit_free),)
            start = max(ready, unit_free[taken[0]])
        else:
            candidates: Sequence[int] = allowed.get(key, ())
            if not candidates or (len(candidates) < t.units and not t.cycles_by_units):
                candidates = range(len(unit_free))
            first_free = sorted(unit_free[u] for u in candidates)
            count = min(t.units, len(candidates))
            if t.cycles_by_units:
                # The spread that ends first, the fewest units on a tie.
                by_units = t.cycles_by_units
                if sharing is not None:  # its end given the bandwidth the commands before it took
                    count, placed = _spread(bookings, sharing, t, unit_free, candidates, ready, count)
                    traffic = t.traffic_by_units[count - 1]
                else:
                    count = min(range(1, count + 1), key=lambda k: (max(ready, first_free[k - 1]) + by_units[k - 1], k))
                cycles = by_units[count - 1]
            start = max(ready, first_free[count - 1])
            taken = _best_fit(unit_free, candidates, ready, count)
        several = len(taken) > 1
        main = max(taken, key=lambda u: (unit_free[u], -u)) if several else taken[0]
        if several:
            main_unit[key] = main
        # Each part is a command of its own on its unit: it starts when the unit frees (or
        # the inputs are ready), not when the command's last part can.
        begins = [max(ready, unit_free[u]) for u in taken]
        if sharing is not None:
            placed = placed or bookings.plan(sharing, begins, cycles, traffic, len(unit_free))
            bookings.book(placed)
            ends = placed.ends
        else:
            ends = [b + cycles for b in begins]
        found: tuple[int, int] | None = None
        for u, b, e in zip(taken, begins, ends):
            prev = last[u]
            if prev is not None and unit_free[u] > ready:
                link: tuple[int, int] | None = (prev, u)
            else:
                if found is None and ready:
                    found = data_setter(t, ready)
                link = found
            if u == main:
                if link is not None:
                    setter[key] = link
            else:
                part_start[(key, u)] = b
                if link is not None:
                    part_setter[(key, u)] = link
            unit_free[u] = e
            last[u] = key
        end = max(ends)
        busy[engine] += sum(ends) - sum(begins)
        parts = tuple(part_start.get((key, u), start) for u in taken) if several else ()
        placed = slots[key] = Slot(key, engine, taken[0], start, end, taken, parts, tuple(ends) if several else (),
                                   end > start + cycles)
    makespan = max((s.end for s in slots.values()), default=0)
    path, on_path = _critical_path(setter, main_unit, part_start, part_setter, slots, makespan)
    return Schedule(slots, tasks, makespan, path, busy, dict(units), on_path, bookings.peak)


def _critical_path(setter: Mapping[int, tuple[int, int]], main_unit: Mapping[int, int],
                   part_start: Mapping[tuple[int, int], int], part_setter: Mapping[tuple[int, int], tuple[int, int]],
                   slots: Mapping[int, Slot], makespan: int) -> tuple[list[int], dict[int, int]]:
    """From the command that ends last, back through what set each start: an input's producer
    (data edges first, then the latest issued) when the inputs were ready last, else the
    previous command on the unit. A command on several units is entered through the part the
    path came by. Returns the keys, first to last, and the cycles each spends on the path
    (from its part's start to the next one's start; they add up to the makespan)."""
    if not slots:
        return [], {}
    last = max(slots, key=lambda k: (slots[k].end, -k))
    node: tuple[int, int] | None = (last, main_unit.get(last, slots[last].unit))
    path: list[tuple[int, int]] = []
    while node is not None:
        path.append(node)
        node = part_setter.get(node) if node in part_start else setter.get(node[0])
    path.reverse()
    starts = [part_start.get(n, slots[n[0]].start) for n in path]
    on_path: dict[int, int] = {}
    for (key, _), begins, ends in zip(path, starts, [*starts[1:], makespan]):
        on_path[key] = on_path.get(key, 0) + ends - begins
    return [key for key, _ in path], on_path
