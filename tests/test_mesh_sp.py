"""The sp axis (seed 001's mesh: tokens sharded over a row's chips, all-gathered before the
expert all-to-all over the column, reduce-scattered back), and chips of one trace costed once."""

from __future__ import annotations

import math

import numpy as np
import pytest

import tcpc
from runtime_sim.semantics.ccl_semantics import a2a_plan
from tcpc.cli import main
from tcpc.mesh_run import MeshSpec, check_on_mesh, simulate_on_mesh

TINY = {"T": 64, "D": 8, "F": 16, "E": 32, "K": 2}
"""examples/toy.moe with 32 experts: one a chip on a 4 x 8 mesh, two tokens a chip."""


@pytest.mark.parametrize("spec", ["ep=4,sp=8", "ep=2,sp=4,strategy=a2a_sum,chunks=2", "dp=2,ep=2,sp=2",
                                  "ep=4,sp=8,sp_sum=bf16", "ep=2,sp=4,strategy=a2a_sum,sp_sum=bf16"])
def test_sp_layout_agrees_with_one_chip(spec: str) -> None:
    """The seed's 4 x 8 mesh (32 chips) against the single-chip reference: the columns' parts
    are added in f32 and rounded once, within --check's tolerance (bit-identical here); with
    sp_sum=bf16 each column's part is rounded first (a2a_sum's tolerance)."""
    program = tcpc.compile_file("examples/toy.moe", dims=TINY)
    parsed = MeshSpec.parse(spec)
    sim = simulate_on_mesh(program, parsed, seed=3)
    results = check_on_mesh(program, parsed, sim, seed=3)
    assert all(c.ok for c in results), [c.message for c in results]
    assert len(sim.report.chips) == parsed.mesh.chips
    ops = {x.op for x in sim.report.links}
    assert {"ccl.all_gather", "ccl.reduce_scatter"} <= ops


def test_bf16_sp_sum_halves_the_reduce_scatter_and_needs_its_tolerance() -> None:
    """sp_sum=bf16 sends each column's sum in bf16: the reduce-scatter moves half the f32 run's
    bytes, the outputs are not the f32 run's bits (one more rounding of a token's parts) and
    only RECEIVER_SUM_SCALE's allowance takes them."""
    from runtime_sim.semantics.tolerance import compare_outputs

    program = tcpc.compile_file("examples/toy.moe", dims=TINY)
    runs = {}
    for sp_sum in ("f32", "bf16"):
        spec = MeshSpec.parse(f"ep=4,sp=8,sp_sum={sp_sum}")
        sim = simulate_on_mesh(program, spec, seed=3)
        assert all(c.ok for c in check_on_mesh(program, spec, sim, seed=3))
        moved = {x.sent_bytes for x in sim.report.links if x.op == "ccl.reduce_scatter"}
        runs[sp_sum] = (sim.outputs, moved)
    (f32_out, f32_bytes), (bf16_out, bf16_bytes) = runs["f32"], runs["bf16"]
    assert len(f32_bytes) == 1 and bf16_bytes == {next(iter(f32_bytes)) // 2}
    assert not np.array_equal(f32_out[0], bf16_out[0])
    assert not all(c.ok for c in compare_outputs(bf16_out, f32_out, None))


def test_sp_chips_hold_their_own_tokens_and_experts() -> None:
    """Chip (ep i, sp j) holds token shard i * sp + j and experts [(j * ep + i) * E/(ep sp), ...):
    a column's chips hold E / sp consecutive experts, its all-to-all's group."""
    mesh = MeshSpec.parse("dp=2,ep=2,sp=4").mesh
    assert mesh.token_shards == 16 and mesh.expert_shards == 8
    assert [mesh.token_shard(c) for c in range(mesh.chips)] == list(range(16))
    assert [mesh.expert_shard(c) for c in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]
    assert mesh.group(5, "sp") == [4, 5, 6, 7] and mesh.group(5, "ep") == [1, 5]


def test_plan_takes_minus_one_as_no_pair() -> None:
    rows, slot_experts, counts = a2a_plan(np.array([[0, -1], [-1, 3]]), 2, 4, 2)
    assert rows.tolist() == [[0, -1], [-1, 2]] and counts.tolist() == [1, 1]
    assert slot_experts.tolist() == [[1, 0], [2, 0]]


def test_chips_of_one_trace_are_costed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chips whose traces are the same are planned, scheduled and reported once: the same
    report, every chip's cycles included, as costing each chip on its own."""
    import runtime_sim.perf.mesh_simulate as mesh_simulate

    program = tcpc.compile_file("examples/toy.moe", dims={**TINY, "T": 32, "E": 8})

    def report(spec: str) -> dict:
        return simulate_on_mesh(program, MeshSpec.parse(spec), cost_only=True, routing="balanced",
                                seed=1).report.to_json()

    shared = {spec: report(spec) for spec in ("ep=2,sp=4", "ep=8")}
    classes = mesh_simulate.trace_classes
    seen: list[list[int]] = []

    def each_chip_alone(traces: list) -> list[int]:
        seen.append(classes(traces))
        return list(range(len(traces)))

    monkeypatch.setattr(mesh_simulate, "trace_classes", each_chip_alone)
    for spec, once in shared.items():
        assert report(spec) == once
    assert all(len(set(c)) < len(c) for c in seen)  # chips did share a trace


def test_a_trace_differing_in_one_field_is_a_class_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """`trace_classes` tells chips apart by every field of every command (the IR op by
    identity) and by the routings' loads: one changed field splits a chip from its class."""
    import copy
    import dataclasses

    import runtime_sim.perf.mesh_simulate as mesh_simulate

    program = tcpc.compile_file("examples/toy.moe", dims={**TINY, "T": 32, "E": 8})
    seen: list[list] = []
    classes = mesh_simulate.trace_classes

    def keep(traces: list) -> list[int]:
        seen.append(list(traces))
        return classes(traces)

    monkeypatch.setattr(mesh_simulate, "trace_classes", keep)
    simulate_on_mesh(program, MeshSpec.parse("ep=8"), cost_only=True, routing="balanced", seed=1)
    trace = seen[0][0]
    last = len(trace.ops) - 1
    variants = []
    for change in ({"cluster": 1 - trace.ops[last].cluster}, {"deps": (*trace.ops[last].deps, 0)},
                   {"op": None}, {"label": trace.ops[last].label + "'"}):
        other = copy.copy(trace)
        other.ops = [*trace.ops[:last], dataclasses.replace(trace.ops[last], **change)]
        variants.append(other)
    same = copy.copy(trace)
    same.ops = [dataclasses.replace(o) for o in trace.ops]
    assert mesh_simulate.same_trace(trace, same)
    assert classes([trace, same, *variants, same]) == [0, 0, 2, 3, 4, 5, 0]


def test_sp_errors_are_clear(capsys: pytest.CaptureFixture[str]) -> None:
    for spec, message in [
        ("ep=2,sp=3", "T = 16 tokens do not divide over dp * ep * sp = 6 chips"),
        ("ep=4,sp=8", "E = 12 experts do not divide over ep * sp = 32 chips"),
        ("ep=2,sp=2,strategy=allgather", "sp = 2 gathers the tokens for an all-to-all over ep: it takes strategy "
                                         "a2a or a2a_sum without tp"),
        ("ep=2,sp=2,tp=2", "without tp (got strategy=a2a, tp=2)"),
        ("ep=2,sp=0", "sp must be positive, got 0"),
        ("ep=2,sp_sum=bf16", "sp_sum = bf16 rounds the columns' sums of sp's reduce-scatter: it needs sp > 1"),
        ("ep=2,sp=2,sp_sum=f16", "unknown sp_sum 'f16' (expected f32, bf16)"),
    ]:
        assert main(["run", "examples/toy.moe", "--set", "T=16", "--set", "E=12", "--mesh", spec]) == 1, spec
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    assert main(["run", "examples/toy.moe", "--set", "T=12", "--mesh", "ep=2,sp=2,chunks=2"]) == 1
    assert "T / (dp * ep * sp) = 3 tokens per chip do not divide into 2 chunks" in capsys.readouterr().err


def test_benchmark_link_bound_adds_the_sp_collectives() -> None:
    """ep=2, sp=2, E = 8 (column 0: experts 0-3, chips (0, 0) and (1, 0); column 1: 4-7), one
    token a chip: in each column every chip sends one of its row's tokens to the other row and
    receives one (2 rows each way with the results), and the all-gather and the reduce-scatter
    move one row each way each."""
    from benchmark_scripts import load_script
    from target.mesh_machine import load_mesh_machine

    bench = load_script("mesh")
    machine = load_mesh_machine()
    choices = np.array([[0, 4], [2, 6], [1, 5], [3, 7]], dtype=np.int32)
    assert bench.sp_link_bound_cycles(choices, 2, 2, 8, 30, machine) == (2 + 2) * 30 / machine.link_bytes_per_cycle


def test_benchmark_sp_row_stays_above_its_bound() -> None:
    from benchmark_scripts import load_script

    bench = load_script("mesh")
    tiny = dict(D=16, F=32, E=8, K=2)
    row = bench.mesh_row(bench.MODELS[1], 4, 4, "a2a", "balanced", dims=tiny, block=2, sp=2, search=False)
    assert row.total_cycles >= row.bound > 0 and row.link_bound > 0 and row.cpu_seconds > 0
    assert "| 4 | ep=2,sp=2 | 4 | a2a | balanced |" in bench.table([row], cpu=True)


def test_benchmark_seed_row_keeps_the_chunk_count_of_fewest_cycles() -> None:
    """A seed prefill row simulates each of its chunk counts (its block the pairs an expert
    receives in a chunk) and keeps the fewest cycles: its chunks, B and simulated time."""
    from benchmark_scripts import load_script

    bench = load_script("mesh")
    tiny = dict(D=16, F=32, E=8, K=2)
    row = bench.mesh_row(bench.MODELS[1], 4, 4, "a2a", "balanced", dims=tiny, block=2, sp=2, search=False,
                         sp_sum="bf16", chunk_counts=(1, 2))
    counts = dict(row.chunks_tried)
    assert sorted(counts) == [1, 2] and row.chunks == min(counts, key=counts.__getitem__)
    assert row.chunks not in row.chunks_bounded and all(counts[c] >= row.total_cycles for c in row.chunks_bounded)
    assert row.total_cycles == counts[row.chunks] and row.block == 2 // row.chunks
    assert "ep=2,sp=2,sp_sum=bf16, T = 4 per chip, a2a: 1: " in bench.tried_chunks([row])


def test_sp_chunks_pipeline_cycles() -> None:
    """DeepSeek-V3's layer (D = 7168, 32 experts of F = 512) on ep=4,sp=4, 128 tokens a chip,
    a2a_sum, sp_sum=bf16: two chunks in shard_experts._sp_order's order (each chunk's
    all-gather one chunk ahead, its reduce-scatter right after its return) take fewer cycles
    than one. (Here the order without sp, `_order`, would take 846,925: on seed 001's ep=16,sp=8
    mesh at 128 tokens a chip it took 2,380.9 us against _sp_order's 2,102.8.)"""
    dims = {"T": 2048, "D": 7168, "F": 512, "FS": 512, "E": 32, "K": 8, "NG": 8, "TG": 4, "B": 64}
    program = tcpc.compile_file("examples/deepseek_v3.moe", dims=dims)

    def cycles(chunks: int) -> int:
        spec = MeshSpec.parse(f"ep=4,sp=4,strategy=a2a_sum,sp_sum=bf16,chunks={chunks}")
        return simulate_on_mesh(program, spec, cost_only=True).report.total_cycles

    assert cycles(1) == 975_215
    assert cycles(2) == 855_127


def test_sp_decode_cycles() -> None:
    """DeepSeek-V3's layer (D = 7168, 32 experts of F = 512, FS = 1024) on ep=4,sp=4 at 4 tokens a
    chip, a2a_sum, sp_sum=bf16: sp's collectives go direct (one step each: shard-experts'
    `_Layer.sp_direct`) and the shared expert's down projections load after the reduce-scatter
    (interleave-shared), under the combine's link steps. Before both: 99,928 cycles; 79,261 with
    the ring. (The expert ids' all-gather before the tokens', with direct: 75,152.)"""
    dims = {"T": 64, "D": 7168, "F": 512, "FS": 1024, "E": 32, "K": 8, "NG": 8, "TG": 4, "B": 16}
    program = tcpc.compile_file("examples/deepseek_v3.moe", dims=dims)
    spec = MeshSpec.parse("ep=4,sp=4,strategy=a2a_sum,sp_sum=bf16")
    assert simulate_on_mesh(program, spec, cost_only=True).report.total_cycles == 74_706


@pytest.mark.parametrize("direct", [False, True])
def test_direct_gather_and_scatter_take_one_step(direct: bool) -> None:
    """sp's all-gather of a decode step's tokens (4 a chip of DeepSeek-V3, 57 KB) and its
    reduce-scatter over 8 chips: the ring's 7 steps pay 7 latencies, `direct` (one step, a share to
    each other chip) one, for the same bytes each way."""
    from xdsl.dialects.builtin import TensorType, bf16
    from xdsl.utils.test_value import create_ssa_value

    from dialects import ccl
    from runtime_sim.perf.ccl_cost import link_parts, received_bytes, traffic
    from target.mesh_machine import load_mesh_machine

    machine = load_mesh_machine()
    share = 4 * 7168 * 2
    for op, rows in ((ccl.AllGatherOp(create_ssa_value(TensorType(bf16, [4, 7168])), "sp", 8, direct=direct), 4),
                     (ccl.ReduceScatterOp(create_ssa_value(TensorType(bf16, [32, 7168])), "sp", 8, direct=direct), 32)):
        group = [traffic(op, (np.zeros((rows, 7168), dtype=np.uint16),), 8, me) for me in range(8)]
        assert sum(group[0].sent) == received_bytes(group, 0) == 7 * share
        assert link_parts(machine, group, 0) == ((1 if direct else 7) * 2000, math.ceil(7 * share / 30))
