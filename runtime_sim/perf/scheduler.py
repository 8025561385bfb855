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

The dependency graph is a networkx DiGraph over command keys with `kind="data"` edges
(producer -> consumer), `kind="memory"` edges (a command reusing SRAM space waits for the
space's last reader) and `kind="engine"` edges (previous command on the same unit -> next).
Every start equals the end of one of its inputs' producers, or the end of the previous part on
one of its units (or 0), so the makespan is the length of a path through that graph: the
critical path, found by walking back from the last command through the command that set each
start (recorded as it is placed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

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
    scheduler may spread over fewer engines than `units` (module docstring); empty: `units` only."""


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


@dataclass
class Schedule:
    slots: dict[int, Slot]
    tasks: Sequence[Task]
    preds: dict[int, dict[int, str]]
    """Key -> the keys it waits for, each with its edge's kind (the first found), in the order found."""
    makespan: int
    critical_path: list[int]
    busy: dict[str, int]
    """Engine -> cycles its units were busy, summed over units (a command on n units counts n times)."""
    units: dict[str, int | None]
    critical_cycles: dict[int, int] = field(default_factory=dict)
    """Key of a command on the critical path -> the cycles it spends there (its part's, from
    when it started to when the next command on the path did; they add up to the makespan)."""

    def utilisation(self, engine: str) -> float:
        """Busy cycles over (makespan x units); 0 for an empty schedule or unlimited engine."""
        n = self.units.get(engine)
        if not n or not self.makespan:
            return 0.0
        return self.busy.get(engine, 0) / (self.makespan * n)

    @cached_property
    def graph(self) -> nx.DiGraph:
        """The dependency graph (module docstring), built when first asked for: a long program
        has millions of edges, and a simulation needs none of them."""
        graph = nx.DiGraph()
        slots = self.slots
        graph.add_nodes_from(
            (t.key, {"label": t.label, "engine": t.engine, "cycles": t.cycles, "unit": (s := slots[t.key]).unit,
                     "units": s.units, "start": s.start, "end": s.end})
            for t in self.tasks)
        graph.add_edges_from((u, v, {"kind": kind}) for v, into in self.preds.items() for u, kind in into.items())
        return graph


def schedule(tasks: Sequence[Task], units: Mapping[str, int | None], pinned: Mapping[int, int] | None = None,
             allowed: Mapping[int, tuple[int, ...]] | None = None) -> Schedule:
    """Place `tasks` (in issue order) on the engines; `units` gives each engine's unit count;
    `pinned` maps a task's key to the one unit it must run on (a tensor command to its cluster;
    modulo the engine's units, so a program split over more clusters than the machine has
    shares them); `allowed` maps a task's key to the units it may take (a DMA command on its
    cluster's own engines): fewer than its `units` only if it may be spread over fewer."""
    pinned = pinned or {}
    allowed = allowed or {}
    free: dict[str, list[int]] = {e: [0] * n for e, n in units.items() if n}
    last_on_unit: dict[tuple[str, int], int] = {}
    slots: dict[int, Slot] = {}
    preds: dict[int, dict[int, str]] = {}
    busy: dict[str, int] = {e: 0 for e in units}
    setter: dict[int, tuple[int, int]] = {}
    """Key -> (the command, its unit) whose end set its start (none for a start at 0); for a
    command on several units, the start of its part on `main_unit`, the one that started last."""
    main_unit: dict[int, int] = {}
    part_start: dict[tuple[int, int], int] = {}
    part_setter: dict[tuple[int, int], tuple[int, int]] = {}
    """(key, unit) -> as `setter`, for the other parts of a command on several units."""

    def at_end_of(d: int) -> tuple[int, int]:
        return d, main_unit.get(d, slots[d].unit)
    for t in tasks:
        if t.engine not in units:
            raise ValueError(f"{t.label}: unknown engine '{t.engine}' (engines: {', '.join(units)})")
        if t.cycles < 0:
            raise ValueError(f"{t.label}: negative cycles {t.cycles}")
        into: dict[int, str] = {}
        ready = 0
        for kind, keys in (("data", t.deps), ("memory", t.after)):
            for d in keys:
                slot = slots.get(d)
                if slot is None:
                    raise ValueError(f"{t.label}: depends on {d}, which is not scheduled before it")
                into.setdefault(d, kind)
                if slot.end > ready:
                    ready = slot.end
        taken: tuple[int, ...] = (0,)
        start = ready
        cycles = t.cycles
        data_setter: tuple[int, int] | None = None
        unit_free = free.get(t.engine)
        if unit_free is not None:
            if not 1 <= t.units <= len(unit_free):
                raise ValueError(f"{t.label}: needs {t.units} units of '{t.engine}', which has {len(unit_free)}")
            if t.key in pinned and t.units == 1:
                taken = (pinned[t.key] % len(unit_free),)
                start = max(ready, unit_free[taken[0]])
            else:
                candidates: Sequence[int] = allowed.get(t.key, ())
                if not candidates or (len(candidates) < t.units and not t.cycles_by_units):
                    candidates = range(len(unit_free))
                first_free = sorted(unit_free[u] for u in candidates)
                count = min(t.units, len(candidates))
                start = max(ready, first_free[count - 1])
                if t.cycles_by_units:
                    # The spread that ends first, the fewest units on a tie.
                    by_units = t.cycles_by_units
                    count = min(range(1, count + 1), key=lambda k: (max(ready, first_free[k - 1]) + by_units[k - 1], k))
                    start = max(ready, first_free[count - 1])
                    cycles = by_units[count - 1]
                fits = sorted((u for u in candidates if unit_free[u] <= start), key=lambda u: (-unit_free[u], u))
                taken = tuple(sorted(fits[:count]))
        if ready:
            binding = [d for d in into if slots[d].end == ready]
            data_setter = at_end_of(max(binding, key=lambda d: (into[d] == "data", d)))
        if unit_free is not None:
            main = max(taken, key=lambda u: (unit_free[u], -u))
            if len(taken) > 1:
                main_unit[t.key] = main
            for u in taken:
                prev = last_on_unit.get((t.engine, u))
                if prev is not None:
                    into.setdefault(prev, "engine")
                # Each part is a command of its own on its unit: it starts when the unit frees
                # (or the inputs are ready), not when the command's last part can.
                begins = max(ready, unit_free[u])
                link = (prev, u) if prev is not None and unit_free[u] > ready else data_setter
                if u == main:
                    if link is not None:
                        setter[t.key] = link
                else:
                    part_start[(t.key, u)] = begins
                    if link is not None:
                        part_setter[(t.key, u)] = link
                unit_free[u] = begins + cycles
                last_on_unit[(t.engine, u)] = t.key
        elif data_setter is not None:
            setter[t.key] = data_setter
        preds[t.key] = into
        parts = tuple(part_start.get((t.key, u), start) for u in taken) if len(taken) > 1 else ()
        slots[t.key] = Slot(t.key, t.engine, taken[0], start, start + cycles, taken, parts)
        busy[t.engine] += cycles * len(taken)
    makespan = max((s.end for s in slots.values()), default=0)
    path, on_path = _critical_path(setter, main_unit, part_start, part_setter, slots, makespan)
    return Schedule(slots, tasks, preds, makespan, path, busy, dict(units), on_path)


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
