"""List scheduling of costed commands onto engines that run concurrently.

Policy (docs/architecture.md#the-simulator): commands issue in program order (the order the
interpreter ran them, the compiler's order). A command starts when every command producing
one of its inputs has finished and a unit of its engine is free. Units run their commands in
order and never back-fill, so which unit a command takes matters: it takes a unit that is
already free when its inputs are ready, the one freed most recently (best fit), so that a
command waiting for late inputs does not hold a unit an earlier-ready command could use;
when none is free by then, the unit that frees first (lowest index on ties). Engines with `None` units (zero-cost ops) never wait for a unit. A command
that needs several units (a large DMA command spread over several engines, `Task.units`)
takes the units that free first and starts when the last of them is free; it holds them all
until it ends (its parts run in parallel).

The dependency graph is a networkx DiGraph over command keys with `kind="data"` edges
(producer -> consumer), `kind="memory"` edges (a command reusing SRAM space waits for the
space's last reader) and `kind="engine"` edges (previous command on the same unit -> next).
Every start equals the end of one of its predecessors (or 0), so the makespan is the length of
a path through that graph: the critical path, found by walking back from the last command
through the predecessor that set each start.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import networkx as nx


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class Slot:
    key: int
    engine: str
    unit: int
    """The first of `units` (0 for engines without units)."""
    start: int
    end: int
    units: tuple[int, ...] = (0,)
    """Every unit the command occupies, ascending."""


@dataclass
class Schedule:
    slots: dict[int, Slot]
    graph: nx.DiGraph
    makespan: int
    critical_path: list[int]
    busy: dict[str, int]
    """Engine -> cycles its units were busy, summed over units (a command on n units counts n times)."""
    units: dict[str, int | None]

    def utilisation(self, engine: str) -> float:
        """Busy cycles over (makespan x units); 0 for an empty schedule or unlimited engine."""
        n = self.units.get(engine)
        if not n or not self.makespan:
            return 0.0
        return self.busy.get(engine, 0) / (self.makespan * n)


def schedule(tasks: Sequence[Task], units: Mapping[str, int | None], pinned: Mapping[int, int] | None = None) -> Schedule:
    """Place `tasks` (in issue order) on the engines; `units` gives each engine's unit count;
    `pinned` maps a task's key to the one unit it must run on (a tensor command to its cluster;
    modulo the engine's units, so a program split over more clusters than the machine has
    shares them)."""
    pinned = pinned or {}
    graph = nx.DiGraph()
    free: dict[str, list[int]] = {e: [0] * n for e, n in units.items() if n}
    last_on_unit: dict[tuple[str, int], int] = {}
    slots: dict[int, Slot] = {}
    busy: dict[str, int] = {e: 0 for e in units}
    for t in tasks:
        if t.engine not in units:
            raise ValueError(f"{t.label}: unknown engine '{t.engine}' (engines: {', '.join(units)})")
        if t.cycles < 0:
            raise ValueError(f"{t.label}: negative cycles {t.cycles}")
        graph.add_node(t.key, label=t.label, engine=t.engine, cycles=t.cycles)
        ready = 0
        for kind, keys in (("data", t.deps), ("memory", t.after)):
            for d in keys:
                if d not in slots:
                    raise ValueError(f"{t.label}: depends on {d}, which is not scheduled before it")
                if not graph.has_edge(d, t.key):
                    graph.add_edge(d, t.key, kind=kind)
                ready = max(ready, slots[d].end)
        taken: tuple[int, ...] = (0,)
        start = ready
        if t.engine in free:
            unit_free = free[t.engine]
            if not 1 <= t.units <= len(unit_free):
                raise ValueError(f"{t.label}: needs {t.units} units of '{t.engine}', which has {len(unit_free)}")
            if t.key in pinned and t.units == 1:
                taken = (pinned[t.key] % len(unit_free),)
            else:
                taken = _pick_units(unit_free, t.units, ready)
            start = max(ready, *(unit_free[u] for u in taken))
            for u in taken:
                unit_free[u] = start + t.cycles
                prev = last_on_unit.get((t.engine, u))
                if prev is not None and not graph.has_edge(prev, t.key):
                    graph.add_edge(prev, t.key, kind="engine")
                last_on_unit[(t.engine, u)] = t.key
        slots[t.key] = Slot(t.key, t.engine, taken[0], start, start + t.cycles, taken)
        nx.set_node_attributes(graph, {t.key: {"unit": taken[0], "units": taken, "start": start,
                                               "end": start + t.cycles}})
        busy[t.engine] += t.cycles * len(taken)
    makespan = max((s.end for s in slots.values()), default=0)
    return Schedule(slots, graph, makespan, _critical_path(graph, slots), busy, dict(units))


def _pick_units(unit_free: Sequence[int], n: int, ready: int) -> tuple[int, ...]:
    """The `n` units a command ready at `ready` takes: those already free by then, the most
    recently freed first (best fit: a unit that frees earlier stays for a command that is
    ready earlier), then those that free first; lowest index on ties."""
    def preference(u: int) -> tuple[bool, int, int]:
        idle = unit_free[u] <= ready
        return (not idle, -unit_free[u] if idle else unit_free[u], u)
    return tuple(sorted(sorted(range(len(unit_free)), key=preference)[:n]))


def _critical_path(graph: nx.DiGraph, slots: Mapping[int, Slot]) -> list[int]:
    if not slots:
        return []
    node = max(slots, key=lambda k: (slots[k].end, -k))
    path = [node]
    while True:
        # The predecessor that set the start; data edges first, then the latest issued.
        binding = [p for p in graph.predecessors(node) if slots[p].end == slots[node].start]
        if not binding:
            break
        node = max(binding, key=lambda p: (graph.edges[p, node]["kind"] == "data", p))
        path.append(node)
    path.reverse()
    return path
