"""The mesh's cost-model search (tcpc.mesh_run.compile_for_mesh): a candidate whose chips'
roofline passes the fewest cycles found stops there, and the search still makes the choice
and reports the cycles that simulating every candidate whole gives."""

from __future__ import annotations

import json
import math
import threading

import pytest

import tcpc
from passes.lowering.lower_topk import STRATEGIES as TOPK_STRATEGIES
from runtime_sim.perf.mesh_simulate import AboveBound
from tcpc import autotune, mesh_run
from tcpc.mesh_run import MeshSpec, compile_for_mesh, simulate_on_mesh

SMALL = dict(T=64, D=512, F=1024, E=8, K=2)
"""Mixtral's layer on 2 chips at 32 tokens each: 4 and 8 chunks load every expert's weights per
chunk, so their roofline passes one chunk's cycles."""


def test_a_bound_stops_the_mesh_run_above_it() -> None:
    """Below its chips' roofline, every chip stops once one chip's roofline passes the bound,
    and the run lists the bound's next cycle (every run alike, at most the run's cycles); at
    the run's cycles, the run is the unbounded one."""
    program = tcpc.compile_file("examples/mixtral.moe", dims={**SMALL, "B": 16})
    spec = MeshSpec.parse("ep=2")
    full = simulate_on_mesh(program, spec, cost_only=True).report
    below = min(r.roofline.cycles for r in full.chips) / 2
    threads = threading.active_count()
    for _ in range(3):  # the same every run, whichever chip's thread passed the bound first
        with pytest.raises(AboveBound) as stopped:
            simulate_on_mesh(program, spec, cost_only=True, bound_above=below)
        assert stopped.value.cycles == math.floor(below) + 1 <= full.total_cycles
    assert threading.active_count() == threads  # no chip left waiting at a collective
    at = simulate_on_mesh(program, spec, cost_only=True, bound_above=full.total_cycles).report
    assert json.dumps(at.to_json(), default=str) == json.dumps(full.to_json(), default=str)


DECODE = dict(T=32, D=512, F=256, E=16, K=4, B=4)
"""Qwen3-30B-A3B's layer on 2 chips at 16 tokens each, a decode step: its chunks' collectives
and expert loops wait on one another (2 chunks: 35,100 cycles, 1 chunk: 21,078)."""


def test_a_chunked_decode_stops_on_its_chips_longest_path() -> None:
    """A decode step in 2 chunks stops below one chunk's cycles although its chips' roofline
    is below them: its commands' longest path (a collective at least its own link time, a
    tensor unit and the link running their commands in issue order) passes them."""
    program = tcpc.compile_file("examples/qwen3_moe.moe", dims=DECODE)
    one = simulate_on_mesh(program, MeshSpec.parse("ep=2"), cost_only=True).report.total_cycles
    two = simulate_on_mesh(program, MeshSpec.parse("ep=2,chunks=2"), cost_only=True).report
    assert max(r.roofline.cycles for r in two.chips) < one < two.total_cycles
    with pytest.raises(AboveBound) as stopped:
        simulate_on_mesh(program, MeshSpec.parse("ep=2,chunks=2"), cost_only=True, bound_above=one)
    assert stopped.value.cycles == one + 1 <= two.total_cycles


def test_bounded_chunk_counts_change_no_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """chunks=auto with the bound makes the choice of every count simulated whole, at the same
    cycles; the counts it bounded are listed with a bound above the chosen count's cycles and
    at most their own."""
    unbounded = mesh_run.simulate_on_mesh

    def search(bound: bool) -> tcpc.Program:
        monkeypatch.setattr(autotune, "_costs", {})  # nothing remembered from the other search
        if not bound:
            monkeypatch.setattr(mesh_run, "simulate_on_mesh",
                                lambda *a, bound_above=math.inf, **k: unbounded(*a, **k))
        return compile_for_mesh("examples/mixtral.moe", {**SMALL, "B": 16}, MeshSpec.parse("ep=2,chunks=auto"))

    chose, whole = search(True).choices[-1], search(False).choices[-1]
    assert chose.what == whole.what == "chunk count" and chose.chosen == whole.chosen
    fewest = dict(whole.alternatives)[whole.chosen]
    assert dict(chose.alternatives)[chose.chosen] == fewest
    assert chose.bounded and not whole.bounded
    for (count, cycles), (_, simulated) in zip(chose.alternatives, whole.alternatives):
        assert fewest < cycles <= simulated if count in chose.bounded else cycles == simulated


def test_the_run_takes_the_searchs_simulation_of_its_program(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the block search, topk=auto's run of the default strategy is the search's
    simulation of the chosen block (only the other strategy is simulated), and reports what
    simulating it again reports."""
    from runtime_sim.perf import mesh_simulate

    monkeypatch.setattr(autotune, "_costs", {})  # the search simulates, not remembers
    spec = MeshSpec.parse("ep=2,topk=auto")
    program = compile_for_mesh("examples/mixtral.moe", {"T": 8, "D": 512, "F": 1024, "E": 8, "K": 2, "B": "auto"}, spec)
    simulated = []
    original = mesh_simulate.simulate_mesh
    monkeypatch.setattr(mesh_simulate, "simulate_mesh", lambda *a, **k: simulated.append(1) or original(*a, **k))
    run = simulate_on_mesh(program, spec, cost_only=True)
    assert len(simulated) == len(TOPK_STRATEGIES) - 1 and not mesh_run._kept
    again = simulate_on_mesh(program, spec, cost_only=True)
    assert len(simulated) == 2 * len(TOPK_STRATEGIES) - 1
    assert json.dumps(run.report.to_json(), default=str) == json.dumps(again.report.to_json(), default=str)
