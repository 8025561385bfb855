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
routing makes them; a reused weight tile passed through and row tiles four blocks ahead; each
part's start of a command on several DMA engines in the JSON, `part_starts`; the trace's track
per unit of every engine, each part drawn at its own start; the roofline's useful FLOPs and its
padding, report JSON only; the layer's output stored to HBM, one command more, 520 to
1,524 cycles more; each cluster's peak SRAM, report JSON only; each command's source
locations, creating passes and dependencies, and the cycles by source line, report JSON and
trace (with flows) only: without them the digests were the earlier ones; a quantize's two
streams each widening x in its own chain, the f8 cast in the chain's Cast stage: gpt_oss_mxfp4
24,332 -> 22,385 cycles, the same output bits; block scales gathered ahead are gathered by
each cluster for its own blocks rather than copied to cluster 1: gpt_oss_mxfp4 22,385 -> 22,381;
the cost model's choice of where lower-dispatch quantizes block-scaled activations, listed in
gpt_oss_mxfp4's report JSON (blocks kept: 18,626 cycles against tokens' 21,525 in the choice's
cost-only run), its cycles, graph, trace and outputs unchanged;
a group of more than four slots runs the slots after the first as a loop: the same commands at
the same cycles and the same outputs, plus two free views of the slot tables (a row per slot)
for each cluster and for the tables split-clusters copies them from: 6 rows more in the
report, graph and trace per group loop, 12 for qwen3 real dims T=64's two; one token's decode
pinned since issue #30 part 3 (its expert ids from the counts, its routing weights after them;
gpt-oss-120b's biases gathered ahead of a loop that streams its weights: gpt_oss_mxfp4 T=40
22,381 -> 21,789 cycles, the same output bits; and its MXFP4 scales, 259 KB an expert and matrix,
there too: its real dims at T=1 42,344 -> 41,853; a combine that gathers more than one DMA
piece in a tile per engine, schedule-tokens' `spread_rows`: qwen3 real dims T=64 696,526 ->
693,020; one chip's decode guessing its first weights from 4 routed pairs per expert,
split-clusters' GUESS_PAIRS_PER_EXPERT: 693,020 -> 693,038, and qwen3 T=200 B=8 and gpt_oss_mxfp4
T=40 their 8 guessed loads more, the same cycles and output bits); a trace slice of a command
on several DMA engines carries its part's share of the bytes and FLOPs, not all of them: trace
only, the two real-dims cases whose commands run on several engines; the padding's HBM bytes of
a whole-buffer store that moved only the blocks that ran (each cluster's of its own blocks)
counted among those blocks' rows, not the buffer's: report JSON only, three cases; split-clusters'
gathers of each cluster's block scales (and gpt-oss's biases) issued right before the loop,
after the dispatch's commands: gpt_oss_mxfp4 T=40 21,789 -> 21,297 cycles, the same output bits;
an f32 contraction whose operand is widened from bf16 costed on that operand's one bf16 piece (k x 3
piece pairs, target/contraction_mapping.py): deepseek_v3 T=48 12,202 -> 12,182, the same output bits;
the pinned routing read after the router's top-k (`tcp.order`) in its indices' buffer, not loaded
from HBM, and the top-k's last ops, which cost-only runs had dropped as dead, kept: qwen3 real
dims T=64 693,038 -> 692,850 (no DMA load of its 2 KB routing), qwen3 T=256
35,951 -> 35,977, qwen3 fp8 real dims T=1 31,649 -> 31,676, gpt_oss_mxfp4 real dims T=1 41,853 ->
41,889; the values cases the same cycles, graph, trace and outputs, their report JSON listing
the cost-only cycles of their choices' candidates.)
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
GPT_OSS_REAL = dict(D=2880, F=2880, E=128, K=4)
"""gpt-oss-120b (examples/gpt_oss_mxfp4.moe's header)."""


def cost_only_case(example: str, dims: dict[str, int], routing: str) -> Callable[[], SimulationResult]:
    def run() -> SimulationResult:
        return tcpc.compile_file(f"examples/{example}.moe", dims=dims).simulate(cost_only=True, routing=routing)
    return run


def values_case(example: str, dims: dict[str, int], seed: int) -> Callable[[], SimulationResult]:
    def run() -> SimulationResult:
        return tcpc.compile_file(f"examples/{example}.moe", dims=dims).simulate(seed=seed)
    return run


CASES: dict[str, Callable[[], SimulationResult]] = {  # B fixed: the block is the case's, not the cost model's
    "qwen3 real dims T=64, cost-only, skewed": cost_only_case("qwen3_moe", {**QWEN3_REAL, "T": 64, "B": 4}, "skewed"),
    "qwen3 T=256, cost-only, balanced": cost_only_case("qwen3_moe", {"T": 256, "B": 4}, "balanced"),
    "qwen3 T=200 B=8, values": values_case("qwen3_moe", {"T": 200, "B": 8}, 1),
    "deepseek_v3 T=48, values": values_case("deepseek_v3", {"T": 48, "B": 4}, 2),
    "gpt_oss_mxfp4 T=40, values": values_case("gpt_oss_mxfp4", {"T": 40, "B": 4}, 3),
    "qwen3 fp8 real dims T=1, cost-only, balanced": cost_only_case("qwen3_moe_fp8", {**QWEN3_REAL, "T": 1, "B": 1},
                                                                   "balanced"),
    "gpt_oss_mxfp4 real dims T=1, cost-only, balanced": cost_only_case("gpt_oss_mxfp4",
                                                                       {**GPT_OSS_REAL, "T": 1, "B": 1}, "balanced"),
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
    'qwen3 real dims T=64, cost-only, skewed': (692850, 5742, 'c4d4b23d49cc9e1f', '0bee2c956e14ee5a', '9a08c5f9e9af5b1e', '4f53cda18c2baa0c'),
    'qwen3 T=256, cost-only, balanced': (35977, 638, '810239889d3cd534', '656bd4ff6ff163ce', '8a26633b2c1d1e57', '4f53cda18c2baa0c'),
    'qwen3 T=200 B=8, values': (20481, 637, '7ba23bb4934d21b7', '82972133737a49b4', 'd927b4e58b72b58e', 'ab6ace93d3c51875'),
    'deepseek_v3 T=48, values': (12182, 590, 'f8d5f2b051294967', 'c647ed4cded13c41', '6b9d9b86b25c0ecb', '82a5f6f1023632f3'),
    'gpt_oss_mxfp4 T=40, values': (21297, 2553, '145dc94be217cc19', '2449c865b717994e', '2dd9b52da79578ab', '778cfe00474e8a2b'),
    'qwen3 fp8 real dims T=1, cost-only, balanced': (31676, 596, '8a31cfade9961c25', '9ca3723dd9a7d404', '50c267322726cb21', '4f53cda18c2baa0c'),
    'gpt_oss_mxfp4 real dims T=1, cost-only, balanced': (41889, 318, '4a9afd40734a465d', '200962e277ca6728', '8d9b8a81f95aff08', '4f53cda18c2baa0c'),
}


@pytest.mark.parametrize("name", CASES)
def test_the_simulation_is_the_pinned_simulation(name: str) -> None:
    assert digests(CASES[name]()) == PINNED[name]


if __name__ == "__main__":
    for name, case in CASES.items():
        print(f"    {name!r}: {digests(case())!r},")
