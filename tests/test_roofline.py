"""The report's roofline counts the layer's useful work, the graph's contractions on the routed
pairs (runtime_sim/perf/graph_work.py), and shows the padding rows' FLOPs and HBM bytes apart."""

from __future__ import annotations

import pytest

import tcpc
from runtime_sim.perf.cost_model import flop_cycles
from tcpc.mesh_run import MeshSpec, simulate_on_mesh
from tcpc.program import load_ir, print_ir
from tests.test_mesh import CAPACITY_LAYER



def test_full_blocks_stored_by_both_clusters_are_no_padding() -> None:
    """Qwen3-MoE at T 256, B 4, balanced: 1,024 pairs fill 256 of 268 blocks exactly. Each
    cluster stores the blocks it ran into the whole [268, 4, D] buffer (one command each, fewer
    bytes than the buffer): none of those rows is padding (the buffer's share, 48 of 1,072 rows,
    counted 5,868 bytes)."""
    report = tcpc.compile_file("examples/qwen3_moe.moe", dims={"T": 256, "B": 4}).simulate(
        cost_only=True, routing="balanced").report
    assert report.roofline.padding.flops == 0 and report.roofline.padding.hbm_bytes == 0

def test_the_roofline_does_not_grow_with_the_block() -> None:
    """Mixtral at its default dims (T 16, D 64, F 128, E 8, K 2), balanced: 4 pairs per expert."""
    t, d, f, e, k = 16, 64, 128, 8, 2
    small, large = (tcpc.compile_file("examples/mixtral.moe", dims={"B": b}).simulate(cost_only=True).report
                    for b in (4, 16))
    useful = 2 * t * k * 3 * d * f + 2 * t * d * e  # three grouped matmuls per pair, the router
    assert small.roofline.flops == large.roofline.flops == useful
    assert small.roofline.hbm_bytes == large.roofline.hbm_bytes
    assert small.roofline.padding.flops == 0 and small.roofline.padding.hbm_bytes == 0
    # B 16: one block per expert, 12 padding rows each; G <= E, so each block stores only its
    # pairs' rows (schedule-experts' row stores): no padding row moves to HBM
    rows = e * (16 - t * k // e)
    assert large.roofline.padding.flops == rows * 3 * 2 * d * f
    assert large.roofline.padding.hbm_bytes == 0
    assert large.roofline.padding.contraction_flops == useful + rows * 3 * 2 * d * f
    assert f"padding: {rows * 6 * d * f:,} FLOPs (74.8% of the contraction work), 0 HBM bytes" \
        in large.to_text(max_ops=0)
    assert large.to_json()["roofline"]["padding"] == {
        "flops": rows * 6 * d * f, "hbm_bytes": 0, "contraction_flops": useful + rows * 6 * d * f,
        "share": large.roofline.padding.share}


@pytest.mark.parametrize("example", ["gpt_oss_mxfp4", "deepseek_v3_fp8", "llama4"])
def test_at_block_1_the_commands_do_exactly_the_graphs_work(example: str) -> None:
    """B 1 has no padding rows: biases, fp8 and MXFP4 experts, shared experts and group routing
    are counted as the lowered commands do them, to the FLOP."""
    report = tcpc.compile_file(f"examples/{example}.moe", dims={"B": 1, "T": 4}).simulate(
        cost_only=True, routing="skewed").report
    r = report.roofline
    assert r.padding.flops == 0 and r.padding.hbm_bytes == 0
    assert r.flops == r.padding.contraction_flops
    # the fp8 and MXFP4 experts' FLOPs at the fp8 peak, bf16's at bf16's
    at_bf16 = flop_cycles(report.machine, r.flops) / report.machine.clusters
    assert r.flop_cycles < at_bf16 if example != "llama4" else r.flop_cycles == at_bf16


def test_a_mesh_chips_useful_work_adds_up_to_one_chips() -> None:
    """With a capacity: each chip counts the pairs it kept for its experts."""
    program = tcpc.compile_source(CAPACITY_LAYER)
    one = program.simulate(seed=2).report.roofline
    chips = simulate_on_mesh(program, MeshSpec.parse("ep=2"), seed=2).report.chips
    assert sum(c.roofline.flops for c in chips) == one.flops
    assert all(c.roofline.padding is not None for c in chips)


def test_ir_below_the_graph_level_counts_every_flop() -> None:
    program = tcpc.compile_file("examples/toy.moe")
    lowered = load_ir(print_ir(program.lower()), "toy.mlir")
    report = lowered.simulate(seed=1).report
    assert report.roofline.padding is None
    assert report.roofline.flops == sum(o.flops for o in report.ops)
    assert report.to_json()["roofline"]["padding"] is None
    assert "padding: not known" in report.to_text(max_ops=0)
