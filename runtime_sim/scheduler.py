"""List scheduling of costed commands onto engines that run concurrently.

Policy (DESIGN section 6): commands are issued in program order (the order the interpreter ran
them, which is the order the compiler chose). A command starts when every command producing
one of its inputs has finished and a unit of its engine is free; it takes the unit of its
engine that frees first (lowest index on ties), so a unit runs its commands in order and
never back-fills. Engines with `None` units (zero-cost ops) never wait for a unit.

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


@dataclass(frozen=True)
class Slot:
    key: int
    engine: str
    unit: int
    start: int
    end: int


@dataclass
class Schedule:
    slots: dict[int, Slot]
    graph: nx.DiGraph
    makespan: int
    critical_path: list[int]
    busy: dict[str, int]
    """Engine -> cycles its units were busy, summed over units."""
    units: dict[str, int | None]

    def utilisation(self, engine: str) -> float:
        """Busy cycles over (makespan x units); 0 for an empty schedule or unlimited engine."""
        n = self.units.get(engine)
        if not n or not self.makespan:
            return 0.0
        return self.busy.get(engine, 0) / (self.makespan * n)


def schedule(tasks: Sequence[Task], units: Mapping[str, int | None]) -> Schedule:
    """Place `tasks` (in issue order) on the engines; `units` gives each engine's unit count."""
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
        unit = 0
        start = ready
        if t.engine in free:
            unit_free = free[t.engine]
            unit = min(range(len(unit_free)), key=lambda u: (unit_free[u], u))
            start = max(ready, unit_free[unit])
            unit_free[unit] = start + t.cycles
            prev = last_on_unit.get((t.engine, unit))
            if prev is not None and not graph.has_edge(prev, t.key):
                graph.add_edge(prev, t.key, kind="engine")
            last_on_unit[(t.engine, unit)] = t.key
        slots[t.key] = Slot(t.key, t.engine, unit, start, start + t.cycles)
        nx.set_node_attributes(graph, {t.key: {"unit": unit, "start": start, "end": start + t.cycles}})
        busy[t.engine] += t.cycles
    makespan = max((s.end for s in slots.values()), default=0)
    return Schedule(slots, graph, makespan, _critical_path(graph, slots), busy, dict(units))


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
