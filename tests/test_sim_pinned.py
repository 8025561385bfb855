"""Whole simulations pinned: making the simulator faster must not change one number it reports.

Each case runs a looped program (the schedule level's `scf.for` over token tiles and G blocks)
through the full pipeline and hashes everything the simulation returns: the report's JSON
(every command with its slot, engine, bytes, FLOPs and bound; the phases, engines, spills,
streams, roofline and critical path), the scheduled dependency graph (every node with its
attributes, every edge with its kind), the chrome trace, and, for runs with values, the outputs
bit for bit. The digests were recorded before the simulator cached per-op work across loop
iterations (runtime_sim/perf/op_trace.py) and stopped building the graph node by node, so these
tests prove those changes kept the results. A deliberate change to a cost, the plan or the
lowering changes them: rerun `python tests/test_sim_pinned.py` and paste its table. (The
merge of this speed work with the whole chip and block=auto was checked the same way: the
pre-speed and sped-up code gave the same digests; regenerated since for deliberate changes:
unused blocks skipped whole, F tiling and the contraction grid, the best-fit units, the router
split along K at decode, split-router-k; split-clusters' masked ids issued as early as the
routing makes them; a reused weight tile passed through and row tiles four blocks ahead.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tcpc
from tcpc.program import SimulationResult

QWEN3_REAL = dict(D=2048, F=768, E=128, K=8)
"""Qwen3-30B-A3B (examples/qwen3_moe.moe's header)."""


def cost_only_case(example: str, dims: dict[str, int], routing: str) -> Callable[[], SimulationResult]:
    def run() -> SimulationResult:
        return tcpc.compile_file(f"examples/{example}.moe", dims=dims).simulate(cost_only=True, routing=routing)
    return run


def values_case(example: str, dims: dict[str, int], seed: int) -> Callable[[], SimulationResult]:
    def run() -> SimulationResult:
        return tcpc.compile_file(f"examples/{example}.moe", dims=dims).simulate(seed=seed)
    return run


CASES: dict[str, Callable[[], SimulationResult]] = {
    "qwen3 real dims T=64, cost-only, skewed": cost_only_case("qwen3_moe", {**QWEN3_REAL, "T": 64}, "skewed"),
    "qwen3 T=256, cost-only, balanced": cost_only_case("qwen3_moe", {"T": 256}, "balanced"),
    "qwen3 T=200 B=8, values": values_case("qwen3_moe", {"T": 200, "B": 8}, 1),
    "deepseek_v3 T=48, values": values_case("deepseek_v3", {"T": 48}, 2),
    "gpt_oss_mxfp4 T=40, values": values_case("gpt_oss_mxfp4", {"T": 40}, 3),
}


def _hash(value: Any) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def digests(result: SimulationResult) -> tuple[int, int, str, str, str, str]:
    """(total cycles, commands, report JSON, graph, chrome trace, outputs) hashed."""
    report = result.report
    json = {k: v for k, v in report.to_json().items() if k != "machine_file"}  # not where the repo is
    graph = (sorted((n, sorted(a.items())) for n, a in result.graph.nodes(data=True)),
             sorted((u, v, sorted(a.items())) for u, v, a in result.graph.edges(data=True)))
    outputs = [(o.dtype.str, o.shape, hashlib.sha256(np.ascontiguousarray(o).tobytes()).hexdigest())
               for o in result.outputs]
    return (report.total_cycles, len(report.ops), _hash(json), _hash(graph), _hash(report.chrome_trace()),
            _hash(outputs))


PINNED: dict[str, tuple[int, int, str, str, str, str]] = {
    'qwen3 real dims T=64, cost-only, skewed': (737248, 6572, '427902872844669a', '09d7ed332de231cd', 'fd1f7bf9a6ee9601', '4f53cda18c2baa0c'),
    'qwen3 T=256, cost-only, balanced': (59378, 6084, 'b5acea5f80d4b8f5', '6b4e99b53a995bc1', '0633266a769e158d', '4f53cda18c2baa0c'),
    'qwen3 T=200 B=8, values': (26486, 2619, '05ec55824e56ac39', 'dda1fae1aa8c5f7f', '9e79967c017ae13f', 'ab6ace93d3c51875'),
    'deepseek_v3 T=48, values': (16903, 1439, '78341e4b110f89c2', '86a1c9d59742ac83', '10ae5733ae3798c2', '82a5f6f1023632f3'),
    'gpt_oss_mxfp4 T=40, values': (23455, 2725, '46c362aca2565a50', 'd48092e00de9b20d', 'aede27ea419b9b5e', '778cfe00474e8a2b'),
}


@pytest.mark.parametrize("name", CASES)
def test_the_simulation_is_the_pinned_simulation(name: str) -> None:
    assert digests(CASES[name]()) == PINNED[name]


if __name__ == "__main__":
    for name, case in CASES.items():
        print(f"    {name!r}: {digests(case())!r},")
